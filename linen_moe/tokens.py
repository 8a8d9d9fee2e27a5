"""Token ids in [0, vocab_size): checks outside jit, and a checked mode inside."""

from linen_moe._src.tokens import check_tokens
from linen_moe._src.tokens import checked
from linen_moe._src.tokens import validate_tokens

__all__ = [
    "check_tokens",
    "checked",
    "validate_tokens",
]
