"""What the GPU chip checks (tests/gpu/test_on_gpu_*.py) share: where they run,
and the records they leave.

They run on an NVIDIA GPU (benchmarks/gpu/one_gpu.sh's `tests` step; `-k
on_gpu` selects them, as `-k on_tpu` the TPU's), and on a CPU where
`LINEN_MOE_GPU_CHECKS_ON_CPU=1` says so: the GPU script's `--cpu-dry-run`
rehearses them there, the same code at the same tiny shapes, with what
only a GPU (or torch) can run skipped with its reason. Anywhere else each
file is skipped at collection, with one reason, before it builds anything.

A check records what it measured (element types, routes' programs, largest
differences) with `record`: a JSON file per check file under
`$LINEN_MOE_GPU_RECORDS` (the script's step folder, so the run returns
them), nothing where that is unset.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import numpy as np
import pytest

ON_CPU_ENV = "LINEN_MOE_GPU_CHECKS_ON_CPU"
RECORDS_ENV = "LINEN_MOE_GPU_RECORDS"
SKIP_REASON = (
    "GPU chip checks: no GPU here (jax's default backend is not 'gpu'); set"
    f" {ON_CPU_ENV}=1 to rehearse them on the CPU"
)


def platform() -> str | None:
  """ "gpu" on a GPU; "cpu" where the rehearsal is asked for; else None."""
  if jax.default_backend() == "gpu":
    return "gpu"
  if os.environ.get(ON_CPU_ENV) == "1":
    return "cpu"
  return None


ON_GPU = platform() == "gpu"


def skip_unless_asked() -> None:
  """Skips the calling test module at collection unless it runs here."""
  if platform() is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)


def record(name: str, key: str, value: Any) -> None:
  """Sets `key` of `$LINEN_MOE_GPU_RECORDS/on_gpu_<name>.json` to `value`
  (JSON; the file gains a key per call), with the platform and device
  kind. Does nothing where the variable is unset."""
  folder = os.environ.get(RECORDS_ENV)
  if not folder:
    return
  path = pathlib.Path(folder, f"on_gpu_{name}.json")
  path.parent.mkdir(parents=True, exist_ok=True)
  data = json.loads(path.read_text()) if path.exists() else {}
  data.setdefault("platform", platform())
  data.setdefault("device_kind", jax.devices()[0].device_kind)
  data.setdefault("jax", jax.__version__)
  data[key] = value
  path.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))


def custom_call_targets(text: str) -> list[str]:
  """The distinct `custom_call_target`s of a compiled HLO text, sorted."""
  from linen_moe._src.hlo import reading  # noqa: PLC0415

  return sorted({
      inst.target
      for inst in reading.parse_hlo(text).values()
      if inst.opcode == "custom-call" and inst.target
  })


def relative_errors(parts, got, want) -> dict[str, float]:
  """Each part's largest |got - want| over want's largest magnitude (at
  least 1), in float64: `parts` names the leaves of `got` and `want`."""
  out = {}
  for part, g, w in zip(
      parts, jax.tree.leaves(got), jax.tree.leaves(want), strict=True
  ):
    ref = np.asarray(w, np.float64)
    scale = max(1.0, float(np.abs(ref).max()))
    out[part] = float(np.abs(np.asarray(g, np.float64) - ref).max()) / scale
  return out
