"""Logical axis names, the rule table that maps them to a mesh, and the mesh.

Every parameter carries logical axis names through Flax's partitioning
metadata (`nn.with_logical_partitioning`), and activations at the layer
boundaries carry logical constraints (`constrain`). A rule table maps each
logical name to mesh axes; `DEFAULT_RULES` targets the mesh axes `MESH_AXES`.

Parameter names:
  exp      routed-expert axis of wi_0, wi_1, wo and per_expert_scale
  embed    model width M
  mlp      expert / shared-expert hidden width
  heads    attention heads
  kv       attention head width
  vocab    vocabulary
  router   the router's expert axis (gate/kernel [embed, router]); replicated
           by default, since top-k needs every expert's logit of a token
  norm     RMSNorm scales
  layers   the stacked layer axis of a scanned decoder (`nn.scan` metadata)

Activation names (prefixed so that they map independently of the weights):
  activation_batch         batch, where no expert axis is present
  activation_batch_no_exp  batch, beside an expert axis ([B, S, E, H], ...)
  activation_length, activation_embed, activation_mlp, activation_heads,
  activation_kv, activation_vocab, activation_exp

`model.init` returns `nn.LogicallyPartitioned` boxes; `unbox` is the one
helper that strips them where plain arrays are needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
import contextlib
import math
import re
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor")

Rules = tuple[tuple[str, Any], ...]

DEFAULT_RULES: Rules = (
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_batch_no_exp", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_mlp", "tensor"),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_vocab", "tensor"),
    ("activation_exp", "expert"),
    ("exp", "expert"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("latent", None),
    ("vocab", "tensor"),
    ("router", None),
    ("norm", None),
    ("layers", None),
)

# Logical names of the [batch, seq, emb] activations between layers.
BSM = ("activation_batch", "activation_length", "activation_embed")

_SPEC_ITEM = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*(\d+)\s*$")


def unbox(tree: Any) -> Any:
  """Strips `nn.Partitioned` boxes (the one place plain arrays are made).

  Args:
    tree: a pytree whose leaves may be `nn.Partitioned` /
      `nn.LogicallyPartitioned` boxes (what `model.init` returns).

  Returns:
    The same tree with each box replaced by the value it holds.
  """
  return nn.meta.unbox(tree)


def parse_mesh_spec(spec: str | Mapping[str, int]) -> dict[str, int]:
  """ "data=2,expert=4" -> {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}.

  Axes are `MESH_AXES`; missing ones have size 1.

  Args:
    spec: comma-separated `axis=size` items, or a mapping of axis name to
      size.

  Returns:
    The size of every axis of `MESH_AXES`, by name, in that order.

  Raises:
    ValueError: on a malformed item, an axis not in `MESH_AXES`, an axis
      given twice, or a size that is not an integer >= 1.
  """
  if isinstance(spec, Mapping):
    items = [(str(k), v) for k, v in spec.items()]
  else:
    items = []
    for part in str(spec).split(","):
      if not part.strip():
        continue
      match = _SPEC_ITEM.match(part)
      if not match:
        raise ValueError(
            f"Bad mesh spec item {part.strip()!r} in {spec!r}; expected "
            f"axis=size items such as 'data=2,expert=4' (axes: {MESH_AXES})."
        )
      items.append((match.group(1), int(match.group(2))))
  sizes = dict.fromkeys(MESH_AXES, 1)
  seen = set()
  for name, size in items:
    if name not in MESH_AXES:
      raise ValueError(
          f"Unknown mesh axis {name!r} in {spec!r}; allowed: {MESH_AXES}."
      )
    if name in seen:
      raise ValueError(f"Mesh axis {name!r} appears twice in {spec!r}.")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
      raise ValueError(f"Mesh axis {name}={size!r} must be an integer >= 1.")
    seen.add(name)
    sizes[name] = size
  return sizes


def make_mesh(
    spec: str | Mapping[str, int], devices: Sequence[Any] | None = None
) -> Mesh:
  """A mesh over `MESH_AXES` (Auto axis types) from a spec like "data=8".

  Args:
    spec: a mesh spec, as `parse_mesh_spec` reads it.
    devices: the devices to lay out; default `jax.devices()` (every process's
      devices).

  Returns:
    A `jax.sharding.Mesh` with the four axes of `MESH_AXES`.

  Raises:
    ValueError: if `spec` does not parse (see `parse_mesh_spec`), or the axis
      sizes do not multiply to the number of devices.
  """
  sizes = parse_mesh_spec(spec)
  devices = list(jax.devices() if devices is None else devices)
  if math.prod(sizes.values()) != len(devices):
    processes = {getattr(d, "process_index", 0) for d in devices}
    where = f" over {len(processes)} processes" if len(processes) > 1 else ""
    wanted = math.prod(sizes.values())
    hint = ""
    if all(getattr(d, "platform", "") == "cpu" for d in devices):
      hint = (
          f" On a CPU, simulate {wanted} devices: set XLA_FLAGS="
          f"--xla_force_host_platform_device_count={wanted} before jax "
          "starts (e.g. in the shell that runs the command)."
      )
    raise ValueError(
        f"Mesh {spec!r} has {wanted} devices ({sizes}), but {len(devices)} "
        f"are available{where}; the axis sizes must multiply to the device "
        f"count.{hint}"
    )
  return jax.make_mesh(
      tuple(sizes.values()),
      MESH_AXES,
      axis_types=(AxisType.Auto,) * len(MESH_AXES),
      devices=devices,
  )


@contextlib.contextmanager
def mesh_context(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
  """Makes `mesh` and `rules` current for tracing (constraints, EP).

  Args:
    mesh: the mesh to set (`jax.set_mesh`).
    rules: the logical-axis rule table to set (`nn.logical_axis_rules`).

  Yields:
    None; both are current inside the `with` block.
  """
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """`nn.with_logical_constraint`; a no-op without a mesh and rules.

  Args:
    x: the array to constrain, e.g. [B, S, M].
    names: one logical axis name (or None) per axis of `x`, e.g. `BSM`.

  Returns:
    `x`, with a sharding constraint when a mesh and rules are current.
  """
  return nn.with_logical_constraint(x, tuple(names))


def current_mesh():
  """The mesh set by `mesh_context` / `jax.set_mesh`, or None.

  Returns:
    The current `jax.sharding.AbstractMesh`, or None when no mesh is set.
  """
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def current_rules() -> Rules:
  """The logical-axis rules in effect.

  Returns:
    The rules set by `mesh_context` / `nn.logical_axis_rules`, or
    `DEFAULT_RULES` when none are set.
  """
  return tuple(nn.get_logical_axis_rules()) or DEFAULT_RULES


def mesh_axes(name: str, mesh, rules: Rules | None = None) -> tuple[str, ...]:
  """The mesh axes (present in `mesh`) that logical `name` maps to.

  Args:
    name: a logical axis name, e.g. "exp".
    mesh: a mesh (or abstract mesh); axes it lacks are dropped.
    rules: the rule table; default `current_rules()`. The first rule for
      `name` is used.

  Returns:
    The mesh axis names, in rule order; () when `name` has no rule or maps to
    None.
  """
  rules = current_rules() if rules is None else rules
  for logical, physical in rules:
    if logical == name:
      axes = (physical,) if isinstance(physical, str) else physical or ()
      return tuple(a for a in axes if a in mesh.axis_names)
  return ()


def logical_shardings(abstract_tree: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings of a (boxed, abstract) tree, per the rule table.

  Args:
    abstract_tree: a pytree of `nn.LogicallyPartitioned` boxes (e.g. the
      `jax.eval_shape` of `model.init`); unboxed leaves are replicated.
    mesh: the mesh.
    rules: the logical-axis rule table.

  Returns:
    A tree of the same structure with a `NamedSharding` per leaf.
  """
  specs = nn.get_partition_spec(abstract_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def named(mesh: Mesh, names: Sequence[str | None], rules: Rules) -> Any:
  """The NamedSharding of one array with logical axis `names`.

  Args:
    mesh: the mesh.
    names: one logical axis name (or None) per array axis.
    rules: the logical-axis rule table.

  Returns:
    A `NamedSharding` over `mesh`.
  """
  return NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(names), rules))


def replicated(mesh: Mesh) -> NamedSharding:
  """The fully replicated sharding.

  Args:
    mesh: the mesh.

  Returns:
    `NamedSharding(mesh, PartitionSpec())`.
  """
  return NamedSharding(mesh, P())
