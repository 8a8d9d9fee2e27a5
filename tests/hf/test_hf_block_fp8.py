"""Block-fp8 Hugging Face checkpoints (the DeepSeek-V3 / Qwen3-FP8 layout):
loaded dequantized or as fp8 serving weights, saved back, bad files.

The fixtures (written by scripts/make_fp8_fixtures.py): DeepSeek-V3 in
blocks of [128, 128], every tensor smaller than a block, with a
multi-token-prediction layer; Qwen3-MoE in blocks of [16, 16] on dims that
are no multiple of 16 (partial blocks at the edges). Their logits.npy are
transformers' of the dequantized model. The reference for the weights is
a NumPy dequantization written here from the format: the tensors parsed
from the safetensors bytes, each block times its scale in a loop.

Each fixture is loaded once (float32) and shared; the default run compiles
two forwards and one fp8 serving forward (about 22 s on 2 cores).
"""

import functools
import json
import logging
import pathlib
import shutil
import struct

from absl.testing import absltest
from absl.testing import parameterized
import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from linen_moe import MATMUL_PATHS
from linen_moe import hf
from linen_moe import quantization
from linen_moe import testing
from linen_moe._src.hf import block_fp8
from linen_moe._src.hf.safetensors_io import Checkpoint
from linen_moe._src.testing import helpers
from tests import workers
from tests.hf_helpers import ATOL
from tests.hf_helpers import equal_trees
from tests.hf_helpers import fixture as _fixture
from tests.hf_helpers import forbid_data_reads
from tests.hf_helpers import logits as _logits

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"
DEEPSEEK = "deepseek_v3_fp8_block128"
QWEN = "qwen3_moe_fp8_block16"
BLOCKS = {DEEPSEEK: (128, 128), QWEN: (16, 16)}
SCALE = "_scale_inv"
SERVING_REL = 0.12  # fp8 serving weights: the bound of tests/hf/test_hf.py
_DTYPES = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F32": np.dtype(np.float32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}


def _raw(path: pathlib.Path) -> dict[str, np.ndarray]:
  """Every tensor of a safetensors file, parsed from the format: 8 bytes of
  header length, the JSON header, the data (safetensors' NumPy front end
  reads no fp8)."""
  data = path.read_bytes()
  (n,) = struct.unpack("<Q", data[:8])
  header = json.loads(data[8 : 8 + n])
  header.pop("__metadata__", None)
  out = {}
  for name, entry in header.items():
    lo, hi = entry["data_offsets"]
    raw = data[8 + n + lo : 8 + n + hi]
    out[name] = np.frombuffer(raw, _DTYPES[entry["dtype"]]).reshape(
        entry["shape"]
    )
  return out


def _write_raw(path: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
  codes = {v: k for k, v in _DTYPES.items()}
  header, offset = {}, 0
  for name, t in tensors.items():
    header[name] = {
        "dtype": codes[t.dtype],
        "shape": list(t.shape),
        "data_offsets": [offset, offset + t.nbytes],
    }
    offset += t.nbytes
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for t in tensors.values():
      f.write(np.ascontiguousarray(t).tobytes())


def _dequantized(tensors: dict, block) -> dict[str, np.ndarray]:
  """The float32 weights of block-fp8 tensors: block (i, j) of each fp8
  tensor times its scale [i, j], partial blocks at the edges."""
  bm, bn = block
  out = {}
  for name, t in tensors.items():
    scale = tensors.get(name + SCALE)
    if name.endswith(SCALE):
      continue
    if scale is None:
      out[name] = t
      continue
    w = t.astype(np.float32)
    for *lead, i, j in np.ndindex(*scale.shape):
      rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
      w[(*lead, rows, cols)] *= np.float32(scale[(*lead, i, j)])
    out[name] = w
  return out


class _Logs(logging.Handler):

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


@functools.cache
def _load(name: str, **kwargs):
  """(config, variables, warnings) of a fixture loaded once per process."""
  logs, logger = _Logs(), logging.getLogger("linen_moe.hf")
  logger.addHandler(logs)
  try:
    config, variables = hf.load_checkpoint(FIXTURES / name, **kwargs)
  finally:
    logger.removeHandler(logs)
  return config, variables, logs.messages


class LoadTest(parameterized.TestCase):

  @parameterized.parameters(
      (DEEPSEEK, True, "linen", "sparse"), (QWEN, False, "nnx", "dense")
  )
  def test_logits_equal_the_dequantized_model(self, name, scan, fe, path):
    ids, expected, _, _ = _fixture(name)
    config, variables, _ = _load(name, scan_layers=scan, dtype="float32")
    config = config.replace(**MATMUL_PATHS[path])
    logits = _logits(config, variables, fe, ids)
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)

  @parameterized.parameters((DEEPSEEK, True), (QWEN, False))
  def test_weights_are_the_numpy_dequantization(self, name, scan):
    # The dequantized tensors written as a float checkpoint load (float
    # path, tested against transformers) into the same variables.
    tensors = _raw(FIXTURES / name / "model.safetensors")
    self.assertTrue(
        any(t.dtype == _DTYPES["F8_E4M3"] for t in tensors.values())
    )
    d = pathlib.Path(helpers.tempdir(self))
    hf_config = json.loads((FIXTURES / name / "config.json").read_text())
    del hf_config["quantization_config"]
    (d / "config.json").write_text(json.dumps(hf_config))
    save_file(_dequantized(tensors, BLOCKS[name]), d / "model.safetensors")
    _, want = hf.load_checkpoint(d, scan_layers=scan, dtype="float32")
    _, got, _ = _load(name, scan_layers=scan, dtype="float32")
    equal_trees(self, got, want)

  def test_mtp_layer_is_skipped_with_its_warning(self):
    config, _, messages = _load(DEEPSEEK, scan_layers=True, dtype="float32")
    self.assertEqual(config.num_layers, 2)
    self.assertLen(messages, 1)
    self.assertRegex(
        messages[0], r"Skipping the \d+ tensors of the multi-token-pred.*\[2\]"
    )

  def test_fp8_serving_on_load(self):
    # Each expert matrix dequantized as read, then converted as
    # quantize_weights converts the float load.
    ids, expected, _, _ = _fixture(QWEN)
    config, served = hf.load_checkpoint(
        FIXTURES / QWEN,
        scan_layers=True,
        dtype="float32",
        quantization="fp8",
        serving=True,
    )
    float_config, floats, _ = _load(QWEN, scan_layers=True, dtype="float32")
    want_config, want = quantization.quantize_weights(
        float_config.replace(quantization="fp8"), {"params": floats["params"]}
    )
    self.assertEqual(config, want_config)
    equal_trees(self, served, want)
    wi_0 = served["params"]["layers"]["moe"]["wi_0"]
    self.assertEqual(wi_0.dtype, "float8_e4m3fn")
    logits = _logits(config, served, "linen", ids)
    self.assertLess(helpers.rel_err(logits, expected), SERVING_REL)


class ReadRowsTest(parameterized.TestCase):
  """Any rows of an fp8 tensor (a device's slice) read dequantized."""

  @parameterized.parameters(((37, 45),), ((3, 37, 45),))
  def test_any_rows_against_numpy(self, shape):
    block = (8, 16)
    rng = np.random.default_rng(0)
    values = rng.normal(size=shape).astype(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(0.5, 2, block_fp8.scale_shape(shape, block))
    tensors = {"w.weight": values, "w.weight" + SCALE: scales.astype("f4")}
    d = pathlib.Path(helpers.tempdir(self))
    _write_raw(d / "model.safetensors", tensors)
    ckpt = block_fp8.Dequantized(Checkpoint(d), block)
    self.assertEqual(ckpt.tensors["w.weight"].dtype, "F32")
    self.assertNotIn("w.weight" + SCALE, ckpt.tensors)
    want = _dequantized(tensors, block)["w.weight"]
    lead = [()] if len(shape) == 2 else [(0,), (2,)]
    for at in lead:
      for lo, hi in ((0, 37), (5, 13), (8, 16), (15, 17), (36, 37), (3, 3)):
        got = ckpt.read_rows("w.weight", at, lo, hi)
        np.testing.assert_array_equal(got, want[at][lo:hi])

  def test_quantize_is_the_format_and_a_fixed_point(self):
    block = (8, 16)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 21, 35)).astype(np.float32) * 3
    x[0, :8, :16] = 0  # an all-zero block: scale 1
    values, scales = block_fp8.quantize(x, block)
    self.assertEqual(scales.shape, (2, 3, 3))
    for e, i, j in np.ndindex(*scales.shape):
      part = x[e, i * 8 : (i + 1) * 8, j * 16 : (j + 1) * 16]
      amax = np.abs(part).max()
      want = amax / np.float32(448) if amax else 1
      self.assertEqual(scales[e, i, j], np.float32(want))
    back = _dequantized({"w": values, "w" + SCALE: scales}, block)["w"]
    # e4m3 keeps 3 mantissa bits: 2^-4 relative, subnormals 2^-10 * scale.
    grid = np.repeat(np.repeat(scales, 8, 1), 16, 2)[:, :21, :35]
    bound = np.maximum(np.abs(x) * 2.0**-4, grid * 2.0**-10)
    self.assertTrue(np.all(np.abs(back - x) <= bound))
    again_values, again_scales = block_fp8.quantize(back, block)
    np.testing.assert_array_equal(again_scales, scales)
    np.testing.assert_array_equal(
        again_values.view(np.uint8), values.view(np.uint8)
    )


class SaveTest(parameterized.TestCase):

  @parameterized.parameters(DEEPSEEK, QWEN)
  def test_save_writes_the_fixture_back_byte_for_byte(self, name):
    config, variables, _ = _load(name, scan_layers=True, dtype="float32")
    out = pathlib.Path(helpers.tempdir(self)) / "out"
    hf.save_checkpoint(
        config,
        variables,
        out,
        weight_format="block_fp8",
        block_size=BLOCKS[name],
    )
    saved = _raw(out / "model.safetensors")
    fixture = _raw(FIXTURES / name / "model.safetensors")
    mtp = "model.layers.2." if name == DEEPSEEK else "-"
    self.assertEqual(set(saved), {n for n in fixture if not n.startswith(mtp)})
    for key, tensor in saved.items():
      self.assertEqual(tensor.dtype, fixture[key].dtype, key)
      np.testing.assert_array_equal(
          tensor.view(np.uint8), fixture[key].view(np.uint8), err_msg=key
      )
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    self.assertEqual(quant["quant_method"], "fp8")
    self.assertEqual(quant["weight_block_size"], list(BLOCKS[name]))
    self.assertEqual(quant["modules_to_not_convert"][0], "lm_head")
    self.assertIn("model.layers.1.mlp.gate", quant["modules_to_not_convert"])
    again_config, again = hf.load_checkpoint(out, dtype="float32")
    self.assertEqual(again_config, config)
    equal_trees(self, again, variables)

  def test_bad_arguments(self):
    config, variables, _ = _load(QWEN, scan_layers=True, dtype="float32")
    out = pathlib.Path(helpers.tempdir(self)) / "out"
    for kwargs, pattern in (
        ({"weight_format": "fp4"}, r"weight_format='fp4' is invalid"),
        ({"block_size": (16, 16)}, r"block_size=.* is for weight_format="),
        (
            {"weight_format": "block_fp8", "block_size": (0, 16)},
            r"block_size=\(0, 16\) is invalid: expected two ints > 0",
        ),
    ):
      with self.assertRaisesRegex(ValueError, pattern):
        hf.save_checkpoint(config, variables, out, **kwargs)
    self.assertFalse(out.exists())


class BadInputTest(parameterized.TestCase):
  """One error each, naming the file and the tensor (or the field), before
  any tensor data is read."""

  def setUp(self):
    super().setUp()
    self.dir = pathlib.Path(helpers.tempdir(self)) / QWEN
    shutil.copytree(FIXTURES / QWEN, self.dir)
    forbid_data_reads(self)

  def _edit_tensors(self, edit):
    path = self.dir / "model.safetensors"
    tensors = {k: v.copy() for k, v in _raw(path).items()}
    edit(tensors)
    _write_raw(path, tensors)

  def _edit_quantization(self, edit):
    path = self.dir / "config.json"
    hf_config = json.loads(path.read_text())
    edit(hf_config["quantization_config"])
    path.write_text(json.dumps(hf_config))

  def _fails(self, pattern):
    with self.assertRaisesRegex(ValueError, pattern):
      hf.load_checkpoint(self.dir)

  def test_scale_shape_that_does_not_match_the_blocks(self):
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"  # [3, 3]
    self._edit_tensors(lambda t: t.update({name: t[name][:, :2].copy()}))
    self._fails(
        rf"model.safetensors: tensor '{name}' has shape \[3, 2\]; "
        r"'model.layers.0.self_attn.q_proj.weight' \[48, 40\] in blocks of "
        r"\[16, 16\] .* needs \[3, 3\]"
    )

  def test_block_size_that_does_not_match_the_scales(self):
    self._edit_quantization(lambda q: q.update(weight_block_size=[32, 32]))
    self._fails(r"model.safetensors: tensor '.*_scale_inv' has shape")

  def test_missing_scale(self):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    self._edit_tensors(lambda t: t.pop(name + SCALE))
    self._fails(
        rf"model.safetensors: tensor '{name}' is float8_e4m3fn, but the "
        rf"checkpoint has no '{name}_scale_inv'"
    )

  def test_scale_of_a_float_tensor(self):
    name = "model.norm.weight" + SCALE
    self._edit_tensors(lambda t: t.update({name: np.ones((1, 1), "f4")}))
    self._fails(rf"tensor '{name}' is a block scale, but 'model.norm.weight'")

  @parameterized.parameters(
      ({"quant_method": "awq"}, r"quant_method='awq' is not supported"),
      ({"weight_block_size": [16]}, r"weight_block_size=\[16\] is invalid"),
      ({"weight_block_size": None}, r"per-tensor fp8 is not read"),
      ({"activation_scheme": "static"}, r"activation_scheme='static' is not"),
      ({"bits": 4}, r"field\(s\) \['bits'\] not known here"),
  )
  def test_quantization_config(self, change, pattern):
    self._edit_quantization(lambda q: q.update(change))
    self._fails(r"config.json: quantization_config.*" + pattern)


@testing.slow
class SlowTest(parameterized.TestCase):

  def test_deepseek_fp8_serving_on_load(self):
    ids, expected, _, _ = _fixture(DEEPSEEK)
    config, served = hf.load_checkpoint(
        FIXTURES / DEEPSEEK, quantization="fp8", serving=True
    )
    logits = _logits(config, served, "nnx", ids)
    self.assertLess(helpers.rel_err(logits, expected), SERVING_REL)

  def test_bfloat16_is_the_float32_dequantization_rounded(self):
    _, variables = hf.load_checkpoint(
        FIXTURES / QWEN, scan_layers=False, dtype="bfloat16"
    )
    _, floats, _ = _load(QWEN, scan_layers=False, dtype="float32")
    q = variables["params"]["layers_0"]["attention"]["query"]["kernel"]
    self.assertEqual(q.dtype, "bfloat16")
    for a, b in zip(
        jax.tree.leaves(variables), jax.tree.leaves(floats), strict=True
    ):
      np.testing.assert_array_equal(a, np.asarray(b).astype(a.dtype))

  def test_fused_experts_round_trip(self):
    # Gemma-4 stores its experts fused, [E, 2I, H]: scales
    # [E, ceil(2I / bm), ceil(H / bn)] beside them.
    name = "gemma4_text_moe_keqv"
    config, variables = hf.load_checkpoint(FIXTURES / name, dtype="float32")
    out = pathlib.Path(helpers.tempdir(self)) / "out"
    hf.save_checkpoint(
        config, variables, out, weight_format="block_fp8", block_size=(16, 16)
    )
    saved = _raw(out / "model.safetensors")
    gate_up = "model.layers.0.experts.gate_up_proj"
    self.assertEqual(saved[gate_up].dtype, _DTYPES["F8_E4M3"])
    self.assertEqual(saved[gate_up + SCALE].shape, (6, 1, 2))  # 2I 16, H 32
    _, again = hf.load_checkpoint(out, dtype="float32")
    for a, b in zip(
        jax.tree.leaves(again), jax.tree.leaves(variables), strict=True
    ):
      np.testing.assert_allclose(a, b, rtol=2.0**-4, atol=1e-6)
    moe = again["params"]["layers"]["block_0"]["moe"]
    want = _dequantized(saved, (16, 16))[gate_up][:, :8].transpose(0, 2, 1)
    np.testing.assert_array_equal(moe["wi_0"][0], want)

  def test_each_device_reads_its_rows_into_its_sharding(self):
    # Device slices that start and end inside a block (tensor=2 halves
    # q_proj's 48 rows into 24, blocks of 16).
    got = workers.run_json(
        "tests.hf_mesh_worker", QWEN, "fsdp=2,expert=2,tensor=2"
    )
    self.assertTrue(got["placed"] and got["equal"])
    self.assertTrue(got["served_placed"] and got["served_equal"])
    self.assertGreater(got["sharded_leaves"], 10)


if __name__ == "__main__":
  absltest.main()
