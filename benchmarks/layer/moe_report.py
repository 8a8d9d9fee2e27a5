"""The layer benchmark's sweeps, peer results, printed table, JSON file and
PNG chart (`bench_moe.py` runs them).

A peer file is JSON measured elsewhere (e.g. MaxText's MoE layer on the same
machine, forward+backward of the same shapes), so that both libraries share
one table and one chart (`--peer`):

  {"name": "MaxText 0.2.5",
   "rows": [{"size": "gemma_like", "path": "dense_dropping",
             "dtype": "float32", "step_s": 1.64}, ...]}

`size` is a key of `layer_case.SIZES` (or a sweep's case name such as
"E=64"), `path` one of `linen_moe.MATMUL_PATHS`, `dtype` defaults to float32. A
row may carry "error" instead of "step_s" (e.g. out of memory).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import json
import os
import time
from typing import Any

import linen_moe

from common.layer_case import SIZES
from common.layer_case import Case


def load_peer(path: str) -> dict[str, Any]:
  """Reads and checks a peer file; ValueError names what is wrong."""
  try:
    with open(path, encoding="utf-8") as f:
      peer = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"--peer {path!r}: cannot read JSON ({e}).") from e
  if not isinstance(peer, dict) or not isinstance(peer.get("rows"), list):
    raise ValueError(
        f"--peer {path!r}: expected an object with a 'rows' list; got"
        f" {type(peer).__name__} with keys"
        f" {sorted(peer) if isinstance(peer, dict) else []}."
    )
  peer.setdefault("name", "peer")
  for i, row in enumerate(peer["rows"]):
    missing = {"size", "path"} - set(row)
    if missing or not ("step_s" in row or "error" in row):
      raise ValueError(
          f"--peer {path!r}: row {i} {row} needs 'size', 'path' and "
          "'step_s' (seconds) or 'error'."
      )
    row.setdefault("dtype", "float32")
  return peer


def peer_row(peer: dict[str, Any] | None, row: dict[str, Any]):
  """The peer's row for our `row` (same size, path, dtype), or None."""
  if peer is None:
    return None
  for p in peer["rows"]:
    if (p["size"], p["path"], p["dtype"]) == (
        row["size"],
        row["path"],
        row.get("dtype", "float32"),
    ):
      return p
  return None


SWEEPS = ("sizes", "implementations", "experts", "capacity")


def sweep_cases(
    sweep: str,
    quantizations=("none",),
    targets=("layer",),
    dtypes=("float32",),
) -> list[Case]:
  """The cases of one named sweep (`dtypes` applies to the sizes sweep)."""
  if sweep == "sizes":
    return [
        Case(size, path, q, t, dtype=dtype)
        for size in SIZES
        for path in linen_moe.MATMUL_PATHS
        for dtype in dtypes
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


def format_rows(rows: list[dict], peer: dict | None = None) -> str:
  """The table; with a peer, its step time and ours / peer per row."""
  head = (
      f"{'case':<12}{'path':<16}{'dtype':<10}{'quant':<10}{'target':<14}"
      f"{'impl':<11}{'step ms':>9}{'tok/s':>9}{'GFLOP/s':>9}{'roofl.':>7}"
      f"{'cpu r.':>7}{'compile s':>10}{'RSS MiB':>9}"
  )
  if peer is not None:
    head += f"{'peer ms':>9}{'ours/peer':>10}"
  lines = [head]
  for r in rows:
    first = (
        f"{r['size']:<12}{r['path']:<16}{r.get('dtype', 'float32'):<10}"
        f"{r['quantization']:<10}{r['target']:<14}{r['implementation']:<11}"
    )
    if "error" in r:
      lines.append(f"{first}  ERROR {r['error']}")
      continue
    line = (
        f"{first}{1e3 * r['step_s']:>9.1f}{r['tokens_per_s']:>9.0f}"
        f"{r['useful_gflops']:>9.1f}{r['roofline_fraction']:>7.2f}"
        f"{r.get('cpu_roofline_fraction', float('nan')):>7.2f}"
        f"{r['compile_s']:>10.1f}{r['max_rss_mib']:>9.0f}"
    )
    theirs = peer_row(peer, r)
    if theirs is not None and "step_s" in theirs:
      line += (
          f"{1e3 * theirs['step_s']:>9.1f}"
          f"{r['step_s'] / theirs['step_s']:>10.2f}"
      )
    elif theirs is not None:
      line += f"  peer: {theirs['error']}"
    lines.append(line)
  return "\n".join(lines)


def write_chart(rows: list[dict], path: str, peer: dict | None = None) -> None:
  """Step time (fwd+bwd, log scale) vs size, one line per path, one panel per
  dtype and quantization; the black line is the matmul roofline (the case's
  useful FLOPs at the dense matmul's GFLOP/s measured beside it); a peer's
  times are dashed in the path's colour."""
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
  panels = sorted(
      {(r.get("dtype", "float32"), r["quantization"]) for r in sized}
  )
  panels = panels or [("float32", "none")]
  fig, axes = plt.subplots(
      1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False
  )
  sizes = list(SIZES)
  for ax, (dtype, q) in zip(axes[0], panels, strict=True):
    here = [
        r
        for r in sized
        if r.get("dtype", "float32") == dtype and r["quantization"] == q
    ]
    for i, p in enumerate(linen_moe.MATMUL_PATHS):
      color = f"C{i}"
      ours = sorted(
          (sizes.index(r["size"]), r["step_s"]) for r in here if r["path"] == p
      )
      if ours:
        ax.plot(*zip(*ours, strict=True), marker="o", color=color, label=p)
      theirs = sorted(
          (sizes.index(r["size"]), t["step_s"])
          for r in here
          if r["path"] == p
          and (t := peer_row(peer, r)) is not None
          and "step_s" in t
      )
      if theirs:
        ax.plot(
            *zip(*theirs, strict=True),
            marker="x",
            linestyle="--",
            color=color,
            label=f"{p} ({peer['name']})",
        )
    roofline = {}
    for r in here:  # useful GFLOP / roofline GFLOP/s, per size
      seconds = r["useful_gflops"] * r["step_s"] / r["roofline_gflops"]
      roofline.setdefault(sizes.index(r["size"]), []).append(seconds)
    if roofline:
      xs = sorted(roofline)
      ys = [sorted(roofline[x])[len(roofline[x]) // 2] for x in xs]
      ax.plot(xs, ys, color="black", linestyle=":", label="matmul roofline")
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_yscale("log")
    ax.set_ylabel("step seconds (fwd+bwd)")
    ax.set_title(f"RoutedMoE, {dtype}, quantization={q}")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def run(
    sweeps,
    quantizations,
    targets,
    repeats: int,
    out_dir: str,
    run_case: Callable[[Case, int], dict],
    log=print,
    dtypes=("float32",),
    peer_path: str | None = None,
    chart: bool = True,
) -> list[dict]:
  """Runs the sweeps; prints and writes `bench.json` and (with `chart`, which
  needs matplotlib) `bench.png`.

  `run_case(case, repeats)`: a case's figures (its own process, in
  `bench_moe.py`). `peer_path`: a peer results file (the module docstring),
  shown beside ours.
  """
  peer = load_peer(peer_path) if peer_path else None
  start = time.perf_counter()
  roofline = run_case(Case("medium", "roofline"), repeats)
  if "error" in roofline:
    raise RuntimeError(f"roofline measurement failed: {roofline['error']}")
  log(
      "dense matmul roofline (fwd+bwd, 8192x512 @ 512x1024 float32): "
      f"{roofline['gflops']:.1f} GFLOP/s"
  )
  if peer is not None:
    log(f"peer: {peer['name']} ({len(peer['rows'])} rows from {peer_path})")
  rows = []
  for sweep in sweeps:
    cases = sweep_cases(sweep, quantizations, targets, dtypes)
    sweep_rows = [
        _row(c, run_case(c, repeats), roofline["gflops"]) for c in cases
    ]
    log(f"\n== sweep: {sweep}")
    log(format_rows(sweep_rows, peer))
    rows.extend(dict(r, sweep=sweep) for r in sweep_rows)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "bench.json"), "w", encoding="utf-8") as f:
    json.dump({"roofline": roofline, "rows": rows, "peer": peer}, f, indent=1)
  written = [f"{out_dir}/bench.json"]
  if chart:
    write_chart(rows, os.path.join(out_dir, "bench.png"), peer)
    written.append(f"{out_dir}/bench.png")
  log(f"\nwrote {' and '.join(written)} ({time.perf_counter() - start:.0f}s)")
  return rows
