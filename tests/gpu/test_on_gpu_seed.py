"""On the GPU: the seed table trains, really quantized, in both front ends.

Every cell of the table (quantization none / int8 / fp8 / nanoo_fp8 x the
sparse, dense and dense + dropping paths) of tiny_mixtral with scanned
layers, under the Linen and the NNX decoder: one train step compiled for
the GPU, whose contractions must be fed (at least) the mode's quantized
element types (`QuantizationMode.hlo_types`: int8 as s8, fp8 as f8e4m3fn
/ f8e5m2, nanoo_fp8 as the fnuz types) and an unquantized step none;
then two steps on one batch: the loss finite and falling, the parameters
moved, and every fp8 call site's state moved.

Where XLA:GPU keeps a quantized type native is recorded, not guessed: for
each cell, each quantized type the contractions see, the contractions
(and their custom-call targets: cuBLAS / cuBLASLt GEMMs) that take it as
an operand ("native") and those that meet it only upstream, converted to
a wider type first ("converted").

Skipped at collection without a GPU (tests/gpu_checks.py); rehearsed on a
CPU with LINEN_MOE_GPU_CHECKS_ON_CPU=1.
"""

from __future__ import annotations

import itertools

from tests import gpu_checks

gpu_checks.skip_unless_asked()

from absl.testing import absltest  # noqa: E402
from absl.testing import parameterized  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from linen_moe import MATMUL_PATHS  # noqa: E402
from linen_moe import hlo  # noqa: E402
from linen_moe._src.hlo import reading  # noqa: E402
from linen_moe._src.testing import helpers  # noqa: E402
from linen_moe.quantization import MODES  # noqa: E402
from linen_moe.training import FRONTENDS  # noqa: E402
from linen_moe.training import MarkovData  # noqa: E402
from linen_moe.training import default_optimizer  # noqa: E402
from nnx_adapter import frontend as get_frontend  # noqa: E402

CONFIG = "tiny_mixtral"
BATCH, SEQ = 2, 8
LEARNING_RATE = 1e-3
CELLS = tuple(
    ("_".join(cell), *cell)
    for cell in itertools.product(FRONTENDS, tuple(MODES), tuple(MATMUL_PATHS))
)


def where_types_are(text: str) -> dict[str, dict]:
  """For each quantized type feeding a contraction of the program: the
  contractions that take it as an operand ("native": opcode or GEMM
  target) and the number that meet it only upstream ("converted")."""
  instructions = reading.parse_hlo(text)
  out: dict[str, dict] = {}
  for c in hlo.contractions(text):
    operands = set().union(*c.operand_types) if c.operand_types else set()
    target = instructions[c.name].target or c.opcode
    for t in c.quantized_inputs:
      entry = out.setdefault(t, {"native": {}, "converted": 0})
      if t in operands:
        entry["native"][target] = entry["native"].get(target, 0) + 1
      else:
        entry["converted"] += 1
  return out


def _moved(before, after) -> list[bool]:
  return [
      bool(np.any(np.asarray(a) != np.asarray(b)))
      for a, b in zip(
          jax.tree.leaves(before), jax.tree.leaves(after), strict=True
      )
  ]


class SeedTableOnGpuTest(parameterized.TestCase):

  @parameterized.named_parameters(*CELLS)
  def test_on_gpu_cell_trains_quantized(self, frontend, mode, path):
    cfg = helpers.config_on_path(
        CONFIG, mode, path, scan_layers=True, scan_unroll=1
    )
    fe = get_frontend(frontend)
    tx = default_optimizer(LEARNING_RATE)
    tokens = jnp.asarray(next(MarkovData(cfg.vocab_size).batches(BATCH, SEQ)))
    state = fe.init(cfg, tx, tokens, jax.random.key(0))
    step = jax.jit(fe.make_step(cfg, tx))
    compiled = step.lower(state, tokens, jax.random.key(0)).compile()
    text = compiled.as_text()
    found = where_types_are(text)
    state1, m1 = compiled(state, tokens, jax.random.key(1))
    state2, m2 = compiled(state1, tokens, jax.random.key(2))
    losses = (float(m1["loss"]), float(m2["loss"]))
    gpu_checks.record(
        "seed",
        f"{frontend}/{mode}/{path}",
        {"types": found, "losses": losses},
    )
    expected = MODES[mode].hlo_types
    self.assertContainsSubset(expected, set(found), "types at contractions")
    if not expected:
      self.assertEmpty(found, "an unquantized step")
    self.assertTrue(np.isfinite(losses).all(), losses)
    self.assertLess(losses[1], losses[0], "the loss falls on one batch")
    self.assertTrue(any(_moved(fe.params(state), fe.params(state2))))
    if MODES[mode].keeps_state:
      moved = _moved(fe.fp8_state(state), fe.fp8_state(state2))
      self.assertTrue(moved and all(moved), "every fp8 state leaf moved")


if __name__ == "__main__":
  absltest.main()
