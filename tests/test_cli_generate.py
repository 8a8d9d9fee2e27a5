"""`linen-moe generate`: trains (here: no steps), converts, decodes, and
prints each mode's expert-weight bytes and decode speed. Decoding itself:
test_decoding.py."""

from absl.testing import absltest

from linen_moe import testing
from linen_moe_cli.main import main


class GenerateCommandTest(absltest.TestCase):

  def test_generate_prints_bytes_and_speed(self):
    code, text, _ = testing.run_capturing(
        main,
        [
            "generate",
            "--train-steps=0",
            "--batch-size=2",
            "--prompt-len=4",
            "--new-tokens=3",
            "--repeats=1",
        ],
    )
    self.assertEqual(code, 0)
    self.assertIn("decode tok/s", text)
    rows = {line.split()[0]: line.split() for line in text.splitlines()[2:4]}
    self.assertEqual(set(rows), {"float", "int8"})
    # [E, M, H] x 3 kernels x 2 layers: 4 bytes float, 1 byte + scales int8.
    self.assertEqual(rows["float"][1], f"{8 * 64 * 128 * 3 * 2 * 4:,}")
    self.assertLess(float(rows["int8"][2]), 0.3)

  def test_generate_needs_a_quantized_mode(self):
    code, _, err = testing.run_capturing(
        main, ["generate", "--quantization=none", "--train-steps=0"]
    )
    self.assertEqual(code, 2)
    self.assertIn("quantization", err)


if __name__ == "__main__":
  absltest.main()
