"""Benchmark sweeps, the printed table, the JSON file and the PNG chart."""

from __future__ import annotations

import dataclasses
import json
import os
import time

from linen_moe.config import PATHS
from linen_moe_cli.bench import SIZES
from linen_moe_cli.bench import Case
from linen_moe_cli.bench import run_case_subprocess

SWEEPS = ("sizes", "implementations", "experts", "capacity")


def sweep_cases(
    sweep: str, quantizations=("none",), targets=("layer",)
) -> list[Case]:
  """The cases of one named sweep."""
  if sweep == "sizes":
    return [
        Case(size, path, q, t)
        for size in SIZES
        for path in PATHS
        for q in quantizations
        for t in targets
    ]
  if sweep == "implementations":
    return [
        Case("medium", "sparse", q, implementation=impl)
        for q in quantizations
        for impl in ("ragged_dot", "blocked")
    ]
  if sweep == "experts":
    return [
        Case(f"E={e}", path, dims=(4, 128, 256, 512, e, 2))
        for path in ("sparse", "dense")
        for e in (8, 16, 32, 64)
    ]
  if sweep == "capacity":
    dims = (8, 512, 256, 512, 32, 2)
    return [
        Case(f"cf={cf}", "dense_dropping", dims=dims, capacity_factor=cf)
        for cf in (0.5, 1.0, 2.0, 4.0)
    ] + [Case("dropless", "dense", dims=dims)]
  raise ValueError(f"Unknown sweep {sweep!r}; allowed: {SWEEPS}.")


def _row(case: Case, result: dict, roofline_gflops: float) -> dict:
  row = dataclasses.asdict(case)
  row.update(result)
  if "useful_gflops" in result:
    roofline = result.get("roofline_gflops", roofline_gflops)
    row["roofline_fraction"] = result["useful_gflops"] / roofline
  return row


def format_rows(rows: list[dict]) -> str:
  head = (
      f"{'case':<16}{'path':<16}{'quant':<10}{'target':<14}{'impl':<11}"
      f"{'step ms':>9}{'tok/s':>10}{'GFLOP/s':>9}{'roofl.':>8}"
      f"{'compile s':>10}{'RSS MiB':>9}"
  )
  lines = [head]
  for r in rows:
    if "error" in r:
      lines.append(
          f"{r['size']:<16}{r['path']:<16}{r['quantization']:<10}"
          f"{r['target']:<14}{r['implementation']:<11}  ERROR "
          f"{r['error']}"
      )
      continue
    lines.append(
        f"{r['size']:<16}{r['path']:<16}{r['quantization']:<10}"
        f"{r['target']:<14}{r['implementation']:<11}"
        f"{1e3 * r['step_s']:>9.1f}{r['tokens_per_s']:>10.0f}"
        f"{r['useful_gflops']:>9.1f}{r['roofline_fraction']:>8.2f}"
        f"{r['compile_s']:>10.1f}{r['max_rss_mib']:>9.0f}"
    )
  return "\n".join(lines)


def write_chart(rows: list[dict], path: str) -> None:
  """Throughput (tokens/s) vs size, one line per path, per quantization."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  sized = [
      r
      for r in rows
      if r["size"] in SIZES
      and "error" not in r
      and r["implementation"] == "auto"
      and r["target"] == "layer"
  ]
  quants = sorted({r["quantization"] for r in sized}) or ["none"]
  fig, axes = plt.subplots(
      1, len(quants), figsize=(5 * len(quants), 4), squeeze=False
  )
  for ax, q in zip(axes[0], quants, strict=True):
    for p in PATHS:
      pts = [
          (list(SIZES).index(r["size"]), r["tokens_per_s"])
          for r in sized
          if r["path"] == p and r["quantization"] == q
      ]
      if pts:
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
    ax.set_xticks(range(len(SIZES)), list(SIZES))
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (fwd+bwd)")
    ax.set_title(f"RoutedMoE, quantization={q}")
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def run(
    sweeps,
    quantizations,
    targets,
    repeats: int,
    out_dir: str,
    log=print,
    chart: bool = True,
) -> list[dict]:
  """Runs the sweeps; prints and writes `bench.json` and (with `chart`, which
  needs matplotlib) `bench.png`."""
  start = time.perf_counter()
  roofline = run_case_subprocess(Case("medium", "roofline"), repeats)
  if "error" in roofline:
    raise RuntimeError(f"roofline measurement failed: {roofline['error']}")
  log(
      "dense matmul roofline (fwd+bwd, 8192x512 @ 512x1024 float32): "
      f"{roofline['gflops']:.1f} GFLOP/s"
  )
  rows = []
  for sweep in sweeps:
    cases = sweep_cases(sweep, quantizations, targets)
    sweep_rows = [
        _row(c, run_case_subprocess(c, repeats), roofline["gflops"])
        for c in cases
    ]
    log(f"\n== sweep: {sweep}")
    log(format_rows(sweep_rows))
    rows.extend(dict(r, sweep=sweep) for r in sweep_rows)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "bench.json"), "w", encoding="utf-8") as f:
    json.dump({"roofline": roofline, "rows": rows}, f, indent=1)
  written = [f"{out_dir}/bench.json"]
  if chart:
    write_chart(rows, os.path.join(out_dir, "bench.png"))
    written.append(f"{out_dir}/bench.png")
  log(f"\nwrote {' and '.join(written)} ({time.perf_counter() - start:.0f}s)")
  return rows
