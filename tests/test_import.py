"""`import linen_moe` is cheap, and every public name still loads."""

import subprocess
import sys

from absl.testing import absltest

import linen_moe


class ImportTest(absltest.TestCase):

  def test_import_loads_no_jax_until_a_name_is_used(self):
    script = (
        "import sys\n"
        "import linen_moe, linen_moe.testing\n"
        "from linen_moe._src.config import files, moe_config\n"
        "assert moe_config.MODES and files.available_configs()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in"
        " ('jax', 'flax', 'optax', 'aqt', 'orbax')))\n"
        "linen_moe.Decoder\n"
        "print('jax' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertEqual(done.stdout.split("\n")[:2], ["[]", "True"])

  def test_every_public_name_loads(self):
    for name in linen_moe.__all__:
      self.assertIsNotNone(getattr(linen_moe, name), name)
    self.assertContainsSubset(linen_moe.__all__, dir(linen_moe))
    with self.assertRaisesRegex(AttributeError, "no attribute 'nothing'"):
      linen_moe.nothing  # noqa: B018


if __name__ == "__main__":
  absltest.main()
