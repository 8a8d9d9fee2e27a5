"""What tests and benchmarks need and the product does not: reading compiled
programs (the quantized element types that feed each contraction, the
collectives and which processes they cross), the compile policy a test
session shares with `linen-moe matrix` (`use_compilation_cache`,
`use_fast_compile`; call them before jax is imported), and a tiny real
text corpus that needs no download (`license_texts`).

Stable like the rest of the public API, but not needed to train or serve.
"""

from linen_moe._src.compile_options import use_compilation_cache
from linen_moe._src.compile_options import use_fast_compile
from linen_moe._src.data.license_texts import license_texts
from linen_moe._src.hlo import COLLECTIVES
from linen_moe._src.hlo import CONTRACTIONS
from linen_moe._src.hlo import QUANTIZED_TYPES
from linen_moe._src.hlo import Collective
from linen_moe._src.hlo import Contraction
from linen_moe._src.hlo import Instruction
from linen_moe._src.hlo import all_gather_shapes
from linen_moe._src.hlo import collective_counts
from linen_moe._src.hlo import collective_summary
from linen_moe._src.hlo import collectives
from linen_moe._src.hlo import contractions
from linen_moe._src.hlo import crosses_processes
from linen_moe._src.hlo import parse_hlo
from linen_moe._src.hlo import quantized_types_at_contractions
from linen_moe._src.hlo import quantized_types_in_hlo

__all__ = [
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
    "license_texts",
    "parse_hlo",
    "quantized_types_at_contractions",
    "quantized_types_in_hlo",
    "use_compilation_cache",
    "use_fast_compile",
]
