"""`serving/bench_serving.py`'s decoding part: trains (here: no steps),
converts, decodes, and prints each mode's expert-weight bytes and decode
speed. Decoding itself: tests/models/test_decoding.py."""

from absl.testing import absltest
import bench_serving

# No training steps, a batch of 2 prompts of 4 tokens, 3 new, one timed run.
SMALL = dict(train_steps=0, batch_size=2, prompt_len=4, new_tokens=3, repeats=1)


class GenerateTest(absltest.TestCase):

  def test_prints_bytes_and_speed(self):
    result = bench_serving.generate(
        "tiny_mixtral", {}, quantization="int8", **SMALL
    )
    text = bench_serving.format_report(result)
    self.assertIn("decode tok/s", text)
    rows = {line.split()[0]: line.split() for line in text.splitlines()[2:4]}
    self.assertEqual(set(rows), {"float", "int8"})
    # [E, M, H] x 3 kernels x 2 layers: 4 bytes float, 1 byte + scales int8.
    self.assertEqual(rows["float"][1], f"{8 * 64 * 128 * 3 * 2 * 4:,}")
    self.assertLess(float(rows["int8"][2]), 0.3)

  def test_needs_a_mode_that_stores_weights(self):
    with self.assertRaisesRegex(ValueError, "quantization"):
      bench_serving.generate("tiny_mixtral", {}, quantization="none", **SMALL)


if __name__ == "__main__":
  absltest.main()
