"""The machine a GPU run ran on, as JSON: the `env` step of gpu_run.py.

Records what every later figure depends on: Python; each package this
project uses, its version, where it was imported from (the machine's own or
the carried wheels' folder) and whether pyproject.toml's range admits it;
the devices JAX sees and their kind and memory; the CUDA, cuDNN and driver
versions; whether tokamax imports (and whether it found the real xprof or
benchmarks/gpu/standin's); the jax flags that choose how `ragged_dot` is
lowered on a GPU; `nvidia-smi`'s line for each GPU.

  python benchmarks/gpu/gpu_env.py --out DIR     # writes DIR/env.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Distribution name -> module whose file says where it came from.
PACKAGES = {
    "jax": "jax",
    "jaxlib": "jaxlib",
    "jax-cuda13-plugin": "jax_cuda13_plugin",
    "jax-cuda13-pjrt": "jax_plugins",
    "flax": "flax",
    "optax": "optax",
    "orbax-checkpoint": "orbax.checkpoint",
    "chex": "chex",
    "aqtp": "aqt",
    "grain": "grain",
    "tokamax": "tokamax",
    "xprof": "xprof",
    "tensorstore": "tensorstore",
    "numpy": "numpy",
    "ml-dtypes": "ml_dtypes",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "torch": "torch",
    "triton": "triton",
    "transformers": "transformers",
    "pydantic": "pydantic",
    "typing-extensions": "typing_extensions",
    "pytest": "pytest",
    "hypothesis": "hypothesis",
    "linen_moe": "linen_moe",
}
# jax's switches of the grouped matmul's lowering on a GPU (read, not set).
JAX_FLAGS = ("jax_ragged_dot_use_gpu_pallas_triton_lowering",)


def requirement_ranges(pyproject: pathlib.Path) -> dict[str, str]:
  """Distribution name (lower case) -> its range in pyproject.toml's
  dependencies and its `test` and `kernels` extras (the first one wins)."""
  project = tomllib.loads(pyproject.read_text())["project"]
  lines = list(project["dependencies"])
  for extra in ("test", "kernels"):
    lines += project["optional-dependencies"].get(extra, [])
  out = {}
  for line in lines:
    name = line
    for stop in "<>=!~[; ":
      name = name.split(stop, 1)[0]
    out.setdefault(name.lower(), line[len(name) :].split(";")[0].strip())
  return out


def admitted(version: str, spec: str) -> bool | None:
  """Whether `version` satisfies `spec` (None: packaging is missing)."""
  try:
    from packaging.specifiers import SpecifierSet  # noqa: PLC0415
  except ImportError:
    return None
  return SpecifierSet(spec).contains(version, prereleases=True)


def package(name: str, module: str, ranges: dict, site: str | None) -> dict:
  """One package's version, origin and range check (import errors kept)."""
  record: dict = {}
  try:
    record["version"] = importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    record["version"] = None
  try:
    mod = importlib.import_module(module)
    where = getattr(mod, "__file__", None) or str(list(mod.__path__)[0])
    record["file"] = where
    record["carried"] = bool(site) and where.startswith(site)
    if getattr(mod, "STANDIN", False):  # benchmarks/gpu/standin's xprof
      record["standin"] = True
      record["version"] = "stand-in"
  except Exception as e:  # noqa: BLE001  (recorded, not fatal)
    record["import_error"] = f"{type(e).__name__}: {e}"[:300]
  spec = ranges.get(name.lower())
  if spec is not None and record["version"]:
    record["range"] = spec
    record["admitted"] = admitted(record["version"], spec)
  return record


def cuda_versions() -> dict:
  """The CUDA runtime, cuDNN and driver versions as jaxlib's plugin reads
  them (empty where there is no CUDA plugin)."""
  out = {}
  for module in (
      "jax_cuda13_plugin.cuda_versions",
      "jax_cuda12_plugin.cuda_versions",
  ):
    try:
      versions = importlib.import_module(module)
    except ImportError:
      continue
    out["module"] = module
    for key in (
        "cuda_runtime_get_version",
        "cuda_driver_get_version",
        "cudnn_get_version",
        "cublas_get_version",
        "cupti_get_version",
        "cufft_get_version",
        "cusolver_get_version",
        "cusparse_get_version",
        "nccl_get_version",
    ):
      getter = getattr(versions, key, None)
      if getter is None:
        continue
      try:
        out[key.removesuffix("_get_version")] = getter()
      except Exception as e:  # noqa: BLE001
        out[key.removesuffix("_get_version")] = f"{type(e).__name__}: {e}"
    break
  return out


def devices() -> dict:
  """JAX's backend, devices, their kind and memory limit."""
  import jax  # noqa: PLC0415

  devs = jax.devices()
  out = {
      "backend": jax.default_backend(),
      "count": len(devs),
      "kind": devs[0].device_kind,
      "platform": devs[0].platform,
  }
  try:
    stats = devs[0].memory_stats() or {}
    out["bytes_limit"] = stats.get("bytes_limit")
  except Exception as e:  # noqa: BLE001
    out["memory_stats_error"] = str(e)[:200]
  compute = getattr(devs[0], "compute_capability", None)
  if compute is not None:
    out["compute_capability"] = compute
  out["flags"] = {
      flag: getattr(jax.config, flag, "absent in this jax")
      for flag in JAX_FLAGS
  }
  return out


def nvidia_smi() -> list[str] | None:
  """`nvidia-smi`'s name, driver and memory line per GPU (None: absent)."""
  if shutil.which("nvidia-smi") is None:
    return None
  done = subprocess.run(
      [
          "nvidia-smi",
          "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
          "--format=csv,noheader",
      ],
      capture_output=True,
      text=True,
      timeout=30,
      check=False,
  )
  return done.stdout.strip().splitlines() or [done.stderr.strip()[:300]]


def collect(site: str | None = None) -> dict:
  """The whole record (see the module docstring)."""
  ranges = requirement_ranges(ROOT / "pyproject.toml")
  record = {
      "python": sys.version.split()[0],
      "platform": platform.platform(),
      "site": site,
      "env": {
          k: os.environ.get(k)
          for k in (
              "JAX_PLATFORMS",
              "XLA_FLAGS",
              "XLA_PYTHON_CLIENT_MEM_FRACTION",
          )
      },
      "packages": {
          name: package(name, module, ranges, site)
          for name, module in PACKAGES.items()
      },
      "cuda": cuda_versions(),
      "nvidia_smi": nvidia_smi(),
  }
  record["devices"] = devices()
  record["outside_range"] = sorted(
      name
      for name, p in record["packages"].items()
      if p.get("admitted") is False
  )
  return record


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=".", help="where env.json goes")
  parser.add_argument(
      "--site",
      default=os.environ.get("SITE"),
      help="the carried wheels' folder",
  )
  args = parser.parse_args(argv)
  record = collect(args.site)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "env.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1, default=str)
  p = record["packages"]
  d = record["devices"]
  print(
      f"python {record['python']}, jax {p['jax']['version']}, flax"
      f" {p['flax']['version']}; {d['count']} x {d['kind']} ({d['backend']});"
      f" cuDNN {record['cuda'].get('cudnn', '-')}; tokamax"
      f" {'imports' if 'file' in p['tokamax'] else 'fails'} (xprof"
      f" {'stand-in' if p['xprof'].get('standin') else 'real' if 'file' in p['xprof'] else 'absent'});"
      f" outside pyproject's ranges: {record['outside_range'] or 'none'}"
  )
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
