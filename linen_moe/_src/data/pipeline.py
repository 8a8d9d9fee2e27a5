"""Training and held-out batches of a corpus, through Grain.

The sequences of a corpus (`packing`) are split in order: the last
`eval_fraction` of them are held out, the rest are for training. The
training sequences go through Grain as

    MapDataset.source(train).shuffle(seed).repeat()   # epochs reshuffled
        .batch(rows).slice(q::Q)                      # this process's rows

so global batch k is the sequences [k B, (k + 1) B) of the shuffled stream,
and a process that holds block q of Q equal blocks of its rows (`shards`)
reads only those rows: batch k of its dataset is global batch k's rows
[q B / Q, (q + 1) B / Q). Nothing depends on the process count but which
rows a process reads, so the global batches are the same on one process or
many. The iterator's state (`DatasetIterator.get_state()`,
`{"next_index": k}`) is k, the global batches read, equal on every process;
a checkpoint stores it (`checkpointing`) and a resumed run, on any number
of processes with the same global batch, continues at global batch k.

Held-out batches are the first `num_batches` B sequences of the held-out
set, in order, unshuffled: the same every time they are evaluated.
"""

from __future__ import annotations

import math
from typing import Any

import grain

from linen_moe._src.config.checks import check_int as _check_int
from linen_moe._src.data import packing as packing_lib
from linen_moe._src.data import shards
from linen_moe._src.data.sources import Corpus

# Grain reads ahead in a thread, a few batches at most: a batch is a few
# slices of memory-mapped ids, and the step, not the reading, is the work.
DEFAULT_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)


class DataPipeline:
  """Shuffled training batches of a corpus, per process, and its held-out
  batches, through Grain.

  Example usage:
    corpus = data.read_corpus("notes/*.txt", tokenizer="tokenizer.json")
    pipeline = data.DataPipeline(corpus, seq_len=128, batch_size=8)
    batches = pipeline.train_iterator()
    batch = next(batches)  # tokens, mask, segment_ids, positions: [8, 128]

  Attributes:
    corpus: the corpus.
    seq_len: S, tokens per sequence.
    batch_size: B, sequences per global batch.
    packing: one of `packing.PACKINGS`.
    seed: the shuffle's seed.
    eval_fraction: the share of the sequences held out (the last ones).
    train: the training `packing.Sequences`.
    eval: the held-out `packing.Sequences` (may be empty).
    read_options: Grain's threads and read-ahead.

  Args:
    corpus: see `sources.read_corpus`.
    seq_len: S >= 2.
    batch_size: B >= 1, the global batch.
    packing: "pack", "pad" or "first_fit" (see `packing`).
    seed: the shuffle's seed, in [0, 2**32).
    eval_fraction: in [0, 1): the share held out, rounded up to whole
      sequences (0: none).
    pad_id: the id of padded positions (default: the corpus's
      end-of-document id, else 0); masked, so it only has to be a valid id.
    read_options: Grain's threads and read-ahead (`DEFAULT_READ_OPTIONS`).

  Raises:
    ValueError: a bad argument, a corpus shorter than `seq_len`, or too few
      sequences to hold any out and train on the rest.
  """

  def __init__(
      self,
      corpus: Corpus,
      *,
      seq_len: int,
      batch_size: int,
      packing: str = "pack",
      seed: int = 0,
      eval_fraction: float = 0.1,
      pad_id: int | None = None,
      read_options: grain.ReadOptions | None = None,
  ):
    """Cuts `corpus` into sequences and splits off the held-out ones."""
    _check_int("batch_size", batch_size, 1)
    _check_int("seed", seed, 0)
    if seed >= 2**32:
      raise ValueError(f"seed={seed} is invalid: it must be < 2**32.")
    if not (
        isinstance(eval_fraction, (int, float))
        and not isinstance(eval_fraction, bool)
        and 0 <= eval_fraction < 1
    ):
      raise ValueError(
          f"eval_fraction={eval_fraction!r} is invalid: a number in [0, 1)."
      )
    if pad_id is None:
      pad_id = corpus.eod_id if corpus.eod_id is not None else 0
    self.corpus, self.seq_len, self.batch_size = corpus, seq_len, batch_size
    self.packing, self.seed, self.eval_fraction = packing, seed, eval_fraction
    self.read_options = read_options or DEFAULT_READ_OPTIONS
    every = packing_lib.sequences(corpus, seq_len, packing, pad_id)
    held_out = math.ceil(eval_fraction * len(every))
    if len(every) - held_out < 1:
      raise ValueError(
          f"data {corpus.name}: its {len(every)} sequences of {seq_len} "
          "tokens leave none to train on after holding out "
          f"eval_fraction={eval_fraction} of them (add data, or lower the "
          "sequence length or the fraction)."
      )
    self.train, self.eval = every.split(len(every) - held_out)

  def train_dataset(self, rows: slice | None = None) -> grain.MapDataset:
    """The training batches, without end (each epoch reshuffled).

    Args:
      rows: this process's rows of each global batch (`shards.process_rows`;
        one of Q equal blocks); None: all of them.

    Returns:
      A `grain.MapDataset` whose element k is `rows` of global batch k,
      `{"tokens": <int32>[rows, S], "mask": <bool>[rows, S],
      "segment_ids": <int32>[rows, S], "positions": <int32>[rows, S]}`
      (`packing.Sequences`).

    Raises:
      ValueError: if `rows` is not an equal block of the batch.
    """
    q, count = shards.block_of(rows, self.batch_size)
    ds = grain.MapDataset.source(self.train).shuffle(seed=self.seed).repeat()
    return ds.batch(self.batch_size // count)[q::count]

  def train_iterator(self, rows: slice | None = None) -> grain.DatasetIterator:
    """An iterator over the training batches, from global batch 0.

    Args:
      rows: as for `train_dataset`.

    Returns:
      A Grain `DatasetIterator` over `train_dataset(rows)`; its
      `get_state()` ({"next_index": k}, the global batches read) and
      `set_state()`, or a checkpoint (`checkpointing`), move it to any
      global batch.
    """
    return iter(self.train_dataset(rows).to_iter_dataset(self.read_options))

  def eval_dataset(
      self, num_batches: int, rows: slice | None = None
  ) -> grain.MapDataset:
    """The first held-out global batches, in order, unshuffled.

    Args:
      num_batches: how many (of B sequences each).
      rows: as for `train_dataset`.

    Returns:
      A `grain.MapDataset` of `num_batches` elements, this process's `rows`
      of each held-out batch (the same every time).

    Raises:
      ValueError: the held-out set has fewer than `num_batches` B
        sequences.
    """
    _check_int("num_batches", num_batches, 1)
    need = num_batches * self.batch_size
    if need > len(self.eval):
      raise ValueError(
          f"data {self.corpus.name}: {num_batches} held-out batches of "
          f"{self.batch_size} need {need} held-out sequences, and "
          f"eval_fraction={self.eval_fraction} holds out {len(self.eval)} of "
          f"{len(self.train) + len(self.eval)} (evaluate fewer batches, or "
          "hold out more)."
      )
    q, count = shards.block_of(rows, self.batch_size)
    ds = grain.MapDataset.source(self.eval)[:need]
    return ds.batch(self.batch_size // count)[q::count]

  def describe(self) -> dict[str, Any]:
    """What determines the batches.

    Returns:
      A JSON-serialisable dict of the corpus (`Corpus.describe`), seq_len,
      batch_size, packing, seed, eval_fraction and the sequence counts (a
      run resumes only on the same, `check_same`); for "first_fit" also
      `fill_fraction`, the share of the training rows' positions that hold
      ids.
    """
    extra = {}
    if self.packing == "first_fit":
      extra["fill_fraction"] = round(self.train.fill_fraction, 6)
    return {
        **extra,
        "corpus": self.corpus.describe(),
        "seq_len": self.seq_len,
        "batch_size": self.batch_size,
        "packing": self.packing,
        "seed": self.seed,
        "eval_fraction": self.eval_fraction,
        "train_sequences": len(self.train),
        "eval_sequences": len(self.eval),
    }

  def check_same(self, saved: dict[str, Any], where: str) -> None:
    """Checks that a saved description gives the same batches as this one.

    Args:
      saved: a `describe()` of the run that wrote `where`.
      where: the checkpoint, for the message.

    Raises:
      ValueError: naming each difference (the files' paths may differ: a
        moved corpus is the same corpus).
    """
    now = self.describe()
    diffs = []
    for key in sorted(set(now) | set(saved)):
      a, b = saved.get(key), now.get(key)
      if key == "corpus" and isinstance(a, dict):
        a = {k: v for k, v in a.items() if k not in ("files", "tokenizer")}
        b = {k: v for k, v in b.items() if k not in ("files", "tokenizer")}
      if a != b:
        diffs.append(f"{key}={a!r} there, {b!r} here")
    if diffs:
      raise ValueError(
          f"Checkpoint {where} read other data: {'; '.join(diffs)}. Resume "
          "with the same data, sequence length, batch size, packing, seed "
          "and held-out fraction, or start a new run."
      )
