"""Sharding checks on 8 simulated CPU devices, run in a subprocess.

`python -m tests.sharding_worker '<json list of jobs>'` runs each job and
prints one JSON line with their results; `tests/layer/test_sharding.py` asserts on
them. The device count must be set before jax is imported, which is why this
runs in its own process. Each job compiles its single-device reference once
and then one sharded init and step per mesh.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
)

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from flax import nnx  # noqa: E402
from flax import traverse_util  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from linen_moe import MATMUL_PATHS  # noqa: E402
from linen_moe import load_model_config  # noqa: E402
from linen_moe import models  # noqa: E402
from linen_moe import sharding  # noqa: E402
from linen_moe._src.hlo import reading
from linen_moe._src.testing import helpers
from linen_moe.training import MarkovData  # noqa: E402
from linen_moe.training import default_optimizer  # noqa: E402
import nnx_adapter  # noqa: E402
from nnx_adapter import frontend as get_frontend  # noqa: E402

EXPERT_WEIGHTS = ("wi_0", "wi_1", "wo")
_max_abs_diff = helpers.max_abs_diff


def _max_abs(tree) -> float:
  return max(
      (float(np.max(np.abs(x))) for x in jax.tree.leaves(tree)), default=0.0
  )


def _expert_weights(params) -> dict[str, jax.Array]:
  """The routed experts' weights of the first MoE layer, by name."""
  layer = params["layers"] if "layers" in params else params["layers_0"]
  moe = layer["moe"].get("routed_experts", layer["moe"])
  return {name: moe[name] for name in EXPERT_WEIGHTS}


def equivalence(job: dict) -> dict:
  """One step of `job`'s cell on one device and on each mesh, compared.

  The state is initialised sharded on the first mesh; the single-device
  reference and the other meshes start from copies of it (with
  `check_init`, an independent single-device init must equal it too). With
  `grad_accum`, the meshes split the batch into that many microbatches; the
  reference always takes it whole. With `packed`, the batch carries
  segment ids (two or three documents a row, some padding) and their
  restarting positions, on one device and on every mesh alike.
  """
  cfg = load_model_config(
      job.get("config", "tiny_mixtral"),
      quantization=job.get("quantization", "none"),
      num_layers=job.get("num_layers", 1),
      expert_parallel=job.get("expert_parallel", "auto"),
      remat=job.get("remat", "none"),
      **MATMUL_PATHS[job.get("path", "sparse")],
  )
  frontend = job.get("frontend", "linen")
  fe = get_frontend(frontend)
  optimizer = optax.sgd(0.1)
  batch = job.get("batch", 8)
  tokens = jnp.asarray(next(MarkovData(cfg.vocab_size).batches(batch, 8, 1)))
  rng, step_rng = jax.random.key(0), jax.random.key(1)
  extras = ()  # (mask, segment_ids, positions) after the step's rng
  if job.get("packed"):
    rows = ([1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 2, 2, 3, 3, 3, 3])
    segment_ids = jnp.asarray([rows[i % 2] for i in range(batch)], jnp.int32)
    extras = (None, segment_ids, models.segment_positions(segment_ids))
  runs = {
      spec: (
          nnx_adapter.frontend(frontend).sharded(
              cfg, optimizer, sharding.make_mesh(spec), job.get("grad_accum", 1)
          )
      )
      for spec in job["meshes"]
  }
  first = runs[job["meshes"][0]].init(tokens, rng)
  host = jax.device_get(first)
  out = {"meshes": {}}
  if job.get("check_init"):
    init = jax.jit(lambda t, r: fe.init(cfg, optimizer, t, r))
    out["init_err"] = _max_abs_diff(first, init(tokens, rng))
  state0 = jax.device_put(host, jax.devices()[0])
  ref, ref_metrics = jax.jit(fe.make_step(cfg, optimizer))(
      state0, tokens, step_rng, *extras
  )
  out.update(
      loss=float(ref_metrics["loss"]),
      update=_max_abs_diff(ref.params, host.params),
      fp8_moved=_max_abs_diff(ref.fp8_state, host.fp8_state),
      rule_moved=_max_abs_diff(fe.rule_state(ref), fe.rule_state(host)),
  )
  for spec, run in runs.items():
    start = time.perf_counter()
    state = first if spec == job["meshes"][0] else None
    if state is None:
      state = run.place(host, tokens, rng)
    weights = _expert_weights(state.params)
    result = {
        "specs": {name: str(w.sharding.spec) for name, w in weights.items()},
        "local_fraction": {
            name: w.addressable_shards[0].data.nbytes / w.nbytes
            for name, w in weights.items()
        },
    }
    compiled = run.lower(state, tokens, step_rng, *extras).compile()
    if job.get("hlo"):
      text = compiled.as_text()
      full = {s for w in weights.values() for s in (w.shape, w.shape[1:])}
      result["collectives"] = reading.collective_counts(text)
      result["full_weight_gathers"] = [
          s for s in reading.all_gather_shapes(text) if s in full
      ]
    new, metrics = compiled(state, tokens, step_rng, *extras)
    result.update(
        loss=float(metrics["loss"]),
        param_err=_max_abs_diff(new.params, ref.params),
        fp8_err=_max_abs_diff(new.fp8_state, ref.fp8_state),
        rule_err=_max_abs_diff(fe.rule_state(new), fe.rule_state(ref)),
        seconds=time.perf_counter() - start,
    )
    out["meshes"][spec] = result
  return out


def shardings(job: dict) -> dict:
  """The state's shardings on a mesh, from an abstract init (no compile)."""
  cfg = load_model_config(
      job.get("config", "tiny_gemma4_26b"),
      quantization=job.get("quantization", "fp8"),
  )
  tokens = jax.ShapeDtypeStruct((8, 8), jnp.int32)
  run = nnx_adapter.frontend(job.get("frontend", "linen")).sharded(
      cfg, default_optimizer(), sharding.make_mesh(job["mesh"])
  )
  specs = run.state_shardings(tokens, jax.random.key(0))
  flat = jax.tree_util.tree_leaves_with_path(specs)
  return {jax.tree_util.keystr(path): str(s.spec) for path, s in flat}


# Rule tables of `layer` beside the default one, by name. "batch_on_data":
# tokens replicated over `expert` (outputs summed there, nothing exchanged);
# "two_exchange_axes": experts over fsdp and expert, which both split the
# batch; "exchange_and_sum" / "sum_then_exchange": experts over data and
# expert, the batch over only one of them (exchanged over it, summed over
# the other).
def _rules(**overrides):
  return tuple(
      (name, overrides.get(name, axes)) for name, axes in sharding.DEFAULT_RULES
  )


RULES = {
    "default": sharding.DEFAULT_RULES,
    "batch_on_data": _rules(activation_batch=("data",)),
    "two_exchange_axes": _rules(exp=("fsdp", "expert")),
    "exchange_and_sum": _rules(
        exp=("data", "expert"), activation_batch=("expert",)
    ),
    "sum_then_exchange": _rules(
        exp=("data", "expert"), activation_batch=("data",)
    ),
}


def layer(job: dict) -> dict:
  """Loss and gradients (params, fp8 state, input) of one `RoutedMoE` layer
  on one device and under each (mesh, rules name of `RULES`), for each of
  `quantizations` (default: `quantization`, "fp8") with `expert_parallel`
  (default "auto"), on each of `inputs` ("random", "skewed"; default
  "random"). Errors are absolute; `*_scale` the reference's max."""
  from linen_moe import RoutedMoE  # noqa: PLC0415
  from linen_moe import load_moe_config  # noqa: PLC0415
  from linen_moe.variables import OVERWRITE_WITH_GRADIENT  # noqa: PLC0415

  out = {}
  modes = job.get("quantizations", [job.get("quantization", "fp8")])
  for mode in modes:
    cfg = load_moe_config(
        job.get("config", "tiny_mixtral"),
        quantization=mode,
        expert_parallel=job.get("expert_parallel", "auto"),
        **MATMUL_PATHS[job.get("path", "sparse")],
    )
    moe = RoutedMoE(cfg)
    x = jax.random.normal(jax.random.key(3), (8, 8, cfg.emb_dim))
    # "skewed": every token near the same point, so all route to the same k
    # experts: most experts (and devices) get nothing, one gets every row.
    inputs = {
        "random": x,
        "skewed": x[:1, :1] + 1e-3 * x,
    }
    variables = sharding.unbox(moe.init(jax.random.key(0), x))

    def loss(params, fp8, x, moe=moe):
      variables = {"params": params, OVERWRITE_WITH_GRADIENT: fp8}
      y, aux = moe.apply(variables, x, rngs={"params": jax.random.key(4)})
      return jnp.sum(y**2), aux.expert_fraction

    fp8 = variables.get(OVERWRITE_WITH_GRADIENT, {})
    step = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
    refs = {
        name: step(variables["params"], fp8, inputs[name])
        for name in job.get("inputs", ["random"])
    }
    for spec, rules_name in job["meshes"]:
      with sharding.mesh_context(sharding.make_mesh(spec), RULES[rules_name]):
        mesh_step = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
        got = {
            name: mesh_step(variables["params"], fp8, inputs[name])
            for name in refs
        }
      for name, ((value, fraction), grads) in got.items():
        (ref_loss, ref_fraction), ref_grads = refs[name]
        key = f"{spec}/{rules_name}"
        key = key if len(modes) == 1 else f"{mode}/{key}"
        key = key if name == "random" else f"{key}/{name}"
        out[key] = {
            "loss_err": abs(float(value) - float(ref_loss)),
            "loss_scale": abs(float(ref_loss)),
            "fraction_err": _max_abs_diff(fraction, ref_fraction),
            "param_grad_err": _max_abs_diff(grads[0], ref_grads[0]),
            "param_grad_scale": _max_abs(ref_grads[0]),
            "fp8_err": _max_abs_diff(grads[1], ref_grads[1]),
            "fp8_scale": _max_abs(ref_grads[1]),
            "input_grad_err": _max_abs_diff(grads[2], ref_grads[2]),
            "input_grad_scale": _max_abs(ref_grads[2]),
        }
  return out


def serving(job: dict) -> dict:
  """Serving forward of a converted `RoutedMoE` (sparse path) on one device
  and under each mesh: the expert-parallel path reads the stored kernels."""
  from linen_moe import RoutedMoE  # noqa: PLC0415
  from linen_moe import load_moe_config  # noqa: PLC0415
  from linen_moe import quantization  # noqa: PLC0415

  out = {}
  for mode in job["modes"]:
    cfg = load_moe_config(job.get("config", "tiny_mixtral"), quantization=mode)
    x = jax.random.normal(jax.random.key(3), (8, 8, cfg.emb_dim))
    float_layer = RoutedMoE(cfg.replace(quantization="none"))
    variables = sharding.unbox(float_layer.init(jax.random.key(0), x))
    serve_cfg, served = quantization.quantize_weights(cfg, variables)
    apply = jax.jit(RoutedMoE(serve_cfg).apply)
    ref = apply(served, x)[0]
    for spec in job["meshes"]:
      with sharding.mesh_context(sharding.make_mesh(spec)):
        y = jax.jit(RoutedMoE(serve_cfg).apply)(served, x)[0]
      out[f"{mode}/{spec}"] = {
          "err": _max_abs_diff(y, ref),
          "scale": float(jnp.max(jnp.abs(ref))),
      }
  return out


def skip(job: dict) -> dict:
  """Three sharded fp8 steps with two microbatches, the second step's last
  microbatch poisoned (an out-of-range id: NaN loss); see
  `tests/training/test_skip_steps.py` for the single-device twin."""
  cfg = load_model_config(
      "tiny_mixtral",
      quantization="fp8",
      num_layers=1,
      **MATMUL_PATHS[job.get("path", "sparse")],
  )
  frontend = job.get("frontend", "linen")
  fe = get_frontend(frontend)
  run = nnx_adapter.frontend(frontend).sharded(
      cfg, default_optimizer(1e-2), sharding.make_mesh(job["mesh"]), 2
  )
  # 16 rows: each microbatch of 8 splits over the 8 devices' batch axes.
  good = jnp.asarray(next(MarkovData(cfg.vocab_size).batches(16, 8, 1)))
  bad = good.at[15, 5].set(cfg.vocab_size)
  state = run.init(good, jax.random.key(0))
  hosts, metrics = [jax.device_get(state)], []
  for i, tokens in enumerate((good, bad, good)):
    state, m = run.step(state, tokens, jax.random.key(i + 1))  # donated
    hosts.append(jax.device_get(state))
    # Scalars only: `expert_load` is [L, E].
    metrics.append({k: float(v) for k, v in m.items() if jnp.ndim(v) == 0})

  def leaves(s):
    """Params, fp8 state and optimizer state: what a skip leaves as is."""
    if frontend == "linen":
      return jax.tree.leaves((s.params, s.fp8_state, s.opt_state))
    model, optimizer = s.merge()
    return jax.tree.leaves((nnx.state(model), optimizer.opt_state))

  before, after = leaves(hosts[1]), leaves(hosts[2])
  return {
      "metrics": metrics,
      "steps": [int(h.step) for h in hosts],
      "skipped_steps": int(hosts[-1].skipped_steps),
      "fp8_leaves": len(jax.tree.leaves(fe.fp8_state(hosts[2]))),
      "skip_diff": _max_abs_diff(after, before),
      "finite": all(bool(np.isfinite(x).all()) for x in after),
      "moved_after": _max_abs_diff(leaves(hosts[3]), after),
  }


def lora(job: dict) -> dict:
  """A `RoutedMoE` with adapters on its experts (sparse path), every
  adapter leaf random (B too): its output and the gradients of A and B of
  `sum(y * cotangent)` on one device and under each (mesh, rules name of
  `RULES`), with the frozen kernels and the adapters placed as their
  logical axes say; and each placed leaf's spec. Errors are absolute;
  `*_scale` the reference's max (per leaf for the gradients)."""
  from linen_moe import RoutedMoE  # noqa: PLC0415
  from linen_moe import load_moe_config  # noqa: PLC0415
  from linen_moe import lora as lora_lib  # noqa: PLC0415
  from linen_moe import quantization  # noqa: PLC0415

  cfg = load_moe_config(
      job.get("config", "tiny_mixtral"),
      load_balance_loss_weight=0.0,
      expert_parallel=job.get("expert_parallel", "auto"),
      **MATMUL_PATHS[job.get("path", "sparse")],
  )
  x = jax.random.normal(jax.random.key(3), (8, 8, cfg.emb_dim))
  base = None
  mode = job.get("quantization", "none")
  if mode != "none":  # QLoRA: a frozen serving base of that mode
    float_vars = RoutedMoE(cfg).init(jax.random.key(0), x)
    cfg, base = quantization.quantize_weights(
        cfg.replace(quantization=mode), sharding.unbox(float_vars)
    )
  cfg = cfg.replace(lora_rank=4, lora_alpha=8)
  moe = RoutedMoE(cfg)
  boxed = moe.init(jax.random.key(0), x)
  if base is not None:  # the served kernels, boxed as the init's
    flat = traverse_util.flatten_dict(boxed["params"])
    for path, value in traverse_util.flatten_dict(base["params"]).items():
      box = flat[path]
      flat[path] = box.replace_boxed(value) if hasattr(box, "names") else value
    boxed = {"params": traverse_util.unflatten_dict(flat)}
  params = sharding.unbox(boxed)["params"]
  adapters, frozen = lora_lib.split(params)
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(5), len(leaves))
  adapters = jax.tree.unflatten(
      tree,
      [
          0.3 * jax.random.normal(k, a.shape, a.dtype)
          for k, a in zip(keys, leaves, strict=True)
      ],
  )
  cotangent = jax.random.normal(jax.random.key(4), x.shape)

  def loss(adapters, frozen, x):
    y, _ = moe.apply({"params": lora_lib.join(adapters, frozen)}, x)
    return jnp.sum(y * cotangent), y

  step = jax.value_and_grad(loss, has_aux=True)
  (_, ref_y), ref_grads = jax.jit(step)(adapters, frozen, x)
  ref_grads = {
      "/".join(p): g for p, g in traverse_util.flatten_dict(ref_grads).items()
  }
  out = {
      "logical": {
          "/".join(p): list(s)
          for p, s in traverse_util.flatten_dict(
              nn.get_partition_spec(boxed)["params"]
          ).items()
      },
      "grad_scale": {p: _max_abs(g) for p, g in ref_grads.items()},
      "y_scale": _max_abs(ref_y),
      "meshes": {},
  }
  for spec, rules_name in job["meshes"]:
    mesh, rules = sharding.make_mesh(spec), RULES[rules_name]
    placed = jax.device_put(
        sharding.unbox(boxed)["params"],
        sharding.logical_shardings(boxed, mesh, rules)["params"],
    )
    placed_adapters, placed_frozen = lora_lib.split(placed)
    placed_adapters = jax.tree.map(
        lambda a, p: jax.device_put(a, p.sharding), adapters, placed_adapters
    )
    with sharding.mesh_context(mesh, rules):
      (_, y), grads = jax.jit(step)(placed_adapters, placed_frozen, x)
    grads = {
        "/".join(p): g for p, g in traverse_util.flatten_dict(grads).items()
    }
    out["meshes"][f"{spec}/{rules_name}"] = {
        "specs": {
            "/".join(p): str(a.sharding.spec)
            for p, a in traverse_util.flatten_dict(placed).items()
        },
        "y_err": _max_abs_diff(y, ref_y),
        "grad_err": {
            p: _max_abs_diff(g, ref_grads[p]) for p, g in grads.items()
        },
    }
  return out


CHECKS = {
    "skip": skip,
    "equivalence": equivalence,
    "shardings": shardings,
    "layer": layer,
    "serving": serving,
    "lora": lora,
}


def main(argv: list[str]) -> None:
  jobs = json.loads(argv[1])
  results = [CHECKS[job["check"]](job) for job in jobs]
  print(json.dumps(results))


if __name__ == "__main__":
  main(sys.argv)
