"""The date, the machine and the versions a benchmark run was measured with."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

import flax
import jax

import linen_moe

from common import host_memory


def _cpuinfo() -> str:
  """The text of /proc/cpuinfo, or "" where there is none."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      return f.read()
  except OSError:
    return ""


def _cpu_name(cpuinfo: str) -> str:
  for line in cpuinfo.splitlines():
    if line.startswith("model name"):
      return line.split(":", 1)[1].strip()
  return platform.processor() or platform.machine()


# Vector units a CPU flag names, widest first. Recorded because the model
# name does not tell machines apart: two that both said "AMD EPYC" measured
# this benchmark's float32 roofline at 351 and 88 GFLOP/s.
_VECTOR_FLAGS = ("avx512f", "avx2", "avx", "sve", "asimd", "sse2")


def vector_isa(cpuinfo: str) -> str:
  """The widest of `_VECTOR_FLAGS` among the first processor's flags in
  `cpuinfo` (the text of /proc/cpuinfo), or "unknown"."""
  for line in cpuinfo.splitlines():
    key, _, value = line.partition(":")
    if key.strip() in ("flags", "Features"):
      flags = set(value.split())
      return next((f for f in _VECTOR_FLAGS if f in flags), "unknown")
  return "unknown"


def machine() -> dict[str, Any]:
  """The date, the machine and the versions a run was measured with."""
  cpuinfo = _cpuinfo()
  return {
      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      "cpu": _cpu_name(cpuinfo),
      "vector_isa": vector_isa(cpuinfo),
      "cores": os.cpu_count(),
      "platform": platform.platform(),
      "load_average": list(os.getloadavg()),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "flax": flax.__version__,
      "linen_moe": linen_moe.__version__,
      "env": {
          k: os.environ[k]
          for k in (
              "XLA_FLAGS",
              "OMP_WAIT_POLICY",
              "OMP_NUM_THREADS",
              host_memory.ENV,
          )
          if k in os.environ
      },
  }
