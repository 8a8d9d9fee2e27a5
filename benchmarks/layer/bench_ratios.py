"""The layer's speed ratios, measured side by side in one run.

Each case runs in a fresh subprocess (`bench_moe.py --case`), once per
library: the installed one, and with `--base DIR` an older checkout of the
library (e.g. `git worktree add /tmp/base main`, first on PYTHONPATH; it
must have the public names `common/layer_case.py` uses), alternating the two
for `--rounds` rounds, so that both see the same machine load. Medians of
wall seconds and of CPU seconds (all threads; steadier on a shared machine)
are printed, with every ratio:

  1. sparse, gemma-like (128 experts top-8, emb 512, mlp 128, batch 8 x seq
     512): fraction of the float32 dense-matmul roofline timed in the same
     process, beside the fractions three idealised forms reach (dense
     matmuls of the experts' shapes; per-expert matmuls of equal groups; a
     whole layer on perfectly balanced routing) and this library's sparse
     experts on that routing, with its default slots and with slots of the
     mean group: see `ceilings_main`;
  2. sparse at fixed tokens (batch 4, seq 128, emb 256, mlp 512, top-2):
     step(64 experts) / step(8 experts); beside it the "weight floor", a
     step that only reads the 3 expert weights and writes their gradients
     (8x more bytes at 64 experts), measured the same way: a lower bound, as
     a real step reads each weight twice (forward, and backward for the
     input gradient);
  3. dense dropping (capacity 1.0), gemma-like: this tree against the base;
  4. bf16 / f32 step time for every path at the small and medium sizes, the
     two dtypes compiled in one process and timed alternately;
  5. first construction (Linen `init`, `EagerToNNX`, `nnx_adapter.Decoder`)
     of the tiny configs, seconds, this tree against the base.

  python benchmarks/layer/bench_ratios.py --base /tmp/base
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common import child

HARNESS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "bench_moe.py"
)
GEMMA = "gemma_like"
FIXED_TOKENS = (4, 128, 256, 512)  # batch, seq, emb, mlp


def _case(size, path, dims=(), dtype="float32", capacity_factor=0.0):
  return {
      "size": size,
      "path": path,
      "dims": list(dims),
      "dtype": dtype,
      "capacity_factor": capacity_factor,
  }


def _run(tree: str | None, args: list[str]) -> dict:
  """The figures `args` print in a fresh Python, with the library of `tree`
  first on PYTHONPATH (None: the installed one)."""
  return child.run_json(args, pythonpath=tree)


def _median(results: list[dict], key: str) -> float:
  values = [r[key] for r in results if key in r]
  return statistics.median(values) if values else float("nan")


def weight_floor_main(e: int) -> None:
  """A step that reads the 3 expert weights and writes their gradients."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from common import timing  # noqa: PLC0415

  _, _, m, h = FIXED_TOKENS
  shapes = ((e, m, h), (e, m, h), (e, h, m))
  ws = [jax.random.normal(jax.random.key(i), s) for i, s in enumerate(shapes)]
  step = jax.jit(jax.grad(lambda ws: sum(jnp.sum(w * w) for w in ws)))
  wall, cpu = timing.median_times(step, (ws,), 5)
  print(json.dumps({"step_s": wall, "cpu_s": cpu}))


def ceilings_main() -> None:
  """Roofline fractions of three idealised forms of the gemma-like layer,
  and of this library's sparse experts on the idealised routing, here:
  forward+backward, float32, flops counted as for the layer (nine [T*k, .]
  matmuls):

  dense: plain dense matmuls of the experts' shapes (no experts at all);
  grouped: the same as batched per-expert matmuls of exactly the mean group
    (perfect balance, no routing, no padding): the matmuls alone of any
    implementation that multiplies each expert's rows by its weights;
  balanced_layer: a whole dropless layer on perfectly balanced routing, no
    router: `permute`'s sort and gathers, the three batched matmuls, SiLU,
    the weighted combine. No implementation can beat it on real routing,
    which adds a router and unequal groups (padding or overflow);
  library_balanced: this library's sparse experts (`sparse_experts`, the
    "blocked" grouped matmul, the CPU default) on the same routing, no
    router: the ceiling less what the library adds (its slots, C = 1.25x
    the mean group);
  library_mean_slots: the same with C = the mean group, which balanced
    routing fills exactly: what the library adds beyond padding.
  """
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  # The layer's pieces alone have no public names (private: they may move).
  from linen_moe._src.kernels import blocked  # noqa: PLC0415, TID251
  from linen_moe._src.layer import permute  # noqa: PLC0415, TID251
  from linen_moe._src.layer import sparse  # noqa: PLC0415, TID251

  from common import layer_case  # noqa: PLC0415
  from common import timing  # noqa: PLC0415

  b, s, m, h, e, k = layer_case.SIZES[GEMMA]
  t = b * s
  rows, per_expert = t * k, t * k // e
  keys = jax.random.split(jax.random.key(0), 6)
  x, a = (jax.random.normal(keys[i], (rows, d)) for i, d in ((0, m), (1, h)))
  ws = [
      0.05 * jax.random.normal(key, shape)
      for key, shape in zip(
          keys[2:5], ((e, m, h), (e, m, h), (e, h, m)), strict=True
      )
  ]

  def squares(*ys):  # every product's cotangent is itself: all matmuls run
    return sum(0.5 * jnp.sum(jnp.square(y)) for y in ys)

  def up(xg, w):  # [E, n, M] x [E, M, H] -> [E, n, H]
    return jnp.einsum("gcm,gmh->gch", xg, w)

  def down(ag, w):  # [E, n, H] x [E, H, M] -> [E, n, M]
    return jnp.einsum("gch,ghm->gcm", ag, w)

  def dense(x, a, ws):
    return squares(x @ ws[0][0], x @ ws[1][0], a @ ws[2][0])

  def grouped(x, a, ws):
    xg, ag = x.reshape(e, per_expert, m), a.reshape(e, per_expert, h)
    return squares(up(xg, ws[0]), up(xg, ws[1]), down(ag, ws[2]))

  # Token t's k choices are experts (t * k + j) mod E: distinct, and every
  # expert gets exactly T * k / E rows.
  indices = (jnp.arange(t)[:, None] * k + jnp.arange(k)) % e
  weights = jax.random.uniform(keys[5], (t, k))

  def balanced_layer(x, weights, ws):
    plan = permute.sort_plan(indices.astype(jnp.int32), e, all_local=True)
    xg = permute.dispatch_rows(x, plan).reshape(e, per_expert, m)
    y = down(jax.nn.silu(up(xg, ws[0])) * up(xg, ws[1]), ws[2])
    return squares(permute.combine_rows(y.reshape(rows, m), weights, plan))

  def library_balanced(x, weights, ws, slot_rows=None):
    def hook(site, lhs, rhs, group_sizes):
      del site
      return blocked.blocked_grouped_matmul(
          lhs, rhs, group_sizes, slot_rows_override=slot_rows
      )

    y = sparse.sparse_experts(
        hook, x, indices, weights, tuple(ws), jax.nn.silu, all_experts=True
    )
    return squares(y)

  flops = 3 * 2 * rows * 3 * m * h
  roofline = timing.roofline(5)
  out = {}
  for name, fn, args in (
      ("dense", dense, (x, a, ws)),
      ("grouped", grouped, (x, a, ws)),
      ("balanced_layer", balanced_layer, (x[:t], weights, ws)),
      ("library_balanced", library_balanced, (x[:t], weights, ws)),
      (
          "library_mean_slots",
          functools.partial(library_balanced, slot_rows=per_expert),
          (x[:t], weights, ws),
      ),
  ):
    step = jax.jit(jax.grad(fn, argnums=(0, 1, 2)))
    wall, cpu = timing.median_times(step, args, 5)
    out[name] = flops / wall / 1e9 / roofline["gflops"]
    out[f"{name}_cpu"] = flops / cpu / 1e9 / roofline["cpu_gflops"]
  print(json.dumps(out))


def bf16_pair_main(size: str, path: str, repeats: int) -> None:
  """float32 and bfloat16 steps of one case, compiled in this process and
  timed alternately (one call each, `repeats` times), so both see the same
  machine: medians of wall and CPU seconds."""
  from common import layer_case  # noqa: PLC0415
  from common import timing  # noqa: PLC0415

  steps = {
      dtype: layer_case.compiled_step(
          layer_case.Case(size=size, path=path, dtype=dtype)
      )
      for dtype in ("float32", "bfloat16")
  }
  for compiled, args, _ in steps.values():
    timing.time_call(compiled, args)  # warm-up
  times = {dtype: ([], []) for dtype in steps}
  for _ in range(repeats):
    for dtype, (compiled, args, _) in steps.items():
      wall, cpu = timing.time_call(compiled, args)
      times[dtype][0].append(wall)
      times[dtype][1].append(cpu)
  print(
      json.dumps({
          f"{dtype}_{key}": statistics.median(values)
          for dtype, (wall, cpu) in times.items()
          for key, values in (("step_s", wall), ("cpu_s", cpu))
      })
  )


def init_main(config: str, layers: str, what: str) -> None:
  """Seconds of one first construction, in a fresh process."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from linen_moe import Decoder  # noqa: PLC0415
  from linen_moe import RoutedMoE  # noqa: PLC0415
  from linen_moe import load_model_config  # noqa: PLC0415

  cfg = load_model_config(
      config, quantization="fp8", scan_layers=layers == "scanned"
  )
  jnp.zeros(1).block_until_ready()  # backend start-up is not init
  start = time.perf_counter()
  if what == "linen_decoder":
    out = Decoder(cfg).init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))
  else:
    from flax import nnx  # noqa: PLC0415

    import nnx_adapter  # noqa: PLC0415

    if what == "nnx_decoder":
      out = nnx.state(nnx_adapter.Decoder(cfg, rngs=nnx.Rngs(0)))
    else:  # "eager_to_nnx" of one layer
      x = jnp.zeros((2, 8, cfg.moe.emb_dim))
      out = nnx.state(
          nnx_adapter.EagerToNNX(RoutedMoE(cfg.moe), x, rngs=nnx.Rngs(0))
      )
  jax.block_until_ready(out)
  print(json.dumps({"seconds": time.perf_counter() - start}))


def _bench(trees, cases, rounds, repeats):
  """{(case index, tree name): [result, ...]}, trees alternating."""
  results = {}
  for _ in range(rounds):
    for i, case in enumerate(cases):
      for name, tree in trees.items():
        args = [HARNESS, "--case", json.dumps(case), "--repeats", str(repeats)]
        results.setdefault((i, name), []).append(_run(tree, args))
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base", default=None, help="an older library tree")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument(
      "--parts",
      nargs="+",
      default=["roofline", "experts", "dropping", "bf16", "init"],
  )
  a = parser.parse_args()
  trees = {"new": None} | ({"base": a.base} if a.base else {})
  me = os.path.abspath(__file__)
  line = print

  if "roofline" in a.parts:
    line("\n== 1. sparse, gemma-like: fraction of the f32 matmul roofline")
    res = _bench(trees, [_case(GEMMA, "sparse")], a.rounds, a.repeats)
    for name in trees:
      r = res[(0, name)]
      wall = _median(r, "useful_gflops") / _median(r, "roofline_gflops")
      line(
          f"{name:5s} step {_median(r, 'step_s'):.3f}s  roofline fraction "
          f"wall {wall:.2f}  cpu {_median(r, 'cpu_roofline_fraction'):.2f}"
      )
    ceilings = [_run(None, [me, "--ceilings"]) for _ in range(a.rounds)]
    for name, what in (
        ("dense", "dense matmuls of the experts' shapes, no experts"),
        ("grouped", "per-expert batched matmuls, equal groups, no routing"),
        ("balanced_layer", "a whole layer on perfectly balanced routing"),
        ("library_balanced", "this library's sparse experts, same routing"),
        ("library_mean_slots", "the same, slots = the mean group"),
    ):
      line(
          f"ceiling {name:18s} roofline fraction wall "
          f"{_median(ceilings, name):.2f}  cpu "
          f"{_median(ceilings, name + '_cpu'):.2f}  ({what})"
      )

  if "experts" in a.parts:
    line("\n== 2. sparse at fixed tokens: step(E=64) / step(E=8)")
    cases = [
        _case(f"E={e}", "sparse", (*FIXED_TOKENS[:2], *FIXED_TOKENS[2:], e, 2))
        for e in (8, 64)
    ]
    res = _bench(trees, cases, a.rounds, a.repeats)
    floor = {
        e: [_run(None, [me, "--weight-floor", str(e)]) for _ in range(a.rounds)]
        for e in (8, 64)
    }
    for key in ("step_s", "cpu_s"):
      f8, f64 = _median(floor[8], key), _median(floor[64], key)
      for name in trees:
        s8, s64 = _median(res[(0, name)], key), _median(res[(1, name)], key)
        line(
            f"{name:5s} {key:6s} E=8 {s8 * 1e3:7.1f}ms  E=64 {s64 * 1e3:7.1f}ms"
            f"  ratio {s64 / s8:.2f}  | weight floor E=8 {f8 * 1e3:.1f}ms "
            f"E=64 {f64 * 1e3:.1f}ms; ratio less the floor's growth "
            f"{(s64 - (f64 - f8)) / s8:.2f}"
        )

  if "dropping" in a.parts:
    line("\n== 3. dense dropping (capacity 1.0), gemma-like")
    res = _bench(
        trees,
        [_case(GEMMA, "dense_dropping", capacity_factor=1.0)],
        a.rounds,
        a.repeats,
    )
    for key in ("step_s", "cpu_s"):
      times = {n: _median(res[(0, n)], key) for n in trees}
      text = "  ".join(f"{n} {t:.3f}s" for n, t in times.items())
      if "base" in times:
        text += f"  base/new {times['base'] / times['new']:.2f}x"
      line(f"{key:6s} {text}")

  if "bf16" in a.parts:
    line(
        "\n== 4. bf16 / f32 step time (this tree; the two alternate in one"
        " process)"
    )
    for size in ("small", "medium"):
      for path in ("sparse", "dense", "dense_dropping"):
        pair = [
            _run(None, [me, "--bf16-pair", size, path, str(4 * a.repeats)])
            for _ in range(a.rounds)
        ]
        f32, bf16 = (
            _median(pair, f"{d}_step_s") for d in ("float32", "bfloat16")
        )
        cpu = _median(pair, "bfloat16_cpu_s") / _median(pair, "float32_cpu_s")
        line(
            f"{size:7s}{path:15s} f32 {f32:.3f}s bf16 {bf16:.3f}s  "
            f"wall {bf16 / f32:.2f}  cpu {cpu:.2f}"
        )

  if "init" in a.parts:
    line("\n== 5. first construction, seconds (fp8, the tiny configs)")
    for config, layers in (
        ("tiny_mixtral", "scanned"),
        ("tiny_gemma4_26b", "unrolled"),
    ):
      for what in ("linen_decoder", "eager_to_nnx", "nnx_decoder"):
        times = {}
        for _ in range(a.rounds):
          for name, tree in trees.items():
            r = _run(tree, [me, "--init", config, layers, what])
            times.setdefault(name, []).append(r.get("seconds", float("nan")))
        text = "  ".join(
            f"{n} {statistics.median(t):.1f}s" for n, t in times.items()
        )
        line(f"{config:16s}{layers:9s}{what:14s} {text}")


if __name__ == "__main__":
  if sys.argv[1:2] == ["--weight-floor"]:
    weight_floor_main(int(sys.argv[2]))
  elif sys.argv[1:2] == ["--ceilings"]:
    ceilings_main()
  elif sys.argv[1:2] == ["--bf16-pair"]:
    bf16_pair_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
  elif sys.argv[1:2] == ["--init"]:
    init_main(*sys.argv[2:5])
  else:
    main()
