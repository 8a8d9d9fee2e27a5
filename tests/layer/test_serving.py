"""Quantized serving: conversion, serving layers on every path, bad input.

One case per (config, mode) converts a `RoutedMoE` once; its serving
variables serve all three paths. Each serving forward is compiled once and
both run and inspected; the float references are shared across modes.
"""

import functools
import itertools
import re

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from linen_moe import MATMUL_PATHS
from linen_moe import Decoder
from linen_moe import RoutedAndSharedMoE
from linen_moe import RoutedMoE
from linen_moe import hlo
from linen_moe import load_model_config
from linen_moe import load_moe_config
from linen_moe import quantization
from linen_moe import testing
from linen_moe._src.config import expert_weights
from linen_moe._src.quantization import serving as serving_lib
from linen_moe._src.quantization import stored_weights
from linen_moe._src.testing import helpers
from linen_moe.models import scanned_to_unrolled
from linen_moe.quantization import MODES as FACTS
from linen_moe.quantization import SERVING_MODES as MODES
from linen_moe.sharding import unbox
from linen_moe.testing import TINY_CONFIGS
from linen_moe.variables import OVERWRITE_WITH_GRADIENT as OWG
import nnx_adapter
from tests import workers

SITES = ("wi_0", "wi_1", "wo")
HLO_TYPE = {m: FACTS[m].hlo_storage_type for m in MODES}
FP8_MAX = {"fp8": 448.0, "nanoo_fp8": 240.0}
# ||y_serve - y_float|| / ||y_float||: the training-mode bounds of
# tests/layer/test_quantization.py (serving quantizes the same expert contractions,
# and nothing else).
BOUND = {"int8": 0.04, "fp8": 0.12, "nanoo_fp8": 0.12}
# A serving forward against the training-mode forward of the same weights
# (and fp8 state) on the sparse path. The quantized operands are bitwise the
# same (same int8 grid, same fp8 scales); what differs is where the scales
# are applied: after the dot (serving) or to each operand before it
# (training, fp8), and the dense paths sum the k expert outputs in another
# order. Measured: int8 sparse 0 (identical), int8 dense 7e-8, fp8 2e-7.
SERVE_VS_TRAIN = 1e-6
# The dense paths of the training mode also quantize the combine weights (and
# the dispatch mask), which serving keeps float: measured 0.7% (int8) on the
# dense path; they stay within the training-mode bounds above.


_rel_err = helpers.rel_err


def _x(config):
  return jax.random.normal(jax.random.key(1), (2, 8, config.emb_dim))


@functools.cache
def _float_variables(name: str):
  config = load_moe_config(name)
  return unbox(jax.jit(RoutedMoE(config).init)(jax.random.key(0), _x(config)))


def _learned_fp8_state(config, params, x):
  """The fp8 state one training step leaves: each site's newest amax entry
  holds its operand's amax (the history the next step's scales come from);
  the stored scales are stale (1), as after the first step."""
  variables = jax.jit(RoutedMoE(config).init)(jax.random.key(0), x)
  state = unbox(variables)[OWG]
  amax = {"wi_0": 3.0, "wi_1": 3.0, "wo": 1.5}  # the inputs' ranges
  for site in SITES:
    site_state = dict(state[f"{site}_dot"])
    kernel_amax = jnp.max(jnp.abs(params[site]))
    for role, value in (("kernel", kernel_amax), ("input", amax[site])):
      history = site_state[f"{role}_amax_history"]
      site_state[f"{role}_amax_history"] = history.at[0].set(value)
    state[f"{site}_dot"] = site_state
  return state


@functools.cache
def _training_case(name: str, mode: str):
  """(training config, variables incl. fp8 state, training sparse output)."""
  config = load_moe_config(name, quantization=mode, **MATMUL_PATHS["sparse"])
  variables = dict(_float_variables(name))
  x = _x(config)
  if FACTS[mode].keeps_state:
    variables[OWG] = _learned_fp8_state(config, variables["params"], x)
  y = jax.jit(RoutedMoE(config).apply)(variables, x)[0]
  return config, variables, y


@functools.cache
def _serving(name: str, mode: str):
  config, variables, _ = _training_case(name, mode)
  return quantization.quantize_weights(config, variables)


@functools.cache
def _serve(name: str, mode: str, path: str):
  """(output, compiled HLO text) of the serving forward on `path`."""
  serve_config, serve_variables = _serving(name, mode)
  model = RoutedMoE(serve_config.replace(**MATMUL_PATHS[path]))
  x = _x(serve_config)
  compiled = jax.jit(model.apply).lower(serve_variables, x).compile()
  return compiled(serve_variables, x)[0], compiled.as_text()


@functools.cache
def _float_output(name: str, path: str):
  config = load_moe_config(name, **MATMUL_PATHS[path])
  return jax.jit(RoutedMoE(config).apply)(_float_variables(name), _x(config))[0]


# (config, mode) of the default run: every config and every mode once.
SERVING_DEFAULT = tuple(
    (config, MODES[i % len(MODES)]) for i, config in enumerate(TINY_CONFIGS)
)


class ServingLayerTest(parameterized.TestCase):
  """Serving `RoutedMoE` per config x mode, on all three paths: every config
  and mode once by default, the rest of the product slow."""

  @parameterized.parameters(*SERVING_DEFAULT)
  def test_serving_layer(self, config, mode):
    self.check_serving_layer(config, mode)

  @testing.slow
  @parameterized.parameters(*(
      case
      for case in itertools.product(TINY_CONFIGS, MODES)
      if case not in SERVING_DEFAULT
  ))
  def test_serving_layer_slow(self, config, mode):
    self.check_serving_layer(config, mode)

  def check_serving_layer(self, config, mode):
    serve_config, serve_variables = _serving(config, mode)
    self.assertTrue(serve_config.serving)
    self._check_stored(serve_config, serve_variables, mode)
    for path in MATMUL_PATHS:
      with self.subTest(path=path):
        y, text = _serve(config, mode, path)
        self._check_compiled(serve_config, text, mode)
        err = _rel_err(y, _float_output(config, path))
        self.assertLess(err, BOUND[mode], "serving vs float layer")
    _, _, y_train = _training_case(config, mode)
    for path in ("sparse", "dense"):
      with self.subTest(path=path, against="training-mode sparse forward"):
        y, _ = _serve(config, mode, path)
        self.assertLess(_rel_err(y, y_train), SERVE_VS_TRAIN)

  def _check_stored(self, config, variables, mode):
    params = variables["params"]
    storage = stored_weights.STORAGE_DTYPES[mode]
    e, m, h = config.num_experts, config.emb_dim, config.moe_mlp_dim
    for site in SITES:
      self.assertEqual(params[site].dtype, storage, site)
    float_shapes = {(e, m, h), (e, h, m)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(variables):
      if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != storage:
        self.assertNotIn(leaf.shape, float_shapes, jax.tree_util.keystr(path))
    self.assertNotIn(OWG, variables)

  def _check_compiled(self, config, text, mode):
    """The compiled forward takes the kernels in their storage type (its
    entry parameters), and that type feeds each expert contraction."""
    e, m, h = config.num_experts, config.emb_dim, config.moe_mlp_dim
    kind = HLO_TYPE[mode]
    entry = _entry_parameter_types(text)
    for shape in (f"[{e},{m},{h}]", f"[{e},{h},{m}]"):
      self.assertIn(kind + shape, entry)
      self.assertFalse(
          [t for t in entry if t.endswith(shape) and t != kind + shape]
      )
    for site in SITES:
      fed = [
          c.quantized_inputs
          for c in hlo.contractions(text)
          if f"/{site}_dot/" in c.op_name
      ]
      self.assertTrue(any(kind in t for t in fed), (site, fed))


def _entry_parameter_types(text: str) -> list[str]:
  """Types of the entry computation's parameters, e.g. "s8[8,64,128]"."""
  (line,) = [ln for ln in text.splitlines() if ln.startswith("ENTRY")]
  signature = line[line.index("(") + 1 : line.index(") ->")]
  return re.findall(r":\s*([a-z0-9]+\[[0-9,]*\])", signature)


class ConversionTest(parameterized.TestCase):
  """quantize_weights on decoders and layers: layout, scales, untouched rest."""

  @functools.cached_property
  def decoder(self):
    """tiny_gemma4_26b (routed + shared experts), fp8, scanned variables."""
    config = load_model_config("tiny_gemma4_26b", quantization="fp8")
    tokens = jnp.zeros((1, 8), jnp.int32)
    variables = unbox(jax.jit(Decoder(config).init)(jax.random.key(0), tokens))
    return config, variables

  def test_decoder_scanned_and_unrolled(self):
    config, variables = self.decoder
    before = jax.tree.map(np.array, variables)
    serve_config, served = quantization.quantize_weights(config, variables)
    self.assertTrue(serve_config.moe.serving)
    self.assertEqual(serve_config.replace(serving=False), config)
    # The caller's variables are untouched, values and structure.
    jax.tree.map(np.testing.assert_array_equal, variables, before)
    self.assertEqual(variables["params"]["layers"]["moe"]["wi_0"].dtype, "f4")
    self.assertNotIn(OWG, served)
    layers = served["params"]["layers"]
    e4m3 = jnp.float8_e4m3fn
    for module in ("moe", "shared_experts"):
      for site in SITES:
        self.assertEqual(layers[module][site].dtype, e4m3, (module, site))
        self.assertEqual(layers[module][f"{site}_scale"].shape, (2, 1))
    # Everything outside the experts is the caller's, bit for bit.
    flat = dict(jax.tree_util.tree_leaves_with_path(before["params"]))
    for path, leaf in jax.tree_util.tree_leaves_with_path(served["params"]):
      name = str(path[-1].key)
      if not name.startswith(SITES):
        np.testing.assert_array_equal(leaf, flat[path])
    # Unrolled: the same conversion, layer by layer.
    unrolled_config = config.replace(scan_layers=False)
    _, served_unrolled = quantization.quantize_weights(
        unrolled_config, scanned_to_unrolled(variables, config.num_layers)
    )
    jax.tree.map(
        np.testing.assert_array_equal,
        scanned_to_unrolled(served, config.num_layers),
        served_unrolled,
    )

  def test_int8_scales_per_expert_and_channel(self):
    # NumPy from the formula: scale = max|w| over the contracted axis / 127.5,
    # and every weight within half a step of its stored value.
    config = load_moe_config("tiny_mixtral", quantization="int8")
    params = _float_variables("tiny_mixtral")["params"]
    _, served = quantization.quantize_weights(config, {"params": params})
    for site in SITES:
      w = np.asarray(params[site], np.float64)  # [E, K, N]
      scale = np.max(np.abs(w), axis=1, keepdims=True) / 127.5
      stored = served["params"]
      np.testing.assert_allclose(stored[f"{site}_scale"], scale, rtol=1e-6)
      q = np.asarray(stored[site], np.float64)
      self.assertLessEqual(np.max(np.abs(q)), 127)
      self.assertTrue(np.all(np.abs(w - q * scale) <= scale / 2 * 1.0001))

  @parameterized.parameters("fp8", "nanoo_fp8")
  def test_fp8_scales(self, mode):
    fp8_max = FP8_MAX[mode]
    dtype = stored_weights.STORAGE_DTYPES[mode]
    config = load_moe_config("tiny_mixtral", quantization=mode)
    params = _float_variables("tiny_mixtral")["params"]
    state = _learned_fp8_state(config, params, _x(config))
    # A stale stored scale and a history with two entries: the training
    # forward's scale comes from the largest.
    wo = dict(state["wo_dot"])
    wo["kernel_amax_history"] = wo["kernel_amax_history"].at[5].set(9.0)
    wo["kernel_scale"] = jnp.full((1,), 0.25)
    state["wo_dot"] = wo
    # A fresh site (all-zero histories): the training forward keeps the
    # stored scale.
    wi_1 = dict(state["wi_1_dot"])
    wi_1["kernel_amax_history"] = jnp.zeros_like(wi_1["kernel_amax_history"])
    wi_1["kernel_scale"] = jnp.full((1,), 0.5)
    state["wi_1_dot"] = wi_1
    _, served = quantization.quantize_weights(
        config, {"params": params, OWG: state}
    )
    stored = served["params"]
    amax_wi_0 = float(np.max(np.abs(params["wi_0"])))
    expected = {"wi_0": amax_wi_0 / fp8_max, "wi_1": 0.5, "wo": 9.0 / fp8_max}
    expected_input = {"wi_0": 3.0, "wi_1": 3.0, "wo": 1.5}
    for site in SITES:
      np.testing.assert_allclose(
          stored[f"{site}_scale"], [expected[site]], rtol=1e-6
      )
      np.testing.assert_allclose(
          stored[f"{site}_input_scale"],
          [expected_input[site] / fp8_max],
          rtol=1e-6,
      )
      w = np.asarray(params[site], np.float32) / expected[site]
      w = np.clip(w, -fp8_max, fp8_max).astype(getattr(ml_dtypes, dtype.name))
      np.testing.assert_array_equal(
          np.asarray(stored[site]).view(np.uint8), w.view(np.uint8)
      )
    # No fp8 state at all: the kernel's own amax, input scale 1.
    _, served = quantization.quantize_weights(config, {"params": params})
    for site in SITES:
      amax = float(np.max(np.abs(params[site])))
      np.testing.assert_allclose(
          served["params"][f"{site}_scale"], [amax / fp8_max], rtol=1e-6
      )
      np.testing.assert_array_equal(
          served["params"][f"{site}_input_scale"], [1.0]
      )

  def test_expert_weight_bytes(self):
    config = load_moe_config("tiny_mixtral", quantization="int8")
    variables = _float_variables("tiny_mixtral")
    e, m, h = config.num_experts, config.emb_dim, config.moe_mlp_dim
    self.assertEqual(
        quantization.expert_weight_bytes(variables), 3 * e * m * h * 4
    )
    _, served = quantization.quantize_weights(config, variables)
    scales = (2 * e * h + e * m) * 4
    self.assertEqual(
        quantization.expert_weight_bytes(served), 3 * e * m * h + scales
    )

  def test_routed_and_shared_layer(self):
    config = load_moe_config("tiny_gemma4_26b", quantization="int8")
    x = _x(config)
    float_layer = RoutedAndSharedMoE(config.replace(quantization="none"))
    variables = unbox(jax.jit(float_layer.init)(jax.random.key(0), x))
    serve_config, served = quantization.quantize_weights(config, variables)
    for module in ("routed_experts", "shared_experts"):
      for site in SITES:
        self.assertEqual(served["params"][module][site].dtype, jnp.int8)
    y = jax.jit(RoutedAndSharedMoE(serve_config).apply)(served, x)[0]
    y_float = jax.jit(float_layer.apply)(variables, x)[0]
    self.assertLess(_rel_err(y, y_float), BOUND["int8"])


class HostConversionTest(parameterized.TestCase):
  """The checkpoint loader's host conversion makes convert_kernel's stored
  kernels and scales, bit for bit, in every mode that stores weights."""

  @parameterized.product(mode=MODES, dtype=("float32", "bfloat16"))
  def test_host_equals_device(self, mode, dtype):
    rng = np.random.default_rng(0)
    # Magnitudes over 8 decades (fp8's subnormals and clipping, int8's
    # small channels); layer 1's expert 0 and channel 0 of every expert
    # are zero (an all-zero int8 channel, an all-zero fp8 matrix).
    routed = rng.standard_normal((2, 4, 16, 8)) * 10.0 ** rng.uniform(
        -4, 4, (2, 4, 16, 8)
    )
    routed[1, 0] = 0.0
    routed[..., 0] = 0.0
    mlp = rng.standard_normal((16, 8)) * 10.0 ** rng.uniform(-4, 4, (16, 8))
    zeros = np.zeros((3, 16, 8))
    cases = (  # (kernel, rank, stacked)
        (routed, expert_weights.ROUTED_RANK, True),
        (mlp, expert_weights.MLP_RANK, False),
        (zeros, expert_weights.ROUTED_RANK, False),
    )
    for wide, rank, stacked in cases:
      kernel = wide.astype(jnp.dtype(dtype))
      with self.subTest(shape=kernel.shape):
        device = {
            suffix: np.asarray(v)
            for suffix, v in serving_lib.convert_kernel(
                mode, kernel, rank, None
            ).items()
        }
        host = {k: np.full_like(v, 7) for k, v in device.items()}
        for layer in range(kernel.shape[0]) if stacked else [None]:
          one = kernel if layer is None else kernel[layer]
          slot = () if layer is None else (layer,)
          serving_lib.convert_kernel_host(
              mode,
              lambda e, one=one: one if e is None else one[e],
              one.shape[0] if rank == expert_weights.ROUTED_RANK else None,
              {k: v[slot] for k, v in host.items()},
          )
        self.assertEqual(sorted(host), sorted(device))
        for suffix, want in device.items():
          self.assertEqual(host[suffix].dtype, want.dtype, suffix)
          np.testing.assert_array_equal(
              host[suffix].view(np.uint8), want.view(np.uint8), suffix
          )


class BadInputTest(parameterized.TestCase):
  """Each misuse is a clear error, raised before any work."""

  def setUp(self):
    super().setUp()
    self.config = load_moe_config("tiny_mixtral", quantization="int8")
    self.variables = _float_variables("tiny_mixtral")

  def test_config_field(self):
    with self.assertRaisesRegex(
        ValueError, "serving=True.*quantization='none'"
    ):
      load_moe_config("tiny_mixtral", serving=True)
    with self.assertRaisesRegex(ValueError, "serving='yes'.*bool"):
      load_moe_config("tiny_mixtral", quantization="int8", serving="yes")
    with self.assertRaisesRegex(ValueError, "quantization='int4'.*allowed"):
      load_moe_config("tiny_mixtral", quantization="int4")

  def test_quantize_weights_rejects(self):
    q = quantization.quantize_weights
    with self.assertRaisesRegex(ValueError, "quantization.*'none'"):
      q(self.config.replace(quantization="none"), self.variables)
    with self.assertRaisesRegex(ValueError, "already a serving config"):
      q(self.config.replace(serving=True), self.variables)
    serve_config, served = q(self.config, self.variables)
    with self.assertRaisesRegex(ValueError, "params/wi_0 is already converted"):
      q(self.config, served)
    with self.assertRaisesRegex(ValueError, "already a serving config"):
      q(serve_config, served)
    gemma = load_moe_config("tiny_gemma4_26b", quantization="int8")
    with self.assertRaisesRegex(ValueError, r"params/wi_0 has shape \(8, 64"):
      q(gemma, self.variables)
    with self.assertRaisesRegex(TypeError, "MoEConfig or a ModelConfig"):
      q("tiny_mixtral", self.variables)
    with self.assertRaisesRegex(TypeError, "'params' collection"):
      q(self.config, self.variables["params"])
    decoder = load_model_config("tiny_mixtral", quantization="int8")
    with self.assertRaisesRegex(ValueError, "params has no layers"):
      q(decoder, self.variables)
    self.assertEqual(self.variables["params"]["wi_0"].dtype, jnp.float32)

  def test_serving_layer_rejects(self):
    serve_config, served = quantization.quantize_weights(
        self.config, self.variables
    )
    x = _x(self.config)
    apply = RoutedMoE(serve_config).apply
    with self.assertRaisesRegex(ValueError, "wi_0 holds float weights"):
      apply(self.variables, x)
    fp8 = serve_config.replace(quantization="fp8")
    with self.assertRaisesRegex(ValueError, "converted for another mode"):
      RoutedMoE(fp8).apply(served, x)
    missing = {"params": dict(served["params"])}
    del missing["params"]["wo_scale"]
    with self.assertRaisesRegex(ValueError, "there is no params/wo_scale"):
      apply(missing, x)
    narrow = serve_config.replace(moe_mlp_dim=64)
    with self.assertRaisesRegex(ValueError, r"wi_0 has shape \(8, 64, 128\)"):
      RoutedMoE(narrow).apply(served, x)


class NNXServingTest(absltest.TestCase):
  """Both NNX entry points serve converted weights like Linen does."""

  def test_eager_to_nnx_wraps_a_serving_layer(self):
    serve_config, served = _serving("tiny_mixtral", "fp8")
    x = _x(serve_config)
    layer = nnx_adapter.EagerToNNX(RoutedMoE(serve_config), x, rngs=nnx.Rngs(0))
    state = nnx.state(layer)
    self.assertEqual(state["wi_0"].get_value().dtype, jnp.float8_e4m3fn)
    nnx_adapter.linen_to_nnx(served, layer)
    y = nnx.jit(lambda m: m(x)[0])(layer)
    after = nnx.state(layer)
    self.assertEqual(
        jax.tree.structure(after), jax.tree.structure(state), "grew on call"
    )
    np.testing.assert_allclose(y, _serve("tiny_mixtral", "fp8", "sparse")[0])

  def test_decoder_from_converted_variables(self):
    config = load_model_config("tiny_gemma4_26b", quantization="int8")
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, config.vocab_size)
    variables = unbox(jax.jit(Decoder(config).init)(jax.random.key(0), tokens))
    serve_config, served = quantization.quantize_weights(config, variables)
    model = nnx_adapter.Decoder.from_linen(serve_config, served)
    moe = nnx_adapter.nnx_to_linen(model)["params"]["layers"]["moe"]
    self.assertEqual(moe["wi_0"].dtype, jnp.int8)
    logits = nnx.jit(lambda m, t: m(t)[0])(model, tokens)
    expected = jax.jit(Decoder(serve_config).apply)(served, tokens)[0]
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


class ExpertParallelServingTest(absltest.TestCase):

  def test_mesh_serving_equals_one_device(self):
    # The expert-parallel sparse path splits the stored kernels (and int8's
    # per-expert scales) over `expert` and replicates fp8's per-tensor
    # scales; each device multiplies the same codes as one device does.
    (result,) = workers.sharding_jobs({
        "check": "serving",
        "modes": ["int8", "fp8"],
        "meshes": ["expert=8", "data=2,expert=4"],
    })
    self.assertLen(result, 4)
    for key, cell in result.items():
      self.assertLess(cell["err"], 1e-5 * cell["scale"], key)


if __name__ == "__main__":
  absltest.main()
