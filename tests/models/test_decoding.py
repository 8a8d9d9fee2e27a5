"""Greedy decoding with the KV cache against the full forward.

Per case: one compiled prefill, one compiled decode step, one compiled full
forward over the final sequence length (the causality check reuses it). The
other tests reuse the float case's model and cache size, so its programs.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import MATMUL_PATHS
from linen_moe import Decoder
from linen_moe import decoding
from linen_moe import load_model_config
from linen_moe import quantization
from linen_moe._src.models import decoding as decoding_impl
from linen_moe.models import scanned_to_unrolled
from linen_moe.sharding import unbox

PROMPT, NEW = 5, 4
# (config, layers, path, mode): a float model and converted ones, both
# dropless paths, scanned and unrolled; gemma adds the shared expert.
CASES = {
    "mixtral_float_sparse": ("tiny_mixtral", True, "sparse", "none"),
    "mixtral_int8_dense": ("tiny_mixtral", True, "dense", "int8"),
    "gemma_fp8_sparse_unrolled": ("tiny_gemma4_26b", False, "sparse", "fp8"),
}
# Logits of a cached step against the full forward: the same math, but the
# attention sums over the whole cache (zeros past the written positions,
# masked) instead of the S tokens, in another order.
ATOL = 1e-4


@functools.cache
def _model(case: str):
  """(config, variables, prompt) of a case, converted when quantized."""
  name, scan, path, mode = CASES[case]
  config = load_model_config(name, scan_layers=scan, **MATMUL_PATHS[path])
  prompt = jax.random.randint(
      jax.random.key(3), (2, PROMPT), 0, config.vocab_size
  )
  init = jax.jit(Decoder(config).init)
  variables = unbox(init(jax.random.key(0), prompt))
  if mode != "none":
    config, variables = quantization.quantize_weights(
        config.replace(quantization=mode), variables
    )
  return config, variables, prompt


@functools.cache
def _full_forward(case: str):
  config, variables, _ = _model(case)
  return jax.jit(lambda t: Decoder(config).apply(variables, t)[0])


class DecodingTest(parameterized.TestCase):

  @parameterized.named_parameters((case, case) for case in CASES)
  def test_cache_equals_full_forward(self, case):
    config, variables, prompt = _model(case)
    tokens = decoding.greedy_generate(config, variables, prompt, NEW)
    self.assertEqual(tokens.shape, (2, PROMPT + NEW))
    np.testing.assert_array_equal(tokens[:, :PROMPT], prompt)
    # The logits of each cached step, replaying the generated tokens.
    cache = decoding.init_cache(config, 2, PROMPT + NEW)
    _, logits, cache = decoding.prefill(config, variables, cache, prompt)
    cached = [logits]
    for i in range(PROMPT, PROMPT + NEW - 1):
      _, logits, cache = decoding.decode_step(
          config, variables, cache, tokens[:, i]
      )
      cached.append(logits)
    cached = np.stack(cached, axis=1)  # [B, NEW, V]
    # One program (greedy_generate) and step by step: the same tokens.
    np.testing.assert_array_equal(
        tokens[:, PROMPT:], np.argmax(cached, axis=-1)
    )
    self.assertEqual(int(cache["index"]), PROMPT + NEW - 1)
    # The full forward on the final sequence: by causality (checked below),
    # position t sees exactly the growing sequence up to t.
    full = np.asarray(_full_forward(case)(tokens))[:, PROMPT - 1 : -1]
    np.testing.assert_allclose(cached, full, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(tokens[:, PROMPT:], np.argmax(full, axis=-1))

  @parameterized.named_parameters((case, case) for case in CASES)
  def test_full_forward_is_causal(self, case):
    config, _, prompt = _model(case)
    forward = _full_forward(case)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (2, PROMPT + NEW))
    changed = tokens.copy()
    changed[:, PROMPT:] = (changed[:, PROMPT:] + 1) % config.vocab_size
    a, b = forward(jnp.asarray(tokens)), forward(jnp.asarray(changed))
    np.testing.assert_allclose(a[:, :PROMPT], b[:, :PROMPT], atol=1e-6)
    self.assertGreater(
        float(jnp.max(jnp.abs(a[:, PROMPT:] - b[:, PROMPT:]))), 0
    )

  def test_prefill_runs_the_output_head_on_the_last_position_only(self):
    config, variables, prompt = _model("mixtral_float_sparse")
    last = jax.jit(
        lambda t: Decoder(config, last_logits_only=True).apply(variables, t)[0]
    )(prompt)
    full = _full_forward("mixtral_float_sparse")(prompt)
    self.assertEqual(last.shape, (2, 1, config.vocab_size))
    np.testing.assert_allclose(last, full[:, -1:], atol=1e-6, rtol=0)
    cache = decoding.init_cache(config, 2, PROMPT + NEW)
    prefill = jax.jit(functools.partial(decoding.prefill, config))
    text = prefill.lower(variables, cache, prompt).as_text()
    v = config.vocab_size
    self.assertIn(f"tensor<2x1x{v}xf32>", text)
    every_position = f"tensor<2x{PROMPT}x{v}xf32>"  # [B, P, V]
    self.assertFalse(
        every_position in text, f"the prefill has {every_position}"
    )

  def test_layer_views_equal_slices_and_share_the_buffers(self):
    config, variables, _ = _model("mixtral_float_sparse")
    views = decoding_impl.host_unrolled(config, variables)
    sliced = scanned_to_unrolled(variables, config.stack_plan)
    self.assertEqual(jax.tree.structure(views), jax.tree.structure(sliced))
    jax.tree.map(np.testing.assert_array_equal, views, sliced)
    # Not copies: a layer's expert weights sit inside the stacked buffer.
    stacked = variables["params"]["layers"]["moe"]["wi_0"]
    layer = views["params"]["layers_1"]["moe"]["wi_0"]
    self.assertEqual(
        layer.unsafe_buffer_pointer(),
        stacked.unsafe_buffer_pointer() + layer.nbytes,
    )
    # Traced there is nothing to view: the program slices.
    jax.jit(
        lambda v: self.assertIsNone(decoding_impl.host_unrolled(config, v))
    )(variables)
    unrolled = config.replace(scan_layers=False)
    self.assertIs(decoding_impl.host_unrolled(unrolled, sliced), sliced)

  def test_generate_program_slices_a_stack_itself(self):
    # The program a traced or accelerator stack gets: sliced in the program.
    config, variables, prompt = _model("mixtral_int8_dense")
    program, args = decoding.generate_program(config, variables, prompt, NEW)
    stacked = (config, unbox(dict(variables))) + args[2:]
    np.testing.assert_array_equal(
        program(*stacked),
        decoding.greedy_generate(config, variables, prompt, NEW)[:, PROMPT:],
    )

  def test_a_scanned_cache_is_accepted_and_kept_scanned(self):
    config, variables, prompt = _model("mixtral_float_sparse")
    # PROMPT + NEW: the per-layer prefill is `test_cache_equals_full_forward`'s.
    scanned = Decoder(config, decode=True).init(
        jax.random.key(0), jnp.zeros((2, PROMPT + NEW), jnp.int32)
    )["cache"]
    scanned = jax.tree.map(jnp.zeros_like, scanned)
    self.assertIn("layers", scanned)
    token, logits, cache = decoding.prefill(config, variables, scanned, prompt)
    self.assertEqual(jax.tree.structure(cache), jax.tree.structure(scanned))
    per_layer = decoding.init_cache(config, 2, PROMPT + NEW)
    self.assertNotIn("layers", per_layer)
    token_u, logits_u, cache_u = decoding.prefill(
        config, variables, per_layer, prompt
    )
    np.testing.assert_array_equal(token, token_u)
    np.testing.assert_array_equal(logits, logits_u)
    jax.tree.map(
        np.testing.assert_array_equal,
        cache,
        decoding_impl.layer_stack.to_scanned(cache_u, config.stack_plan),
    )

  def test_bad_arguments(self):
    config, variables, prompt = _model("mixtral_float_sparse")
    generate = functools.partial(decoding.greedy_generate, config, variables)
    with self.assertRaisesRegex(ValueError, "max_len=6 cannot hold"):
      generate(prompt, 2, max_len=6)
    with self.assertRaisesRegex(ValueError, "num_tokens=0"):
      generate(prompt, 0)
    with self.assertRaisesRegex(ValueError, r"prompt must be \[batch"):
      generate(prompt[0], 2)
    with self.assertRaisesRegex(ValueError, "batch=0"):
      decoding.init_cache(config, 0, 8)

  def test_a_full_cache_is_an_error_not_a_clamped_write(self):
    config, variables, prompt = _model("mixtral_float_sparse")
    p = prompt.shape[1]
    with self.assertRaisesRegex(ValueError, f"{p} more do not fit"):
      decoding.prefill(
          config, variables, decoding.init_cache(config, 2, p - 1), prompt
      )
    # The cache of `test_cache_equals_full_forward` (its compiled steps),
    # filled by the prefill and NEW steps.
    max_len = p + NEW
    cache = decoding.init_cache(config, 2, max_len)
    token, _, cache = decoding.prefill(config, variables, cache, prompt)
    for _ in range(NEW):
      token, _, cache = decoding.decode_step(config, variables, cache, token)
    with self.assertRaisesRegex(
        ValueError, f"holds {max_len} of its max_len={max_len} tokens"
    ):
      decoding.decode_step(config, variables, cache, token)


if __name__ == "__main__":
  absltest.main()
