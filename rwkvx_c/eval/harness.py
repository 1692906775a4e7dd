"""An lm-evaluation-harness model over rwkvx_c's recurrent state (extra
``eval``: ``pip install "rwkvx_c[eval]"``).

    from rwkvx_c.eval.harness import RwkvxLM, run_tasks
    lm = RwkvxLM(pretrained="runs/r7")           # or RwkvxLM(model=m, tokenizer=tok)
    results = run_tasks(lm, ["my_task"], include_path="tasks/")

Importing this module registers the model under the name ``rwkvx_c``, so
``lm_eval.simple_evaluate(model="rwkvx_c", model_args="pretrained=RUN")``
works from Python; lm-eval 0.4's command line has no plugin route for
models, which is what ``rwkvx-c eval RUN --tasks`` is for.

Each loglikelihood request is one recurrent pass: the context, then the
continuation, whose log-probabilities are read from the same pass; the
requests run together in the batched engine
(rwkvx_c.generation.score), a context shared by several read once. Texts are encoded as
lm-eval's own ``hf`` model encodes them (lm_eval.api.model.TemplateLM:
trailing context spaces move to the continuation, an empty context becomes
the prefix token), so the two models score the same tokens; a recurrent
model needs no context window, so nothing is truncated or windowed.
"""
from __future__ import annotations

import os
from typing import Any

from rwkvx_c._core import RxPtModel
from rwkvx_c.data.tokenizers import Tokenizer
from rwkvx_c.errors import EvalError
from rwkvx_c.generation import Request, Sampling, run_requests
from rwkvx_c.generation.score import score_continuations
from rwkvx_c.sample import load_run

# nothing downloads at run time: datasets and the hub stay offline unless the user says otherwise
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError:
    raise EvalError('lm-eval tasks need lm-evaluation-harness: pip install "rwkvx_c[eval]"') \
        from None

__all__ = ["RwkvxLM", "run_tasks"]

DEFAULT_MAX_GEN_TOKS = 256


@register_model("rwkvx_c")
class RwkvxLM(TemplateLM):
    """lm-eval's LM interface for an rwkvx_c model: loglikelihood,
    loglikelihood_rolling and greedy generate_until.

    pretrained: a run folder (or checkpoint), or model + tokenizer given
    directly; prefix_token_id: what an empty context and every rolling
    document start from (0, the document separator RWKV models train with)."""

    def __init__(self, pretrained: str | None = None, *, model: RxPtModel | None = None,
                 tokenizer: Tokenizer | None = None, prefix_token_id: int = 0,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, **_: Any) -> None:
        super().__init__()
        if pretrained is not None:
            model, tokenizer = load_run(str(pretrained), hold_base=True)
            model.precision = "fp32"   # as rwkvx-c eval's default (a held base stays as it is)
        if model is None or tokenizer is None:
            raise EvalError("RwkvxLM needs pretrained=RUN, or model and tokenizer")
        self.model, self.tok = model, tokenizer
        self.vocab = model.config["vocab_size"]
        if not 0 <= int(prefix_token_id) < self.vocab:
            raise EvalError(f"prefix_token_id {prefix_token_id} is outside the vocabulary")
        self._prefix = int(prefix_token_id)
        self.max_gen_toks = int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return self._prefix

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        return [int(t) for t in self.tok.encode(string)]

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens).decode("utf-8", "replace")

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """Every request at once in the batched engine (score_continuations)."""
        bar = _bar([], "loglikelihood", disable_tqdm)
        bar.reset(total=len(requests))
        out = score_continuations(self.model, [(c, d) for _, c, d in requests],
                                  progress=bar.update)
        bar.close()
        for ((ctx, cont), _, _), res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", (ctx, cont), res)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        """log p(text) from the prefix token, every token predicted once."""
        texts = [req.args[0] for req in requests]
        bar = _bar([], "loglikelihood_rolling", disable_tqdm)
        bar.reset(total=len(texts))
        out = [lp for lp, _ in score_continuations(
            self.model, [([self._prefix], self.tok_encode(t)) for t in texts],
            progress=bar.update)]
        bar.close()
        for text, lp in zip(texts, out):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), lp)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context until a stop string (gen_kwargs
        "until") or max_gen_toks tokens; the text before the first stop. The
        requests run together in the batched engine (rwkvx_c.generation)."""
        reqs = []
        for req in requests:
            ctx, kw = req.args
            kw = dict(kw or {})
            if kw.get("do_sample") and float(kw.get("temperature", 1.0)) > 0:
                raise EvalError("RwkvxLM generates greedily only (do_sample is set)")
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else [u for u in until if u]
            reqs.append(Request(self.tok_encode(ctx) or [self._prefix], 1,
                                int(kw.get("max_gen_toks", self.max_gen_toks)), until))
        bar = _bar([], "generate_until", disable_tqdm)
        bar.reset(total=sum(r.max_new_tokens or 0 for r in reqs))
        outs = run_requests(self.model, reqs, Sampling(temperature=0), self.max_gen_toks,
                            tokenizer=self.tok, progress=bar.update)
        bar.close()
        texts = [group[0].text for group in outs]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", (req.args[0], req.args[1]), text)
        return texts


def _bar(items: list[Any], desc: str, disable: bool) -> Any:
    from tqdm import tqdm
    return tqdm(items, desc=desc, disable=disable)


def run_tasks(lm: Any, tasks: list[str], include_path: str | None = None,
              num_fewshot: int | None = None, limit: float | None = None) -> dict[str, Any]:
    """lm_eval.simple_evaluate of lm on tasks: the local YAML tasks under
    include_path only (lm-eval's own catalogue is not even indexed then), or
    lm-eval's tasks whose data is already in the local Hugging Face cache;
    the results dict."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    tm = TaskManager(include_path=include_path, include_defaults=False) if include_path \
        else TaskManager()
    try:
        res = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                              task_manager=tm, bootstrap_iters=0, log_samples=False)
    except (KeyError, ValueError, FileNotFoundError) as e:
        raise EvalError(f"lm-eval could not run {', '.join(tasks)}: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if res is None:
        raise EvalError("lm-eval returned no results")
    return dict(res)
