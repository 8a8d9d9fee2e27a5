"""Compiles the DMA row gather for a TPU through libtpu, without the TPU:
`pallas_gather.gather_rows` at the sparse path's real sizes (a [32768,
2048] bf16 table, 262,144 rows; float32 in both DMA forms), then a
the combine backward's gather, scale and dot (`gather_scale_dot`), the
combine's weighted sum of each token's k rows (`gather_sum`), then a
Qwen3-30B-A3B-dims MoE layer's forward + backward ([8, 4096, 2048] bf16,
`grouped_matmul="kernel"`), whose program must hold the gather kernels
(its dispatch, the dispatch again in the rematerialized backward, the
combine's backward, the combine and the dispatch's backward as sums), no
XLA gather of [R, M] or [T, M] rows and no scatter, the gate and up
projections paired (by default); and the same layer with them as two
calls (`accelerator.paired_gate_up(False)`), beside it its bytes accessed
and temporaries. Mosaic must accept each.

  python benchmarks/device/compile_gather.py [--target tpu:v5e-1] \\
      [--batch 8] [--json compile_gather.json]

Exit status 1 if any compile failed or the layer's program lacks the
kernel.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

# The kernel has no public name: the layer reaches it through
# `MoEConfig.grouped_matmul`; this compiles it alone and in the layer.
from linen_moe._src.planning import targets  # noqa: TID251

TOKENS, CHOICES, WIDTH = 32768, 8, 2048


def _record(records, what, fn):
  rec = {"what": what}
  start = time.perf_counter()
  try:
    rec.update(fn())
    rec["ok"] = rec.get("ok", True)
  except Exception as e:  # noqa: BLE001 (Mosaic's refusals are reported)
    rec["ok"], rec["error"] = False, f"{type(e).__name__}: {str(e)[:800]}"
  rec["compile_s"] = round(time.perf_counter() - start, 1)
  records.append(rec)
  detail = rec.get("error") or {
      k: v for k, v in rec.items() if k not in ("what", "ok")
  }
  print(f"{'ok' if rec['ok'] else 'FAIL'} {what}: {detail}", flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="tpu:v5e-1")
  parser.add_argument("--batch", type=int, default=8, help="rows of 4096")
  parser.add_argument("--json", help="write the records here")
  args = parser.parse_args(argv)
  target = targets.parse_target(args.target)
  targets.prepare_process(target)
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import tpu_programs  # noqa: PLC0415 (imports jax)

  from linen_moe import load_moe_config  # noqa: PLC0415
  from linen_moe._src.kernels import accelerator  # noqa: PLC0415, TID251
  from linen_moe._src.kernels.tpu import pallas_gather  # noqa: PLC0415, TID251

  device = targets.target_devices(target)[0]
  print(f"jax {jax.__version__}, {args.target}: {device.device_kind}")
  place = tpu_programs.placer(device)

  def arg(*shape, dtype=jnp.bfloat16):
    return place(shape, dtype)

  records = []
  for dtype, via, block in (
      (jnp.bfloat16, "vmem", 256),
      (jnp.bfloat16, "vmem", 512),
      (jnp.float32, "vmem", 256),
      (jnp.float32, "hbm", 256),
  ):

    def gather(dtype=dtype, via=via, block=block):
      fn = lambda x, i, v: pallas_gather.gather_rows(  # noqa: E731
          x, i, v, block_rows=block, via=via
      )
      jax.jit(fn).lower(
          arg(TOKENS, WIDTH, dtype=dtype),
          arg(TOKENS * CHOICES, dtype=jnp.int32),
          arg(dtype=jnp.int32),
      ).compile()
      return {}

    name = f"gather_rows {jnp.dtype(dtype).name} {via} {block}"
    _record(records, name, gather)

  def scale_dot():
    pallas_gather.gather_scale_dot.lower(
        arg(TOKENS, WIDTH),
        arg(TOKENS * CHOICES, dtype=jnp.int32),
        arg(TOKENS * CHOICES),
        arg(TOKENS * CHOICES, WIDTH),
    ).compile()
    return {}

  _record(records, "gather_scale_dot bfloat16 vmem 256", scale_dot)

  def weighted_sum():
    pallas_gather.gather_sum.lower(
        arg(TOKENS * CHOICES, WIDTH),
        arg(TOKENS, CHOICES, dtype=jnp.int32),
        arg(TOKENS, CHOICES, dtype=jnp.float32),
    ).compile()
    return {}

  _record(records, "gather_sum bfloat16 vmem 256", weighted_sum)

  def layer(paired=True):
    cfg = load_moe_config(
        "qwen3_30b_a3b", grouped_matmul="kernel", sparse_matmul=True
    )
    x = arg(args.batch, 4096, cfg.emb_dim)
    with accelerator.paired_gate_up(paired):
      compiled = tpu_programs.layer_gradients(cfg, x, place)
    text = compiled.as_text()
    kernels = len(
        re.findall(r"= \S+ custom-call\([^\n]*linen_moe_gather", text)
    )
    gathers = re.findall(r"= (\S+\[\d+,\d+\]\S*) gather\(", text)
    tokens = args.batch * 4096
    rows = tokens * cfg.num_experts_per_tok
    big = [
        g
        for g in gathers
        if g.split("[")[1].split(",")[0] in (f"{rows}", f"{tokens}")
    ]
    # On a TPU the routing and the sort move scalars by sorts and fused
    # compares (`layer/index_ops.py`): no scatter of a token's or an
    # assignment's values is left (the kernels' visit schedules scatter a
    # few hundred).
    scatters = [
        n
        for n in re.findall(r"= \S+\[(\d+)[,\]]\S* scatter\(", text)
        if int(n) >= tokens
    ]
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "gb_accessed": round(float(cost.get("bytes accessed", 0)) / 1e9, 1),
        "gather_kernels": kernels,
        "xla_row_gathers": big,
        "scatters": scatters,
        "sorts": len(re.findall(r" sort\(", text)),
        "temp_gb": round(getattr(mem, "temp_size_in_bytes", 0) / 1e9, 2),
        "ok": kernels >= 3 and not big and not scatters,
    }

  _record(records, f"layer fwd+bwd [{args.batch}, 4096] kernel", layer)
  _record(
      records,
      f"layer fwd+bwd [{args.batch}, 4096] kernel, gate and up unpaired",
      lambda: layer(paired=False),
  )
  failed = [r for r in records if not r["ok"]]
  print(f"{len(records) - len(failed)} of {len(records)} compiled and checked")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(records, f, indent=1)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
