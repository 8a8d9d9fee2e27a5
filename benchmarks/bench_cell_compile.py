"""Where a `linen-moe matrix` cell's time goes before its steps run.

For each cell (config/quantization/path/layers/frontend), in this process:
the train state's init, tracing and lowering the train step, and XLA's
compile, in seconds, as `linen_moe_cli.matrix.run_cell` does them, and the
size of the compiled step (lines of optimised HLO). Point
`JAX_COMPILATION_CACHE_DIR` at an empty directory for cold-cache figures;
`--fast-compile` compiles as `linen-moe matrix` does by default.

  JAX_COMPILATION_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python \\
      benchmarks/bench_cell_compile.py --fast-compile \\
      tiny_mixtral/fp8/sparse/scanned/linen tiny_mixtral/fp8/dense/scanned/nnx
"""

from __future__ import annotations

import argparse
import time

from linen_moe.testing import use_fast_compile


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("cells", nargs="+", help="config/quant/path/layers/fe")
  parser.add_argument("--fast-compile", action="store_true")
  a = parser.parse_args()
  if a.fast_compile:
    use_fast_compile()
  import jax  # noqa: PLC0415 (after the XLA flags)
  import jax.numpy as jnp  # noqa: PLC0415

  from linen_moe.training import MarkovData  # noqa: PLC0415
  from linen_moe.training import default_optimizer  # noqa: PLC0415
  from linen_moe_cli import matrix  # noqa: PLC0415
  from linen_moe_cli.frontends import frontend  # noqa: PLC0415

  for spec in a.cells:
    cell = matrix.Cell(*spec.split("/"))
    cfg, fe = cell.model_config(), frontend(cell.frontend)
    optimizer = default_optimizer(matrix.MATRIX_LEARNING_RATE)
    tokens = jnp.asarray(next(MarkovData(cfg.vocab_size).batches(2, 8)))
    rng = jax.random.key(0)
    start = time.perf_counter()
    state = jax.block_until_ready(fe.init(cfg, optimizer, tokens, rng))
    inited = time.perf_counter()
    lowered = jax.jit(fe.make_step(cfg, optimizer)).lower(state, tokens, rng)
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    hlo_lines = len(compiled.as_text().splitlines())
    print(
        f"{spec}: init {inited - start:.2f}s  trace+lower "
        f"{traced - inited:.2f}s  compile {done - traced:.2f}s  "
        f"({hlo_lines} lines of optimised HLO)"
    )


if __name__ == "__main__":
  main()
