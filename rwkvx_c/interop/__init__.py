"""Models in and out of rwkvx_c: the RWKV-LM x070 state dict (the ``rwkv``
package), the RWKV-X layout (the ``rwkv-x`` package), PyTorch .pth files
and GGUF for llama.cpp; each door is its own module and knows the model
only through RxPtModel, its config dict and NumPy arrays.

    sd = to_rwkv7(model)              # {"emb.weight": ..., "blocks.0.ln0.weight": ...}
    model = from_rwkv7(sd)            # sizes derived from the shapes
    save_pth(sd, "model.pth", "bf16") # torch's zip format, written without torch
    sd = load_pth("model.pth")        # bf16 / fp16 / fp32 in, float32 out
"""
from rwkvx_c.errors import InteropError
from rwkvx_c.interop.gguf import save_gguf
from rwkvx_c.interop.pth import DTYPES, load_pth, save_pth
from rwkvx_c.interop.runs import FORMATS, export_model, import_pth, state_dict
from rwkvx_c.interop.rwkv7 import (
    from_rwkv7,
    from_rwkvx,
    rwkv7_config,
    rwkvx_refusal,
    to_rwkv7,
    to_rwkvx,
)
from rwkvx_c.interop.source import Source, read_source

__all__ = ["InteropError", "to_rwkv7", "from_rwkv7", "rwkv7_config", "to_rwkvx", "from_rwkvx",
           "rwkvx_refusal", "load_pth", "save_pth", "save_gguf", "export_model", "import_pth",
           "DTYPES", "FORMATS", "state_dict", "Source", "read_source"]
