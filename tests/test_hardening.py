"""Hostile and careless use: exact cross-entropy at any finite logits,
divergence, leaks over threads, inputs that used to crash, memory checked up
front, checkpoint integrity, run-folder locking. Whatever could crash the
interpreter runs in a subprocess (tests/hostile.py)."""
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import safetensors.numpy

import rwkvx_c as rx
from rwkvx_c.model import memory as memcheck
from rwkvx_c.run.checkpoint import (
    CheckpointError,
    parse_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from rwkvx_c.train import CHECKPOINT, LOG, Trainer, TrainError, TrainOptions
from rwkvx_c.train.guard import MAX_ROLLBACKS, ROLLBACK_LR_FACTOR, Divergence, DivergenceGuard

from hostile import SMALL, cli, corpus, no_traceback, python

# ------------------------------------------------------------ cross-entropy


def ref_ce(logits, target):
    """-log softmax(l)[target] in float64: logaddexp over l - l[target]
    (differences of floats are exact or relatively exact in float64), so
    nothing is lost to the size of the logits."""
    d = logits.astype(np.float64) - np.float64(logits[target])
    return float(np.logaddexp.reduce(d))


HUGE = 3e38
CE_CASES = [
    ([HUGE] * 4, 0),                    # all equal and huge: log 4, read 0.0 before
    ([HUGE] * 257, 5),
    ([HUGE, -HUGE, HUGE, 0.0], 0),      # mixed signs: log 2
    ([HUGE, -HUGE, HUGE, 0.0], 1),      # target at -3e38: 6e38
    ([-HUGE] * 9, 3),
    ([100.0, 0.0], 0),                  # dominant target: e^-100, read 0.0 before
    ([30.0, 0.0, -5.0], 0),
    ([700.0, 0.0], 0),                  # e^-700 ~ 1e-304, still a normal double
    (list(np.linspace(-50, 50, 37)), 36),
    ([1e4, -1e4], 1),
]


@pytest.mark.parametrize("row,target", CE_CASES)
def test_cross_entropy_exact_for_any_finite_logits(row, target):
    """Exact to float32 exp rounding: rx_expf is within 1.5 ulp, so the sum
    of e^(l - max) and the loss's log-sum part carry a relative error
    below 1e-6."""
    for T in (1, 3):  # the row alone and among others
        logits = np.tile(np.asarray(row, np.float32), (T, 1))
        targets = np.full(T, target, np.int32)
        loss = rx.cross_entropy_forward(logits, targets)
        want = ref_ce(logits[0], target)
        assert want > 0.0
        assert loss > 0.0
        assert abs(loss - want) <= 1e-6 * want, (loss, want)
        loss2, d = rx.cross_entropy_backward(logits, targets)
        assert loss2 == loss
        assert np.isfinite(d).all()
        assert abs(float(d.astype(np.float64).sum())) <= 1e-6


def test_cross_entropy_finds_the_maximum_anywhere():
    """The maximum (gap 30) at every position of a 77-wide row -- in each
    lane and block of the vectorised scans and sums, and in their tails --
    is the one left out of the tail sum: else the loss of its own target
    would be log 2, not ~76 e^-30."""
    V = 77
    base = np.random.default_rng(0).uniform(-1.0, 0.0, V).astype(np.float32)
    for p in range(V):
        row = base.copy()
        row[p] = 30.0
        for target in (p, (p + 1) % V):
            want = ref_ce(row, target)
            loss = rx.cross_entropy_forward(row[None, :], np.array([target], np.int32))
            assert abs(loss - want) <= 1e-6 * want, (p, target, loss, want)


def test_cross_entropy_never_zero_for_an_imperfect_row():
    """A gap beyond ~745 underflows e^-gap even in float64; the row still
    counts as imperfect (its loss is the smallest positive double)."""
    logits = np.array([[1e4, -1e4, 0.0]], np.float32)
    assert rx.cross_entropy_forward(logits, np.array([0], np.int32)) > 0.0


def test_val_bpb_never_zero(tmp_path):
    tr = Trainer(TrainOptions(preset="tiny", data=corpus(str(tmp_path)), model=dict(SMALL),
                              batch=2, seq_len=24, steps=1, eval_tokens=48,
                              cache_dir=str(tmp_path / "c")), None)
    tr.model.params["head"][...] = 0.0
    tr.model.params["ln_out_b"][...] = 0.0
    tr.model.params["ln_out_w"][...] = 0.0
    tr.model.params["head"][0, :] = HUGE  # every logit a huge constant
    ev = tr.evaluate()
    assert abs(ev["val_loss"] - math.log(256)) < 1e-5
    assert ev["val_bpb"] > 0


# ----------------------------------------------------------------- divergence


def _opts(tmp_path, **kw):
    base = dict(preset="tiny", data=corpus(str(tmp_path)), model=dict(SMALL), batch=2,
                seq_len=24, steps=6, eval_tokens=48, warmup_steps=0, lr=3e-3, threads=2,
                cache_dir=str(tmp_path / "cache"))
    base.update(kw)
    return TrainOptions(**base)


def test_guard_bounds():
    g = DivergenceGuard(256)
    for loss in (5.5, 5.0, 4.0, 3.9, 3.8, 3.7):
        g.check_loss(loss, 1)
    with pytest.raises(Divergence, match="uniform"):
        DivergenceGuard(256).check_loss(math.log(256) + 1.01, 1)
    with pytest.raises(Divergence, match="nan"):
        g.check_loss(float("nan"), 8)
    with pytest.raises(Divergence, match="gradient"):
        g.check_grad_norm(float("inf"), 8)
    with pytest.raises(Divergence, match="gradient norm is inf"):
        g.check_loss(3.7, 8, float("inf"))


def test_every_init_starts_below_the_uniform_bound(tmp_path):
    """The uniform bound must never stop a healthy run at its first step."""
    from rwkvx_c.model.init import SCHEMES
    for scheme in SCHEMES:
        tr = Trainer(_opts(tmp_path, init=scheme, steps=1), None)
        tr.step()


def test_divergence_without_checkpoint_says_so(tmp_path):
    out = str(tmp_path / "run")
    tr = Trainer(_opts(tmp_path, lr=10.0, steps=50), out)
    with pytest.raises(Divergence) as e:
        tr.run()
    assert "no checkpoint was saved" in str(e.value)
    assert not os.path.exists(os.path.join(out, CHECKPOINT))


def _healthy_then_blow_up(tmp_path, on_divergence):
    out = str(tmp_path / "run")
    tr = Trainer(_opts(tmp_path, steps=40, save_every=2, on_divergence=on_divergence), out)
    tr.step()
    tr.step()
    tr.save()
    with open(os.path.join(out, CHECKPOINT), "rb") as f:
        good = f.read()
    tr.opts.lr = 1e4   # what a too-high --lr does, from a known-good checkpoint
    with pytest.raises(Divergence) as e:
        tr.run()
    with open(os.path.join(out, CHECKPOINT), "rb") as f:
        assert f.read() == good
    return out, tr, str(e.value)


def test_divergence_stops_and_keeps_the_checkpoint(tmp_path):
    out, _tr, msg = _healthy_then_blow_up(tmp_path, "stop")
    assert "checkpoint of step 2" in msg and "is kept" in msg and "--on-divergence" in msg
    tensors, _, state = read_checkpoint(os.path.join(out, CHECKPOINT))
    assert state["step"] == 2
    assert all(np.isfinite(t).all() for t in tensors.values())


def test_divergence_rollback_lowers_the_lr(tmp_path):
    out, _tr, msg = _healthy_then_blow_up(tmp_path, "rollback")
    assert f"{MAX_ROLLBACKS} rollbacks did not help" in msg
    with open(os.path.join(out, LOG)) as f:
        rows = [json.loads(line) for line in f]
    rb = [r for r in rows if "rollback" in r]
    assert [r["lr_scale"] for r in rb] == [ROLLBACK_LR_FACTOR ** k
                                          for k in range(1, MAX_ROLLBACKS + 1)]
    assert all(r["step"] == 2 for r in rb)


def test_save_refuses_a_non_finite_model(tmp_path):
    out = str(tmp_path / "run")
    tr = Trainer(_opts(tmp_path), out)
    tr.step()
    tr.model.params["head"][0, 0] = np.nan
    with pytest.raises(Divergence, match="not finite"):
        tr.save()
    assert not os.path.exists(os.path.join(out, CHECKPOINT))


# ----------------------------------------------------------------------- leaks

LEAK = """
import os, threading, numpy as np, rwkvx_c as rx
from hostile import SMALL
m = rx.RxPtModel(dict(SMALL, n_embd=64, head_size=32), seed=0, precision="{precision}")
x = np.random.default_rng(0).integers(0, 256, (1, {T})).astype(np.int32)
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
def step():
    m.forward(x); m.backward(x)
for i in range(20):  # warm: arenas, the OpenMP pool
    t = threading.Thread(target=step); t.start(); t.join()
    rx.set_num_threads(1 + i % 2); step()
r0 = rss()
for i in range({n}):
    t = threading.Thread(target=step); t.start(); t.join()
r1 = rss()
for i in range({n}):
    rx.set_num_threads(1 + i % 2); step()
r2 = rss()
print(r1 - r0, r2 - r1)
"""


@pytest.mark.parametrize("precision,T", [("fp32", 40), ("bf16", 400)])
def test_rss_flat_over_short_lived_threads(precision, T):
    """Each thread that ran a GEMM used to keep its packing buffers after it
    ended: the fp32 ones (~0.7 MiB) grew RSS by ~200 MiB over 300 threads,
    and the bf16 GEMM's packed operands (~0.3 MiB at T = 400) by ~80 MiB.
    Now the buffers die with the thread; allow 16 MiB for malloc's
    per-thread arenas."""
    r = python(LEAK.format(n=300, precision=precision, T=T), timeout=300)
    assert r.returncode == 0, r.stderr
    grow_threads, grow_flips = (int(v) for v in r.stdout.split())
    assert grow_threads < 16 << 20, f"RSS grew {grow_threads / 2**20:.1f} MiB over 300 threads"
    assert grow_flips < 16 << 20, f"RSS grew {grow_flips / 2**20:.1f} MiB over thread flips"


# ---------------------------------------------------------------- API abuse


@pytest.mark.parametrize("n,exc", [(10 ** 9, ValueError), (-1, ValueError),
                                   (rx.MAX_THREADS + 1, ValueError), (2.5, TypeError),
                                   (True, TypeError), (10 ** 30, ValueError)])
def test_set_num_threads_refuses_before_openmp(n, exc):
    before = rx.get_num_threads()
    with pytest.raises(exc):
        rx.set_num_threads(n)
    assert rx.get_num_threads() == before


def test_reinit_is_refused():
    m = rx.RxPtModel(SMALL)
    x = np.zeros((1, 8), np.int32)
    m.forward(x)
    with pytest.raises(RuntimeError, match="already initialised"):
        m.__init__(dict(SMALL, n_embd=64, head_size=32))
    assert m.forward(x).shape == (1, 8, 256)


RACE = """
import sys, threading, numpy as np, rwkvx_c as rx
sys.setswitchinterval(1e-4)   # the writer's busy loop hands the GIL back often
from hostile import SMALL
m = rx.RxPtModel(SMALL)
x = np.zeros((4, 64), np.int32)
stop = False
def writer():
    while not stop:
        x[:, ::3] = 1 << 28    # far past the embedding
        x[:, ::3] = 1
t = threading.Thread(target=writer); t.start()
ok = bad = 0
st = rx.InferState(m, max_len=10 ** 6)
try:
    for i in range(40):
        for call in (lambda: m.forward(x), lambda: m.backward(x),
                     lambda: st.forward(x[0])):
            try:
                call(); ok += 1
            except ValueError:
                bad += 1
finally:
    stop = True; t.join()
print(ok, bad)
"""


def test_concurrent_writer_to_tokens_cannot_crash():
    """The C core checks the ids it actually reads (copy, then check), so a
    thread scribbling on the array mid-call gives a ValueError, not a read
    of memory 2**28 rows past the embedding."""
    r = python(RACE, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


# ------------------------------------------------------------ memory up front


def test_estimate_params_bounds_the_model():
    from rwkvx_c.train import PRESETS
    for p in PRESETS.values():
        n = rx.RxPtModel(p["model"]).n_params
        est = memcheck.estimate_params(p["model"])
        assert n <= est <= 1.05 * n, (n, est)


_ACTS_PROBE = """
import numpy as np
import safetensors.numpy
import rwkvx_c as rx
from rwkvx_c.model import memory as memcheck
CFG, B, T, SEQ_SHARE = %r
m = rx.RxPtModel(CFG)
per, seq = memcheck.acts_bytes(m)
assert per <= memcheck.ROUGH_MARGIN * memcheck.rough_bytes_per_token(CFG), per
V = CFG["vocab_size"]
if memcheck._heap_in_use() is None:
    print("no mallinfo2")
    raise SystemExit(0)
x = np.zeros((B, T), np.int32)
small = np.zeros((1, CFG["chunk_size"]), np.int32)
grown = []
for _ in range(3):   # x first: its threads' GEMM scratch is not per token
    for t in (x, small):
        m.forward(t, return_logits=False)
        m.backward(t)
    h0 = memcheck._heap_in_use()
    m.forward(x, return_logits=False)
    m.backward(x)
    grown.append(memcheck._heap_in_use() - h0)
# a one-time allocation (a thread's first scratch) can only add to a round
grown = min(grown)
want = per * (x.size - small.size) + seq * (B - 1) + memcheck.head_bytes(V, x.size) - \
    memcheck.head_bytes(V, small.size)
assert abs(grown - want) <= 0.1 * want, (grown, want)
# the sequences' own share is what a token's figure alone would miss
assert seq * (B - 1) >= SEQ_SHARE * want, (seq, want)
"""


# widths whose buffers are kilobytes a token: at SMALL's, malloc's rounding
# is a tenth of the figure
WIDE = dict(SMALL, n_embd=256, n_head=4, head_size=64, ffn_dim=1024, Dw=32, Da=32, Dg=32,
            Dv=32, chunk_size=32)


@pytest.mark.parametrize("cfg,batch,seq_len,seq_share", [(SMALL, 3, 256, 0.0),
                                                         (WIDE, 8, 32, 0.01)])
def test_acts_bytes_predict_a_large_batch(cfg, batch, seq_len, seq_share):
    """The bytes a token and a sequence costs, measured at one and two small
    sequences, predict the heap growth of a batch of many more tokens to
    10%; with heads of 64 the sequences' own share (each head's WKV state)
    is 2% of it at batch 8. In a fresh process:
    malloc's mmap threshold and arenas depend on what the process allocated
    before."""
    _heap_probe(_ACTS_PROBE, (cfg, batch, seq_len, seq_share))


def _heap_probe(src, args):
    """Runs the probe src % (args,) in a fresh process (malloc's mmap
    threshold and arenas depend on what the process allocated before); a
    skip where glibc has no mallinfo2 to read the heap with."""
    r = python(src % (args,))
    assert r.returncode == 0, r.stderr
    if "no mallinfo2" in r.stdout:
        pytest.skip("no mallinfo2")


_SHARED_PROBE = """
import rwkvx_c as rx
from rwkvx_c.model import memory as memcheck
if memcheck._heap_in_use() is None:
    print("no mallinfo2")
    raise SystemExit(0)
cfg, recompute = %r
N = cfg["head_size"]
one = 4 * cfg["n_head"] * (N * N + 2 * N)   # a sequence's part of rx_wkv7_work_floats
per_seq = memcheck._measured_bytes(rx.RxPtModel(cfg, recompute=recompute, init=False))[1]
assert 0.9 * one <= per_seq <= 1.5 * one, (per_seq, one)
"""


@pytest.mark.parametrize("recompute", [False, True])
def test_the_blocks_of_a_step_share_one_wkv_scratch(recompute):
    """The WKV recurrence's scratch is the step's, one for every RWKV block
    (each block's forward and backward write it before reading it), and
    only its forward part, each head's state ([N][N] and [2][N] floats), is
    per sequence: the backward's chunk of recomputed states ([65][N][N]) is
    per thread, a head at a time in each. So a second sequence costs one
    head set of states (16 heads, four blocks here, with and without
    recompute): not one a block (4x), nor a chunk a head (65x). In a fresh
    process, as the run measures."""
    cfg = dict(WIDE, n_embd=1024, n_head=16, ffn_dim=4096, n_rwkv_layer=memcheck.TWIN_BLOCKS,
               n_attn_layer=0)
    _heap_probe(_SHARED_PROBE, (cfg, recompute))


def test_memory_check_names_size_and_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(memcheck, "available_bytes", lambda: 64 << 20)
    with pytest.raises(TrainError, match=r"GiB.*--batch or --seq-len"):
        Trainer(_opts(tmp_path, batch=512, seq_len=64), None)


def test_huge_model_in_checkpoint_header_refused_before_allocation(tmp_path):
    from rwkvx_c.sample import load_model
    huge = dict(SMALL, n_embd=1 << 15, n_head=1 << 9, head_size=64, ffn_dim=1 << 15,
                n_rwkv_layer=8)   # every tensor valid, 5e10 parameters in all
    p = str(tmp_path / "huge.safetensors")
    save_checkpoint(p, {"emb": np.zeros((256, 4), np.float32)}, huge, {})
    t = time.perf_counter()
    with pytest.raises(CheckpointError, match="needs about"):
        load_model(p)
    assert time.perf_counter() - t < 5


# -------------------------------------------------------------------- files


def _small_checkpoint(path):
    m = rx.RxPtModel(SMALL)
    save_checkpoint(path, m.params, m.config, {"step": 3, "note": "x"})
    with open(path, "rb") as f:
        return f.read()


def test_no_single_bit_flip_is_accepted(tmp_path):
    """Seeded: every bit of the length prefix, 3000 bits of the header, 300
    of the data; each flipped copy must be refused."""
    blob = _small_checkpoint(str(tmp_path / "c.safetensors"))
    hlen = int.from_bytes(blob[:8], "little")
    parse_checkpoint(blob)
    rng = np.random.default_rng(16)
    bits = list(range(64)) + list(rng.integers(64, 8 * (8 + hlen), 3000)) + \
        list(rng.integers(8 * (8 + hlen), 8 * len(blob), 300))
    for b in bits:
        bad = bytearray(blob)
        bad[b // 8] ^= 1 << (b % 8)
        with pytest.raises(CheckpointError):
            parse_checkpoint(bytes(bad))


def test_version_1_files_still_read(tmp_path):
    """Files written before the header checksum still load."""
    import zlib
    blob = _small_checkpoint(str(tmp_path / "c.safetensors"))
    hlen = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + hlen])
    meta = header["__metadata__"]
    del meta["header_crc32"]
    meta["version"] = "1"
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    old = len(h).to_bytes(8, "little") + h + blob[8 + hlen:]
    assert zlib.crc32(blob[8 + hlen:]) == int(meta["data_crc32"], 16)
    _tensors, config, state = parse_checkpoint(old)
    assert state["step"] == 3 and config == rx.RxPtModel(SMALL).config


def test_orphan_temp_files_removed_on_start(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    for name in (".checkpoint.safetensors.tmp4242", ".log.jsonl.tmp4242", ".loss.png.tmp4242.png",
                 "log.jsonl.tmp", "loss.png.tmp.png"):   # the last two: earlier versions' names
        (out / name).write_bytes(b"torn")
    (out / "notes.txt").write_text("mine")
    Trainer(_opts(tmp_path), str(out)).close()
    # and no .lock once closed; the run's options are saved at its start
    assert sorted(os.listdir(out)) == ["config.toml", "notes.txt"]


def test_second_resume_of_a_run_is_refused(tmp_path):
    data = corpus(str(tmp_path), 20000)
    common = ("--preset", "tiny", "--data", data, "--batch", "2", "--seq-len", "32",
              "--cache-dir", "cache", "--out", "run")
    r = cli("train", "--steps", "2", *common, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from rwkvx_c.run.lock import RunLock; "
         "held = RunLock(sys.argv[1]); print('locked', flush=True); time.sleep(60)",
         str(tmp_path / "run")], env=__import__("hostile").env(), stdout=subprocess.PIPE,
        text=True, cwd=str(tmp_path))
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = cli("train", "--resume", "--steps", "4", *common, cwd=str(tmp_path))
        err = no_traceback(r)
        assert r.returncode == 1 and "in use by another rwkvx-c process" in err
        assert f"pid {holder.pid}" in err
    finally:
        holder.kill()
        holder.wait()
    r = cli("train", "--resume", "--steps", "3", *common, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr


def _fsize_limit(n):
    def f():
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return f


def test_disk_full_is_one_line_and_keeps_the_checkpoint(tmp_path):
    """A file size limit stands in for a full disk (the write fails with
    EFBIG instead of ENOSPC, through the same path)."""
    data = corpus(str(tmp_path), 20000)
    common = ("--preset", "tiny", "--data", data, "--batch", "2", "--seq-len", "32",
              "--cache-dir", "cache", "--out", "run")
    assert cli("train", "--steps", "2", *common, cwd=str(tmp_path)).returncode == 0
    ck = tmp_path / "run" / CHECKPOINT
    good = ck.read_bytes()
    r = cli("train", "--resume", "--steps", "4", *common, cwd=str(tmp_path),
            preexec_fn=_fsize_limit(1 << 20))
    err = no_traceback(r)
    assert r.returncode == 1 and "previous checkpoint" in err, err
    lines = err.strip().splitlines()   # progress lines, then the error
    assert lines[-1].startswith("rwkvx-c: error:") and err.count("error") == 1, err
    assert ck.read_bytes() == good
    assert [n for n in os.listdir(tmp_path / "run") if "tmp" in n] == []


# ---------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    data = corpus(str(d), 20000)
    t = time.monotonic()
    r = cli("train", "--preset", "tiny", "--data", data, "--batch", "2", "--seq-len", "32",
            "--steps", "12", "--cache-dir", "cache", "--out", "run", cwd=str(d))
    assert r.returncode == 0, r.stderr
    return d, r, time.monotonic() - t


def test_progress_without_a_terminal_is_plain_lines(trained):
    """12 steps used to write 12+ carriage-return updates into a log; now
    a line at most every PLAIN_INTERVAL_S seconds, plus the last."""
    from rwkvx_c.util.progress import PLAIN_INTERVAL_S
    _, r, seconds = trained
    err = r.stderr.decode()
    assert "\r" not in err
    assert len(err.splitlines()) <= seconds / PLAIN_INTERVAL_S + 1, err


def test_sample_non_utf8_prompt_and_broken_pipe(trained):
    d, _, _ = trained
    prompt = b"def \xff\xfe("
    r = subprocess.run([sys.executable, "-m", "rwkvx_c", "sample", "run", "--prompt", prompt,
                        "--max-new-tokens", "5"], env=__import__("hostile").env(),
                       capture_output=True, cwd=str(d), timeout=120)
    no_traceback(r)
    assert r.returncode == 0 and r.stdout.startswith(prompt)
    sh = (f"{sys.executable} -m rwkvx_c sample run --max-new-tokens 2000 --temperature 1 "
          "| head -c 10")
    r = subprocess.run(["bash", "-c", sh], env=__import__("hostile").env(), capture_output=True,
                       cwd=str(d), timeout=120)
    err = no_traceback(r)
    assert "Exception ignored" not in err and len(r.stdout) == 10, err


def test_sample_tiny_temperature(trained):
    d, _, _ = trained
    r = cli("sample", "run", "--temperature", "1e-300", "--max-new-tokens", "3", cwd=str(d))
    no_traceback(r)
    assert r.returncode == 0


def test_threads_flag_too_large_is_one_line(trained):
    d, _, _ = trained
    for cmd in (["sample", "run"], ["train", "--resume", "--out", "run", "--steps", "31"]):
        r = cli(*cmd, "--threads", "1000000000", cwd=str(d))
        err = no_traceback(r)
        assert r.returncode == 1 and "at most" in err and len(err.splitlines()) == 1, err


_SLOW_FINALIZER = """
import sys, time
import rwkvx_c.run.lock as lock
from rwkvx_c.cli import main
def held(self, release=lock.RunLock.__del__):
    open("in_finalizer", "w").close()
    time.sleep(60)
    release(self)
lock.RunLock.__del__ = held
sys.argv = ["rwkvx-c", "train", "--preset", "tiny", "--data", sys.argv[1], "--batch", "2",
            "--seq-len", "32", "--steps", "100000", "--cache-dir", "cache", "--out", "run"]
sys.exit(main())
"""


def test_a_second_ctrl_c_inside_a_finalizer_ends_the_run_at_once(tmp_path):
    # the run folder's lock is let go by a finalizer held open here for a
    # minute; a second Ctrl-C arriving in it (where Python prints a
    # KeyboardInterrupt and drops it) still ends the process, with 130
    data = corpus(str(tmp_path), 20000)
    p = subprocess.Popen([sys.executable, "-c", _SLOW_FINALIZER, data],
                         env=__import__("hostile").env(), cwd=str(tmp_path),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in p.stdout:
        if b"train  batch" in line:
            break
    p.send_signal(signal.SIGINT)
    marker = tmp_path / "in_finalizer"
    for _ in range(600):
        if marker.exists() or p.poll() is not None:
            break
        time.sleep(0.1)
    assert marker.exists(), p.communicate()[1].decode()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)   # the finalizer alone would hold it 60 s
    assert p.returncode == 130, err.decode()
    assert b"Traceback" not in err, err.decode()


@pytest.mark.parametrize("gap", [0.0, 0.05, 0.5])
def test_double_ctrl_c_ends_cleanly(tmp_path, gap):
    # the second Ctrl-C `gap` seconds after the first: in the clean stop's
    # evaluation, its checkpoint, the release of the run folder's lock (a
    # finalizer, where a KeyboardInterrupt would be printed and dropped) or
    # after it; wherever it lands the run ends with 130 and no traceback
    data = corpus(str(tmp_path), 20000)
    p = subprocess.Popen([sys.executable, "-m", "rwkvx_c", "train", "--preset", "tiny",
                          "--data", data, "--batch", "2", "--seq-len", "32", "--steps",
                          "100000", "--cache-dir", "cache", "--out", "run"],
                         env=__import__("hostile").env(), cwd=str(tmp_path),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in p.stdout:
        if b"train  batch" in line:
            break
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    time.sleep(gap)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err.decode()
    assert b"Traceback" not in err, err.decode()
    ck = tmp_path / "run" / "checkpoint.safetensors"
    if ck.exists():   # cut or not, what stands under the name is whole
        assert safetensors.numpy.load_file(str(ck))
