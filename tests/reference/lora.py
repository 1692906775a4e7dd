"""LoRA adapters, float64, from docs/maths.md §LoRA: each adapted weight
W [in, out] (the arena's orientation, y = x W) acts as

    W_eff = W + s A^T B^T,   s = alpha / r,   A [r, in], B [out, r]

(PEFT's W + s B A in torch's [out, in]; rsLoRA's s = alpha / sqrt(r),
docs/finetune.md §Adapter kinds); the rest of the model is
reference.model's. Gradients on A and B come from the autograd."""
import math

from reference.autograd import Var


def merged(W, A, B, r, alpha, rs=False):
    """W + s A^T B^T for Vars (or arrays taken as constants), s = alpha / r
    (rs: alpha / sqrt(r))."""
    W, A, B = (v if isinstance(v, Var) else Var(v, requires_grad=False) for v in (W, A, B))
    return W + (A.T @ B.T) * (alpha / (math.sqrt(r) if rs else r))


def lora_params(params, adapters, r, alpha, rs=False):
    """params with every adapted weight replaced by its W_eff. adapters:
    {param name: (A, B)} of Vars or arrays."""
    out = dict(params)
    for name, (A, B) in adapters.items():
        out[name] = merged(params[name], A, B, r, alpha, rs)
    return out
