"""Data-parallel training over MPI (rwkvx_c/train/distributed.py).

Without a launcher: how one is recognised, and that a plain run never
imports mpi4py. With mpiexec (skipped when mpi4py or mpiexec is missing):
2 ranks give the 1-process losses to float32 reduction noise, reruns are bit
identical, resume works with the same number of ranks and is refused with
another, and a rank that raises or dies ends the whole job (no hang).
Runs are kept tiny (seq_len 32, batch 4, a few steps).
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import rwkvx_c
from rwkvx_c.train.distributed import DistributedError, ProcessGroup, mpi_requested

ROOT = os.path.dirname(os.path.dirname(rwkvx_c.__file__))
FAST = ["--preset", "tiny", "--seq-len", "32", "--batch", "4", "--eval-tokens", "128",
        "--seed", "1", "--no-progress"]
TIMEOUT = 240  # seconds; a hang fails the test instead of blocking the suite


@pytest.mark.parametrize("env,want", [
    ({}, False),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, False),   # mpiexec -n 1 is a plain run
    ({"PMI_SIZE": "4"}, True),
    ({"PMIX_RANK": "0"}, True),
    ({"PMIX_RANK": "0", "SLURM_STEP_NUM_TASKS": "1"}, False),
    ({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}, False),  # a batch script, no launcher
    ({"OMPI_COMM_WORLD_SIZE": "2", "RWKVX_MPI": "0"}, False),
    ({"RWKVX_MPI": "1"}, True),
])
def test_launcher_detection(env, want):
    assert mpi_requested(env) is want


def test_bad_force_value():
    with pytest.raises(DistributedError, match="RWKVX_MPI"):
        mpi_requested({"RWKVX_MPI": "maybe"})


def test_one_process_group_is_a_no_op():
    g = ProcessGroup()
    grads = np.arange(5, dtype=np.float32)
    assert g.average_grads(grads, 1.5) == 1.5 and grads.tolist() == [0, 1, 2, 3, 4]
    assert g.rows(6) == (0, 6) and g.split(7) == (0, 7)
    assert g.default_threads() is None and g.sum_values(1.0, 2) == (1.0, 2)


def test_plain_run_never_imports_mpi4py(tmp_path):
    code = ("import sys\n"
            "from rwkvx_c.train import Trainer, TrainOptions\n"
            "tr = Trainer(TrainOptions(preset='tiny', steps=1, batch=2, seq_len=16, "
            f"eval_tokens=32, data={str(_corpus(tmp_path))!r}, cache_dir={str(tmp_path)!r}))\n"
            "tr.step(); tr.evaluate()\n"
            "assert 'mpi4py' not in sys.modules, 'mpi4py was imported'\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "RWKVX_MPI"))}
    r = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=TIMEOUT, check=False,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def _corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    if not p.exists():
        rng = np.random.default_rng(0)
        p.write_text("".join(rng.choice(list("abcdefgh \n"), 20000)))
    return p


def _mpiexec():
    """mpiexec of this environment (the venv's bin first), or skip."""
    pytest.importorskip("mpi4py")
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    exe = here if os.access(here, os.X_OK) else shutil.which("mpiexec")
    if exe is None:
        pytest.skip("mpiexec not found")
    return exe


def _launch(n, args, tmp_path, script=None, data=None):
    """Run `rwkvx-c train ARGS` (or a script) on n ranks over data (default:
    the text corpus); returns the CompletedProcess."""
    exe = _mpiexec()
    version = subprocess.run([exe, "--version"], capture_output=True, text=True,
                             check=False).stdout
    flags = []
    # no OMP_NUM_THREADS: each rank takes its share of the cores (distributed._share_of_cores)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = ROOT
    if "Open MPI" in version:
        flags = ["--oversubscribe"]  # CI machines may have fewer cores than ranks
        # containers often run as root, which Open MPI refuses unless told
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    prog = [sys.executable, "-m", "rwkvx_c", "train"] if script is None else \
        [sys.executable, str(script)]
    cmd = [exe, "-n", str(n)] + flags + prog + args + ["--data", str(data or _corpus(tmp_path)),
                                                        "--cache-dir", str(tmp_path / "cache")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=tmp_path, check=False)


def _losses(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["loss"] for r in rows if "loss" in r], rows


def test_two_ranks_match_one_process_and_resume(tmp_path):
    one, two, again = (str(tmp_path / d) for d in ("one", "two", "again"))
    r = _launch(1, ["--out", one, "--steps", "4"] + FAST, tmp_path)
    assert r.returncode == 0, r.stderr
    r = _launch(2, ["--out", two, "--steps", "4"] + FAST, tmp_path)
    assert r.returncode == 0, r.stderr
    share = max(1, len(os.sched_getaffinity(0)) // 2)  # --oversubscribe leaves ranks unbound
    assert f"2 ranks x {share} threads per rank" in r.stdout
    assert r.stdout.count("checkpoint ") == 1  # rank 0 alone reports
    l1, rows1 = _losses(one)
    l2, rows2 = _losses(two)
    assert {row["world_size"] for row in rows1} == {1}
    assert {row["world_size"] for row in rows2} == {2}
    # float32 gradient sums in another order: relative noise ~1e-7 per step, grown by
    # 4 steps of training; 1e-5 is the bound, well above that noise
    rel = np.abs(np.subtract(l1, l2)) / np.abs(l1)
    assert rel.max() <= 1e-5, rel
    v1 = [row["val_loss"] for row in rows1 if "val_loss" in row]
    v2 = [row["val_loss"] for row in rows2 if "val_loss" in row]
    assert np.allclose(v1, v2, rtol=1e-5, atol=0)
    # rank 0 alone writes: its checkpoint, log and plot (with matplotlib)
    # a finished run leaves no .lock
    want = ["checkpoint.safetensors", "config.toml", "log.jsonl"]
    if importlib.util.find_spec("matplotlib") is not None:
        want.append("loss.png")
    assert sorted(os.listdir(two)) == want

    r = _launch(2, ["--out", again, "--steps", "4"] + FAST, tmp_path)
    assert r.returncode == 0, r.stderr
    assert _losses(again)[0] == l2  # bit for bit with the same number of ranks

    r = _launch(2, ["--out", two, "--resume", "--steps", "6", "--no-progress"], tmp_path)
    assert r.returncode == 0, r.stderr
    l2b = _losses(two)[0]
    assert l2b[:4] == l2 and len(l2b) == 6 and "resumed at step 4" in r.stdout

    r = _launch(1, ["--out", two, "--resume", "--steps", "8", "--no-progress"], tmp_path)
    assert r.returncode == 1
    assert "trained on 2 process(es)" in r.stderr and "mpiexec -n 2" in r.stderr
    assert _losses(two)[0] == l2b  # the refused resume touched nothing


# beside this file: ROOT is the installed package's folder when it is not an editable install
CHAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "chat.jsonl")


@pytest.mark.parametrize("tune,data,adapter", [
    ("state", CHAT, None), ("lora", None, "lora"), ("lora", None, "rslora"),
    ("lora", None, "pissa"), ("lora", None, "miss"), ("lora", None, "dora"),
    ("full", None, "lisa")])
def test_fine_tunes_on_two_ranks_match_one_process(tmp_path, tune, data, adapter):
    """--tune state (on chat data, whose rows count different numbers of
    assistant tokens on each rank), --tune lora of each adapter kind with a
    trained group (--train-parts ln, MiSS's with the states; PiSSA and DoRA on a q8_0 base, whose
    residual and column norms every rank computes alike) and LISA (every
    rank draws the same blocks): the ranks average what trains, and 20
    steps give the one-process losses to float32 reduction noise."""
    base = str(tmp_path / "base")
    r = _launch(1, ["--out", base, "--steps", "3", "--precision", "fp32"] + FAST, tmp_path)
    assert r.returncode == 0, r.stderr
    seq = ["--seq-len", "96"] if tune == "state" else []   # a prompt and its reply
    lr = {"state": "0.05", "lora": "0.01"}.get(tune, "0.003")
    # fp32 throughout: the ranks' sums round apart by float32 ulps, which bf16
    # operands would turn into whole bf16 steps of a weight (--precision auto
    # is bf16 on some CPUs)
    args = ["--init-from", base, "--tune", tune, "--steps", "20", "--lr", lr,
            "--precision", "fp32"] + FAST + seq
    if tune == "lora":
        # MiSS with the states too: RWKV-PEFT's state tuning beside its DiSHA
        parts = "ln,state" if adapter == "miss" else "ln"
        args += ["--train-parts", parts, "--lora-r", "4", "--adapter", adapter]
    if adapter in ("pissa", "dora"):
        args += ["--base-dtype", "q8_0"]
    if adapter == "lisa":
        args += ["--lisa-layers", "1", "--lisa-interval", "5"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    r = _launch(1, ["--out", one] + args, tmp_path, data=data)
    assert r.returncode == 0, r.stderr
    r = _launch(2, ["--out", two] + args, tmp_path, data=data)
    assert r.returncode == 0, r.stderr
    assert "2 ranks x" in r.stdout
    l1, l2 = _losses(one)[0], _losses(two)[0]
    assert len(l1) == len(l2) == 20 and l1[-1] < l1[0]
    rel = np.abs(np.subtract(l1, l2)) / np.abs(l1)
    assert rel.max() <= 1e-5, rel
    # the checkpoint names its base; the resumed ranks rebuild the model from it
    r = _launch(2, ["--out", two, "--resume", "--steps", "22", "--no-progress"], tmp_path,
                data=data)
    assert r.returncode == 0, r.stderr
    l2b = _losses(two)[0]
    assert l2b[:20] == l2 and len(l2b) == 22 and "resumed at step 20" in r.stdout


def test_batch_must_divide_over_ranks(tmp_path):
    r = _launch(2, ["--out", str(tmp_path / "x"), "--steps", "1", "--preset", "tiny",
                    "--batch", "3"], tmp_path)
    assert r.returncode == 1
    assert "--batch 3 does not divide over 2 processes" in r.stderr
    assert r.stderr.count("error") == 1 and "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "x" / "checkpoint.safetensors")


@pytest.mark.parametrize("how", ["raise", "die", "interrupt"])
def test_a_failing_rank_ends_the_job(tmp_path, how):
    """Rank 1 raises (or is killed) at its second step while rank 0 waits in
    the gradient allreduce: the job must end with an error, not hang. A
    SIGINT on rank 1 alone stops both ranks at the same step, cleanly."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, signal, sys\n"
        "from rwkvx_c import cli\n"
        "from rwkvx_c.train import distributed\n"
        "from rwkvx_c.train import Trainer\n"
        "if distributed.world().rank == 1:\n"
        "    step = Trainer.step\n"
        "    def failing(self):\n"
        "        if self.step_count == 1:\n"
        f"            if {how!r} == 'die':\n"
        "                os.kill(os.getpid(), signal.SIGKILL)\n"
        f"            if {how!r} == 'interrupt':\n"
        "                os.kill(os.getpid(), signal.SIGINT)\n"
        "            else:\n"
        "                raise RuntimeError('injected failure')\n"
        "        return step(self)\n"
        "    Trainer.step = failing\n"
        "sys.exit(cli.main(['train'] + sys.argv[1:]))\n")
    out = tmp_path / "f"
    r = _launch(2, ["--out", str(out), "--steps", "5"] + FAST, tmp_path, script=script)
    if how == "interrupt":
        assert r.returncode == 130, r.stderr
        steps = [row["step"] for row in _losses(out)[1] if "loss" in row]
        assert 1 <= len(steps) < 5 and os.path.exists(out / "checkpoint.safetensors")
        return
    assert r.returncode != 0
    if how == "raise":
        assert "rank 1 of 2 failed (RuntimeError: injected failure)" in r.stderr
