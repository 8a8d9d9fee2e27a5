"""The expert-parallel traffic model and the choice `expert_parallel="auto"`
makes from it, at the scales of released models.

The model's figures are checked against compiled programs in
tests/kernels/test_ragged_all_to_all.py; here, that its rule picks what the bytes
say (the all-gather moves about D / k times the ragged exchange's bytes).
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax

from linen_moe._src.layer import expert_parallel
from linen_moe._src.parallel import ep_traffic

# (name, emb, top-k, experts): DeepSeek-V3, Qwen3-30B-A3B, Mixtral 8x7B.
MODELS = {
    "deepseek_v3": (7168, 8, 256),
    "qwen3_30b_a3b": (2048, 8, 128),
    "mixtral_8x7b": (4096, 2, 8),
}


def _problem(model, ep, tokens=4096):
  emb, k, experts = MODELS[model]
  return ep_traffic.Problem(
      tokens=tokens,
      emb=emb,
      k=k,
      ep=ep,
      act_bytes=2,
      experts_per_device=max(1, experts // ep),
  )


class ModelTest(parameterized.TestCase):

  @parameterized.parameters(
      ("deepseek_v3", 8, "all_gather"),  # D = k: the same bytes
      ("deepseek_v3", 64, "ragged_all_to_all"),
      ("deepseek_v3", 256, "ragged_all_to_all"),
      ("qwen3_30b_a3b", 8, "all_gather"),
      ("qwen3_30b_a3b", 16, "ragged_all_to_all"),
      ("mixtral_8x7b", 8, "ragged_all_to_all"),
      ("mixtral_8x7b", 2, "all_gather"),  # D = k
  )
  def test_auto_follows_the_bytes(self, model, ep, want):
    for tokens in (4096, 16384):
      self.assertEqual(ep_traffic.choose(_problem(model, ep, tokens)), want)

  @parameterized.parameters(8, 64, 256)
  def test_all_gather_over_ragged_is_about_ep_over_k(self, ep):
    p = _problem("deepseek_v3", ep)
    ratio = (
        ep_traffic.all_gather_traffic(p).total
        / ep_traffic.ragged_traffic(p).total
    )
    self.assertAlmostEqual(ratio, ep / 8, delta=0.01 * ep / 8)

  def test_emulated_ragged_never_wins(self):
    for model in MODELS:
      for ep in (2, 8, 64, 256):
        self.assertEqual(
            ep_traffic.choose(_problem(model, ep), emulated=True), "all_gather"
        )

  def test_deepseek_v3_at_ep_64(self):
    """The figures by hand: 4096 tokens, emb 7168, bf16, top-8, EP 64."""
    p = _problem("deepseek_v3", 64)
    gather = ep_traffic.all_gather_traffic(p)
    ragged = ep_traffic.ragged_traffic(p)
    row = 7168 * 2
    # 63 of 64 devices' tokens in, outputs out; 8 B of routing per choice.
    self.assertEqual(gather.forward, 63 * 4096 * (2 * row + 8 * 8))
    # Each of 4096 * 8 assignments leaves with probability 63/64, and back.
    counts = 63 * 64 * 4 * 4
    self.assertAlmostEqual(
        ragged.forward, 2 * 4096 * 8 * 63 / 64 * row + counts
    )
    seconds, _ = gather.seconds(50e9)  # 400 Gb/s
    self.assertAlmostEqual(seconds, gather.forward / 50e9)

  def test_unknown_strategy(self):
    with self.assertRaisesRegex(ValueError, "'ring'"):
      ep_traffic.traffic(_problem("mixtral_8x7b", 8), "ring")


class StrategyTest(parameterized.TestCase):
  """`expert_parallel.strategy`: what the layer runs for a plan."""

  def _plan(self, expert, batch_axes=("expert",)):
    mesh = jax.sharding.AbstractMesh((expert,), ("expert",))
    return expert_parallel.ExpertParallelPlan(
        mesh=mesh,
        batch_axes=batch_axes,
        expert_axes=("expert",),
        num_experts=256,
    )

  @parameterized.parameters(
      ("auto", "gpu", "ragged_all_to_all"),
      ("auto", "tpu", "ragged_all_to_all"),
      ("auto", "cpu", "all_gather"),  # emulated here
      ("all_gather", "gpu", "all_gather"),
      ("ragged_all_to_all", "cpu", "ragged_all_to_all"),
  )
  def test_deepseek_v3_scale(self, requested, backend, want):
    got = expert_parallel.strategy(
        requested, self._plan(64), 4096, 7168, 8, 2, backend
    )
    self.assertEqual(got, want)

  def test_nothing_to_exchange_is_all_gather(self):
    plan = self._plan(64, batch_axes=())  # tokens replicated over experts
    got = expert_parallel.strategy(
        "ragged_all_to_all", plan, 4096, 7168, 8, 2, "gpu"
    )
    self.assertEqual(got, "all_gather")


if __name__ == "__main__":
  absltest.main()
