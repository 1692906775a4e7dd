"""Evaluating a trained model: corpus loss, perplexity and bits per byte,
RWKV-LM's LAMBADA, passkey retrieval (rwkvx_c.eval.metrics,
rwkvx_c.eval.passkey), and an lm-evaluation-harness model
(rwkvx_c.eval.harness, extra ``eval``; imported on its own since it needs
lm-eval).

This package sits one layer above training, interop and sampling (it takes
a trained run through rwkvx_c.sample.load_run) and below the command line.
"""
from rwkvx_c.eval.metrics import consecutive_starts, lambada, score_windows
from rwkvx_c.eval.passkey import format_table, heatmap, passkey_grid

__all__ = ["score_windows", "consecutive_starts", "lambada", "passkey_grid", "format_table",
           "heatmap"]
