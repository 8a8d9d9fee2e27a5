"""Forward+backward of the MoE layer across sizes, paths and quantizations.

  python benchmarks/layer/bench_moe.py
  python benchmarks/layer/bench_moe.py --sweep sizes experts \\
      --quantization none fp8

Each case runs in its own process (this script with `--case`), so that its
peak memory (max RSS) is its own; the dense-matmul roofline is measured in
the same run, after each case, so ratios stay meaningful on a shared, noisy
machine. Prints a table per sweep and writes `bench.json` and (with
matplotlib) `bench.png` under `--out` (`moe_report.py`). Formerly
`linen-moe bench`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import linen_moe

from common import child
from common import layer_case
import moe_report

# Where results go by default: benchmarks/results, beside this folder.
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"


def run_case_subprocess(
    case: layer_case.Case, repeats: int, timeout: float = 900
) -> dict[str, Any]:
  """`layer_case.run_case` in a fresh Python; adds its peak RSS (MiB)."""
  return child.run_json(
      [
          os.path.abspath(__file__),
          "--case",
          json.dumps(dataclasses.asdict(case)),
          "--repeats",
          str(repeats),
      ],
      timeout=timeout,
  )


def case_main(case_json: str, repeats: int) -> int:
  """One case in this process: its figures and peak RSS as a JSON line."""
  import resource  # noqa: PLC0415

  fields = json.loads(case_json)
  fields["dims"] = tuple(fields.get("dims") or ())
  result = layer_case.run_case(layer_case.Case(**fields), repeats)
  result["max_rss_mib"] = (
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  )
  print(json.dumps(result))
  return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument(
      "--sweep",
      nargs="+",
      default=list(moe_report.SWEEPS),
      choices=moe_report.SWEEPS,
  )
  p.add_argument(
      "--quantization",
      nargs="+",
      choices=tuple(linen_moe.quantization.MODES),
      default=["none"],
  )
  p.add_argument(
      "--target",
      nargs="+",
      choices=("layer", "decoder_layer"),
      default=["layer"],
  )
  p.add_argument(
      "--dtype",
      nargs="+",
      choices=("float32", "bfloat16"),
      default=["float32", "bfloat16"],
      help="compute/weight dtypes of the sizes sweep (default: both)",
  )
  p.add_argument(
      "--peer",
      default=None,
      metavar="JSON",
      help=(
          "another library's results for the same cases (see moe_report.py),"
          " shown beside ours in the table and the chart"
      ),
  )
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out", default=str(RESULTS))
  p.add_argument("--case", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.repeats < 1:
    p.error(f"--repeats must be >= 1; got {args.repeats}.")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.case:
    return case_main(args.case, args.repeats)
  chart = importlib.util.find_spec("matplotlib") is not None
  if not chart:
    print(
        "bench_moe: matplotlib is not installed, so the chart (bench.png) is"
        " skipped; bench.json is written (pip install matplotlib)",
        file=sys.stderr,
    )
  rows = moe_report.run(
      args.sweep,
      args.quantization,
      tuple(args.target),
      args.repeats,
      args.out,
      run_case_subprocess,
      dtypes=tuple(args.dtype),
      peer_path=args.peer,
      chart=chart,
  )
  return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
