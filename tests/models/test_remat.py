"""Rematerialization (`ModelConfig.remat`): same numbers, less kept.

Every policy gives the loss and the gradients of no remat (float32, CPU:
within 1e-6 of each leaf's largest value), scanned and unrolled, in both
front ends, in every quantization mode (fp8 state moved once per step, AQT
int8's stochastic rounding drawing the same values in the recompute); each
policy saves exactly the tensors it names (read from the saved residuals
of the traced program, so a renamed tensor fails here, unlike
maxtext#4005); and a decoder of the user's own that wraps its block in
`nn.remat` / `nnx.remat` gets the gradients it gets without. Compiled
programs are shared per module (`functools.cache`); the products are slow.
"""

import collections
import functools
import json

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import flax.linen as nn
import jax
from jax._src.ad_checkpoint import saved_residuals
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax

from linen_moe import MATMUL_PATHS
from linen_moe import Decoder
from linen_moe import RoutedMoE
from linen_moe import frontend
from linen_moe import load_model_config
from linen_moe import load_moe_config
from linen_moe import models
from linen_moe import testing
from linen_moe import training
from linen_moe._src.config.model_config import REMAT_POLICIES
from linen_moe._src.layer import checkpoint_names as names
from linen_moe._src.models.remat import OFFLOADED_NAMES
from linen_moe._src.models.remat import SAVED_NAMES
from linen_moe._src.planning import targets as targets_lib
from linen_moe._src.testing import helpers
from linen_moe.quantization import MODES
from linen_moe.sharding import unbox
from linen_moe.variables import OVERWRITE_WITH_GRADIENT
from linen_moe.variables import rng_dict
import nnx_adapter

POLICIES = tuple(p for p in REMAT_POLICIES if p != "none")
CONFIGS = ("tiny_mixtral", "tiny_gemma4_26b", "tiny_deepseek_v3_mla")


def _tokens(cfg):
  return helpers.markov_tokens(cfg.vocab_size, 2, 16, 1)


@functools.cache
def _variables(cfg):
  return unbox(Decoder(cfg).init(jax.random.key(0), _tokens(cfg)))


@functools.cache
def _zero_variables(cfg):
  """Zeros in the shapes of `_variables(cfg)`, for the checks that only
  trace: no init program to compile and run."""
  shapes = jax.eval_shape(Decoder(cfg).init, jax.random.key(0), _tokens(cfg))
  return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), unbox(shapes))


def _loss_fn(cfg, variables_of=_variables):
  """loss(params) of the Linen decoder at `cfg`, at the variables of its
  config without remat (every policy has the same variables); traced only,
  `variables_of=_zero_variables` is enough."""
  tokens = _tokens(cfg)
  variables = variables_of(cfg.replace(remat="none"))

  def loss(p):
    logits, aux = Decoder(cfg).apply({**variables, "params": p}, tokens)
    return training.decoder_loss(logits, aux, tokens)[0]

  return loss, variables["params"]


@functools.cache
def _loss_and_grads(cfg):
  loss, params = _loss_fn(cfg)
  return jax.jit(jax.value_and_grad(loss))(params)


def _nnx_loss_and_grads(cfg):
  tokens = _tokens(cfg)
  model = nnx_adapter.Decoder(cfg, rngs=nnx.Rngs(0))
  nnx_adapter.linen_to_nnx(_variables(cfg.replace(remat="none")), model)

  def loss(m):
    logits, aux = m(tokens)
    return training.decoder_loss(logits, aux, tokens)[0]

  value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
  # The gradients are the nnx.Param's; the other variables (a routed bias)
  # complete the graph for the conversion.
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  return (
      value,
      nnx_adapter.nnx_to_linen(nnx.merge(graphdef, grads, rest))["params"],
  )


def assert_close_per_leaf(test, got, want, rtol=1e-6):
  """Each leaf of `got` within `rtol` of `want`'s largest magnitude."""
  test.assertEqual(jax.tree.structure(got), jax.tree.structure(want))
  for (path, got_leaf), want_leaf in zip(
      jax.tree_util.tree_leaves_with_path(got),
      jax.tree.leaves(want),
      strict=True,
  ):
    a, b = np.asarray(got_leaf), np.asarray(want_leaf)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    np.testing.assert_allclose(
        a, b, rtol=0, atol=rtol * scale, err_msg=jax.tree_util.keystr(path)
    )


class RematConfigTest(parameterized.TestCase):

  @parameterized.parameters("", "Full", "dots", 1, None)
  def test_bad_remat_names_value_and_allowed(self, value):
    with self.assertRaisesRegex(ValueError, r"remat=.*allowed.*'full'"):
      load_model_config("tiny_mixtral").replace(remat=value)

  def test_remat_is_a_run_field(self):
    from linen_moe import ModelConfig  # noqa: PLC0415

    self.assertIn("remat", ModelConfig.run_fields())
    self.assertEqual(load_model_config("tiny_mixtral").remat, "none")

  def test_decoding_blocks_are_never_wrapped(self):
    cfg = load_model_config("tiny_mixtral", remat="full")
    self.assertIs(
        models.remat_block(models.DecoderBlock, cfg, decode=True),
        models.DecoderBlock,
    )


class RematGradientsTest(parameterized.TestCase):

  def check(self, got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert_close_per_leaf(self, got[1], want[1])

  # Each policy once in the default run (the rest of the product is slow):
  # these two scanned, "offload" in the NNX decoder, "full" in the fp8
  # step (scanned) and "save_experts" in the int8 step (unrolled) below.
  @parameterized.parameters("save_experts", "save_attention_experts")
  def test_scanned_linen_equals_no_remat(self, remat):
    cfg = load_model_config("tiny_mixtral")
    self.check(_loss_and_grads(cfg.replace(remat=remat)), _loss_and_grads(cfg))

  def test_nnx_equals_linen_without_remat(self):
    cfg = load_model_config("tiny_mixtral")
    self.check(
        _nnx_loss_and_grads(cfg.replace(remat="offload")),
        _loss_and_grads(cfg),
    )

  @testing.slow
  @parameterized.product(
      config=CONFIGS, remat=POLICIES, scan=(True, False), nnx_=(False, True)
  )
  def test_product(self, config, remat, scan, nnx_):
    cfg = load_model_config(config, scan_layers=scan)
    got = cfg.replace(remat=remat)
    got = _nnx_loss_and_grads(got) if nnx_ else _loss_and_grads(got)
    self.check(got, _loss_and_grads(cfg))


def _residuals(cfg):
  """The saved residuals of the decoder's loss, not its arguments: a
  Counter of names (named ones), "host <shape>" (offloaded) and
  "<shape>" (the rest)."""
  loss, params = _loss_fn(cfg, _zero_variables)
  out = collections.Counter()
  for aval, where in saved_residuals(loss, params):
    if "from the argument" in where:
      continue
    if where.startswith("named '"):
      out[where.split("'")[1]] += 1
    elif aval.memory_space == jax.memory.Space.Host:
      out[f"host {aval.shape}"] += 1
    else:
      out[str(aval.shape)] += 1
  return out


class SavedTensorsTest(parameterized.TestCase):
  """Each policy saves exactly the tensors it names: a block's tensor that
  loses its name (or a policy naming one no block tags) fails here.

  Unrolled tiny Mixtral with a post-MLP norm, so that the backward pass
  reads every named tensor (the MLP output feeds a norm); tracing only.
  """

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.cfg = load_model_config(
        "tiny_mixtral", scan_layers=False, post_mlp_norm=True
    )
    cls.full = _residuals(cls.cfg.replace(remat="full"))

  def test_full_saves_no_named_tensor(self):
    self.assertFalse(set(self.full) & set(models.CHECKPOINT_NAMES))
    none = _residuals(self.cfg)
    self.assertLess(self.full.total(), none.total() // 2)

  @parameterized.parameters("save_experts", "save_attention_experts")
  def test_save_policies_save_their_names_and_nothing_else(self, remat):
    got = _residuals(self.cfg.replace(remat=remat))
    layers = self.cfg.num_layers
    want = {name: layers for name in SAVED_NAMES[remat]}
    self.assertEqual(
        {k: v for k, v in got.items() if k in models.CHECKPOINT_NAMES}, want
    )
    self.assertEqual(
        {k: v for k, v in got.items() if k not in models.CHECKPOINT_NAMES},
        self.full,
    )

  def test_offload_moves_every_layer_input_to_host(self):
    got = _residuals(self.cfg.replace(remat="offload"))
    self.assertEqual(OFFLOADED_NAMES["offload"], (names.LAYER_INPUT,))
    shape = (2, 16, self.cfg.moe.emb_dim)
    self.assertEqual(got[f"host {shape}"], self.cfg.num_layers)
    want = self.full.copy()
    want[str(shape)] -= self.cfg.num_layers  # now on the host
    self.assertEqual({k: v for k, v in got.items() if "host" not in k}, want)

  @parameterized.parameters("tiny_mixtral", "tiny_deepseek_v3_mla")
  def test_every_name_is_tagged(self, config):
    """Each name of `checkpoint_models.CHECKPOINT_NAMES` is on a tensor of the traced
    decoder (MLA's query, key and value too)."""
    cfg = load_model_config(config, scan_layers=False)
    loss, params = _loss_fn(cfg, _zero_variables)
    found = {
        eqn.params["name"]
        for eqn in helpers.jaxpr_equations(jax.make_jaxpr(loss)(params))
        if eqn.primitive.name == "name"
    }
    self.assertEqual(found, set(models.CHECKPOINT_NAMES))


class GroupedStackTest(parameterized.TestCase):
  """A scanned stack of groups (GPT-OSS's sliding / full pairs, Llama-4's
  periods of four) rematerializes each member, as a stack of one kind
  rematerializes each layer: the backward holds one member's activations
  and gathered weights at a time, not the whole period's."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.cfg = load_model_config(
        "tiny_gpt_oss",
        num_layers=4,
        full_attention_layers=(1, 3),
        scan_layers=True,
        remat="full",
    )

  def test_full_keeps_every_members_input(self):
    plan = self.cfg.stack_plan
    self.assertEqual((plan.period, plan.repeats), (2, 2))
    got = _residuals(self.cfg)
    # [R, B, S, M]: one stacked input per member, none for the group.
    self.assertEqual(got[str((2, 2, 16, self.cfg.moe.emb_dim))], plan.period)

  # Slow: two compiles of a four-layer stack. By default the member-wise
  # remat is `test_full_keeps_every_members_input`, and a remat stack's
  # loss and gradients equal no remat's in `RematGradientsTest`.
  @testing.slow
  def test_equals_no_remat(self):
    want = _loss_and_grads(self.cfg.replace(remat="none"))
    np.testing.assert_allclose(_loss_and_grads(self.cfg)[0], want[0], 1e-6)
    assert_close_per_leaf(self, _loss_and_grads(self.cfg)[1], want[1])


@functools.cache
def _train_step(cfg, grad_accum):
  optimizer = optax.sgd(0.1)
  state = training.train_state_from_variables(
      _variables(cfg.replace(remat="none")), optimizer
  )
  step = training.make_train_step(Decoder(cfg), optimizer, grad_accum)
  return state, jax.jit(step)


def _train_step_result(cfg, rng, grad_accum=1):
  """(state before, state after) one train step of `cfg` (4 x 16 tokens)."""
  state, step = _train_step(cfg, grad_accum)
  tokens = helpers.markov_tokens(cfg.vocab_size, 4, 16, 1)
  return state, step(state, tokens, rng)[0]


class RematQuantizationTest(parameterized.TestCase):

  def test_fp8_state_moves_once_per_step(self):
    """fp8, scanned, two microbatches: params and the fp8 scales and amax
    histories after one step equal no remat's (moved once: a second move
    would roll the histories again)."""
    cfg = load_model_config("tiny_mixtral", quantization="fp8")
    rng = jax.random.key(3)
    before, want = _train_step_result(cfg, rng, grad_accum=2)
    _, got = _train_step_result(cfg.replace(remat="full"), rng, grad_accum=2)
    self.assertGreater(
        helpers.max_abs_diff(want.fp8_state, before.fp8_state), 0.0
    )
    assert_close_per_leaf(self, got.fp8_state, want.fp8_state)
    assert_close_per_leaf(self, got.params, want.params)

  def test_int8_recompute_draws_the_same_rounding(self):
    """AQT int8 (its einsums round stochastically), unrolled: the
    recompute's rounding replays the forward's keys, so the step equals no
    remat's, while another key moves the params by far more than the
    tolerance."""
    cfg = load_model_config(
        "tiny_mixtral",
        quantization="int8",
        scan_layers=False,
        **MATMUL_PATHS["dense"],
    )
    rng = jax.random.key(3)
    _, want = _train_step_result(cfg, rng)
    _, got = _train_step_result(cfg.replace(remat="save_experts"), rng)
    assert_close_per_leaf(self, got.params, want.params)
    _, other = _train_step_result(cfg, jax.random.key(4))
    self.assertGreater(
        helpers.max_abs_diff(other.params, want.params),
        1e3 * helpers.max_abs_diff(got.params, want.params) + 1e-7,
    )


@absltest.skipUnless(
    targets_lib.libtpu_available(),
    "needs libtpu to compile for a TPU: pip install '.[tpu-plan]'",
)
class OffloadOnTpuTest(parameterized.TestCase):
  """Planned for a TPU chip (`linen-moe plan`, libtpu's topology, no TPU),
  the train step of "offload" keeps each layer's input in host memory:
  the compiled program's host bytes are the layers' inputs to the byte;
  "full" keeps none there. (The device's own growth per layer is
  measured at the Qwen3-30B-A3B layer shape by `bench_remat.py memory
  --target`.) Skipped without libtpu."""

  @parameterized.product(remat=("full", "offload"), layers=(2, 4))
  def test_layer_inputs_are_in_host_memory(self, remat, layers):
    from tests import workers  # noqa: PLC0415

    emb, seq = 128, 128  # a layer's input: [1, seq, emb] float32
    proc = workers.run(
        "linen_moe_cli.main",
        *("plan", "--config", "tiny_mixtral", "--target", "tpu:v6e-1"),
        *("--set", f"emb_dim={emb}", "--set", f"num_layers={layers}"),
        *("--set", "scan_unroll=1", "--remat", remat, "--json"),
        *("--batch-size", "1", "--seq-len", str(seq)),
    )
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    want = layers * seq * emb * 4 if remat == "offload" else 0
    self.assertEqual(plan["per_device"]["host_bytes"], want)


class RematOnMeshTest(absltest.TestCase):

  @testing.slow
  def test_mesh_and_microbatches_equal_one_device(self):
    """fp8, sparse (expert parallel), "save_experts", 2 layers, on
    data=2,expert=4 and fsdp=8: loss, params and fp8 state as one device's
    step (whose remat equals no remat, above; microbatches are the fp8
    step's test)."""
    from tests import workers  # noqa: PLC0415

    (result,) = workers.sharding_jobs({
        "check": "equivalence",
        "path": "sparse",
        "quantization": "fp8",
        "num_layers": 2,
        "remat": "save_experts",
        "meshes": ["data=2,expert=4", "fsdp=8"],
    })
    self.assertGreater(result["update"], 0.0)
    self.assertGreater(result["fp8_moved"], 0.0)
    for spec, r in result["meshes"].items():
      with self.subTest(mesh=spec):
        self.assertAlmostEqual(
            r["loss"], result["loss"], delta=1e-5 * abs(result["loss"])
        )
        self.assertLessEqual(r["param_err"], 1e-4 * result["update"])
        self.assertLessEqual(r["fp8_err"], 1e-5 * result["fp8_moved"])


# A decoder of the user's own around `RoutedMoE`, its block under the user's
# remat: "remat" (nothing saved), "policy" (the experts' named tensors
# saved) or "none".
_USER_POLICY = jax.checkpoint_policies.save_only_these_names(
    names.EXPERT_GATE, names.EXPERT_UP, names.EXPERT_DOWN
)


class _UserBlock(nn.Module):
  config: object

  @nn.compact
  def __call__(self, x):
    y, aux = RoutedMoE(self.config, name="moe")(nn.RMSNorm()(x))
    return x + y, aux.load_balance_loss


def _user_block(wrap):
  if wrap == "none":
    return _UserBlock
  policy = _USER_POLICY if wrap == "policy" else None
  return nn.remat(_UserBlock, policy=policy, prevent_cse=wrap == "remat")


class _UserDecoder(nn.Module):
  config: object
  wrap: str = "none"
  scan: bool = True

  @nn.compact
  def __call__(self, x):
    block = _user_block(self.wrap)
    if self.scan:
      x, lb = models.scan_blocks(block, length=2)(self.config, name="layers")(x)
      return x, jnp.sum(lb)
    lb = 0.0
    for i in range(2):
      x, aux = block(self.config, name=f"layers_{i}")(x)
      lb = lb + aux
    return x, lb


def _user_grads(mode, path, wrap, scan):
  cfg = load_moe_config("tiny_mixtral", quantization=mode, **MATMUL_PATHS[path])
  model = _UserDecoder(cfg, wrap, scan)
  x = jax.random.normal(jax.random.key(0), (2, 8, cfg.emb_dim))
  variables = unbox(_UserDecoder(cfg, "none", scan).init(jax.random.key(1), x))
  params = variables["params"]
  fp8 = variables.get(OVERWRITE_WITH_GRADIENT, {})

  def loss(params, fp8):
    v = {"params": params}
    if fp8:
      v[OVERWRITE_WITH_GRADIENT] = fp8
    y, lb = model.apply(v, x, rngs=rng_dict(jax.random.key(2)))
    return jnp.mean(y**2) + lb

  return jax.jit(jax.value_and_grad(loss, (0, 1)))(params, fp8)


class _NNXUserDecoder(nnx.Module):

  def __init__(self, cfg, sample, remat, rngs):
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=models_layers())
    def make(rngs):
      return nnx_adapter.EagerToNNX(RoutedMoE(cfg), sample, rngs=rngs)

    self.moe = make(rngs)
    self.remat = remat

  def __call__(self, x, rng):
    def layer(moe, x, key):
      y, aux = moe(x, rngs=key)
      return x + y, aux.load_balance_loss

    if self.remat:
      layer = nnx.remat(layer)

    @nnx.scan(
        in_axes=(0, nnx.Carry, 0),
        out_axes=(nnx.Carry, 0),
        transform_metadata=models_layers(),
    )
    def layers(moe, x, key):
      return layer(moe, x, key)

    x, lb = layers(self.moe, x, jax.random.split(rng, 2))
    return x, jnp.sum(lb)


def models_layers():
  return {nnx.PARTITION_NAME: frontend.LAYERS_AXIS}


def _nnx_user_grads(mode, path, remat):
  cfg = load_moe_config("tiny_mixtral", quantization=mode, **MATMUL_PATHS[path])
  x = jax.random.normal(jax.random.key(0), (2, 8, cfg.emb_dim))
  model = _NNXUserDecoder(cfg, x, remat, nnx.Rngs(1))

  def loss(model):
    y, lb = model(x, jax.random.key(2))
    return jnp.mean(y**2) + lb

  value, grads = nnx.jit(
      nnx.value_and_grad(
          loss,
          argnums=nnx.DiffState(0, nnx.Any(nnx.Param, nnx_adapter.Fp8State)),
      )
  )(model)
  return value, nnx.to_pure_dict(grads)


# The default run: fp8, sparse, a policy, scanned (Linen) and nanoo_fp8,
# dense_dropping (NNX); the decoder's tests above have int8 on the dense
# path under remat and no quantization. The products are slow.


class UserRematTest(parameterized.TestCase):
  """The layer under the user's own `nn.remat` / `nnx.remat`."""

  def check(self, got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert_close_per_leaf(self, got[1], want[1])

  @testing.slow  # nn.remat around a block: RematGradientsTest by default
  def test_linen_user_remat_equals_no_remat(self):
    self.check(
        _user_grads("fp8", "sparse", "policy", True),
        _user_grads("fp8", "sparse", "none", True),
    )

  def test_nnx_user_remat_equals_no_remat(self):
    mode, path = "nanoo_fp8", "dense_dropping"
    self.check(
        _nnx_user_grads(mode, path, True), _nnx_user_grads(mode, path, False)
    )

  @testing.slow
  @parameterized.product(
      mode=tuple(MODES),
      path=tuple(MATMUL_PATHS),
      wrap=("remat", "policy"),
      scan=(True, False),
  )
  def test_linen_product(self, mode, path, wrap, scan):
    self.check(
        _user_grads(mode, path, wrap, scan),
        _user_grads(mode, path, "none", scan),
    )

  @testing.slow
  @parameterized.product(mode=tuple(MODES), path=tuple(MATMUL_PATHS))
  def test_nnx_product(self, mode, path):
    self.check(
        _nnx_user_grads(mode, path, True), _nnx_user_grads(mode, path, False)
    )


if __name__ == "__main__":
  absltest.main()
