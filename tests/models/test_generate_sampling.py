"""One `Sampling` for every generation call (issue 64, item 4): the old
loose keywords still build it, with a warning; both forms at once, or
another object, are a TypeError."""

import warnings

from absl.testing import absltest

from linen_moe import decoding
from linen_moe import load_model_config
from linen_moe._src.models import generation

CONFIG = load_model_config("tiny_mixtral")
# A cache in the variables is refused after every argument is checked.
REACHED = "must not hold a cache"


def _generate(**kwargs):
  return decoding.generate(
      CONFIG, {"cache": {}}, [[1, 2]], max_new_tokens=1, **kwargs
  )


class SamplingTest(absltest.TestCase):

  def test_the_old_keywords_warn_and_make_the_same_sampling(self):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      got = generation.sampling_of(
          None, dict(temperature=0.7, top_k=None, top_p=0.9, min_p=None), "f"
      )
    self.assertEqual(got, decoding.Sampling(temperature=0.7, top_p=0.9))
    self.assertIn("f(temperature, top_p=...)", str(caught[0].message))
    self.assertIs(caught[0].category, DeprecationWarning)
    with self.assertWarns(DeprecationWarning):
      with self.assertRaisesRegex(ValueError, REACHED):
        _generate(temperature=0.5)

  def test_one_form_at_a_time(self):
    with self.assertRaisesRegex(TypeError, "without temperature"):
      _generate(sampling=decoding.Sampling(), temperature=0.5)
    with self.assertRaisesRegex(TypeError, "expected a .*Sampling"):
      _generate(sampling={"temperature": 0.5})
    with self.assertRaisesRegex(ValueError, REACHED):
      _generate(sampling=decoding.Sampling(temperature=0.5, top_k=3))
    with self.assertRaisesRegex(TypeError, "expected a .*Sampling"):
      next(
          decoding.generate_stream(
              CONFIG, {}, [1], max_new_tokens=1, sampling=0.5
          )
      )


if __name__ == "__main__":
  absltest.main()
