"""One decoder layer's MFU on the chip: the train step of a model of two
depths at the same batch, the layer's time their difference, so that the
vocabulary head (a plain dense matmul, most of a shallow model's FLOPs)
does not flatter it.

Shapes (`SHAPES`): Mixtral-8x7B's layer (emb 4096, 8 experts of 14336,
top-2, 32 / 8 heads of 128, vocabulary 32,000) and Qwen3-30B-A3B's (emb
2048, 128 experts of 768, top-8, 32 / 4 heads of 128, vocabulary
151,936), bf16, 4096 tokens a row, at `Shape.depths` layers. The router
is trained with its 0.01 load-balance loss (nothing forces the balance);
the optimizer is plain SGD, so the step is the loss and its gradients
(and the finite check), and the SGD update is timed apart (on a slice it
is sharded N ways). Each shape's batch is the largest that
`linen_moe.planning.plan(..., optimizer=optax.sgd(...))` fits on a
`tpu:v5e-1` at the deeper depth, with the remat it then needs
(`Shape.batch`, `Shape.remat`; `--plan` reproduces that search). On a
GPU (`--chip h200`: its peak from `planning.CHIPS`, 989 TFLOP/s) the
batches are `GPU_SHAPES`'.

Variants (`VARIANTS`), each a step of its own, all alternating on one
train state per depth (they share its layout), medians of `--rounds`:

  bf16      the plan's remat and batch, `grouped_matmul="auto"`
  int8      the same with `quantization="int8"` (AQT)
  int8_kernel  int8 on our Pallas int8 gmm (`grouped_matmul="kernel"`:
            the scales in its epilogue; "auto" takes it too from
            `accelerator.AUTO_INT8_MIN_ROWS` rows, XLA's s8 ragged_dot
            below)
  kernel    the same with `grouped_matmul="kernel"` (our Pallas gmm)
  ragged_dot  the same with `grouped_matmul="ragged_dot"` (XLA's)
  rows_once the same with `remat_moe_rows=False` (the MoE layer's own
            row recompute dropped inside the block's remat)
  no_remat  `remat="none"` at the largest batch that fits without it
            (`Shape.no_remat_batch`, at `Shape.no_remat_depths`)
  unrolled  `scan_layers=False` at `Shape.unrolled_batch`: each layer's
            weights their own arrays. A stack of layers keeps each weight
            as one [L, ...] array, and a Pallas call cannot read a layer's
            slice of it in place (XLA fuses no slice into a custom call's
            operand, `allow_input_fusion` or not): the step copies every
            layer's expert weights out of the stack and their gradients
            back into it. Its own train state (another layout), timed
            after the stacked variants'.
  unrolled_no_remat  the same with `remat="none"`, at
            `Shape.unrolled_no_remat_batch`
  unrolled_save_experts  the same with `remat="save_experts"` (the
            expert matmuls' outputs kept, attention recomputed), at
            `Shape.unrolled_save_experts_batch`

Per variant with both depths: the layer's seconds (step less SGD update,
deeper less shallower, per layer), its model FLOPs
(`linen_moe.planning.model_flops`, causal attention counted once) and
MFU against the chip's bf16 peak, the compiler's FLOPs of a layer
(`cost_analysis()`, deeper less shallower) beside them, the expert load's
max / mean of each layer, and the released depth's step estimated as
layer x depth + head (the shallow step less its layers), with its MFU.

Programs are lowered in order and compiled `--workers` at a time
(compiling is most of the time on the chip), then each depth's group is
timed; everything stays under `--budget-s` and the JSON is written after
each group.

  python benchmarks/device/bench_mfu.py --out DIR               # on the chip
  python benchmarks/device/bench_mfu.py --target tpu:v5e-1      # AOT here
  python benchmarks/device/bench_mfu.py --plan --target tpu:v5e-1 \\
      --shapes mixtral --batches 1 2 4                            # the search
      [--plan-variant unrolled]                          # of another layout
  python benchmarks/device/bench_mfu.py --tiny --out DIR         # CPU rehearsal
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import re
import statistics
import sys
import time
import traceback
from typing import Any

SEQ = 4096
LOAD_BALANCE = 0.01
LEARNING_RATE = 1e-4
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Shape:
  """A model measured at two depths.

  Attributes:
    config: the shipped config whose layer it is.
    released_layers: the released model's depth (the whole-step estimate).
    batch: rows of `SEQ` tokens: the largest batch the plan fits at the
      deeper depth, with `remat`.
    remat: the remat policy that batch needs (the lightest that fits).
    no_remat_batch: the largest batch that fits with remat "none".
    no_remat_depths: the depths at which `no_remat_batch` fits.
    depths: the two depths.
    changes: further config fields (the tiny rehearsal's sizes).
    unrolled_batch: the largest batch that fits with `remat` and the layers
      unrolled (`scan_layers=False`); None: `batch`.
    unrolled_no_remat_batch: the largest that fits unrolled with remat
      "none" at both depths; None: `no_remat_batch` (at its depths).
    unrolled_save_experts_batch: the largest that fits unrolled with
      remat "save_experts"; None: `unrolled_batch`.
  """

  config: str
  released_layers: int
  batch: int
  remat: str
  no_remat_batch: int
  no_remat_depths: tuple[int, ...]
  depths: tuple[int, int] = (1, 2)
  changes: tuple[tuple[str, Any], ...] = ()
  unrolled_batch: int | None = None
  unrolled_no_remat_batch: int | None = None
  unrolled_save_experts_batch: int | None = None


# Planned for tpu:v5e-1 (15.75 GiB) with SGD, jax 0.10.2 and libtpu 0.0.42.1
# (the chip's jax), `--plan` (benchmarks/device/README.md has the table).
SHAPES = {
    # Unrolled, the deeper step holds no stacked copy of the expert weights.
    # Compiled for tpu:v5e-1 with jax 0.12.0.1 / libtpu 0.0.50.1, 2 layers:
    # Qwen3 full remat 14.09 GiB at batch 12 (16: 15.68, at the edge), no
    # remat 14.51 at 8 (12: 16.65 temporaries, does not fit); Mixtral full
    # remat 15.64 at 4 (13.76 at 2, against 16.39 scanned), no remat 15.06
    # at 3 (scanned, no remat fits 1 layer at batch 1). Remat
    # "save_experts" at the unrolled batch: Qwen3 15.00 GiB at 12 (13.12
    # at 8), Mixtral 15.57 at 4.
    "qwen3": Shape(
        "qwen3_30b_a3b",
        48,
        8,
        "full",
        4,
        (1, 2),
        unrolled_batch=12,
        unrolled_no_remat_batch=8,
    ),
    "mixtral": Shape(
        "mixtral_8x7b",
        32,
        2,
        "full",
        1,
        (1,),
        unrolled_batch=4,
        unrolled_no_remat_batch=3,
    ),
}
# On a GPU (`--chip h100`/`h200`): estimated, not planned, from the v5e
# plans' bytes per row (Qwen3 ~0.9 GB, Mixtral ~1.5 GB at 2 layers, full
# remat) within JAX's default 75 % of an H200's 141 GB, then halved for
# the compile's slack and the step's time; `--plan --target gpu:h200-1`
# searches them where a CUDA jaxlib compiles.
GPU_SHAPES = {
    "qwen3": Shape("qwen3_30b_a3b", 48, 32, "full", 8, (1, 2)),
    "mixtral": Shape("mixtral_8x7b", 32, 16, "full", 4, (1, 2)),
}
GPU_CHIPS = ("h100", "h200")
# A CPU rehearsal of the same code (`--tiny`): its figures mean nothing.
TINY = {
    "qwen3": Shape(
        "tiny_qwen3_moe",
        48,
        2,
        "full",
        2,
        (1, 2),
        (1, 2),
        (("vocab_size", 512),),
    ),
}
# Variant -> config changes (no_remat also takes its own batch).
VARIANTS = {
    "bf16": {},
    "int8": {"quantization": "int8"},
    "int8_kernel": {"quantization": "int8", "grouped_matmul": "kernel"},
    "kernel": {"grouped_matmul": "kernel"},
    "ragged_dot": {"grouped_matmul": "ragged_dot"},
    "no_remat": {"remat": "none"},
    "rows_once": {"remat_moe_rows": False},
    "unrolled": {"scan_layers": False},
    "unrolled_no_remat": {"scan_layers": False, "remat": "none"},
    "unrolled_save_experts": {"scan_layers": False, "remat": "save_experts"},
}


@dataclasses.dataclass(frozen=True)
class Program:
  """One compiled train step: a shape at a depth, in a variant."""

  shape: str
  depth: int
  variant: str

  @property
  def key(self) -> str:
    return f"{self.shape}/{self.depth}/{self.variant}"


def programs(shapes: dict, names, variants) -> list[Program]:
  """The programs of `names` x depths x `variants`, variant-major within
  each shape (the bf16 pair first), skipping no_remat where it does not
  fit."""
  out = []
  for name in names:
    shape = shapes[name]
    for variant in variants:
      for depth in shape.depths:
        if depth not in _depths(shape, variant):
          continue
        out.append(Program(name, depth, variant))
  return out


def _own_batch(shape: Shape, variant: str) -> int | None:
  """The batch `shape` names for `variant` alone, or None."""
  if variant == "unrolled":
    return shape.unrolled_batch
  if variant == "unrolled_no_remat":
    return shape.unrolled_no_remat_batch
  if variant == "unrolled_save_experts":
    return shape.unrolled_save_experts_batch or shape.unrolled_batch
  return None


def _no_remat_fallback(shape: Shape, variant: str) -> bool:
  """A variant without remat and without a batch of its own takes
  `no_remat_batch`, at `no_remat_depths`."""
  return remat_of(shape, variant) == "none" and not _own_batch(shape, variant)


def _depths(shape: Shape, variant: str) -> tuple[int, ...]:
  """The depths `variant` is measured at: where its batch fits."""
  if _no_remat_fallback(shape, variant):
    return shape.no_remat_depths
  return shape.depths


def batch_of(shape: Shape, variant: str) -> int:
  if _no_remat_fallback(shape, variant):
    return shape.no_remat_batch
  return _own_batch(shape, variant) or shape.batch


def remat_of(shape: Shape, variant: str) -> str:
  return VARIANTS[variant].get("remat", shape.remat)


def layouts(variants: list[str]) -> list[list[str]]:
  """`variants` split by the train state's layout they need (stacked
  first, then unrolled), each list in the given order."""
  stacked = [v for v in variants if "scan_layers" not in VARIANTS[v]]
  unrolled = [v for v in variants if "scan_layers" in VARIANTS[v]]
  return [x for x in (stacked, unrolled) if x]


def model_config(shape: Shape, depth: int, variant: str = "bf16"):
  """The program's `ModelConfig`."""
  import linen_moe  # noqa: PLC0415

  changes = {
      "num_layers": depth,
      "load_balance_loss_weight": LOAD_BALANCE,
      "remat": shape.remat,
      **dict(shape.changes),
      **VARIANTS[variant],
  }
  return linen_moe.load_model_config(shape.config).replace(**changes)


def training_run(cfg, mesh):
  """The sharded train step of `cfg` with SGD on `mesh`."""
  import optax  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415
  from linen_moe import training  # noqa: PLC0415

  return training.ShardedTraining(
      linen_moe.Decoder(cfg), optax.sgd(LEARNING_RATE), mesh
  )


def replicated(mesh):
  import jax  # noqa: PLC0415

  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def abstract_args(run, mesh, batch: int, seq: int):
  """(state, tokens, rng) as sharded ShapeDtypeStructs. The rng is
  replicated on the mesh: a step called with a key put there hits the
  compile of these (a plain key is another input type)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  tokens = jax.ShapeDtypeStruct(
      (batch, seq), jnp.int32, sharding=run.token_sharding()
  )
  key = jax.eval_shape(lambda: jax.random.key(0))
  rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated(mesh))
  return run.abstract_state(tokens, rng), tokens, rng


# What a compiled step holds, by HLO text: the grouped matmul XLA's way,
# Pallas kernels (ours, splash attention), and of those the sparse path's
# row gathers (`pallas_gather`: the dispatch, its recomputes, the
# combine's backward).
_COUNTS = {
    "ragged_dot_ops": re.compile(r"\sragged-dot\("),
    "pallas_calls": re.compile(r'custom_call_target="tpu_custom_call"'),
    "row_gathers": re.compile(
        r'custom_call_target="tpu_custom_call".*linen_moe_gather'
    ),
}


def compiled_facts(compiled, memory_limit: int | None) -> dict:
  """The compiler's FLOPs and bytes, memory analysis and op counts."""
  from linen_moe import hlo  # noqa: PLC0415

  out: dict[str, Any] = {}
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out["compiler_flops"] = float(cost.get("flops", -1))
    out["compiler_bytes"] = float(cost.get("bytes accessed", -1))
  except Exception as e:  # noqa: BLE001 (a backend without it)
    out["cost_error"] = str(e)[:200]
  stats = compiled.memory_analysis()
  if stats is not None:
    m = {
        k: int(getattr(stats, f"{k}_size_in_bytes"))
        for k in ("argument", "output", "alias", "temp")
    }
    m["peak"] = m["argument"] + m["output"] - m["alias"] + m["temp"]
    out["memory_bytes"] = m
    if memory_limit:
      out["fits"] = m["peak"] <= memory_limit
  text = compiled.as_text()
  out.update({k: len(p.findall(text)) for k, p in _COUNTS.items()})
  out["quantized_types_at_contractions"] = sorted(
      hlo.quantized_types_at_contractions(text)
  )
  return out


class Compiler:
  """Lowers programs in this thread and compiles them `workers` at a
  time: `submit` returns at once; `result(key)` waits (until `deadline`)."""

  def __init__(self, mesh, shapes, seq, workers, memory_limit=None):
    self.mesh, self.shapes, self.seq = mesh, shapes, seq
    self.memory_limit = memory_limit
    self.pool = concurrent.futures.ThreadPoolExecutor(max(1, workers))
    self.futures: dict[str, concurrent.futures.Future] = {}
    self.runs: dict[str, Any] = {}
    self.lowering: dict[str, dict] = {}

  def submit(self, p: Program) -> None:
    shape = self.shapes[p.shape]
    start = time.perf_counter()
    try:
      run = training_run(model_config(shape, p.depth, p.variant), self.mesh)
      args = abstract_args(run, self.mesh, batch_of(shape, p.variant), self.seq)
      lowered = run.lower(*args)
    except Exception as e:  # noqa: BLE001 (reported, the rest goes on)
      self.lowering[p.key] = {"error": f"lower: {type(e).__name__}: {e}"[:600]}
      return
    self.runs[p.key] = run
    self.lowering[p.key] = {"lower_s": time.perf_counter() - start}
    self.futures[p.key] = self.pool.submit(self._compile, lowered)

  def _compile(self, lowered) -> dict:
    start = time.perf_counter()
    try:
      compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 (an out-of-memory is a result)
      return {
          "error": f"{type(e).__name__}: {e}"[:600],
          "compile_s": time.perf_counter() - start,
      }
    out = {"compile_s": time.perf_counter() - start}
    out.update(compiled_facts(compiled, self.memory_limit))
    return out

  def result(self, key: str, deadline: float) -> dict:
    if key not in self.futures:
      return self.lowering.get(key, {"error": "not lowered"})
    try:
      wait = deadline - time.monotonic()
      got = self.futures[key].result(
          timeout=None if wait == float("inf") else max(0.0, wait)
      )
    except concurrent.futures.TimeoutError:
      return {**self.lowering[key], "error": "still compiling at the deadline"}
    return {**self.lowering[key], **got}

  def close(self) -> None:
    self.pool.shutdown(wait=False, cancel_futures=True)


# -- the figures (pure arithmetic; benchmarks/tests checks it) --------------


def layer_figures(
    depths: tuple[int, int],
    step_s: dict[int, float],
    optimizer_s: dict[int, float | None],
    model_flops: dict[int, float],
    peak_flops: float,
    released_layers: int,
    released_flops: float,
    compiler_flops: dict[int, float | None] | None = None,
) -> dict[str, Any]:
  """One layer's figures from steps at two depths.

  Args:
    depths: (d1, d2), d1 < d2.
    step_s: {depth: median step seconds}.
    optimizer_s: {depth: median seconds of the SGD update alone}, or None
      where it was not timed (then the layer includes its update).
    model_flops: {depth: model FLOPs of the step (`planning.model_flops`)}.
    peak_flops: the chip's peak FLOP/s (bf16).
    released_layers: D, the released model's depth.
    released_flops: model FLOPs of the step at depth D.
    compiler_flops: {depth: the compiler's FLOPs}, optional.

  Returns:
    A dict: `layer_s` (step less update, per layer of difference),
    `layer_model_flops`, `layer_mfu`, `head_s` (the shallow step less its
    layers: embedding, final norm, head and loss), `optimizer_layer_s`
    and `optimizer_head_s`, `released_step_s` (D x layer + head) and its
    `released_mfu`, `released_step_with_update_s` and its MFU; with
    `compiler_flops`, `layer_compiler_flops` and its ratio to the model's.
  """
  d1, d2 = depths
  if not d1 < d2:
    raise ValueError(f"depths must rise; got {depths}.")
  n = d2 - d1
  opt = {d: optimizer_s.get(d) or 0.0 for d in depths}
  core = {d: step_s[d] - opt[d] for d in depths}
  layer_s = (core[d2] - core[d1]) / n
  layer_flops = (model_flops[d2] - model_flops[d1]) / n
  head_s = core[d1] - d1 * layer_s
  opt_layer = (opt[d2] - opt[d1]) / n
  opt_head = opt[d1] - d1 * opt_layer
  released_s = released_layers * layer_s + head_s
  with_update = released_s + released_layers * opt_layer + opt_head
  out = {
      "layer_s": layer_s,
      "layer_model_flops": layer_flops,
      "layer_mfu": layer_flops / layer_s / peak_flops if layer_s > 0 else None,
      "head_s": head_s,
      "head_model_flops": model_flops[d1] - d1 * layer_flops,
      "optimizer_layer_s": opt_layer,
      "optimizer_head_s": opt_head,
      "released_layers": released_layers,
      "released_step_s": released_s,
      "released_mfu": (
          released_flops / released_s / peak_flops if released_s > 0 else None
      ),
      "released_step_with_update_s": with_update,
      "released_mfu_with_update": (
          released_flops / with_update / peak_flops if with_update > 0 else None
      ),
  }
  if compiler_flops and all(compiler_flops.get(d) for d in depths):
    layer_compiler = (compiler_flops[d2] - compiler_flops[d1]) / n
    out["layer_compiler_flops"] = layer_compiler
    out["compiler_over_model"] = layer_compiler / layer_flops
  return out


def load_balance(expert_load) -> list[float]:
  """max / mean of each layer's expert load ([L, E] token shares)."""
  import numpy as np  # noqa: PLC0415

  load = np.asarray(expert_load, np.float64)
  return [
      float(row.max() / row.mean()) for row in load.reshape(load.shape[0], -1)
  ]


def ratios(step_ms: dict[str, float], base: str = "bf16") -> dict[str, float]:
  """{variant: base ms / variant ms} (> 1: faster than `base`)."""
  if base not in step_ms:
    return {}
  return {
      v: step_ms[base] / ms for v, ms in step_ms.items() if v != base and ms
  }


# -- on the chip ------------------------------------------------------------


def _block(x):
  import jax  # noqa: PLC0415

  return jax.block_until_ready(x)


def time_group(
    compiler: Compiler,
    shape: Shape,
    name: str,
    depth: int,
    variants: list[str],
    rounds: int,
    deadline: float,
) -> dict:
  """Medians of alternating steps of `variants` at `depth`, on one state
  per layout (`layouts`), then the SGD update alone on the first state's
  parameters."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  group: dict[str, Any] = {"shape": name, "depth": depth, "programs": {}}
  ready = []
  for v in variants:
    key = Program(name, depth, v).key
    facts = compiler.result(key, deadline)
    group["programs"][v] = facts
    if "error" not in facts:
      ready.append(v)
    else:
      print(f"  {key}: {facts['error'][:200]}", flush=True)
  if not ready:
    return group
  runs = {v: compiler.runs[Program(name, depth, v).key] for v in ready}
  rng = jax.device_put(jax.random.key(1), replicated(compiler.mesh))
  vocab = model_config(shape, depth).vocab_size
  rows = np.random.default_rng(0)
  tokens = {}
  for v in ready:
    b = batch_of(shape, v)
    if b not in tokens:
      tokens[b] = jax.device_put(
          jnp.asarray(rows.integers(0, vocab, (b, compiler.seq)), jnp.int32),
          runs[v].token_sharding(),
      )
  samples, metrics = {}, {}
  timing = _Timing(runs, tokens, shape, rng, rounds, deadline)
  for layout in layouts(ready):  # one state at a time: a chip holds one
    state = _alternate(group, layout, timing, samples, metrics)
    if state is None:
      continue
    if time.monotonic() < deadline and "optimizer_ms" not in group:
      group["optimizer_ms"] = _time_update(state, rounds)
    del state
  group["step_ms"] = {
      v: statistics.median(s) * 1e3 for v, s in samples.items() if s
  }
  group["samples_ms"] = {v: [x * 1e3 for x in s] for v, s in samples.items()}
  for v, m in metrics.items():
    group["programs"][v].update(
        loss=float(m["loss"]),
        load_balance_loss=float(m["load_balance_loss"]),
        skipped_steps=int(m["skipped_steps"]),
        expert_load_max_over_mean=load_balance(m["expert_load"]),
    )
  return group


@dataclasses.dataclass(frozen=True)
class _Timing:
  """What one depth's timing shares: the compiled runs by variant, the
  token batches by size, the shape, the key, rounds and deadline."""

  runs: dict
  tokens: dict
  shape: Shape
  rng: Any
  rounds: int
  deadline: float


def _alternate(group, variants, t: _Timing, samples, metrics):
  """Steps of `variants` (one layout) alternating on one fresh state:
  their times into `samples`, last metrics into `metrics`. Returns the
  state, or None where a failed step took it."""
  import jax  # noqa: PLC0415

  variants = list(variants)
  first = t.runs[variants[0]]
  start = time.perf_counter()
  state = first.init(
      t.tokens[batch_of(t.shape, variants[0])], jax.random.key(0)
  )
  _block(state)
  group.setdefault("init_s", {})[variants[0]] = time.perf_counter() - start
  for v in variants:
    samples[v] = []
  for r in range(t.rounds + 1):  # round 0 warms up
    for v in list(variants):
      if time.monotonic() > t.deadline:
        group["cut"] = f"deadline in round {r}"
        break
      start = time.perf_counter()
      try:
        state, m = t.runs[v].step(state, t.tokens[batch_of(t.shape, v)], t.rng)
        _block((state, m))
      except Exception as e:  # noqa: BLE001 (the chip refuses: reported)
        group["programs"][v]["error"] = f"run: {type(e).__name__}: {e}"[:600]
        variants.remove(v)
        samples.pop(v)
        print(
            f"  {group['shape']}/{group['depth']}/{v}:"
            f" {group['programs'][v]['error'][:200]}"
        )
        if state is None or any(
            getattr(x, "is_deleted", lambda: False)()
            for x in jax.tree.leaves(state)
        ):
          return None  # the state went with it
        continue
      if r:
        samples[v].append(time.perf_counter() - start)
      metrics[v] = m
  return state


def _time_update(state, rounds: int) -> float:
  """Median ms of the SGD update alone on `state`'s parameters (a gradient
  of their size; the parameters donated, as in the step)."""
  import functools  # noqa: PLC0415

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415

  sgd = optax.sgd(LEARNING_RATE)

  @functools.partial(jax.jit, donate_argnums=0)
  def update(params, grads):
    updates, _ = sgd.update(grads, sgd.init(params), params)
    return optax.apply_updates(params, updates)

  params = state.params
  grads = jax.tree.map(jnp.ones_like, params)
  times = []
  for r in range(rounds + 1):
    start = time.perf_counter()
    params = _block(update(params, grads))
    if r:
      times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def derive(result: dict, shapes: dict, peak: float, seq: int) -> list[dict]:
  """Per shape and variant with both depths timed: `layer_figures`."""
  from linen_moe import planning  # noqa: PLC0415

  rows = []
  groups = {(g["shape"], g["depth"]): g for g in result["groups"]}
  for name, shape in shapes.items():
    d1, d2 = shape.depths
    for v in VARIANTS:
      pair = [groups.get((name, d)) for d in (d1, d2)]
      if not all(g and v in g.get("step_ms", {}) for g in pair):
        continue
      batch = batch_of(shape, v)
      flops = {
          d: planning.model_flops(model_config(shape, d, v), batch, seq)
          for d in (d1, d2)
      }
      released = planning.model_flops(
          model_config(shape, shape.released_layers, v), batch, seq
      )
      fig = layer_figures(
          (d1, d2),
          {
              d: g["step_ms"][v] / 1e3
              for d, g in zip((d1, d2), pair, strict=True)
          },
          {
              d: (g.get("optimizer_ms") or 0) / 1e3
              for d, g in zip((d1, d2), pair, strict=True)
          },
          flops,
          peak,
          shape.released_layers,
          released,
          {
              d: g["programs"][v].get("compiler_flops")
              for d, g in zip((d1, d2), pair, strict=True)
          },
      )
      rows.append(
          {"shape": name, "variant": v, "batch": batch, "seq": seq, **fig}
      )
  return rows


def summary(result: dict) -> list[str]:
  """What each figure is, one line each."""
  lines = []
  for g in result["groups"]:
    where = f"{g['shape']} {g['depth']} layer(s)"
    for v, ms in g.get("step_ms", {}).items():
      p = g["programs"][v]
      load = p.get("expert_load_max_over_mean") or []
      lines.append(
          f"{where} {v}: step {ms:.1f} ms (median of"
          f" {len(g['samples_ms'][v])}), compile {p.get('compile_s', 0):.0f}"
          f" s, peak {p.get('memory_bytes', {}).get('peak', 0) / GIB:.2f}"
          f" GiB, loss {p.get('loss', float('nan')):.3f}, expert load"
          f" max/mean {', '.join(f'{x:.2f}' for x in load)}"
      )
    if "optimizer_ms" in g:
      lines.append(f"{where}: SGD update alone {g['optimizer_ms']:.1f} ms")
    for v, r in ratios(g.get("step_ms", {})).items():
      lines.append(f"{where}: bf16 step / {v} step = {r:.2f}")
  for row in result.get("layers", []):
    mfu = row["layer_mfu"]
    lines.append(
        f"{row['shape']} {row['variant']} (batch {row['batch']} x"
        f" {row['seq']}): one layer {row['layer_s'] * 1e3:.1f} ms for"
        f" {row['layer_model_flops'] / 1e12:.2f} model TFLOP: layer MFU"
        f" {mfu:.1%}"
        + (
            f"; compiler FLOPs / model FLOPs {row['compiler_over_model']:.2f}"
            if "compiler_over_model" in row
            else ""
        )
    )
    lines.append(
        f"{row['shape']} {row['variant']}: head {row['head_s'] * 1e3:.1f} ms;"
        f" {row['released_layers']} layers estimated"
        f" {row['released_step_s'] * 1e3:.0f} ms, MFU"
        f" {row['released_mfu']:.1%} ({row['released_mfu_with_update']:.1%}"
        " with the SGD update)"
    )
  return lines


def environment() -> dict:
  import jax  # noqa: PLC0415

  d = jax.devices()[0]
  return {
      "date": datetime.date.today().isoformat(),
      "jax": jax.__version__,
      "device_kind": d.device_kind,
      "platform": d.platform,
      "host_cpus": os.cpu_count(),
  }


def write(out: str, result: dict) -> None:
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "bench_mfu.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1, default=str)


def run_on_device(args, shapes) -> int:
  import jax  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415
  from linen_moe import planning  # noqa: PLC0415

  deadline = time.monotonic() + args.budget_s
  mesh = linen_moe.sharding.make_mesh("data=1", jax.devices()[:1])
  chip = planning.CHIPS.get(args.chip)
  peak = chip.peak_flops if chip else float("nan")
  result: dict[str, Any] = {
      "environment": environment(),
      "settings": {
          "seq": args.seq,
          "rounds": args.rounds,
          "peak_flops": peak,
          "learning_rate": LEARNING_RATE,
          "load_balance_loss_weight": LOAD_BALANCE,
          "shapes": {n: dataclasses.asdict(s) for n, s in shapes.items()},
      },
      "groups": [],
  }
  print(json.dumps(result["environment"]), flush=True)
  compiler = Compiler(mesh, shapes, args.seq, args.workers)
  todo = programs(shapes, shapes, args.variants)
  for p in todo:
    if time.monotonic() > deadline:
      break
    compiler.submit(p)
  try:
    for name, shape in shapes.items():
      for depth in shape.depths:
        if time.monotonic() > deadline:
          result["groups"].append(
              {"shape": name, "depth": depth, "cut": "deadline"}
          )
          continue
        variants = [
            p.variant for p in todo if (p.shape, p.depth) == (name, depth)
        ]
        print(f"== {name}, {depth} layer(s): {variants}", flush=True)
        try:
          group = time_group(
              compiler, shape, name, depth, variants, args.rounds, deadline
          )
        except Exception as e:  # noqa: BLE001 (the next group goes on)
          group = {
              "shape": name,
              "depth": depth,
              "error": f"{type(e).__name__}: {e}"[:600],
              "traceback": traceback.format_exc()[-2000:],
          }
          print(f"  {group['error']}", flush=True)
        result["groups"].append(group)
        result["layers"] = derive(result, shapes, peak, args.seq)
        write(args.out, result)
        for line in summary({"groups": [group]}):
          print("  " + line, flush=True)
  finally:
    compiler.close()
  result["layers"] = derive(result, shapes, peak, args.seq)
  write(args.out, result)
  print("== summary", flush=True)
  for line in summary(result):
    print(line, flush=True)
  print(f"wrote {os.path.join(args.out, 'bench_mfu.json')}", flush=True)
  return 0


# -- here, without the chip -------------------------------------------------


def aot(args, shapes) -> int:
  """Compiles every program for `--target` through libtpu: each must
  compile and fit."""
  from linen_moe import planning  # noqa: PLC0415

  target = planning.parse_target(args.target)
  planning.prepare_process(target)
  import jax  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415

  mesh = linen_moe.sharding.make_mesh(
      "data=1", planning.target_devices(target)[:1]
  )
  limit = target.device_memory_bytes
  print(
      f"jax {jax.__version__}, {args.target}: {limit / GIB:.2f} GiB a chip",
      flush=True,
  )
  compiler = Compiler(mesh, shapes, args.seq, args.workers, limit)
  todo = programs(shapes, shapes, args.variants)
  for p in todo:
    compiler.submit(p)
  records, failed = [], 0
  for p in todo:
    facts = compiler.result(p.key, float("inf"))
    shape = shapes[p.shape]
    rec = {
        "program": p.key,
        "batch": batch_of(shape, p.variant),
        "remat": remat_of(shape, p.variant),
        **facts,
    }
    records.append(rec)
    ok = "error" not in facts and facts.get("fits", False)
    failed += not ok
    m = facts.get("memory_bytes", {})
    print(
        f"{'ok' if ok else 'FAIL'} {p.key} batch {rec['batch']} remat"
        f" {rec['remat']}: "
        + (
            facts.get("error", "")[:300]
            or f"peak {m['peak'] / GIB:.2f} GiB (temp {m['temp'] / GIB:.2f}), compile {facts['compile_s']:.0f} s, compiler FLOPs {facts.get('compiler_flops', -1):.4g}, ragged-dot {facts['ragged_dot_ops']}, Pallas calls {facts['pallas_calls']} (row gathers {facts['row_gathers']})"
        ),
        flush=True,
    )
  compiler.close()
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"jax": jax.__version__, "records": records}, f, indent=1)
  print(f"{len(records) - failed} of {len(records)} compiled and fit")
  return 1 if failed else 0


def plan_search(args, shapes) -> int:
  """`planning.plan` (SGD) of each shape's deeper depth at `--batches` x
  `--remats`: the table `SHAPES` was chosen from."""
  import optax  # noqa: PLC0415

  from linen_moe import planning  # noqa: PLC0415

  target = planning.parse_target(args.target)
  planning.prepare_process(target)
  for name, shape in shapes.items():
    depth = max(shape.depths)
    for batch in args.batches:
      for remat in args.remats:
        planned = dataclasses.replace(shape, remat=remat)
        cfg = model_config(planned, depth, args.plan_variant)
        p = planning.plan(
            cfg,
            target,
            batch_size=batch,
            seq_len=args.seq,
            optimizer=optax.sgd(LEARNING_RATE),
        )
        print(
            f"{name} {depth} layer(s) {args.plan_variant} batch {batch}"
            f" remat {remat}: fits"
            f" {p.fits}, peak {p.per_device.peak_bytes / GIB:.2f} GiB of"
            f" {p.device_memory_bytes / GIB:.2f}, temp"
            f" {p.per_device.temp_bytes / GIB:.2f} GiB, compile"
            f" {p.compile_s:.0f} s"
            + (f" ({p.note[:120]})" if p.note else ""),
            flush=True,
        )
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
      "--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES)
  )
  parser.add_argument(
      "--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS)
  )
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--seq", type=int, default=SEQ)
  parser.add_argument(
      "--workers",
      type=int,
      default=min(8, os.cpu_count() or 1),
      help="programs compiled at once",
  )
  parser.add_argument(
      "--budget-s", type=float, default=300, help="the whole run's seconds"
  )
  parser.add_argument("--chip", default="v5e", help="whose peak FLOP/s")
  parser.add_argument("--out", default=".", help="where bench_mfu.json goes")
  parser.add_argument(
      "--target", help="compile for this target here (AOT), run nothing"
  )
  parser.add_argument("--json", help="--target: write the records here")
  parser.add_argument(
      "--plan", action="store_true", help="--target: the batch search"
  )
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument(
      "--plan-variant",
      default="bf16",
      choices=[v for v in VARIANTS if "remat" not in VARIANTS[v]],
      help="--plan: the variant searched (e.g. unrolled)",
  )
  parser.add_argument("--remats", nargs="+", default=["none", "full"])
  parser.add_argument(
      "--tiny",
      action="store_true",
      help="a tiny Qwen3-like model, 64-token rows (a CPU rehearsal)",
  )
  args = parser.parse_args(argv)
  if args.tiny:
    shapes = dict(TINY)
    args.seq = min(args.seq, 64)
  else:
    table = GPU_SHAPES if args.chip in GPU_CHIPS else SHAPES
    shapes = {n: table[n] for n in args.shapes}
  if args.plan:
    return plan_search(args, shapes)
  if args.target:
    return aot(args, shapes)
  return run_on_device(args, shapes)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  sys.exit(main())
