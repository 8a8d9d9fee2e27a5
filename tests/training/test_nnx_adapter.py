"""The NNX adapter, the NNX decoder and its train step, weight interchange."""

import itertools

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import MATMUL_PATHS
from linen_moe import Decoder as LinenDecoder
from linen_moe import RoutedMoE
from linen_moe import load_model_config
from linen_moe import sharding
from linen_moe import testing
from linen_moe import training
from linen_moe._src.config.quantization_modes import FP8_MODES
from linen_moe._src.testing import helpers
from linen_moe._src.testing.marks import heavy
from linen_moe.frontend import accumulate_gradients
from linen_moe.quantization import MODES
from linen_moe.sharding import unbox
from linen_moe.training import MarkovData
from linen_moe.variables import OVERWRITE_WITH_GRADIENT
import nnx_adapter

# The contraction call sites each path registers.
SITES = {
    "sparse": ("wi_0", "wi_1", "wo"),
    "dense": ("wi_0", "wi_1", "wo", "combine"),
    "dense_dropping": ("wi_0", "wi_1", "wo", "dispatch", "combine"),
}
FP8_VARIABLES = ("input", "kernel", "output_grad")
HISTORY = 1024
F32 = np.dtype("float32")
TX = training.default_optimizer(1e-2)
_config = helpers.config_on_path
# (mode, path) of the construction test's default run: an fp8 mode on
# every path (each registers other call sites, each with the same state in
# both fp8 modes), each mode at least once; the rest of the product is
# slow.
CONSTRUCTION = (
    ("fp8", "sparse"),
    ("fp8", "dense"),
    ("none", "sparse"),
    ("int8", "dense"),
    ("nanoo_fp8", "dense_dropping"),
)


def _signature(module: nnx.Module) -> set:
  """{(path, variable type, shape, dtype)} of every variable of `module`."""
  return {
      (path, type(v).__name__, v.get_value().shape, v.get_value().dtype)
      for path, v in nnx.to_flat_state(nnx.state(module))
  }


def _adapted_moe(cfg, batch=2, seq=8):
  x = jnp.zeros((batch, seq, cfg.moe.emb_dim))
  return nnx_adapter.EagerToNNX(RoutedMoE(cfg.moe), x, rngs=nnx.Rngs(0))


def _fp8_sites(fp8_state: dict) -> dict:
  """{(layer path..., site): {variable: array}} of a Linen-layout fp8 tree,
  scanned layers split into one entry per layer."""
  flat = nnx.traversals.flatten_mapping(fp8_state)
  sites = {}
  for path, value in flat.items():
    site, name = path[:-1], path[-1]
    if path[0] == "layers":  # stacked: one row per layer
      for i, row in enumerate(value):
        sites.setdefault((i, *site), {})[name] = row
    else:
      sites.setdefault(site, {})[name] = value
  return sites


class AdapterTest(parameterized.TestCase):

  @parameterized.parameters(*CONSTRUCTION)
  def test_all_state_exists_at_construction(self, mode, path):
    self.check_construction(mode, path)

  @testing.slow
  @parameterized.parameters(*(
      case
      for case in itertools.product(tuple(MODES), MATMUL_PATHS)
      if case not in CONSTRUCTION
  ))
  def test_all_state_exists_at_construction_slow(self, mode, path):
    self.check_construction(mode, path)

  def check_construction(self, mode, path):
    cfg = _config(quantization=mode, path=path)
    moe = _adapted_moe(cfg)
    before = _signature(moe)
    x = jax.random.normal(jax.random.key(1), (2, 8, cfg.moe.emb_dim))
    y, _ = moe(x, rngs=jax.random.key(2))
    self.assertEqual(y.shape, x.shape)
    self.assertEqual(_signature(moe), before)
    fp8 = {
        (path_[0], path_[1], shape, dtype)
        for path_, kind, shape, dtype in before
        if kind == "Fp8State"
    }
    expected = set()
    if mode in FP8_MODES:
      for site, var in itertools.product(SITES[path], FP8_VARIABLES):
        expected.add((f"{site}_dot", f"{var}_scale", (1,), F32))
        expected.add((f"{site}_dot", f"{var}_amax_history", (HISTORY,), F32))
    self.assertEqual(fp8, expected)
    # Params are the public layout in every mode: nothing quantized in them.
    params = {p[0] for p, _ in nnx.to_flat_state(nnx.state(moe, nnx.Param))}
    self.assertEqual(params, {"gate", "wi_0", "wi_1", "wo"})

  def test_fp8_collection_is_one_variable_type(self):
    self.assertEqual(
        nnx.variable_name_from_type(nnx_adapter.Fp8State),
        OVERWRITE_WITH_GRADIENT,
    )
    self.assertIs(
        nnx.variable_type_from_name(OVERWRITE_WITH_GRADIENT),
        nnx_adapter.Fp8State,
    )

  def test_int8_rounding_randomness_comes_from_call_rngs(self):
    moe = _adapted_moe(_config(quantization="int8", path="dense"))
    x = jax.random.normal(jax.random.key(1), (2, 8, 64))

    @nnx.jit
    def grad(moe, key):
      loss = lambda moe: jnp.sum(moe(x, rngs=key)[0] ** 2)  # noqa: E731
      return nnx.grad(loss)(moe)["wi_0"].get_value()

    g1, g1_again = grad(moe, jax.random.key(3)), grad(moe, jax.random.key(3))
    g2 = grad(moe, jax.random.key(4))
    np.testing.assert_array_equal(g1, g1_again)
    self.assertGreater(float(jnp.abs(g1 - g2).max()), 0.0)


class ConstructionUnderTraceTest(absltest.TestCase):
  """Constructing inside a trace works and builds the same graph, or fails
  loudly; calls never change the graph."""

  def test_inside_jit_builds_the_eager_state(self):
    cfg = _config(quantization="fp8", path="dense")
    eager = _adapted_moe(cfg)
    traced = nnx.jit(lambda: _adapted_moe(cfg))()
    self.assertEqual(_signature(traced), _signature(eager))
    jax.tree.map(
        np.testing.assert_array_equal, nnx.state(traced), nnx.state(eager)
    )

  def test_inside_vmap_builds_a_stacked_layer(self):
    cfg = _config(quantization="fp8", path="sparse")
    layers = 3

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):
      x = jnp.zeros((1, 4, cfg.moe.emb_dim))
      return nnx_adapter.EagerToNNX(RoutedMoE(cfg.moe), x, rngs=rngs)

    moe = stacked(nnx.Rngs(0))
    state = nnx.state(moe, nnx_adapter.Fp8State)
    self.assertEqual(state["wi_0_dot"]["input_scale"].shape, (layers, 1))
    self.assertEqual(
        state["wo_dot"]["output_grad_amax_history"].shape, (layers, HISTORY)
    )
    wi_0 = moe.wi_0.get_value()
    self.assertEqual(wi_0.shape[0], layers)
    self.assertGreater(float(jnp.abs(wi_0[0] - wi_0[1]).max()), 0.0)

  def test_attaching_inside_scan_is_an_error(self):
    class Holder(nnx.Module):

      def __init__(self):
        self.inner = nnx_adapter.EagerToNNX(
            nn.Dense(3), jnp.ones(4), rngs=nnx.Rngs(0)
        )

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def body(holder, x):
      holder.extra = nnx_adapter.EagerToNNX(nn.Dense(3), x, rngs=nnx.Rngs(1))
      return holder, holder.extra(x)

    holder = Holder()
    with self.assertRaisesRegex(TypeError, "carry"):
      body(holder, jnp.ones((2, 4)))
    self.assertFalse(hasattr(holder, "extra"))

  def test_call_never_creates_or_reshapes_variables(self):
    dense = nnx_adapter.EagerToNNX(
        nn.Dense(3), jnp.ones((2, 4)), rngs=nnx.Rngs(0)
    )
    before = _signature(dense)
    with self.assertRaises(flax.errors.ScopeParamShapeError):
      dense(jnp.ones((2, 8)))
    self.assertEqual(_signature(dense), before)


class InterchangeTest(parameterized.TestCase):
  """Linen variables into the NNX decoder and back: the same loss, the same
  leaves. By default float scanned and fp8 (the state the conversion must
  carry) unrolled; the other layouts, int8 and nanoo_fp8 (no state of their
  own beyond fp8's) are slow."""

  @parameterized.parameters(("none", True), ("fp8", False))
  def test_same_loss_both_ways(self, mode, scan):
    self.check_same_loss_both_ways(mode, scan)

  @testing.slow
  @parameterized.parameters(
      ("none", False), ("fp8", True), ("int8", False), ("nanoo_fp8", False)
  )
  def test_same_loss_both_ways_slow(self, mode, scan):
    self.check_same_loss_both_ways(mode, scan)

  def check_same_loss_both_ways(self, mode, scan):
    cfg = _config("tiny_gemma4_26b", mode, "dense", scan_layers=scan)
    tokens = helpers.markov_tokens(cfg.vocab_size)
    linen = LinenDecoder(cfg)
    variables = unbox(linen.init(jax.random.key(0), tokens))
    if mode in FP8_MODES:  # fp8 state the loss depends on, not the init one
      leaves, treedef = jax.tree.flatten(variables[OVERWRITE_WITH_GRADIENT])
      keys = jax.random.split(jax.random.key(5), len(leaves))
      variables[OVERWRITE_WITH_GRADIENT] = jax.tree.unflatten(
          treedef,
          [
              jax.random.uniform(k, x.shape, x.dtype, 0.5, 2.0)
              for k, x in zip(keys, leaves, strict=True)
          ],
      )
    model = nnx_adapter.Decoder(cfg, rngs=nnx.Rngs(1))
    nnx_adapter.linen_to_nnx(variables, model)
    # Compiled: a whole decoder op by op compiles every op on its own.
    linen_loss_of = jax.jit(
        lambda v: training.decoder_loss(*linen.apply(v, tokens), tokens)[0]
    )
    linen_loss = linen_loss_of(variables)
    nnx_loss = nnx.jit(lambda m: nnx_adapter.decoder_loss(m, tokens, None)[0])(
        model
    )
    np.testing.assert_allclose(nnx_loss, linen_loss, rtol=1e-6)
    back = nnx_adapter.nnx_to_linen(model)
    self.assertEqual(jax.tree.structure(back), jax.tree.structure(variables))
    jax.tree.map(np.testing.assert_array_equal, back, variables)
    if mode in FP8_MODES and not scan:  # the fp8 state the loss depends on
      reset = dict(variables)
      reset[OVERWRITE_WITH_GRADIENT] = linen.init(jax.random.key(0), tokens)[
          OVERWRITE_WITH_GRADIENT
      ]
      reset_loss = linen_loss_of(reset)
      self.assertNotAlmostEqual(float(reset_loss), float(linen_loss), places=5)

  def test_variables_of_another_config(self):
    cfg = _config(num_layers=1)
    model = nnx_adapter.Decoder(cfg, rngs=nnx.Rngs(0))
    before = nnx_adapter.nnx_to_linen(model)
    other = LinenDecoder(cfg.replace(moe_mlp_dim=2 * cfg.moe.moe_mlp_dim))
    shapes = jax.eval_shape(
        other.init, jax.random.key(0), jnp.ones((1, 4), int)
    )
    variables = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    m, h = cfg.moe.emb_dim, cfg.moe.moe_mlp_dim
    e = cfg.moe.num_experts
    with self.assertRaisesRegex(
        ValueError,
        rf"another config.*params/layers/moe/wi_0: expected "
        rf"float32\[1, {e}, {m}, {h}\], got float32\[1, {e}, {m}, {2 * h}\]",
    ):
      nnx_adapter.linen_to_nnx(variables, model)
    # Nothing was loaded: the check runs before the first variable is set.
    jax.tree.map(
        np.testing.assert_array_equal, nnx_adapter.nnx_to_linen(model), before
    )

  def test_mismatch_is_an_error(self):
    cfg = _config(quantization="fp8")
    model = nnx_adapter.Decoder(cfg, rngs=nnx.Rngs(0))
    variables = nnx_adapter.nnx_to_linen(model)
    no_fp8 = {"params": variables["params"]}
    with self.assertRaisesRegex(ValueError, "missing.*input_scale"):
      nnx_adapter.linen_to_nnx(no_fp8, model)
    with self.assertRaisesRegex(ValueError, "unexpected.*extra"):
      nnx_adapter.linen_to_nnx(
          {**variables, "extra": {"x": jnp.ones(1)}}, model
      )
    bad = jax.tree.map(lambda x: x, variables)
    bad["params"]["final_norm"]["scale"] = jnp.ones(3)
    with self.assertRaisesRegex(ValueError, "final_norm/scale"):
      nnx_adapter.linen_to_nnx(bad, model)


class TrainingTest(absltest.TestCase):
  """tiny_mixtral (scanned, 2 microbatches a step) trained with fp8 in both
  front ends from the same weights on the same batches: the same loss at
  every step, the fp8 state moved everywhere, and a float32 Linen run as the
  reference for how fp8 trains."""

  STEPS = 20

  def _train_linen(self, cfg, variables, batches, grad_accum=2):
    """(losses, fp8 state after) of the Linen train step from `variables`."""
    state = training.TrainState(
        step=jnp.zeros((), jnp.int32),
        params=variables["params"],
        fp8_state=variables.get(OVERWRITE_WITH_GRADIENT, {}),
        opt_state=TX.init(variables["params"]),
    )
    step = jax.jit(training.make_train_step(LinenDecoder(cfg), TX, grad_accum))
    losses = []
    for i, tokens in enumerate(batches):
      state, metrics = step(state, tokens, jax.random.key(i))
      losses.append(float(metrics["cross_entropy"]))
    self.assertEqual(step._cache_size(), 1)
    return losses, state.fp8_state

  def _train_nnx(self, model, batches, grad_accum=2):
    """(losses, fp8 state after, Linen layout) of the NNX train step."""
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    traces = []

    @nnx.jit(static_argnames="grad_accum")
    def step(model, optimizer, tokens, rng, grad_accum):
      traces.append(None)
      return nnx_adapter.train_step(model, optimizer, tokens, rng, grad_accum)

    losses = []
    for i, tokens in enumerate(batches):
      metrics = step(model, optimizer, tokens, jax.random.key(i), grad_accum)
      losses.append(float(metrics["cross_entropy"]))
    self.assertLen(traces, 1)  # one trace for all steps under nnx.jit
    fp8 = nnx_adapter.nnx_to_linen(model).get(OVERWRITE_WITH_GRADIENT, {})
    return losses, fp8

  @heavy
  def test_fp8_trains_and_linen_matches_nnx(self):
    # Scaled embeddings (tiny_mixtral's are unscaled, as Mixtral's): the
    # residual stream starts at unit RMS, and 20 steps train it far.
    cfg = _config(quantization="fp8", scale_embeddings=True)
    data = MarkovData(cfg.vocab_size).batches(8, 16, seed=3)
    batches = [jnp.asarray(next(data)) for _ in range(self.STEPS)]
    model = nnx_adapter.Decoder(cfg, rngs=nnx.Rngs(0))
    variables = nnx_adapter.nnx_to_linen(model)
    losses, fp8_after = {}, {}
    losses["linen"], fp8_after["linen"] = self._train_linen(
        cfg, variables, batches
    )
    losses["nnx"], fp8_after["nnx"] = self._train_nnx(model, batches)
    # Same math, weights and batches: the same loss at every step. Both
    # steps skip non-finite steps in one form (`train_step`), so they round
    # alike; fp8 would amplify an ulp of the weights (test_nnx_fp8.py).
    np.testing.assert_allclose(losses["nnx"], losses["linen"], rtol=1e-6)
    # Every variable of every call site moved, in every layer of the stack.
    before = _fp8_sites(variables[OVERWRITE_WITH_GRADIENT])
    self.assertLen(before, 2 * len(SITES["sparse"]))
    for frontend, fp8 in fp8_after.items():
      for site, values in _fp8_sites(fp8).items():
        self.assertLen(values, 2 * len(FP8_VARIABLES))
        for var, value in values.items():
          self.assertFalse(
              np.array_equal(value, before[site][var]),
              f"{frontend} {site} {var}",
          )
    # fp8 trains like float32: from 6.7 nats it falls by more than 1.2 over
    # 20 steps and stays within 0.1 nats of the float run at every step
    # (measured: at most 0.04; old scales written back over new ones left
    # fp8 barely moving).
    float_losses, _ = self._train_linen(
        cfg.replace(quantization="none"),
        {"params": variables["params"]},
        batches,
    )
    fp8 = np.array(losses["linen"])
    self.assertLess(np.mean(fp8[-5:]), fp8[0] - 1.2)
    np.testing.assert_allclose(fp8, float_losses, atol=0.1, rtol=0)


class GradAccumTest(parameterized.TestCase):

  @parameterized.parameters("linen", "nnx")
  def test_microbatch_amax_is_the_maximum(self, frontend):
    """fp8 amax over microbatches of magnitude 1 and 100: the combined
    newest amax is their maximum, whichever microbatch comes first."""
    cfg = _config(quantization="fp8", path="dense")
    x = jax.random.normal(jax.random.key(0), (1, 8, cfg.moe.emb_dim))
    fp8_grads = jax.jit(self._fp8_grads(frontend, cfg), static_argnums=1)
    small = fp8_grads(x, 1)
    large = fp8_grads(100.0 * x, 1)
    newest = lambda t: t["wi_0_dot"]["input_amax_history"][0]  # noqa: E731
    np.testing.assert_allclose(newest(large), 100.0 * newest(small), rtol=1e-5)
    for batch in ((x, 100.0 * x), (100.0 * x, x)):
      combined = fp8_grads(jnp.concatenate(batch), 2)
      # Not the sum, not the last microbatch's: the element-wise maximum.
      jax.tree.map(
          np.testing.assert_array_equal,
          combined,
          jax.tree.map(jnp.maximum, small, large),
      )
      self.assertEqual(float(newest(combined)), float(newest(large)))

  def _fp8_grads(self, frontend, cfg):
    """(inputs [B, S, M], grad_accum) -> the layer's combined fp8 grads."""
    loss = lambda y: jnp.mean(y**2)  # noqa: E731
    rng = jax.random.key(1)
    if frontend == "nnx":
      moe = _adapted_moe(cfg, batch=1)

      def nnx_grads(x, grad_accum):
        (_, fp8), _ = nnx_adapter.accumulate_gradients(
            moe,
            lambda m, x, r: (loss(m(x, rngs=r)[0]), {}),
            x,
            rng,
            grad_accum,
        )
        return nnx.to_pure_dict(fp8)

      return nnx_grads
    module = RoutedMoE(cfg.moe)
    variables = module.init(rng, jnp.zeros((1, 8, cfg.moe.emb_dim)))

    def linen_grads(x, grad_accum):
      def grad_fn(x, rng):
        def f(params, fp8):
          y, _ = module.apply(
              {"params": params, OVERWRITE_WITH_GRADIENT: fp8},
              x,
              rngs={"params": rng},
          )
          return loss(y), {}

        return jax.grad(f, argnums=(0, 1), has_aux=True)(
            variables["params"], variables[OVERWRITE_WITH_GRADIENT]
        )

      (_, fp8), _ = accumulate_gradients(grad_fn, x, grad_accum, rng)
      return fp8

    return linen_grads


class FrontendRegistryTest(absltest.TestCase):
  """One registry of the training front ends, known without jax."""

  def test_names_and_loaders_agree(self):
    self.assertEqual(tuple(training.FRONTENDS), ("linen", "nnx"))
    with self.assertWarns(DeprecationWarning):
      self.assertEqual(nnx_adapter.FRONTENDS, ("linen", "nnx"))
    self.assertIs(nnx_adapter.frontend("nnx"), nnx_adapter.NNXFrontend)
    self.assertIs(nnx_adapter.frontend("linen"), training.LinenFrontend)
    with self.assertRaisesRegex(ValueError, r"'haiku'; allowed: \('linen'"):
      nnx_adapter.frontend("haiku")

  def test_sharded_training_of_each(self):
    cfg = load_model_config("tiny_mixtral", num_layers=1)
    mesh = sharding.make_mesh("data=1")
    for name in training.FRONTENDS:
      run = nnx_adapter.frontend(name).sharded(
          cfg, training.default_optimizer(), mesh, 2
      )
      self.assertEqual(run.grad_accum, 2, name)


if __name__ == "__main__":
  absltest.main()
