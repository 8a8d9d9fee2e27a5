"""Planning a run before renting the hardware: compile (never run) a
config's train or decode step for a target (`cpu:N` simulated devices, a
Cloud TPU slice through libtpu, NVIDIA GPUs such as `gpu:h200-1` through
jax's CUDA plugin) and read its per-device memory, its FLOPs and a
roofline step time.

`plan` returns a `Plan` (what `linen-moe plan` prints); `CHIPS` is the
table of accelerators it knows; `model_flops` counts a step's model FLOPs
from the config. Its names load on first use: importing it imports no jax
(`parse_target` and `prepare_process` must run before jax starts).

Example usage:

  planning.prepare_process(planning.parse_target("cpu:8"))  # before jax
  p = planning.plan(load_model_config("tiny_mixtral"), "cpu:8",
                    mesh="fsdp=8", batch_size=16, seq_len=32)
  print(p.per_device.peak_bytes, p.fits, p.flops_per_step)
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.planning.chips": ("CHIPS",),
    "linen_moe._src.planning.flops": ("model_flops",),
    "linen_moe._src.planning.plan": ("Plan", "plan"),
    "linen_moe._src.planning.targets": (
        "check_mesh",
        "parse_target",
        "prepare_process",
        "target_devices",
    ),
}

_lazy_face(globals(), _EXPORTS)
