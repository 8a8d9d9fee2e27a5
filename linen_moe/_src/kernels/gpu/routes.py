"""The grouped-matmul routes a GPU offers, as registry entries
(`kernel.Entry`, backend "gpu"):

  xla_ragged_dot  `jax.lax.ragged_dot` as XLA lowers it for the GPU. On
                  jax[cuda13] 0.11.2 compiled without a GPU (this host) it
                  lowers to one dense dot over all groups (G times the
                  FLOPs); upstream XLA sends it to cuDNN's grouped matmul
                  when the runtime's cuDNN is >= 9.22 (its weight gradient
                  needs >= 9.24), which a compile without a GPU cannot see.
                  On a CPU it runs XLA:CPU's lowering instead.
  pallas_triton   `jax.lax.ragged_dot` under jax's opt-in Pallas-Triton
                  lowering (`jax_ragged_dot_use_gpu_pallas_triton_lowering`;
                  in some jax releases only, not in every one: the entry
                  does not load where the flag is missing).
  tokamax         Tokamax's grouped kernels in its order, Mosaic GPU then
                  Triton, without its XLA implementation (which is
                  `ragged_dot`, dense on XLA:GPU): what `"kernel"` runs on
                  a GPU.
  tokamax_mosaic  Tokamax's Pallas Mosaic GPU kernel (sm90 and up).
  tokamax_triton  Tokamax's Pallas Triton kernel.
  tokamax_xla     Tokamax's XLA implementation: the wrapper's masks and VJP
                  (`tokamax_ragged_dot`) on any backend; what
                  `kernels_on_cpu("tokamax")` runs.
  pallas_triton_gmm  our own Pallas-Triton grouped matmul
                  (`triton_grouped`): forward, input and weight gradient
                  as Triton kernels on a GPU; interpreted on a CPU. With
                  it, the decode expert matmul (`triton_decode`,
                  unmeasured, `Kernel.decode`): nothing runs it by default.

Each takes float16, bfloat16 and float32 operands (Tokamax's kernels take
other types only as qwix `QArray`s). Which one `"auto"` runs is
`gpu.auto_table`'s choice.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp

from linen_moe._src.kernels.kernel import Entry
from linen_moe._src.kernels.kernel import Parts
from linen_moe._src.kernels.kernel import rows_valid

PALLAS_TRITON_FLAG = "jax_ragged_dot_use_gpu_pallas_triton_lowering"
PALLAS_TRITON_LOWERING = "jax._src.lax.pallas_lowerings.gpu"
FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32)
AUTO_TABLE = "gpu/gpu_routes.json"


def _ragged_dot(lhs, rhs, group_sizes, preferred_element_type=None):
  """`jax.lax.ragged_dot`, the rows past the groups' total zeroed (a TPU
  leaves them unwritten; nothing says a GPU lowering writes them)."""
  out = jax.lax.ragged_dot(
      lhs,
      rhs,
      group_sizes.astype(jnp.int32),
      preferred_element_type=preferred_element_type,
  )
  return jnp.where(rows_valid(lhs.shape[0], group_sizes)[:, None], out, 0)


def _xla(interpret: bool) -> Parts:
  del interpret
  return Parts(_ragged_dot)


def pallas_triton_state():
  """jax's config state of `PALLAS_TRITON_FLAG` (a context manager).

  Raises:
    ImportError: this jax has no such flag.
  """
  from jax._src import config as jax_config

  state = getattr(jax_config, PALLAS_TRITON_FLAG, None)
  if state is None:
    raise ImportError(f"jax {jax.__version__} has no {PALLAS_TRITON_FLAG}")
  # jax 0.11.2 has the flag but not the module its lowering imports (seen
  # compiling for an H200: ModuleNotFoundError at lowering).
  try:
    lowering = importlib.util.find_spec(PALLAS_TRITON_LOWERING)
  except ModuleNotFoundError:  # its package is missing too
    lowering = None
  if lowering is None:
    raise ImportError(
        f"jax {jax.__version__} has {PALLAS_TRITON_FLAG} but not "
        f"{PALLAS_TRITON_LOWERING}, which its lowering imports"
    )
  return state


def _pallas_triton_call(lhs, rhs, group_sizes, preferred_element_type=None):
  with pallas_triton_state()(True):
    return _ragged_dot(lhs, rhs, group_sizes, preferred_element_type)


def _pallas_triton(interpret: bool) -> Parts:
  del interpret
  pallas_triton_state()
  return Parts(_pallas_triton_call)


def _tokamax(implementation, interpret: bool) -> Parts:
  from linen_moe._src.kernels import tokamax_ragged_dot as tokamax

  return Parts(tokamax.load(implementation, interpret))


def _triton_gmm(interpret: bool) -> Parts:
  try:
    from linen_moe._src.kernels.gpu import triton_grouped
  except ImportError as e:  # a jax without Pallas' Triton backend
    raise ImportError(f"jax.experimental.pallas.triton: {e}") from e
  from linen_moe._src.kernels.gpu import triton_decode

  return Parts(
      functools.partial(
          triton_grouped.triton_grouped_matmul, interpret=interpret
      ),
      decode=functools.partial(
          triton_decode.decode_matmul, interpret=interpret
      ),
  )


def _route(name, title, loader, *, on_cpu=None, needs="") -> Entry:
  """A GPU route: it takes `FLOATS`, and "auto" chooses it from
  `AUTO_TABLE` (tokamax_xla, which is `ragged_dot` again, never)."""
  return Entry(
      name=name,
      backend="gpu",
      title=title,
      operand_dtypes=FLOATS,
      loader=loader,
      auto_table=None if name == "tokamax_xla" else AUTO_TABLE,
      on_cpu=on_cpu,
      needs=needs,
  )


_GPU = "an NVIDIA GPU"
_TOKAMAX = functools.partial(functools.partial, _tokamax)
ENTRIES = (
    _route("xla_ragged_dot", "XLA ragged_dot", _xla, on_cpu="xla"),
    _route(
        "pallas_triton",
        "ragged_dot on jax's Pallas-Triton lowering",
        _pallas_triton,
        needs=(
            f"{_GPU} (the flag {PALLAS_TRITON_FLAG} changes the CUDA "
            "lowering only) and a jax that has the flag"
        ),
    ),
    _route(
        "tokamax",
        "tokamax ragged_dot",
        _TOKAMAX(("mosaic", "triton")),
        needs=f"{_GPU} and tokamax (on a CPU its kernels do not run)",
    ),
    _route(
        "tokamax_mosaic",
        "tokamax Mosaic GPU ragged_dot",
        _TOKAMAX(("mosaic",)),
        needs=f"{_GPU} of sm90 or newer (Mosaic GPU) and tokamax",
    ),
    _route(
        "tokamax_triton",
        "tokamax Triton ragged_dot",
        _TOKAMAX(("triton",)),
        needs=f"{_GPU} (Triton) and tokamax",
    ),
    _route(
        "tokamax_xla",
        "tokamax XLA ragged_dot",
        _TOKAMAX(("xla",)),
        on_cpu="xla",
    ),
    # A `pallas_call`'s outputs carry no manual-axis types: not inside a
    # `shard_map` that checks them.
    dataclasses.replace(
        _route(
            "pallas_triton_gmm",
            "our Pallas-Triton grouped matmul",
            _triton_gmm,
            on_cpu="interpret",
        ),
        in_shard_map=False,
        decode=True,
    ),
)
