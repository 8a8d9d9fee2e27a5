"""Where a training run's batches come from, and its held-out loss.

`MarkovSource`: the synthetic Markov tokens (the default), batch i a
function of (seed + 1, i); the data position is the step. `CorpusSource`:
the user's files (`data`) through `linen_moe.data.DataPipeline` (chat
files through `linen_moe.data.ChatPipeline`), each
process reading only its rows of each global batch; the Grain iterator's
state is saved with each checkpoint and restored on resume (on any process
count with the same global batch). Both offer `sample`, `batches`, `meta`,
`check_meta`, `restore` and `iterator` (the Grain iterator to save, or
None). `Evaluator` computes the held-out loss of a train state.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe._src.data import chat as chat_data
from linen_moe._src.data import chat_rows
from linen_moe._src.data import pipeline as data_pipeline
from linen_moe._src.data import shards
from linen_moe._src.data import sources as data_sources
from linen_moe._src.data import tokenization
from linen_moe._src.models.decoder import Decoder
from linen_moe._src.models.tokens import validate_tokens
from linen_moe._src.parallel import sharding
from linen_moe._src.run import tokenizer_files
from linen_moe._src.run.options import RunOptions
from linen_moe._src.training import evaluation
from linen_moe._src.training.markov_data import MarkovData

# One step's batch: tokens <int32>[B, S], the loss mask <bool>[B, S] (None:
# every position is real, the step's unmasked loss), and for rows packed
# first fit the segment ids and positions <int32>[B, S] (else None).
Batch = tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]
BATCH_FIELDS = ("tokens", "mask", "segment_ids", "positions")


def tokenizer_path(opts: RunOptions) -> str | None:
  """`tokenizer`, else the tokenizer.json of the Hugging Face checkpoint
  the run starts from (`init_from_hf` DIR, where the command has it),
  else the one kept by the run it starts from (`init_from` RUN), else
  the one the run kept in its `checkpoint_dir` (a resumed run), else
  None."""
  if opts.tokenizer is not None:
    return opts.tokenizer
  init_from = getattr(opts, "init_from_hf", None)
  if init_from:
    return tokenization.find_tokenizer(init_from)
  if getattr(opts, "init_from", None):
    return tokenizer_files.kept_tokenizer(opts.init_from)
  return tokenizer_files.kept_tokenizer(getattr(opts, "checkpoint_dir", None))


def _other_data(where: str, saved: dict, here: str) -> ValueError:
  there = saved.get("pipeline", {}).get("corpus", {}).get("files") or [
      "synthetic Markov data"
  ]
  return ValueError(
      f"Checkpoint {where} was trained on {there[0]}"
      f"{f' (and {len(there) - 1} more files)' if len(there) > 1 else ''}, "
      f"this run reads {here}; resume with the same data, or start a new "
      "run."
  )


class MarkovSource:
  """The synthetic Markov tokens (`linen_moe.training.MarkovData`)."""

  iterator = None

  def __init__(self, cfg, opts: RunOptions, place: Callable):
    self.data = MarkovData(cfg.vocab_size)
    self.seed, self.opts, self.place = opts.seed + 1, opts, place
    self.vocab_size = cfg.vocab_size
    self.best_loss = self.data.best_loss
    self.meta = {"kind": "markov", "seed": self.seed}

  def batches(self, start: int) -> Iterator[Batch]:
    """Batches `start`, `start + 1`, ...: batch i is a function of
    (seed + 1, i)."""
    for b in self.data.batches(
        self.opts.batch_size, self.opts.seq_len, self.seed, start=start
    ):
      tokens = self.place(validate_tokens(b, self.vocab_size, name="batch"))
      yield tokens, None, None, None

  def sample(self) -> jax.Array:
    return next(self.batches(0))[0]

  def check_meta(self, saved: dict, where: str) -> None:
    if saved.get("kind", "markov") != "markov":
      raise _other_data(where, saved, "synthetic Markov data (no `data`)")

  def restore(self, ckpts, step: int) -> None:
    del ckpts, step  # the position is the step


class CorpusSource:
  """The user's files through a `linen_moe.data.DataPipeline`.

  Attributes:
    pipeline: the pipeline (its corpus read and checked: every error is
      raised here, before any step).
    rows: this process's rows of each global batch (None: one device).
    iterator: the Grain iterator of the training batches.
  """

  best_loss = math.nan  # unknown for real data

  def __init__(self, cfg, opts: RunOptions, run: Any):
    self.opts = opts
    rows = {
        "seq_len": opts.seq_len,
        "batch_size": opts.batch_size,
        "packing": opts.packing,
        "seed": opts.seed + 1,
        "eval_fraction": opts.eval_fraction,
    }
    self.chat = opts.data_format == chat_data.CHAT_FORMAT
    self.segmented = opts.packing == "first_fit"
    if self.chat:  # every row has a mask: the assistant's tokens
      chat = chat_data.read_chat(
          opts.data,
          tokenizer_path(opts),
          vocab_size=cfg.vocab_size,
          eod_id=opts.eod_id,
      )
      self.pipeline = chat_rows.ChatPipeline(chat, **rows)
    else:
      corpus = data_sources.read_corpus(
          opts.data,
          format=opts.data_format,
          tokenizer=tokenizer_path(opts),
          dtype=opts.data_dtype,
          vocab_size=cfg.vocab_size,
          eod_id=opts.eod_id,
      )
      self.pipeline = data_pipeline.DataPipeline(corpus, **rows)
    self.sharding = None if run is None else run.token_sharding()
    self.rows = None
    if self.sharding is not None:
      shape = (opts.batch_size, opts.seq_len)
      self.rows = shards.process_rows(self.sharding, shape)
    self.eval_dataset = None
    if opts.eval_every is not None:  # raises now if too few are held out
      self.eval_dataset = self.pipeline.eval_dataset(
          opts.eval_batches, self.rows
      )
    self.iterator = self.pipeline.train_iterator(self.rows)
    self.meta = {"kind": "corpus", "pipeline": self.pipeline.describe()}

  def place(self, local: dict[str, np.ndarray]) -> Batch:
    """(tokens, mask, segment_ids, positions) global arrays from this
    process's rows; the last two None unless the rows are packed first
    fit."""
    names = ["tokens", "mask"]
    if self.segmented:
      names += ["segment_ids", "positions"]
    local = {k: local[k] for k in names}
    if self.sharding is None:
      batch = {k: jnp.asarray(v) for k, v in local.items()}
    else:
      batch = shards.global_batch(
          local, self.rows, self.sharding, self.opts.batch_size
      )
    return tuple(batch.get(k) for k in BATCH_FIELDS)

  def batches(self, start: int) -> Iterator[Batch]:
    """The training batches from where the iterator is (global batch
    `start`: 0, or where `restore` put it); packed batches of text or ids
    come without a mask (every position is real); rows packed first fit
    with their segment ids and positions."""
    position = self.iterator.get_state().get("next_index")
    if position != start:
      raise ValueError(
          f"the data iterator is at global batch {position}, not at step "
          f"{start} where the run resumes."
      )
    masked = self.opts.packing != "pack" or self.chat
    for local in self.iterator:
      tokens, mask, segment_ids, positions = self.place(local)
      yield tokens, mask if masked else None, segment_ids, positions

  def sample(self) -> jax.Array:
    return self.place(self.pipeline.train_dataset(self.rows)[0])[0]

  def check_meta(self, saved: dict, where: str) -> None:
    if saved.get("kind") != "corpus":
      raise _other_data(where, saved, self.pipeline.corpus.name)
    self.pipeline.check_same(saved["pipeline"], where)

  def restore(self, ckpts, step: int) -> None:
    """Moves the iterator to the state saved with checkpoint `step`."""
    self.iterator = ckpts.restore_data(self.iterator, step)


class Evaluator:
  """The held-out loss (nats per real target) of a train state, over the
  same held-out batches every time."""

  def __init__(self, cfg, fe, run, source: CorpusSource):
    eval_step = evaluation.make_eval_step(Decoder(cfg))

    def fn(state, tokens, mask, segment_ids, positions):
      return eval_step(
          evaluation.variables_of(fe, state),
          tokens,
          mask,
          segment_ids,
          positions,
      )

    self.run = run
    if run is None:
      self._fn = jax.jit(fn)
    else:  # read on every process: replicated
      self._fn = jax.jit(fn, out_shardings=sharding.replicated(run.mesh))
    self.batches = [source.place(b) for b in source.eval_dataset]

  def __call__(self, state) -> float:
    total, count = 0.0, 0.0
    for batch in self.batches:
      if self.run is None:
        s, c = self._fn(state, *batch)
      else:
        with self.run.context():
          s, c = self._fn(state, *batch)
      total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)
