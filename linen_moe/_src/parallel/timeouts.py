"""How long joined processes wait for each other, in seconds: the defaults
of `distributed.initialize`, read by the command line's help before jax
loads (this module imports nothing)."""

# How long a process waits for all N to connect.
DEFAULT_INIT_TIMEOUT_S = 300
# How long a silent process counts as alive.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30
