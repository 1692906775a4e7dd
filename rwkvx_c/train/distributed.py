"""Data-parallel process group over MPI, and its one-process stand-in.

``world()`` is the group the trainer uses. Launched by an MPI launcher with
more than one process it wraps ``mpi4py``'s COMM_WORLD; otherwise it is a
no-op group of size 1 and mpi4py is never imported.

How a launch is recognised (before MPI is initialised, so nothing is
imported for a plain run): the wire-up variables the MPI library itself
reads at start-up --
  - ``OMPI_COMM_WORLD_SIZE`` (Open MPI's mpiexec / prterun),
  - ``PMI_SIZE`` (MPICH / Intel MPI Hydra, Slurm ``srun --mpi=pmi2``),
  - ``PMIX_RANK`` without a size variable (Slurm ``srun --mpi=pmix``; the
    size then comes from ``SLURM_STEP_NUM_TASKS`` when set, else from MPI).
A size of 1 (``mpiexec -n 1``) is a plain run. Slurm's own task variables
(``SLURM_NTASKS``, ``SLURM_PROCID``) are deliberately not used: they are set
in the batch script itself too, where no MPI launcher started the process.
``RWKVX_MPI=1`` forces MPI on (for a launcher not listed here) and
``RWKVX_MPI=0`` forces it off.

What the trainer asks of a group (the one-process group answers each
without doing anything):
  - ``rows(B)``: this rank's slice [lo, hi) of a global batch of B rows;
  - ``average_grads(grads, loss, share)``: in-place Allreduce(SUM) of the
    flat float32 gradients of what trains (the arena of a full run; a
    fine-tune's states, adapters and trained parameter ranges), scaled by
    1/P, and the mean of the ranks' losses (each rank's C backward gives the
    mean over its own B/P*T tokens, so the mean over ranks is the mean over
    the global batch); share, this rank's fraction of the batch's counted
    targets (a chat corpus, whose ranks count different numbers), weights
    each rank by it instead of 1/P;
  - ``broadcast_(buf)``: rank 0's buffer into every rank's, in place;
  - ``root_value(v)``: rank 0's value of a Python object (clock-driven
    decisions: learning rate, stop, evaluate now);
  - ``sum_values(*xs)``: float64 sums over ranks (evaluation);
  - ``agree(fn)`` / ``on_root(fn)``: run set-up code so that an error on
    any rank raises the same exception on every rank, never a hang;
  - ``abort(exc)``: print which rank failed and why, then end the whole job.
"""
from __future__ import annotations

import os
import pickle
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from rwkvx_c.errors import DistributedError

T = TypeVar("T")

__all__ = ["DistributedError", "MPIGroup", "ProcessGroup", "abort_job", "mpi_requested", "world"]

_FORCE = "RWKVX_MPI"
_ON, _OFF = ("1", "on", "yes", "true"), ("0", "off", "no", "false")


def _int_env(name: str) -> int | None:
    v = os.environ.get(name)
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def mpi_requested(environ: Mapping[str, str] | None = None) -> bool:
    """True when this process was started by an MPI launcher with more than
    one process (or RWKVX_MPI=1). Reads only environment variables."""
    env = os.environ if environ is None else environ
    force = env.get(_FORCE, "").strip().lower()
    if force in _ON:
        return True
    if force in _OFF:
        return False
    if force:
        raise DistributedError(f"{_FORCE}={env[_FORCE]!r}: expected 1 or 0")
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if name in env:
            try:
                return int(env[name]) > 1
            except ValueError:
                return True  # a launcher set it; let MPI say how many
    if "PMIX_RANK" in env:
        try:
            return int(env.get("SLURM_STEP_NUM_TASKS", "2")) > 1
        except ValueError:
            return True
    return False


class ProcessGroup:
    """One process: rank 0 of 1. Every collective returns its input."""

    rank = 0
    size = 1
    local_size = 1

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return "1 process"

    def rows(self, batch: int) -> tuple[int, int]:
        """[lo, hi) rows of a global batch of `batch` sequences for this rank."""
        if batch % self.size:
            raise DistributedError(f"--batch {batch} does not divide over {self.size} "
                                   f"processes; use a multiple of {self.size}")
        n = batch // self.size
        return self.rank * n, (self.rank + 1) * n

    def split(self, n: int) -> tuple[int, int]:
        """[lo, hi) of n items (evaluation windows) for this rank, as even as possible."""
        lo = self.rank * n // self.size
        return lo, (self.rank + 1) * n // self.size

    def default_threads(self) -> int | None:
        """OpenMP threads for this rank when --threads is not given; None keeps
        the library default (OMP_NUM_THREADS, else every core)."""
        return None

    def average_grads(self, grads: np.ndarray | Sequence[np.ndarray], loss: float,
                      share: float | None = None) -> float:
        return loss

    def broadcast_(self, buf: np.ndarray) -> np.ndarray:
        return buf

    def gather_rows(self, a: np.ndarray) -> np.ndarray:
        """Every rank's rows of a, in rank order (each rank gets them all)."""
        return a

    def root_value(self, value: T) -> T:
        return value

    def sum_values(self, *xs: float) -> tuple[float, ...]:
        return xs

    def any(self, flag: object) -> bool:
        return bool(flag)

    def agree(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return fn(*args, **kw)

    def on_root(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return fn(*args, **kw)

    def abort(self, exc: BaseException) -> None:
        raise exc


class MPIGroup(ProcessGroup):
    """COMM_WORLD of mpi4py; see the module doc for each operation."""

    def __init__(self, comm: Any, MPI: Any) -> None:
        self.comm, self._MPI = comm, MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_size = node.Get_size()
        # collective, so done here once, never inside agree()'s error-prone set-up
        self._threads = _share_of_cores(node)
        node.Free()

    def describe(self) -> str:
        return f"{self.size} MPI ranks ({self.local_size} on this node)"

    def default_threads(self) -> int | None:
        """OMP_NUM_THREADS when set; else this rank's share of its cores (see
        _share_of_cores): P ranks on one machine never oversubscribe it."""
        env = _int_env("OMP_NUM_THREADS")
        return env if env is not None and env >= 1 else self._threads

    def average_grads(self, grads: np.ndarray | Sequence[np.ndarray], loss: float,
                      share: float | None = None) -> float:
        for g in [grads] if isinstance(grads, np.ndarray) else grads:
            if share is not None:   # each rank weighted by its counted targets
                g *= np.float32(share)
            self.comm.Allreduce(self._MPI.IN_PLACE, g, op=self._MPI.SUM)
            if share is not None:
                continue
            if self.size & (self.size - 1) == 0:
                g *= np.float32(1.0 / self.size)  # a power of two: exact
            else:
                np.divide(g, np.float32(self.size), out=g)
        total = np.array([loss if share is None else loss * share], dtype=np.float64)
        self.comm.Allreduce(self._MPI.IN_PLACE, total, op=self._MPI.SUM)
        return float(total[0]) / (self.size if share is None else 1)

    def broadcast_(self, buf: np.ndarray) -> np.ndarray:
        self.comm.Bcast(buf, root=0)
        return buf

    def gather_rows(self, a: np.ndarray) -> np.ndarray:
        return np.concatenate(self.comm.allgather(np.ascontiguousarray(a)))

    def root_value(self, value: T) -> T:
        return self.comm.bcast(value, root=0)

    def sum_values(self, *xs: float) -> tuple[float, ...]:
        v = np.array(xs, dtype=np.float64)
        self.comm.Allreduce(self._MPI.IN_PLACE, v, op=self._MPI.SUM)
        return tuple(float(x) for x in v)

    def any(self, flag: object) -> bool:
        return bool(self.comm.allreduce(bool(flag), op=self._MPI.LOR))

    def _agreed(self, outcome: tuple[bool, Any]) -> Any:
        """outcome: (ok, value or exception). Every rank learns every outcome;
        the lowest failing rank's exception is raised on all of them."""
        ok, val = outcome
        err = None if ok else _portable(val, self.rank)
        errs = self.comm.allgather(err)
        for r, e in enumerate(errs):
            if e is not None:
                raise val if r == self.rank else e
        return val

    def agree(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        out: tuple[bool, Any]
        try:
            out = (True, fn(*args, **kw))
        except Exception as e:  # noqa: BLE001 -- every error must reach the other ranks
            out = (False, e)
        return self._agreed(out)

    def on_root(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """fn runs on rank 0 only; its result (or its exception) reaches every rank."""
        out: tuple[bool, Any] | None = None
        if self.is_root:
            try:
                out = (True, fn(*args, **kw))
            except Exception as e:  # noqa: BLE001
                out = (False, _portable(e, 0))
        ok, val = self.comm.bcast(out, root=0)
        if not ok:
            raise val
        return val

    def abort(self, exc: BaseException) -> None:
        """Report exc as this rank's failure on the real stderr, then end every
        rank (MPI_Abort): the others may be waiting in a collective."""
        msg = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        err = sys.__stderr__ or sys.stderr   # None when Python started without one
        err.write(f"{msg}rwkvx-c: error: rank {self.rank} of {self.size} failed "
                  f"({type(exc).__name__}: {exc}); ending all ranks\n")
        err.flush()
        self.comm.Abort(1)


def _share_of_cores(node: Any) -> int:
    """The CPUs in this rank's affinity mask divided by the number of ranks on
    this node (communicator `node`) with that same mask. Unbound ranks split
    the machine; ranks the launcher bound (--bind-to socket / core) split
    their own set."""
    try:
        mine = frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no affinity masks, split the machine
        mine = frozenset(range(os.cpu_count() or 1))
    sharing = sum(1 for s in node.allgather(mine) if s == mine)
    return max(1, len(mine) // sharing)


def _portable(exc: BaseException, rank: int) -> BaseException:
    """exc, marked with the rank it happened on, if it survives pickling; else
    a RuntimeError with its text."""
    try:
        exc.rank = rank  # type: ignore[attr-defined]
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 -- any unpicklable exception
        e = RuntimeError(f"{type(exc).__name__}: {exc}")
        e.rank = rank  # type: ignore[attr-defined]
        return e


_WORLD: ProcessGroup | None = None


def world() -> ProcessGroup:
    """The process group of this process (created once)."""
    global _WORLD
    if _WORLD is None:
        if not mpi_requested():
            _WORLD = ProcessGroup()
        else:
            try:
                import mpi4py
            except ImportError:
                raise DistributedError("launched under MPI but mpi4py is not installed: "
                                       'pip install "rwkvx_c[mpi]"') from None
            mpi4py.rc.thread_level = "funneled"  # OpenMP threads never call MPI
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
            _WORLD = MPIGroup(comm, MPI) if comm.Get_size() > 1 else ProcessGroup()
    return _WORLD


def abort_job(exc: BaseException) -> None:
    """Under MPI with more than one rank: report exc as this rank's failure and
    end the whole job (never returns). Otherwise does nothing."""
    if _WORLD is not None and _WORLD.size > 1:
        _WORLD.abort(exc)
