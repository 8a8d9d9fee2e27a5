"""Every registered grouped-matmul kernel keeps the grouped matmul's contract.

One class, one test per registered kernel (`registry.entries()`: the TPU's
and the GPU's folders) and check:

- the output and both gradients equal a float64 NumPy row loop
  (`numpy_reference.grouped_matmul`) on one problem with empty groups, a
  one-row group, skewed sizes and rows past the groups' total, whose
  output and input gradient are exactly zero, as is an empty group's
  weight gradient. A kernel runs here in Pallas interpret mode (the TPU
  kernels: their own programs, interpreted, traced for a TPU) or as XLA
  ops (`Entry.on_cpu`); one that runs only on its device (the GPU's
  Tokamax kernels, the Pallas-Triton lowering) is skipped here with what
  it needs, and runs on that device;
- a dtype it cannot take is a `TypeError`, and concrete group sizes past
  the rows a `ValueError`, the same message on every backend, raised
  before the kernel is imported (so checked here for the GPU's too);
- its loaded callables match its declared capabilities.
"""

from __future__ import annotations

import functools
import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax._src import mesh as mesh_lib
import jax.numpy as jnp
import numpy as np

from linen_moe._src.kernels import registry
from linen_moe._src.kernels.gpu import routes
from tests import gmm_cases
from tests import numpy_reference

# (M, K, N, group sizes): groups 1 and 3 empty, group 0 one row, sizes
# skewed (50 against 5), and 72 - 56 = 16 rows past the total.
PROBLEM = (72, 24, 40, (1, 0, 50, 0, 5))
# Tokamax's Mosaic TPU kernel takes every non-group dimension >= 128:
# the same pattern at 128 (256 - 184 = 72 rows past the total).
PROBLEM_128 = (256, 128, 128, (1, 0, 150, 0, 33))
TOLERANCE = dict(rtol=1e-5, atol=1e-4)
ENTRIES = {e.key.replace("/", "_"): e for e in registry.entries()}


def _here(entry) -> str | None:
  """None if `entry` runs on this machine, else why not."""
  if entry.on_cpu or jax.default_backend() == entry.backend:
    return None
  return f"{entry.key} runs only on its device: it needs {entry.needs}"


def _traced_for(entry):
  """The abstract mesh of the device `entry` is built for, where it is
  interpreted (Tokamax reads the TPU generation from it), else None."""
  if entry.backend != "tpu" or jax.default_backend() == "tpu":
    return None
  tpu = mesh_lib.AbstractDevice(
      device_kind="TPU v5 lite", num_cores=1, platform="tpu"
  )
  return jax.sharding.AbstractMesh(
      (1,), ("x",), axis_types=jax.sharding.AxisType.Auto, abstract_device=tpu
  )


class KernelConformanceTest(parameterized.TestCase):

  def test_the_registry_has_both_folders(self):
    backends = {e.backend for e in registry.entries()}
    self.assertEqual(backends, {"tpu", "gpu"})
    self.assertEqual(len(ENTRIES), len(registry.entries()), "keys unique")
    for backend, key in registry.KERNEL.items():
      self.assertEqual(registry.get(key).backend, backend)
    for key in registry.ON_CPU.values():
      self.assertIsNotNone(registry.get(key).on_cpu, key)

  @parameterized.named_parameters(*ENTRIES.items())
  def test_matches_the_reference(self, entry):
    why = _here(entry)
    if why:
      self.skipTest(why)
    interpret = jax.default_backend() != entry.backend
    kernel, missing = registry.load(entry, jax.default_backend())
    if kernel is None:
      self.skipTest(f"{entry.key} does not load here: {missing}")
    problem = PROBLEM_128 if entry.min_dim > PROBLEM[1] else PROBLEM
    lhs, rhs, sizes, dout = gmm_cases.operands(*problem)
    mesh = _traced_for(entry) if interpret else None
    run = jax.jit(functools.partial(gmm_cases.fwd_bwd, kernel.fn))
    if mesh is None:
      got = run(lhs, rhs, sizes, dout)
    else:
      with jax.sharding.use_abstract_mesh(mesh):
        got = run(lhs, rhs, sizes, dout)
    want = numpy_reference.grouped_matmul(lhs, rhs, sizes, dout)
    total = int(np.sum(sizes))
    for what, g, w in zip(("out", "dlhs", "drhs"), got, want, strict=True):
      np.testing.assert_allclose(
          np.asarray(g, np.float64), w, err_msg=what, **TOLERANCE
      )
    out, dlhs, drhs = (np.asarray(a) for a in got)
    np.testing.assert_array_equal(out[total:], 0, "output past the total")
    np.testing.assert_array_equal(dlhs[total:], 0, "dlhs past the total")
    empty = np.asarray(sizes) == 0
    np.testing.assert_array_equal(drhs[empty], 0, "an empty group's drhs")

  @parameterized.named_parameters(*ENTRIES.items())
  def test_a_dtype_it_cannot_take_is_a_type_error(self, entry):
    lhs = jnp.ones((8, 16), jnp.int8)
    rhs = jnp.ones((2, 16, 8), jnp.int8)
    sizes = jnp.asarray([3, 5], jnp.int32)
    title = re.escape(f"{entry.title} ({entry.key})")
    with self.assertRaisesRegex(
        TypeError, f"lhs has dtype int8; {title} takes .*float32"
    ):
      entry(lhs, rhs, sizes, jnp.int32, interpret=True)
    with self.assertRaisesRegex(
        TypeError, f"preferred_element_type=int32; {title} writes"
    ):
      entry(
          lhs.astype(jnp.float32),
          rhs.astype(jnp.float32),
          sizes,
          jnp.int32,
          interpret=True,
      )

  @parameterized.named_parameters(*ENTRIES.items())
  def test_group_sizes_past_the_rows_are_a_value_error(self, entry):
    lhs = jnp.ones((8, 16), jnp.float32)
    rhs = jnp.ones((2, 16, 8), jnp.float32)
    with self.assertRaisesRegex(
        ValueError, "group_sizes sum to 9, past the 8 rows of lhs"
    ):
      entry(lhs, rhs, jnp.asarray([4, 5], jnp.int32), interpret=True)
    with self.assertRaisesRegex(ValueError, "group_sizes must be >= 0"):
      entry(lhs, rhs, jnp.asarray([-1, 5], jnp.int32), interpret=True)

  @parameterized.named_parameters(*ENTRIES.items())
  def test_capabilities_are_what_it_loads(self, entry):
    kernel, missing = registry.load(entry, jax.default_backend())
    if kernel is None:
      self.skipTest(f"{entry.key} does not load here: {missing}")
    self.assertEqual(kernel.paired is not None, entry.paired_gate_up)
    self.assertEqual(kernel.int8_scaled is not None, entry.int8_scaled)
    self.assertEqual(kernel.decode is not None, entry.decode)
    self.assertEqual(kernel.in_shard_map, entry.in_shard_map)
    self.assertTrue(kernel.takes(entry.operand_dtypes))
    self.assertFalse(kernel.takes((jnp.int8,)))


class PallasTritonRouteTest(absltest.TestCase):
  """jax's opt-in Pallas-Triton ragged dot loads only where its lowering
  module exists (jax 0.11.2 has the flag without it; 0.12 has neither)."""

  def test_a_flag_without_its_lowering_is_unavailable(self):
    from jax._src import config as jax_config  # noqa: PLC0415

    flag = routes.PALLAS_TRITON_FLAG
    with (
        mock.patch.object(jax_config, flag, object(), create=True),
        mock.patch.object(
            routes.importlib.util, "find_spec", return_value=None
        ),
        self.assertRaisesRegex(ImportError, re.escape(f"has {flag} but not")),
    ):
      routes.pallas_triton_state()


if __name__ == "__main__":
  absltest.main()
