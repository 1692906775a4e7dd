"""The groups of parameters --train-parts and --freeze name (docs/finetune.md
§Groups): ln, time, emb, head and attn, each parameter's by its name; and
state, the initial WKV states a LoRA tune may train beside its adapters
(no parameter is of that group)."""
from __future__ import annotations

__all__ = ["PARTS", "STATES", "part_of"]

PARTS = ("ln", "time", "emb", "head", "attn", "state")
STATES = "state"   # the group of the initial WKV states

# the time-mix and channel-mix parameters that are not projections
_TIME = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "w1", "w2", "a0", "a1", "a2", "v0",
         "v1", "v2", "g1", "g2", "k_k", "k_a", "r_k", "ffn_x_k")


def part_of(name: str, layers: str) -> str | None:
    """The group of parameter `name` (ln, time, emb, head, attn), or None
    for the projection matrices of the RWKV blocks, which no group names."""
    if name in ("emb", "head"):
        return name
    last = name.rsplit(".", 1)[-1]
    if name.startswith("blocks.") and layers[int(name.split(".")[1])] == "A":
        return "attn"
    if last.startswith("ln"):
        return "ln"
    return "time" if last in _TIME else None
