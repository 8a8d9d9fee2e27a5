"""What runs each contraction of the compiled GPU train step.

Compiles (never runs) the train step, forward + backward, of the MoE layer
(`RoutedMoE`: gradients of the parameters, of the input and, for fp8, of
the `_overwrite_with_gradient` collection) and of the tiny decoder (the
Linen front end's sharded step with AdamW, as `linen-moe plan` compiles
it), for each quantization x path and, on the sparse path, each
grouped-matmul route, and reads from each optimised program
(`linen_moe._src.hlo.gemms`), per contraction: the operand element types
the GEMM multiplies, whether they are native quantized types (s8, f8...),
what runs it (a cuBLAS / cuBLASLt custom call such as
`__cublas$lt$matmul$f8`, a Triton fusion, an XLA dot), whether a quantized
input is converted to a float first (inside the GEMM's fusion, or by an op
that writes the float copy to memory), the scalar scales fused into its
call, and its FLOPs; per program the temporaries (`memory_analysis`), the
compiler's FLOPs where it gives them and the contractions' FLOPs summed.

`--probe` adds one fp8 contraction, forward + backward, in the two forms
Flax offers: quantize-dequantize around a float dot (`fp8_ops.in_qdq` /
`out_qdq`: what this library's fp8 modes do) and the direct fp8 x fp8 dot
with the scales applied to its result (`fp8_ops.fp8_scaled_dot_general`).

Without a GPU (jax[cuda13]: the CUDA plugin's topology, as `linen-moe plan
--target gpu:h200-1` compiles), nothing is autotuned: XLA keeps its default
choice of emitter (Triton for the GEMM fusions it forms; `--xla-flags
--xla_gpu_enable_triton_gemm=false` shows the cuBLAS rewrites instead). On
the GPU itself, pass `--target local`.

  python benchmarks/gpu/compiled_contractions.py [--target gpu:h200-1] \\
      [--programs layer decoder] [--quantizations none int8 fp8 nanoo_fp8] \\
      [--paths sparse dense dense_dropping] [--routes ragged_dot blocked] \\
      [--probe] [--xla-flags ...] [--json compiled_contractions.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import warnings

# The reader and the target plumbing have no public names.
from linen_moe._src.hlo import gemms as gemms_lib  # noqa: TID251
from linen_moe._src.hlo import reading  # noqa: TID251
from linen_moe._src.planning import targets  # noqa: TID251

PROGRAMS = ("layer", "decoder")
QUANTIZATIONS = ("none", "int8", "fp8", "nanoo_fp8")
PATHS = ("sparse", "dense", "dense_dropping")
# Routes: the layer's `grouped_matmul` values, and the GPU registry's
# entries run as `"kernel"` (`kernels/gpu/routes.py`).
SETTINGS = ("ragged_dot", "blocked", "auto")
KERNELS = (
    "pallas_triton",
    "pallas_triton_gmm",
    "tokamax",
    "tokamax_mosaic",
    "tokamax_triton",
)
ROUTES = SETTINGS + KERNELS
_SITE = re.compile(r"/(\w+?)_dot[/.]")


def site_of(op_name: str) -> str:
  """The contraction site an op path names ("wi_0", "wo", "dispatch", ...),
  "other" where none (the router's gate, attention, the logits)."""
  match = _SITE.search(op_name)
  return match.group(1) if match else "other"


def summarize(found: list, expert_sites=("wi_0", "wi_1", "wo")) -> dict:
  """A program's contractions, counted: all of them, and the expert
  matmuls' (`expert_sites`) apart, each by "route:lhs x rhs[:converted]";
  the native ones; their FLOPs."""
  experts = [g for g in found if site_of(g.op_name) in expert_sites]
  return {
      "contractions": gemms_lib.summary(found),
      "expert": gemms_lib.summary(experts),
      "expert_native": sum(g.native for g in experts),
      "expert_count": len(experts),
      "expert_fused_scales": sorted({g.scales for g in experts}),
      "native_types": sorted(
          {t for g in found if g.native for t in g.operand_types}
      ),
      "hlo_flops": sum(g.flops for g in found),
  }


@contextlib.contextmanager
def route_context(route: str, platform: str):
  """(the layer's `grouped_matmul` value, inside): a registry entry runs as
  "kernel", `registry.KERNEL[platform]` pointing at it meanwhile."""
  if route in SETTINGS:
    yield route
    return
  from linen_moe._src.kernels import registry  # noqa: PLC0415, TID251

  key = f"gpu/{route}"
  registry.get(key)  # a ValueError naming the registered ones
  saved = registry.KERNEL.get(platform)
  registry.KERNEL[platform] = key
  try:
    yield "kernel"
  finally:
    if saved is None:
      registry.KERNEL.pop(platform)
    else:
      registry.KERNEL[platform] = saved


def _layer_step(cfg, device, batch: int, seq: int):
  """The MoE layer's forward + backward, lowered for `device`."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from linen_moe import RoutedMoE  # noqa: PLC0415

  mesh = jax.sharding.Mesh([device], ("x",))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  x = jax.ShapeDtypeStruct((batch, seq, cfg.emb_dim), jnp.bfloat16)
  shapes = jax.eval_shape(
      RoutedMoE(cfg.replace(grouped_matmul="ragged_dot")).init,
      jax.random.key(0),
      x,
  )
  place = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=whole)  # noqa: E731
  variables = jax.tree.map(place, shapes)
  x = place(x)

  def loss(variables, x):
    y, aux = RoutedMoE(cfg).apply(
        variables, x, rngs={"params": jax.random.key(1)}
    )
    return jnp.sum(y.astype(jnp.float32)) + aux.load_balance_loss

  with jax.set_mesh(mesh):
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables, x)


def _decoder_step(cfg, device, batch: int, seq: int):
  """The decoder's train step (AdamW), lowered as `linen-moe plan` does."""
  from linen_moe._src.parallel import sharding  # noqa: PLC0415, TID251
  from linen_moe._src.planning import plan as plan_lib  # noqa: PLC0415, TID251
  from linen_moe.training import default_optimizer  # noqa: PLC0415

  fe = plan_lib._default_frontend()  # noqa: SLF001
  mesh = sharding.make_mesh("data=1", [device])
  lowered, _ = plan_lib._compile_train(  # noqa: SLF001
      cfg, mesh, batch, seq, 1, default_optimizer(), fe.sharded, fe
  )
  return lowered


def compile_cell(
    program: str,
    quantization: str,
    path: str,
    route: str,
    device,
    *,
    config: str = "tiny_mixtral",
    batch: int = 2,
    seq: int = 64,
    keep_text: bool = False,
) -> dict:
  """Compiles one cell for `device`; its record (an "error" instead of
  the reading where it does not compile)."""
  from linen_moe import MATMUL_PATHS  # noqa: PLC0415
  from linen_moe import load_model_config  # noqa: PLC0415

  record = {
      "program": program,
      "config": config,
      "quantization": quantization,
      "path": path,
      "route": route if path == "sparse" else "einsum",
  }
  platform = (
      "gpu" if device.platform in ("cuda", "rocm", "gpu") else (device.platform)
  )
  try:
    with (
        route_context(route, platform) as setting,
        warnings.catch_warnings(record=True) as caught,
    ):
      warnings.simplefilter("always")
      cfg = load_model_config(
          config,
          quantization=quantization,
          grouped_matmul=setting,
          dtype="bfloat16",
          **MATMUL_PATHS[path],
      )
      start = time.perf_counter()
      if program == "layer":
        lowered = _layer_step(cfg.moe, device, batch, seq)
      else:
        lowered = _decoder_step(cfg, device, batch, seq)
      compiled = lowered.compile()
      record["compile_s"] = round(time.perf_counter() - start, 1)
    record["warnings"] = sorted(
        {f"{w.category.__name__}: {str(w.message)[:160]}" for w in caught}
    )
  except Exception as e:  # noqa: BLE001 (a cell records any failure)
    record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return record
  text = compiled.as_text()
  found = gemms_lib.gemms(text)
  stats = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  record.update(summarize(found))
  record["compiler_flops"] = cost.get("flops")
  record["temp_bytes"] = (
      None if stats is None else int(stats.temp_size_in_bytes)
  )
  record["argument_bytes"] = (
      None if stats is None else int(stats.argument_size_in_bytes)
  )
  record["custom_call_targets"] = sorted(
      set(re.findall(r'custom_call_target="([^"]*)"', text))
  )
  record["kernel_calls"] = gemms_lib.kernel_calls(text)
  # Anywhere in the program, not only at a contraction: XLA:GPU may drop
  # a round trip through a narrow type altogether.
  record["quantized_types_in_program"] = sorted(
      reading.quantized_types_in_hlo(text)
  )
  record["gemms"] = gemms_lib.to_json(found)
  if keep_text:
    record["hlo"] = text
  return record


def probe(device, m: int = 1024, k: int = 2048, n: int = 4096) -> list[dict]:
  """One fp8 contraction [m, k] x [k, n], forward + backward, in Flax's
  two forms ("qdq": `in_qdq` / `out_qdq` around a bf16 dot, as this
  library's fp8 modes; "direct": `fp8_scaled_dot_general`, fp8 x fp8),
  compiled for `device`; each form's record."""
  from flax.linen import fp8_ops  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  mesh = jax.sharding.Mesh([device], ("x",))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  spec = lambda s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d, sharding=whole)  # noqa: E731
  dims = (((1,), (0,)), ((), ()))
  e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2

  def qdq(a, b, s, h):
    qa = fp8_ops.in_qdq(jnp.bfloat16, e4m3, a, s[0], h[0])
    qb = fp8_ops.in_qdq(jnp.bfloat16, e4m3, b, s[1], h[1])
    y = jax.lax.dot_general(qa, qb, dims, preferred_element_type=jnp.float32)
    y = y.astype(jnp.bfloat16)
    return fp8_ops.out_qdq(jnp.bfloat16, e5m2, y, s[2], h[2])

  def direct(a, b, s, h):
    return fp8_ops.fp8_scaled_dot_general(
        a,
        b,
        dims,
        preferred_element_type=jnp.bfloat16,
        lhs_scale=s[0],
        rhs_scale=s[1],
        grad_scale=s[2],
        lhs_amax_history=h[0],
        rhs_amax_history=h[1],
        grad_amax_history=h[2],
        quantize_compute_type=jnp.bfloat16,
    )

  records = []
  for form, fn in (("qdq", qdq), ("direct", direct)):
    # A square, so that the forward's result is used by the backward.
    loss = lambda a, b, s, h, fn=fn: jnp.sum(  # noqa: E731
        jnp.square(fn(a, b, s, h).astype(jnp.float32))
    )
    scales = [spec((1,), jnp.float32)] * 3
    histories = [spec((16,), jnp.float32)] * 3
    with jax.set_mesh(mesh):
      compiled = (
          jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
          .lower(spec((m, k)), spec((k, n)), scales, histories)
          .compile()
      )
    found = gemms_lib.gemms(compiled.as_text())
    stats = compiled.memory_analysis()
    records.append({
        "program": "probe",
        "form": form,
        "shape": [m, k, n],
        "contractions": gemms_lib.summary(found),
        "native": sum(g.native for g in found),
        "count": len(found),
        "fused_scales": sorted({g.scales for g in found}),
        "temp_bytes": None if stats is None else int(stats.temp_size_in_bytes),
        "gemms": gemms_lib.to_json(found),
    })
  return records


def _device(target_name: str):
  import jax  # noqa: PLC0415

  if target_name == "local":
    return jax.devices()[0]
  return targets.target_devices(targets.parse_target(target_name))[0]


def _cells(args) -> list[tuple[str, str, str, str]]:
  cells = []
  for program in args.programs:
    for quantization in args.quantizations:
      for path in args.paths:
        routes = args.routes if path == "sparse" else args.routes[:1]
        cells += [(program, quantization, path, r) for r in routes]
  return cells


def _line(record: dict) -> str:
  head = (
      f"{record['program']:7s} {record['quantization']:9s} "
      f"{record['path']:14s} {record['route']:17s}"
  )
  if "error" in record:
    return f"{head} ERROR {record['error']}"
  expert = ", ".join(f"{k} {v}" for k, v in record["expert"].items())
  if record["kernel_calls"]:
    expert += "; kernels " + ", ".join(
        f"{k} {v}" for k, v in record["kernel_calls"].items()
    )
  return (
      f"{head} temp {record['temp_bytes'] / 2**20:8.1f} MiB, dots "
      f"{record['hlo_flops'] / 1e9:8.3f} GFLOP; experts "
      f"{record['expert_native']}/{record['expert_count']} native: {expert}"
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="gpu:h200-1", help='or "local"')
  parser.add_argument("--config", default="tiny_mixtral")
  parser.add_argument("--programs", nargs="+", default=list(PROGRAMS))
  parser.add_argument("--quantizations", nargs="+", default=list(QUANTIZATIONS))
  parser.add_argument("--paths", nargs="+", default=list(PATHS))
  parser.add_argument(
      "--routes", nargs="+", default=["ragged_dot"], help=f"of {ROUTES}"
  )
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--probe", action="store_true")
  parser.add_argument("--xla-flags", default="", help="added to XLA_FLAGS")
  parser.add_argument("--json", help="write the records here")
  args = parser.parse_args(argv)
  for name, given, allowed in (
      ("--programs", args.programs, PROGRAMS),
      ("--quantizations", args.quantizations, QUANTIZATIONS),
      ("--paths", args.paths, PATHS),
      ("--routes", args.routes, ROUTES),
  ):
    unknown = sorted(set(given) - set(allowed))
    if unknown:
      parser.error(f"{name} {unknown}: expected some of {list(allowed)}")
  if args.batch < 1 or args.seq < 2:
    parser.error(f"--batch {args.batch} --seq {args.seq}: need >= 1, >= 2")
  if args.target != "local":
    target = targets.parse_target(args.target)
    targets.prepare_process(target)
  if args.xla_flags:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " " + args.xla_flags
    ).strip()
  import jax  # noqa: PLC0415

  device = _device(args.target)
  print(f"jax {jax.__version__}, {args.target}: {device.device_kind}")
  records = []
  for cell in _cells(args):
    record = compile_cell(
        *cell, device, config=args.config, batch=args.batch, seq=args.seq
    )
    records.append(record)
    print(_line(record), flush=True)
  if args.probe:
    for record in probe(device):
      records.append(record)
      print(
          f"probe {record['form']:6s} {record['native']}/{record['count']} "
          f"native: {record['contractions']} scales {record['fused_scales']}",
          flush=True,
      )
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(
          {
              "jax": jax.__version__,
              "target": args.target,
              "device_kind": device.device_kind,
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "records": records,
          },
          f,
          indent=1,
      )
  return 0


if __name__ == "__main__":
  sys.exit(main())
