"""Planning a run before renting the hardware: compile (never run) the
train or decode step for a target and read its memory and FLOPs. Imports
no jax."""
