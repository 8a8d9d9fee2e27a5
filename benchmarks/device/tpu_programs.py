"""Programs compiled for a TPU through libtpu, without the TPU: the pieces
the `compile_*.py` scripts share. Call after `targets.prepare_process`.

  place = placer(device)             # one-device mesh of the target
  x = place((8, 4096, 2048))         # a bf16 ShapeDtypeStruct on it
  compiled = layer_gradients(cfg, x, place)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from linen_moe import RoutedMoE


def placer(device) -> Callable[..., jax.ShapeDtypeStruct]:
  """`place(shape, dtype=bf16)`: a ShapeDtypeStruct whole on `device` (a
  one-device mesh, axis "x"); `place.mesh` is that mesh."""
  mesh = jax.sharding.Mesh([device], ("x",))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def place(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=whole)

  place.mesh = mesh
  return place


def layer_gradients(cfg, x: jax.ShapeDtypeStruct, place) -> jax.stages.Compiled:
  """The MoE layer `RoutedMoE(cfg)`'s forward + backward (gradients of the
  weights and of `x` [B, S, M], of sum(y) plus the load-balance loss),
  compiled for the device of `place` (`placer`). The parameters' shapes
  are traced on this host (through `ragged_dot`, which any host runs)."""
  shapes = jax.eval_shape(
      RoutedMoE(cfg.replace(grouped_matmul="ragged_dot")).init,
      jax.random.key(0),
      jax.ShapeDtypeStruct(x.shape, x.dtype),
  )
  params = jax.tree.map(lambda s: place(s.shape, s.dtype), shapes["params"])

  def loss(params, x):
    y, aux = RoutedMoE(cfg).apply(
        {"params": params}, x, rngs={"params": jax.random.key(1)}
    )
    return jnp.sum(y.astype(jnp.float32)) + aux.load_balance_loss

  with jax.set_mesh(place.mesh):
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
