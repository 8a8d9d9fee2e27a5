"""Reading compiled programs: contractions' element types, collectives, the
bytes they send. Imports no jax.

The names each module gives the public face `linen_moe.hlo` (which moved
there from `linen_moe.testing`: `deprecation` reads these too).
"""

READING_NAMES = (
    "Collective",
    "Contraction",
    "all_gather_shapes",
    "collective_counts",
    "collective_summary",
    "collectives",
    "contractions",
    "crosses_processes",
    "quantized_types_at_contractions",
    "quantized_types_in_hlo",
)
TRAFFIC_NAMES = ("sent_bytes",)
# Exported by `linen_moe.testing` in 0.2, private since: the parser's
# internals and its tables (`deprecation` answers for them until 0.4).
PRIVATE_NAMES = {
    "linen_moe._src.hlo.reading": (
        "COLLECTIVES",
        "CONTRACTIONS",
        "QUANTIZED_TYPES",
        "Instruction",
        "parse_hlo",
    ),
    "linen_moe._src.hlo.traffic": ("CollectiveBytes", "collective_bytes"),
}
