"""The released models at their real sizes, by shape only (`jax.eval_shape`,
nothing allocated or compiled): the decoder of `hf.model_config` of each
released config.json has exactly the parameters, tensor shapes and saved
buffers that transformers' model of that config has (its numbers, built on
the meta device: tests/fixtures/hf/param_counts.json), and the shipped
YAML configs of these models are those configs.
"""

import importlib.resources
import json
import math
import re

from absl.testing import absltest
from absl.testing import parameterized
import jax

from linen_moe import decoding
from linen_moe import hf
from linen_moe import load_model_config
from linen_moe._src import sharding
from linen_moe._src.hf import config_map
from linen_moe._src.hf import load
from linen_moe._src.hf import tensor_names as tn
from linen_moe._src.models import mla
from tests.hf_helpers import FIXTURES

# The released models' config.json files, read from the installed package
# (configs/hf/ in the repository) as CI's copy of tests/ must.
CONFIGS = importlib.resources.files("linen_moe.configs") / "hf"
COUNTS = json.loads((FIXTURES / "param_counts.json").read_text())["models"]
# The parameter counts transformers gives (stated in docs/guides/families.md).
TOTALS = {
    "mixtral_8x7b": 46_702_792_704,
    "qwen3_30b_a3b": 30_532_122_624,
    "deepseek_v3": 671_026_404_352,
    "gemma4_26b_a4b": 25_233_141_760,  # the text decoder
}


def _released(name: str) -> dict:
  return json.loads((CONFIGS / name / "config.json").read_text())


def _on_disk(names_to_shapes: dict) -> dict:
  """Per-expert names collapsed as param_counts.json lists them."""
  out = {}
  for name, shape in names_to_shapes.items():
    collapsed = re.sub(r"\.experts\.\d+\.", ".experts.*.", name)
    if collapsed == name:
      out[name] = list(shape)
      continue
    entry = out.setdefault(collapsed, {"shape": list(shape), "count": 0})
    entry["count"] += 1
  return out


def _count(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


class RealSizesTest(parameterized.TestCase):

  @parameterized.parameters(*TOTALS)
  def test_parameters_shapes_and_buffers_equal_transformers(self, name):
    raw = _released(name)
    config = hf.model_config(raw)
    family = config_map.family_of(raw)
    abstract = load.abstract_variables(config)
    params = sharding.unbox(abstract["params"])
    state = sharding.unbox(abstract.get("updated_by_rule", {}))
    want = COUNTS[name].get("text_only", COUNTS[name])
    self.assertEqual(_count(params), want["total_params"])
    self.assertEqual(_count(params), TOTALS[name])
    self.assertEqual(_count(state), want["buffer_elements"])
    # Every tensor on disk, named through the tensor-name mapping.
    plan = config.stack_plan
    shapes = load._unrolled_shapes(abstract["params"], plan)
    shapes |= load._unrolled_shapes(abstract.get("updated_by_rule", {}), plan)
    srcs = tn.sources(family, config) | tn.state_sources(family, config)
    disk = {}
    for path, source in srcs.items():
      disk |= tn.expected_shapes(source, tuple(shapes[path].shape))
    expected = {
        n: s
        for n, s in COUNTS[name]["tensors_on_disk"].items()
        if not n.startswith(family.skipped_prefixes or ("\0",))
    }
    self.assertEqual(_on_disk(disk), expected)
    buffers = {
        n
        for n in COUNTS[name]["persistent_buffers"]
        if not n.startswith(family.skipped_prefixes or ("\0",))
    }
    state_names = {s.name for s in tn.state_sources(family, config).values()}
    self.assertEqual(state_names, buffers)

  def test_mla_cache_per_token(self):
    config = hf.model_config(_released("deepseek_v3"))
    self.assertEqual(
        mla.cache_values_per_token(config),
        {"latent": 512 + 64, "expanded": 128 * (128 + 64 + 128)},
    )
    cache = jax.eval_shape(lambda: decoding.init_cache(config, 1, 16))
    per_token = _count(cache) / 16  # `index` rounds away
    self.assertEqual(int(per_token), 61 * 576)


# shipped config -> the config.json it is `hf.model_config` of (as
# scripts/make_hf_configs.py writes them; its --check compares the text).
DERIVED = {
    "mixtral_8x7b": CONFIGS / "mixtral_8x7b" / "config.json",
    "qwen3_30b_a3b": CONFIGS / "qwen3_30b_a3b" / "config.json",
    "deepseek_v3_671b": CONFIGS / "deepseek_v3" / "config.json",
    "gemma4_26b": CONFIGS / "gemma4_26b_a4b" / "config.json",
    "tiny_deepseek_v3_mla": (
        FIXTURES / "deepseek_v3_qlora_yarn_groups" / "config.json"
    ),
    "tiny_gemma4_text": FIXTURES / "gemma4_text_moe_keqv" / "config.json",
}


class DerivedConfigsTest(parameterized.TestCase):

  @parameterized.parameters(*DERIVED)
  def test_shipped_config_is_the_config_json(self, name):
    hf_config = json.loads(DERIVED[name].read_text())
    self.assertEqual(load_model_config(name), hf.model_config(hf_config))


if __name__ == "__main__":
  absltest.main()
