"""Shared by the tests on the Hugging Face fixtures (tests/fixtures/hf):
each fixture read and loaded once per process, and the Linen / NNX
forward and greedy decoding of a loaded checkpoint."""

import functools
import json
import pathlib
from unittest import mock

from flax import nnx
import jax
import numpy as np

from linen_moe import MATMUL_PATHS
from linen_moe import Decoder
from linen_moe import decoding
from linen_moe import hf
from linen_moe._src.hf.safetensors_io import Checkpoint
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
