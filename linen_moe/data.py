"""Real data for training: your text or token ids, through Grain.

Files become a `Corpus` (`read_corpus`: text tokenized with a Hugging Face
`tokenizer.json`, or pre-tokenized `.npy` / flat uint16 / uint32 ids), cut
into packed or padded sequences with a loss mask (or whole documents packed
first fit into rows, with segment ids and positions: `first_fit`), shuffled with a seed and
split into training and held-out batches (`DataPipeline`); each process
reads only its rows of each global batch (`process_rows`, `global_batch`),
and the Grain iterator's state goes into a checkpoint (`IteratorSave`,
`IteratorRestore`; `linen_moe.checkpoint.Checkpoints` does it), so a
resumed run, on any process count with the same global batch, gets the
batches it would have had.

Chat data (`read_chat`, `ChatPipeline`): JSONL conversations rendered with
the tokenizer's chat template as transformers renders it, the loss on what
the assistant wrote.
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.data.chat": (
        "CHAT_FORMAT",
        "ChatCorpus",
        "ROLES",
        "encode_conversation",
        "loss_mask_of",
        "read_chat",
        "read_conversations",
    ),
    "linen_moe._src.data.chat_rows": (
        "CHAT_PACKINGS",
        "ChatPipeline",
        "ChatSequences",
        "chat_step_mask",
    ),
    "linen_moe._src.data.chat_template": (
        "ChatTemplate",
        "assistant_spans",
        "load_chat_template",
    ),
    "linen_moe._src.data.checkpointing": (
        "IteratorCheckpointHandler",
        "IteratorRestore",
        "IteratorSave",
    ),
    "linen_moe._src.data.packing": (
        "PACKINGS",
        "Sequences",
        "first_fit",
        "first_fit_rows",
        "pack",
        "pad",
    ),
    "linen_moe._src.data.pipeline": ("DataPipeline",),
    "linen_moe._src.data.shards": ("global_batch", "process_rows"),
    "linen_moe._src.data.sources": (
        "BIN_DTYPES",
        "FORMATS",
        "Corpus",
        "find_files",
        "read_corpus",
    ),
    "linen_moe._src.data.tokenization": (
        "end_of_document_id",
        "find_tokenizer",
        "load_tokenizer",
        "train_bpe_tokenizer",
    ),
}


# Names load on first use: the command line checks its data flags before
# jax loads.
_lazy_face(globals(), _EXPORTS)
