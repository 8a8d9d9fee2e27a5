"""A measurement in a fresh Python process: its figures as one JSON line.

A fresh process has its own peak memory (max RSS), compiles from scratch,
and can import another checkout of the library (`PYTHONPATH`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_json(
    args: list[str], *, pythonpath: str | None = None, timeout: float = 1800
) -> dict[str, Any]:
  """The last line that `python ARGS` prints, read as JSON.

  Args:
    args: the script and its arguments.
    pythonpath: a directory put first on the child's PYTHONPATH (an older
      checkout of the library); None: the installed package.
    timeout: seconds before the child is stopped.

  Returns:
    The child's figures; or {"error": ...} with the last line of its stderr
    when it fails, or the timeout when it runs past it.
  """
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  if pythonpath is not None:
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, (pythonpath, env.get("PYTHONPATH")))
    )
  try:
    proc = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f}s"}
  if proc.returncode:
    return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
  return json.loads(proc.stdout.strip().splitlines()[-1])
