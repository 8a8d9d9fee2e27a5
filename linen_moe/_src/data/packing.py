"""A corpus cut into sequences of `seq_len` tokens: packed or padded.

- "pack": the stream is cut into consecutive windows of `seq_len` ids,
  across document boundaries (each document ends with its end-of-document
  id, so the model sees where one ends): pre-training on a continuous
  stream. Every position is real, the mask is all ones, one segment per
  row, and the ids after the last whole window are not used.
- "pad": each document is cut into windows of at most `seq_len` ids, and
  a shorter last window is filled with `pad_id` and masked; a window of
  fewer than 2 real ids (no next-token target) is left out.
- "first_fit": the windows of "pad" (each document cut into pieces of at
  most `seq_len` ids), packed whole into rows, first fit decreasing: the
  pieces, longest first, each go into the first row with room for it (a
  new row when none has). Each piece is a segment of its row (segment ids
  1, 2, ...; padding 0), its positions restart at 0, and the decoders keep
  the segments apart (`linen_moe.Decoder`'s `segment_ids`). The rows are
  ordered by where their first piece lies in the corpus.
  `Sequences.fill_fraction` is the share of positions holding ids (the
  license-text corpus at seq_len 1024: >= 95 %).

Grain's own packers (`grain.experimental.FirstFitPackIterDataset`) pack a
stream: an `IterDataset` whose rows depend on the order read, of unknown
count, without random access. The pipeline here needs random access (a
shuffle and a per-process slice of each global batch, a held-out split,
resuming at any global batch on any number of processes), so first fit is
planned once, from the documents' lengths alone (no id is read), and the
rows are a Grain data source like the others.

`Sequences` gives random access to them (a Grain data source): item `i` is
`{"tokens": <int32>[seq_len], "mask": <bool>[seq_len], "segment_ids":
<int32>[seq_len], "positions": <int32>[seq_len]}`: the mask True where the
id is real, the segment ids 1, 2, ... for the row's pieces and 0 on
padding, the positions restarting at 0 in each segment
(`linen_moe.models.segment_positions` of the segment ids). A loss counts
the target at position t+1 only where the mask is True at t and t+1
(`linen_moe.training.loss_weights`), and, given the segment ids, where t
and t+1 are in one segment.
"""

from __future__ import annotations

import numpy as np

from linen_moe._src.data.sources import Corpus

PACKINGS = ("pack", "pad", "first_fit")


class Sequences:
  """Sequences of one corpus: row `i` is its pieces `row_splits[i] ..
  row_splits[i + 1] - 1` side by side, piece `p` the `lengths[p]` ids from
  `starts[p]` in the stream, then `pad_id` (masked) up to `seq_len`. Each
  piece is a segment of its row. The arguments are kept as attributes of
  the same names (`starts`, `lengths` <int64>[P], `row_splits`
  <int64>[N + 1]).

  Args:
    corpus: the corpus read.
    seq_len: S.
    starts: <int>[P] where each piece starts in the stream.
    lengths: <int>[P] its ids; a row's pieces hold at most S together.
    pad_id: the id of padded positions.
    row_splits: <int>[N + 1] the first piece of each row, and P; None: one
      piece per row (`arange(P + 1)`).
  """

  def __init__(
      self,
      corpus: Corpus,
      seq_len: int,
      starts: np.ndarray,
      lengths: np.ndarray,
      pad_id: int = 0,
      row_splits: np.ndarray | None = None,
  ):
    self.corpus, self.seq_len, self.pad_id = corpus, seq_len, pad_id
    self.starts = np.asarray(starts, np.int64)
    self.lengths = np.asarray(lengths, np.int64)
    if row_splits is None:
      row_splits = np.arange(len(self.starts) + 1)
    self.row_splits = np.asarray(row_splits, np.int64)

  def __len__(self) -> int:
    return len(self.row_splits) - 1

  def pieces(self, index: int) -> list[tuple[int, int]]:
    """Row `index`'s pieces, in order.

    Args:
      index: the row, in [0, N).

    Returns:
      `(start in the stream, length)` of each piece.
    """
    first, end = self.row_splits[index], self.row_splits[index + 1]
    return [
        (int(self.starts[p]), int(self.lengths[p])) for p in range(first, end)
    ]

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    s = self.seq_len
    tokens = np.full((s,), self.pad_id, np.int32)
    segment_ids = np.zeros((s,), np.int32)
    positions = np.zeros((s,), np.int32)
    at = 0
    for k, (start, length) in enumerate(self.pieces(index)):
      tokens[at : at + length] = self.corpus.read(start, start + length)
      segment_ids[at : at + length] = k + 1
      positions[at : at + length] = np.arange(length)
      at += length
    positions[at:] = np.arange(s - at)  # padding: a segment of its own
    return {
        "tokens": tokens,
        "mask": segment_ids > 0,
        "segment_ids": segment_ids,
        "positions": positions,
    }

  @property
  def fill_fraction(self) -> float:
    """The share of the rows' positions that hold ids (not padding)."""
    return float(self.lengths.sum()) / max(len(self) * self.seq_len, 1)

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
    cut = int(self.row_splits[at])

    def make(rows, pieces, offset):
      return Sequences(
          self.corpus,
          self.seq_len,
          self.starts[pieces],
          self.lengths[pieces],
          self.pad_id,
          self.row_splits[rows] - offset,
      )

    return (
        make(slice(0, at + 1), slice(0, cut), 0),
        make(slice(at, None), slice(cut, None), cut),
    )


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


def _windows(corpus: Corpus, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(starts, lengths) of each document's windows of at most `seq_len`
  ids, in order, those of fewer than 2 ids (no target) left out."""
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
  return starts[keep], lengths[keep]


def first_fit_rows(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
  """First fit decreasing: pieces into rows of `seq_len` positions.

  Args:
    lengths: <int>[P] the pieces' lengths, each in [1, seq_len].
    seq_len: S, a row's room.

  Returns:
    The rows in the order they were opened, each the indices of its pieces
    in the order placed: the pieces, longest first (ties in order), each go
    into the first row with room for it, a new row when none has.
  """
  lengths = np.asarray(lengths, np.int64)
  order = np.argsort(-lengths, kind="stable")
  rows: list[list[int]] = []
  # A max tree over the rows' room: leaf r is row r's (S for rows not yet
  # opened), so the leftmost leaf with room >= n is the first fit, in
  # O(log P) a piece.
  size = 1
  while size < max(len(lengths), 1):
    size *= 2
  room = [seq_len] * (2 * size)
  for p in order:
    n = int(lengths[p])
    node = 1
    while node < size:  # descend to the leftmost leaf with room >= n
      node = 2 * node if room[2 * node] >= n else 2 * node + 1
    r = node - size
    if r == len(rows):
      rows.append([])
    rows[r].append(int(p))
    room[node] -= n
    node //= 2
    while node:
      room[node] = max(room[2 * node], room[2 * node + 1])
      node //= 2
  return rows


def first_fit(corpus: Corpus, seq_len: int, pad_id: int = 0) -> Sequences:
  """The windows of `pad` packed whole into rows, first fit decreasing.

  Args:
    corpus: the corpus.
    seq_len: S >= 2.
    pad_id: the id that fills a row's unused positions (masked, segment 0).

  Returns:
    `Sequences` whose rows hold one or more pieces (segments), ordered by
    where their first piece lies in the corpus; `fill_fraction` says how
    full.

  Raises:
    ValueError: if the corpus has fewer than `seq_len` ids, or no document
      has 2.
  """
  starts, lengths = _windows(corpus, seq_len)
  rows = first_fit_rows(lengths, seq_len)
  rows.sort(key=lambda pieces: int(starts[pieces[0]]))
  pieces = np.asarray([p for row in rows for p in row], np.int64)
  splits = np.concatenate([[0], np.cumsum([len(row) for row in rows])])
  return Sequences(
      corpus, seq_len, starts[pieces], lengths[pieces], pad_id, splits
  )


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
  starts, lengths = _windows(corpus, seq_len)
  return Sequences(corpus, seq_len, starts, lengths, pad_id)


def sequences(
    corpus: Corpus, seq_len: int, packing: str = "pack", pad_id: int = 0
) -> Sequences:
  """`pack(corpus, seq_len)`, `pad(corpus, seq_len, pad_id)` or
  `first_fit(corpus, seq_len, pad_id)`.

  Args:
    corpus: the corpus.
    seq_len: S >= 2.
    packing: "pack", "pad" or "first_fit".
    pad_id: for "pad" and "first_fit", the id of padded positions.

  Returns:
    The `Sequences`.

  Raises:
    ValueError: for another `packing` (and see `pack`, `pad`).
  """
  if packing == "pack":
    return pack(corpus, seq_len)
  if packing == "pad":
    return pad(corpus, seq_len, pad_id)
  if packing == "first_fit":
    return first_fit(corpus, seq_len, pad_id)
  raise ValueError(f"packing={packing!r} is invalid: one of {PACKINGS}.")
