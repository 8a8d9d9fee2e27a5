"""How fast XLA:CPU reads expert weights in a decode-size matmul.

  python benchmarks/layer/bench_expert_dots.py [--rounds 40]

At decode sizes the MoE layer multiplies a few rows per expert by every
expert's weights ([E, T, M] x [E, M, H], `sparse.every_expert`), so a decode
step is bound by how fast those dots read the weights. This times, in one
process, each formulation over the same 12 float32 weights of the
whole-model benchmark's experts ([8, 512, 1024], 4 layers x 3; 201 MB) and
prints its median milliseconds and the GB/s at which it reads them: a plain
compiled sum of the weights (the read limit), the batched dot at T = 1, 2,
4, 8 and 16 rows per expert, one dot per expert, the weight as the left
operand, and for the down projection ([E, T, H] x [E, H, M]) the batched
dot against one [T, E * H] x [E * H, M] matmul.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common import timing

E, M, H = 8, 512, 1024  # experts, emb, mlp: the whole-model benchmark's
WEIGHTS = 12


def _median_ms(fn, args, rounds: int) -> float:
  """Median milliseconds of `rounds` calls of jitted `fn`, compiled first."""
  fn = jax.jit(fn)
  timing.time_call(fn, args)
  return (
      statistics.median(timing.time_call(fn, args)[0] for _ in range(rounds))
      * 1e3
  )


def _summed(product):
  """A function summing `product(x, w)` over the weights: every dot runs."""
  return lambda x, ws: sum(jnp.sum(product(x, w)) for w in ws)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=40)
  args = parser.parse_args()
  keys = jax.random.split(jax.random.key(0), WEIGHTS + 1)
  wi = [jax.random.normal(k, (E, M, H)) for k in keys[:WEIGHTS]]
  wo = [jnp.swapaxes(w, 1, 2) for w in wi]  # [E, H, M]
  nbytes = sum(w.nbytes for w in wi)

  def x(*shape):
    return jax.random.normal(keys[-1], shape)

  cases = [
      (
          "read (sum of the weights)",
          lambda ws: sum(jnp.sum(w) for w in ws),
          (wi,),
      ),
  ]
  for t in (1, 2, 4, 8, 16):
    cases.append((
        f"batched etm,emh, T={t}",
        _summed(lambda x, w: jnp.einsum("etm,emh->eth", x, w)),
        (x(E, t, M), wi),
    ))
  cases += [
      (
          "one dot per expert, T=8",
          _summed(lambda x, w: jnp.stack([x[e] @ w[e] for e in range(E)])),
          (x(E, 8, M), wi),
      ),
      (
          "weight as lhs emh,etm, T=8",
          _summed(lambda x, w: jnp.einsum("emh,etm->eht", w, x)),
          (x(E, 8, M), wi),
      ),
      (
          "down batched eth,ehm, T=8",
          _summed(lambda x, w: jnp.einsum("eth,ehm->etm", x, w)),
          (x(E, 8, H), wo),
      ),
      (
          "down as one [T, E*H] matmul, T=8",
          _summed(lambda x, w: x @ w.reshape(E * H, M)),
          (x(8, E * H), wo),
      ),
  ]
  print(
      f"{WEIGHTS} float32 weights of [{E}, {M}, {H}] ({nbytes / 1e6:.0f} MB),"
      f" median of {args.rounds} calls each"
  )
  for name, fn, fn_args in cases:
    ms = _median_ms(fn, fn_args, args.rounds)
    print(f"  {name:>34}: {ms:7.2f} ms, {nbytes / ms / 1e6:5.1f} GB/s")


if __name__ == "__main__":
  main()
