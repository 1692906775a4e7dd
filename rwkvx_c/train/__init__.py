"""The training layer: options, the schedule, the Trainer, AdamW, the
divergence guard and the MPI process group.

    from rwkvx_c.train import Trainer, TrainOptions
    tr = Trainer(TrainOptions(preset="tiny", steps=200), out_dir="runs/demo")
    final = tr.run()                               # {'val_loss', 'val_bpb'}

Imports the data, model and run layers below it, never the CLI."""
from rwkvx_c.errors import Divergence, TrainError
from rwkvx_c.model.presets import PRESETS
from rwkvx_c.run.rundir import CHECKPOINT, LOG
from rwkvx_c.train.config_file import options_from_file
from rwkvx_c.train.options import TrainOptions, auto_precision
from rwkvx_c.train.trainer import Trainer

__all__ = ["Trainer", "TrainOptions", "TrainError", "Divergence", "PRESETS", "CHECKPOINT", "LOG",
           "auto_precision", "options_from_file"]
