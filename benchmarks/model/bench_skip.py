"""What skipping non-finite steps costs: the Linen train step with the skip
beside the same step without it.

`python benchmarks/model/bench_skip.py [--quantization fp8] [--rounds 12]` prints
the best step time of each over interleaved rounds, their ratio, and the
compiled steps' temporary / argument / output memory.
"""

import argparse
import time

import jax
import jax.numpy as jnp

from linen_moe import Decoder
from linen_moe import load_model_config

# The step without its skip is the library's own step with the skip's pieces
# patched out around its compile: no public switch turns the skip off (it is
# the train step's guarantee), and a copy of the step built here from public
# pieces would time the copy, not the library's step.
from linen_moe._src.training import skip  # noqa: TID251
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
from linen_moe.training import init_train_state
from linen_moe.training import make_train_step


def _compile(cfg, optimizer, state, tokens, with_skip: bool):
  """The compiled train step; without the skip, its finite check and its
  `lax.cond` are patched out (the update always applies)."""
  finite, apply = skip.all_finite, skip.apply_if_finite
  if not with_skip:  # traced once, so patching around the compile suffices
    skip.all_finite = lambda tree: jnp.array(True)
    skip.apply_if_finite = lambda ok, update, state: update(state)
  try:
    step = jax.jit(make_train_step(Decoder(cfg), optimizer))
    return step.lower(state, tokens, jax.random.key(1)).compile()
  finally:
    skip.all_finite, skip.apply_if_finite = finite, apply


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="tiny_mixtral")
  p.add_argument("--quantization", default="fp8")
  p.add_argument("--rounds", type=int, default=12)
  p.add_argument("--steps", type=int, default=20)
  a = p.parse_args()
  cfg = load_model_config(a.config, quantization=a.quantization)
  optimizer = default_optimizer()
  tokens = jnp.asarray(next(MarkovData(cfg.vocab_size).batches(16, 32)))
  state = jax.jit(lambda t, r: init_train_state(Decoder(cfg), optimizer, t, r))(
      tokens, jax.random.key(0)
  )
  steps = {
      name: _compile(cfg, optimizer, state, tokens, name == "skip")
      for name in ("skip", "plain")
  }
  best = dict.fromkeys(steps, float("inf"))
  for _ in range(a.rounds):
    for name, step in steps.items():
      s = state
      jax.block_until_ready(step(s, tokens, jax.random.key(1)))
      start = time.perf_counter()
      for i in range(a.steps):
        s, _ = step(s, tokens, jax.random.key(i))
      jax.block_until_ready(s)
      best[name] = min(best[name], (time.perf_counter() - start) / a.steps)
  print(
      f"{a.config} {a.quantization}: step skip {1e3 * best['skip']:.2f} ms, "
      f"plain {1e3 * best['plain']:.2f} ms, "
      f"skip/plain {best['skip'] / best['plain']:.3f}"
  )
  for name, step in steps.items():
    m = step.memory_analysis()
    print(
        f"  {name}: temp {m.temp_size_in_bytes / 2**20:.2f} MiB, arguments "
        f"{m.argument_size_in_bytes / 2**20:.2f} MiB, outputs "
        f"{m.output_size_in_bytes / 2**20:.2f} MiB"
    )


if __name__ == "__main__":
  main()
