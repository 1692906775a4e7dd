"""Batch-1 decode of a DoRA tune against its LoRA twin over a held Q8_0
base (docs/finetune.md §Adapter kinds, DoRA): a random model of the 0.1B
shape (C 768, 12 blocks, World vocabulary), adapters of rank 32 on every
target with B drawn non-zero, one GenState slot stepped token by token;
tokens/s, the best of --repeat runs of --steps steps, each kind on a
model of its own in this process, one after the other.

    python bench/bench_dora.py [--steps 16] [--repeat 3] [--threads 2]

The DoRA rows show what keeping the column norms saves: they are taken
once for the adapters, not at every token (`rwkvx_c.profile()`'s
"dora norms" slot, printed beside)."""
import argparse
import time

import numpy as np

import rwkvx_c as rx
from rwkvx_c.model.lora import M_SUFFIX, TARGETS, target_params

CFG = dict(n_embd=768, n_rwkv_layer=12, n_attn_layer=0, n_head=12, head_size=64,
           vocab_size=65536, ffn_dim=3072, chunk_size=32, moba_top_k=2, Dw=64, Da=64, Dg=128,
           Dv=32)
R = 32


def held_model():
    """The 0.1B-shaped model with its projections in a Q8_0 base."""
    src = rx.RxPtModel(CFG, seed=1)
    m = rx.RxPtModel(CFG, seed=1, init=False)
    m.param_buffer[...] = src.param_buffer
    names = target_params(m.layers, tuple(TARGETS))
    m.set_base("q8_0", names)
    for n in names:
        m.base_fill(n, src.params[n])
    return m, names


def decode(m, steps, repeat):
    """(tokens/s, seconds in "dora norms") of one slot decoding."""
    g = rx.GenState(m, 1, max_len=steps * repeat + 8, max_tokens=8)
    tok = np.array([1], np.int32)
    g.step([0], [1], tok)
    best, norms = 0.0, 0.0
    for _ in range(repeat):
        rx.profile_enable(True)
        t = time.perf_counter()
        for _ in range(steps):
            g.step([0], [1], tok)
        best = max(best, steps / (time.perf_counter() - t))
        norms = rx.profile().get("dora norms", 0.0)
        rx.profile_enable(False)
    return best, norms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rx.set_num_threads(a.threads)
    print("| adapters | decode B=1 tok/s | seconds in dora norms (last run) |")
    print("|---|---|---|")
    for kind in ("lora", "dora"):
        m, names = held_model()   # a model takes one set of adapters
        rng = np.random.default_rng(0)
        m.enable_lora(R, 32.0, names, dora=kind == "dora")
        for k, v in m.lora.items():
            if k.endswith(".lora_B"):
                v[...] = rng.standard_normal(v.shape).astype(np.float32) * 0.01
        for k, v in m.lora.items():   # DoRA's magnitudes: the columns' norms, as a tune starts
            if k.endswith(M_SUFFIX):
                v[...] = m.lora_norms(k[:-len(M_SUFFIX)])
        tps, norms = decode(m, a.steps, a.repeat)
        print(f"| {kind} | {tps:.1f} | {norms:.3f} |", flush=True)


if __name__ == "__main__":
    main()
