"""The README's Python examples run as written."""

import os
import re

from absl.testing import absltest

_README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def _python_blocks() -> list[str]:
  with open(_README, encoding="utf-8") as f:
    return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


class ReadmeTest(absltest.TestCase):

  def test_has_examples(self):
    self.assertGreaterEqual(len(_python_blocks()), 2)

  def test_examples_run(self):
    for i, block in enumerate(_python_blocks()):
      with self.subTest(block=i):
        exec(compile(block, f"README.md[python block {i}]", "exec"), {})  # noqa: S102


if __name__ == "__main__":
  absltest.main()
