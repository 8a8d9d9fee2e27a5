"""Deprecated: `linen_moe.quantization` holds the serving conversion now.

`linen_moe.serving.quantize_weights` and `expert_weight_bytes` answer until
linen_moe 0.3, with a `DeprecationWarning`.
"""

from linen_moe._src import deprecation as _deprecation

__all__ = []


def __getattr__(name: str):
  return _deprecation.moved_name(__name__, name)
