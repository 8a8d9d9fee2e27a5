"""Shared by the tests on the Hugging Face fixtures (tests/fixtures/hf):
each fixture read and loaded once per process, and the Linen / NNX
forward and greedy decoding of a loaded checkpoint."""

import functools
import json
import pathlib
import shutil
from unittest import mock

from flax import nnx
import jax
import numpy as np

from linen_moe import MATMUL_PATHS
from linen_moe import Decoder
from linen_moe import decoding
from linen_moe import hf
from linen_moe._src.hf.safetensors_io import Checkpoint
from linen_moe._src.testing import helpers
import nnx_adapter

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
# float32 against transformers' float32 logits (max abs over the vocab).
ATOL = 1e-4


@functools.cache
def fixture(name: str):
  d = FIXTURES / name
  meta = json.loads((d / "meta.json").read_text())
  return (
      np.load(d / "input_ids.npy"),
      np.load(d / "logits.npy"),
      np.load(d / "generate.npy"),
      meta["prompt_len"],
  )


@functools.cache
def load(name: str, scan: bool, path: str = "sparse", **kwargs):
  config, variables = hf.load_checkpoint(
      FIXTURES / name, scan_layers=scan, **kwargs
  )
  return config.replace(**MATMUL_PATHS[path]), variables


def logits(config, variables, frontend: str, ids) -> np.ndarray:
  if frontend == "linen":
    forward = jax.jit(lambda v, t: Decoder(config).apply(v, t)[0])
    return np.asarray(forward(variables, ids))
  model = nnx_adapter.Decoder.from_linen(config, variables)
  return np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, ids))


def generate(config, variables, frontend: str, prompt, n) -> np.ndarray:
  if frontend == "linen":
    return np.asarray(decoding.greedy_generate(config, variables, prompt, n))
  model = nnx_adapter.Decoder.from_linen(config, variables)
  return np.asarray(nnx_adapter.greedy_generate(model, prompt, n))


def forbid_data_reads(test) -> None:
  """Makes any read of tensor data fail `test` (bad input must be refused
  before a byte of data is read)."""
  patcher = mock.patch.object(
      Checkpoint, "read_rows", side_effect=AssertionError("data was read")
  )
  patcher.start()
  test.addCleanup(patcher.stop)


def equal_trees(test, a, b) -> None:
  """Asserts two trees of arrays have one structure, dtypes and values."""
  test.assertEqual(jax.tree.structure(a), jax.tree.structure(b))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    test.assertEqual(x.dtype, y.dtype)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_logits(name: str, scan: bool, frontend: str, path: str) -> None:
  """Fixture `name`'s logits equal transformers' to `ATOL`."""
  ids, expected, _, _ = fixture(name)
  config, variables = load(name, scan, path)
  got = logits(config, variables, frontend, ids)
  np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def assert_greedy(name: str, frontend: str = "linen", scan: bool = True):
  """Greedy decoding over the KV cache gives transformers' `generate`."""
  _, _, expected, prompt_len = fixture(name)
  config, variables = load(name, scan)
  tokens = generate(config, variables, frontend, expected[:, :prompt_len], 8)
  np.testing.assert_array_equal(tokens, expected)


def assert_save_is_the_fixture(test, name: str, prefix: str = "model."):
  """Load fixture `name` unrolled, save it: the files hold its tensors
  byte for byte (its text tensors under `prefix` written under `model.`),
  and loading them back gives the same config and variables. Returns the
  saved directory."""
  from safetensors.numpy import load_file  # noqa: PLC0415

  out = pathlib.Path(helpers.tempdir(test)) / "out"
  config, variables = hf.load_checkpoint(FIXTURES / name, scan_layers=False)
  hf.save_checkpoint(config, variables, out)
  saved = {}
  for file in out.glob("*.safetensors"):
    saved |= load_file(file)
  hub = load_file(FIXTURES / name / "model.safetensors")
  hub = {n.replace(prefix, "model.", 1): v for n, v in hub.items()}
  test.assertEqual(sorted(saved), sorted(hub))
  for tensor, value in hub.items():
    np.testing.assert_array_equal(saved[tensor], value, err_msg=tensor)
  again_config, again = hf.load_checkpoint(out, scan_layers=False)
  test.assertEqual(again_config, config)
  equal_trees(test, again, variables)
  return out


def assert_config_refused(test, name: str, change: dict, pattern: str):
  """Fixture `name` with `change` applied to its config.json fails to load
  with a ValueError matching `pattern` (before any data is read, when the
  test forbids it)."""
  d = pathlib.Path(helpers.tempdir(test)) / name
  shutil.copytree(FIXTURES / name, d)
  config = json.loads((d / "config.json").read_text())
  config.update(change)
  (d / "config.json").write_text(json.dumps(config))
  with test.assertRaisesRegex(ValueError, pattern):
    hf.load_checkpoint(d)


def assert_packed_equals_alone(name: str, implementation: str = "einsum"):
  """Two documents of fixture `name` packed in one row (segment ids,
  positions restarting) give the logits each gives alone."""
  ids = fixture(name)[0]
  config, variables = load(name, True)
  config = config.replace(attention=implementation)
  docs = (ids[0, :5], ids[1, :7])
  row = np.concatenate(docs)[None]
  seg = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)])
  forward = jax.jit(
      lambda v, t, s: Decoder(config).apply(v, t, segment_ids=s)[0]
  )
  packed = np.asarray(forward(variables, row, seg[None].astype(np.int32)))
  alone = np.zeros((2, 7), np.int32)
  alone[0, :5], alone[1] = docs
  apart = np.asarray(jax.jit(Decoder(config).apply)(variables, alone)[0])
  np.testing.assert_allclose(packed[0, :5], apart[0, :5], atol=2e-5, rtol=0)
  np.testing.assert_allclose(packed[0, 5:], apart[1], atol=2e-5, rtol=0)


# int8 per-channel serving weights against transformers' float logits
# (tests/hf/test_hf.py's bound).
INT8_REL = 0.04


def assert_int8_serving(test, name: str, scan: bool = True):
  """Fixture `name` loaded straight to int8 serving weights is
  `quantization.quantize_weights` of its float load, within `INT8_REL` of
  transformers' logits."""
  from linen_moe import quantization  # noqa: PLC0415

  config, variables = hf.load_checkpoint(
      FIXTURES / name, scan_layers=scan, quantization="int8", serving=True
  )
  float_config, floats = hf.load_checkpoint(
      FIXTURES / name, scan_layers=scan, quantization="int8"
  )
  want_config, want = quantization.quantize_weights(float_config, floats)
  test.assertEqual(config, want_config)
  equal_trees(test, variables, want)
  ids, expected, _, _ = fixture(name)
  got = np.asarray(jax.jit(Decoder(config).apply)(variables, ids)[0])
  test.assertLess(helpers.rel_err(got, expected), INT8_REL)
