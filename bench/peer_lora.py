"""The LoRA fine-tune step through PyTorch peers on CPU, each in its own
process: the same 0.1B shape, T, batch 1, r, alpha and targets as
`bench/bench_finetune.py --mode lora`, so the two print comparable tokens/s.

    python bench/peer_lora.py --peer torch     # bench/torch_model.py + factored LoRA
    python bench/peer_lora.py --peer hf-peft   # rwkv7-hf's model wrapped by peft
    python bench/peer_lora.py                  # both, one process each

`torch` is the strongest straightforward PyTorch model (chunked WKV7, one
matmul per projection: bench/torch_model.py) with the adapters in PEFT's
factored form; `hf-peft` is the ecosystem's own path (the `rwkv7-hf`
package's RWKV7ForCausalLM, `peft.get_peft_model` on r/k/v/o and the
channel-mix key/value), whose WKV7 runs token by token. One step: forward,
cross-entropy, backward, AdamW on the adapters. Prints one JSON line per
peer: tokens/s (best of --steps after one untimed step) and peak RSS."""
import argparse
import json
import os
import subprocess
import sys
import time

from common import peak_rss_mib

SHAPE = dict(n_embd=768, n_head=12, head_size=64, n_rwkv_layer=12, n_attn_layer=0,
             vocab_size=65536, Dw=64, Da=64, Dg=128, Dv=32, ffn_dim=3072, chunk_size=64,
             moba_top_k=0, ln0=1)
OURS = ("tm.receptance_w", "tm.key_w", "tm.value_w", "tm.output_w", "cm.ffn_key_w",
        "cm.ffn_value_w")
HF = ["r_proj", "k_proj", "v_proj", "o_proj", "key", "value"]


def _time(step, steps):
    times = []
    for _ in range(steps + 1):      # the first step warms the allocator: not timed
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return min(times[1:])


def torch_peer(T, steps, r, alpha):
    import torch
    import torch_model as tm
    m = tm.RwkvXTorch(SHAPE)
    opt = torch.optim.AdamW(m.add_lora(r, alpha, OURS), lr=1e-4)
    g = torch.Generator().manual_seed(0)

    def step():
        x = torch.randint(0, SHAPE["vocab_size"], (1, T + 1), generator=g)
        loss = m.loss(x[:, :-1], x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return _time(step, steps)


def hf_peer(T, steps, r, alpha):
    import torch
    from peft import LoraConfig, get_peft_model
    from rwkv7_hf.configuration_rwkv7 import RWKV7Config
    from rwkv7_hf.modeling_rwkv7 import RWKV7ForCausalLM
    cfg = RWKV7Config(vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["n_embd"],
                      num_hidden_layers=SHAPE["n_rwkv_layer"], head_dim=SHAPE["head_size"],
                      intermediate_size=SHAPE["ffn_dim"], decay_low_rank_dim=SHAPE["Dw"],
                      a_low_rank_dim=SHAPE["Da"], gate_low_rank_dim=SHAPE["Dg"],
                      v_low_rank_dim=SHAPE["Dv"], use_cache=False)
    m = get_peft_model(RWKV7ForCausalLM(cfg),
                       LoraConfig(r=r, lora_alpha=alpha, target_modules=HF, lora_dropout=0.0))
    m.train()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(0)

    def step():
        x = torch.randint(0, SHAPE["vocab_size"], (1, T), generator=g)
        loss = m(input_ids=x, labels=x).loss      # HF shifts the labels inside
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return _time(step, steps)


PEERS = {"torch": torch_peer, "hf-peft": hf_peer}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", choices=sorted(PEERS))
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    a = ap.parse_args()
    if a.peer is None:
        for peer in sorted(PEERS):
            subprocess.run([sys.executable, os.path.abspath(__file__), "--peer", peer, "--T",
                            str(a.T), "--steps", str(a.steps), "--threads", str(a.threads),
                            "--lora-r", str(a.lora_r), "--lora-alpha", str(a.lora_alpha)],
                           check=True)
        return
    import torch
    torch.set_num_threads(a.threads)
    best = PEERS[a.peer](a.T, a.steps, a.lora_r, a.lora_alpha)
    print(json.dumps({"peer": a.peer, "T": a.T, "threads": a.threads, "lora_r": a.lora_r,
                      "tokens_per_s": a.T / best, "step_s": best,
                      "peak_rss_mib": peak_rss_mib()}), flush=True)


if __name__ == "__main__":
    main()
