"""What a grouped-matmul kernel is, for the registry (`registry`): a loaded
kernel (`Kernel`: the callables) and a registered one (`Entry`: its name,
its backend's folder, what it can do, how to load it).

Every kernel computes the contract of `grouped_matmul` (lhs [M, K] sorted by
group, rhs [G, K, N], group_sizes <int32>[G] -> [M, N]; rows past
sum(group_sizes) zero, and so are their input gradients; an empty group's
weight gradient zero), with its own VJP. An entry's `load` wraps the
kernel's function in the checks every backend shares
(`operand_shapes.check_dtypes`, `check_group_sizes`), so a dtype the kernel
cannot take or concrete group sizes past the rows give the same error on a
GPU route as on a TPU one, before anything is imported or traced.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from linen_moe._src.kernels.operand_shapes import check_dtypes
from linen_moe._src.kernels.operand_shapes import check_group_sizes
from linen_moe._src.kernels.operand_shapes import check_shapes

BACKENDS = ("tpu", "gpu")


class KernelFallbackWarning(UserWarning):
  """`grouped_matmul="kernel"` ran a contraction with `jax.lax.ragged_dot`
  because the kernel does not take its operand types, or cannot run where
  it was called (megablox inside a `shard_map`)."""


@dataclasses.dataclass(frozen=True)
class Kernel:
  """A grouped-matmul kernel, loaded.

  Attributes:
    name: what it is, for messages ("pallas gmm", "tokamax ragged_dot").
    fn: (lhs, rhs, group_sizes, preferred_element_type) -> [M, N].
    operand_dtypes: the dtypes it takes for lhs and rhs.
    in_shard_map: whether it runs inside a `shard_map` that checks
      manual-axis types (`check_vma`, the expert-parallel path's): a
      `pallas_call`'s outputs carry none.
    int8_scaled: the int8 grouped matmul with in-kernel scales, where the
      kernel has one (`pallas_int8.int8_grouped_matmul_scaled`'s
      signature), else None.
    paired: the gate and up projections, their backward in one call each
      way, where the kernel has it (`pallas_gate_up.paired_grouped_matmul`'s
      signature), else None.
    decode: the decode expert matmul (few token-assignments, each
      distinct expert's weights read once; `triton_decode.decode_matmul`'s
      signature), where the kernel has one, else None.
  """

  name: str
  fn: Callable[..., jax.Array]
  operand_dtypes: tuple[Any, ...]
  in_shard_map: bool = True
  int8_scaled: Callable[..., jax.Array] | None = None
  paired: Callable[..., tuple[jax.Array, jax.Array]] | None = None
  decode: Callable[..., jax.Array] | None = None

  def takes(self, dtypes: tuple[Any, ...]) -> bool:
    allowed = {jnp.dtype(d) for d in self.operand_dtypes}
    return all(jnp.dtype(d) in allowed for d in dtypes)

  def describe_dtypes(self) -> str:
    return "/".join(jnp.dtype(d).name for d in self.operand_dtypes)


@dataclasses.dataclass(frozen=True)
class Parts:
  """What an entry's loader returns: the callables of a `Kernel`."""

  fn: Callable[..., jax.Array]
  int8_scaled: Callable[..., jax.Array] | None = None
  paired: Callable[..., tuple[jax.Array, jax.Array]] | None = None
  decode: Callable[..., jax.Array] | None = None


@dataclasses.dataclass(frozen=True)
class Entry:
  """A registered grouped-matmul kernel and its capabilities.

  Attributes:
    name: its name in its backend's folder ("pallas", "tokamax_mosaic").
    backend: the folder it lives in, the platform it is built for: "tpu"
      or "gpu".
    title: what it is, for messages ("pallas gmm").
    operand_dtypes: the lhs / rhs (and output) dtypes it takes.
    loader: interpret -> `Parts`; raises `ImportError` saying what is
      missing (a jax without Pallas TPU, tokamax not installed, a jax
      without the flag a route sets).
    paired_gate_up: whether it has the gate and up projections as one call.
    gathers: whether the sparse path's row gathers run as its DMA kernels
      (`pallas_gather`) where it is the grouped matmul.
    in_shard_map: whether it runs inside a `shard_map` that checks
      manual-axis types.
    int8_scaled: whether it has the int8 grouped matmul with in-kernel
      scales.
    auto_table: the package-data table `grouped_matmul="auto"` reads for it
      ("tpu/gmm_tiles.json"), or None.
    on_cpu: how it runs on a CPU: "interpret" (Pallas interpret mode: the
      kernel's own program), "xla" (it is XLA ops: what runs is the CPU's
      lowering, not its device's), or None (only on its device).
    needs: what it needs to run, where `on_cpu` is None (for the reason a
      test skips it).
    auto_int8_min_rows: the fewest rows at which `grouped_matmul="auto"`
      runs its int8 kernel, where it was measured faster; None: never.
    min_dim: the least M, K and N it takes (Tokamax's Mosaic TPU kernel:
      128).
    decode: whether it has a decode expert matmul (`Kernel.decode`); none
      runs by default (`registry.find_decode` loads one by key).
  """

  name: str
  backend: str
  title: str
  operand_dtypes: tuple[Any, ...]
  loader: Callable[[bool], Parts] = dataclasses.field(repr=False)
  paired_gate_up: bool = False
  gathers: bool = False
  in_shard_map: bool = True
  int8_scaled: bool = False
  auto_table: str | None = None
  on_cpu: str | None = None
  needs: str = ""
  auto_int8_min_rows: int | None = None
  min_dim: int = 1
  decode: bool = False

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(
          f"Entry {self.name!r}: backend must be one of {BACKENDS}; got "
          f"{self.backend!r}."
      )
    if self.on_cpu not in (None, "interpret", "xla"):
      raise ValueError(
          f"Entry {self.name!r}: on_cpu must be None, 'interpret' or 'xla';"
          f" got {self.on_cpu!r}."
      )

  @property
  def key(self) -> str:
    """ "backend/name", e.g. "tpu/pallas"."""
    return f"{self.backend}/{self.name}"

  def takes(self, dtypes: tuple[Any, ...]) -> bool:
    allowed = {jnp.dtype(d) for d in self.operand_dtypes}
    return all(jnp.dtype(d) in allowed for d in dtypes)

  def check(self, lhs, rhs, group_sizes, preferred_element_type=None):
    """The checks every kernel runs first: shapes, dtypes this kernel
    takes, concrete group sizes. Returns the output dtype.

    Raises:
      ValueError: a shape that does not fit, group sizes negative or
        summing past M.
      TypeError: a dtype this kernel does not take.
    """
    check_shapes(lhs, rhs, group_sizes)
    out = check_dtypes(
        lhs,
        rhs,
        group_sizes,
        preferred_element_type,
        self.operand_dtypes,
        f"{self.title} ({self.key})",
    )
    check_group_sizes(group_sizes, lhs.shape[0])
    return out

  def load(self, interpret: bool = False) -> Kernel:
    """The loaded kernel; its `fn` checks its operands (`check`) first.

    Args:
      interpret: run Pallas kernels in interpret mode (on a CPU).

    Raises:
      ImportError: what it needs is missing (the message says what).
    """
    parts = self.loader(interpret)
    return Kernel(
        name=self.title,
        fn=functools.partial(_checked, self, parts.fn),
        operand_dtypes=self.operand_dtypes,
        in_shard_map=self.in_shard_map,
        int8_scaled=parts.int8_scaled,
        paired=parts.paired,
        decode=parts.decode,
    )

  def __call__(
      self, lhs, rhs, group_sizes, preferred_element_type=None, *, interpret
  ) -> jax.Array:
    """Checks the operands, then loads and runs the kernel: the checks
    come before any import, so a bad call fails the same way where the
    kernel cannot load."""
    self.check(lhs, rhs, group_sizes, preferred_element_type)
    return self.load(interpret).fn(
        lhs, rhs, group_sizes, preferred_element_type
    )


def _checked(
    entry: Entry, fn, lhs, rhs, group_sizes, preferred_element_type=None
):
  entry.check(lhs, rhs, group_sizes, preferred_element_type)
  return fn(lhs, rhs, group_sizes, preferred_element_type)


def rows_valid(m: int, group_sizes: jax.Array) -> jax.Array:
  """<bool>[M]: rows inside some group (the rows a kernel that leaves the
  others unwritten must mask)."""
  return jax.lax.iota(jnp.int32, m) < jnp.sum(group_sizes)
