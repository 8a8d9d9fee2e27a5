"""On the GPU: every grouped-matmul route it offers equals a float64 NumPy
row loop, in the output and both gradients.

The routes: the registry's GPU entries (`registry.entries("gpu")`: XLA's
`ragged_dot` as the machine lowers it, jax's Pallas-Triton lowering of it,
Tokamax's Mosaic GPU and Triton kernels, Tokamax's default order and its
XLA implementation), `"blocked"`, and whatever `"auto"` picks there. Each
on problems with empty groups, a one-row group, skewed sizes and rows past
the groups' total (whose output and input gradient must be exactly zero,
as must an empty group's weight gradient): float32 at the highest matmul
precision (no TF32) to 1e-4 of the largest magnitude, and bfloat16 to 2 %
of it (a bf16 output rounds to 2^-8; the gradients sum 50-150 products).
Each route's compiled program is recorded (its custom-call targets, its
contractions' opcodes, XLA's FLOP count against the useful 6 M K N), so the
run shows what each route became on the machine, before any assertion. A
GPU kernel that refuses the small problem (below its tiles) is recorded
and skipped with its error; the problem at 128 a side it must run.

Skipped at collection without a GPU (tests/gpu_checks.py); rehearsed on a
CPU with LINEN_MOE_GPU_CHECKS_ON_CPU=1, where the routes that need the
GPU's own kernels (Tokamax's Mosaic and Triton) skip with what they need.
"""

from __future__ import annotations

import functools

from tests import gpu_checks

gpu_checks.skip_unless_asked()

from absl.testing import absltest  # noqa: E402
from absl.testing import parameterized  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from linen_moe import hlo  # noqa: E402
from linen_moe._src.kernels import grouped_matmul as gmm_lib  # noqa: E402
from linen_moe._src.kernels import registry  # noqa: E402
from tests import gmm_cases  # noqa: E402
from tests import numpy_reference  # noqa: E402

# (M, K, N, group sizes): groups 1 and 3 empty, group 0 one row, sizes
# skewed, rows past the total (16 and 72); the second at the 128 a side
# that kernels with fixed tiles take.
PROBLEMS = {
    "small": (72, 24, 40, (1, 0, 50, 0, 5)),
    "tiles": (256, 128, 128, (1, 0, 150, 0, 33)),
}
CASES = (
    ("small", jnp.float32),
    ("tiles", jnp.float32),
    ("tiles", jnp.bfloat16),
)
# Of each leaf's largest magnitude (at least 1).
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 0.02}
# The GPU routes whose own program runs on a CPU too: XLA ops, and the
# Pallas-Triton flag (which changes only the CUDA lowering: on a CPU it is
# XLA:CPU's ragged_dot, traced under the flag).
_RUN_ON_CPU = {"pallas_triton"}
ROUTES = {e.name: e for e in registry.entries("gpu")}
# The GPU's own kernels, which may refuse a problem below their tiles.
REFUSE_SMALL = {"tokamax", "tokamax_mosaic", "tokamax_triton", "pallas_triton"}
NAMES = (*ROUTES, "blocked", "auto")
NAMED = tuple(
    (f"{name}_{problem}_{jnp.dtype(dtype).name}", name, (problem, dtype))
    for name in NAMES
    for problem, dtype in CASES
)


def _matmul(name: str, dtype):
  """(the grouped matmul `name` runs, what it is), or (None, why it cannot
  run here)."""
  here = jax.default_backend()
  if name in ("blocked", "auto"):
    return functools.partial(gmm_lib.grouped_matmul, implementation=name), name
  entry = ROUTES[name]
  if here != "gpu" and not (entry.on_cpu or name in _RUN_ON_CPU):
    return None, f"{entry.key} runs only on its device: it needs {entry.needs}"
  if not entry.takes((dtype,)):
    return None, f"{entry.key} does not take {jnp.dtype(dtype).name}"
  kernel, missing = registry.load(entry, "gpu" if here == "gpu" else "cpu")
  if kernel is None:
    return None, f"{entry.key} does not load here: {missing}"
  return kernel.fn, entry.key


def _program(run, args, m, k, n) -> dict:
  """What the compiled forward + backward holds."""
  compiled = run.lower(*args).compile()
  text = compiled.as_text()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  flops = (cost or {}).get("flops")
  return {
      "custom_calls": gpu_checks.custom_call_targets(text),
      "contractions": sorted({c.opcode for c in hlo.contractions(text)}),
      "flops": flops,
      "useful_flops": 6 * m * k * n,
  }


class RoutesOnGpuTest(parameterized.TestCase):

  @parameterized.named_parameters(*NAMED)
  def test_on_gpu_route_equals_numpy(self, name, case):
    problem, dtype = case
    matmul, what = _matmul(name, dtype)
    if matmul is None:
      self.skipTest(what)
    m, k, n, sizes = PROBLEMS[problem]
    lhs, rhs, group_sizes, dout = gmm_cases.operands(m, k, n, sizes, dtype)
    run = jax.jit(functools.partial(gmm_cases.fwd_bwd, matmul))
    args = (lhs, rhs, group_sizes, dout)
    key = f"{name}/{problem}/{jnp.dtype(dtype).name}"
    with jax.default_matmul_precision("highest"):
      try:
        program = _program(run, args, m, k, n)
      except Exception as e:  # noqa: BLE001 (a refusal is recorded)
        # A kernel of fixed tiles may refuse the small problem (K = 24,
        # N = 40); the problem at 128 a side it must run.
        if problem != "small" or name not in REFUSE_SMALL:
          raise
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        gpu_checks.record("routes", key, {"runs": what, "refused": why})
        self.skipTest(f"{key} refused: {why}")
      got = run(*args)
    # The reference from the operands as the route saw them (bf16-rounded).
    want = numpy_reference.grouped_matmul(lhs, rhs, group_sizes, dout)
    errors = gpu_checks.relative_errors(("out", "dlhs", "drhs"), got, want)
    if name == "auto":
      shape = (m, k, n, len(sizes))
      impl, entry = registry.auto(jax.default_backend(), shape, (dtype, dtype))
      what = entry.key if entry else impl
    gpu_checks.record(
        "routes", key, {"runs": what, "relative_error": errors, **program}
    )
    for part, error in errors.items():
      self.assertLessEqual(error, TOLERANCE[dtype], (key, part))
    out, dlhs, drhs = (np.asarray(a) for a in got)
    total = int(np.sum(sizes))
    np.testing.assert_array_equal(out[total:], 0, "output past the total")
    np.testing.assert_array_equal(dlhs[total:], 0, "dlhs past the total")
    empty = np.asarray(sizes) == 0
    np.testing.assert_array_equal(drhs[empty], 0, "an empty group's drhs")


if __name__ == "__main__":
  absltest.main()
