"""The data pipeline: files to tokens (`sources`, `tokenization`), tokens to
sequences (`packing`), sequences to per-process batches through Grain
(`pipeline`, `shards`), and the iterator state in a checkpoint
(`checkpointing`). `sources` and `tokenization` import no jax (the command
line checks its files with them before jax loads); the rest does, through
Grain."""
