"""docs/training.md §Presets model-FLOP count of bench/common.py: reproduces the quoted
S ~= 32.8 and M ~= 181 MFLOP/token at T=512, and its attended-key count
agrees with a brute-force enumeration of the MoBA key sets."""
import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench", "common.py")
_spec = importlib.util.spec_from_file_location("bench_common", _PATH)
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


@pytest.mark.parametrize("preset,mflop", [("S", 32.8), ("M", 181.0)])
def test_spec_flops_per_token(preset, mflop):
    got = common.model_flops_per_token(common.PRESETS[preset], T=512) / 1e6
    assert abs(got - mflop) < 0.5, got


def test_flops_hand_count_S():
    # 6 x forward MACs, hand-summed for S at T=512 (136.5 keys per query)
    C, F, V, N = 256, 1024, 256, 64
    rwkv = 4 * (4 * C * C + 2 * C * (32 + 32 + 64) + 2 * C * F + 4 * C * N) + 3 * 2 * C * 16
    attn = 2 * (4 * C * C + 2 * C * F + 2 * C * 136.5)
    assert common.model_flops_per_token(common.PRESETS["S"]) == 6 * (rwkv + attn + C * V)


@pytest.mark.parametrize("T,chunk,top_k", [(1, 4, 2), (17, 4, 2), (64, 8, 0), (50, 7, 3),
                                           (33, 5, 100), (512, 64, 4)])
def test_attended_keys_brute_force(T, chunk, top_k):
    total = 0
    for t in range(T):
        ct = t // chunk
        selected = range(ct) if top_k <= 0 or top_k >= ct else range(top_k)
        keys = {s for j in selected for s in range(j * chunk, (j + 1) * chunk)}
        keys |= set(range(ct * chunk, t + 1))
        total += len(keys)
    assert common.attended_keys(T, chunk, top_k) == total


def test_flops_scale_with_T_only_through_attention():
    cfg = dict(common.PRESETS["S"], n_attn_layer=0)
    assert common.model_flops_per_token(cfg, T=1) == common.model_flops_per_token(cfg, T=4096)
    assert (common.model_flops_per_token(common.PRESETS["S"], T=1024)
            > common.model_flops_per_token(common.PRESETS["S"], T=512))


def test_peak_rss_positive():
    assert common.peak_rss_mib() > 1.0
