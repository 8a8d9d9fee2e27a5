"""Hugging Face checkpoints in and out: Mixtral, Qwen3-MoE, DeepSeek-V3,
Gemma-4, GPT-OSS, GLM-4.5, MiniMax-M2 and Llama-4 (the text decoder of the
multimodal Gemma-4 and Llama-4 checkpoints).

    config, variables = hf.load_checkpoint("path/to/Mixtral-8x7B-v0.1")
    logits, aux = linen_moe.Decoder(config).apply(variables, tokens)
    hf.save_checkpoint(config, variables, "path/to/out")

`load_checkpoint` reads the safetensors tensor by tensor, each device only
its slice, straight into the decoder's variables (scanned or unrolled, float
or int8/fp8 serving weights); `Decoder(config)` then computes transformers'
logits. `save_checkpoint` writes what transformers loads back.
`model_config` maps a config.json alone; `family_match` says whether a
`ModelConfig` has a Hugging Face form (and, when not, what the nearest
family needs). `save_peft_adapters` writes a LoRA run's adapters for
PEFT: all of them for Mixtral, Qwen3-MoE, DeepSeek-V3, Gemma-4, GLM-4.5
and MiniMax-M2; for GPT-OSS and Llama-4, whose routed experts are stored
as x @ W, all but the experts' (`linen-moe export --format adapters`
writes those in this library's files beside them).
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.hf.config_map": ("family_match", "model_config"),
    "linen_moe._src.hf.load": ("load_checkpoint",),
    "linen_moe._src.hf.peft": ("save_peft_adapters",),
    "linen_moe._src.hf.save": ("save_checkpoint",),
}

_lazy_face(globals(), _EXPORTS)
