"""--unfreeze-at STEP, the base-unfreeze (docs/finetune.md §Unfreezing the
base): frozen parameters bit-identical before the switch and moving from
it, the old moments kept and the new ones zero with their own AdamW step
count, the checkpoint's side of the switch, bit-exact resume on both sides
of it, and the refusal of a run with nothing frozen."""
import numpy as np
import pytest
from test_finetune import _base_run, _tune
from test_train import SMALL, _opts

from rwkvx_c.cli import main
from rwkvx_c.run.checkpoint import read_checkpoint
from rwkvx_c.train import Trainer, TrainError
from rwkvx_c.train.finetune import is_unfrozen, part_of, switched, unfreeze

RWKV = dict(SMALL, n_attn_layer=0)


def _losses(rows):
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("mode", ["state", "freeze", "lora"])
def test_unfreeze_at_trains_the_base_from_that_step_and_resumes_bit_exact(tmp_path, mode,
                                                                           capsys):
    model = dict(SMALL) if mode == "freeze" else RWKV
    base = _base_run(tmp_path, model)
    tensors, _, _ = read_checkpoint(base + "/checkpoint.safetensors")
    kw = dict(freeze="emb,head,time") if mode == "freeze" else \
        dict(tune=mode, lora_r=3) if mode == "lora" else dict(tune=mode)
    kw.update(steps=6, lr=1e-2, save_every=2, unfreeze_at=3)
    tr = _tune(tmp_path, base, "a", **kw)
    m = tr.model
    frozen = [n for n in m.param_names if mode != "freeze"
              or part_of(n, m.layers) in ("emb", "head", "time")]
    n_before = tr.optim.m.size
    snaps = {}
    rows = []

    def seen(row):
        rows.append(row)
        if "loss" in row:
            snaps[row["step"]] = {n: m.params[n].copy() for n in frozen}
    tr.run(on_step=seen)
    for n in frozen:   # held through steps 1 and 2, trained from step 3
        assert np.array_equal(snaps[2][n], tensors[n]), n
    assert any(not np.array_equal(snaps[3][n], tensors[n]) for n in frozen)
    assert any(not np.array_equal(snaps[6][n], snaps[3][n]) for n in frozen)
    # the adapters, merged into the base at the switch, left the optimiser
    kept = 0 if mode == "lora" else n_before
    assert tr.optim.m.size == kept + sum(m.params[n].size for n in frozen)
    assert is_unfrozen(tr.optim) and tr.optim.t == 6
    assert m.lora is None   # merged into the base (lora) or never there
    # the pieces that joined at step 3 counted their own AdamW steps from there
    starts = tr.optim.starts
    assert set(starts) == ({2} if mode == "lora" else {0, 2})
    assert [a.t for a in tr.optim.subs] == [6 - s for s in starts]
    ck, _, st = read_checkpoint(str(tmp_path / "a" / "checkpoint.safetensors"))
    assert st["unfrozen"] is True and ck["optim.m"].shape == (tr.optim.m.size,)
    assert not any(k.endswith(".lora_A") for k in ck)   # past the switch: merged
    if mode == "lora":   # the adapters are gone into the base: a lora export says so
        capsys.readouterr()
        assert main(["export", str(tmp_path / "a"), "--format", "lora", "--out",
                     str(tmp_path / "a.pth")]) == 1
        e = capsys.readouterr().err.strip()
        assert len(e.splitlines()) == 1 and "--unfreeze-at 3" in e
        assert main(["export", str(tmp_path / "a"), "--format", "rwkv7", "--out",
                     str(tmp_path / "m.pth")]) == 0
        assert "merged into this model" not in capsys.readouterr().out
    losses = _losses(rows)
    # resumed before the switch (step 2) it crosses it identically; after it
    # (step 4) it continues identically
    for stop in (2, 4):
        b = _tune(tmp_path, base, f"b{stop}", **kw)
        b.run(stop=lambda b=b, stop=stop: b.step_count >= stop)
        _, _, st = read_checkpoint(str(tmp_path / f"b{stop}" / "checkpoint.safetensors"))
        assert st["step"] == stop and st["unfrozen"] is (stop >= 3)
        r = Trainer.resume(str(tmp_path / f"b{stop}"))
        again = []
        r.run(on_step=again.append)
        assert _losses(again) == losses[stop:], stop
        assert np.array_equal(r.model.param_buffer, m.param_buffer)
        assert np.array_equal(r.optim.m, tr.optim.m) and np.array_equal(r.optim.v, tr.optim.v)


def test_the_switch_keeps_the_old_moments_and_starts_the_new_at_zero(tmp_path):
    base = _base_run(tmp_path)
    tr = _tune(tmp_path, base, "s", tune="state", steps=2, unfreeze_at=3)
    tr.step()
    tr.step()
    old_m, old_v, n_old = tr.optim.m.copy(), tr.optim.v.copy(), tr.optim.m.size
    assert n_old == tr.model.state.size
    assert tr.model.frozen is True and not is_unfrozen(tr.optim)
    new = unfreeze(tr.model, tr.optim, tr.opts)
    assert is_unfrozen(new) and new.t == 2 and tr.model.frozen is False
    assert np.array_equal(new.m[:n_old], old_m) and np.array_equal(new.v[:n_old], old_v)
    assert not np.any(new.m[n_old:]) and not np.any(new.v[n_old:])
    assert new.m.size == n_old + tr.model.param_buffer.size
    assert unfreeze(tr.model, new, tr.opts) is new          # once only
    # a rollback to a checkpoint before the switch freezes the base again
    back = switched(tr.model, new, tr.opts, False)
    assert not is_unfrozen(back) and back.m.size == n_old and tr.model.frozen is True


def test_a_lora_switch_merges_the_adapters_and_a_rollback_takes_them_back(tmp_path):
    base = _base_run(tmp_path, RWKV)
    tr = _tune(tmp_path, base, "l", tune="lora", lora_r=2, steps=2, unfreeze_at=3,
               precision="fp32")   # bf16 rounds the factored and merged forms apart
    tr.step()
    tr.step()
    m = tr.model
    adapters = {k: v.copy() for k, v in m.lora.items()}
    assert any(np.any(v) for k, v in adapters.items() if k.endswith(".lora_B"))
    x = np.arange(7, dtype=np.int32)[None] % m.config["vocab_size"]
    want = m.forward(x)
    new = unfreeze(m, tr.optim, tr.opts)
    # the merged weights give the adapted model's logits (one float32 rounding
    # of W + s A^T B^T per weight)
    assert m.lora is None and m.frozen is False and new.m.size == m.param_buffer.size
    got = m.forward(x)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    back = switched(m, new, tr.opts, False)   # a rollback to before the switch
    assert not is_unfrozen(back) and m.lora is not None and m.frozen is not False
    assert set(m.lora) == set(adapters) and back.m.size == sum(v.size for v in adapters.values())


def test_unfreeze_at_with_nothing_frozen_is_refused(tmp_path, capsys):
    with pytest.raises(TrainError, match="--unfreeze-at unfreezes a frozen base"):
        _opts(tmp_path, unfreeze_at=3).resolved()
    rc = main(["train", "--data", str(tmp_path / "x.txt"), "--unfreeze-at", "3",
               "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "--unfreeze-at" in err
    with pytest.raises(SystemExit) as e:   # the help formats (a bare % once broke it)
        main(["train", "--help"])
    assert e.value.code == 0 and "--unfreeze-at STEP" in capsys.readouterr().out
