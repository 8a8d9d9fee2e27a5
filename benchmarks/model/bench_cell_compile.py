"""Where a `linen-moe matrix` cell's time goes before its steps run.

For each cell (config/quantization/path/layers/frontend), in this process:
the train state's init, tracing and lowering the train step, and XLA's
compile, in seconds, as `linen-moe matrix` does them (the same config: the
scanned stack compiled as a loop, `scan_unroll=1`; the same learning rate),
and the size of the compiled step (lines of optimised HLO). Point
`JAX_COMPILATION_CACHE_DIR` at an empty directory for cold-cache figures;
`--fast-compile` compiles as `linen-moe matrix` does by default.
`--grad-accum 1 2` compiles each cell's step with each number of
microbatches, all at the batch of the largest (2 rows a microbatch).

  JAX_COMPILATION_CACHE_DIR=$(mktemp -d) python \\
      benchmarks/model/bench_cell_compile.py --fast-compile \\
      tiny_mixtral/fp8/sparse/scanned/linen tiny_mixtral/fp8/dense/scanned/nnx
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from linen_moe.testing import use_fast_compile

# `linen-moe matrix`'s learning rate (its second step must lower the loss).
MATRIX_LEARNING_RATE = 1e-3


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("cells", nargs="+", help="config/quant/path/layers/fe")
  parser.add_argument("--fast-compile", action="store_true")
  parser.add_argument(
      "--grad-accum",
      type=int,
      nargs="+",
      default=[1],
      help="microbatches per step, each compiled (default: 1)",
  )
  a = parser.parse_args()
  if a.fast_compile:
    use_fast_compile()
  import jax  # noqa: PLC0415 (after the XLA flags)
  import jax.numpy as jnp  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415
  from linen_moe.training import MarkovData  # noqa: PLC0415
  from linen_moe.training import default_optimizer  # noqa: PLC0415

  from common.frontends import frontend  # noqa: PLC0415

  for spec in a.cells:
    config, quantization, path, layers, frontend_name = spec.split("/")
    cfg = linen_moe.load_model_config(
        config,
        quantization=quantization,
        scan_layers=layers == "scanned",
        scan_unroll=1,
        **linen_moe.MATMUL_PATHS[path],
    )
    fe = frontend(frontend_name)
    optimizer = default_optimizer(MATRIX_LEARNING_RATE)
    batch = 2 * max(a.grad_accum)
    tokens = jnp.asarray(next(MarkovData(cfg.vocab_size).batches(batch, 8)))
    rng = jax.random.key(0)
    start = time.perf_counter()
    state = jax.block_until_ready(fe.init(cfg, optimizer, tokens, rng))
    inited = time.perf_counter()
    print(f"{spec}: init {inited - start:.2f}s ({batch} x 8 tokens)")
    for grad_accum in a.grad_accum:
      start = time.perf_counter()
      step = fe.make_step(cfg, optimizer, grad_accum)
      lowered = jax.jit(step).lower(state, tokens, rng)
      traced = time.perf_counter()
      compiled = lowered.compile()
      done = time.perf_counter()
      hlo_lines = len(compiled.as_text().splitlines())
      print(
          f"  grad_accum {grad_accum}: trace+lower {traced - start:.2f}s  "
          f"compile {done - traced:.2f}s  ({hlo_lines} lines of optimised "
          "HLO)"
      )


if __name__ == "__main__":
  main()
