"""Names of a step's metrics that a run reports but that are no fact of
the step itself. Imports nothing."""

# The metrics of a step's time (`run.throughput`): they differ between two
# runs of one step, so a comparison of two runs' rows leaves them out.
TIMING_METRICS = ("tokens_per_s", "model_tflops_per_s", "mfu")
