"""Token ids in [0, vocab_size): checks outside jit, and a checked mode inside."""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.models.tokens": (
        "checked",
        "valid_token_mask",
        "validate_tokens",
    ),
}

_lazy_face(globals(), _EXPORTS)
