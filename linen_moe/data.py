"""Real data for training: your text or token ids, through Grain.

Files become a `Corpus` (`read_corpus`: text tokenized with a Hugging Face
`tokenizer.json`, or pre-tokenized `.npy` / flat uint16 / uint32 ids), cut
into packed or padded sequences with a loss mask (or whole documents packed
first fit into rows, with segment ids and positions), shuffled with a seed and
split into training and held-out batches (`DataPipeline`); each process
reads only its rows of each global batch (`process_rows`, `global_batch`),
and the Grain iterator's state goes into a checkpoint
(`linen_moe.checkpoint.Checkpoints` saves it beside the model), so a
resumed run, on any process count with the same global batch, gets the
batches it would have had.

Chat data (`read_chat`, `ChatPipeline`): JSONL conversations rendered with
the tokenizer's chat template as transformers renders it, the loss on what
the assistant wrote.
"""

from linen_moe._src.faces import lazy_face as _lazy_face

_EXPORTS = {
    "linen_moe._src.data.chat": ("CHAT_FORMAT", "ChatCorpus", "read_chat"),
    "linen_moe._src.data.chat_rows": ("ChatPipeline",),
    "linen_moe._src.data.chat_spans": ("assistant_spans",),
    "linen_moe._src.data.chat_template": ("ChatTemplate", "load_chat_template"),
    "linen_moe._src.data.packing": ("PACKINGS",),
    "linen_moe._src.data.pipeline": ("DataPipeline",),
    "linen_moe._src.data.shards": ("global_batch", "process_rows"),
    "linen_moe._src.data.sources": (
        "BIN_DTYPES",
        "FORMATS",
        "Corpus",
        "read_corpus",
    ),
    "linen_moe._src.data.tokenization": (
        "load_tokenizer",
        "train_bpe_tokenizer",
    ),
}

_lazy_face(globals(), _EXPORTS)
