"""Deprecated: `linen_moe.quantization` holds the serving conversion now.

`linen_moe.serving.quantize_weights` and `expert_weight_bytes` answer until
linen_moe 0.3, with a `DeprecationWarning`.
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS: dict[str, tuple[str, ...]] = {}

_lazy_face(globals(), _EXPORTS)
