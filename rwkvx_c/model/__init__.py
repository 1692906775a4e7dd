"""The model layer: its config type and presets, parameter init, the memory
estimate, and loading tensors into a model. Imports only rwkvx_c.errors,
rwkvx_c.util and the binding."""
from rwkvx_c.model.config import SHAPE_OPTIONS, ModelConfig, lora_sizes
from rwkvx_c.model.init import SCHEMES, init_model
from rwkvx_c.model.presets import PRESETS
from rwkvx_c.model.weights import load_params

__all__ = ["ModelConfig", "SHAPE_OPTIONS", "lora_sizes", "PRESETS", "SCHEMES", "init_model",
           "load_params"]
