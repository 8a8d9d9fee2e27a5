"""LoRA and QLoRA (`linen_moe.lora`): B = 0 changes no logit, merging gives
the adapted logits, the gradients of A and B are the formula's, dropout is
the formula's in training and absent in evaluation, counts come from
shapes, the QLoRA step (int8, fp8, nanoo_fp8 bases) differentiates no
frozen kernel, expert parallelism gives one device's output and gradients,
bad input.

The per-family fixture cases share one loaded checkpoint and one compiled
forward each; the default run holds one case per axis value (family, path,
front end, layer layout), the full product is `slow`.
"""

import contextlib
import functools
import itertools
import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax

from linen_moe import MATMUL_PATHS
from linen_moe import Decoder
from linen_moe import MoEConfig
from linen_moe import RoutedAndSharedMoE
from linen_moe import RoutedMoE
from linen_moe import SharedExpert
from linen_moe import frontend
from linen_moe import hlo
from linen_moe import load_model_config
from linen_moe import lora
from linen_moe import quantization
from linen_moe import training
from linen_moe import variables as variables_lib
from linen_moe._src.config import lora as lora_config
from linen_moe._src.lora import adapters as lora_adapters
from linen_moe._src.lora import tree
from linen_moe._src.testing.marks import heavy
from linen_moe.sharding import unbox
from linen_moe.testing import slow
import nnx_adapter
from tests import hf_helpers
from tests import numpy_reference
from tests import workers

FAMILIES = {
    "qwen3": "qwen3_moe_dense0_norm",
    "mixtral": "mixtral_gqa_swa",
    "deepseek": "deepseek_v3_plain_nogroup",
    "gemma4": "gemma4_text_moe_untied",
    "gpt_oss": "gpt_oss_sinks_swa_yarn",
    "glm4_moe": "glm4_moe_partial_qknorm_groups",
    "minimax_m2": "minimax_m2_partial_qknorm",
    "llama4": "llama4_text_nope_chunked",
}
# (family, path, front end, scanned): the default run's one case (about 7 s
# of compiling on CI's machine); the product of every axis is `slow`.
DEFAULT_CASES = (("qwen3", "sparse", "linen", True),)
ALL_CASES = tuple(
    itertools.product(FAMILIES, MATMUL_PATHS, ("linen", "nnx"), (True, False))
)
SLOW_CASES = tuple(c for c in ALL_CASES if c not in DEFAULT_CASES)
RANK = 2


@functools.cache
def _adapted(family: str, path: str, scan: bool):
  """(base config, base variables, LoRA config, variables with adapters)."""
  config, variables = hf_helpers.load(FAMILIES[family], scan, path)
  cfg = config.replace(lora_rank=RANK, lora_alpha=4)
  return config, variables, cfg, lora.init_adapters(cfg, variables, _key(1))


def _key(i: int) -> jax.Array:
  return jax.random.key(i)


def _ids(family: str) -> np.ndarray:
  return hf_helpers.fixture(FAMILIES[family])[0]


def _perturbed(variables, scale: float = 0.5):
  """The variables with every adapter leaf (B included) random."""
  adapters, frozen = lora.split(variables["params"])
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(_key(7), len(leaves))
  leaves = [
      scale * jax.random.normal(k, x.shape, x.dtype)
      for k, x in zip(keys, leaves, strict=True)
  ]
  adapters = jax.tree.unflatten(tree, leaves)
  return {**variables, "params": lora.join(adapters, frozen)}


class ZeroBTest(parameterized.TestCase):
  """B = 0: the adapted decoder's logits are the base's, bit for bit."""

  def _check(self, family, path, frontend, scan):
    config, variables, cfg, adapted = _adapted(family, path, scan)
    ids = _ids(family)
    if frontend == "linen":  # compiled once per config, shared
      base = np.asarray(_forward(config)(variables, ids))
      got = np.asarray(_forward(cfg)(adapted, ids))
    else:
      base = hf_helpers.logits(config, variables, frontend, ids)
      got = hf_helpers.logits(cfg, adapted, frontend, ids)
    np.testing.assert_array_equal(got, base)

  @parameterized.parameters(*DEFAULT_CASES)
  def test_zero_b_is_the_base(self, family, path, frontend, scan):
    self._check(family, path, frontend, scan)

  @slow
  @parameterized.parameters(*SLOW_CASES)
  def test_zero_b_is_the_base_everywhere(self, family, path, frontend, scan):
    self._check(family, path, frontend, scan)


LORA_FIXTURE = hf_helpers.FIXTURES.parent / "lora" / FAMILIES["qwen3"]


@functools.cache
def _forward(config):
  """One compiled forward per config (the base's serves the merged model:
  merging gives back the base's config)."""
  return jax.jit(lambda v, t: Decoder(config).apply(v, t)[0])


class MergeTest(parameterized.TestCase):
  """merge(config, variables) then the plain decoder == the adapted one."""

  def _check(self, family, path, scan, adapted_variables=None):
    config, variables, cfg, adapted = _adapted(family, path, scan)
    if adapted_variables is None:
      # Every A and B ~ N(0, 0.05^2) (a trained adapter's are smaller still):
      # the logits move by 0.39 to 1.3, merged and adapted differ by 2.9e-6
      # at most (the slow product). At 0.5 the adapters swamp the kernels
      # and float32 rounding in the grown activations alone reaches 5.6e-5
      # (mixtral, dense); at 0.1, 5e-6.
      adapted = _perturbed(adapted, 0.05)
    else:
      cfg, adapted = adapted_variables
    ids = _ids(family)
    want = np.asarray(_forward(cfg)(adapted, ids))
    plain_cfg, plain = lora.merge(cfg, adapted)
    self.assertEqual(plain_cfg, config)
    self.assertFalse(tree.has_adapters(plain["params"]))
    got = np.asarray(_forward(plain_cfg)(plain, ids))
    base = np.asarray(_forward(config)(variables, ids))
    self.assertGreater(np.abs(want - base).max(), 1e-2)  # adapters matter
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    return want

  def test_merge_equals_adapted_and_transformers(self):
    """The committed adapters (scripts/make_lora_fixture.py) on the Qwen3
    fixture: merged == adapted to 1e-5, and the adapted logits are those
    transformers computes from our merged export, to 1e-4."""
    config, variables = hf_helpers.load(FAMILIES["qwen3"], True)
    adapted = lora.load_adapters(config, variables, LORA_FIXTURE)
    self.assertEqual(adapted[0].moe.lora, lora_config.LoRAConfig(4, 8.0))
    want = self._check("qwen3", "sparse", True, adapted)
    theirs = np.load(LORA_FIXTURE / "transformers_logits.npy")
    np.testing.assert_allclose(want, theirs, atol=hf_helpers.ATOL, rtol=0)

  @slow
  @parameterized.parameters(
      *itertools.product(FAMILIES, MATMUL_PATHS, (True, False))
  )
  def test_merge_equals_adapted_everywhere(self, family, path, scan):
    self._check(family, path, scan)


def _layer_config(path: str, **changes) -> MoEConfig:
  return MoEConfig(
      num_experts=4,
      num_experts_per_tok=2,
      emb_dim=8,
      moe_mlp_dim=6,
      lora_rank=3,
      lora_alpha=6,
      load_balance_loss_weight=0.0,
      **MATMUL_PATHS[path],
      **changes,
  )


def _reference_loss(params, adapters, x, cotangent, cfg):
  """sum(cotangent * y), y the routed layer from the formula, per token:
  y_t = sum_j w_tj (act(x_t W0') * (x_t W1')) W2', W' = W + (alpha / r) A B
  applied as x W + s (x A) B; the routing from the NumPy oracle (the
  adapters do not touch it)."""
  s = cfg.lora.scale
  gate = np.asarray(params["gate"]["kernel"], np.float64)
  total = 0.0
  for t in range(x.shape[0]):
    ids, weights = numpy_reference.route_token(
        np.asarray(x[t], np.float64) @ gate, cfg, None
    )
    y = jnp.zeros(x.shape[-1])
    for e, w in zip(ids, weights, strict=True):

      def proj(name, v, e=e):
        a, b = adapters[name + "_lora_a"][e], adapters[name + "_lora_b"][e]
        return v @ params[name][e] + s * ((v @ a) @ b)

      h = jax.nn.silu(proj("wi_0", x[t])) * proj("wi_1", x[t])
      y = y + np.float32(w) * proj("wo", h)
    total = total + jnp.sum(cotangent[t] * y)
  return total


class GradientTest(parameterized.TestCase):
  """dA, dB of the routed layer against the per-token formula."""

  @parameterized.parameters("sparse", "dense")
  def test_adapter_gradients(self, path):
    cfg = _layer_config(path)
    x = jax.random.normal(_key(0), (2, 5, 8), jnp.float32)
    layer = RoutedMoE(cfg)
    params = unbox(_perturbed(unbox(layer.init(_key(1), x)), 0.3))["params"]
    adapters, frozen = lora.split(params)
    cotangent = jax.random.normal(_key(2), (10, 8), jnp.float32)

    def loss(adapters):
      y, _ = layer.apply({"params": lora.join(adapters, frozen)}, x)
      return jnp.sum(cotangent * y.reshape(10, 8))

    got = jax.jit(jax.grad(loss))(adapters)
    # Jitted: one program, not one per op of the per-token loop (the
    # routing is the NumPy oracle's, read from the concrete input).
    tokens = np.asarray(x).reshape(10, 8)
    want = jax.jit(
        jax.grad(lambda a: _reference_loss(frozen, a, tokens, cotangent, cfg))
    )(adapters)
    self.assertLen(jax.tree.leaves(got), 6)
    for (path_, g), w in zip(
        traverse_util.flatten_dict(got).items(),
        jax.tree.leaves(want),
        strict=True,
    ):
      self.assertGreater(np.abs(w).max(), 1e-3, path_)
      np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=path_)


P_DROP = 0.25


@contextlib.contextmanager
def _recorded_adapter_inputs():
  """Records each (input, what the adapter branch got) pair of
  `_adapter_input`, in call order, unchanged (run eagerly: no scan; by a
  callback, since the sparse path's gate and up projections are traced
  inside an `nn.checkpoint` even then)."""
  original = lora_adapters._adapter_input  # noqa: SLF001
  pairs = []

  def record(x, out):
    pairs.append((np.asarray(x), np.asarray(out)))

  def recording(module, x, rate):
    out = original(module, x, rate)
    jax.debug.callback(record, x, out)
    return out

  with mock.patch.object(lora_adapters, "_adapter_input", recording):
    yield pairs


def _silu(v):
  return v / (1.0 + np.exp(-v))


def _dropped(v, mask):
  """Inverted dropout from the formula: kept entries scaled 1 / (1 - p)."""
  return np.where(mask, v / np.float32(1.0 - P_DROP), 0).astype(np.float32)


class DropoutTest(parameterized.TestCase):
  """lora_dropout p: with a "params" RNG (a train step's) the adapter
  branch gets its input with each entry dropped with probability p and the
  kept ones scaled 1 / (1 - p), the base branch the input unchanged:
  x W + s (D(x) A) B; without one (evaluation) no dropout. The output
  against a NumPy reference of that formula with the masks the layer drew
  (each a per-entry Bernoulli: its dropped fraction within 4 sigma of p)."""

  def _layer(self, kind, rate=P_DROP):
    """(config, layer): "shared" a shared expert, else the routed layer on
    that matmul path."""
    if kind == "shared":
      cfg = _layer_config("dense", shared_experts=1, shared_mlp_dim=6)
      cfg = cfg.replace(lora_dropout=rate)
      return cfg, SharedExpert(cfg)
    cfg = _layer_config(kind, lora_dropout=rate)
    return cfg, RoutedMoE(cfg)

  def _variables(self, kind, x, zero_b=False):
    _, layer = self._layer(kind)
    variables = unbox(_perturbed(unbox(layer.init(_key(1), x)), 0.3))
    if zero_b:
      variables = jax.tree_util.tree_map_with_path(
          lambda p, v: jnp.zeros_like(v)
          if p[-1].key.endswith("_lora_b")
          else v,
          variables,
      )
    return variables

  def _apply(self, kind, variables, x, rng=None, rate=P_DROP):
    _, layer = self._layer(kind, rate)
    rngs = None if rng is None else {"params": rng}
    y = layer.apply(variables, x, rngs=rngs)
    return np.asarray(y[0] if isinstance(y, tuple) else y)

  def _check_masks(self, pairs):
    """Every recorded adapter input is the input with entries zeroed and
    the rest scaled 1 / (1 - p); returns the masks."""
    masks = []
    for x, got in pairs:
      mask = got != 0
      # To one rounding: XLA may divide by 1 - p as a product by 1/(1 - p).
      np.testing.assert_allclose(got, _dropped(x, mask), rtol=3e-7, atol=0)
      sigma = np.sqrt(P_DROP * (1 - P_DROP) / mask.size)
      self.assertLess(abs(1 - mask.mean() - P_DROP), 4 * sigma)
      masks.append(mask)
    return masks

  def test_shared_expert_against_the_formula(self):
    cfg, _ = self._layer("shared")
    x = jax.random.normal(_key(0), (2, 40, 8), jnp.float32)
    variables = self._variables("shared", x)
    with _recorded_adapter_inputs() as pairs:
      got = self._apply("shared", variables, x, _key(5))
    self.assertLen(pairs, 3)  # wi_0, wi_1, wo
    m0, m1, m2 = self._check_masks(pairs)
    p = {k: np.asarray(v) for k, v in variables["params"].items()}
    s = cfg.lora.scale
    xn = np.asarray(x)

    def proj(name, v, mask):
      a, b = p[name + "_lora_a"], p[name + "_lora_b"]
      return v @ p[name] + s * ((_dropped(v, mask) @ a) @ b)

    h = _silu(proj("wi_0", xn, m0)) * proj("wi_1", xn, m1)
    want = proj("wo", h, m2)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

  def test_routed_dense_against_the_formula(self):
    """Dense path: the gate and up projections drop each token's input
    [B, S, M] (one mask per token for every expert), the down projection
    each expert's hidden [B, S, E, H]."""
    cfg, _ = self._layer("dense")
    x = jax.random.normal(_key(0), (2, 20, 8), jnp.float32)
    variables = self._variables("dense", x)
    with _recorded_adapter_inputs() as pairs:
      got = self._apply("dense", variables, x, _key(5))
    self.assertLen(pairs, 3)
    m0, m1, m2 = self._check_masks(pairs)
    p = {
        k: np.asarray(v)
        for k, v in traverse_util.flatten_dict(variables["params"]).items()
    }
    s = cfg.lora.scale
    xt = np.asarray(x).reshape(-1, 8)
    m0, m1 = m0.reshape(-1, 8), m1.reshape(-1, 8)
    m2 = m2.reshape(xt.shape[0], cfg.num_experts, -1)
    want = np.zeros_like(xt)
    for t in range(xt.shape[0]):
      ids, weights = numpy_reference.route_token(
          xt[t].astype(np.float64) @ p[("gate", "kernel")], cfg, None
      )
      for e, w in zip(ids, weights, strict=True):

        def proj(name, v, mask, e=e):
          a, b = p[(name + "_lora_a",)][e], p[(name + "_lora_b",)][e]
          return v @ p[(name,)][e] + s * ((_dropped(v, mask) @ a) @ b)

        h = _silu(proj("wi_0", xt[t], m0[t])) * proj("wi_1", xt[t], m1[t])
        want[t] += np.float32(w) * proj("wo", h, m2[t, e])
    np.testing.assert_allclose(got.reshape(-1, 8), want, atol=1e-5, rtol=1e-5)

  @slow
  def test_decoder_drops_with_the_train_steps_rngs(self):
    """A decoder given `rng_dict` (what the train step passes) drops in
    every layer, given no RNG (the eval step) it does not. Unrolled, two
    layers: the recorded adapter inputs are the formula's and no two masks
    are the same (each layer and kernel draws its own). Scanned and
    unrolled: with the RNG the logits move; without, they are rate 0's bit
    for bit. Slow: eager, about 12 s; the layers' tests above are the
    default run's."""
    cfg = load_model_config("tiny_qwen3_moe").replace(
        lora_rank=2, lora_dropout=P_DROP, num_layers=2
    )
    tokens = jax.random.randint(_key(3), (2, 8), 0, cfg.vocab_size)
    rngs = variables_lib.rng_dict(_key(5))
    for scan in (False, True):
      config = cfg.replace(scan_layers=scan)
      variables = _perturbed(unbox(Decoder(config).init(_key(0), tokens)), 0.1)

      def logits(config, rngs=None, variables=variables):
        out = Decoder(config).apply(variables, tokens, rngs=rngs)
        return np.asarray(out[0])

      if scan:
        dropped = logits(config, rngs)
      else:
        with _recorded_adapter_inputs() as pairs:
          dropped = logits(config, rngs)
        # Per layer: query, key, value, out; the experts' wi_0, wi_1, wo.
        self.assertLen(pairs, 2 * 7)
        masks = self._check_masks(pairs)
        for i, j in itertools.combinations(range(len(masks)), 2):
          if masks[i].shape == masks[j].shape:
            self.assertFalse(np.array_equal(masks[i], masks[j]), (i, j))
      plain = logits(config.replace(lora_dropout=0.0))
      self.assertGreater(np.abs(dropped - plain).max(), 1e-3, scan)
      np.testing.assert_array_equal(logits(config), plain)

  @parameterized.parameters("shared", "dense", "sparse")
  def test_when_dropout_applies(self, kind):
    """With an RNG: the same key gives the same bits, another key others,
    and B = 0 gives the base's output bit for bit (dropout touches the
    adapter branch alone). Without one, or at rate 0, no dropout: the
    output is rate 0's bit for bit. The sparse path's adapter inputs (its
    sorted rows, one mask per routed assignment) are dropped and scaled
    as the formula says."""
    x = jax.random.normal(_key(0), (2, 20, 8), jnp.float32)
    variables = self._variables(kind, x)
    apply = functools.partial(self._apply, kind, variables, x)
    with _recorded_adapter_inputs() as pairs:
      dropped = apply(_key(5))
    self._check_masks(pairs)
    np.testing.assert_array_equal(apply(_key(5)), dropped)
    self.assertGreater(np.abs(apply(_key(6)) - dropped).max(), 1e-3)
    plain = apply(rate=0.0)
    self.assertGreater(np.abs(dropped - plain).max(), 1e-3)
    np.testing.assert_array_equal(apply(), plain)
    np.testing.assert_array_equal(apply(_key(5), rate=0.0), plain)
    zero_b = self._variables(kind, x, zero_b=True)
    base = self._apply(kind, zero_b, x, rate=0.0)
    np.testing.assert_array_equal(self._apply(kind, zero_b, x, _key(5)), base)


def _dequantized(node):
  """A serving `params` tree with its int8 kernels dequantized (values
  times their per-channel scales) and the scales dropped."""
  out = {}
  for name, value in node.items():
    if isinstance(value, dict):
      out[name] = _dequantized(value)
    elif value.dtype == jnp.int8:
      out[name] = value.astype(jnp.float32) * node[name + "_scale"]
    elif not name.endswith("_scale"):
      out[name] = value
  return out


class QLoRAGradientTest(parameterized.TestCase):
  """Through a frozen int8 serving base, the adapters' gradients are those
  of the float base it stores (the dequantized kernels), up to the int8
  forward's rounding: QLoRA's rule, the input's gradient from the
  dequantized kernel (int8's own backward would lose it)."""

  def test_gradients_through_int8_base(self):
    self._check("sparse")

  @slow
  def test_gradients_through_int8_base_dense(self):
    self._check("dense")

  def _check(self, path):
    cfg = _layer_config(
        path, shared_experts=1, shared_mlp_dim=6, quantization="int8"
    ).replace(lora_rank=0)
    x = jax.random.normal(_key(0), (2, 6, 8), jnp.float32)
    layer = RoutedAndSharedMoE(cfg)
    serve_cfg, serve = quantization.quantize_weights(
        cfg, unbox(layer.init(_key(1), x))
    )
    qlora_cfg = serve_cfg.replace(lora_rank=3, lora_alpha=6)
    fresh = unbox(RoutedAndSharedMoE(qlora_cfg).init(_key(2), x))
    adapters = lora.split(_perturbed(fresh, 0.3)["params"])[0]
    frozen = lora.split(serve["params"])[1]
    float_cfg = cfg.replace(quantization="none", lora_rank=3, lora_alpha=6)
    cotangent = jax.random.normal(_key(3), x.shape, jnp.float32)

    def grads(config, frozen):
      def loss(a):
        y, _ = RoutedAndSharedMoE(config).apply(
            {"params": lora.join(a, frozen)}, x, rngs={"params": _key(4)}
        )
        return jnp.sum(y * cotangent)

      # Compiled: one program each, cheaper than the ops one by one.
      return traverse_util.flatten_dict(jax.jit(jax.grad(loss))(adapters))

    got = grads(qlora_cfg, frozen)
    want = grads(float_cfg, _dequantized(frozen))
    self.assertLen(got, 12)
    for name, g in got.items():
      w = want[name]
      err = float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
      self.assertLess(err, 0.02, name)


def _rank_count(cfg) -> int:
  """Adapter parameters from the config's shapes, in NumPy: r (K + N) per
  adapted kernel (times E per routed expert), summed over layers."""
  m, r = cfg.moe.emb_dim, cfg.moe.lora_rank
  e, h = cfg.moe.num_experts, cfg.moe.moe_mlp_dim
  d, n, kv = cfg.resolved_head_dim, cfg.num_heads, cfg.resolved_kv_heads
  per_layer = np.int64(0)
  per_layer += 3 * e * r * (m + h)  # wi_0, wi_1, wo of each expert
  per_layer += r * (m + n * d) * 2 + r * (m + kv * d) * 2  # q, out; k, v
  return int(per_layer * cfg.num_layers)


class CountTest(absltest.TestCase):

  def test_trainable_count_from_shapes(self):
    cfg = load_model_config("tiny_qwen3_moe").replace(lora_rank=4)
    shapes = jax.eval_shape(
        Decoder(cfg).init, _key(0), jnp.zeros((1, 2), jnp.int32)
    )
    self.assertEqual(lora.count_trainable(shapes["params"]), _rank_count(cfg))


def _dot_shapes(text: str) -> set[tuple[int, ...]]:
  """The result shapes of the compiled program's contractions
  (`linen_moe.hlo.contractions` names them)."""
  names = {c.name for c in hlo.contractions(text)}
  shapes = set()
  for line in text.splitlines():
    found = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]", line)
    if found and found.group(1) in names:
      dims = found.group(2)
      shapes.add(tuple(int(d) for d in dims.split(",")) if dims else ())
  return shapes


def _kernel_shapes(params) -> set[tuple[int, ...]]:
  """Every frozen kernel's shape, per layer and as the 2-D matrix a dot
  would produce ([K, N] of its contracted and output axes)."""
  shapes = set()
  for path, v in traverse_util.flatten_dict(params).items():
    if frontend.is_adapter(path) or v.ndim < 2 or path[-1].endswith("_scale"):
      continue
    shape = v.shape[1:] if path[0] == "layers" else v.shape
    shapes.add(tuple(shape))
    if len(shape) == 3 and path[-2] in ("query", "key", "value"):
      shapes.add((shape[0], shape[1] * shape[2]))
    if len(shape) == 3 and path[-2] == "out":
      shapes.add((shape[0] * shape[1], shape[2]))
  return shapes


# The serving modes a frozen QLoRA base can be stored in, and their storage
# dtypes; int8 in the default run, the fp8 modes (about 35 s of compiling
# each on CI's machine) `slow`.
QLORA_MODES = {
    "int8": jnp.int8,
    "fp8": jnp.float8_e4m3fn,
    "nanoo_fp8": jnp.float8_e4m3fnuz,
}


@functools.cache
def _qlora_base(mode: str, lora_rank: int = 3):
  """(serving config, serving variables, QLoRA config, its variables with
  fresh adapters (B = 0), tokens): tiny_qwen3_moe's weights stored in
  `mode`, float adapters on them."""
  float_cfg = load_model_config("tiny_qwen3_moe").replace(quantization=mode)
  tokens = jax.random.randint(_key(3), (2, 5), 0, float_cfg.vocab_size)
  float_vars = Decoder(float_cfg).init(_key(0), tokens)
  serve_cfg, serve_vars = quantization.quantize_weights(float_cfg, float_vars)
  cfg = serve_cfg.replace(lora_rank=lora_rank)
  variables = lora.init_adapters(cfg, serve_vars, _key(1))
  return serve_cfg, serve_vars, cfg, variables, tokens


@functools.cache
def _qlora_run(mode: str = "int8", lora_rank: int = 3):
  """A QLoRA decoder (a `mode` serving base, float adapters), its train
  state, tokens and its compiled step."""
  _, _, cfg, variables, tokens = _qlora_base(mode, lora_rank)
  optimizer = optax.adam(1e-2)
  state = training.train_state_from_variables(variables, optimizer)
  step = jax.jit(training.make_train_step(Decoder(cfg), optimizer))
  compiled = step.lower(state, tokens, _key(4)).compile()
  return cfg, state, tokens, compiled


class QLoRATest(parameterized.TestCase):
  """A frozen serving base (int8, fp8, nanoo_fp8) with float adapters:
  fresh adapters change no logit of the serving model, a step trains the
  adapters alone (the optimizer's moments are theirs, the stored kernels
  unchanged, no contraction producing a frozen kernel's gradient in the
  compiled program) and a few steps lower the loss."""

  @heavy
  def test_int8_base(self):
    self._check("int8")

  @slow
  @parameterized.parameters("fp8", "nanoo_fp8")
  def test_fp8_bases(self, mode):
    self._check(mode)

  def _check(self, mode):
    with self.subTest("zero_b"):
      self._check_zero_b(mode)
    with self.subTest("training"):
      self._check_training(mode)
    with self.subTest("contractions"):
      self._check_contractions(mode)

  def _check_zero_b(self, mode):
    serve_cfg, serve_vars, cfg, variables, tokens = _qlora_base(mode)
    stored = serve_vars["params"]["layers"]["moe"]["wi_0"]
    self.assertEqual(jnp.dtype(stored.dtype), QLORA_MODES[mode])
    self.assertTrue(tree.has_adapters(variables["params"]))
    base = np.asarray(_forward(serve_cfg)(serve_vars, tokens))
    got = np.asarray(_forward(cfg)(variables, tokens))
    self.assertTrue(np.isfinite(base).all())
    np.testing.assert_array_equal(got, base)

  def _check_training(self, mode):
    cfg, state, tokens, compiled = _qlora_run(mode)
    adapters, frozen = lora.split(state.params)
    # The optimizer's moments are the adapters' (Adam: two of each).
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    self.assertEqual(
        sum(x.size for x in moments), 2 * lora.count_trainable(state.params)
    )
    losses = []
    for i in range(4):
      state, metrics = compiled(state, tokens, _key(10 + i))
      losses.append(float(metrics["loss"]))
    self.assertLess(losses[-1], losses[0])
    new_adapters, new_frozen = lora.split(state.params)
    jax.tree.map(np.testing.assert_array_equal, new_frozen, frozen)
    moved = jax.tree.map(
        lambda a, b: bool(np.any(a != b)), new_adapters, adapters
    )
    self.assertTrue(all(jax.tree.leaves(moved)))
    self.assertEqual(
        jnp.dtype(new_frozen["layers"]["moe"]["wi_0"].dtype), QLORA_MODES[mode]
    )

  def _check_contractions(self, mode):
    cfg, state, _, compiled = _qlora_run(mode)
    frozen_shapes = _kernel_shapes(lora.split(state.params)[1])
    self.assertIn((32, 64, 16), frozen_shapes)  # the experts' wi_0
    produced = _dot_shapes(compiled.as_text())
    self.assertNotEmpty(produced)
    self.assertEmpty(produced & frozen_shapes)

  @slow
  def test_full_fine_tuning_has_those_contractions(self):
    """The check above can fail: a full fine-tuning step of the same
    (float) decoder produces its kernels' gradients."""
    cfg = load_model_config("tiny_qwen3_moe")
    tokens = jax.random.randint(_key(3), (2, 5), 0, cfg.vocab_size)
    optimizer = optax.adam(1e-2)
    state = training.init_train_state(Decoder(cfg), optimizer, tokens, _key(0))
    step = jax.jit(training.make_train_step(Decoder(cfg), optimizer))
    text = step.lower(state, tokens, _key(4)).compile().as_text()
    self.assertNotEmpty(_dot_shapes(text) & _kernel_shapes(state.params))


# The default rule table's placement of the routed experts' kernels and
# their adapters: A and B split on the expert axis as their kernel, each on
# the kernel's mesh axis of the side it shares with it, the rank unsplit.
EP_SPECS = {
    "wi_0": "P('expert', 'fsdp', 'tensor')",
    "wi_0_lora_a": "P('expert', 'fsdp', None)",
    "wi_0_lora_b": "P('expert', None, 'tensor')",
    "wo": "P('expert', 'tensor', 'fsdp')",
    "wo_lora_a": "P('expert', 'tensor', None)",
    "wo_lora_b": "P('expert', None, 'fsdp')",
}


class ExpertParallelTest(parameterized.TestCase):
  """Adapters under expert parallelism (8 simulated devices, in
  `tests/sharding_worker.py`'s "lora" check): A and B carry their kernel's
  expert axis, are placed split on it, and the routed layer's output and
  the gradients of every A and B on the mesh are the single device's, to
  1e-5 of each one's largest magnitude (measured: 2.5e-7 at most, dense
  path; 1.5e-7 sparse, any strategy or serving base). The default run: the
  sparse path on a mesh that gathers tokens over `expert` and one with
  FSDP and tensor axes; the rest is slow."""

  def test_adapters_split_with_their_experts(self):
    self._check({
        "meshes": [
            ("data=2,expert=4", "default"),
            ("fsdp=2,expert=2,tensor=2", "default"),
        ]
    })

  @slow
  def test_adapters_split_with_their_experts_more(self):
    """Every expert on its own device, tokens replicated over `expert`
    (outputs summed), the ragged all-to-all exchange, the dense path under
    the same mesh, and QLoRA: frozen int8 / fp8 / nanoo_fp8 serving bases."""
    mesh = [("data=2,expert=4", "default")]
    self._check(
        {
            "meshes": [
                ("expert=8", "default"),
                ("data=2,expert=4", "batch_on_data"),
            ]
        },
        {"meshes": mesh, "expert_parallel": "ragged_all_to_all"},
        {"meshes": mesh, "path": "dense"},
        *(
            {"meshes": mesh, "quantization": m}
            for m in ("int8", "fp8", "nanoo_fp8")
        ),
    )

  def _check(self, *jobs):
    jobs = [{"check": "lora", **job} for job in jobs]
    for job, result in zip(jobs, workers.sharding_jobs(*jobs), strict=True):
      logical = result["logical"]
      for w in ("wi_0", "wi_1", "wo"):
        self.assertEqual(logical[w][0], "exp")
        self.assertEqual(logical[w + "_lora_a"], [*logical[w][:2], None])
        self.assertEqual(
            logical[w + "_lora_b"], [logical[w][0], None, logical[w][2]]
        )
      self.assertGreater(result["y_scale"], 0.0)
      self.assertLen(result["grad_scale"], 6)
      for spec, r in result["meshes"].items():
        with self.subTest(job=job, mesh=spec):
          specs = r["specs"]
          self.assertEqual({w: specs[w] for w in EP_SPECS}, EP_SPECS)
          self.assertEqual(specs["wi_1_lora_a"], specs["wi_0_lora_a"])
          self.assertEqual(specs["wi_1_lora_b"], specs["wi_0_lora_b"])
          self.assertLessEqual(r["y_err"], 1e-5 * result["y_scale"])
          self.assertEqual(r["grad_err"].keys(), result["grad_scale"].keys())
          for name, err in r["grad_err"].items():
            scale = result["grad_scale"][name]
            self.assertGreater(scale, 0.0, name)
            self.assertLessEqual(err, 1e-5 * scale, name)


class NNXTrainTest(absltest.TestCase):

  @slow
  def test_nnx_step_trains_the_adapters_alone(self):
    """The NNX front end's step: the base unchanged, the adapters moved,
    the optimizer's moments the adapters' alone."""
    cfg = load_model_config("tiny_qwen3_moe").replace(lora_rank=2)
    tokens = jax.random.randint(_key(3), (2, 5), 0, cfg.vocab_size)
    optimizer = optax.adam(1e-2)
    frontend = nnx_adapter.frontend("nnx")
    state = frontend.init(cfg, optimizer, tokens, _key(0))
    before = frontend.params(state)
    step = jax.jit(frontend.make_step(cfg, optimizer))
    state, _ = step(state, tokens, _key(1))
    after = frontend.params(state)
    old_a, old_f = lora.split(before)
    new_a, new_f = lora.split(after)
    jax.tree.map(np.testing.assert_array_equal, new_f, old_f)
    # One step from B = 0 moves every B (A's gradient is 0 until B is not).
    moved = {
        p: bool(np.any(a != b))
        for (p, a), b in zip(
            traverse_util.flatten_dict(new_a).items(),
            traverse_util.flatten_dict(old_a).values(),
            strict=True,
        )
        if p[-1].endswith("_lora_b")
    }
    self.assertNotEmpty(moved)
    self.assertTrue(all(moved.values()), moved)


class BadInputTest(absltest.TestCase):
  """One clear error each, before any work."""

  def test_rank_not_positive(self):
    cfg = load_model_config("tiny_qwen3_moe")
    with self.assertRaisesRegex(ValueError, r"lora_rank=-1 .*>= 0"):
      cfg.replace(lora_rank=-1)
    with self.assertRaisesRegex(ValueError, r"LoRAConfig.rank=0 .*>= 1"):
      lora_config.LoRAConfig(0)

  def test_rank_above_a_kernel_side(self):
    cfg = load_model_config("tiny_qwen3_moe")
    with self.assertRaisesRegex(
        ValueError, r"lora_rank=17 .*routed experts' wi_0 is \[64, 16\]"
    ):
      cfg.replace(lora_rank=17)
    with self.assertRaisesRegex(ValueError, r"lora_rank=65 .*attention"):
      cfg.replace(lora_rank=65, lora_targets=("attention",))

  def test_unknown_target(self):
    cfg = load_model_config("tiny_qwen3_moe")
    with self.assertRaisesRegex(
        ValueError, r"lora_targets=\('experts', 'ffn'\).*unknown: \['ffn'\]"
    ):
      cfg.replace(lora_rank=2, lora_targets=("experts", "ffn"))

  def test_merge_without_adapters(self):
    cfg = load_model_config("tiny_qwen3_moe")
    variables = {"params": {"embedding": np.zeros((2, 2))}}
    with self.assertRaisesRegex(ValueError, "lora_rank is 0"):
      lora.merge(cfg, variables)
    with self.assertRaisesRegex(ValueError, "merge found no adapters"):
      lora.merge(cfg.replace(lora_rank=2), variables)


if __name__ == "__main__":
  absltest.main()
