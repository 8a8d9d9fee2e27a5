"""The attention implementations (`ModelConfig.attention`): compiled memory
of the train step, where blockwise starts to pay on CPU, and step time.

  python benchmarks/model/bench_attention.py memory [--seqs 8192 32768]
      [--layers 2] [--vocab 256] [--implementations einsum blockwise]
  python benchmarks/model/bench_attention.py crossover [--seqs 256 ... 4096]
  python benchmarks/model/bench_attention.py speed [--repeats 5]

memory     compiles (never runs) jax.jit(jax.grad(loss)) of the decoder at
           the Qwen3-30B-A3B layer shape (configs/qwen3_30b_a3b.yml: emb
           2048, 32 query / 4 KV heads of 128, 128 experts top-8 of 768;
           bfloat16, the sparse path, no remat) with `--layers` layers,
           batch 1, on abstract inputs, and prints XLA's
           `memory_analysis()` temp bytes for each implementation and
           length. Temp per layer = temp(L) - temp(L - 1) (both compiled).
           `--vocab` sets the vocabulary (the released 151,936 makes the
           [B, S, V] float32 logits of the loss, which are not attention's;
           the default 256 leaves attention's share). `--part attention`
           compiles the attention function alone at that layer's heads.
crossover  times the forward and backward of the attention alone (jitted
           jax.grad of sum(attend(q, k, v))) at the whole-model benchmark's
           heads (8 heads of 64, batch 8 / (S / 256) rows, so the tokens are
           the same at every length) for "einsum" and "blockwise",
           alternating, median of `--repeats`: where "auto" switches on CPU
           (`CPU_BLOCKWISE_FROM`).
speed      the whole-model benchmark's train step (`common/whole_model.Ours`,
           batch 8 x 256) with attention "auto" and "einsum", alternating in
           one run; then "blockwise" and "einsum" at batch 1 x 4096.

  python benchmarks/model/bench_attention.py tpu [--target tpu:v5e-4]
      [--seqs 8192]   (under a venv with libtpu: pip install 'jax[tpu]')

tpu        compiles (never runs) the attention alone, as `memory --part
           attention`, for a TPU slice through libtpu's topology
           (`linen_moe.planning`), the batch (one row a chip) sharded over
           a data=N mesh, with "splash" (its kernels in shard_map) and
           "blockwise", and prints each one's temp bytes per device.

  python benchmarks/model/bench_attention.py accelerator [--seqs 2048 8192]
      (on a machine with a TPU or GPU: benchmarks/device/README.md)

accelerator  times the attention alone on this machine's first device:
           jitted jax.grad of sum(attend) at the Qwen3-30B-A3B heads (32 /
           4 of 128), bfloat16, causal, batch 1, for "einsum", "blockwise"
           and the platform's fused kernel ("splash" on TPU, "dot_product"
           on GPU), alternating, median of `--repeats`; TFLOP/s of the
           causal attention's model FLOPs (6 B N S^2 D: the forward's two
           products and the backward's four, over the causal half) and each
           program's compiled temp bytes. A length an implementation cannot
           hold prints the compiler's or the runtime's error instead.

The rest runs on the CPU (it reads `jax.default_backend()` for "auto");
nice it, a compile at 32768 takes minutes.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

import linen_moe
from linen_moe import training

# The attention function alone (`crossover`, `memory --part attention`,
# `tpu`) and the CPU threshold of "auto" have no public name: the public face
# is `ModelConfig.attention`, through which `memory` and `speed` measure.
from linen_moe._src.models import attention as attention_lib  # noqa: TID251

from common import whole_model

GB = 1e9


def _qwen3_layers(layers: int, vocab: int, implementation: str):
  cfg = linen_moe.load_model_config("qwen3_30b_a3b")
  return cfg.replace(
      num_layers=layers,
      vocab_size=vocab,
      attention=implementation,
      **linen_moe.MATMUL_PATHS["sparse"],
  )


def train_temp_bytes(cfg, seq: int, batch: int = 1) -> int:
  """`memory_analysis()` temp bytes of jit(grad(loss)) of `cfg`, compiled
  on abstract parameters and tokens."""
  model = linen_moe.Decoder(cfg)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  variables = jax.eval_shape(
      lambda t: linen_moe.sharding.unbox(
          dict(model.init(jax.random.key(0), t))
      ),
      jax.ShapeDtypeStruct((batch, 8), jnp.int32),
  )

  def loss(params, rest, tokens):
    logits, aux = model.apply({**rest, "params": params}, tokens)
    return training.decoder_loss(logits, aux, tokens)[0]

  params = variables["params"]
  rest = {k: v for k, v in variables.items() if k != "params"}
  compiled = jax.jit(jax.grad(loss)).lower(params, rest, tokens).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def _attention_grad(impl: str, seq: int, batch: int):
  """(jit(grad(sum(attend))) wrt q, k, v at the Qwen3-30B-A3B attention
  (bf16, causal), (query heads, KV heads, head dim))."""
  cfg = _qwen3_layers(1, 256, impl)
  n, kv, d = cfg.num_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim

  def loss(q, k, v):
    pos = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    out = attention_lib.attend(
        q,
        k,
        v,
        positions=pos,
        key_positions=pos,
        window=0,
        scale=d**-0.5,
        dtype=jnp.bfloat16,
        implementation=impl,
        self_attention=True,
    )
    return jnp.sum(out.astype(jnp.float32))

  return jax.jit(jax.grad(loss, (0, 1, 2))), (n, kv, d)


def attention_temp_bytes(
    impl: str, seq: int, batch: int = 1, sharding=None
) -> int:
  """`memory_analysis()` temp bytes of jit(grad(sum(attend))) alone at the
  Qwen3-30B-A3B attention (32 query / 4 KV heads of 128, bf16, causal),
  per device with `sharding` (of the batch axis)."""
  grad, (n, kv, d) = _attention_grad(impl, seq, batch)
  q = jax.ShapeDtypeStruct((batch, seq, n, d), jnp.bfloat16, sharding=sharding)
  k = jax.ShapeDtypeStruct((batch, seq, kv, d), jnp.bfloat16, sharding=sharding)
  compiled = grad.lower(q, k, k).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def memory(args) -> None:
  if args.part == "attention":
    print(
        "Qwen3-30B-A3B attention alone (32 / 4 heads of 128, bf16, batch 1):"
        " jit(grad(sum(attend))) temp bytes"
    )
    print(f"{'attention':>10} {'S':>6} {'temp GB':>8}")
    for impl in args.implementations:
      for seq in args.seqs:
        temp = attention_temp_bytes(impl, seq)
        print(f"{impl:>10} {seq:>6} {temp / GB:>8.3f}", flush=True)
    return
  print(
      f"Qwen3-30B-A3B layer shape, batch 1, bf16, sparse, vocab {args.vocab}:"
      f" jit(grad(loss)) temp bytes ({args.layers} layers; per layer ="
      f" temp({args.layers}) - temp({args.layers - 1}))",
      flush=True,
  )
  print(f"{'attention':>10} {'S':>6} {'temp GB':>8} {'per layer':>10}")
  for impl in args.implementations:
    first = None
    for seq in args.seqs:
      start = time.perf_counter()
      full = train_temp_bytes(_qwen3_layers(args.layers, args.vocab, impl), seq)
      less = train_temp_bytes(
          _qwen3_layers(args.layers - 1, args.vocab, impl), seq
      )
      per = full - less
      first = first or (seq, per)
      ratio = (
          f"  x{per / first[1]:.2f} of S={first[0]}" if seq != first[0] else ""
      )
      print(
          f"{impl:>10} {seq:>6} {full / GB:>8.2f} {per / GB:>10.3f}{ratio}"
          f"  ({time.perf_counter() - start:.0f} s)",
          flush=True,
      )


def tpu(args) -> None:
  from linen_moe import planning  # noqa: PLC0415

  target = planning.parse_target(args.target)
  planning.prepare_process(target)
  devices = planning.target_devices(target)
  n = len(devices)
  mesh = linen_moe.sharding.make_mesh(f"data={n}", devices)
  batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  print(
      f"{args.target} ({devices[0].device_kind}, {n} devices), compiled through"
      " libtpu's topology: Qwen3-30B-A3B attention alone, batch"
      f" {n} (one row a device), jit(grad(sum(attend))) temp bytes a device"
  )
  print(f"{'attention':>10} {'S':>6} {'temp GB':>8} {'compile s':>10}")
  with linen_moe.sharding.mesh_context(mesh):
    for impl in args.implementations:
      for seq in args.seqs:
        start = time.perf_counter()
        temp = attention_temp_bytes(impl, seq, n, batch)
        print(
            f"{impl:>10} {seq:>6} {temp / GB:>8.3f}"
            f" {time.perf_counter() - start:>10.0f}",
            flush=True,
        )


def _attention_step(impl: str, batch: int, seq: int):
  heads, dim = 8, 64
  rng = np.random.default_rng(0)
  q, k, v = (
      jnp.asarray(rng.normal(size=(batch, seq, heads, dim)), jnp.float32)
      for _ in range(3)
  )
  pos = jnp.broadcast_to(jnp.arange(seq), (batch, seq))

  def loss(q, k, v):
    out = attention_lib.attend(
        q,
        k,
        v,
        positions=pos,
        key_positions=pos,
        window=0,
        scale=dim**-0.5,
        dtype=jnp.float32,
        implementation=impl,
        self_attention=True,
    )
    return jnp.sum(out)

  step = jax.jit(jax.grad(loss, (0, 1, 2)))
  jax.block_until_ready(step(q, k, v))
  return lambda: jax.block_until_ready(step(q, k, v))


def _alternate(fns: dict, repeats: int) -> dict[str, float]:
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def crossover(args) -> None:
  print(
      "attention fwd+bwd alone, 8 heads x 64, float32, causal, 2048 tokens a"
      f" step; median of {args.repeats}, alternating;"
      f" auto switches at S >= {attention_lib.CPU_BLOCKWISE_FROM} on CPU"
  )
  print(
      f"{'S':>6} {'batch':>5} {'einsum ms':>10} {'blockwise ms':>13}"
      f" {'ratio':>6}"
  )
  for seq in args.seqs:
    batch = max(1, 2048 // seq)
    fns = {i: _attention_step(i, batch, seq) for i in ("einsum", "blockwise")}
    t = _alternate(fns, args.repeats)
    print(
        f"{seq:>6} {batch:>5} {t['einsum'] * 1e3:>10.1f}"
        f" {t['blockwise'] * 1e3:>13.1f} {t['einsum'] / t['blockwise']:>6.2f}",
        flush=True,
    )


def _train_steps(cfg, impls, batch, seq):
  steps = {}
  for impl in impls:
    ours = whole_model.Ours(cfg.replace(attention=impl), None)
    ours.setup_train(batch, seq)
    ours.train()
    steps[impl] = ours.train
  return steps


def speed(args) -> None:
  base = whole_model.model_config(whole_model.MIXTRAL_SHAPE)
  for (a, b), (batch, seq) in (
      (("auto", "einsum"), (8, 256)),
      (("blockwise", "einsum"), (1, 4096)),
  ):
    t = _alternate(_train_steps(base, (a, b), batch, seq), args.repeats)
    print(
        f"{whole_model.MIXTRAL_SHAPE} train step {batch} x {seq}: {a}"
        f" {t[a] * 1e3:.0f} ms, {b} {t[b] * 1e3:.0f} ms, {b} / {a} ="
        f" {t[b] / t[a]:.3f}x (median of {args.repeats}, alternating)",
        flush=True,
    )


def _qwen3_attention_step(impl: str, seq: int):
  """(step, compiled temp bytes, model FLOPs): jitted grad of sum(attend)
  at the Qwen3-30B-A3B heads on real bf16 arrays of this process's device;
  the FLOPs 6 N S^2 D (batch 1)."""
  grad, (n, kv, d) = _attention_grad(impl, seq, 1)
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (1, seq, n, d), jnp.bfloat16)
  k, v = (jax.random.normal(x, (1, seq, kv, d), jnp.bfloat16) for x in keys[1:])
  compiled = grad.lower(q, k, v).compile()
  temp = int(compiled.memory_analysis().temp_size_in_bytes)
  jax.block_until_ready(compiled(q, k, v))
  step = lambda: jax.block_until_ready(compiled(q, k, v))  # noqa: E731
  return step, temp, 6 * n * seq * seq * d


def accelerator(args) -> None:
  device = jax.devices()[0]
  fused = {"tpu": "splash", "gpu": "dot_product"}.get(device.platform)
  impls = [i for i in ("einsum", "blockwise", fused) if i]
  print(
      f"{device.device_kind}: Qwen3-30B-A3B attention alone (32 / 4 heads of"
      " 128, bf16, causal, batch 1), jit(grad(sum(attend))); median of"
      f" {args.repeats}, alternating; TFLOP/s of 6 N S^2 D"
  )
  print(f"{'S':>6} {'attention':>10} {'ms':>9} {'TFLOP/s':>8} {'temp GB':>8}")
  for seq in args.seqs:
    steps, temps = {}, {}
    for impl in impls:
      try:
        steps[impl], temps[impl], flops = _qwen3_attention_step(impl, seq)
      except Exception as e:  # noqa: BLE001 (an OOM is a result here)
        print(f"{seq:>6} {impl:>10}  {type(e).__name__}: {str(e)[:160]}")
    t = _alternate(steps, args.repeats)
    for impl, seconds in t.items():
      print(
          f"{seq:>6} {impl:>10} {seconds * 1e3:>9.2f}"
          f" {flops / seconds / 1e12:>8.1f} {temps[impl] / GB:>8.3f}",
          flush=True,
      )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  mem = sub.add_parser("memory")
  mem.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
  mem.add_argument("--layers", type=int, default=2)
  mem.add_argument("--vocab", type=int, default=256)
  mem.add_argument(
      "--part",
      choices=("model", "attention"),
      default="model",
      help="the decoder's train step, or the attention function alone",
  )
  mem.add_argument(
      "--implementations", nargs="+", default=["einsum", "blockwise"]
  )
  cross = sub.add_parser("crossover")
  cross.add_argument(
      "--seqs", type=int, nargs="+", default=[256, 512, 1024, 2048]
  )
  cross.add_argument("--repeats", type=int, default=5)
  on_tpu = sub.add_parser("tpu")
  on_tpu.add_argument("--target", default="tpu:v5e-4")
  on_tpu.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
  on_tpu.add_argument(
      "--implementations", nargs="+", default=["splash", "blockwise"]
  )
  acc = sub.add_parser("accelerator")
  acc.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
  acc.add_argument("--repeats", type=int, default=10)
  fast = sub.add_parser("speed")
  fast.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  commands = {"memory": memory, "crossover": crossover, "speed": speed}
  commands["tpu"] = tpu
  commands["accelerator"] = accelerator
  commands[args.command](args)


if __name__ == "__main__":
  main()
