"""Fine-tuning end to end at the 0.1B shape: a random x070 .pth in the
official names and layouts (C 768, 12 blocks, head size 64, the World
vocabulary) is state-tuned and LoRA-tuned by `rwkvx-c train --init-from`
on a chat .jsonl (SFT: the loss on the assistant turns alone); the state
run's states are exported beside its base, the LoRA run's merged model is
exported, and the `rwkv` package runs each.

    python bench/finetune_official.py [WORKDIR] [--steps 20] [--tune state|lora|both]
        [--data CHAT.jsonl] [--pretrain 40] [--pretrain-data docs/]

A state has nothing to steer in a random model (its logits sit at the
uniform guess whatever the state), so the random .pth is first trained in
full for --pretrain steps on plain text (the repository's docs/) and
exported again in the official layout: that .pth is the base both tunes
start from, as a real fine-tune starts from a trained model.

Prints per tune: the training and validation loss at the first and last
steps, whether the base stayed bit-identical in the checkpoint, and the
rwkv package's logits against ours (max |diff| / max |logit|, fp32), and
one JSON line with the same. Needs torch and rwkv (".[torch,world]"). The
default data is tests/data/chat.jsonl (made-up conversations)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

CHAT = os.path.join(os.path.dirname(HERE), "tests", "data", "chat.jsonl")
# each tune's batch x seq_len and learning rate: a state tune's windows start
# at conversations (docs/finetune.md) and a state acts most near a window's
# start, so it trains on windows of about one conversation of this data, at
# RWKV-PEFT's state-tuning lr 1 (a state has no scale of its own to keep);
# the LoRA rate moves the adapters on this base within a few steps
SETUP = {"state": ("8", "32", "1"), "lora": ("2", "128", "1e-2")}

_RWKV = """
import os, sys
os.environ["RWKV_V7_ON"] = "1"
import numpy as np, torch
from rwkv.model import RWKV
m = RWKV(model=sys.argv[1][:-len(".pth")], strategy="cpu fp32")
state = m.generate_zero_state()
if sys.argv[3] != "-":
    ts = torch.load(sys.argv[3])
    for i in range(m.n_layer):
        state[3 * i + 1] = ts[f"blocks.{i}.att.time_state"].float().clone()
out, _ = m.forward(np.load(sys.argv[2]).tolist(), state, full_output=True)
np.save(sys.argv[4], out.float().numpy())
"""


def pretrain(pth, data, steps, work):
    """pth trained in full for steps on data, exported in the official layout."""
    from rwkvx_c import interop
    from rwkvx_c.cli import main as cli
    from rwkvx_c.sample import load_run

    run = os.path.join(work, "base-run")
    rc = cli(["train", "--init-from", pth, "--data", data, "--steps", str(steps), "--batch", "2",
              "--seq-len", "128", "--lr", "1e-3", "--warmup", "2", "--eval-tokens", "512",
              "--threads", "2", "--precision", "fp32", "--no-progress", "--out", run,
              "--cache-dir", os.path.join(work, "cache")])
    assert rc == 0
    out = os.path.join(work, "base-0.1B.pth")
    interop.export_model(load_run(run)[0], "rwkv7", out)
    return out


def tune(mode, pth, data, steps, work):
    """Tune pth by mode on data; check the base, export, run the rwkv package."""
    from rwkvx_c import interop
    from rwkvx_c.cli import main as cli
    from rwkvx_c.run.checkpoint import read_checkpoint
    from rwkvx_c.sample import load_run

    run = os.path.join(work, f"{mode}-run")
    batch, seq_len, lr = SETUP[mode]
    rc = cli(["train", "--init-from", pth, "--tune", mode, "--data", data, "--steps",
              str(steps), "--batch", batch, "--seq-len", seq_len, "--lr", lr, "--warmup", "2",
              "--eval-tokens", "512", "--eval-every", str(max(1, steps // 6)), "--threads", "2",
              "--precision", "fp32", "--no-progress", "--out", run, "--cache-dir",
              os.path.join(work, "cache")])
    assert rc == 0
    model, tok = load_run(run)     # a LoRA run's model comes merged
    tensors, _, _ = read_checkpoint(os.path.join(run, "checkpoint.safetensors"))
    src = interop.read_source(pth)
    same = all(np.array_equal(tensors[n], src.weights[n]) for n in model.param_names)
    with open(os.path.join(run, "log.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    losses = [r["loss"] for r in rows if "loss" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    # a state run's states travel apart from its base
    out_pth = os.path.join(work, f"{mode}-model.pth")
    st = os.path.join(work, "state.pth") if mode == "state" else "-"
    interop.export_model(model, "rwkv7", out_pth)
    if mode == "state":
        interop.export_model(model, "state", st)
    tokens = tok.encode("User: Name a colour.\n\nAssistant:").astype(np.int32)
    ours = model.forward(tokens)
    np.save(os.path.join(work, "tokens.npy"), tokens.astype(np.int64))
    r = subprocess.run([sys.executable, "-c", _RWKV, out_pth, os.path.join(work, "tokens.npy"),
                        st, os.path.join(work, "ref.npy")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    ref = np.load(os.path.join(work, "ref.npy"))
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    print(f"{mode}: train loss {losses[0]:.4f} -> {losses[-1]:.4f}; val loss {vals[0]:.4f} -> "
          f"{vals[-1]:.4f}; base bit-identical: {same}; rwkv package with the exported "
          f"{'state' if mode == 'state' else 'merged model'} vs ours: {err:.2e} of the largest "
          "logit", flush=True)
    return {"tune": mode, "loss_first": losses[0], "loss_last": losses[-1],
            "val_first": vals[0], "val_last": vals[-1], "base_identical": same,
            "rwkv_rel_err": err}


def main():
    from test_interop import _official_dict

    from rwkvx_c import interop

    ap = argparse.ArgumentParser()
    ap.add_argument("work", nargs="?", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tune", choices=["state", "lora", "both"], default="both")
    ap.add_argument("--data", default=CHAT)
    ap.add_argument("--pretrain", type=int, default=40, metavar="STEPS")
    ap.add_argument("--pretrain-data", default=os.path.join(os.path.dirname(HERE), "docs"))
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="rwkvx_ft_")
    os.makedirs(work, exist_ok=True)
    sd = _official_dict(np.random.default_rng(0), V=65536, C=768, H=12, N=64, L=12, F=3072,
                        Dw=64, Da=64, Dv=32, Dg=128)
    # a smaller head: random logits as wide as _official_dict's start above the
    # uniform guess, which the divergence guard takes for a blown-up run
    sd["head.weight"] *= 0.1
    # RWKV-7's own decay spectrum (docs/layout.md §Init), slow channels to
    # fast, for the random one: an initial state acts through what the heads
    # remember, and random decays forget it within a few tokens
    i = np.arange(768)
    zig = ((i % 64) - 31.5) / 31.5 * np.abs(((i % 64) - 31.5) / 31.5)
    for L in range(12):
        w0 = -6 + 6 * (i / 767) ** (1 + (L / 11) ** 0.3) + 0.5 + 2.5 * zig
        sd[f"blocks.{L}.att.w0"] = w0.reshape(1, 1, 768).astype(np.float32)
    pth = os.path.join(work, "official-0.1B.pth")
    interop.save_pth(sd, pth, "fp32")
    if a.pretrain:
        pth = pretrain(pth, a.pretrain_data, a.pretrain, work)
    for mode in ("state", "lora") if a.tune == "both" else (a.tune,):
        print(json.dumps(tune(mode, pth, a.data, a.steps, work)), flush=True)


if __name__ == "__main__":
    main()
