"""Training rows of chat data: the windows of a packing, with the loss mask
the train step reads.

The rows are the windows that `packing` cuts from the chat corpus's
stream of ids ("pad": each conversation in its own rows, padded; "pack":
conversations one after another across rows), so the ids of a row are
those of its window, and its mask comes from the conversations' loss
masks (`chat.ChatCorpus.loss_mask`, a, over the window's ids).

The train step counts the target at position t + 1 where its `mask` is
True at t and at t + 1 (`linen_moe.training.loss_weights`; there, True
marks a real id). A chat row's `mask` is m[t] = a[t] or a[t + 1] (within
the window, m = a at its last real position, False on padding): the
tokens the loss learns and the one before each, which predicts it. Then
m[t] and m[t + 1] = a[t + 1] or (a[t] and a[t + 2]), exactly a[t + 1]
unless one position that the loss does not learn lies between two that
it does; no chat template writes an end of turn, a new turn and the next
assistant reply in one token, and `ChatPipeline` refuses data where it
happens. So the step counts exactly the assistant's tokens, in both front
ends, on any mesh and in the held-out loss, with no other change to them.

"first_fit" places several conversations (or windows of them) in a row,
each its own segment: the row's mask is read piece by piece from the loss
mask over each piece's range, and the segment ids keep the loss from the
target that crosses from one piece into the next.
"""

from __future__ import annotations

import grain
import numpy as np

from linen_moe._src.data import packing as packing_lib
from linen_moe._src.data import pipeline
from linen_moe._src.data.chat import ChatCorpus

# The packings of chat rows (each row's pieces are ranges of the stream).
CHAT_PACKINGS = ("pad", "pack", "first_fit")


def chat_step_mask(loss_mask: np.ndarray) -> np.ndarray:
  """The train step's mask of a row's loss mask (see the module docstring).

  Args:
    loss_mask: <bool>[n] True on the ids the loss learns.

  Returns:
    <bool>[n], m[t] = loss_mask[t] or loss_mask[t + 1] (loss_mask[n - 1]
    at the end).
  """
  a = np.asarray(loss_mask, np.bool_)
  m = a.copy()
  m[:-1] |= a[1:]
  return m


class ChatSequences:
  """Rows of a chat corpus: item `i` is window `i` of `windows` with the
  mask `chat_step_mask` of its loss mask (a Grain data source).

  Args:
    windows: the windows (`packing.Sequences`) of `chat.corpus`.
    loss_mask: <bool>[num_tokens] the chat corpus's loss mask.
  """

  def __init__(self, windows: packing_lib.Sequences, loss_mask: np.ndarray):
    self.windows, self.loss_mask = windows, loss_mask

  def __len__(self) -> int:
    return len(self.windows)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    item = self.windows[index]
    mask = np.zeros_like(item["mask"])
    at = 0
    for start, length in self.windows.pieces(index):
      piece = self.loss_mask[start : start + length]
      mask[at : at + length] = chat_step_mask(piece)
      at += length
    return {**item, "mask": mask}

  @property
  def fill_fraction(self) -> float:
    """The share of the rows' positions that hold ids."""
    return self.windows.fill_fraction

  def __repr__(self) -> str:
    return f"ChatSequences({self.windows!r})"

  def split(self, at: int) -> tuple[ChatSequences, ChatSequences]:
    """The rows cut in two, in order.

    Args:
      at: where, in [0, N].

    Returns:
      A pair (rows [0, at), rows [at, N)).
    """
    first, second = self.windows.split(at)
    return (
        ChatSequences(first, self.loss_mask),
        ChatSequences(second, self.loss_mask),
    )


def check_rows(chat: ChatCorpus, windows: packing_lib.Sequences) -> None:
  """Raises where a row's mask cannot say exactly what the loss learns.

  Args:
    chat: the chat corpus.
    windows: its windows.

  Raises:
    ValueError: naming the conversation (file and line) where, in one
      window, a single id the loss does not learn lies between two that
      it does.
  """
  a = chat.loss_mask
  bad = np.flatnonzero(a[:-2] & ~a[1:-1] & a[2:])
  if not bad.size:
    return
  order = np.argsort(windows.starts, kind="stable")
  starts = windows.starts[order]
  ends = starts + windows.lengths[order]
  at = np.searchsorted(starts, bad, side="right") - 1
  inside = (at >= 0) & (bad + 2 < ends[np.maximum(at, 0)])
  if inside.any():
    t = int(bad[np.argmax(inside)])
    documents = chat.corpus.documents[:, 0]
    doc = int(np.searchsorted(documents, t + 1, side="right")) - 1
    raise ValueError(
        f"data {chat.origins[doc]}: token {t + 1 - int(documents[doc])}, "
        "which the loss does not learn, lies alone between two tokens it "
        "learns; a train step's mask cannot express that (see "
        "linen_moe.data.ChatPipeline)."
    )


class ChatPipeline(pipeline.DataPipeline):
  """Shuffled training batches and held-out batches of a chat corpus, as
  `pipeline.DataPipeline` makes them of a corpus, each row's mask marking
  what the loss learns (see the module docstring).

  Example usage:
    chat = data.read_chat("chats.jsonl", "tokenizer/tokenizer.json")
    pipeline = data.ChatPipeline(chat, seq_len=512, batch_size=8)
    batch = next(pipeline.train_iterator())  # tokens, mask <[8, 512]>

  Attributes:
    chat: the chat corpus.

  Args:
    chat: see `chat.read_chat`.
    seq_len: S >= 2.
    batch_size: B >= 1, the global batch.
    packing: one of `CHAT_PACKINGS`: "pad" (default), a conversation's
      ids in its own rows; "pack", across rows; "first_fit",
      conversations packed whole into rows as segments (rows carry
      `segment_ids` and `positions`).
    seed: the shuffle's seed.
    eval_fraction: the share of the rows held out (the last ones).
    pad_id: the id of padded positions (default: `chat.corpus.eod_id`).
    read_options: Grain's threads and read-ahead.

  Raises:
    ValueError: a bad argument (see `pipeline.DataPipeline`), another
      packing, or data whose mask cannot be expressed (`check_rows`).
  """

  def __init__(
      self,
      chat: ChatCorpus,
      *,
      seq_len: int,
      batch_size: int,
      packing: str = "pad",
      seed: int = 0,
      eval_fraction: float = 0.1,
      pad_id: int | None = None,
      read_options: grain.ReadOptions | None = None,
  ):
    if packing not in CHAT_PACKINGS:
      raise ValueError(
          f"packing={packing!r} is invalid for chat data: one of "
          f"{CHAT_PACKINGS}."
      )
    super().__init__(
        chat.corpus,
        seq_len=seq_len,
        batch_size=batch_size,
        packing=packing,
        seed=seed,
        eval_fraction=eval_fraction,
        pad_id=pad_id,
        read_options=read_options,
    )
    for windows in (self.train, self.eval):
      check_rows(chat, windows)
    self.chat = chat
    self.train = ChatSequences(self.train, chat.loss_mask)
    self.eval = ChatSequences(self.eval, chat.loss_mask)

  def describe(self) -> dict:
    """What determines the batches.

    Returns:
      `pipeline.DataPipeline.describe()` with the chat corpus's
      description (`ChatCorpus.describe`: its loss mask too) as "corpus".
    """
    return {**super().describe(), "corpus": self.chat.describe()}
