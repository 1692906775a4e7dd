"""Experiment trackers (--log-to, rwkvx_c.train.trackers), read back with
their own libraries: TensorBoard's EventAccumulator holds every logged
step's loss and each val_bpb; a W&B offline run and an MLflow file-store
run hold the same series; a failing tracker is a warning, never a stopped
run; a missing library is one line naming the extra. Nothing reaches the
network (W&B offline, MLflow on files)."""
import glob
import json
import os
import struct

import numpy as np
import pytest
from test_train import _opts

from rwkvx_c.cli import main
from rwkvx_c.errors import RwkvxWarning
from rwkvx_c.train import Trainer, TrainError
from rwkvx_c.train import trackers as trk

STEPS = 6


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    for k in list(os.environ):
        if k.startswith(("WANDB_", "MLFLOW_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


def _run(tmp_path, log_to, out="run", **kw):
    out = str(tmp_path / out)
    Trainer(_opts(tmp_path, steps=STEPS, eval_every=2, log_to=log_to, **kw), out).run()
    with open(os.path.join(out, "log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return out, rows


def _series(rows, key):
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


def test_tensorboard_holds_every_loss_and_val_bpb(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, rows = _run(tmp_path, "tensorboard")
    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    for key in ("loss", "val_bpb", "val_loss", "lr"):
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        want = _series(rows, key)
        assert [s for s, _ in got] == [s for s, _ in want], key
        # simple_value is a float32
        assert np.array_equal(np.float32([v for _, v in got]), np.float32([v for _, v in want]))
    assert len(_series(rows, "loss")) == STEPS and len(_series(rows, "val_bpb")) >= 3
    if pytest.importorskip("matplotlib"):
        assert acc.Tags()["images"] == ["loss_plot"]


def _wandb_history(out):
    """The history rows of the offline W&B run in out: its .wandb file is a
    LevelDB-style log of protobuf Records (W&B's own format), read here
    with W&B's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    block, pos, records, part = 32768, 7, [], b""   # a 7-byte file header
    while pos + 7 <= len(data):
        if block - pos % block < 7:          # a block's tail too short for a header
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                   # a whole record, or its last piece
            records.append(part)
            part = b""
    out_rows = []
    for raw in records:
        r = pb.Record()
        r.ParseFromString(raw)
        if r.WhichOneof("record_type") == "history":
            out_rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in r.history.item})
    return out_rows


@pytest.mark.parametrize("store", ["default", "file"])
def test_wandb_offline_and_mlflow_hold_the_same_series(tmp_path, monkeypatch, store):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient
    out = str(tmp_path / "run")
    uri = f"sqlite:///{out}/mlflow.db"
    if store == "file":   # MLflow's file store, which it keeps behind a switch
        uri = "file://" + str(tmp_path / "mlruns")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out, rows = _run(tmp_path, "wandb,mlflow", sample_every=3, sample_prompt=["def "])
    history = _wandb_history(out)
    client = MlflowClient(tracking_uri=uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "rwkvx_c"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "run" and run.data.params["lr"] == "0.003"
    assert run.data.params["model.n_embd"] == "32"
    for key in ("loss", "val_loss", "val_bpb", "grad_norm"):
        want = _series(rows, key)
        ml = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        wb = [(h["_step"], h[key]) for h in history if key in h]
        assert ml == want and wb == want, key
    assert any(h.get("loss_plot/_type") == "image-file" for h in history)
    assert "loss_plot.png" in [a.path for a in client.list_artifacts(run.info.run_id)]
    # --sample-every's generations: an HTML panel by step, a text artifact per step
    assert [h["_step"] for h in history if h.get("samples/_type") == "html-file"] == [0, 3, 6]
    texts = [a.path for a in client.list_artifacts(run.info.run_id, "samples")]
    assert texts == [f"samples/step-{s:07d}.txt" for s in (0, 3, 6)], texts


def test_a_failing_tracker_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")

    def broken(self, step, values):
        raise OSError("disk on fire")
    monkeypatch.setattr(trk._TensorBoard, "scalars", broken)
    with pytest.warns(RwkvxWarning, match="tracker tensorboard failed.*disk on fire"):
        _, rows = _run(tmp_path, "tensorboard")
    assert len(_series(rows, "loss")) == STEPS


def test_a_slow_tracker_never_holds_up_a_step(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    import threading
    release = threading.Event()

    def stuck(self, step, values):
        release.wait(30)
    monkeypatch.setattr(trk._TensorBoard, "scalars", stuck)
    monkeypatch.setattr(trk, "QUEUE_ROWS", 2)
    monkeypatch.setattr(trk, "CLOSE_WAIT_S", 0.5)
    with pytest.warns(RwkvxWarning, match="rows behind"):
        _, rows = _run(tmp_path, "tensorboard")
    release.set()
    assert len(_series(rows, "loss")) == STEPS


def test_a_missing_library_names_its_extra(tmp_path, monkeypatch):
    real = trk.importlib.util.find_spec
    monkeypatch.setattr(trk.importlib.util, "find_spec",
                        lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(TrainError, match=r'pip install "rwkvx_c\[wandb\]"'):
        Trainer(_opts(tmp_path, log_to="wandb"), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    with pytest.raises(TrainError, match="unknown tracker 'neptune'"):
        _opts(tmp_path, log_to="tensorboard,neptune").resolved()


def test_log_to_from_the_command_line(tmp_path):
    pytest.importorskip("tensorboard")
    out = str(tmp_path / "cli")
    assert main(["train", "--out", out, "--preset", "tiny", "--data", _opts(tmp_path).data,
                 "--steps", "2", "--batch", "2", "--seq-len", "16", "--eval-tokens", "32",
                 "--log-to", "tensorboard", "--no-progress",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    assert glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))
