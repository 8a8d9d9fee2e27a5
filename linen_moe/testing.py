"""What tests and benchmarks need and the product does not: reading compiled
programs (the element types that feed each contraction, the collectives, the
bytes they send and which processes they cross), running the accelerator
grouped-matmul kernels on a CPU (`kernels_on_cpu`), the compile policy a
test session shares with `linen-moe matrix` (`use_compilation_cache`,
`use_fast_compile`; call them before jax is imported), the `slow` mark,
small shared helpers (random layers, inputs and tokens, error measures,
captured output), and a tiny real text corpus that needs no download
(`license_texts`).

Stable like the rest of the public API, but not needed to train or serve.
Importing it imports no jax; the helpers load it on first use.
"""

import importlib as _importlib
from typing import Any as _Any

from linen_moe._src.data.license_texts import license_texts
from linen_moe._src.hlo.reading import COLLECTIVES
from linen_moe._src.hlo.reading import CONTRACTIONS
from linen_moe._src.hlo.reading import QUANTIZED_TYPES
from linen_moe._src.hlo.reading import Collective
from linen_moe._src.hlo.reading import Contraction
from linen_moe._src.hlo.reading import Instruction
from linen_moe._src.hlo.reading import all_gather_shapes
from linen_moe._src.hlo.reading import collective_counts
from linen_moe._src.hlo.reading import collective_summary
from linen_moe._src.hlo.reading import collectives
from linen_moe._src.hlo.reading import contractions
from linen_moe._src.hlo.reading import crosses_processes
from linen_moe._src.hlo.reading import parse_hlo
from linen_moe._src.hlo.reading import quantized_types_at_contractions
from linen_moe._src.hlo.reading import quantized_types_in_hlo
from linen_moe._src.hlo.traffic import CollectiveBytes
from linen_moe._src.hlo.traffic import collective_bytes
from linen_moe._src.hlo.traffic import sent_bytes
from linen_moe._src.testing.compile_options import use_compilation_cache
from linen_moe._src.testing.compile_options import use_fast_compile
from linen_moe._src.testing.marks import SLOW_ATTRIBUTE
from linen_moe._src.testing.marks import is_slow
from linen_moe._src.testing.marks import slow

# The helpers that need jax, loaded on first use (PEP 562).
_HELPERS = (
    "flat_numpy",
    "markov_tokens",
    "max_abs_diff",
    "model_config",
    "moe_params",
    "moe_variables",
    "random_inputs",
    "read_jsonl",
    "rel_err",
    "run_capturing",
)


def kernels_on_cpu(kind: str):
  """A context in which `grouped_matmul="kernel"` on a CPU runs a real kernel.

  "auto" still resolves to "blocked" inside it. Trace inside it. Imports jax
  when called, not when this module is imported (the compile policy above
  must run before jax loads).

  Args:
    kind: "megablox" (Pallas interpret mode), "tokamax" (its XLA
      implementation) or "tokamax_pallas" (its Pallas TPU kernel,
      interpreted).

  Returns:
    A context manager.

  Raises:
    ValueError: on entering the context, if `kind` is none of those.
  """
  from linen_moe._src.kernels import accelerator as grouped_kernels  # noqa: PLC0415

  return grouped_kernels.kernels_on_cpu(kind)


__all__ = [
    "COLLECTIVES",
    "CONTRACTIONS",
    "QUANTIZED_TYPES",
    "SLOW_ATTRIBUTE",
    "Collective",
    "CollectiveBytes",
    "Contraction",
    "Instruction",
    "all_gather_shapes",
    "collective_bytes",
    "collective_counts",
    "collective_summary",
    "collectives",
    "contractions",
    "crosses_processes",
    "flat_numpy",
    "is_slow",
    "kernels_on_cpu",
    "license_texts",
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
    "sent_bytes",
    "slow",
    "use_compilation_cache",
    "use_fast_compile",
]


def __getattr__(name: str) -> _Any:
  if name in _HELPERS:
    module = _importlib.import_module("linen_moe._src.testing.helpers")
    value = getattr(module, name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'linen_moe.testing' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
