"""Reference WKV7 recurrence (docs/maths.md §WKV7) over autograd Vars, per (b, h):

    sa[i]   = sum_j a_t[j] S[i][j]
    S[i][j] = S[i][j] w_t[j] + v_t[i] k_t[j] + sa[i] b_t[j]
    y_t[i]  = sum_j S[i][j] r_t[j]

All heads and batch rows advance together as (B, H, N, N) arrays."""
import numpy as np

from reference.autograd import Var, stack


def wkv7(r, w, k, v, a, b, s_init=None):
    """r, w, k, v, a, b: Vars (B, T, H, N); s_init: Var (B, H, N, N) or None
    (zero state). Returns (y (B, T, H, N), s_final (B, H, N, N))."""
    B, T, H, N = r.shape
    S = Var(np.zeros((B, H, N, N)), requires_grad=False) if s_init is None else s_init

    def col(x, t):   # indexed by j (key dim)
        return x[:, t].reshape(B, H, 1, N)

    def row(x, t):   # indexed by i (value dim)
        return x[:, t].reshape(B, H, N, 1)

    ys = []
    for t in range(T):
        sa = (S * col(a, t)).sum(-1, keepdims=True)
        S = S * col(w, t) + row(v, t) * col(k, t) + sa * col(b, t)
        ys.append((S * col(r, t)).sum(-1))
    return stack(ys, axis=1), S
