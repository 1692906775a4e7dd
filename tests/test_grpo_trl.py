"""GRPO judged by TRL itself: for a LoRA tune that has moved away from its
base, on one batch of completions the engine sampled, the per-token
log-probabilities, the group advantages and the loss of each loss_type
rwkvx_c computes equal those of TRL's GRPOTrainer (its scoring,
advantages and _compute_loss fed the same prompts, completions and reward
function, not re-sampled) with the rwkv7-hf exports of the policy (the
LoRA run, merged) and the reference (the base), within 1e-4, with the KL
term, at the run's sampling temperature (1.5: both divide the logits by
it) and at 1.

Without torch / transformers / rwkv7-hf / trl these tests skip, unless
RWKVX_REQUIRE_INTEROP=1, where that is a failure."""
import json

import numpy as np
from test_dpo_trl import trained_base
from test_interop import _need

from rwkvx_c.cli import main
from rwkvx_c.data.chat import IGNORE
from rwkvx_c.train import Trainer
from rwkvx_c.train.grpo_loss import LOSS_TYPES, token_loss

TOL = 1e-4
TEXT = b"1+2=3\n2+2=4\n3+4=7\n5+1=6\n"
REWARD = """
def digits(prompts, completions, completion_ids, answer, **kw):
    # a spread of rewards from the ids alone (the same on both sides), None for some
    return [None if sum(ids) % 7 == 0 else (sum(ids) % 5) / 4.0 + float(a == '3')
            for ids, a in zip(completion_ids, answer)]
"""


def _trl(policy_dir, ref_dir, tmp_path, inputs, prompt_ids, comp_ids, G, beta, max_len, temp):
    """TRL's advantages, per-token log-probabilities and loss per loss_type
    of the completions comp_ids of prompt_ids (each repeated G times),
    sampled at temperature temp."""
    import importlib.util

    import torch
    from datasets import Dataset
    from rwkv7_hf import RWKV7ForCausalLM
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    spec = importlib.util.spec_from_file_location("grpo_reward", tmp_path / "reward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    policy = RWKV7ForCausalLM.from_pretrained(str(policy_dir), torch_dtype=torch.float32)
    ref = RWKV7ForCausalLM.from_pretrained(str(ref_dir), torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    tok.pad_token = tok.eos_token = tok.convert_ids_to_tokens(0)   # the separator, id 0
    N = len(comp_ids)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      per_device_train_batch_size=N, per_device_eval_batch_size=N,
                      num_generations=G, max_completion_length=max_len, temperature=temp)
    tr = GRPOTrainer(model=policy, reward_funcs=[mod.digits], args=args,
                     train_dataset=Dataset.from_list(inputs), processing_class=tok)
    if beta:   # set after: TRL would load its own reference from the policy's path
        tr.beta, tr.ref_model = beta, ref.eval()
        from trl.trainer.utils import add_fused_lm_head
        add_fused_lm_head(tr.ref_model, temperature=tr.temperature)
    tr.model.eval()
    texts = [tok.decode(c) for c in comp_ids]

    def fake_generate(prompts):
        return (prompt_ids, comp_ids, None, texts, None, {}, None, None)
    tr._generate = fake_generate
    with torch.no_grad():
        out = tr._generate_and_score_completions(inputs)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        logps, _, _ = tr._get_per_token_logps_and_entropies(
            tr.model, ids, mask, out["completion_ids"].size(1))
        losses = {}
        for lt in LOSS_TYPES:
            tr.loss_type = lt
            losses[lt] = float(tr._compute_loss(tr.model, out))
    return out["advantages"].numpy(), logps.numpy(), losses


def test_grpo_logps_advantages_and_losses_equal_trl(tmp_path):
    _need("torch", "transformers", "rwkv7_hf", "trl", "datasets")
    # trained enough that its completions end at --stop at different lengths
    base = trained_base(tmp_path, TEXT * 200, "--steps", "60", "--lr", "1e-2")
    run = str(tmp_path / "grpo")
    data = tmp_path / "prompts.jsonl"
    rng = np.random.default_rng(0)
    recs = [{"prompt": f"{a}+{b}=", "answer": str(a + b)}
            for a, b in rng.integers(0, 5, (12, 2))]
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "reward.py").write_text(REWARD)
    G, max_len, beta, temp = 4, 8, 0.04, 1.5
    common = ["--data", str(data), "--reward", f"{tmp_path / 'reward.py'}:digits",
              "--num-generations", str(G), "--batch", "8", "--max-completion-length",
              str(max_len), "--stop", "\\n", "--temperature", str(temp), "--threads", "2",
              "--precision", "fp32", "--warmup", "0",
              "--beta", str(beta)]
    assert main(["train", "--init-from", base, "--tune", "lora", "--lora-r", "4",
                 "--objective", "grpo", "--steps", "3", "--lr", "3e-2", "--out", run,
                 *common]) == 0
    tr = Trainer.resume(run, steps=4)
    g = tr.pref
    r = g.next_rollout(tr.model)   # the batch of step 4: the step below takes it
    g.rollout = r
    x, y = r.x, r.y
    mask = (y != IGNORE).astype(np.float64)
    logp, ours = {}, {}
    for t in (temp, 1.0):   # the run's temperature, and TRL's default
        g.o.temperature = t
        tr.model.forward(x, return_logits=False)
        logp[t] = -tr.model.row_losses(y, IGNORE, temperature=t)
        ref = g._ref_logps(tr.model, x, y)
        assert np.abs((logp[t] - ref) * mask).max() > 1e-3   # the LoRA tune has moved off its base
        ours[t] = {lt: token_loss(logp[t], mask, r.adv, loss_type=lt, eps_low=0.2, eps_high=0.2,
                                  beta=beta, ref=ref, max_len=max_len, n_items=mask.sum()).loss
                   for lt in LOSS_TYPES}
    assert np.abs((logp[temp] - logp[1.0]) * mask).max() > 1e-2   # the temperature tells
    g.o.temperature = temp
    row = tr.step()
    assert abs(row["loss"] - ours[temp]["dapo"]) <= 1e-12 * max(1.0, abs(ours[temp]["dapo"]))
    tr.close()
    pol_dir, ref_dir = tmp_path / "pol_hf", tmp_path / "ref_hf"
    assert main(["export", run, "--format", "hf", "--out", str(pol_dir)]) == 0
    assert main(["export", base, "--format", "hf", "--out", str(ref_dir)]) == 0
    prompt_ids, comp_ids = [], []
    for k in range(len(x)):
        pos = np.flatnonzero(y[k] != IGNORE)
        prompt_ids.append([int(v) for v in x[k, :pos[0] + 1]])
        comp_ids.append([int(v) for v in y[k, pos]])
    assert len({len(p) for p in prompt_ids}) == 1   # no left padding on TRL's side
    assert len({len(c) for c in comp_ids}) > 1      # the aggregations differ
    inputs = [{"prompt": recs[i]["prompt"], "answer": recs[i]["answer"]}
              for i in r.idx for _ in range(G)]
    for t in (temp, 1.0):
        adv, tlogp, losses = _trl(pol_dir, ref_dir, tmp_path, inputs, prompt_ids, comp_ids, G,
                                  beta, max_len, t)
        print(f"temperature {t}: advantages", np.round(r.adv, 5), "TRL", np.round(adv, 5))
        assert np.abs(adv - r.adv).max() <= TOL
        for k in range(len(x)):
            mine = logp[t][k, y[k] != IGNORE]
            assert np.abs(tlogp[k, :len(mine)] - mine).max() <= TOL, (t, k)
        for lt in LOSS_TYPES:
            print(f"{lt}: rwkvx_c {ours[t][lt]:.7f}, TRL {losses[lt]:.7f}")
            assert abs(ours[t][lt] - losses[lt]) <= TOL, (t, lt)
