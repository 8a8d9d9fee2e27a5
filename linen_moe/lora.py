"""LoRA and QLoRA: low-rank adapters on every expert and attention kernel.

A config with `lora_rank >= 1` (`MoEConfig.lora_rank`, `lora_alpha`,
`lora_targets`, `lora_dropout`; `MoEConfig.lora` gives them as one
object) puts adapters A [K, r], B [r, N] (per routed expert: A
[E, K, r], B [E, r, N]) beside each targeted kernel, as `params` named
`{kernel}_lora_a` / `{kernel}_lora_b`; every contraction then adds
(alpha / r) (x A) B, on every matmul path and under expert parallelism.
B starts at 0, so a fresh adapter changes nothing. The train steps
(`linen_moe.training.make_train_step`) train the adapters alone: the base
(float, or a serving config's stored int8 / fp8 kernels: QLoRA) is frozen
and never differentiated.

Example usage:

  config, variables = linen_moe.hf.load_checkpoint(path)
  config = config.replace(lora_rank=16, lora_alpha=32)
  variables = lora.init_adapters(config, variables, jax.random.key(0))
  ...  # train (`linen-moe train --lora-rank 16`)
  plain_config, plain_variables = lora.merge(config, variables)

Imported on its own, it imports no jax until a function runs.
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.config.lora": ("TARGETS",),
    "linen_moe._src.lora.files": ("load_adapters", "save_adapters"),
    "linen_moe._src.lora.tree": ("count_trainable", "join", "merge", "split"),
    "linen_moe._src.models.lora_init": ("init_adapters",),
}

_lazy_face(globals(), _EXPORTS)
