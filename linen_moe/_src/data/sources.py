"""Files to a corpus of token ids: text (tokenized) or pre-tokenized ids.

A `Corpus` is one stream of token ids, the concatenation of its files in
sorted path order, with the document boundaries in it. Text files are one
document each, tokenized with a Hugging Face tokenizer (`tokenization`),
each followed by the end-of-document token. Pre-tokenized files (`.npy`, or
a flat binary of uint16 / uint32 ids) are read as they are, memory-mapped,
never copied whole: their ids already carry whatever separators their
tokenization put in; their documents are the files, or, with an
end-of-document id, the runs that end with it.

Every problem with the input is a one-line `ValueError` naming the file and
the problem, raised while reading, before any training step. Imports no jax.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import functools
import glob
import hashlib
import os
from typing import Any

import numpy as np

FORMATS = ("text", "npy", "bin")
BIN_DTYPES = ("uint16", "uint32")
# Ids are checked in chunks of this many, so a large memory-mapped file is
# never read into memory whole.
_CHUNK = 1 << 24


def find_files(paths: str | Sequence[str]) -> list[str]:
  """The files that `paths` names, sorted and without repeats.

  Args:
    paths: a file, a directory (every file under it), a glob (`**` matches
      directories recursively), or a sequence of them.

  Returns:
    The matching file paths, sorted.

  Raises:
    ValueError: a path names nothing, or no file.
  """
  patterns = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  if not patterns:
    raise ValueError("data: no path given.")
  found = set()
  for pattern in map(os.fspath, patterns):
    if os.path.isdir(pattern):
      matches = glob.glob(os.path.join(pattern, "**", "*"), recursive=True)
    elif glob.has_magic(pattern):
      matches = glob.glob(pattern, recursive=True)
    elif os.path.exists(pattern):
      matches = [pattern]
    else:
      raise ValueError(f"data {pattern}: no such file or directory.")
    files = [m for m in matches if os.path.isfile(m)]
    if not files:
      raise ValueError(f"data {pattern}: no file matches.")
    found.update(files)
  return sorted(found)


def infer_format(files: Sequence[str]) -> str:
  """ "npy" or "bin" when every file has that extension, else "text"."""
  for fmt in ("npy", "bin"):
    if all(f.endswith(f".{fmt}") for f in files):
      return fmt
  return "text"


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
  """A stream of token ids made of files, and its documents.

  Attributes:
    files: the files read, in stream order.
    parts: <int>[n_i] each file's ids (text: one array for all files).
    documents: <int64>[D, 2] each document's [start, end) in the stream.
    format: one of `FORMATS`.
    eod_id: the end-of-document id (None: pre-tokenized without one).
    tokenizer: the tokenizer file of a text corpus (None otherwise).
  """

  files: tuple[str, ...]
  parts: tuple[np.ndarray, ...]
  documents: np.ndarray
  format: str
  eod_id: int | None = None
  tokenizer: str | None = None

  @property
  def num_tokens(self) -> int:
    return int(sum(len(p) for p in self.parts))

  @property
  def name(self) -> str:
    """The files, for messages: one path, or the first and a count."""
    if len(self.files) == 1:
      return self.files[0]
    return f"{self.files[0]} (and {len(self.files) - 1} more files)"

  @functools.cached_property
  def _offsets(self) -> np.ndarray:
    """<int64>[P + 1] where each part starts in the stream, and the end."""
    return np.cumsum([0] + [len(p) for p in self.parts])

  def read(self, start: int, stop: int) -> np.ndarray:
    """The ids of a range of the stream, across file boundaries.

    Args:
      start: the first position, in [0, num_tokens].
      stop: the end, in [start, num_tokens].

    Returns:
      <int32>[stop - start] the ids at [start, stop).
    """
    offsets = self._offsets
    first = int(np.searchsorted(offsets, start, side="right")) - 1
    out, at = [], start
    for i in range(first, len(self.parts)):
      if at >= stop:
        break
      lo = at - offsets[i]
      hi = min(stop, offsets[i + 1]) - offsets[i]
      out.append(np.asarray(self.parts[i][lo:hi]))
      at = offsets[i] + hi
    if not out:
      return np.zeros((0,), np.int32)
    return np.concatenate(out).astype(np.int32, copy=False)

  def digest(self) -> str:
    """A hash of the document bounds and the first ids of some documents.

    Returns:
      16 hex digits that change when the corpus does (a resume checks
      them), computed without reading the whole corpus.
    """
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(self.documents, np.int64).tobytes())
    for start, end in self.documents[:: max(1, len(self.documents) // 64)]:
      h.update(self.read(int(start), int(min(end, start + 16))).tobytes())
    return h.hexdigest()[:16]

  def describe(self) -> dict[str, Any]:
    """What identifies the corpus.

    Returns:
      A JSON-serialisable dict of "files", "format", "num_tokens",
      "num_documents", "eod_id", "tokenizer" and "digest".
    """
    return {
        "files": list(self.files),
        "format": self.format,
        "num_tokens": self.num_tokens,
        "num_documents": len(self.documents),
        "eod_id": self.eod_id,
        "tokenizer": self.tokenizer,
        "digest": self.digest(),
    }


def _check_ids(path: str, ids: np.ndarray, vocab_size: int | None) -> None:
  """Raises unless every id of `ids` is in [0, vocab_size)."""
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(
        f"data {path}: holds {ids.dtype} values; token ids must be integers."
    )
  if vocab_size is None:
    return
  for lo in range(0, len(ids), _CHUNK):
    chunk = np.asarray(ids[lo : lo + _CHUNK])
    bad = (chunk < 0) | (chunk >= vocab_size)
    if bad.any():
      at = int(np.argmax(bad))
      count = int(bad.sum())
      raise ValueError(
          f"data {path}: id {int(chunk[at])} at position {lo + at} is outside"
          f" [0, vocab_size={vocab_size}) of the model ({count} such ids in "
          f"positions {lo}-{lo + len(chunk) - 1}); it was tokenized for "
          "another vocabulary."
      )


def _read_ids(path: str, fmt: str, dtype: str | None) -> np.ndarray:
  """The ids of one pre-tokenized file, memory-mapped."""
  if fmt == "npy":
    try:
      ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
      raise ValueError(
          f"data {path}: cannot be read as .npy ({type(e).__name__}: {e})."
      ) from None
    if ids.ndim != 1:
      raise ValueError(
          f"data {path}: holds an array of shape {ids.shape}; a .npy of "
          "token ids must be 1-D (one stream of ids)."
      )
    return ids
  if dtype not in BIN_DTYPES:
    raise ValueError(
        f"data {path}: a flat binary file carries no dtype: give it "
        f"(dtype / --data-dtype) as one of {BIN_DTYPES}, not {dtype!r}."
    )
  size, itemsize = os.path.getsize(path), np.dtype(dtype).itemsize
  if size % itemsize:
    raise ValueError(
        f"data {path}: its {size} bytes are not a whole number of {dtype} "
        f"ids ({itemsize} bytes each); is the dtype right?"
    )
  if size == 0:
    return np.zeros((0,), dtype)
  return np.memmap(path, dtype=dtype, mode="r")


def _documents_of(parts, eod_id: int | None) -> np.ndarray:
  """[D, 2] document ranges: each part, split after each `eod_id`."""
  docs, offset = [], 0
  for ids in parts:
    n = len(ids)
    cuts = []
    if eod_id is not None:
      for lo in range(0, n, _CHUNK):
        chunk = np.asarray(ids[lo : lo + _CHUNK])
        cuts.extend((np.flatnonzero(chunk == eod_id) + lo + 1).tolist())
    bounds = [0, *[c for c in cuts if c < n], n]
    docs.extend(
        (offset + a, offset + b)
        for a, b in zip(bounds, bounds[1:], strict=False)
        if b > a
    )
    offset += n
  return np.asarray(docs, np.int64).reshape(-1, 2)


def read_token_files(
    files: Sequence[str],
    fmt: str,
    *,
    dtype: str | None = None,
    vocab_size: int | None = None,
    eod_id: int | None = None,
) -> Corpus:
  """A corpus of pre-tokenized ids (`fmt` "npy" or "bin").

  Args:
    files: the files, in stream order.
    fmt: "npy" (a 1-D integer array) or "bin" (flat ids of `dtype`).
    dtype: for "bin": one of `BIN_DTYPES`.
    vocab_size: every id must be in [0, vocab_size) (None: not checked).
    eod_id: documents end after each such id (None: a file is a document).

  Raises:
    ValueError: a file cannot be read, holds an id outside the vocabulary,
      or the corpus is empty.
  """
  if fmt not in ("npy", "bin"):
    raise ValueError(f"read_token_files: fmt={fmt!r} must be 'npy' or 'bin'.")
  parts = []
  for path in files:
    ids = _read_ids(path, fmt, dtype)
    _check_ids(path, ids, vocab_size)
    parts.append(ids)
  corpus = Corpus(
      tuple(files), tuple(parts), _documents_of(parts, eod_id), fmt, eod_id
  )
  _check_not_empty(corpus)
  return corpus


def _check_not_empty(corpus: Corpus) -> None:
  if corpus.num_tokens == 0:
    count = len(corpus.files)
    raise ValueError(
        f"data {corpus.name}: the corpus is empty ({count} "
        f"file{'s' * (count != 1)}, no tokens)."
    )


def read_text_files(
    files: Sequence[str],
    tokenizer: Any,
    eod_id: int,
    *,
    tokenizer_path: str | None = None,
) -> Corpus:
  """A corpus of UTF-8 text files, one document each, tokenized.

  Args:
    files: the files, in stream order.
    tokenizer: a `tokenizers.Tokenizer` (see `tokenization.load_tokenizer`).
    eod_id: appended to each document unless its ids already end with it.
    tokenizer_path: the tokenizer's file, recorded in the corpus.

  Raises:
    ValueError: a file is not UTF-8 text, or the corpus is empty (files
      that hold only white space are skipped).
  """
  texts = []
  for path in files:
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
    except UnicodeDecodeError as e:
      raise ValueError(
          f"data {path}: is not UTF-8 text (byte {e.start}); pre-tokenized "
          "ids need the format 'npy' or 'bin'."
      ) from None
    texts.append(text)
  kept = [(p, t) for p, t in zip(files, texts, strict=True) if t.strip()]
  encoded = tokenizer.encode_batch([t for _, t in kept]) if kept else []
  docs, ids = [], []
  offset = 0
  for enc in encoded:
    doc = list(enc.ids)
    if not doc or doc[-1] != eod_id:
      doc.append(eod_id)
    ids.append(np.asarray(doc, np.int32))
    docs.append((offset, offset + len(doc)))
    offset += len(doc)
  stream = np.concatenate(ids) if ids else np.zeros((0,), np.int32)
  corpus = Corpus(
      tuple(files),
      (stream,),
      np.asarray(docs, np.int64).reshape(-1, 2),
      "text",
      eod_id,
      tokenizer_path,
  )
  _check_not_empty(corpus)
  return corpus


def read_corpus(
    paths: str | Sequence[str],
    *,
    format: str | None = None,  # noqa: A002 (the --data-format flag's name)
    tokenizer: Any = None,
    dtype: str | None = None,
    vocab_size: int | None = None,
    eod_id: int | None = None,
) -> Corpus:
  """The corpus of the files `paths` names (see `find_files`).

  Args:
    paths: a file, a directory, a glob, or a sequence of them.
    format: one of `FORMATS`; None: "npy" / "bin" when every file has that
      extension, else "text".
    tokenizer: for text: a `tokenizer.json` path or a `tokenizers.Tokenizer`
      (not used for pre-tokenized ids).
    dtype: for "bin": one of `BIN_DTYPES`.
    vocab_size: the model's: the tokenizer's vocabulary, every
      pre-tokenized id and `eod_id` must fit in it (None: not checked).
    eod_id: the end-of-document id; None: for text, the tokenizer's
      (`tokenization.end_of_document_id`); for pre-tokenized ids, none (a
      file is a document).

  Returns:
    The `Corpus`, every id checked.

  Raises:
    ValueError: see `find_files`, `read_text_files`, `read_token_files` and
      `tokenization.load_tokenizer`; or a bad `format` or `eod_id`, text
      without a tokenizer, or a tokenizer larger than `vocab_size`.
  """
  from linen_moe._src.data import tokenization  # noqa: PLC0415

  files = find_files(paths)
  fmt = format or infer_format(files)
  if fmt not in FORMATS:
    raise ValueError(f"format={fmt!r} is invalid: one of {FORMATS}.")
  if eod_id is not None:
    if isinstance(eod_id, bool) or not isinstance(eod_id, int) or eod_id < 0:
      raise ValueError(f"eod_id={eod_id!r} is invalid: an integer >= 0.")
    if vocab_size is not None and eod_id >= vocab_size:
      raise ValueError(
          f"eod_id={eod_id} is outside [0, vocab_size={vocab_size})."
      )
  if fmt != "text":
    return read_token_files(
        files, fmt, dtype=dtype, vocab_size=vocab_size, eod_id=eod_id
    )
  if tokenizer is None:
    raise ValueError(
        f"data {files[0]}: text needs a tokenizer (tokenizer=, --tokenizer "
        "tokenizer.json), or give pre-tokenized ids (format 'npy' or 'bin')."
    )
  path = None
  if isinstance(tokenizer, (str, os.PathLike)):
    path = os.fspath(tokenizer)
    tokenizer = tokenization.load_tokenizer(path, vocab_size)
  elif vocab_size is not None:
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
      raise ValueError(
          f"the tokenizer's vocabulary of {size} tokens is larger than the "
          f"model's vocab_size={vocab_size}."
      )
  if eod_id is None:
    eod_id = tokenization.end_of_document_id(tokenizer, path)
  return read_text_files(files, tokenizer, eod_id, tokenizer_path=path)
