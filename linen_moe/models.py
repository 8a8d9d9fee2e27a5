"""Building blocks of the reference decoders, for a decoder of your own.

`linen_moe.Decoder` is assembled from these, and so is the NNX decoder of
`nnx_adapter`: the token embedding (`embedding`), a block of attention and
MoE (or dense MLP) per layer (`DecoderBlock`), the layer stack laid out as
`ModelConfig.stack_plan` says (`StackPlan`: unrolled layers `layers_{i}`
around one scanned stack `layers`, scanned with `scan_blocks`), the final
`RMSNorm` and the head (`output_kernel`: the tied embedding or a separate
kernel). `remat_block` wraps a block class in the rematerialization
`ModelConfig.remat` names (`remat_policy`, its `jax.checkpoint` policy);
`CHECKPOINT_NAMES` are the names the blocks and the MoE layer give their
tensors (`jax.ad_checkpoint.checkpoint_name`), for a policy of your own.
Packed rows: `segment_positions` (positions restarting per segment).

Weights move between a scanned and an unrolled stack with
`scanned_to_unrolled` / `unrolled_to_scanned`. The finer pieces a second
front end assembles (the stack's body, the per-layer aux, the logits) are
`linen_moe.frontend`'s.
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.config.stack_plan": ("StackPlan",),
    "linen_moe._src.layer.checkpoint_names": ("CHECKPOINT_NAMES",),
    "linen_moe._src.models.blocks": ("DecoderBlock",),
    "linen_moe._src.models.decoder": (
        "embedding",
        "output_kernel",
        "scanned_to_unrolled",
        "unrolled_to_scanned",
    ),
    "linen_moe._src.models.norms": ("RMSNorm",),
    "linen_moe._src.models.remat": ("remat_block", "remat_policy"),
    "linen_moe._src.models.scan": ("scan_blocks",),
    "linen_moe._src.models.segments": ("segment_positions",),
}

_lazy_face(globals(), _EXPORTS)
