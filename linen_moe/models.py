"""Building blocks of the reference decoders, for a decoder of your own.

`linen_moe.Decoder` is assembled from these, and so is the NNX decoder of
`nnx_adapter`: the token embedding and its input scale, a block of
attention and MoE (or dense MLP) per layer (`DecoderBlock`), the layer stack
laid out as `ModelConfig.stack_plan` says (`StackPlan`: unrolled layers
`layers_{i}` around one scanned stack `layers`, of rows of one block or a
repeated group `stack_body` builds, scanned with `scan_blocks`), the final
`RMSNorm`, the tied or separate head (`logits_of`), and the per-layer aux
reduced to the decoder's (`per_layer_aux`, `layer_aux`). `remat_block`
wraps a block class in the rematerialization `ModelConfig.remat` names
(`remat_policy`, its `jax.checkpoint` policy); `CHECKPOINT_NAMES` are the
names the blocks and the MoE layer give their tensors
(`jax.ad_checkpoint.checkpoint_name`), for a policy of your own.
Packed rows: `segment_positions` (positions restarting per segment),
`resolve_positions` and `validate_segments` (what the decoders run on their
`segment_ids` and `positions`), `same_segment_targets` (the targets a loss
counts).

Weights move between a scanned and an unrolled stack with
`scanned_to_unrolled` / `unrolled_to_scanned`.
"""

from linen_moe._src.config.stack_plan import STACK
from linen_moe._src.config.stack_plan import StackPlan
from linen_moe._src.config.stack_plan import layer_name
from linen_moe._src.layer.checkpoint_names import ALL as CHECKPOINT_NAMES
from linen_moe._src.models.blocks import DecoderBlock
from linen_moe._src.models.blocks import per_layer_aux
from linen_moe._src.models.blocks import stack_body
from linen_moe._src.models.decoder import embedding
from linen_moe._src.models.decoder import layer_aux
from linen_moe._src.models.decoder import logits_of
from linen_moe._src.models.decoder import output_head
from linen_moe._src.models.decoder import output_kernel
from linen_moe._src.models.decoder import scale_embeddings
from linen_moe._src.models.decoder import scanned_to_unrolled
from linen_moe._src.models.decoder import unrolled_to_scanned
from linen_moe._src.models.norms import RMSNorm
from linen_moe._src.models.remat import policy as remat_policy
from linen_moe._src.models.remat import remat_block
from linen_moe._src.models.scan import LAYERS_AXIS
from linen_moe._src.models.scan import resolved_unroll
from linen_moe._src.models.scan import scan_blocks
from linen_moe._src.models.segments import resolve_positions
from linen_moe._src.models.segments import same_segment_targets
from linen_moe._src.models.segments import segment_positions
from linen_moe._src.models.segments import validate_segments

__all__ = [
    "CHECKPOINT_NAMES",
    "LAYERS_AXIS",
    "STACK",
    "DecoderBlock",
    "RMSNorm",
    "StackPlan",
    "embedding",
    "layer_aux",
    "layer_name",
    "logits_of",
    "output_head",
    "output_kernel",
    "per_layer_aux",
    "remat_block",
    "remat_policy",
    "resolve_positions",
    "resolved_unroll",
    "same_segment_targets",
    "scale_embeddings",
    "scan_blocks",
    "scanned_to_unrolled",
    "segment_positions",
    "stack_body",
    "unrolled_to_scanned",
    "validate_segments",
]
