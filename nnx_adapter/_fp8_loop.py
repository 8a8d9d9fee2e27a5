"""fp8 in a training loop of your own: `value_and_grad`, and the warning a
loop that never updates the fp8 state gets.

Flax's fp8 ops return the new scales and amax histories as the "gradient"
of the fp8 state (`Fp8State`); `train_step` differentiates it and writes
that value back. A loop written as the Flax docs write one,

    loss, grads = nnx.value_and_grad(loss_fn)(model)    # nnx.Param only
    optimizer.update(model, grads)

never does, so the scales stay at 1 whatever the amax: fp8 training then
quantizes with stale scales. `value_and_grad` is the drop-in that does
(one line changes), and a step that differentiates the parameters but not
the fp8 state warns once, when it is traced (`_adapter.warn_if_fp8_frozen`,
called by `EagerToNNX` and `Decoder`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx
import jax

from linen_moe import frontend
from nnx_adapter._adapter import Fp8State


def value_and_grad(
    fn: Callable[..., Any], *, has_aux: bool = False, wrt: Any = nnx.Param
) -> Callable[..., tuple[Any, nnx.State]]:
  """`nnx.value_and_grad` of `fn(model, ...)` that also updates the fp8
  state: a drop-in for the Flax docs' training loop.

  Example usage:

    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens, rng):
      loss_fn = lambda m: nnx_adapter.decoder_loss(m, tokens, rng)
      (loss, metrics), grads = nnx_adapter.value_and_grad(  # not nnx's
          loss_fn, has_aux=True
      )(model)
      optimizer.update(model, grads)
      return loss

  Args:
    fn: `fn(model, *args, **kwargs)`, the loss (or `(loss, aux)` with
      `has_aux`); `model` an `nnx.Module` (e.g. `nnx_adapter.Decoder`).
    has_aux: whether `fn` returns `(loss, aux)`.
    wrt: the variables the optimizer trains (`nnx.Param`, or a filter such
      as LoRA's adapters), as `nnx.Optimizer`'s `wrt`.

  Returns:
    A function of `(model, *args, **kwargs)` returning `(value, grads)`,
    as `nnx.value_and_grad(fn, has_aux=has_aux)` does with `grads` the
    `wrt` variables' gradients alone, having written the new fp8 state
    (the `Fp8State` "gradients") into `model`. A model without fp8 state
    is differentiated as `nnx.value_and_grad` would.

  Raises:
    TypeError: `fn` is not callable.
  """
  if not callable(fn):
    raise TypeError(
        f"value_and_grad: fn={fn!r} is not callable; expected the loss "
        "function fn(model, ...)."
    )
  both = nnx.DiffState(0, nnx.Any(wrt, Fp8State))
  grad_fn = nnx.value_and_grad(fn, argnums=both, has_aux=has_aux)

  def step(model: nnx.Module, *args, **kwargs):
    value, grads = grad_fn(model, *args, **kwargs)
    param_grads, fp8_grads = nnx.split_state(grads, wrt, Fp8State)
    fp8_state = nnx.state(model, Fp8State)
    if jax.tree.leaves(fp8_state):
      nnx.update(model, frontend.overwrite_with_gradient(fp8_state, fp8_grads))
    return value, param_grads

  return step
