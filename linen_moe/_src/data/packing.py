"""A corpus cut into sequences of `seq_len` tokens: packed or padded.

- "pack": the stream is cut into consecutive windows of `seq_len` ids,
  across document boundaries (each document ends with its end-of-document
  id, so the model sees where one ends); every position is real, the mask
  is all ones, and the ids after the last whole window are not used.
- "pad": each document is cut into windows of at most `seq_len` ids, and
  a shorter last window is filled with `pad_id` and masked; a window of
  fewer than 2 real ids (no next-token target) is left out.

`Sequences` gives random access to them (a Grain data source): item `i` is
`{"tokens": <int32>[seq_len], "mask": <bool>[seq_len]}`, True where the id
is real. A loss counts the target at position t+1 only where the mask is
True at t and t+1 (`linen_moe.training.loss_weights`).
"""

from __future__ import annotations

import numpy as np

from linen_moe._src.data.sources import Corpus

PACKINGS = ("pack", "pad")


class Sequences:
  """Sequences of one corpus: item `i` is `seq_len` ids from `starts[i]`, of
  which `lengths[i]` are real (the rest `pad_id`, masked). The arguments
  are kept as attributes of the same names (`starts` and `lengths` as
  <int64>[N]).

  Args:
    corpus: the corpus read.
    seq_len: S.
    starts: <int>[N] where each sequence starts in the stream.
    lengths: <int>[N] its real ids (<= S).
    pad_id: the id of padded positions.
  """

  def __init__(
      self,
      corpus: Corpus,
      seq_len: int,
      starts: np.ndarray,
      lengths: np.ndarray,
      pad_id: int = 0,
  ):
    self.corpus, self.seq_len, self.pad_id = corpus, seq_len, pad_id
    self.starts = np.asarray(starts, np.int64)
    self.lengths = np.asarray(lengths, np.int64)

  def __len__(self) -> int:
    return len(self.starts)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    start, length = int(self.starts[index]), int(self.lengths[index])
    tokens = np.full((self.seq_len,), self.pad_id, np.int32)
    tokens[:length] = self.corpus.read(start, start + length)
    mask = np.zeros((self.seq_len,), np.bool_)
    mask[:length] = True
    return {"tokens": tokens, "mask": mask}

  def __repr__(self) -> str:
    return (
        f"Sequences({len(self)} x {self.seq_len} of {self.corpus.name}, "
        f"{int(self.lengths.sum())} real ids)"
    )

  def split(self, at: int) -> tuple[Sequences, Sequences]:
    """The sequences cut in two, in order.

    Args:
      at: where, in [0, N].

    Returns:
      A pair (sequences [0, at), sequences [at, N)).
    """
    make = lambda sl: Sequences(  # noqa: E731
        self.corpus,
        self.seq_len,
        self.starts[sl],
        self.lengths[sl],
        self.pad_id,
    )
    return make(slice(0, at)), make(slice(at, None))


def _check_seq_len(corpus: Corpus, seq_len: int) -> None:
  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
    raise ValueError(f"seq_len={seq_len!r} is invalid: an integer >= 2.")
  if corpus.num_tokens < seq_len:
    raise ValueError(
        f"data {corpus.name}: the corpus has {corpus.num_tokens} tokens, "
        f"fewer than seq_len={seq_len}: not one sequence can be made (lower "
        "the sequence length, or add data)."
    )


def pack(corpus: Corpus, seq_len: int) -> Sequences:
  """The stream cut into consecutive windows of `seq_len` ids.

  Args:
    corpus: the corpus.
    seq_len: S >= 2.

  Returns:
    `Sequences` of S real ids each (the ids after the last whole window
    are left out).

  Raises:
    ValueError: if the corpus has fewer than `seq_len` ids.
  """
  _check_seq_len(corpus, seq_len)
  n = corpus.num_tokens // seq_len
  starts = np.arange(n, dtype=np.int64) * seq_len
  return Sequences(corpus, seq_len, starts, np.full((n,), seq_len, np.int64))


def pad(corpus: Corpus, seq_len: int, pad_id: int = 0) -> Sequences:
  """Each document cut into windows of at most `seq_len` ids.

  Args:
    corpus: the corpus.
    seq_len: S >= 2.
    pad_id: the id that fills a document's last, shorter window (masked).

  Returns:
    `Sequences`, a document's windows in order; windows of fewer than 2 real
    ids (no next-token target) are left out.

  Raises:
    ValueError: if the corpus has fewer than `seq_len` ids, or no document
      has 2.
  """
  _check_seq_len(corpus, seq_len)
  begin, end = corpus.documents[:, 0], corpus.documents[:, 1]
  counts = -(-(end - begin) // seq_len)  # windows per document
  doc = np.repeat(np.arange(len(begin)), counts)
  first = np.repeat(np.cumsum(counts) - counts, counts)
  starts = begin[doc] + (np.arange(len(doc)) - first) * seq_len
  lengths = np.minimum(end[doc] - starts, seq_len)
  keep = lengths >= 2
  if not keep.any():
    raise ValueError(
        f"data {corpus.name}: every document is shorter than 2 tokens: no "
        "sequence has a next-token target."
    )
  return Sequences(corpus, seq_len, starts[keep], lengths[keep], pad_id)


def sequences(
    corpus: Corpus, seq_len: int, packing: str = "pack", pad_id: int = 0
) -> Sequences:
  """`pack(corpus, seq_len)` or `pad(corpus, seq_len, pad_id)`.

  Args:
    corpus: the corpus.
    seq_len: S >= 2.
    packing: "pack" or "pad".
    pad_id: for "pad", the id of padded positions.

  Returns:
    The `Sequences`.

  Raises:
    ValueError: for another `packing` (and see `pack`, `pad`).
  """
  if packing == "pack":
    return pack(corpus, seq_len)
  if packing == "pad":
    return pad(corpus, seq_len, pad_id)
  raise ValueError(f"packing={packing!r} is invalid: one of {PACKINGS}.")
