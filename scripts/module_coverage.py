"""Which modules of the packages a pytest run enters, and which it never does.

The oldest-jax run of .ci/run is a subset of the suite
(.ci/oldest_tests.txt) that must run code in every module; this measures
that. It runs pytest under PYTHON with a `sys.monitoring` tracer loaded by
a `sitecustomize` (so xdist workers and the tests' subprocesses are traced
too) that records each module of linen_moe, nnx_adapter and linen_moe_cli
one of whose functions starts (module and class bodies, which run at
import, do not count). Each function is recorded once, so the run is about
as fast as without it. Then it prints the modules that have functions but
none entered.

  python scripts/module_coverage.py [--python PY] -- PYTEST_ARGS ...
  python scripts/module_coverage.py --python /tmp/old/bin/python -- \\
      -n 2 -q $(grep -v '^#' .ci/oldest_tests.txt)
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("linen_moe", "nnx_adapter", "linen_moe_cli")
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

# The tracer: CO_OPTIMIZED (flag 1) marks function bodies, not the module or
# class bodies that import runs; comprehensions and generator expressions
# ("<genexpr>") run where they are written.
TRACER = """\
import json, os, sys
_OUT = os.environ.get("MODULE_COVERAGE")
if _OUT:
  _PACKAGES = tuple(f"/{{p}}/" for p in {packages!r})
  _seen = set()
  def _start(code, offset):
    name = code.co_filename
    if code.co_flags & 1 and (not code.co_name.startswith("<")
                              or code.co_name == "<lambda>"):
      for package in _PACKAGES:
        if package in name:
          module = package[1:] + name.rsplit(package, 1)[1]
          if module not in _seen:
            _seen.add(module)
            with open(os.path.join(_OUT, f"{{os.getpid()}}.txt"), "a") as f:
              f.write(module + "\\n")
          break
    return sys.monitoring.DISABLE
  sys.monitoring.use_tool_id(4, "module_coverage")
  sys.monitoring.register_callback(4, sys.monitoring.events.PY_START, _start)
  sys.monitoring.set_events(4, sys.monitoring.events.PY_START)
"""


def modules_with_functions(root: pathlib.Path = ROOT) -> list[str]:
  """The packages' modules that define a function (relative paths)."""
  out = []
  for package in PACKAGES:
    for path in sorted((root / package).rglob("*.py")):
      tree = ast.parse(path.read_text())
      if any(isinstance(node, _FUNCTIONS) for node in ast.walk(tree)):
        out.append(path.relative_to(root).as_posix())
  return out


def entered(pytest_args: list[str], python: str) -> set[str]:
  """The modules one of whose functions started during the pytest run."""
  with tempfile.TemporaryDirectory() as tmp:
    site, out = pathlib.Path(tmp, "site"), pathlib.Path(tmp, "out")
    site.mkdir()
    out.mkdir()
    (site / "sitecustomize.py").write_text(TRACER.format(packages=PACKAGES))
    env = dict(os.environ, MODULE_COVERAGE=str(out))
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(site), env.get("PYTHONPATH")])
    )
    subprocess.run(
        [python, "-m", "pytest", *pytest_args], cwd=ROOT, env=env, check=False
    )
    return {
        line
        for path in out.glob("*.txt")
        for line in path.read_text().splitlines()
    }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--python", default=sys.executable)
  parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  pytest_args = [a for a in args.pytest_args if a != "--"]
  universe = modules_with_functions()
  seen = entered(pytest_args, args.python)
  missing = [m for m in universe if m not in seen]
  print(
      f"{len(universe) - len(missing)} of {len(universe)} modules with"
      " functions entered; never entered:"
  )
  print("\n".join(f"  {m}" for m in missing) or "  none")
  print(
      json.dumps({"entered": len(universe) - len(missing), "of": len(universe)})
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
