"""The optimizer: learning-rate schedules against their formulas, AdamW with
the weight-decay mask against a NumPy AdamW, and the mask on every family.
"""

import functools
import math

from absl.testing import absltest
from absl.testing import parameterized
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax

from linen_moe import Decoder
from linen_moe import load_model_config
from linen_moe._src.training.optimizer import decays
from linen_moe.sharding import unbox
from linen_moe.training import SCHEDULES
from linen_moe.training import default_optimizer
from linen_moe.training import learning_rate_schedule
from linen_moe.training import weight_decay_mask
import nnx_adapter

PEAK = 0.02


def expected_lr(n, schedule, warmup, total, ratio):
  """The learning rate of update n, written from the definitions: linear
  warmup from 0, then constant, a half cosine or a line down to
  ratio * peak at n = total, flat after."""
  if n < warmup:
    return PEAK * n / warmup
  if schedule == "constant":
    return PEAK
  end = ratio * PEAK
  frac = min(n - warmup, total - warmup) / (total - warmup)
  if schedule == "cosine":
    return end + (PEAK - end) * 0.5 * (1 + math.cos(math.pi * frac))
  return PEAK + (end - PEAK) * frac


class ScheduleTest(parameterized.TestCase):

  @parameterized.product(schedule=SCHEDULES, warmup=(0, 3))
  def test_rate_of_each_update(self, schedule, warmup):
    total, ratio = 12, 0.25
    kwargs = {}
    if schedule != "constant":
      kwargs = {"total_steps": total, "final_lr_ratio": ratio}
    fn = learning_rate_schedule(PEAK, schedule, warmup_steps=warmup, **kwargs)
    got = [float(fn(n)) for n in range(total + 4)]
    want = [
        expected_lr(n, schedule, warmup, total, ratio) for n in range(total + 4)
    ]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)

  def test_decaying_schedules_end_at_a_tenth_by_default(self):
    for schedule in ("cosine", "linear"):
      fn = learning_rate_schedule(PEAK, schedule, total_steps=10)
      np.testing.assert_allclose(float(fn(10)), PEAK / 10, rtol=1e-6)
      np.testing.assert_allclose(float(fn(50)), PEAK / 10, rtol=1e-6)

  @parameterized.named_parameters(
      ("unknown_schedule", {"schedule": "step"}, "schedule='step'"),
      ("negative_warmup", {"warmup_steps": -1}, "warmup_steps=-1"),
      (
          "warmup_past_total",
          {"schedule": "cosine", "warmup_steps": 5, "total_steps": 5},
          "total_steps=5",
      ),
      (
          "no_total",
          {"schedule": "linear"},
          "total_steps=None",
      ),
      (
          "ratio_above_one",
          {"schedule": "cosine", "total_steps": 9, "final_lr_ratio": 1.5},
          "final_lr_ratio=1.5",
      ),
      (
          "ratio_of_constant",
          {"final_lr_ratio": 0.1},
          "final_lr_ratio=0.1",
      ),
      ("zero_rate", {"learning_rate": 0.0}, "learning_rate=0.0"),
      ("negative_decay", {"weight_decay": -0.1}, "weight_decay=-0.1"),
  )
  def test_bad_arguments(self, kwargs, named):
    kwargs = {"learning_rate": PEAK, **kwargs}
    with self.assertRaisesRegex(ValueError, named):
      default_optimizer(**kwargs)


def _params():
  """A parameter tree with a leaf of each kind, Linen-named."""
  shapes = {
      "embed": {"embedding": (6, 3)},
      "final_norm": {"scale": (3,)},
      "layers": {
          "pre_moe_norm": {"scale": (2, 3)},  # scanned: a matrix
          "attention": {"query": {"kernel": (2, 3, 2)}},
          "moe": {
              "gate": {"kernel": (2, 3, 4)},
              "wi_0": (2, 4, 3, 5),
              "wo": (2, 4, 5, 3),
              "per_expert_scale": (2, 4),
          },
          "router_input_scale": (2, 3),
      },
      "logits": {"kernel": (3, 6)},
  }
  rng = np.random.default_rng(0)
  return jax.tree.map(
      lambda s: rng.normal(size=s).astype(np.float32),
      shapes,
      is_leaf=lambda x: isinstance(x, tuple),
  )


# The leaves of `_params` that weight decay applies to, by hand.
DECAYED = {
    "layers/attention/query/kernel",
    "layers/moe/gate/kernel",
    "layers/moe/wi_0",
    "layers/moe/wo",
    "logits/kernel",
}


def _numpy_adamw(params, grads_per_step, lrs, weight_decay):
  """AdamW from its formula (b1 0.9, b2 0.999, eps 1e-8) after clipping
  the global norm to 1, decay on `DECAYED`; the params after each step."""
  flat = {
      "/".join(k): v.astype(np.float64)
      for k, v in traverse_util.flatten_dict(params).items()
  }
  m = {k: np.zeros_like(v) for k, v in flat.items()}
  v2 = {k: np.zeros_like(v) for k, v in flat.items()}
  out = []
  steps = zip(grads_per_step, lrs, strict=True)
  for t, (grads, lr) in enumerate(steps, start=1):
    g = {
        "/".join(k): x.astype(np.float64)
        for k, x in traverse_util.flatten_dict(grads).items()
    }
    norm = math.sqrt(sum(float(np.sum(x * x)) for x in g.values()))
    scale = min(1.0, 1.0 / norm) if norm > 0 else 1.0
    for k, p in flat.items():
      gk = g[k] * scale
      m[k] = 0.9 * m[k] + 0.1 * gk
      v2[k] = 0.999 * v2[k] + 0.001 * gk * gk
      direction = (m[k] / (1 - 0.9**t)) / (
          np.sqrt(v2[k] / (1 - 0.999**t)) + 1e-8
      )
      if k in DECAYED:
        direction = direction + weight_decay * p
      flat[k] = p - lr * direction
    out.append(dict(flat))
  return out


class AdamWTest(absltest.TestCase):

  def _run(self, tx, params, grads_per_step):
    state = tx.init(params)
    update = jax.jit(tx.update)
    out = []
    for grads in grads_per_step:
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
      out.append({
          "/".join(k): np.asarray(v)
          for k, v in traverse_util.flatten_dict(params).items()
      })
    return out

  def test_updates_follow_the_schedule_and_the_mask(self):
    params = _params()
    rng = np.random.default_rng(1)
    grads = [
        jax.tree.map(
            lambda p: rng.normal(size=p.shape).astype(np.float32), params
        )
        for _ in range(8)
    ]
    kwargs = dict(warmup_steps=2, total_steps=6, final_lr_ratio=0.2)
    tx = default_optimizer(PEAK, schedule="cosine", weight_decay=0.1, **kwargs)
    got = self._run(tx, params, grads)
    lrs = [expected_lr(n, "cosine", 2, 6, 0.2) for n in range(8)]
    want = _numpy_adamw(params, grads, lrs, 0.1)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
      for k in w:
        np.testing.assert_allclose(
            g[k], w[k], rtol=2e-5, atol=1e-6, err_msg=f"step {step} {k}"
        )

  def test_zero_gradient_decays_only_kernels(self):
    params = _params()
    zeros = jax.tree.map(np.zeros_like, params)
    tx = default_optimizer(PEAK, weight_decay=0.5)
    got = self._run(tx, params, [zeros] * 3)[-1]
    flat = {
        "/".join(k): v for k, v in traverse_util.flatten_dict(params).items()
    }
    for k, before in flat.items():
      if k in DECAYED:  # p <- p (1 - lr wd), three times
        np.testing.assert_allclose(
            got[k], before * (1 - PEAK * 0.5) ** 3, rtol=1e-6, err_msg=k
        )
      else:
        np.testing.assert_array_equal(got[k], before, err_msg=k)

  def test_state_leaves_do_not_depend_on_the_decay(self):
    # Checkpoints of runs from before the schedules restore: the constant
    # optimizer's state has the leaves it had, with or without decay.
    params = _params()
    old = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(PEAK, weight_decay=0.0)
    )
    paths = lambda tx: [  # noqa: E731
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_leaves_with_path(tx.init(params))
    ]
    self.assertEqual(paths(default_optimizer(PEAK)), paths(old))
    self.assertEqual(
        paths(default_optimizer(PEAK, weight_decay=0.1)), paths(old)
    )


# One tiny config per family; DeepSeek-V3's with MLA and a dense first
# layer, Gemma-4's with both layer kinds, per-expert and router scales.
FAMILY_CONFIGS = (
    "tiny_mixtral",
    "tiny_qwen3_moe",
    "tiny_deepseek_v3_mla",
    "tiny_gemma4_text",
)
KERNEL_NAMES = {"kernel", "wi_0", "wi_1", "wo"}
UNDECAYED_NAMES = {
    "embedding",
    "scale",
    "per_expert_scale",
    "router_input_scale",
}


@functools.cache
def _linen_params(name):
  cfg = load_model_config(name)
  tokens = jnp.zeros((1, 4), jnp.int32)
  variables = jax.eval_shape(
      lambda: Decoder(cfg).init(jax.random.key(0), tokens)
  )
  return cfg, unbox(variables["params"])


class MaskOnFamiliesTest(parameterized.TestCase):

  @parameterized.parameters(*FAMILY_CONFIGS)
  def test_kernels_decay_the_rest_does_not(self, name):
    _, params = _linen_params(name)
    mask = traverse_util.flatten_dict(weight_decay_mask(params))
    for path, decayed in mask.items():
      leaf = path[-1]
      self.assertIn(leaf, KERNEL_NAMES | UNDECAYED_NAMES, path)
      self.assertEqual(decayed, leaf in KERNEL_NAMES, path)
      self.assertEqual(decays(path), decayed)

  def test_mixtral_by_hand(self):
    _, params = _linen_params("tiny_mixtral")
    mask = traverse_util.flatten_dict(weight_decay_mask(params))
    kept = sorted("/".join(p) for p, d in mask.items() if not d)
    self.assertEqual(
        kept,
        [
            "embed/embedding",
            "final_norm/scale",
            "layers/pre_attention_norm/scale",
            "layers/pre_moe_norm/scale",
        ],
    )

  def test_nnx_optimizer_sees_the_same_mask(self):
    cfg, params = _linen_params("tiny_deepseek_v3_mla")
    want = {
        p: d
        for p, d in traverse_util.flatten_dict(
            weight_decay_mask(params)
        ).items()
    }
    seen = {}

    def recording_mask(tree):
      out = weight_decay_mask(tree)
      for path, decayed in jax.tree_util.tree_leaves_with_path(out):
        names = tuple(
            str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)
        )
        seen[names] = bool(decayed)
      return out

    tx = optax.adamw(1e-3, weight_decay=0.1, mask=recording_mask)
    fe = nnx_adapter.frontend("nnx")
    jax.eval_shape(
        lambda: fe.init(
            cfg, tx, jnp.zeros((1, 4), jnp.int32), jax.random.key(0)
        )
    )
    self.assertEqual(seen, want)


if __name__ == "__main__":
  absltest.main()
