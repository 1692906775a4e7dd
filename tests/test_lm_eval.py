"""The lm-evaluation-harness model (rwkvx_c.eval.harness) against
lm-eval's own `hf` model running rwkv7-hf on our Hugging Face export of
the same model: local YAML tasks (multiple choice, rolling loglikelihood,
greedy generation), the same scores, request by request.

Without lm-eval / transformers / rwkv7-hf these tests skip, unless
RWKVX_REQUIRE_INTEROP=1 (set by .ci/run), where that is a failure."""
import json

import numpy as np
import pytest
from test_interop import _need

from rwkvx_c.cli import main
from rwkvx_c.interop import hf
from rwkvx_c.sample import load_run

TEXT = b"def f(x):\n    return x * 2\n"
MC = [{"question": "def f(x):\n    return", "choices": [" x * 2", " y + 1", " 0"], "answer": 0},
      {"question": "def f(x", "choices": ["):", "]]", " ="], "answer": 0},
      {"question": "", "choices": ["def", "xyz", "  q"], "answer": 0},
      {"question": "return x ", "choices": ["* 2", "+ 2", "/ 7"], "answer": 1}]
DOCS = [{"text": "def f(x):\n    return x * 2\n"}, {"text": "hello world, once more"}]
GEN = [{"prompt": "def f(x):\n    return", "target": " x * 2"},
       {"prompt": "def f", "target": "(x):"}]


def _task(folder, name, data, body):
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in data))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {path}\ntest_split: test\n{body}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    _need("lm_eval", "transformers", "rwkv7_hf", "torch", "safetensors", "accelerate")
    d = tmp_path_factory.mktemp("lmeval")
    (d / "corpus.txt").write_bytes(TEXT * 300)
    assert main(["train", "--preset", "tiny", "--n-attn-layer", "0", "--steps", "6",
                 "--seq-len", "32", "--batch", "2", "--eval-tokens", "64", "--threads", "1",
                 "--warmup", "1", "--data", str(d / "corpus.txt"), "--out", str(d / "run"),
                 "--cache-dir", str(d / "cache")]) == 0
    model, tok = load_run(str(d / "run"))
    hf.save_hf(model, tok, str(d / "hf"))
    tasks = d / "tasks"
    tasks.mkdir()
    _task(tasks, "rx_mc", MC, "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
          "doc_to_target: answer\ndoc_to_choice: choices\nmetric_list:\n  - metric: acc\n")
    _task(tasks, "rx_ppl", DOCS, "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
          "doc_to_target: \"{{text}}\"\nmetric_list:\n  - metric: word_perplexity\n"
          "  - metric: bits_per_byte\n")
    _task(tasks, "rx_gen", GEN, "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\n"
          "doc_to_target: \"{{target}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n"
          "  max_gen_toks: 12\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return d, model, tok


def _evaluate(lm, tasks_dir):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    return simple_evaluate(model=lm, tasks=["rx_mc", "rx_ppl", "rx_gen"], log_samples=True,
                           task_manager=TaskManager(include_path=str(tasks_dir),
                                                    include_defaults=False),
                           bootstrap_iters=0)


def test_our_model_scores_what_lm_evals_hf_model_scores_on_the_export(setup):
    import torch
    from lm_eval.models.huggingface import HFLM
    from rwkv7_hf import RWKV7ForCausalLM
    from transformers import AutoTokenizer

    from rwkvx_c.eval.harness import RwkvxLM
    d, model, tok = setup
    theirs_model = RWKV7ForCausalLM.from_pretrained(str(d / "hf"), dtype=torch.float32).eval()
    # the export's tokenizer declares id 0 its end-of-text: lm-eval's own hf model as it is
    theirs = HFLM(pretrained=theirs_model, tokenizer=AutoTokenizer.from_pretrained(d / "hf"),
                  batch_size=1, prefix_token_id=0, device="cpu")
    assert theirs.eot_token_id == 0
    a = _evaluate(RwkvxLM(model=model, tokenizer=tok), d / "tasks")
    b = _evaluate(theirs, d / "tasks")
    worst = 0.0
    for task in ("rx_mc", "rx_ppl", "rx_gen"):
        ra, rb = a["results"][task], b["results"][task]
        for k, v in rb.items():
            if isinstance(v, float) and k != "alias" and "stderr" not in k:
                assert ra[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (task, k)
        for sa, sb in zip(a["samples"][task], b["samples"][task]):
            for x, y in zip(sa["filtered_resps"], sb["filtered_resps"]):
                if task == "rx_gen":
                    assert x == y
                    continue
                x, y = (x[0], x[1]) if isinstance(x, (list, tuple)) else (x, None), \
                    (y[0], y[1]) if isinstance(y, (list, tuple)) else (y, None)
                worst = max(worst, abs(float(x[0]) - float(y[0])))
                assert float(x[0]) == pytest.approx(float(y[0]), rel=1e-5, abs=1e-4)
                if x[1] is not None:
                    assert bool(x[1]) == bool(y[1])
    print(f"lm-eval: ours vs hf on the export, worst |loglikelihood| difference {worst:.2e}; "
          + ", ".join(f"{t} {a['results'][t]}" for t in ("rx_mc", "rx_ppl", "rx_gen")))


def test_rwkvx_c_eval_runs_local_tasks(setup, capsys):
    d, _, _ = setup
    capsys.readouterr()
    assert main(["eval", str(d / "run"), "--tasks", "rx_mc", "--include-path",
                 str(d / "tasks"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    acc = out["tasks"]["rx_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0 and np.isfinite(acc)


def test_an_unknown_task_is_one_line(setup, capsys):
    d, _, _ = setup
    assert main(["eval", str(d / "run"), "--tasks", "no_such_task_xyz", "--include-path",
                 str(d / "tasks")]) == 1
    err = capsys.readouterr().err.strip()
    assert "no_such_task_xyz" in err and len(err.splitlines()) == 1, err


def test_lm_evals_command_line_on_the_export_scores_what_rwkvx_c_eval_scores(setup, tmp_path,
                                                                           capsys):
    """The issue's check: `lm_eval --model hf --model_args
    pretrained=EXPORT,trust_remote_code=True` (a fresh interpreter, the folder
    loaded by name, its end-of-text from the folder) against `rwkvx-c eval
    --tasks` on the run: every score within 1e-4."""
    import glob
    import os
    import subprocess
    import sys
    d, _, _ = setup
    export = tmp_path / "export"
    assert main(["export", str(d / "run"), "--format", "hf", "--out", str(export)]) == 0
    tasks = "rx_mc,rx_ppl,rx_gen"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                        f"pretrained={export},trust_remote_code=True,dtype=float32",
                        "--tasks", tasks, "--include_path", str(d / "tasks"), "--device", "cpu",
                        "--batch_size", "1", "--output_path", str(tmp_path / "out")],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    with open(path) as f:
        theirs = json.load(f)["results"]
    capsys.readouterr()
    assert main(["eval", str(d / "run"), "--tasks", tasks, "--include-path", str(d / "tasks"),
                 "--json"]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]
    worst = 0.0   # accuracies and bits per byte absolutely, perplexities relatively
    for task in tasks.split(","):
        for k, v in theirs[task].items():
            if isinstance(v, float) and "stderr" not in k:
                diff = abs(ours[task][k] - v) / max(1.0, abs(v))
                worst = max(worst, diff)
                assert diff <= 1e-4, (task, k, ours[task][k], v)
    print(f"lm_eval --model hf on the export vs rwkvx-c eval: worst score difference "
          f"{worst:.2e}; " + ", ".join(f"{t} {theirs[t]}" for t in tasks.split(",")))


def test_eval_takes_lm_evals_spellings(setup, capsys):
    d, _, _ = setup
    capsys.readouterr()
    assert main(["eval", "--model_args", f"pretrained={d / 'run'},dtype=float32,batch_size=1",
                 "--tasks", "rx_mc,rx_ppl", "--include-path", str(d / "tasks"),
                 "--num_fewshot", "0", "--limit", "0.5", "--batch_size", "auto", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]
    assert set(out) == {"rx_mc", "rx_ppl"}
    assert main(["eval", str(d / "run"), "--model_args", "pretrained=elsewhere", "--tasks",
                 "rx_mc"]) == 2
    assert "name different runs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", str(d / "run"), "--model_args", "parallelize=True", "--tasks", "rx_mc"])
    assert "parallelize is not a model argument rwkvx-c eval takes" in capsys.readouterr().err
