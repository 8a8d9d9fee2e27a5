"""`training.frontend(name)`: the one registry of training front ends, where
the library's Linen one is and the NNX adapter registers its own (issue 64,
item 4)."""

import subprocess
import sys

from absl.testing import absltest

from linen_moe import training
from linen_moe._src.training import registry
import nnx_adapter


class RegistryTest(absltest.TestCase):

  def test_the_two_front_ends(self):
    self.assertEqual(tuple(training.FRONTENDS), ("linen", "nnx"))
    self.assertIs(training.frontend("linen"), training.LinenFrontend)
    self.assertIs(training.frontend("nnx"), nnx_adapter.NNXFrontend)
    self.assertIs(nnx_adapter.frontend("nnx"), nnx_adapter.NNXFrontend)
    with self.assertRaisesRegex(ValueError, r"'haiku'; allowed: \('linen'"):
      training.frontend("haiku")

  def test_a_front_end_registers_itself(self):
    marker = object()
    training.register_frontend("mine", lambda: marker, "my decoder")
    self.addCleanup(registry._LOADERS.pop, "mine")  # noqa: SLF001
    self.addCleanup(registry._DESCRIPTIONS.pop, "mine")  # noqa: SLF001
    self.assertIs(training.frontend("mine"), marker)
    self.assertEqual(training.FRONTENDS["mine"], "my decoder")
    with self.assertRaisesRegex(TypeError, "name=''"):
      training.register_frontend("", lambda: marker, "x")
    with self.assertRaisesRegex(TypeError, "load=3"):
      training.register_frontend("x", 3, "x")

  def test_nnx_registers_on_import_without_jax(self):
    script = (
        "import sys\n"
        "from linen_moe import training\n"
        "names = tuple(training.FRONTENDS)\n"
        "import nnx_adapter\n"
        "print(names, tuple(training.FRONTENDS), 'jax' in sys.modules)\n"
    )
    out = subprocess.check_output(
        [sys.executable, "-c", script], text=True, timeout=120
    )
    self.assertEqual(out.strip(), "('linen',) ('linen', 'nnx') False")


if __name__ == "__main__":
  absltest.main()
