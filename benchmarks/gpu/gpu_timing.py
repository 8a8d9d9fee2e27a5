"""What the GPU benchmarks share: side-by-side timing of JAX and torch calls
in one process, a deadline, the reporting arithmetic, and torch imported
only where it is there.

Every timed call is a thunk that returns when its work is done (JAX:
`jax.block_until_ready`; torch: `torch.cuda.synchronize`), so JAX programs
and torch kernels alternate in the same rounds, as `bench_gmm.py`'s
`alternating_medians` does on a TPU: one untimed call each, then rounds
that call each once in turn; the median of each.

torch is never a requirement of the library or of CI: `torch_or_none()`
answers None where it does not import, and the scripts then time JAX alone
and say so in their JSON.
"""

from __future__ import annotations

from collections.abc import Callable
import json
import math
import os
import statistics
import time
from typing import Any

# bf16 has an 8-bit significand (epsilon 7.8e-3); sums in another order
# differ by a few of those.
BF16_TOLERANCE = 2e-2


def torch_or_none():
  """The torch module, or None where it does not import."""
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    return None
  return torch


def torch_device(torch) -> str:
  """ "cuda" where torch sees a GPU, else "cpu"."""
  return "cuda" if torch is not None and torch.cuda.is_available() else "cpu"


def torch_thunk(torch, fn: Callable[[], Any]) -> Callable[[], Any]:
  """`fn` run to completion (the GPU's queue drained)."""

  def run():
    out = fn()
    if torch.cuda.is_available():
      torch.cuda.synchronize()
    return out

  return run


def jax_thunk(fn, *args) -> Callable[[], Any]:
  """`fn(*args)` run to completion."""
  import jax  # noqa: PLC0415

  return lambda: jax.block_until_ready(fn(*args))


def compile_all(jobs: dict, workers: int) -> tuple[dict, dict]:
  """({name: compiled executable}, {name: error}) of {name: (jitted fn,
  args)}, lowered and compiled `workers` at a time (XLA compiles outside
  the GIL; a GPU kernel's autotuning is most of a first call)."""
  import concurrent.futures  # noqa: PLC0415

  def build(fn, args):
    try:
      return fn.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 (a route that fails is a result)
      return e

  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    futures = {name: pool.submit(build, *job) for name, job in jobs.items()}
  done, errors = {}, {}
  for name, future in futures.items():
    got = future.result()
    if isinstance(got, Exception):
      errors[name] = f"compile: {type(got).__name__}: {got}"[:600]
    else:
      done[name] = got
  return done, errors


class Deadline:
  """A run's end, as a monotonic time: `left()` seconds, `passed()`."""

  def __init__(self, seconds: float):
    self.end = time.monotonic() + seconds

  def left(self) -> float:
    return self.end - time.monotonic()

  def passed(self) -> bool:
    return self.left() <= 0


def alternating_medians(
    thunks: dict[str, Callable[[], Any]],
    rounds: int,
    deadline: Deadline | None = None,
    warmup: int = 1,
) -> tuple[dict[str, float], dict[str, str]]:
  """({name: median seconds}, {name: error}) of `thunks`: `warmup` (at
  least one: the first compiles) untimed calls each (a call that raises is
  dropped, its error kept), then up to `rounds` rounds calling each once in
  turn, fewer where `deadline` passes (at least one timed round for each
  that warmed up)."""
  errors, live = {}, {}
  for name, thunk in thunks.items():
    try:
      for _ in range(max(warmup, 1)):
        thunk()
      live[name] = thunk
    except Exception as e:  # noqa: BLE001 (a route that fails is a result)
      errors[name] = f"{type(e).__name__}: {e}"[:600]
  samples: dict[str, list[float]] = {name: [] for name in live}
  for r in range(rounds):
    if r and deadline is not None and deadline.passed():
      break
    for name, thunk in live.items():
      start = time.perf_counter()
      thunk()
      samples[name].append(time.perf_counter() - start)
  return {n: statistics.median(s) for n, s in samples.items() if s}, errors


def call_medians(
    calls: dict[str, tuple[Callable[..., Any], tuple]],
    rounds: int,
    warmup: int = 1,
) -> dict[str, float]:
  """{name: median seconds} of {name: (jitted call, its arguments)} by
  `alternating_medians`; a call that fails raises (a kernel's own
  benchmark has no other route to report)."""
  thunks = {
      name: jax_thunk(call, *args) for name, (call, args) in calls.items()
  }
  seconds, errors = alternating_medians(thunks, rounds, warmup=warmup)
  if errors:
    raise RuntimeError(f"timed calls failed: {errors}")
  return seconds


# -- the reporting arithmetic (benchmarks/tests checks it) -----------------


def fractions(ms: dict[str, float], base: str = "dense") -> dict[str, float]:
  """{name: `base` ms / its ms}: > 1 is faster than `base`; empty without
  `base`."""
  if base not in ms:
    return {}
  return {name: ms[base] / t for name, t in ms.items() if t > 0}


def tflops(flops: float, ms: float) -> float:
  """TFLOP/s of `flops` in `ms` milliseconds."""
  return flops / (ms * 1e-3) / 1e12


def grouped_flops(m: int, k: int, n: int) -> float:
  """FLOPs of a grouped matmul's forward + backward (out, input and weight
  gradients): three [M, K] x [K, N] products."""
  return 3.0 * 2 * m * k * n


def relative_errors(got, want) -> dict[str, float]:
  """max |got - want| / max |want| ("max") and ||got - want|| / ||want||
  ("norm") of two arrays (NumPy, JAX or torch, any float type), in
  float64 on the host. "norm" tolerates a few tokens routed to another
  expert by a near tie (bf16 router logits against float32)."""
  import numpy as np  # noqa: PLC0415

  g, w = _host(got), _host(want)
  if g.shape != w.shape:
    raise ValueError(f"shapes differ: {g.shape} against {w.shape}.")
  diff = g - w
  scale = np.max(np.abs(w))
  norm = np.linalg.norm(w)
  return {
      "max": float(np.max(np.abs(diff)) / scale) if scale else math.inf,
      "norm": float(np.linalg.norm(diff) / norm) if norm else math.inf,
  }


def _host(x):
  import numpy as np  # noqa: PLC0415

  if hasattr(x, "detach"):  # a torch tensor
    x = x.detach().float().cpu().numpy()
  return np.asarray(x, np.float64)


def agree(errors: dict[str, float], tolerance: float = BF16_TOLERANCE) -> bool:
  """Whether a `relative_errors` result is within bf16 rounding."""
  return errors["norm"] <= tolerance


def write_json(out: str, name: str, result: dict) -> str:
  """Writes `result` to out/name (a run cut short keeps what it wrote)."""
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, name)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1, default=str)
  return path


def device_fields() -> dict:
  """The backend, first device's kind and jax version a result was
  measured with."""
  import jax  # noqa: PLC0415

  return {
      "backend": jax.default_backend(),
      "device_kind": jax.devices()[0].device_kind,
      "jax": jax.__version__,
  }


def environment() -> dict:
  """The date, jax's device and versions, torch's where it imports."""
  import datetime  # noqa: PLC0415

  import jax  # noqa: PLC0415

  torch = torch_or_none()
  d = jax.devices()[0]
  env = {
      "date": datetime.date.today().isoformat(),
      "jax": jax.__version__,
      "device_kind": d.device_kind,
      "platform": d.platform,
      "torch": getattr(torch, "__version__", None),
  }
  if torch is not None and torch.cuda.is_available():
    env["torch_device"] = torch.cuda.get_device_name()
  return env
