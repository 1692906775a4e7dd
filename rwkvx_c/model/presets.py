"""The model presets of docs/training.md §Presets: PRESETS[name] holds the
model config (rx_pt_config field names plus ln0) and the training defaults
the trainer takes from it. The one copy: rwkvx_c.model.config (and through
it the trainer and the CLI's --preset) and the benchmarks (bench/common.py)
read this table. It imports only the standard library, so bench/common.py
can load it by path without importing the rwkvx_c package (an A/B benchmark
imports two different builds of it)."""

from typing import Any

__all__ = ["PRESETS"]


def _cfg(n_embd: int, n_head: int, head_size: int, n_rwkv: int, n_attn: int, vocab: int,
         ffn: int, Dw: int, Da: int, Dg: int, Dv: int, chunk: int, top_k: int) -> dict[str, int]:
    return dict(n_embd=n_embd, n_head=n_head, head_size=head_size, n_rwkv_layer=n_rwkv,
                n_attn_layer=n_attn, vocab_size=vocab, ffn_dim=ffn, Dw=Dw, Da=Da, Dg=Dg, Dv=Dv,
                chunk_size=chunk, moba_top_k=top_k, ln0=1)


_TINY: dict[str, Any] = dict(model=_cfg(128, 2, 64, 2, 1, 256, 512, 16, 16, 32, 8, 32, 2),
             seq_len=256, batch=8, lr=3e-3, warmup_steps=20)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "S": dict(model=_cfg(256, 4, 64, 4, 2, 256, 1024, 32, 32, 64, 16, 64, 2),
              seq_len=512, batch=8, lr=2e-3, warmup_steps=50),
    "M": dict(model=_cfg(512, 8, 64, 6, 2, 4096, 2048, 64, 64, 128, 32, 64, 4),
              seq_len=512, batch=8, lr=1e-3, warmup_steps=100),
    # The no-argument job: the tiny model, which learns the most per second of
    # 2-core CPU time (measured: val_bpb 1.73 after 9.5 minutes on a loaded
    # 2-core machine; see docs/training.md §Presets).
    "default": dict(_TINY, time_budget=9.5),
}
