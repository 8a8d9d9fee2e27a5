"""Quantization: the modes, their facts, and weights converted for serving.

Every expert contraction of `RoutedMoE` goes through one named, possibly
quantized Linen submodule per call site (`CALL_SITES`), so each mode of
`MODES` works on every matmul path:

  mode        forward    gradient     storage          RNG  state
  none        -          -            -                no   no
  int8        int8       int8         int8             yes  no
  fp8         e4m3fn     e5m2         e4m3fn           no   yes
  nanoo_fp8   e4m3fnuz   e5m2fnuz     e4m3fnuz         no   yes

`MODES[name]` is that row (its fields: `forward`, `gradient`, `storage`, ...). A mode with a storage
type serves (`SERVING_MODES`): `quantize_weights` converts a trained
decoder's expert kernels to it once, and a config with `serving=True`
reads those stored kernels and their scales.

Imported on its own, it imports no jax until a conversion runs.
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.config.quantization_modes": ("MODES", "SERVING_MODES"),
    "linen_moe._src.layer.moe": ("CALL_SITES",),
    "linen_moe._src.quantization.serving": (
        "expert_weight_bytes",
        "quantize_weights",
    ),
}

_lazy_face(globals(), _EXPORTS)
