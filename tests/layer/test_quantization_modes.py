"""The quantization modes' table against what the code and XLA really do.

Every other module reads its facts from `quantization_modes`; these tests
check the table itself: its HLO names against compiled programs, its state
and RNG flags against the layer's variables and errors, its storage types
against what `quantization.quantize_weights` writes.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

from linen_moe import RoutedMoE
from linen_moe import load_moe_config
from linen_moe import quantization
from linen_moe._src.config import quantization_modes as qm
from linen_moe._src.config.variables import AQT_RNG_STREAM
from linen_moe._src.quantization import serving as serving_lib
from linen_moe._src.quantization import stored_weights as sw
from linen_moe.sharding import unbox
from linen_moe.variables import OVERWRITE_WITH_GRADIENT as OWG

# Every element type the table names, once.
TABLE_DTYPES = sorted(
    {
        jnp.dtype(d).name
        for m in quantization.MODES.values()
        for d in (m.forward_dtype, m.gradient_dtype, m.storage_dtype)
        if d is not None
    }
    | {"bfloat16", "float32", "int32", "uint8", "int4"}
)


@functools.cache
def _init(mode: str):
  # The dense path: its einsums are AQT's, whose gradient draws the RNG (the
  # sparse path's int8 grouped matmul rounds to nearest and needs none).
  cfg = load_moe_config("tiny_mixtral", quantization=mode, sparse_matmul=False)
  x = jax.random.normal(jax.random.key(1), (1, 4, cfg.emb_dim))
  return cfg, x, unbox(jax.jit(RoutedMoE(cfg).init)(jax.random.key(0), x))


class TableTest(parameterized.TestCase):

  @parameterized.parameters(*TABLE_DTYPES)
  def test_hlo_name_is_the_compiled_programs(self, name):
    dtype = jnp.dtype(name)
    compiled = jax.jit(lambda x: x.astype(dtype)).lower(jnp.ones(4)).compile()
    self.assertIn(f" {qm.hlo_type_name(dtype)}[4]", compiled.as_text())

  def test_lists_agree_with_the_flags(self):
    self.assertEqual(
        tuple(quantization.MODES), ("none", "int8", "fp8", "nanoo_fp8")
    )
    self.assertEqual(quantization.SERVING_MODES, qm.QUANTIZED)
    self.assertEqual(qm.FP8_MODES, ("fp8", "nanoo_fp8"))
    self.assertEqual(
        quantization.MODES["fp8"].hlo_types, {"f8e4m3fn", "f8e5m2"}
    )
    self.assertEqual(quantization.MODES["none"].hlo_types, frozenset())
    with self.assertRaisesRegex(ValueError, "'int4'.*allowed"):
      qm.get_mode("int4")

  @parameterized.parameters(*tuple(quantization.MODES))
  def test_keeps_state_is_what_init_makes(self, mode):
    _, _, variables = _init(mode)
    self.assertEqual(
        bool(variables.get(OWG)), quantization.MODES[mode].keeps_state
    )

  @parameterized.parameters(*tuple(quantization.MODES))
  def test_needs_rng_is_what_the_gradient_asks_for(self, mode):
    cfg, x, variables = _init(mode)

    def loss(params, rngs):
      y, _ = RoutedMoE(cfg).apply({**variables, "params": params}, x, rngs=rngs)
      return jnp.sum(y)

    params = variables["params"]
    jax.eval_shape(jax.grad(loss), params, {AQT_RNG_STREAM: jax.random.key(0)})
    if quantization.MODES[mode].needs_rng:
      with self.assertRaisesRegex(ValueError, AQT_RNG_STREAM):
        jax.eval_shape(jax.grad(loss), params, {})
    else:
      jax.eval_shape(jax.grad(loss), params, {})

  @parameterized.parameters(*quantization.SERVING_MODES)
  def test_storage_is_what_serving_writes(self, mode):
    cfg, _, variables = _init(mode)
    _, served = quantization.quantize_weights(cfg, variables)
    facts = quantization.MODES[mode]
    self.assertEqual(served["params"]["wi_0"].dtype, facts.storage_dtype)
    scale = served["params"]["wi_0_scale"].shape
    if facts.storage_scales == qm.PER_CHANNEL:
      self.assertEqual(scale, (cfg.num_experts, 1, cfg.moe_mlp_dim))
      self.assertNotIn("wi_0_input_scale", served["params"])
    else:
      self.assertEqual(scale, (1,))
      self.assertEqual(served["params"]["wi_0_input_scale"].shape, (1,))
    # The leaves written are the layout's names, all in the one list the
    # loader and the byte count read.
    stored = {n for k in serving_lib.KERNELS for n in sw.stored_names(k, mode)}
    written = set(served["params"]) - {"gate"}
    self.assertEqual(written, stored)
    self.assertLessEqual(stored, set(serving_lib.KERNEL_LEAVES))


if __name__ == "__main__":
  absltest.main()
