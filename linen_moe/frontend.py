"""The contract for a second front end: what a decoder framework other than
Linen needs to share this library's decoders, train steps and checkpoints.

`nnx_adapter` is built on it (and on the public modules): the pieces of the
reference `Decoder` a twin decoder assembles (the embedding's scale, the
layer stack's body and its scan, the per-layer aux and its reduction, the
head and the logits, the checks and positions of packed rows), the pieces
of the train step a twin step composes (the batch, gradient accumulation,
the fp8 overwrite rule, the routed-bias rule, skipping non-finite steps,
the chunked loss of the head), the sharded step's contract (`ShardedRun`),
compiled initialisation, and the checkpoint tree that makes every front
end's state one layout. A user's decoder of their own rarely needs these
(`linen_moe.models` is for that); a front end does.

Its names load on first use.
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.checkpoint.tree": ("VARIABLES", "state_from", "tree_of"),
    "linen_moe._src.config.stack_plan": ("STACK", "layer_name"),
    "linen_moe._src.layer.jit_init": ("compiled_init", "jit_once"),
    "linen_moe._src.lora.tree": ("is_adapter",),
    "linen_moe._src.models.blocks": ("per_layer_aux", "stack_body"),
    "linen_moe._src.models.decoder": (
        "layer_aux",
        "logits_of",
        "output_head",
        "routed_bias_rule",
        "scale_embeddings",
    ),
    "linen_moe._src.models.scan": ("LAYERS_AXIS", "resolved_unroll"),
    "linen_moe._src.models.segments": (
        "resolve_positions",
        "validate_segments",
    ),
    "linen_moe._src.models.tokens": ("validate_tokens_if_concrete",),
    "linen_moe._src.training.evaluation": ("variables_of",),
    "linen_moe._src.training.sharded": ("ShardedRun",),
    "linen_moe._src.training.skip": ("all_finite", "keep_if_finite"),
    "linen_moe._src.training.step": (
        "accumulate_gradients",
        "hidden_decoder_loss",
        "loss_weights",
        "overwrite_with_gradient",
        "train_batch",
    ),
}

_lazy_face(globals(), _EXPORTS)
