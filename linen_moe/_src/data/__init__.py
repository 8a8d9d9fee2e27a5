"""The data pipeline: files to tokens (`sources`, `tokenization`), tokens to
sequences (`packing`), sequences to per-process batches through Grain
(`pipeline`, `shards`), and the iterator state in a checkpoint
(`checkpointing`); conversations through a chat template (`chat_template`,
`chat_spans`, `chat`) to rows with a loss mask (`chat_rows`). `sources`,
`tokenization`, `chat_template`, `chat_spans` and `chat` import no jax (the
command line checks its files with them before jax loads); the rest does,
through Grain."""
