"""Variable initialisation as one compiled program.

Linen's `init` runs eagerly: every op of the initialisers and of the forward
pass it traces through is compiled and dispatched one by one, which for a
whole decoder is thousands of tiny compilations (seconds to tens of seconds
on a CPU). `compiled_init` runs the same `init` under `jax.jit`, keyed on the
module (a frozen, hashable dataclass, so equal configs share one program) and
on the shapes of the sample inputs. The initialisers draw the same random
numbers under `jit` as eagerly, so the variables are the same.

`JitInit` gives a Linen module an `init` that does this; the library's
top-level modules (`RoutedMoE`, `RoutedAndSharedMoE`, `Decoder`) use it, and
`nnx_adapter.EagerToNNX` builds its state through `compiled_init`. Both
compile through `jit_once`, as do the train states' initialisers (both front
ends, sharded or not).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import numpy as np

# The program runs once: compile it fast, not for speed. XLA's CPU backend at
# optimisation level 0 compiles a tiny decoder's init ~5x faster (measured
# 21 s -> 4 s for tiny_mixtral with fp8, scanned) and draws the same numbers.
_INIT_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


def jit_once(fun: Any, *, placed: bool = False, **jit_kwargs: Any):
  """`jax.jit(fun, **jit_kwargs)` for a program that runs once.

  Such as an initialisation: compiled with fast options (seconds less per
  program, the same numbers). Inside another trace (`eval_shape`, an outer
  `jit` or `scan`: compiler options are for top-level programs only) it is a
  plain `jax.jit`, part of that program and compiled with it.

  Args:
    fun: the function to compile.
    placed: commit each output array to the device it is on, as a restore
      from a checkpoint places its arrays. For a train state: a step jitted
      over a fresh state then is the same program as over a restored one
      (an uncommitted argument makes another one: a second compile on
      resume). No copy is made.
    **jit_kwargs: as `jax.jit` takes them (e.g. `static_argnums`).

  Returns:
    The jitted function (its `top_level` attribute is the `jax.jit` object
    that compiles with the fast options).

  Raises:
    TypeError: `placed` is not a bool.
  """
  if not isinstance(placed, bool):
    raise TypeError(f"jit_once: placed={placed!r} must be True or False.")
  fast = jax.jit(fun, compiler_options=_INIT_COMPILER_OPTIONS, **jit_kwargs)
  plain = jax.jit(fun, **jit_kwargs)

  @functools.wraps(fun)
  def call(*args, **kwargs):
    try:
      out = fast(*args, **kwargs)
    except ValueError as e:
      if "compiler_options" not in str(e):
        raise
      return plain(*args, **kwargs)
    return _commit(out) if placed else out

  call.top_level = fast  # the jitted function that compiles (and caches)
  return call


def _commit(tree: Any) -> Any:
  """`tree` with each array committed to its own device (no copy)."""
  return jax.tree.map(
      lambda x: jax.device_put(x, x.sharding)
      if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
      else x,
      tree,
  )


def _init(module: nn.Module, rngs: Any, args: tuple, kwargs: dict):
  return nn.Module.init(module, rngs, *args, **kwargs)


_jitted_init = jit_once(_init, static_argnums=0)


def _all_arrays(tree: Any) -> bool:
  return all(
      isinstance(leaf, (jax.Array, np.ndarray, np.generic))
      for leaf in jax.tree.leaves(tree)
  )


def compiled_init(module: nn.Module, rngs: Any, *args: Any, **kwargs: Any):
  """`module.init(rngs, *args, **kwargs)`, compiled once per module and shapes.

  Falls back to Linen's eager `init` when the module is not hashable or an
  argument is not an array (a Python flag would have to be static).

  Args:
    module: the Linen module (a frozen, hashable dataclass).
    rngs: a PRNG key or a dict of them, as `init` takes.
    *args: sample inputs.
    **kwargs: keyword inputs.

  Returns:
    The module's variables, the numbers eager `init` gives.
  """
  try:
    hash(module)
  except TypeError:
    return nn.Module.init(module, rngs, *args, **kwargs)
  if not _all_arrays((rngs, args, kwargs)):
    return nn.Module.init(module, rngs, *args, **kwargs)
  return _jitted_init(module, rngs, args, kwargs)


class JitInit:
  """Mixin for a Linen module: `init` compiles once (see `compiled_init`).

  Only the plain form `init(rngs, *arrays, **arrays)` is compiled; with
  `method=`, `mutable=` or `capture_intermediates=` it is Linen's `init`.
  """

  @nn.nowrap
  def init(self, rngs, *args, **kwargs):
    linen_only = ("method", "mutable", "capture_intermediates")
    if any(name in kwargs for name in linen_only):
      return nn.Module.init(self, rngs, *args, **kwargs)
    return compiled_init(self, rngs, *args, **kwargs)
