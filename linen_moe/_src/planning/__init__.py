"""Planning a run before renting the hardware: compile (never run) the
train or decode step for a target and read its memory and FLOPs.

The names each module gives the public face `linen_moe.planning`. Imports
no jax.
"""

CHIP_NAMES = ("CHIPS", "Chip", "chip_of")
TARGET_NAMES = (
    "Target",
    "check_mesh",
    "parse_target",
    "prepare_process",
    "target_devices",
)
FLOP_NAMES = ("attention_flops", "matmul_parameters", "model_flops")
PLAN_NAMES = ("Plan", "PerDevice", "plan")
