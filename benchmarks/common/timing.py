"""Timing a compiled call, and the float32 matmul roofline beside it.

Every benchmark measures its own roofline in the same process and rounds as
what it times, so that ratios stay meaningful on a shared, noisy machine.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

ROOFLINE_SHAPE = (8192, 512, 1024)  # [M, K] x [K, N], float32


def time_call(fn, args) -> tuple[float, float]:
  """Wall and CPU seconds (all threads of this process) of one call, run to
  completion."""
  start, start_cpu = time.perf_counter(), time.process_time()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start, time.process_time() - start_cpu


def median_times(fn, args, repeats: int) -> tuple[float, float]:
  """Median wall and CPU seconds of one call, after a first untimed one.

  On a shared machine, wall time grows with the load of other processes; CPU
  time much less, so it is the steadier measure of the work a step does.
  """
  jax.block_until_ready(fn(*args))
  wall, cpu = zip(*(time_call(fn, args) for _ in range(repeats)), strict=True)
  return sorted(wall)[len(wall) // 2], sorted(cpu)[len(cpu) // 2]


def roofline_step(shape: tuple[int, int, int] = ROOFLINE_SHAPE):
  """(jitted forward+backward of a plain float32 matmul, its arguments).

  The loss is half the sum of squares of `x @ w`, so its cotangent is the
  product itself: all three matmuls (forward, input and weight gradients)
  run. (A plain sum would let XLA drop the forward product and count flops
  it never ran.)
  """
  m, k, n = shape
  x = jax.random.normal(jax.random.key(0), (m, k))
  w = jax.random.normal(jax.random.key(1), (k, n))

  def loss(x, w):
    return 0.5 * jnp.sum(jnp.square(jnp.dot(x, w)))

  return jax.jit(jax.grad(loss, argnums=(0, 1))), (x, w)


def roofline_flops(shape: tuple[int, int, int] = ROOFLINE_SHAPE) -> float:
  """FLOPs of one `roofline_step`: three [M, K] x [K, N] matmuls."""
  m, k, n = shape
  return float(3 * 2 * m * k * n)


def roofline(repeats: int) -> dict[str, float]:
  """GFLOP/s of `roofline_step` at `ROOFLINE_SHAPE`, per wall second and
  per CPU second (medians of `repeats` calls)."""
  step, args = roofline_step()
  seconds, cpu = median_times(step, args, repeats)
  flops = roofline_flops()
  return {
      "step_s": seconds,
      "cpu_s": cpu,
      "gflops": flops / seconds / 1e9,
      "cpu_gflops": flops / cpu / 1e9,
  }
