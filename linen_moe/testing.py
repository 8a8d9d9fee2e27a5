"""What tests and benchmarks need and the product does not: running the
accelerator grouped-matmul kernels on a CPU (`kernels_on_cpu`), the compile
policy a
test session shares with `linen-moe matrix` (`use_compilation_cache`,
`use_fast_compile`; call them before jax is imported), the `slow` mark,
small shared helpers (a shipped config on one matmul path, random layers,
inputs and tokens, error measures, captured output), and a tiny real text
corpus that needs no download
(`license_texts`). Reading compiled programs is `linen_moe.hlo`.

Stable like the rest of the public API, but not needed to train or serve.
Importing it imports no jax; the helpers load it on first use.
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.config.moe_config": ("FAMILY_CONFIGS", "TINY_CONFIGS"),
    "linen_moe._src.data.license_texts": ("license_texts",),
    "linen_moe._src.testing.compile_options": (
        "use_compilation_cache",
        "use_fast_compile",
    ),
    "linen_moe._src.testing.helpers": ("run_capturing",),
    "linen_moe._src.testing.marks": ("slow",),
}


def kernels_on_cpu(kind: str):
  """A context in which `grouped_matmul="kernel"` on a CPU runs a real kernel.

  "auto" still resolves to "blocked" inside it. Trace inside it. Imports jax
  when called, not when this module is imported (the compile policy above
  must run before jax loads).

  Args:
    kind: "pallas" (this project's Pallas TPU kernels in interpret mode),
      "megablox" (Pallas interpret mode), "tokamax" (its XLA
      implementation) or "tokamax_pallas" (its Pallas TPU kernel,
      interpreted).

  Returns:
    A context manager.

  Raises:
    ValueError: on entering the context, if `kind` is none of those.
  """
  from linen_moe._src.kernels import accelerator as grouped_kernels  # noqa: PLC0415

  return grouped_kernels.kernels_on_cpu(kind)


_lazy_face(globals(), _EXPORTS, defined_here=("kernels_on_cpu",))
