"""Where a compiled program spends its time: XLA op times from
`jax.profiler`, for `layer/profile_case.py` and `model/profile_model.py`."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import tempfile

import jax

# Host-side events of the profiler, not ops of the program.
_NOT_OPS = ("ThunkExecutor", "$", "Pjit", "Slinky", "CommonPjRt", "PjRt")


def op_times(run, steps: int) -> collections.Counter:
  """Milliseconds per call of each XLA op `run()` executes (mean over
  `steps` calls under `jax.profiler`, after one call outside it), by op
  name (fusions by their HLO name).

  Self time: an op that contains others on its thread (a `while`, a `call`)
  counts only the time its children do not, so the sum is the work done.
  """
  jax.block_until_ready(run())
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(steps):
        jax.block_until_ready(run())
    (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as f:
      events = json.load(f)["traceEvents"]
  by_thread = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and not e["name"].startswith(_NOT_OPS):
      by_thread[e.get("pid"), e.get("tid")].append(e)
  total = collections.Counter()
  for thread in by_thread.values():
    thread.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []  # [end, event], outermost first
    for e in thread:
      while stack and stack[-1][0] <= e["ts"]:
        stack.pop()
      if stack:  # a child: not the parent's own time
        total[stack[-1][1]["name"]] -= e["dur"] / 1e3 / steps
      total[e["name"]] += e["dur"] / 1e3 / steps  # ms per call
      stack.append((e["ts"] + e["dur"], e))
  return total
