"""Hugging Face checkpoints in and out: Mixtral, Qwen3-MoE, DeepSeek-V3 and
Gemma-4 (its text decoder).

    config, variables = hf.load_checkpoint("path/to/Mixtral-8x7B-v0.1")
    logits, aux = linen_moe.Decoder(config).apply(variables, tokens)
    hf.save_checkpoint(config, variables, "path/to/out")

`load_checkpoint` reads the safetensors tensor by tensor, each device only
its slice, straight into the decoder's variables (scanned or unrolled, float
or int8/fp8 serving weights); `Decoder(config)` then computes transformers'
logits. `save_checkpoint` writes what transformers loads back.
`model_config` maps a config.json alone.
"""

from linen_moe._src.hf.config_map import model_config
from linen_moe._src.hf.families import FAMILIES as _FAMILIES
from linen_moe._src.hf.load import load_checkpoint
from linen_moe._src.hf.save import save_checkpoint

# The `model_type`s of config.json that load.
MODEL_TYPES = tuple(sorted(_FAMILIES))

__all__ = [
    "MODEL_TYPES",
    "load_checkpoint",
    "model_config",
    "save_checkpoint",
]
