"""The released models at their real sizes, by shape only (`jax.eval_shape`,
nothing allocated or compiled): the decoder of `hf.model_config` of each
released config.json has exactly the parameters, tensor shapes and saved
buffers that transformers' model of that config has (its numbers, built on
the meta device: tests/fixtures/hf/param_counts.json), and the shipped
YAML configs of these models are those configs.
"""

import functools
import importlib.resources
import json
import math
import pathlib
import re

from absl.testing import absltest
from absl.testing import parameterized
import jax

from linen_moe import decoding
from linen_moe import hf
from linen_moe import load_model_config
from linen_moe import sharding
from linen_moe._src.hf import config_map
from linen_moe._src.hf import load
from linen_moe._src.hf import tensor_names as tn
from linen_moe._src.models import mla
from tests.hf_helpers import FIXTURES

# The released models' config.json files, read from the installed package
# (configs/hf/ in the repository) as CI's copy of tests/ must.
CONFIGS = importlib.resources.files("linen_moe.configs") / "hf"
# CI copies docs/ beside tests/.
FAMILIES_PAGE = (
    pathlib.Path(__file__).parents[2] / "docs" / "guides" / "families.md"
)
COUNTS = json.loads((FIXTURES / "param_counts.json").read_text())["models"]
# The parameter counts transformers gives (stated in docs/guides/families.md).
TOTALS = {
    "mixtral_8x7b": 46_702_792_704,
    "qwen3_30b_a3b": 30_532_122_624,
    "deepseek_v3": 671_026_404_352,
    "gemma4_26b_a4b": 25_233_141_760,  # the text decoder
    "gpt_oss_120b": 116_829_156_672,
    "gpt_oss_20b": 20_914_757_184,
    "glm4_5": 352_797_814_784,  # no MTP layer (transformers builds none)
    "glm4_5_air": 106_852_245_504,
    "minimax_m2": 228_689_748_992,
    "llama4_scout": 107_769_861_120,  # the text decoder
    "llama4_maverick": 400_711_848_960,  # the text decoder
}
# The models whose active parameters (per token: every parameter less
# (E - k) / E of the routed experts') are checked against transformers'.
ACTIVE = (
    "gpt_oss_120b",
    "gpt_oss_20b",
    "glm4_5",
    "glm4_5_air",
    "minimax_m2",
    "llama4_scout",
    "llama4_maverick",
)


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


def _routed(path, params) -> bool:
  """Whether the leaf at `path` is a routed expert's (a kernel or bias with
  a leading expert axis, beside the router `gate` in its module)."""
  keys = [str(getattr(p, "key", p)) for p in path]
  node = params
  for key in keys[:-1]:
    node = node[key]
  return "gate" in node and keys[-1].startswith(("wi_0", "wi_1", "wo"))


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
    # The saved buffers, under their names on disk (MiniMax-M2's in-memory
    # `mlp.e_score_correction_bias` is `block_sparse_moe.` on disk).
    state_names = {s.name for s in tn.state_sources(family, config).values()}
    self.assertEqual(len(state_names), len(buffers))
    self.assertLessEqual(state_names, set(COUNTS[name]["tensors_on_disk"]))

  @parameterized.parameters(*ACTIVE)
  def test_active_parameters_equal_transformers(self, name):
    config = hf.model_config(_released(name))
    params = sharding.unbox(load.abstract_variables(config)["params"])
    e, k = config.moe.num_experts, config.moe.num_experts_per_tok
    routed = sum(
        math.prod(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if _routed(path, params)
    )
    active = _count(params) - routed * (e - k) // e
    want = COUNTS[name].get("text_only", COUNTS[name])["active_params"]
    self.assertEqual(active, want)

  def test_mla_cache_per_token(self):
    # The decoder's cache of the same model holds 61 x 576 values a token:
    # checked in `DocsFiguresTest.test_kv_cache_figures`, which traces it
    # anyway (seconds of tracing 61 layers, once per test process).
    config = hf.model_config(_released("deepseek_v3"))
    self.assertEqual(
        mla.cache_values_per_token(config),
        {"latent": 512 + 64, "expanded": 128 * (128 + 64 + 128)},
    )


# The cache length of the shapes below (no window of these models is
# shorter, so every slot of every layer is a token's).
CACHE_LEN = 16


@functools.cache
def _abstract_cache(name: str):
  """The shapes of `decoding.init_cache` of a released model, one row of
  `CACHE_LEN` tokens (tracing the unrolled decoder: shared by the tests)."""
  config = hf.model_config(_released(name))
  return jax.eval_shape(lambda: decoding.init_cache(config, 1, CACHE_LEN))


def _kv_leaves(cache) -> list:
  """The cached keys and values (or latents) of a cache, without each
  slot's stored position and the decoder's `index` and `pad`."""
  return [
      x
      for path, x in jax.tree_util.tree_leaves_with_path(cache)
      if getattr(path[-1], "key", "").startswith("cached_")
      and getattr(path[-1], "key", "") != "cached_position"
  ]


def _kv_values(cache) -> int:
  return sum(math.prod(x.shape) for x in _kv_leaves(cache))


# The row of each model in the page's parameter-count table.
DOC_ROWS = {
    "mixtral_8x7b": "Mixtral-8x7B",
    "qwen3_30b_a3b": "Qwen3-30B-A3B",
    "deepseek_v3": "DeepSeek-V3 (no MTP)",
    "gemma4_26b_a4b": "Gemma-4-26B-A4B (text)",
    "gpt_oss_120b": "gpt-oss-120b",
    "gpt_oss_20b": "gpt-oss-20b",
    "glm4_5": "GLM-4.5 (no MTP)",
    "glm4_5_air": "GLM-4.5-Air (no MTP)",
    "minimax_m2": "MiniMax-M2",
    "llama4_scout": "Llama-4-Scout (text)",
    "llama4_maverick": "Llama-4-Maverick (text)",
}


def _table_rows(page: str) -> dict[str, list[str]]:
  """Markdown table rows of `page`: first cell -> the cells."""
  rows = {}
  for line in page.splitlines():
    if line.startswith("| "):
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      rows[cells[0]] = cells
  return rows


def _cache_bytes_per_token(name: str) -> int:
  """Bytes one token adds to the KV cache of every layer of a released
  model (measured on `decoding.init_cache`'s shapes, in its dtype)."""
  total = sum(  # the keys and values; below every window, all slots
      math.prod(x.shape) * x.dtype.itemsize
      for x in _kv_leaves(_abstract_cache(name))
  )
  assert total % CACHE_LEN == 0
  return total // CACHE_LEN


class DocsFiguresTest(absltest.TestCase):
  """The figures docs/guides/families.md states are the decoder's and
  transformers'."""

  def test_parameter_count_table(self):
    rows = _table_rows(FAMILIES_PAGE.read_text(encoding="utf-8"))
    for name, label in DOC_ROWS.items():
      with self.subTest(name=name):
        abstract = load.abstract_variables(hf.model_config(_released(name)))
        ours = _count(sharding.unbox(abstract["params"]))
        buffers = _count(sharding.unbox(abstract.get("updated_by_rule", {})))
        theirs = COUNTS[name].get("text_only", COUNTS[name])["total_params"]
        cells = rows[label]
        self.assertEqual(cells[1], f"{ours:,}")
        self.assertEqual(cells[2], f"{theirs:,}")
        self.assertEqual(cells[3].split()[0], f"{buffers:,}")

  def test_kv_cache_figures(self):
    page = FAMILIES_PAGE.read_text(encoding="utf-8")
    rows = _table_rows(page)
    deepseek = hf.model_config(_released("deepseek_v3"))
    with self.subTest("mla_cache_per_token"):  # RealSizesTest's formula
      cache = _abstract_cache("deepseek_v3")
      self.assertEqual(_kv_values(cache) // CACHE_LEN, 61 * 576)
    per_layer = mla.cache_values_per_token(deepseek)
    kept = _cache_bytes_per_token("deepseek_v3")
    self.assertEqual(kept, deepseek.num_layers * per_layer["latent"] * 2)
    latent = rows["latent + rotary key (what is kept)"]
    self.assertTrue(latent[1].endswith(f"= {per_layer['latent']:,}"))
    self.assertTrue(latent[2].startswith(f"{kept:,} "), latent[2])
    expanded = rows["expanded keys and values"]
    self.assertTrue(expanded[1].endswith(f"= {per_layer['expanded']:,}"))
    expanded_bytes = deepseek.num_layers * per_layer["expanded"] * 2  # bf16
    self.assertTrue(expanded[2].startswith(f"{expanded_bytes:,} "))
    flat = " ".join(page.split())
    self.assertIn(f"{round(expanded_bytes / kept)} times less", flat)
    gemma_bytes = _cache_bytes_per_token("gemma4_26b_a4b")
    self.assertIn(
        f"= {gemma_bytes // 2:,} values a token ({gemma_bytes:,} bf16 bytes)",
        flat,
    )


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
    "gpt_oss_120b": CONFIGS / "gpt_oss_120b" / "config.json",
    "gpt_oss_20b": CONFIGS / "gpt_oss_20b" / "config.json",
    "tiny_gpt_oss": FIXTURES / "gpt_oss_sinks_swa_yarn" / "config.json",
    "glm4_5": CONFIGS / "glm4_5" / "config.json",
    "glm4_5_air": CONFIGS / "glm4_5_air" / "config.json",
    "tiny_glm4_moe": (
        FIXTURES / "glm4_moe_partial_qknorm_groups" / "config.json"
    ),
    "minimax_m2": CONFIGS / "minimax_m2" / "config.json",
    "tiny_minimax_m2": FIXTURES / "minimax_m2_partial_qknorm" / "config.json",
    "llama4_scout": CONFIGS / "llama4_scout" / "config.json",
    "llama4_maverick": CONFIGS / "llama4_maverick" / "config.json",
    "tiny_llama4": FIXTURES / "llama4_text_nope_chunked" / "config.json",
}


class DerivedConfigsTest(parameterized.TestCase):

  @parameterized.parameters(*DERIVED)
  def test_shipped_config_is_the_config_json(self, name):
    hf_config = json.loads(DERIVED[name].read_text())
    self.assertEqual(load_model_config(name), hf.model_config(hf_config))


if __name__ == "__main__":
  absltest.main()
