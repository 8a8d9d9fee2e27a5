"""Token ids in [0, vocab_size): checks outside jit, and a checked mode inside."""

from linen_moe._src import deprecation as _deprecation
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


def __getattr__(name: str):
  return _deprecation.moved_name(__name__, name)
