"""The run layer: the run folder (RunDir: its file names, creation, latest
run, log, checkpoint I/O), the checkpoint format and the folder lock.
Imports only rwkvx_c.errors and rwkvx_c.util."""
from rwkvx_c.run.checkpoint import parse_checkpoint, read_checkpoint, save_checkpoint
from rwkvx_c.run.lock import RunLock
from rwkvx_c.run.rundir import CHECKPOINT, LOG, PLOT, TOKENIZER, RunDir, checkpoint_path

__all__ = ["RunDir", "RunLock", "CHECKPOINT", "LOG", "PLOT", "TOKENIZER", "checkpoint_path",
           "read_checkpoint", "save_checkpoint", "parse_checkpoint"]
