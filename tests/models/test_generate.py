"""`decoding.generate`: prompts of mixed lengths, sampling, stop ids, the
ring-buffer cache of sliding-window layers, and its argument checks.

The model is the Mixtral fixture (window 4, shorter than every prompt plus
its new tokens), so every row runs through the ring buffer. Its two
length-5 prompts have transformers' greedy continuations (generate.npy);
the other rows are checked against decoding them alone. Every call by
default shares two compiled programs: the batch (8 rows) and a row alone,
both with prompts bucketed to 32 columns and a cache of 64. Serving
weights, longer prompts, the other families' fixtures, the NNX front end
on each, and greedy_generate's equality are @slow.
"""

import functools

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from linen_moe import decoding
from linen_moe import quantization
from linen_moe._src.models import decoding as decoding_impl
from linen_moe._src.models import sampling
from linen_moe.testing import slow
import nnx_adapter
from tests import hf_helpers

FIXTURE = "mixtral_gqa_swa"
NEW = 8
LENGTHS = (1, 7, 20)
SLOW_LENGTHS = (64, 300)
SAMPLING = dict(
    sampling=decoding.Sampling(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02)
)


# Every family's fixture, for the @slow products.
FAMILIES = (
    "mixtral_gqa_swa",
    "gemma4_text_moe_keqv",
    "deepseek_v3_plain_nogroup",
    "qwen3_moe_dense0_norm",
    "gpt_oss_sinks_swa_yarn",  # sinks in every step, a window of 4
    "llama4_text_nope_chunked",  # chunks of 4, NoPE layers' temperature
)


@functools.cache
def _model(mode: str = "none", fixture: str = FIXTURE):
  config, variables = hf_helpers.load(fixture, False)
  if mode != "none":
    config, variables = quantization.quantize_weights(
        config.replace(quantization=mode), variables
    )
  return config, variables


@functools.cache
def _prompts(lengths=LENGTHS):
  """The fixture's two length-5 prompts, then random ones of `lengths`."""
  ids, _, _, p = hf_helpers.fixture(FIXTURE)
  config, _ = _model()
  rng = np.random.default_rng(36)
  extra = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
  return [ids[0, :p].tolist(), ids[1, :p].tolist()] + extra


def _generate(prompts, mode="none", fixture=FIXTURE, **kwargs):
  config, variables = _model(mode, fixture)
  return decoding.generate(
      config, variables, prompts, max_new_tokens=NEW, **kwargs
  )


class MixedLengthsTest(absltest.TestCase):

  def test_greedy_rows_match_transformers_and_decoding_alone(self):
    prompts = _prompts()
    batch = _generate(prompts)
    _, _, expected, p = hf_helpers.fixture(FIXTURE)
    # Rows 0, 1: transformers' generate (window 4 < 5 + 8: the ring buffer).
    for row in (0, 1):
      np.testing.assert_array_equal(batch.tokens[row], expected[row, p:])
    for i, prompt in enumerate(prompts):
      alone = _generate([prompt])
      self.assertEqual(batch.tokens[i], alone.tokens[0], f"row {i}")
      self.assertEqual(batch.finish_reasons[i], "length")
      self.assertLen(batch.tokens[i], NEW)

  def test_sampled_rows_equal_decoding_alone(self):
    prompts = _prompts()
    seeds = [11, 12, 13, 14, 15]
    batch = _generate(prompts, seed=seeds, **SAMPLING)
    for i, prompt in enumerate(prompts):
      alone = _generate([prompt], seed=[seeds[i]], **SAMPLING)
      self.assertEqual(batch.tokens[i], alone.tokens[0], f"row {i}")
    # Reordered, with an int seed per call: the same draws per row key.
    again = _generate(prompts[::-1], seed=seeds[::-1], **SAMPLING)
    self.assertEqual(again.tokens[::-1], batch.tokens)
    self.assertEqual(_generate(prompts, seed=seeds, **SAMPLING), batch)
    # The draws are not greedy, and another seed draws others.
    self.assertNotEqual(batch.tokens, _generate(prompts).tokens)
    other = _generate(prompts, seed=[s + 100 for s in seeds], **SAMPLING)
    self.assertNotEqual(other.tokens, batch.tokens)

  def test_int_seed_is_the_prompt_index(self):
    prompts = _prompts()
    batch = _generate(prompts, seed=7, **SAMPLING)
    alone = _generate(prompts[:1], seed=7, **SAMPLING)
    self.assertEqual(batch.tokens[0], alone.tokens[0])
    self.assertEqual(_generate(prompts, seed=7, **SAMPLING), batch)

  def test_top_k_1_is_greedy(self):
    prompts = _prompts()
    sampled = _generate(
        prompts, sampling=decoding.Sampling(temperature=1.5, top_k=1), seed=3
    )
    self.assertEqual(sampled.tokens, _generate(prompts).tokens)

  def test_stream_draws_what_generate_draws(self):
    config, variables = _model()
    prompt = _prompts()[0]
    kwargs = dict(max_new_tokens=NEW, seed=4, **SAMPLING)
    streamed = decoding.generate_stream(config, variables, prompt, **kwargs)
    whole = decoding.generate(config, variables, [prompt], **kwargs)
    self.assertEqual(tuple(streamed), whole.tokens[0])
    stop = whole.tokens[0][3]
    streamed = decoding.generate_stream(
        config, variables, prompt, stop_ids=[stop], **kwargs
    )
    tokens = list(streamed)
    self.assertEqual(tokens[-1], stop)
    self.assertNotIn(stop, tokens[:-1])
    with self.assertRaisesRegex(TypeError, "sampling"):  # at the call
      decoding.generate_stream(
          config, variables, prompt, **(kwargs | {"sampling": 0})
      )

  def test_nnx_generate_equals_linen(self):
    config, variables = _model()
    model = nnx_adapter.Decoder.from_linen(config, variables)
    prompts = _prompts()
    got = nnx_adapter.generate(
        model, prompts, max_new_tokens=NEW, seed=[1, 2, 3, 4, 5], **SAMPLING
    )
    self.assertEqual(got, _generate(prompts, seed=[1, 2, 3, 4, 5], **SAMPLING))

  @slow
  def test_temperature_0_is_greedy_generate(self):
    config, variables = _model()
    prompts = _prompts()
    batch = _generate(prompts)
    for i, prompt in enumerate(prompts):
      greedy = decoding.greedy_generate(
          config, variables, jnp.asarray([prompt]), NEW
      )
      np.testing.assert_array_equal(
          batch.tokens[i], np.asarray(greedy)[0, len(prompt) :]
      )

  @slow
  def test_long_mixed_lengths_families_front_ends_and_serving(self):
    prompts = _prompts(LENGTHS + SLOW_LENGTHS)
    seeds = list(range(len(prompts)))
    for fixture in FAMILIES:
      vocab = _model("none", fixture)[0].vocab_size
      rows = [[t % vocab for t in p] for p in prompts]
      for mode in ("none", "int8", "fp8"):
        for kwargs in ({}, dict(seed=seeds, **SAMPLING)):
          case = (fixture, mode, bool(kwargs))
          batch = _generate(rows, mode, fixture, **kwargs)
          for i, prompt in enumerate(rows):
            one = {"seed": [seeds[i]]} if kwargs else {}
            alone = _generate([prompt], mode, fixture, **(kwargs | one))
            self.assertEqual(batch.tokens[i], alone.tokens[0], (case, i))
          config, variables = _model(mode, fixture)
          model = nnx_adapter.Decoder.from_linen(config, variables)
          nnx = nnx_adapter.generate(model, rows, max_new_tokens=NEW, **kwargs)
          self.assertEqual(nnx, batch, case)


class StopIdsTest(absltest.TestCase):

  def test_rows_stop_independently_and_are_padded(self):
    prompts = _prompts()
    free = _generate(prompts)
    # A token some row first draws at step >= 1.
    row, step = next(
        (i, j)
        for i, r in enumerate(free.tokens)
        for j in range(1, len(r))
        if r[j] not in r[:j]
    )
    stop = free.tokens[row][step]
    got = _generate(prompts, stop_ids=[stop])
    for i, tokens in enumerate(free.tokens):
      if stop in tokens:
        end = tokens.index(stop) + 1
        self.assertEqual(got.tokens[i], tokens[:end])
        self.assertEqual(got.finish_reasons[i], "stop")
      else:
        self.assertEqual(got.tokens[i], tokens)
        self.assertEqual(got.finish_reasons[i], "length")
    self.assertLen(got.tokens[row], step + 1)

  def test_the_program_pads_a_stopped_row_and_ends_early(self):
    prompts = _prompts()
    first = _generate(prompts).tokens
    stops = sorted({row[0] for row in first})
    got = _generate(prompts, stop_ids=stops)
    self.assertEqual(got.tokens, tuple(row[:1] for row in first))
    self.assertEqual(set(got.finish_reasons), {"stop"})


class RingBufferTest(absltest.TestCase):

  def test_sliding_layers_hold_the_window(self):
    config, _ = _model()
    self.assertEqual(config.sliding_window, 4)
    cache = jax.eval_shape(lambda: decoding.init_cache(config, 2, 64))
    for i in range(config.num_layers):
      layer = cache[f"layers_{i}"]["attention"]
      kv, d = config.resolved_kv_heads, config.resolved_head_dim
      self.assertEqual(layer["cached_key"].shape, (2, kv, 4, d))
      self.assertEqual(layer["cached_position"].shape, (2, 4))
    per_token = decoding.cache_bytes_per_token(config, 64)
    kv, d = config.resolved_kv_heads, config.resolved_head_dim
    self.assertEqual(
        per_token["layers_0"],
        {"slots": 4, "bytes_per_token": 2 * kv * d * 4 + 4},
    )

  def test_full_layers_hold_max_len(self):
    config, _ = _model()
    config = config.replace(sliding_window=0)
    per_token = decoding.cache_bytes_per_token(config, 48)
    self.assertEqual(per_token["layers_1"]["slots"], 48)

  def test_a_window_cache_never_fills(self):
    config, _ = _model()
    cache = decoding.init_cache(config, 2, 8)  # every layer: 4 slots
    cache["index"] = jnp.int32(100)
    decoding_impl.check_room(cache, 1, config)  # no error
    full = config.replace(sliding_window=0)
    cache = decoding.init_cache(full, 2, 8)
    cache["index"] = jnp.int32(8)
    with self.assertRaisesRegex(ValueError, "max_len=8"):
      decoding_impl.check_room(cache, 1, full)


def _chi_square_p(draws: np.ndarray, probs: np.ndarray) -> float:
  counts = np.bincount(draws, minlength=probs.size)
  kept = probs > 0
  outside = counts[~kept].sum()
  assert outside == 0, f"{outside} draws outside the kept set"
  expected = probs[kept] * draws.size
  return stats.chisquare(counts[kept], expected).pvalue


def _reference(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
  """The kept distribution, by transformers' order, from the definitions."""
  x = np.asarray(logits, np.float64) / temperature
  keep = np.ones(x.size, bool)
  if top_k:
    keep &= x >= np.sort(x)[::-1][top_k - 1]
  p = np.where(keep, np.exp(x - x.max()), 0)
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  mass = 0.0
  nucleus = np.zeros(x.size, bool)
  for t in order:
    if mass >= top_p or p[t] == 0:
      break
    nucleus[t] = True
    mass += p[t]
  keep &= nucleus
  p = np.where(keep, p, 0)
  p /= p.sum()
  keep &= p >= min_p * p.max()
  p = np.where(keep, p, 0)
  return p / p.sum()


class SamplingTest(absltest.TestCase):

  def test_frequencies_match_the_truncated_softmax(self):
    logits = jnp.asarray(
        [2.0, 1.5, 1.2, 1.0, 0.6, 0.3, 0.0, -0.5, -1.0, -3.0], jnp.float32
    )
    draw = jax.jit(
        jax.vmap(
            lambda key, t, k, p, m: jax.random.categorical(
                key, sampling.filter_logits(logits, t, k, p, m)
            ),
            in_axes=(0, None, None, None, None),
        )
    )
    keys = jax.random.split(jax.random.key(0), 100_000)
    cases = [
        (1.0, 0, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.3),
        (0.9, 7, 0.85, 0.1),
    ]
    for t, k, p, m in cases:
      probs = _reference(np.asarray(logits), t, k, p, m)
      draws = np.asarray(draw(keys, t, k, p, m))
      self.assertGreater(_chi_square_p(draws, probs), 0.01, (t, k, p, m))

  def test_filters_keep_the_defined_sets(self):
    logits = jnp.asarray([3.0, 2.0, 1.0, 0.0], jnp.float32)
    keep = jax.jit(sampling.filter_logits)

    def kept(*args):
      return np.isfinite(keep(logits, *args)).tolist()

    self.assertEqual(kept(1.0, 2, 1.0, 0.0), [True, True, False, False])
    # softmax [.64, .24, .09, .03]: 0.7 needs the top two.
    self.assertEqual(kept(1.0, 0, 0.7, 0.0), [True, True, False, False])
    self.assertEqual(kept(1.0, 0, 0.5, 0.0), [True, False, False, False])
    self.assertEqual(kept(1.0, 0, 1.0, 0.1), [True, True, True, False])
    self.assertEqual(kept(1.0, 0, 1.0, 0.0), [True] * 4)

  def test_kept_sets_equal_the_sorting_reference(self):
    # Random logits over a vocabulary of 1,000 (no ties) and a few with
    # ties at the cut-offs: the filters' sets against `_reference`'s, which
    # sorts; scaled, shifted and negative logits reach every part of the
    # float keys the cut-offs are bisected over.
    rng = np.random.default_rng(0)
    keep = jax.jit(sampling.filter_logits)
    rows = [
        rng.standard_normal(1000) * s + c for s in (0.5, 3) for c in (-40, 0)
    ]
    rows.append(np.repeat([2.0, 1.0, 0.0, -1.0], 25))  # ties at every cut
    cases = [(1.0, 0, 0.9, 0.0), (0.8, 17, 1.0, 0.0), (1.2, 40, 0.5, 0.05)]
    cases += [(1.0, 30, 0.3, 0.0), (1.0, 1, 1.0, 0.0), (1.0, 0, 0.999, 0.0)]
    for row in rows:
      logits = jnp.asarray(row, jnp.float32)
      for t, k, p, m in cases:
        got = np.isfinite(np.asarray(keep(logits, t, k, p, m)))
        want = _reference(np.asarray(logits), t, k, p, m) > 0
        if row[0] == row[1]:  # ties: the reference keeps one of a tie
          want = np.isin(row, row[want])
        np.testing.assert_array_equal(got, want, str((row[:2], t, k, p, m)))


class BadInputTest(absltest.TestCase):

  def _raises(self, name, **kwargs):
    args = dict(prompts=[[1, 2]], max_new_tokens=2) | kwargs
    config, variables = _model()
    with self.assertRaisesRegex(ValueError, name):
      decoding.generate(config, variables, args.pop("prompts"), **args)

  def test_each_bad_argument_is_named(self):
    self._raises(r"prompts\[1\] is empty", prompts=[[1], []])
    self._raises("prompts is empty", prompts=[])
    self._raises(r"prompts\[0\]\[1\]=64 is outside", prompts=[[1, 64]])
    for name, settings in (
        ("top_p=0.0", dict(top_p=0.0)),
        ("top_p=1.5", dict(top_p=1.5)),
        ("temperature=-0.5", dict(temperature=-0.5)),
        ("min_p=2.0", dict(min_p=2.0)),
    ):
      with self.assertRaisesRegex(ValueError, name):
        decoding.Sampling(**settings)
    self._raises("max_new_tokens=0", max_new_tokens=0)
    self._raises(r"stop_ids\[0\]=99", stop_ids=[99])
    self._raises("seed has 2 entries", seed=[1, 2])

  def test_more_tokens_than_the_cache_holds(self):
    config, variables = _model()
    full = config.replace(sliding_window=0)
    prompt = jnp.asarray([[1, 2, 3]])
    with self.assertRaisesRegex(ValueError, "max_len=4"):
      decoding.greedy_generate(full, variables, prompt, 2, max_len=4)
    cache = decoding.init_cache(full, 1, 4)
    with self.assertRaisesRegex(ValueError, "max_len=4"):
      decoding.prefill(full, variables, cache, jnp.zeros((1, 5), jnp.int32))


if __name__ == "__main__":
  absltest.main()
