"""Token ids in [0, vocab_size): checks outside jit, and a checked mode inside."""

import warnings as _warnings

from linen_moe._src.models.tokens import checked
from linen_moe._src.models.tokens import valid_token_mask
from linen_moe._src.models.tokens import validate_tokens
from linen_moe._src.models.tokens import validate_tokens_if_concrete

__all__ = [
    "checked",
    "valid_token_mask",
    "validate_tokens",
    "validate_tokens_if_concrete",
]

# Old name -> new name: the old one works for one release, with a warning.
_RENAMED = {"check_tokens": "valid_token_mask"}


def __getattr__(name: str):
  if name in _RENAMED:
    _warnings.warn(
        f"linen_moe.tokens.{name} is deprecated and will be removed in "
        f"linen_moe 0.3; use linen_moe.tokens.{_RENAMED[name]} (same "
        "function).",
        DeprecationWarning,
        stacklevel=2,
    )
    return globals()[_RENAMED[name]]
  raise AttributeError(f"module 'linen_moe.tokens' has no attribute {name!r}")
