"""Real data for training: your text or token ids, through Grain.

Files become a `Corpus` (`read_corpus`: text tokenized with a Hugging Face
`tokenizer.json`, or pre-tokenized `.npy` / flat uint16 / uint32 ids), cut
into packed or padded sequences with a loss mask, shuffled with a seed and
split into training and held-out batches (`DataPipeline`); each process
reads only its rows of each global batch (`process_rows`, `global_batch`),
and the Grain iterator's state goes into a checkpoint (`IteratorSave`,
`IteratorRestore`; `linen_moe.checkpoint.Checkpoints` does it), so a
resumed run, on any process count with the same global batch, gets the
batches it would have had.
"""

from linen_moe._src.data.checkpointing import IteratorCheckpointHandler
from linen_moe._src.data.checkpointing import IteratorRestore
from linen_moe._src.data.checkpointing import IteratorSave
from linen_moe._src.data.packing import PACKINGS
from linen_moe._src.data.packing import Sequences
from linen_moe._src.data.packing import pack
from linen_moe._src.data.packing import pad
from linen_moe._src.data.pipeline import DataPipeline
from linen_moe._src.data.shards import global_batch
from linen_moe._src.data.shards import process_rows
from linen_moe._src.data.sources import BIN_DTYPES
from linen_moe._src.data.sources import FORMATS
from linen_moe._src.data.sources import Corpus
from linen_moe._src.data.sources import find_files
from linen_moe._src.data.sources import read_corpus
from linen_moe._src.data.tokenization import end_of_document_id
from linen_moe._src.data.tokenization import find_tokenizer
from linen_moe._src.data.tokenization import load_tokenizer
from linen_moe._src.data.tokenization import train_bpe_tokenizer

__all__ = [
    "BIN_DTYPES",
    "FORMATS",
    "PACKINGS",
    "Corpus",
    "DataPipeline",
    "IteratorCheckpointHandler",
    "IteratorRestore",
    "IteratorSave",
    "Sequences",
    "end_of_document_id",
    "find_files",
    "find_tokenizer",
    "global_batch",
    "load_tokenizer",
    "pack",
    "pad",
    "process_rows",
    "read_corpus",
    "train_bpe_tokenizer",
]
