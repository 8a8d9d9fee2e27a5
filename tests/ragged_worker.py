"""Ragged all-to-all checks on 8 simulated CPU devices, run in a subprocess.

`python -m tests.ragged_worker '<json list of jobs>'` prints one JSON line
with their results; `tests/kernels/test_ragged_all_to_all.py` asserts on them. The
layer and train-step jobs are `tests.sharding_worker`'s.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
)

import json  # noqa: E402
import sys  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402

from linen_moe import RoutedMoE  # noqa: E402
from linen_moe import hlo
from linen_moe import load_moe_config  # noqa: E402
from linen_moe import sharding  # noqa: E402
from linen_moe._src.hlo import reading
from linen_moe._src.kernels import ragged_collectives  # noqa: E402
from tests import sharding_worker  # noqa: E402


def definition(operand, output, input_offsets, send_sizes, output_offsets):
  """`jax.lax.ragged_all_to_all` on every device, from its docstring, in
  NumPy: arrays [D, ...] (one row per device) -> results [D, O, ...]."""
  d, k = input_offsets.shape
  per = k // d
  result = np.array(output)
  for src in range(d):
    for i in range(k):
      dst, size = i // per, send_sizes[src, i]
      start = input_offsets[src, i]
      # Where dst writes it: the offset src gave for slice i.
      at = output_offsets[src, i]
      result[dst, at : at + size] = operand[src, start : start + size]
  return result


def _case(rng, d: int, per: int, row: int = 3):
  """Random slices (some empty), packed with gaps on both sides."""
  k = d * per
  n = o = k * (row + 1) + 2
  sizes = rng.integers(0, row + 1, size=(d, k))  # [src, slice]
  sizes[0, :] = 0  # a device that sends nothing
  gaps = rng.integers(0, 2, size=(d, k))
  input_offsets = np.cumsum(sizes + gaps, axis=1) - sizes
  # Receiver dst lays out its slices by (source, slot), with gaps.
  output_offsets = np.zeros((d, k), np.int64)
  recv_sizes = np.zeros((d, k), np.int64)
  for dst in range(d):
    cursor = 1
    for src in range(d):
      for slot in range(per):
        i = dst * per + slot  # src's slice to dst
        output_offsets[src, i] = cursor
        recv_sizes[dst, src * per + slot] = sizes[src, i]
        cursor += sizes[src, i] + gaps[src, i]
  operand = rng.normal(size=(d, n, 2)).astype(np.float32)
  output = np.full((d, o, 2), -7.0, np.float32)
  ints = [a.astype(np.int32) for a in (input_offsets, sizes, output_offsets)]
  return operand, output, *ints, recv_sizes.astype(np.int32)


def emulation(job: dict) -> dict:
  """The emulation against `definition` (values) and against the
  definition's transpose (gradients), on each (mesh, axis, slices per
  destination)."""
  del job
  rng = np.random.default_rng(0)
  out = {}
  for spec, axis, per in (
      ("expert=8", "expert", 1),
      ("expert=8", "expert", 2),
      ("data=2,expert=4", "expert", 1),
  ):
    mesh = sharding.make_mesh(spec)
    d = mesh.shape[axis]
    case = _case(rng, d, per)
    probe = rng.normal(size=case[1].shape).astype(np.float32)

    def run(operand, output, *sizes, mesh=mesh, axis=axis):
      """The result on every device of `axis`, [D, O, 2] (replicated over
      the mesh's other axes)."""

      def body(*a):
        local = [x[0] for x in a]
        return ragged_collectives.emulated_ragged_all_to_all(
            *local, axis_name=axis
        )[None]

      args = [
          jax.device_put(a, NamedSharding(mesh, P(axis)))
          for a in (operand, output, *sizes)
      ]
      f = jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis))
      return f(*args)

    def value_and_transpose(operand, output, sizes, probe, run=run):
      value, vjp = jax.vjp(lambda a, b: run(a, b, *sizes), operand, output)
      return value, vjp(probe)

    want = definition(*case[:5])
    value, (d_operand, d_output) = jax.jit(value_and_transpose)(
        case[0], case[1], case[2:], probe
    )
    # The transpose of the definition: each sent row gets its destination's
    # probe row; rows of output that nothing overwrote pass it through.
    want_operand = np.zeros_like(case[0])
    written = np.zeros(case[1].shape[:2], bool)
    input_offsets, sizes, output_offsets = case[2:5]
    for src in range(d):
      for i in range(d * per):
        dst, size = i // per, sizes[src, i]
        at, start = output_offsets[src, i], input_offsets[src, i]
        want_operand[src, start : start + size] = probe[dst, at : at + size]
        written[dst, at : at + size] = True
    want_output = np.where(written[..., None], 0.0, probe)
    out[f"{spec}/{axis}/{per}"] = {
        "value_err": float(np.max(np.abs(np.asarray(value) - want))),
        "operand_grad_err": float(np.max(np.abs(d_operand - want_operand))),
        "output_grad_err": float(np.max(np.abs(d_output - want_output))),
        "sent_rows": int(case[3].sum()),
    }
  # The docstring's own example (axis of size 2, via the first 2 devices).
  example = [
      np.array(a)
      for a in (
          [[1, 2, 2], [3, 4, 0]],
          [[0, 0, 0, 0], [0, 0, 0, 0]],
          [[0, 1], [0, 1]],
          [[1, 2], [1, 1]],
          [[0, 0], [1, 2]],
          [[1, 1], [2, 1]],
      )
  ]
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])

  def body(*a):
    return ragged_collectives.emulated_ragged_all_to_all(
        *(x[0] for x in a), axis_name="x"
    )[None]

  args = [
      jax.device_put(
          jnp.asarray(a, jnp.float32 if i < 2 else jnp.int32),
          NamedSharding(mesh, P("x")),
      )
      for i, a in enumerate(example)
  ]
  got = jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
  )(*args)
  out["docstring_example"] = np.asarray(got).tolist()
  return out


def device_program(job: dict) -> dict:
  """What GPU/TPU get: the same layer with the real op (its lowering; XLA:
  CPU cannot compile it) and, under "auto" on this CPU, the all-gather."""
  cfg = load_moe_config(
      "tiny_mixtral", quantization=job.get("quantization", "fp8")
  )
  x = jax.random.normal(jax.random.key(3), (8, 8, cfg.emb_dim))
  variables = sharding.unbox(RoutedMoE(cfg).init(jax.random.key(0), x))

  def loss(c):
    def f(variables, x):
      return jnp.sum(RoutedMoE(c).apply(variables, x)[0] ** 2)

    return jax.jit(jax.grad(f))

  out = {}
  with sharding.mesh_context(sharding.make_mesh("data=2,expert=4")):
    ragged = cfg.replace(expert_parallel="ragged_all_to_all")
    with mock.patch.object(
        ragged_collectives, "needs_emulation", lambda *_: False
    ):
      lowered = loss(ragged).lower(variables, x).as_text()
    out["real_op_calls"] = lowered.count("@ragged_all_to_all")
    emulated = loss(ragged).lower(variables, x).compile().as_text()
    out["emulated_counts"] = reading.collective_counts(emulated)
    auto = loss(cfg).lower(variables, x).compile().as_text()
    out["auto_counts"] = reading.collective_counts(auto)
  return out


def traffic(job: dict) -> dict:
  """Bytes each device sends in the expert-parallel body of one layer's
  forward and backward (input gradient included), read from the compiled
  HLO, for both strategies on `mesh`."""
  cfg = load_moe_config("tiny_mixtral", quantization="none")
  x = jax.random.normal(jax.random.key(3), (8, 8, cfg.emb_dim))
  variables = sharding.unbox(RoutedMoE(cfg).init(jax.random.key(0), x))
  mesh = sharding.make_mesh(job.get("mesh", "expert=8"))
  out = {}
  for strategy in ("all_gather", "ragged_all_to_all"):
    c = cfg.replace(expert_parallel=strategy)

    def loss(variables, x, c=c):
      return jnp.sum(RoutedMoE(c).apply(variables, x)[0] ** 2)

    with sharding.mesh_context(mesh):
      text = (
          jax.jit(jax.grad(loss, (0, 1)))
          .lower(variables, x)
          .compile()
          .as_text()
      )
    out[strategy] = hlo.sent_bytes(text, mesh.size, "shard_map")
  return out


CHECKS = {
    "traffic": traffic,
    "emulation": emulation,
    "device_program": device_program,
    "layer": sharding_worker.layer,
    "equivalence": sharding_worker.equivalence,
}


def main(argv: list[str]) -> None:
  jobs = json.loads(argv[1])
  print(json.dumps([CHECKS[job["check"]](job) for job in jobs]))


if __name__ == "__main__":
  main(sys.argv)
