"""Reading compiled programs: contractions' element types, collectives, the
bytes they send. Imports no jax.

The names each module gives the public face `linen_moe.hlo` (which moved
there from `linen_moe.testing`: `deprecation` reads these too).
"""

READING_NAMES = (
    "COLLECTIVES",
    "CONTRACTIONS",
    "QUANTIZED_TYPES",
    "Collective",
    "Contraction",
    "Instruction",
    "all_gather_shapes",
    "collective_counts",
    "collective_summary",
    "collectives",
    "contractions",
    "crosses_processes",
    "parse_hlo",
    "quantized_types_at_contractions",
    "quantized_types_in_hlo",
)
TRAFFIC_NAMES = (
    "CollectiveBytes",
    "collective_bytes",
    "sent_bytes",
)
