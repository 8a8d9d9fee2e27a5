"""Chat data: conversations in JSONL, rendered with the tokenizer's chat
template and tokenized, with a loss mask on what the assistant wrote.

Each line of a chat file is one conversation, `{"messages": [{"role":
..., "content": ...}, ...]}`, the roles among `ROLES`. A conversation is
rendered whole with the template (`chat_template.ChatTemplate.render`, as
transformers' `apply_chat_template(..., tokenize=False)`), tokenized as
transformers tokenizes it (`add_special_tokens=False`: the template writes
its own), and becomes one *document*: its ids and a loss mask, True on
every token the template writes for each assistant message after its
generation prompt (`assistant_spans`: Mixtral's space before the reply,
Qwen3's `<think>` block, the reply) and on the token right after it, the
one that ends the turn (`<|im_end|>`, `</s>`, ...), so the model learns to
start and to stop; nothing of the system's or the users' turns. A token
counts when any of its characters is the assistant's, as in transformers'
`assistant_masks`.

`read_chat` gives a `ChatCorpus`: a `sources.Corpus` whose documents are
the conversations (so any packing of a corpus cuts it), and the loss mask
of every id of its stream. `ChatPipeline` (`chat_rows`) makes training
rows of it. Every problem with a file is a `ValueError` naming the file
and line, raised while reading, before any training step. Imports no jax.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
import dataclasses
import hashlib
import json
import os
from typing import Any

import numpy as np

from linen_moe._src.data import chat_spans
from linen_moe._src.data import chat_template as template_lib
from linen_moe._src.data import sources
from linen_moe._src.data import tokenization

CHAT_FORMAT = "chat"
ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Conversation:
  """One line of a chat file.

  Attributes:
    messages: the messages, each a dict with a "role" in `ROLES` and a
      string "content".
    file: the file it was read from.
    line: its line number there (from 1).
  """

  messages: tuple[Mapping[str, Any], ...]
  file: str
  line: int

  @property
  def where(self) -> str:
    return f"{self.file}:{self.line}"


def _check_messages(obj: Any, where: str) -> list[dict[str, Any]]:
  """The messages of one parsed line, each checked."""
  messages = obj.get("messages") if isinstance(obj, dict) else None
  if not isinstance(messages, list) or not messages:
    raise ValueError(
        f'data {where}: expected an object with a non-empty "messages" '
        'list, e.g. {"messages": [{"role": "user", "content": "Hi"}, ...]}.'
    )
  for j, message in enumerate(messages):
    if not isinstance(message, dict):
      raise ValueError(
          f"data {where}: message {j} is a {type(message).__name__}, not an "
          'object with "role" and "content".'
      )
    if "role" not in message:
      raise ValueError(
          f'data {where}: message {j} has no "role" (one of {ROLES}).'
      )
    role = message["role"]
    if role not in ROLES:
      raise ValueError(
          f"data {where}: message {j} has the unknown role {role!r}; "
          f"expected one of {ROLES}."
      )
    if not isinstance(message.get("content"), str):
      raise ValueError(
          f'data {where}: message {j} ({role}) has no string "content".'
      )
  if not any(m["role"] == "assistant" for m in messages):
    raise ValueError(
        f"data {where}: the conversation has no assistant message: nothing "
        "to train on."
    )
  return messages


def read_conversations(path: str | os.PathLike) -> list[Conversation]:
  """The conversations of one JSONL chat file, each checked.

  Args:
    path: the file; blank lines are skipped.

  Returns:
    Its conversations, in order.

  Raises:
    ValueError: naming the file and line: not UTF-8, not JSON, no
      "messages" list, a message without a role, with an unknown role or
      without string content, or a conversation without an assistant
      message; or a file without a conversation.
  """
  path = os.fspath(path)
  out = []
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      where = f"{path}:{number}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(
            f"data {where}: is not UTF-8 text (byte {e.start})."
        ) from None
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except ValueError as e:
        raise ValueError(
            f"data {where}: is not a JSON object ({e}); a chat file holds "
            "one conversation per line."
        ) from None
      messages = _check_messages(obj, where)
      out.append(Conversation(tuple(messages), path, number))
  if not out:
    raise ValueError(f"data {path}: holds no conversation.")
  return out


def loss_mask_of(
    offsets: np.ndarray, spans: Sequence[tuple[int, int]]
) -> np.ndarray:
  """The loss mask of a tokenized text from the assistant's spans.

  Args:
    offsets: <int>[N, 2] each token's [start, end) characters in the text.
    spans: the assistant's [start, end) character spans, in order.

  Returns:
    <bool>[N] True on every token with a character in a span, and on the
    token after each span's last such token (the turn's end; for an empty
    span, the first token starting at or after it).
  """
  offsets = np.asarray(offsets, np.int64).reshape(-1, 2)
  n = len(offsets)
  mask = np.zeros((n,), np.bool_)
  for start, end in spans:
    inside = np.flatnonzero((offsets[:, 0] < end) & (offsets[:, 1] > start))
    if inside.size:
      mask[inside] = True
      after = int(inside[-1]) + 1
    else:
      after = int(np.searchsorted(offsets[:, 0], start, side="left"))
    if after < n:
      mask[after] = True
  return mask


def encode_conversation(
    template: template_lib.ChatTemplate,
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
) -> tuple[np.ndarray, np.ndarray]:
  """One conversation as a document: its ids and its loss mask.

  Args:
    template: the chat template.
    tokenizer: a `tokenizers.Tokenizer`.
    messages: the conversation (see `read_conversations`).

  Returns:
    The pair `(ids, loss_mask)`, <int32>[N] the rendered text's ids (no
    special tokens added, the template writes them) and <bool>[N] True on
    what the template writes for each assistant message after its
    generation prompt and on the end token of its turn (`loss_mask_of`).

  Raises:
    ValueError: (from `chat_spans.assistant_spans`) the template cannot
      render the conversation.
  """
  text, spans = chat_spans.assistant_spans(template, messages)
  encoding = tokenizer.encode(text, add_special_tokens=False)
  ids = np.asarray(encoding.ids, np.int32)
  return ids, loss_mask_of(np.asarray(encoding.offsets), spans)


@dataclasses.dataclass(frozen=True, eq=False)
class ChatCorpus:
  """Conversations as a corpus of documents with a loss mask.

  Attributes:
    corpus: the ids: a `sources.Corpus` of format "chat" whose documents
      are the conversations, in file and line order (its `eod_id`, the
      tokenizer's end-of-document id, pads rows).
    loss_mask: <bool>[corpus.num_tokens] True on each id the loss learns.
    origins: "file:line" of each conversation.
    template: where the chat template was read.
  """

  corpus: sources.Corpus
  loss_mask: np.ndarray
  origins: tuple[str, ...]
  template: str

  def __len__(self) -> int:
    return len(self.corpus.documents)

  def document(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    """One conversation's ids and loss mask.

    Args:
      index: the conversation, in [0, len).

    Returns:
      `(ids <int32>[N], loss_mask <bool>[N])`.
    """
    start, end = (int(x) for x in self.corpus.documents[index])
    return self.corpus.read(start, end), self.loss_mask[start:end].copy()

  def documents(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every conversation's ids and loss mask, in order.

    Yields:
      `document(i)` for i = 0, 1, ...
    """
    for i in range(len(self)):
      yield self.document(i)

  def describe(self) -> dict[str, Any]:
    """What identifies the corpus and its mask.

    Returns:
      `corpus.describe()` with "loss_tokens" (the ids the loss learns) and
      "loss_digest" (16 hex digits that change with the mask).
    """
    digest = hashlib.sha256(np.packbits(self.loss_mask).tobytes()).hexdigest()
    return {
        **self.corpus.describe(),
        "loss_tokens": int(self.loss_mask.sum()),
        "loss_digest": digest[:16],
    }


def _check_vocab(stream, bounds, origins, eod_id, vocab_size) -> None:
  """Every id, and `eod_id`, in [0, vocab_size)."""
  if not 0 <= eod_id < vocab_size:
    raise ValueError(
        f"eod_id={eod_id} is outside [0, vocab_size={vocab_size})."
    )
  bad = np.flatnonzero(stream >= vocab_size)
  if bad.size:
    doc = int(np.searchsorted([b for _, b in bounds], bad[0], side="right"))
    raise ValueError(
        f"data {origins[doc]}: id {int(stream[bad[0]])} is outside "
        f"[0, vocab_size={vocab_size}) of the model: the tokenizer is not "
        "the model's."
    )


def read_chat(
    paths: str | Sequence[str],
    tokenizer: Any,
    *,
    template: template_lib.ChatTemplate | str | os.PathLike | None = None,
    vocab_size: int | None = None,
    eod_id: int | None = None,
) -> ChatCorpus:
  """The chat files `paths` names (see `sources.find_files`) as a corpus.

  Args:
    paths: a file, a directory, a glob, or a sequence of them; each file is
      JSONL, one conversation a line.
    tokenizer: a `tokenizer.json` path, or a `tokenizers.Tokenizer`.
    template: the chat template, or a path to load it from
      (`chat_template.load_chat_template`); None: the one beside the
      `tokenizer` file.
    vocab_size: the model's: the tokenizer's vocabulary must fit in it
      (None: not checked).
    eod_id: the id that pads rows; None: the tokenizer's end-of-document
      id (`tokenization.end_of_document_id`).

  Returns:
    The `ChatCorpus`.

  Raises:
    ValueError: no template (or a tokenizer object without one), a file
      problem (see `read_conversations`) or a conversation the template
      refuses, naming the file and line; or a tokenizer problem (see
      `tokenization.load_tokenizer`).
  """
  if tokenizer is None:
    raise ValueError(
        "chat data needs a tokenizer with a chat template (tokenizer=, "
        "--tokenizer DIR/tokenizer.json)."
    )
  path = None
  if isinstance(tokenizer, (str, os.PathLike)):
    path = os.fspath(tokenizer)
  if template is None:
    if path is None:
      raise ValueError(
          "read_chat: give the chat template (template=) with a tokenizer "
          "object, or the tokenizer as its tokenizer.json path."
      )
    template = path
  if not isinstance(template, template_lib.ChatTemplate):
    template = template_lib.load_chat_template(template)
  if path is not None:
    tokenizer = tokenization.load_tokenizer(path, vocab_size)
  if eod_id is None:
    eod_id = tokenization.end_of_document_id(tokenizer, path)
  files = sources.find_files(paths)
  ids, masks, bounds, origins, at = [], [], [], [], 0
  for file in files:
    for conversation in read_conversations(file):
      try:
        doc, mask = encode_conversation(
            template, tokenizer, conversation.messages
        )
      except ValueError as e:
        raise ValueError(f"data {conversation.where}: {e}") from None
      ids.append(doc)
      masks.append(mask)
      bounds.append((at, at + len(doc)))
      origins.append(conversation.where)
      at += len(doc)
  stream = np.concatenate(ids).astype(np.int32, copy=False)
  if vocab_size is not None:
    _check_vocab(stream, bounds, origins, eod_id, vocab_size)
  corpus = sources.Corpus(
      tuple(files),
      (stream,),
      np.asarray(bounds, np.int64).reshape(-1, 2),
      CHAT_FORMAT,
      eod_id,
      path,
  )
  return ChatCorpus(
      corpus, np.concatenate(masks), tuple(origins), template.where
  )
