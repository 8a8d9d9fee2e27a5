"""Checkpoint checks that need their own process, run by test_checkpoint.py.

`python -m tests.checkpoint_worker mesh '<json job>'` saves a sharded train
state on 8 simulated CPU devices and restores it onto other meshes, front
ends and layer layouts, printing one JSON line of results.

`python -m tests.checkpoint_worker kill DIR` saves step 1 of a small tree
into DIR, then starts saving step 2 and blocks it just before orbax's atomic
commit (the rename of the finished temporary directory), printing
"committing" so that the test can SIGKILL it there.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.argv[1:2] == ["mesh"]:
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + " --xla_force_host_platform_device_count=8"
  )

import json  # noqa: E402
import time  # noqa: E402

from flax import traverse_util  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from linen_moe import MATMUL_PATHS  # noqa: E402
from linen_moe import checkpoint  # noqa: E402
from linen_moe import load_model_config  # noqa: E402
from linen_moe import sharding  # noqa: E402
from linen_moe.training import default_optimizer  # noqa: E402
import nnx_adapter  # noqa: E402
from nnx_adapter import frontend as get_frontend  # noqa: E402

KILL_TREE_SIZE = 1 << 16


def kill_tree(step: int) -> dict:
  """A small checkpoint tree whose values depend on `step`."""
  w = jnp.arange(KILL_TREE_SIZE, dtype=jnp.float32) + step
  return {"variables": {"params": {"w": w}}, "step": jnp.int32(step)}


def kill(directory: str) -> None:
  from orbax.checkpoint._src.path import atomicity  # noqa: PLC0415

  with checkpoint.Checkpoints(directory) as ckpts:
    ckpts.save(1, kill_tree(1), {})
    ckpts.wait_until_finished()
    print("saved 1", flush=True)

    async def blocked_rename(*args, **kwargs):
      del args, kwargs
      print("committing", flush=True)
      time.sleep(600)

    atomicity.async_path.rename = blocked_rename
    ckpts.save(2, kill_tree(2), {})
    ckpts.wait_until_finished()
  print("not killed", flush=True)


def _perturbed(state):
  """Every leaf moved by a leaf-specific ramp, in its own sharding, so no
  two leaves or elements are alike (a zero optimizer state would restore
  from anywhere)."""

  def move(i, x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x + 7
    ramp = jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) / x.size
    return x + ramp + i

  leaves, tree = jax.tree.flatten(state)
  shardings = [x.sharding for x in leaves]
  moved = jax.jit(
      lambda xs: [move(i, x) for i, x in enumerate(xs)], out_shardings=shardings
  )(leaves)
  return jax.tree.unflatten(tree, moved)


def _expected(saved: dict, path: tuple) -> np.ndarray:
  """The saved value a target leaf must hold, from the saved flat tree:
  `layers_i` reads row i of the saved stack, `layers` stacks `layers_i`."""
  if path in saved:
    return saved[path]
  for j, part in enumerate(path):
    if part.startswith("layers_"):
      return saved[(*path[:j], "layers", *path[j + 1 :])][int(part[7:])]
    if part == "layers":
      rows, i = [], 0
      while (row := (*path[:j], f"layers_{i}", *path[j + 1 :])) in saved:
        rows.append(saved[row])
        i += 1
      return np.stack(rows)
  raise KeyError(path)


def mesh(job: dict) -> dict:
  """Saves a perturbed Linen train state sharded on `job["save_on"]`, then
  restores it onto each target (mesh or None for one device, front end,
  layers) and reports, per target, leaves whose sharding or value differ."""
  base = load_model_config(
      "tiny_mixtral",
      quantization=job["quantization"],
      **MATMUL_PATHS[job["path"]],
  )
  layers = {"scanned": True, "unrolled": False}
  optimizer = default_optimizer()
  tokens = jnp.zeros((8, 8), jnp.int32)
  rng = jax.random.key(0)
  cfg = base.replace(scan_layers=layers[job["save_layers"]])
  run = nnx_adapter.frontend("linen").sharded(
      cfg, optimizer, sharding.make_mesh(job["save_on"])
  )
  state = _perturbed(run.init(tokens, rng))
  fe = get_frontend("linen")
  tree = fe.checkpoint_tree(state)
  saved = {
      p: np.asarray(x) for p, x in traverse_util.flatten_dict(tree).items()
  }
  meta = {"model_config": checkpoint.config_dict(cfg)}
  with checkpoint.Checkpoints(job["dir"]) as ckpts:
    ckpts.save(1, tree, meta)
  out = {}
  for spec, frontend, layout in job["targets"]:
    target_cfg = base.replace(scan_layers=layers[layout])
    fe = get_frontend(frontend)
    if spec is None:
      target = jax.eval_shape(
          lambda t, r, fe=fe, c=target_cfg: fe.init(c, optimizer, t, r),
          tokens,
          rng,
      )
    else:
      target_run = nnx_adapter.frontend(frontend).sharded(
          target_cfg, optimizer, sharding.make_mesh(spec)
      )
      target = target_run.abstract_state(tokens, rng)
    wanted = checkpoint.abstract(fe.checkpoint_tree(target))
    with checkpoint.Checkpoints(job["dir"]) as ckpts:
      restored = ckpts.restore(wanted, config=target_cfg)
    state = fe.from_checkpoint_tree(restored.tree, target)  # must fit
    got = traverse_util.flatten_dict(fe.checkpoint_tree(state))
    want = traverse_util.flatten_dict(wanted)
    bad_sharding, bad_value = [], []
    for path, x in got.items():
      w = want[path]
      if not x.sharding.is_equivalent_to(w.sharding, len(w.shape)):
        bad_sharding.append("/".join(path))
      if not np.array_equal(np.asarray(x), _expected(saved, path)):
        bad_value.append("/".join(path))
    name = f"{spec or 'one device'}/{frontend}/{layout}"
    out[name] = {
        "leaves": len(got),
        "bad_sharding": bad_sharding,
        "bad_value": bad_value,
        "split": sum(
            x.addressable_shards[0].data.size < x.size for x in got.values()
        ),
    }
  return out


if __name__ == "__main__":
  if sys.argv[1] == "kill":
    kill(sys.argv[2])
  else:
    print(json.dumps(mesh(json.loads(sys.argv[2]))))
