"""Hugging Face checkpoint files: round trips, serving on load, bad input.

Loading and saving compile nothing (but the fresh fp8 state of an fp8
mode); the serving cases compile one forward each.
"""

import copy
import importlib.resources
import json
import pathlib
import shutil

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
from safetensors.numpy import load_file
from safetensors.numpy import save_file

from linen_moe import Decoder
from linen_moe import hf
from linen_moe import load_model_config
from linen_moe import quantization
from linen_moe import testing
from linen_moe._src.hf.safetensors_io import Checkpoint
from linen_moe._src.testing import helpers
import nnx_adapter
from tests import workers
from tests.hf_helpers import forbid_data_reads

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"
# The released models' config.json files (configs/hf/ in the repository),
# read from the installed package as CI's copy of tests/ must.
CONFIGS = importlib.resources.files("linen_moe.configs") / "hf"
SERVING_REL = {"int8": 0.04, "fp8": 0.12}  # as tests/hf/test_hf.py


def _equal_trees(test, a, b):
  test.assertEqual(jax.tree.structure(a), jax.tree.structure(b))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    test.assertEqual(x.dtype, y.dtype)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class RoundTripTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.out = pathlib.Path(helpers.tempdir(self)) / "out"

  @parameterized.parameters(
      # (fixture, scanned, shard size): a (dense, MoE) group, sharded; the
      # fused experts written back per expert; unrolled and tied.
      ("qwen3_moe_step2_nonorm_tied", True, 50_000),
      ("mixtral_gqa_swa_fused", False, "2GB"),
      ("mixtral_tied_sharded", False, "60KB"),
  )
  def test_load_save_load_is_bit_identical(self, name, scan, shard):
    config, variables = hf.load_checkpoint(FIXTURES / name, scan_layers=scan)
    files = hf.save_checkpoint(
        config, variables, self.out, max_shard_size=shard
    )
    self.assertEqual(
        (self.out / "model.safetensors.index.json").exists(), len(files) > 1
    )
    again_config, again = hf.load_checkpoint(self.out, scan_layers=scan)
    self.assertEqual(again_config, config)
    _equal_trees(self, again, variables)

  def test_saved_tensors_are_the_hub_names_of_the_fixture(self):
    # The fused fixture's weights, written per expert, are byte for byte
    # the per-expert fixture (the same model, saved by transformers).
    config, variables = hf.load_checkpoint(FIXTURES / "mixtral_gqa_swa_fused")
    hf.save_checkpoint(config, variables, self.out)
    saved = load_file(self.out / "model.safetensors")
    hub = load_file(FIXTURES / "mixtral_gqa_swa" / "model.safetensors")
    self.assertEqual(sorted(saved), sorted(hub))
    for name, value in hub.items():
      np.testing.assert_array_equal(saved[name], value, err_msg=name)
    written = json.loads((self.out / "config.json").read_text())
    original = json.loads(
        (FIXTURES / "mixtral_gqa_swa" / "config.json").read_text()
    )
    self.assertEqual(hf.model_config(written), hf.model_config(original))

  def test_nnx_variables_and_other_layouts_save_the_same(self):
    name = "qwen3_moe_dense0_norm"
    config, variables = hf.load_checkpoint(FIXTURES / name)
    model = nnx_adapter.Decoder.from_linen(config, variables)
    hf.save_checkpoint(config, nnx_adapter.nnx_to_linen(model), self.out)
    unrolled_config, unrolled = hf.load_checkpoint(
        FIXTURES / name, scan_layers=False
    )
    other = self.out.parent / "unrolled"
    hf.save_checkpoint(unrolled_config, unrolled, other, dtype="float32")
    a, b = load_file(self.out / "model.safetensors"), load_file(
        other / "model.safetensors"
    )
    self.assertEqual(sorted(a), sorted(b))
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])

  def test_bfloat16_on_disk(self):
    config, variables = hf.load_checkpoint(FIXTURES / "mixtral_tied_sharded")
    hf.save_checkpoint(config, variables, self.out, dtype="bfloat16")
    ckpt = Checkpoint(self.out)
    self.assertEqual({t.dtype for t in ckpt.tensors.values()}, {"BF16"})
    self.assertEqual(
        json.loads((self.out / "config.json").read_text())["dtype"], "bfloat16"
    )
    back_config, back = hf.load_checkpoint(self.out, dtype="float32")
    self.assertEqual(back_config.moe.param_dtype, "float32")
    wi_0 = variables["params"]["layers"]["moe"]["wi_0"]
    np.testing.assert_array_equal(
        back["params"]["layers"]["moe"]["wi_0"],
        np.asarray(wi_0).astype("bfloat16").astype("float32"),
    )


class ServingOnLoadTest(parameterized.TestCase):

  # One mode and layout each here, the other in the slow set;
  # test_hf_families's default case has the other.
  def test_stored_kernels_straight_from_the_checkpoint(self):
    self.check("qwen3_moe_step2_nonorm_tied", True, "int8")

  @testing.slow
  def test_stored_kernels_straight_from_the_checkpoint_slow(self):
    self.check("mixtral_tied_sharded", False, "fp8")

  def check(self, name, scan, mode):
    d = FIXTURES / name
    config, variables = hf.load_checkpoint(
        d, scan_layers=scan, quantization=mode, serving=True
    )
    self.assertTrue(config.moe.serving)
    float_config, floats = hf.load_checkpoint(
        d, scan_layers=scan, quantization=mode
    )
    # What quantize_weights makes of the float weights without fp8 state.
    want_config, want = quantization.quantize_weights(
        float_config, {"params": floats["params"]}
    )
    self.assertEqual(config, want_config)
    _equal_trees(self, variables, want)
    storage = {"int8": "int8", "fp8": "float8_e4m3fn"}[mode]
    for leaf_path, leaf in jax.tree_util.tree_leaves_with_path(variables):
      if str(leaf_path[-1].key) in ("wi_0", "wi_1", "wo"):
        self.assertEqual(leaf.dtype, storage, leaf_path)
    ids = np.load(d / "input_ids.npy")
    expected = np.load(d / "logits.npy")
    logits, _ = jax.jit(Decoder(config).apply)(variables, ids)
    rel = np.linalg.norm(logits - expected) / np.linalg.norm(expected)
    self.assertLess(rel, SERVING_REL[mode])


class MeshTest(absltest.TestCase):

  def test_each_device_reads_its_rows_into_its_sharding(self):
    # 8 simulated devices: embed over fsdp=2, experts over expert=2, heads
    # and the expert width over tensor=2.
    got = workers.run_json(
        "tests.hf_mesh_worker",
        "qwen3_moe_dense0_norm",
        "fsdp=2,expert=2,tensor=2",
    )
    self.assertTrue(got["placed"])  # every leaf in its logical sharding
    self.assertTrue(got["equal"])  # and equal to the one-device load
    self.assertGreater(got["sharded_leaves"], 10)
    # A device reads the rows of W [out, in] it owns, whole: at most the
    # in-axis split (fsdp=2) times its shard; nothing like every device
    # reading every tensor.
    self.assertLessEqual(got["read_bytes"], 2 * got["shard_bytes"])
    self.assertLess(got["read_bytes"], got["devices"] * got["model_bytes"] / 2)
    # int8 serving weights quantized as read, placed and equal likewise.
    self.assertTrue(got["served_placed"])
    self.assertTrue(got["served_equal"])


def _copy(name: str, tmp: str) -> pathlib.Path:
  out = pathlib.Path(tmp) / name
  shutil.copytree(FIXTURES / name, out)
  return out


def _edit_tensors(path: pathlib.Path, edit) -> None:
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(d: pathlib.Path, edit) -> None:
  hf_config = json.loads((d / "config.json").read_text())
  edit(hf_config)
  (d / "config.json").write_text(json.dumps(hf_config))


class BadInputTest(absltest.TestCase):
  """Each error names the file, the tensor or the field, before any tensor
  data is read."""

  def setUp(self):
    super().setUp()
    self.tmp = helpers.tempdir(self)
    forbid_data_reads(self)

  def assert_fails(self, d, pattern, **kwargs):
    with self.assertRaisesRegex(ValueError, pattern):
      hf.load_checkpoint(d, **kwargs)

  def test_config_fields(self):
    d = _copy("mixtral_gqa_swa", self.tmp)
    cases = [
        (
            {"model_type": "llama"},
            r"model_type='llama' is not supported; supported model types are"
            r" \['deepseek_v3', 'gemma4', 'gemma4_text', .*'mixtral',"
            r" 'qwen3_moe'\]",
        ),
        (
            {
                "rope_parameters": None,
                "rope_scaling": {"type": "linear", "factor": 2.0},
            },
            r"rope_scaling.rope_type='linear' is not supported: only 'default'",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "factor": 2,
                }
            },
            r"rope_parameters=.* its keys \['factor'\] change the rotary",
        ),
        ({"sliding_attention_everywhere": True}, r"field\(s\) \['sliding_at"),
        (
            {"router_jitter_noise": 0.1},
            r"router_jitter_noise=0.1 is not supported",
        ),
        ({"hidden_act": "tanh"}, r"hidden_act='tanh' is not supported"),
        (
            {"num_key_value_heads": 3},
            (
                r"config.json describes no valid model: .*num_kv_heads=3 is"
                r" invalid"
            ),
        ),
    ]
    original = json.loads((d / "config.json").read_text())
    for change, pattern in cases:
      with self.subTest(change=change):
        (d / "config.json").write_text(json.dumps({**original, **change}))
        self.assert_fails(d, pattern)
    qwen = _copy("qwen3_moe_dense0_norm", self.tmp)
    _edit_config(qwen, lambda c: c.update(attention_bias=True))
    self.assert_fails(qwen, r"attention_bias=True is not supported")

  def test_tensors(self):
    d = _copy("mixtral_gqa_swa", self.tmp)
    st = d / "model.safetensors"
    pristine = st.read_bytes()
    q = "model.layers.1.self_attn.q_proj.weight"
    cases = [
        (lambda t: t.pop(q), rf"missing the tensor\(s\) \['{q}'\]"),
        (
            lambda t: t.update(extra=np.zeros(3, np.float32)),
            rf"{st} holds the tensor 'extra'",
        ),
        (
            lambda t: t.update({q: t[q][:-1]}),
            rf"{st}: tensor '{q}' has shape \[47, 32\]; .* needs \[48, 32\]",
        ),
        (
            lambda t: t.update({q: t[q].astype(np.int32)}),
            rf"{st}: tensor '{q}' is I32; expected a float",
        ),
    ]
    for edit, pattern in cases:
      with self.subTest(pattern=pattern):
        st.write_bytes(pristine)
        _edit_tensors(st, edit)
        self.assert_fails(d, pattern)
    st.write_bytes(pristine[:-100])
    self.assert_fails(d, rf"{st} is not a readable safetensors file \(trunc")

  def test_index_and_files(self):
    d = _copy("mixtral_tied_sharded", self.tmp)
    shard = "model-00002-of-00003.safetensors"
    (d / shard).unlink()
    self.assert_fails(d, rf"index.json names the shard '{shard}', which is not")
    (d / "model.safetensors.index.json").unlink()
    self.assert_fails(d, r"holds neither model.safetensors nor model.safet")
    (d / "config.json").unlink()
    self.assert_fails(d, r"has no config.json")
    self.assert_fails(d / "nowhere", r"^path='.*nowhere' does not exist \(rel")
    self.assert_fails(
        d / "model-00001-of-00003.safetensors",
        r"is a file, not a checkpoint directory",
    )

  def test_arguments(self):
    d = FIXTURES / "mixtral_gqa_swa"
    self.assert_fails(
        d, r"serving=True is invalid: .*quantization='none'", serving=True
    )
    self.assert_fails(d, r"dtype='fp64' is invalid", dtype="fp64")
    self.assert_fails(d, r"quantization='int4' is invalid", quantization="int4")

  def test_model_config_reads_both_styles(self):
    new = json.loads((FIXTURES / "mixtral_gqa_swa" / "config.json").read_text())
    old = copy.deepcopy(new)
    del old["rope_parameters"], old["dtype"]
    old |= {
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "torch_dtype": "float32",
    }
    self.assertEqual(hf.model_config(old), hf.model_config(new))
    released = {
        d.name: json.loads((d / "config.json").read_text())
        for d in CONFIGS.iterdir()
        if (d / "config.json").is_file()
    }
    mixtral = hf.model_config(released["mixtral_8x7b"])
    self.assertEqual(
        (
            mixtral.moe.emb_dim,
            mixtral.num_layers,
            mixtral.resolved_kv_heads,
            mixtral.rope_max_wavelength,
            mixtral.moe.param_dtype,
        ),
        (4096, 32, 8, 1e6, "bfloat16"),
    )
    qwen = hf.model_config(released["qwen3_30b_a3b"])
    self.assertEqual(
        (qwen.moe.num_experts, qwen.head_dim, qwen.dense_layers, qwen.qk_norm),
        (128, 128, (), True),
    )
    with self.assertRaisesRegex(TypeError, "config.json must be a mapping"):
      hf.model_config("mixtral")


class SaveErrorsTest(absltest.TestCase):

  def test_rejects(self):
    out = pathlib.Path(helpers.tempdir(self)) / "out"
    config, variables = hf.load_checkpoint(FIXTURES / "mixtral_gqa_swa")
    own = load_model_config("tiny_mixtral", scale_embeddings=True)
    with self.assertRaisesRegex(
        ValueError,
        r"the nearest family, mixtral, needs scale_embeddings=False \(this "
        r"config: True\)\. The shipped configs that export as mixtral: "
        r"tiny_mixtral, mixtral_8x7b\.$",
    ):
      hf.save_checkpoint(own, variables, out)
    with self.assertRaisesRegex(ValueError, "variables are not the parameters"):
      hf.save_checkpoint(config.replace(num_layers=3), variables, out)
    with self.assertRaisesRegex(ValueError, "serving config"):
      hf.save_checkpoint(
          config.replace(quantization="int8", serving=True), variables, out
      )
    with self.assertRaisesRegex(
        TypeError, r"variables must be Linen variables"
    ):
      hf.save_checkpoint(config, [1, 2], out)
    with self.assertRaisesRegex(ValueError, r"max_shard_size='2 bananas'"):
      hf.save_checkpoint(config, variables, out, max_shard_size="2 bananas")
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with self.assertRaisesRegex(ValueError, "exists and is not an empty"):
      hf.save_checkpoint(config, variables, out)
    self.assertEqual((out / "keep.txt").read_text(), "mine")
    self.assertEqual(list(out.parent.iterdir()), [out])  # no staging left


if __name__ == "__main__":
  absltest.main()
