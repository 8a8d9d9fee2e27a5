"""Plan targets: a simulated CPU mesh (`cpu:N`), a Cloud TPU slice
(`tpu:v5p-64`, compiled through libtpu's topology description without a
TPU) or NVIDIA GPUs (`gpu:h100-8`, compiled through the CUDA plugin's
topology description and XLA's description of the GPU, without a GPU),
parsed without jax.

`parse_target` checks a target name (a `ValueError` naming the ones there
are); `prepare_process` sets what the compiler reads when it starts
(`--xla_force_host_platform_device_count` for `cpu:N`, libtpu's variables
for a TPU slice) and must run before jax starts its backends;
`target_devices` returns the devices a mesh is laid out over.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import sys

from linen_moe._src.planning.chips import CHIPS
from linen_moe._src.planning.chips import Chip

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# XLA:GPU sorts with CUB's radix sort where it knows the GPU (an H100), and
# asks CUB for its scratch size through the CUDA runtime, which fails
# without a GPU ("cudaErrorInvalidDevice: invalid device ordinal"); its own
# sort needs no device (and is what it compiles for an H200 anyway).
CUB_SORT_FLAG = "--xla_gpu_enable_cub_radix_sort"

# Chips -> topology (chips laid out x by y [by z]) of the slice sizes offered.
_TWO_D = {
    1: "1x1",
    4: "2x2",
    8: "2x4",
    16: "4x4",
    32: "4x8",
    64: "8x8",
    128: "8x16",
    256: "16x16",
}
_THREE_D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
    2048: "8x16x16",
    4096: "16x16x16",
    6144: "16x16x24",
}
# Slice family -> (chip, topology prefix of libtpu, the slice's number counts
# TensorCores per chip, chips -> topology, the family's name in Cloud TPU's
# accelerator types). A v5p-N slice has N TensorCores, two per chip (one JAX
# device); v5e-N and v6e-N have N chips.
_SLICES = {
    "v5e": ("v5e", "v5e", 1, _TWO_D, "v5litepod"),
    "v5litepod": ("v5e", "v5e", 1, _TWO_D, "v5litepod"),
    "v6e": ("v6e", "v6e", 1, _TWO_D, "v6e"),
    "v5p": ("v5p", "v5p", 2, _THREE_D, "v5p"),
}
# What libtpu reads for the slice it is on (a TPU VM's metadata gives it);
# without it, and without a TPU, it prints "WARNING: could not determine TPU
# accelerator type" on every start.
ACCELERATOR_TYPE_VAR = "TPU_ACCELERATOR_TYPE"
_TPU = re.compile(r"^tpu:([a-z0-9]+)-(\d+)$")
_CPU = re.compile(r"^cpu:(\d+)$")
_GPU = re.compile(r"^gpu:([a-z0-9]+)-(\d+)$")

# GPU -> XLA's target description of it (gpu_specs/: XLA's own
# GpuTargetConfigProto files, xla/backends/gpu/target_config/specs/; the
# CUDA plugins of jax[cuda12] 0.12.0.1 and jax[cuda13] 0.11.2 both compile
# with them); a host holds up to _GPUS_PER_HOST of them.
_GPU_SPECS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
_GPUS_PER_HOST = 8
_SPEC_DIR = os.path.join(os.path.dirname(__file__), "gpu_specs")


@dataclasses.dataclass(frozen=True)
class Target:
  """What a plan compiles for.

  Attributes:
    name: as given, e.g. "cpu:8", "tpu:v5p-64" or "gpu:h100-8".
    platform: "cpu", "tpu" or "gpu".
    num_devices: the JAX devices of the target (TPU: chips; GPU: GPUs).
    chip: the accelerator's figures (`CHIPS`), None for the CPU.
    topology: libtpu's topology name, e.g. "v5p:2x4x4" (TPU), or the CUDA
      plugin's, partitions x hosts x GPUs a host, e.g. "1x1x8" (GPU); None
      for the CPU.
    accelerator_type: a TPU slice's Cloud TPU accelerator type, e.g.
      "v5p-64" or "v5litepod-16" (what libtpu reads from
      `TPU_ACCELERATOR_TYPE`); None for the others.
  """

  name: str
  platform: str
  num_devices: int
  chip: Chip | None = None
  topology: str | None = None
  accelerator_type: str | None = None

  @property
  def device_memory_bytes(self) -> int:
    """What one program may hold on one device: the chip's
    `usable_bytes` (else its `memory_bytes`); for `cpu:N`, the host's
    memory over N (the simulated devices share it)."""
    if self.chip is not None:
      return self.chip.usable_bytes or self.chip.memory_bytes
    return _host_memory_bytes() // self.num_devices


def _host_memory_bytes() -> int:
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _slice_names() -> str:
  names = []
  for family, (_, _, per_chip, shapes, _) in _SLICES.items():
    if family == "v5litepod":
      continue
    sizes = [n * per_chip for n in shapes]
    names.append(f"tpu:{family}-{{{','.join(map(str, sizes))}}}")
  return ", ".join(names)


def _gpu_topology(count: int) -> str | None:
  """The CUDA plugin's topology of `count` GPUs: one host of 1, 2, 4 or 8,
  or hosts of 8; None for another count."""
  if count in (1, 2, 4, _GPUS_PER_HOST):
    return f"1x1x{count}"
  if count > _GPUS_PER_HOST and count % _GPUS_PER_HOST == 0:
    return f"1x{count // _GPUS_PER_HOST}x{_GPUS_PER_HOST}"
  return None


def parse_target(name: str) -> Target:
  """The target called `name`; no jax.

  Args:
    name: "cpu:N" (N >= 1 simulated CPU devices), "tpu:<slice>" with a
      Cloud TPU slice name: v5e-N, v6e-N (N chips) or v5p-N (N TensorCores,
      N / 2 chips), e.g. "tpu:v5p-64", or "gpu:<gpu>-N" with N NVIDIA
      H100 or H200 (SXM) GPUs: 1, 2, 4 or 8 in one host, or a multiple of
      8 in hosts of 8, e.g. "gpu:h100-8".

  Returns:
    The `Target`.

  Raises:
    ValueError: `name` is none of those, naming the ones there are.
  """
  if not isinstance(name, str):
    raise ValueError(f"target={name!r} is invalid: expected a string.")
  spec = name.strip().lower()
  match = _CPU.match(spec)
  if match and int(match.group(1)) >= 1:
    return Target(name, "cpu", int(match.group(1)))
  match = _TPU.match(spec)
  if match and match.group(1) in _SLICES:
    chip, prefix, per_chip, shapes, kind = _SLICES[match.group(1)]
    size = int(match.group(2))
    chips = size // per_chip
    if size % per_chip == 0 and chips in shapes:
      return Target(
          name,
          "tpu",
          chips,
          CHIPS[chip],
          f"{prefix}:{shapes[chips]}",
          f"{kind}-{size}",
      )
  match = _GPU.match(spec)
  if match and match.group(1) in _GPU_SPECS:
    count = int(match.group(2))
    topology = _gpu_topology(count)
    if topology is not None:
      return Target(name, "gpu", count, CHIPS[match.group(1)], topology)
  gpus = ", ".join(f"gpu:{g}-N" for g in _GPU_SPECS)
  raise ValueError(
      f"target={name!r} is invalid: expected cpu:N (N >= 1 simulated CPU "
      f"devices), a TPU slice, one of {_slice_names()}, or NVIDIA GPUs, "
      f"{gpus} (N in 1, 2, 4, 8 or a multiple of 8: hosts of 8)."
  )


def check_mesh(mesh, target: Target) -> dict[str, int]:
  """The axis sizes of `mesh` on `target`; starts no jax backend.

  Args:
    mesh: a mesh spec ("fsdp=8,expert=2", a mapping, or None for
      "data=<devices>"; `linen_moe.sharding.parse_mesh_spec`).
    target: from `parse_target`.

  Returns:
    The size of each axis of `linen_moe.sharding.MESH_AXES`.

  Raises:
    ValueError: a malformed spec, or sizes that do not multiply to the
      target's device count.
  """
  from linen_moe._src.parallel import sharding  # noqa: PLC0415 (imports jax)

  sizes = sharding.parse_mesh_spec(
      mesh if mesh is not None else f"data={target.num_devices}"
  )
  if math.prod(sizes.values()) != target.num_devices:
    shown = ",".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "1"
    raise ValueError(
        f"mesh={shown!r} has {math.prod(sizes.values())} devices, but "
        f"target {target.name!r} has {target.num_devices}: the axis sizes "
        "must multiply to the target's device count."
    )
  return sizes


def install_hint(extra: str) -> str:
  """How to install the package's `extra` ("tpu-plan", "gpu-plan"): from a
  checkout or a wheel (the package is on no index), in a venv of its own.

  Args:
    extra: the optional dependency group of pyproject.toml.

  Returns:
    The words of an error message, e.g. "from a checkout: pip install
    '.[gpu-plan]' ...".
  """
  return (
      f"from a checkout: pip install '.[{extra}]', or VENV=DIR "
      f"scripts/setup_venv.sh {extra} (from a wheel: pip install "
      f"'WHEEL[{extra}]'), in a virtual environment of its own"
  )


def libtpu_available() -> bool:
  """Whether libtpu is installed (the `tpu-plan` extra: `install_hint`)."""
  return importlib.util.find_spec("libtpu") is not None


def cuda_plugin_available() -> bool:
  """Whether jax's CUDA plugin is installed (the `gpu-plan` extra:
  `install_hint`)."""
  if importlib.util.find_spec("jax_plugins") is None:
    return False
  return any(
      importlib.util.find_spec(f"jax_plugins.{name}") is not None
      for name in ("xla_cuda12", "xla_cuda13")
  )


def _backends_started() -> bool:
  if "jax" not in sys.modules:
    return False
  from jax._src import xla_bridge  # noqa: PLC0415

  return xla_bridge.backends_are_initialized()


def prepare_process(target: Target) -> None:
  """Sets up this process to compile for `target`, before jax's backends
  start (a no-op once they have).

  `cpu:N`: XLA's host platform gets N devices
  (`--xla_force_host_platform_device_count`, replacing any count in
  `XLA_FLAGS`) and its backend optimisation level 0 unless one is set (a
  plan never runs the program: LLVM's optimisation only slows the
  compile; the buffers and their sizes are decided before it), and jax
  on the CPU alone (`JAX_PLATFORMS=cpu` unless set). A TPU
  slice: libtpu is told not to look for a TPU of its own
  (`TPU_SKIP_MDS_QUERY`, `ALLOW_MULTIPLE_LIBTPU_LOAD`,
  `TPU_WORKER_HOSTNAMES`) and is given the slice's accelerator type
  (`TPU_ACCELERATOR_TYPE`, which a TPU VM's metadata holds: without it
  libtpu warns on every start that it could not determine one), and jax
  runs on the CPU (`JAX_PLATFORMS=cpu` unless set): the compile for the
  slice goes through its topology. Each is set unless set already.
  NVIDIA GPUs: jax runs on the CPU (`JAX_PLATFORMS=cpu` unless set), so
  that the CUDA plugin looks for no GPU of its own, and XLA sorts without
  CUB (`--xla_gpu_enable_cub_radix_sort=false` unless set: CUB asks the
  GPU for its scratch size); the compile for them goes through the
  plugin's topology. Where jax is already imported (it reads
  `JAX_PLATFORMS` then), its `jax_platforms` option is set too, unless
  set.

  Args:
    target: from `parse_target`.
  """
  if _backends_started():
    return
  if target.platform == "cpu":
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith(DEVICE_COUNT_FLAG)
    ]
    flags.append(f"{DEVICE_COUNT_FLAG}={target.num_devices}")
    if not any("xla_backend_optimization_level" in f for f in flags):
      flags.append("--xla_backend_optimization_level=0")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  elif target.platform == "gpu":
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.startswith(CUB_SORT_FLAG) for f in flags):
      os.environ["XLA_FLAGS"] = " ".join([*flags, f"{CUB_SORT_FLAG}=false"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  else:
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "true")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault(ACCELERATOR_TYPE_VAR, target.accelerator_type)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "jax" in sys.modules:  # it read JAX_PLATFORMS when it was imported
    import jax  # noqa: PLC0415

    if not jax.config.jax_platforms:
      jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


def target_devices(target: Target) -> list:
  """The devices of `target`, to lay a mesh out over.

  Args:
    target: from `parse_target`.

  Returns:
    The target's devices (this process's first N CPU devices, or the
    devices of a TPU slice's topology description from libtpu, or of
    the GPUs' from the CUDA plugin, compile-only: nothing runs on them,
    and arrays placed there cannot exist).

  Raises:
    ValueError: this process has fewer than N CPU devices (its backend
      started before `prepare_process`), or libtpu (a TPU slice) or the
      CUDA plugin (GPUs) is not installed.
  """
  import jax  # noqa: PLC0415

  if target.platform == "cpu":
    devices = jax.devices("cpu")
    if len(devices) < target.num_devices:
      raise ValueError(
          f"target={target.name!r} needs {target.num_devices} CPU devices, "
          f"but this process has {len(devices)}: start it with XLA_FLAGS="
          f"{DEVICE_COUNT_FLAG}={target.num_devices} (or call "
          "linen_moe.planning.prepare_process before jax starts; linen-moe "
          "plan does)."
      )
    return devices[: target.num_devices]
  if target.platform == "gpu":
    return _gpu_devices(target)
  if not libtpu_available():
    raise ValueError(
        f"target={target.name!r} needs libtpu to compile for a TPU without "
        f"one (jax[tpu]): {install_hint('tpu-plan')}."
    )
  from jax.experimental import topologies  # noqa: PLC0415

  # A slice smaller than a host (v5e-1): libtpu on a real TPU host takes
  # that host's chip bounds (2x2x1) and refuses a 1x1 topology without these.
  dims = [int(d) for d in target.topology.split(":")[1].split("x")]
  kwargs = {}
  if target.num_devices < 4:
    kwargs["chips_per_host_bounds"] = tuple(dims + [1] * (3 - len(dims)))
  topology = topologies.get_topology_desc(target.topology, "tpu", **kwargs)
  devices = list(topology.devices)
  if len(devices) != target.num_devices:  # a libtpu that lays it out anew
    raise ValueError(
        f"libtpu's topology {target.topology!r} has {len(devices)} devices, "
        f"not the {target.num_devices} chips of {target.name!r}."
    )
  return devices


def _gpu_devices(target: Target) -> list:
  """The compile-only devices of `target`'s GPUs: the CUDA plugin's
  topology description (no GPU, no driver) for XLA's description of the
  GPU (`gpu_specs/`). Nothing can be measured without the GPU, so the
  compile tunes nothing (no autotuning) and reports no cost analysis."""
  if not cuda_plugin_available():
    raise ValueError(
        f"target={target.name!r} needs jax's CUDA plugin to compile for "
        f"NVIDIA GPUs without one (jax[cuda13]): {install_hint('gpu-plan')}."
    )
  from jax.experimental import topologies  # noqa: PLC0415

  path = os.path.join(_SPEC_DIR, _GPU_SPECS[target.chip.name])
  with open(path, encoding="utf-8") as f:
    target_config = f.read()
  topology = topologies.get_topology_desc(
      platform="cuda", topology=target.topology, target_config=target_config
  )
  devices = list(topology.devices)
  if len(devices) != target.num_devices:
    raise ValueError(
        f"the CUDA plugin's topology {target.topology!r} has {len(devices)} "
        f"devices, not the {target.num_devices} GPUs of {target.name!r}."
    )
  return devices
