"""Experiment trackers (--log-to tensorboard,wandb,mlflow), each through its
own library: every log row and evaluation as scalars by step, the resolved
options as the run's config / hyperparameters, and at the end the loss plot
as an image.

Rank 0 alone tracks. A tracker never holds up a step: the rows go through a
bounded queue to one worker thread, which opens the trackers and writes to
them; a tracker that fails is dropped with a warning (RwkvxWarning) and the
run goes on; a queue that fills up (a tracker slower than training) drops
rows with a warning. A library's own threads (W&B's, MLflow's) fail into
the same one warning line, never a traceback (_quiet_threads); tensorboard's
events are written by the worker itself, through tensorboard's record
writer without its writer thread. Where each writes:

  tensorboard  RUN/tensorboard/ (tensorboard's event file format; no torch)
  wandb        a W&B run in RUN/wandb/, project $WANDB_PROJECT or rwkvx_c;
               WANDB_MODE=offline is W&B's own offline mode
  mlflow       $MLFLOW_TRACKING_URI (a file store too, with MLflow's
               MLFLOW_ALLOW_FILE_STORE=true), else RUN/mlflow.db with the
               artifacts in RUN/mlartifacts/; experiment
               $MLFLOW_EXPERIMENT_NAME or rwkvx_c
"""
from __future__ import annotations

import html
import importlib.util
import io
import os
import queue
import socket
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from rwkvx_c.errors import RwkvxWarning, TrainError
from rwkvx_c.run.plot import plot_png
from rwkvx_c.run.rundir import Row

__all__ = ["TRACKERS", "Trackers", "open_trackers", "parse_trackers"]

# tracker -> (the module it needs, the extra that installs it)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}
PROJECT = "rwkvx_c"           # W&B project / MLflow experiment unless the environment names one
QUEUE_ROWS = 10_000           # rows waiting for a slow tracker before any is dropped
CLOSE_WAIT_S = 60.0           # how long the end of a run waits for the trackers to finish
SKIPPED = ("step", "world_size", "final")   # row keys that are no series
PLOT_NAME = "loss_plot"       # the plot's image ("loss" is the training loss's series)
SAMPLES_NAME = "samples"      # --sample-every's generations
MLFLOW_DB, MLFLOW_ARTIFACTS = "mlflow.db", "mlartifacts"   # in the run folder by default



def parse_trackers(spec: str | None) -> tuple[str, ...]:
    """The tracker names of a --log-to comma list; TrainError for an unknown one."""
    names = tuple(n.strip() for n in (spec or "").split(",") if n.strip())
    for n in names:
        if n not in TRACKERS:
            raise TrainError(f"unknown tracker {n!r} in --log-to; choose from "
                             f"{', '.join(TRACKERS)}")
    return names


def check_installed(names: Sequence[str]) -> None:
    """TrainError naming the extra of the first tracker whose library is missing."""
    for n in names:
        module, extra = TRACKERS[n]
        if importlib.util.find_spec(module) is None:
            raise TrainError(f"--log-to {n} needs the {module} package: "
                             f'pip install "rwkvx_c[{extra}]"')


class Backend(Protocol):
    """One tracker: scalars by step, an image, the end."""
    name: str

    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...
    def image(self, name: str, png: bytes) -> None: ...
    def text(self, step: int, name: str, text: str) -> None: ...
    def close(self) -> None: ...


def _series(row: Row) -> dict[str, float]:
    """The numeric values of a log row, by key (step and flags left out)."""
    return {k: float(v) for k, v in row.items() if k not in SKIPPED
            and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """config with nested dicts as dotted keys (model.n_embd)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, run_dir: str, config: Mapping[str, Any], run_name: str) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.hparams import summary_v2
        from tensorboard.summary.writer.record_writer import RecordWriter
        self._Event, self._Summary = Event, Summary
        # the event file EventFileWriter names, written here in the tracker's
        # worker: EventFileWriter's own thread prints a traceback on a failed write
        folder = os.path.join(run_dir, "tensorboard")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"events.out.tfevents.{int(time.time()):010d}."
                                    f"{socket.gethostname()}.{os.getpid()}.0")
        self.writer = RecordWriter(open(path, "wb"))  # noqa: SIM115 -- closed by close()
        self._add(Event(wall_time=time.time(), file_version="brain.Event:2"))
        hp = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
              for k, v in _flat(config).items()}
        self._add(Event(wall_time=time.time(), summary=summary_v2.hparams_pb(
            hp, trial_id=run_name)))

    def _add(self, event: Any) -> None:
        self.writer.write(event.SerializeToString())
        self.writer.flush()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        S = self._Summary
        self._add(self._Event(wall_time=time.time(), step=step, summary=S(
            value=[S.Value(tag=k, simple_value=v) for k, v in values.items()])))

    def image(self, name: str, png: bytes) -> None:
        w, h = _png_size(png)
        S = self._Summary
        img = S.Image(height=h, width=w, colorspace=4, encoded_image_string=png)
        self._add(self._Event(wall_time=time.time(), summary=S(
            value=[S.Value(tag=name, image=img)])))

    def text(self, step: int, name: str, text: str) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb
        self._add(self._Event(wall_time=time.time(), step=step, summary=text_pb(name, text)))

    def close(self) -> None:
        self.writer.close()


class _WandB:
    name = "wandb"

    def __init__(self, run_dir: str, config: Mapping[str, Any], run_name: str) -> None:
        import wandb
        self._wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name,
                              dir=run_dir, config=dict(config), reinit="create_new")

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def image(self, name: str, png: bytes) -> None:
        from PIL import Image
        self.run.log({name: self._wandb.Image(Image.open(io.BytesIO(png)))})

    def text(self, step: int, name: str, text: str) -> None:
        self.run.log({name: self._wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    name = "mlflow"

    def __init__(self, run_dir: str, config: Mapping[str, Any], run_name: str) -> None:
        import mlflow
        from mlflow.entities import Param
        here = os.path.abspath(run_dir)
        # MLflow's own default store is a SQLite database; this one lives in the run
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{here}/{MLFLOW_DB}"
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
            name, artifact_location=None if os.environ.get("MLFLOW_TRACKING_URI") else
            "file://" + os.path.join(here, MLFLOW_ARTIFACTS))
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        # MLflow keeps a parameter's value in at most 6,000 characters, 100 a batch
        params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric
        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step)
                                                    for k, v in values.items()])

    def image(self, name: str, png: bytes) -> None:
        from PIL import Image
        self.client.log_image(self.run_id, Image.open(io.BytesIO(png)), f"{name}.png")

    def text(self, step: int, name: str, text: str) -> None:
        self.client.log_text(self.run_id, text, f"{name}/step-{step:07d}.txt")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


BACKENDS: dict[str, Callable[[str, Mapping[str, Any], str], Backend]] = {
    "tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


def _png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


class Trackers:
    """The trackers of one run, fed from the training loop without waiting."""

    def __init__(self, names: Sequence[str], run_dir: str, config: Mapping[str, Any]) -> None:
        self.names = tuple(names)
        self.backends: list[Backend] = []
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(QUEUE_ROWS)
        self._dropped = False
        self._hook = _quiet_threads(self.names)
        self._thread = threading.Thread(target=self._work, name="rwkvx_c-trackers",
                                        args=(run_dir, dict(config)), daemon=True)
        self._thread.start()

    def log(self, row: Row) -> None:
        """Queues one log row (a step's or an evaluation's) for every tracker."""
        if "step" in row and _series(row):
            self._put(("row", row))

    def text(self, step: int, samples: Sequence[Mapping[str, str]]) -> None:
        """Queues --sample-every's generations of a step, one text of every
        prompt and its continuation, under SAMPLES_NAME."""
        body = "\n\n".join(f"{s['prompt']}{s['text']}" for s in samples)
        self._put(("text", (step, SAMPLES_NAME, body)))

    def close(self, rows: Sequence[Row] = (), title: str = "") -> None:
        """Sends the loss plot of the log `rows` (with matplotlib), ends every
        tracker and waits for them, at most CLOSE_WAIT_S seconds."""
        png = plot_png(rows, title) if rows else None
        if png is not None:
            self._put(("image", png))
        self._queue.put(None)
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            _warn(f"the trackers ({', '.join(self.names)}) did not finish within "
                  f"{CLOSE_WAIT_S:g} s; what they had not written is lost")
        elif threading.excepthook is self._hook:   # the trackers' threads are done
            threading.excepthook = threading.__excepthook__

    def _put(self, item: tuple[str, Any]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            if not self._dropped:
                self._dropped = True
                _warn(f"the trackers fell {QUEUE_ROWS:,} rows behind the run; rows are "
                      "dropped until they catch up (the log keeps every row)")

    def _work(self, run_dir: str, config: dict[str, Any]) -> None:
        name = os.path.basename(os.path.abspath(run_dir))
        for n in self.names:
            try:
                self.backends.append(BACKENDS[n](run_dir, config, name))
            except Exception as e:  # noqa: BLE001 -- a tracker must never stop the run
                _failed(n, e)
        while (item := self._queue.get()) is not None:
            for b in list(self.backends):
                self._send(b, *item)
        for b in list(self.backends):
            self._send(b, "close", None)

    def _send(self, b: Backend, kind: str, value: Any) -> None:
        """One row, image or the end to tracker b; on any failure a warning,
        and the tracker is dropped."""
        try:
            if kind == "row":
                b.scalars(int(value["step"]), _series(value))
            elif kind == "image":
                b.image(PLOT_NAME, value)
            elif kind == "text":
                b.text(*value)
            else:
                b.close()
        except Exception as e:  # noqa: BLE001 -- a tracker must never stop the run
            _failed(b.name, e)
            self.backends.remove(b)


def _quiet_threads(names: Sequence[str]) -> Callable[[Any], None]:
    """Installs (and returns) a threading.excepthook under which an
    exception ending a thread of a tracker's library (one raised in its
    code) is the tracker's one warning line, not a traceback on stderr;
    any other thread's goes to the hook there was."""
    before = threading.excepthook
    packages = tuple(os.sep + TRACKERS[n][0] + os.sep for n in names)

    def hook(args: Any) -> None:
        tb, where = args.exc_traceback, None
        while tb is not None:
            f = tb.tb_frame.f_code.co_filename
            where = next((p.strip(os.sep) for p in packages if p in f), where)
            tb = tb.tb_next
        if where is None or args.exc_value is None:
            before(args)
        else:
            _failed(where, args.exc_value)
    threading.excepthook = hook
    return hook


def _failed(name: str, e: BaseException) -> None:
    _warn(f"tracker {name} failed ({type(e).__name__}: {e}); the run goes on without it")


def _warn(msg: str) -> None:
    warnings.warn(RwkvxWarning(msg), stacklevel=2)


def open_trackers(spec: str | None, run_dir: str | None, config: Mapping[str, Any]
                  ) -> Trackers | None:
    """The Trackers of --log-to `spec` writing beside run_dir (None: no
    tracker); TrainError for an unknown tracker, a missing library or no
    run folder."""
    names = parse_trackers(spec)
    if not names:
        return None
    check_installed(names)
    if run_dir is None:
        raise TrainError("--log-to needs a run folder (out_dir) to write the trackers' files")
    return Trackers(names, run_dir, config)
