"""What loading a Hugging Face checkpoint costs: rate and host memory.

Writes a random Mixtral-shaped checkpoint of about 1 GB (float16, the size
a bfloat16 one has; safetensors' NumPy front end reads no bfloat16) in
shards with an index to a temporary directory (`hf.save_checkpoint`): width
1024, 8 query and 2 key/value heads, 8 experts of width 4096, 5 layers,
vocabulary 8000, so the experts are 95% of the weights (Mixtral-8x7B: 96%).
Then it measures each
case in a fresh subprocess, the cases interleaved --repeats times (page
cache warm), keeping each one's best:

  load_file   `safetensors.numpy.load_file` of every shard: the plain read
              the loader is compared with.
  float       `linen_moe.hf.load_checkpoint` (scanned, the file's dtype).
  int8        `load_checkpoint(quantization="int8", serving=True)` of the
              same weights in a bfloat16 checkpoint: expert kernels
              quantized as they arrive.

and prints each case's best wall time of --repeats, its load rate as a
fraction of load_file's, and its peak resident memory growth (peak RSS
during the load minus RSS before it) as a multiple of the bytes it loaded
and of the files' size.

  python benchmarks/checkpoint/bench_hf_load.py [--layers 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time


def _rss() -> int:
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmRSS")


def _peak() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# A Mixtral of about 1 GB at 16 bits, `layers` layers: the experts are 95% of
# its weights (Mixtral-8x7B: 96%).
def hf_config(layers: int) -> dict:
  """The checkpoint's config.json."""
  return {
      "architectures": ["MixtralForCausalLM"],
      "model_type": "mixtral",
      "vocab_size": 8000,
      "hidden_size": 1024,
      "intermediate_size": 4096,
      "num_hidden_layers": layers,
      "num_attention_heads": 8,
      "num_key_value_heads": 2,
      "num_local_experts": 8,
      "num_experts_per_tok": 2,
      "rms_norm_eps": 1e-5,
      "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
      "tie_word_embeddings": False,
  }


def write_checkpoints(dirs: dict[str, pathlib.Path], layers: int) -> dict:
  """One random Mixtral (`hf_config`) written by `hf.save_checkpoint` into
  each `dirs[dtype]`, in that dtype, in shards of 512 MB; {dtype: bytes on
  disk}. Run in a process of its own (`--write`): it holds the float32
  weights, and a child started from a process inherits its peak RSS."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415
  from linen_moe import hf  # noqa: PLC0415

  config = hf.model_config(hf_config(layers))
  variables = jax.jit(linen_moe.Decoder(config).init)(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32)
  )
  variables = linen_moe.sharding.unbox(variables)
  sizes = {}
  for dtype, directory in dirs.items():
    files = hf.save_checkpoint(
        config, variables, directory, dtype=dtype, max_shard_size="512MB"
    )
    sizes[dtype] = sum(f.stat().st_size for f in files)
  return sizes


def run_case(case: str, directory: str) -> dict:
  """One case, in this (fresh) process."""
  import jax  # noqa: PLC0415

  jax.devices()
  from safetensors.numpy import load_file  # noqa: PLC0415

  from linen_moe import hf  # noqa: PLC0415

  before = _rss()
  start = time.perf_counter()
  if case == "load_file":
    files = sorted(pathlib.Path(directory).glob("*.safetensors"))
    loaded = [load_file(f) for f in files]
    nbytes = sum(v.nbytes for d in loaded for v in d.values())
  else:
    kwargs = {"quantization": "int8", "serving": True} if case == "int8" else {}
    _, variables = hf.load_checkpoint(directory, **kwargs)
    leaves = jax.tree.leaves(variables)
    jax.block_until_ready(leaves)
    nbytes = sum(x.nbytes for x in leaves)
  seconds = time.perf_counter() - start
  return {"seconds": seconds, "bytes": nbytes, "growth": _peak() - before}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=5)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--case", help=argparse.SUPPRESS)
  parser.add_argument("--dir", help=argparse.SUPPRESS)
  parser.add_argument("--write", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.case:
    print(json.dumps(run_case(args.case, args.dir)))
    return
  if args.write:
    directory = pathlib.Path(args.dir)
    dirs = {
        "float16": directory / "float16",
        "bfloat16": directory / "bfloat16",
    }
    print(json.dumps(write_checkpoints(dirs, args.layers)))
    return
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_hf_load."))
  try:
    dirs = {"float16": tmp / "float16", "bfloat16": tmp / "bfloat16"}
    written = subprocess.run(
        [sys.executable, __file__, "--write", "--dir", str(tmp)]
        + ["--layers", str(args.layers)],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    sizes = json.loads(written.stdout.strip().splitlines()[-1])
    for dtype, d in dirs.items():
      shards = len(list(d.glob("*.safetensors")))
      print(
          f"{dtype} checkpoint: {sizes[dtype] / 1e9:.2f} GB in {shards} shards"
      )
      for f in d.glob("*.safetensors"):  # warm the page cache
        f.read_bytes()
    # (case, checkpoint): load_file and the float load read the same
    # float16 files; int8 serving reads the bfloat16 ones.
    cases = {"load_file": "float16", "float": "float16", "int8": "bfloat16"}
    runs = {case: [] for case in cases}
    for _ in range(args.repeats):
      for case, dtype in cases.items():
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--case",
                case,
                "--dir",
                str(dirs[dtype]),
            ],
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        runs[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
    results = {c: min(r, key=lambda x: x["seconds"]) for c, r in runs.items()}
    base = results["load_file"]
    base_rate = sizes["float16"] / base["seconds"]
    print(
        f"{'case':10s} {'file':>9s} {'seconds':>8s} {'GB/s':>6s} "
        f"{'rate/load_file':>15s} {'loaded GB':>10s} {'peak RSS growth':>16s} "
        f"{'/loaded':>8s} {'/file':>6s}"
    )
    for case, r in results.items():
      size = sizes[cases[case]]
      rate = size / r["seconds"]
      print(
          f"{case:10s} {cases[case]:>9s} {r['seconds']:8.2f} {rate / 1e9:6.2f} "
          f"{rate / base_rate:15.2f} {r['bytes'] / 1e9:10.2f} "
          f"{r['growth'] / 1e9:13.2f} GB {r['growth'] / r['bytes']:8.2f} "
          f"{r['growth'] / size:6.2f}"
      )
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  main()
