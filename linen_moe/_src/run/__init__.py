"""A training run of the reference decoder, start to end: its options, the
loop, its checkpoints and metrics, its data, its throughput and its
directory (`linen_moe.training.run`, what `linen-moe train` calls)."""
