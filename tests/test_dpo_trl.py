"""DPO judged by TRL itself: for a LoRA tune that has moved away from its
base, the per-pair summed log-probabilities of the chosen and rejected
completions and the DPO loss rwkvx_c reports before a step equal those
TRL's DPOTrainer computes (its collator and loss, on the same token ids)
with the rwkv7-hf exports of the policy (the LoRA run, merged) and the
reference (the base), within 1e-4.

Without torch / transformers / rwkv7-hf / trl these tests skip, unless
RWKVX_REQUIRE_INTEROP=1, where that is a failure."""
import json

import numpy as np
from test_interop import _need

from rwkvx_c.cli import main
from rwkvx_c.data.chat import IGNORE
from rwkvx_c.data.preferences import Pairs
from rwkvx_c.train import Trainer
from rwkvx_c.train.objectives import pair_logps

TOL = 1e-4
TEXT = b"def f(x):\n    return x * 2\n"


def _pairs(n):
    words = ["cat", "dog", "sun", "map", "pen", "cup", "hat", "box"]
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        a, b = rng.choice(words, 2, replace=False)
        out.append({"prompt": f"Say {a}", "chosen": f"{a} {a}", "rejected": f"{b} {b}."})
    return out


def _trl_batch_metrics(policy_dir, ref_dir, tmp_path, examples, beta):
    """TRL's DPOTrainer loss and logps/chosen, logps/rejected of each example
    ({prompt_ids, chosen_ids, rejected_ids}), one pair a batch."""
    import torch
    from datasets import Dataset
    from rwkv7_hf import RWKV7ForCausalLM
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    torch.manual_seed(0)
    policy = RWKV7ForCausalLM.from_pretrained(str(policy_dir), torch_dtype=torch.float32)
    ref = RWKV7ForCausalLM.from_pretrained(str(ref_dir), torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    tok.pad_token = tok.eos_token = tok.convert_ids_to_tokens(0)   # the separator, id 0
    # bf16=False: TRL's default on a CPU with bf16 runs the reference under bf16 autocast
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, report_to=[], use_cpu=True,
                     per_device_train_batch_size=1, max_length=None, bf16=False)
    data = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    tr = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=data,
                    processing_class=tok)
    tr.model.eval()
    out = []
    for ex in examples:
        batch = tr.data_collator([ex])
        with torch.no_grad():
            loss = tr._compute_loss(tr.model, batch, return_outputs=False)
        m = tr._metrics["eval"]   # the model is in eval mode: no dropout
        out.append((float(loss), m["logps/chosen"][-1], m["logps/rejected"][-1],
                    m["rewards/chosen"][-1], m["rewards/rejected"][-1]))
    return out


def trained_base(tmp_path, text, *flags):
    """A tiny fp32 byte model trained on text in tmp_path/base (flags: more
    of train's, e.g. --steps): the policy's base and the reference."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(text)
    base = str(tmp_path / "base")
    assert main(["train", "--preset", "tiny", "--n-attn-layer", "0", "--steps", "6",
                 "--seq-len", "32", "--batch", "2", "--eval-tokens", "64", "--threads", "2",
                 "--warmup", "1", "--data", str(corpus), "--out", base, "--precision", "fp32",
                 "--cache-dir", str(tmp_path / "cache"), *flags]) == 0
    return base


def test_dpo_logps_and_loss_equal_trl_on_the_hf_exports(tmp_path):
    _need("torch", "transformers", "rwkv7_hf", "trl", "datasets")
    base, run = trained_base(tmp_path, TEXT * 300), str(tmp_path / "dpo")
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _pairs(24)))
    beta = 0.1
    assert main(["train", "--init-from", base, "--tune", "lora", "--lora-r", "4",
                 "--objective", "dpo", "--dpo-beta", str(beta), "--data", str(data),
                 "--batch", "4", "--seq-len", "48", "--steps", "3", "--lr", "3e-2",
                 "--warmup", "0", "--threads", "2", "--precision", "fp32", "--out", run]) == 0
    tr = Trainer.resume(run, steps=4)
    p = tr.pref
    assert p is not None and p.ref is not None
    idx = p.sampler.next_indices()          # the pairs of step 4, drawn again below
    p.sampler.set_state({"epoch": p.sampler.epoch, "pos": p.sampler.pos - len(idx)})
    t = p.train
    sub = Pairs(t.x[idx], t.y[idx], t.n_tokens[idx], [t.where[i] for i in idx], "")
    pol = pair_logps(tr.model, sub, p.pairs)     # the policy as the step sees it
    ref = p.ref[idx]
    assert np.all(np.abs(pol - ref) > 1e-3)      # the LoRA tune has moved off its base
    row = tr.step()
    assert abs(row["logps/chosen"] - pol[:, 0].mean()) <= 1e-9 * abs(pol[:, 0].mean())
    tr.close()
    pol_dir, ref_dir = tmp_path / "pol_hf", tmp_path / "ref_hf"
    assert main(["export", run, "--format", "hf", "--out", str(pol_dir)]) == 0
    assert main(["export", base, "--format", "hf", "--out", str(ref_dir)]) == 0
    examples = []
    for i in idx:
        x, y = t.x[i], t.y[i]
        start = int(np.flatnonzero(y[0] != IGNORE)[0])   # x[start] ends the prompt
        prompt = [int(v) for v in x[0, :start + 1]]
        comp = [[int(v) for v in y[j][y[j] != IGNORE]] for j in (0, 1)]
        examples.append({"prompt_ids": prompt, "chosen_ids": comp[0], "rejected_ids": comp[1]})
    trl = _trl_batch_metrics(pol_dir, ref_dir, tmp_path, examples, beta)
    losses = []
    for k, (loss, lc, lr, rc, rr) in enumerate(trl):
        # TRL's reference log-probabilities, from its rewards beta * (policy - reference)
        tc, tr_ = lc - rc / beta, lr - rr / beta
        print(f"pair {idx[k]}: logps chosen {pol[k, 0]:.6f} (TRL {lc:.6f}), rejected "
              f"{pol[k, 1]:.6f} (TRL {lr:.6f}); reference chosen {ref[k, 0]:.6f} (TRL "
              f"{tc:.6f}), rejected {ref[k, 1]:.6f} (TRL {tr_:.6f}); loss TRL {loss:.6f}")
        assert abs(pol[k, 0] - lc) <= TOL and abs(pol[k, 1] - lr) <= TOL
        assert abs(ref[k, 0] - tc) <= TOL and abs(ref[k, 1] - tr_) <= TOL
        losses.append(loss)
    print(f"step loss {row['loss']:.6f}, TRL mean {np.mean(losses):.6f}")
    assert abs(row["loss"] - np.mean(losses)) <= TOL
