"""What tests and benchmarks need and the product does not: reading compiled
programs (the element types that feed each contraction, the collectives and
which processes they cross), the `slow` mark, and small shared helpers
(random layers, inputs and tokens, error measures, captured output).

Stable like the rest of the public API, but not needed to train or serve.
"""

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
from linen_moe._src.testing_helpers import SLOW_ATTRIBUTE
from linen_moe._src.testing_helpers import flat_numpy
from linen_moe._src.testing_helpers import is_slow
from linen_moe._src.testing_helpers import markov_tokens
from linen_moe._src.testing_helpers import max_abs_diff
from linen_moe._src.testing_helpers import model_config
from linen_moe._src.testing_helpers import moe_params
from linen_moe._src.testing_helpers import moe_variables
from linen_moe._src.testing_helpers import random_inputs
from linen_moe._src.testing_helpers import read_jsonl
from linen_moe._src.testing_helpers import rel_err
from linen_moe._src.testing_helpers import run_capturing
from linen_moe._src.testing_helpers import slow

__all__ = [
    "COLLECTIVES",
    "CONTRACTIONS",
    "QUANTIZED_TYPES",
    "SLOW_ATTRIBUTE",
    "Collective",
    "Contraction",
    "Instruction",
    "all_gather_shapes",
    "collective_counts",
    "collective_summary",
    "collectives",
    "contractions",
    "crosses_processes",
    "flat_numpy",
    "is_slow",
    "markov_tokens",
    "max_abs_diff",
    "model_config",
    "moe_params",
    "moe_variables",
    "parse_hlo",
    "quantized_types_at_contractions",
    "quantized_types_in_hlo",
    "random_inputs",
    "read_jsonl",
    "rel_err",
    "run_capturing",
    "slow",
]
