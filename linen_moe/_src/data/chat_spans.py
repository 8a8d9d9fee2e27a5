"""Where the assistant wrote in a rendered conversation: the spans a chat
loss mask learns.

`assistant_spans`: everything the template writes for an assistant
message after the generation prompt, the rendering of the messages before
it with `add_generation_prompt=True` (the end-of-turn token after it is
the mask's, `chat.loss_mask_of`).
Mixtral's template writes `' ' + content` after `[/INST]` and has no
generation prompt: the space, a `▁` token of its own before a digit, is
the assistant's, as Qwen3's `<think>` block of the last turn is (the
model writes both). The reply itself is found by rendering the
conversation again with the message's content (and reasoning) replaced by
a character the rendered text does not hold; the text before the first
difference and after the last one is the template's, the rest is what
that message rendered to. The span starts where the generation prompt
and the conversation part, if that is after the reply before and no
later than the message's content; else (a template that renders the
turns before a reply differently once it follows) at the content.
Replacing the content needs no `{% generation %}` markers (the released
templates have none), and, unlike taking differences of the renderings
of the prefixes `messages[:i]`, it holds when a template renders a
message by its position: Qwen3's renders the last assistant message with
an empty `<think>` block and drops the reasoning of earlier turns, so a
prefix's rendering is not a prefix of the whole. Most templates write the
same text around any reply, and one more rendering, with every reply
replaced by its own character, finds all the replies; where the text
around a reply depends on it (Qwen3's reasoning), it renders once per
reply. Each generation prompt is one more rendering: 2.0 ms for a system
prompt and three turns of the Qwen3-style fixture, 1.1 ms of the Mixtral
one, tokenization included (one CPU core, shared).

Imports no jax.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
import os
from typing import Any
from typing import Protocol

# The names a message's reasoning comes under; templates read the first
# (and gpt-oss's read "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplate(Protocol):
  """What the spans need of a `chat_template.ChatTemplate`."""

  where: str

  def render(
      self,
      messages: Sequence[Mapping[str, Any]],
      add_generation_prompt: bool = False,
  ) -> str:
    ...


# Characters tried as the stand-in content of `assistant_spans` (Unicode's
# private use area: no tokenizer's template writes them).
_SENTINELS = range(0xE000, 0xF900)


def _common_prefix(a: str, b: str) -> int:
  return len(os.path.commonprefix([a, b]))


def _with_stand_in(message: Mapping[str, Any], stand_in: str) -> dict:
  """`message` with its content (and reasoning) replaced by `stand_in`."""
  fields = {k: stand_in for k in REASONING_FIELDS if k in message}
  return {**message, **fields, "content": stand_in}


def sentinels(text: str, count: int) -> list[str]:
  """`count` characters that `text` does not hold."""
  free = (chr(c) for c in _SENTINELS if chr(c) not in text)
  return [next(free) for _ in range(count)]


def spans_one_by_one(
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    text: str,
) -> list[tuple[int, int]]:
  """Each assistant message's span, from one more rendering per message
  (with only its content replaced: where the rendering changes).

  Args:
    template: the chat template.
    messages: the conversation.
    text: `template.render(messages)`.

  Returns:
    The [start, end) spans in `text`, in order.

  Raises:
    ValueError: a span overlaps the one before it.
  """
  (sentinel,) = sentinels(text, 1)
  spans = []
  for i, message in enumerate(messages):
    if message.get("role") != "assistant":
      continue
    other = list(messages)
    other[i] = _with_stand_in(message, sentinel)
    changed = template.render(other)
    start = _common_prefix(text, changed)
    end_limit = min(len(text), len(changed)) - start
    tail = _common_prefix(text[::-1], changed[::-1])
    end = len(text) - min(tail, end_limit)
    if spans and start < spans[-1][1]:
      raise ValueError(
          f"{template.where} renders assistant message {i} where an earlier "
          "one is: its span cannot be told apart."
      )
    spans.append((start, end))
  return spans


def _spans_at_once(template, messages, text) -> list[tuple[int, int]] | None:
  """Every span from one more rendering, with each assistant content
  replaced by its own sentinel: that rendering is T0 s1 T1 ... sk Tk, and
  `text` must read T0 c1 T1 ... ck Tk, each Tj found once after c(j-1).
  None where it does not (the template renders a reply by what it holds),
  or where a Tj could be found in two places."""
  replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
  marks = sentinels(text, len(replies))
  other = list(messages)
  for i, mark in zip(replies, marks, strict=True):
    other[i] = _with_stand_in(messages[i], mark)
  pieces, rest = [], template.render(other)
  for mark in marks:
    if rest.count(mark) != 1:
      return None
    piece, rest = rest.split(mark)
    pieces.append(piece)
  if not text.startswith(pieces[0]) or not text.endswith(rest):
    return None
  at, spans = len(pieces[0]), []
  for between in pieces[1:]:
    end = text.find(between, at)
    if end < 0 or text.find(between, end + 1) >= 0:
      return None
    spans.append((at, end))
    at = end + len(between)
  end = len(text) - len(rest)
  if end < at:
    return None
  spans.append((at, end))
  return spans


def content_spans(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]]
) -> tuple[str, list[tuple[int, int]]]:
  """The rendered conversation and where each assistant message's content
  (and reasoning) is in it.

  See the module docstring: each span is where the rendering changes when
  only that message's content (and reasoning, if it has a field of
  `REASONING_FIELDS`) changes: what the template made of them (an empty
  span for an empty content), not the text it writes whatever they are.
  One more rendering, with every reply replaced at once, finds them all
  where the template writes the same text around any reply; else
  `spans_one_by_one` renders once per reply.

  Args:
    template: the chat template.
    messages: the conversation (as `assistant_spans` takes it).

  Returns:
    `(text, spans)`: the rendering, and each assistant message's content
    span [start, end) in it, in order.

  Raises:
    ValueError: as `assistant_spans`.
  """
  text = template.render(messages)
  if not any(m.get("role") == "assistant" for m in messages):
    return text, []
  spans = _spans_at_once(template, messages, text)
  if spans is None:
    spans = spans_one_by_one(template, messages, text)
  return text, spans


def _prompt_end(template, messages, index, text, floor, content) -> int:
  """Where assistant message `index`'s span starts, in [floor, content]:
  the end of the text that `text` shares with the generation prompt of
  `messages[:index]`; else, where the two part before `floor` (a template
  that renders earlier turns by what follows them, as Qwen3's drops
  reasoning), the end of the longest `text[floor:x]` that ends the prompt;
  else `content`."""
  try:
    prompt = template.render(messages[:index], add_generation_prompt=True)
  except ValueError:  # e.g. a template that refuses a reply first
    return content
  at = _common_prefix(text, prompt)
  if floor <= at <= content:
    return at
  if at < floor < content:
    # The longest suffix prompt[p:] that text[floor:content] starts with,
    # tried where prompt[p] is text[floor].
    p = max(0, len(prompt) - (content - floor))
    while (p := prompt.find(text[floor], p)) >= 0:
      if text.startswith(prompt[p:], floor):
        return floor + len(prompt) - p
      p += 1
  return content


def assistant_spans(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]]
) -> tuple[str, list[tuple[int, int]]]:
  """The rendered conversation and what the assistant wrote in it.

  See the module docstring: each assistant message's span runs from the
  end of the generation prompt before it (the rendering of the messages
  before it with `add_generation_prompt=True`, as far as the conversation
  holds it) to the end of its content (`content_spans`). It holds what
  the template writes for the reply that no generation prompt wrote
  (Mixtral's space before the content, Qwen3's `<think>` block of the last
  turn); the token that ends the turn, right after it, is the loss mask's
  (`chat.loss_mask_of`).

  Args:
    template: the chat template.
    messages: the conversation; every assistant message has a string
      "content".

  Returns:
    The pair `(text, spans)`, `template.render(messages)` and, for each
    assistant message in order, its [start, end) character span in `text`.

  Raises:
    ValueError: the template cannot render the conversation, or renders
      one assistant message in more than one place (spans that overlap).
  """
  text, contents = content_spans(template, messages)
  replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
  spans, floor = [], 0
  for i, (content, end) in zip(replies, contents, strict=True):
    start = _prompt_end(template, messages, i, text, floor, content)
    spans.append((start, end))
    floor = end
  return text, spans
