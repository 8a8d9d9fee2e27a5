"""What each metric of the Linen train step means, pinned against NumPy.

One step of a three-layer decoder (MoE, dense, MoE; the dropping dense
path; both auxiliary losses on) on two rows that hold padding, a masked id
and a segment boundary. Every metric is recomputed from the decoder's
logits and each MoE layer's router logits, by the definitions in
`decoder_loss` and `layer_aux`:

- `cross_entropy`: the mean next-token loss over the counted targets only
  (both ids real, one segment, not padding);
- `load_balance_loss`, `router_z_loss`: each MoE layer's weighted loss over
  every token of the batch (the router sees padding too), summed over the
  layers;
- `dropped_fraction`: the dropped share of each MoE layer's assignments
  (an expert's capacity is per sequence), averaged over the MoE layers
  only (a dense layer drops nothing and does not count);
- `expert_load`: per layer [L, E], each MoE layer's share of the routed
  assignments, zeros for the dense layer;
- `loss`: the sum of the three loss terms; `skipped` and `skipped_steps`: 0;
- `make_eval_step`: the summed loss of the same targets, and their count.

A sum that becomes a mean (or back), a term left out of `loss`, the
dense layers counted in the dropped share, or padding or a crossing target
counted in the loss turns this test red. (Microbatches average every
metric: `test_decoder`'s gradient-accumulation test pins that.)
"""

import math

from absl.testing import absltest
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import load_model_config
from linen_moe import training
from linen_moe.sharding import unbox

E, K, S = 4, 2, 8
# Not an integer share: the capacity is ceil(0.6 * S * K / E) = ceil(2.4) = 3.
CAPACITY_FACTOR = 0.6
LB_WEIGHT, Z_WEIGHT = 0.1, 0.01
CONFIG = dict(
    num_layers=3,
    dense_layers=(1,),
    dense_mlp_dim=16,
    scan_layers=False,
    num_experts=E,
    num_experts_per_tok=K,
    emb_dim=16,
    moe_mlp_dim=16,
    num_heads=2,
    vocab_size=32,
    sparse_matmul=False,
    capacity_factor=CAPACITY_FACTOR,
    load_balance_loss_weight=LB_WEIGHT,
    router_z_loss_weight=Z_WEIGHT,
)
# Row 0: a document of 6 ids, then 2 of padding (segment 0; the mask
# leaves them in, so the segment ids alone must leave them out).
# Row 1: documents of 3 and 5 ids; its id 5 is masked: neither the target
# 5 nor the prediction from it counts.
SEGMENTS = np.array([[1] * 6 + [0] * 2, [1] * 3 + [2] * 5], np.int32)
MASK = np.array([[1] * 8, [1] * 5 + [0] + [1] * 2], bool)


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  shifted = x - x.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _counted_targets():
  """<bool>[B, S - 1]: the target t + 1 counts where t and t + 1 are real
  ids of one segment that is not padding."""
  real = MASK[:, :-1] & MASK[:, 1:]
  same = SEGMENTS[:, :-1] == SEGMENTS[:, 1:]
  return real & same & (SEGMENTS[:, 1:] > 0)


def _router_terms(logits):
  """One MoE layer's routing of the batch, from its router logits [B, S, E]
  (top-k of the logits, Mixtral's routing): (load-balance loss, z-loss,
  both weighted; expert load [E]; dropped share)."""
  logits = np.asarray(logits, np.float64)
  chosen = np.argsort(-logits, axis=-1, kind="stable")[..., :K]  # [B, S, K]
  load = np.bincount(chosen.reshape(-1), minlength=E) / chosen.size
  probs = np.exp(_log_softmax(logits)).reshape(-1, E)
  lb = LB_WEIGHT * E * np.sum(load * probs.mean(0))
  lse = np.log(np.exp(logits).sum(-1))
  z = Z_WEIGHT * np.mean(lse**2)
  # Per sequence, an expert takes at most `capacity` of its assignments
  # (which ones is `test_moe`'s; how many is all the share needs).
  capacity = min(S, math.ceil(CAPACITY_FACTOR * S * K / E))
  dropped = 0
  for row in chosen:
    used = np.bincount(row.reshape(-1), minlength=E)
    dropped += np.sum(np.maximum(used - capacity, 0))
  return lb, z, load, dropped / chosen.size


class TrainStepMetricsTest(absltest.TestCase):

  def test_each_metric_from_its_definition(self):
    cfg = load_model_config("tiny_mixtral", **CONFIG)
    self.assertEqual(cfg.layer_kinds, ("moe", "dense", "moe"))
    model = Decoder(cfg)
    optimizer = training.default_optimizer()
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, S)), jnp.int32)
    seg = jnp.asarray(SEGMENTS)
    # Parameters drawn here: only their shapes come from `init` (no compile).
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)
    params = jax.tree.map(
        lambda x: (0.5 * rng.standard_normal(x.shape)).astype(np.float32),
        unbox(shapes)["params"],
    )
    state = training.train_state_from_variables({"params": params}, optimizer)

    @jax.jit
    def forward(params):
      """The logits, and each MoE layer's router logits [B * S, E]."""
      router = []

      def record(call, args, kwargs, context):
        out = call(*args, **kwargs)
        if isinstance(context.module, nn.Dense) and context.module.name == (
            "gate"
        ):
          router.append(out)
        return out

      with nn.intercept_methods(record):
        logits, _ = model.apply({"params": params}, tokens, seg)
      return logits, router

    logits, router = forward(state.params)
    self.assertLen(router, 2)  # layers 0 and 2

    step = jax.jit(training.make_train_step(model, optimizer))
    _, got = step(state, tokens, jax.random.key(1), MASK, seg)

    counted = _counted_targets()
    self.assertEqual(counted.sum(), 9)  # 5 in row 0; 2 + 2 in row 1
    logp = _log_softmax(np.asarray(logits)[:, :-1])
    nll = -np.take_along_axis(logp, np.asarray(tokens)[:, 1:, None], -1)
    cross_entropy = nll[..., 0][counted].mean()

    layers = [_router_terms(np.asarray(r).reshape(2, S, E)) for r in router]
    lb, z, load, dropped = (np.array(t) for t in zip(*layers, strict=True))
    expert_load = np.stack([load[0], np.zeros(E), load[1]])
    lb, z, dropped = lb.sum(), z.sum(), dropped.mean()
    self.assertGreater(dropped, 0.0)  # the capacity binds

    want = {
        "cross_entropy": cross_entropy,
        "load_balance_loss": lb,
        "router_z_loss": z,
        "dropped_fraction": dropped,
        "loss": cross_entropy + lb + z,
    }
    for name, value in want.items():
      np.testing.assert_allclose(got[name], value, rtol=2e-5, err_msg=name)
    np.testing.assert_allclose(got["expert_load"], expert_load, atol=1e-7)
    self.assertEqual((int(got["skipped"]), int(got["skipped_steps"])), (0, 0))

    # The held-out loss: the sum over the same targets, and their count.
    total, count = jax.jit(training.make_eval_step(model))(
        {"params": params}, tokens, MASK, seg
    )
    self.assertEqual(float(count), 9)
    np.testing.assert_allclose(total, nll[..., 0][counted].sum(), rtol=2e-5)


if __name__ == "__main__":
  absltest.main()
