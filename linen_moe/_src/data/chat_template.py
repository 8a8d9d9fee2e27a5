"""A tokenizer's chat template, rendered as transformers renders it, and the
spans of the rendered text that the assistant wrote.

The template is the Jinja text a Hugging Face tokenizer ships:
`chat_template.jinja` beside its `tokenizer_config.json` (transformers 5
saves it there), else the config's `chat_template` (a string, or a list of
named templates of which "default" is used). It renders as
`PreTrainedTokenizerBase.apply_chat_template(..., tokenize=False)` does:
a sandboxed Jinja environment (`ImmutableSandboxedEnvironment`,
`trim_blocks`, `lstrip_blocks`, the loop controls and the `{% generation
%}` tag), the globals `raise_exception`, `strftime_now`, `dict` and a
`namespace` that refuses underscore names, the `tojson` filter as
`json.dumps` (no HTML escaping), and as variables the messages, `tools`
and `documents` (None), `add_generation_prompt` and the tokenizer's named
special tokens (`bos_token`, `eos_token`, ...). Each message loses its
keys whose value is None, and a reasoning field (`reasoning_content`,
`thinking`, `reasoning`) is given under the names templates read.

Where the assistant wrote (`assistant_spans`): everything the template
writes for an assistant message after the generation prompt, the
rendering of the messages before it with `add_generation_prompt=True`
(the end-of-turn token after it is the mask's, `chat.loss_mask_of`).
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

Where a template's generation prompt writes what the training text does
not (Gemma 4's empty thought channel, MiniMax-M2's `<think>`, after a
reply without reasoning), training learns the reply after the text the
two share, and `ChatTemplate.generation_prompt` (what `linen-moe generate
--chat` renders) ends in the same place: the text before the span of a
reply to the conversation, found as above.

Imports no jax; jinja2 is imported when a template is first rendered.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
import dataclasses
import datetime
import functools
import json
import os
from typing import Any

TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# transformers' named special tokens (`SPECIAL_TOKENS_ATTRIBUTES`), passed
# to the template under these names.
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# The names a message's reasoning comes under; templates read the first
# (and gpt-oss's read "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Characters tried as the stand-in content of `assistant_spans` (Unicode's
# private use area: no tokenizer's template writes them).
_SENTINELS = range(0xE000, 0xF900)


def _token_text(value: Any) -> str | None:
  """A special token as tokenizer_config.json stores it: a string, or an
  `AddedToken` dict with its "content"."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _config_dir(path: str | os.PathLike) -> str:
  path = os.fspath(path)
  return path if os.path.isdir(path) else os.path.dirname(path) or "."


@functools.lru_cache(maxsize=16)
def _compiled(source: str):
  """The template compiled in transformers' environment (cached by text)."""
  import jinja2  # noqa: PLC0415
  from jinja2 import ext  # noqa: PLC0415
  from jinja2 import nodes  # noqa: PLC0415
  from jinja2 import sandbox  # noqa: PLC0415

  class Generation(ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body as is."""

    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      call = self.call_method("_body")
      return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  class Namespace(jinja2.utils.Namespace):
    """A Jinja namespace that refuses underscore names (as transformers')."""

    def __init__(*args, **kwargs):  # noqa: N805 (Jinja's own signature)
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        Namespace.check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      Namespace.check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"a chat template namespace cannot hold {name!r}."
        )

  class Dict:
    """`dict(...)` and `dict.fromkeys(...)`, and nothing else of the type."""

    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(
      x, ensure_ascii=False, indent=None, separators=None, sort_keys=False
  ):
    return json.dumps(
        x,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True,
      lstrip_blocks=True,
      extensions=[Generation, ext.loopcontrols],
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  env.globals["dict"] = Dict()
  env.globals["namespace"] = Namespace
  return env.from_string(source)


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
  """A message as transformers hands it to the template: None-valued keys
  dropped, a reasoning field under every name templates read."""
  message = {k: v for k, v in message.items() if v is not None}
  reasoning = next(
      (message[k] for k in REASONING_FIELDS if message.get(k) is not None),
      None,
  )
  if reasoning is not None:
    message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
  return message


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A tokenizer's chat template and the special tokens it reads.

  Attributes:
    source: the Jinja text.
    special_tokens: {name: token text} of the named special tokens the
      tokenizer has (`SPECIAL_TOKENS`), the template's variables.
    where: the file it was read from, for messages.
  """

  source: str
  special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
  where: str = "the chat template"

  def render(
      self,
      messages: Sequence[Mapping[str, Any]],
      add_generation_prompt: bool = False,
  ) -> str:
    """The conversation as text, as transformers renders it.

    Args:
      messages: the conversation, dicts with "role" and "content" (and
        whatever else the template reads).
      add_generation_prompt: end with the header of an assistant turn (to
        prompt a reply), where the template has one.

    Returns:
      `apply_chat_template(messages, tokenize=False,
      add_generation_prompt=...)`'s text.

    Raises:
      ValueError: the template refuses the conversation
        (`raise_exception`) or fails to render it; the message says which
        template and why.
    """
    import jinja2  # noqa: PLC0415

    try:
      return _compiled(self.source).render(
          messages=[_template_message(m) for m in messages],
          tools=None,
          documents=None,
          add_generation_prompt=add_generation_prompt,
          **self.special_tokens,
      )
    except jinja2.TemplateError as e:
      raise ValueError(
          f"{self.where} cannot render the conversation: {e}"
      ) from None

  def generation_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
    """The text a reply to `messages` follows, where training's loss starts.

    It is the rendering of `messages` and a reply, cut where the reply's
    span starts (`assistant_spans`): the generation prompt
    (`render(messages, add_generation_prompt=True)`) where the training
    text holds it whole, else the part of it that the training text holds
    (Gemma 4's thought channel and MiniMax-M2's `<think>` are left out
    before a reply without reasoning, as training leaves them out).

    Args:
      messages: the conversation so far, ending where the assistant
        replies (its last message a user's, as a rule).

    Returns:
      The prompt's text; tokenized without special tokens added, its ids
      are the ids that come before the reply's first learned token in
      training (`chat.encode_conversation`).

    Raises:
      ValueError: the template cannot render the conversation.
    """
    text, start = self._reply_start(messages)
    return text[:start]

  def generation_prompt_ids(
      self, messages: Sequence[Mapping[str, Any]], tokenizer: Any
  ) -> list[int]:
    """The ids a reply to `messages` follows: those of training's text
    before the reply's first learned token.

    The ids of the rendering of `messages` and a reply (as
    `generation_prompt`) before the first token that holds a character of
    the reply's span: where a token of the text that ends the generation
    prompt runs on into the reply (a template whose prompt and training
    text part inside a token), training learns that token, and the prompt
    stops before it, as training's does.

    Args:
      messages: the conversation so far (see `generation_prompt`).
      tokenizer: a `tokenizers.Tokenizer`.

    Returns:
      The prompt's ids (no special tokens added: the template writes
      them).

    Raises:
      ValueError: the template cannot render the conversation.
    """
    text, start = self._reply_start(messages)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    ends = [end for _, end in encoding.offsets]
    first = next((t for t, end in enumerate(ends) if end > start), len(ends))
    return list(encoding.ids[:first])

  def _reply_start(self, messages) -> tuple[str, int]:
    """The rendering of `messages` and a reply, and where its span starts."""
    prompt = self.render(messages, add_generation_prompt=True)
    (reply,) = _sentinels(prompt + self.source, 1)
    probe = [*messages, {"role": "assistant", "content": reply}]
    text, spans = assistant_spans(self, probe)
    return text, spans[-1][0]


def load_chat_template(path: str | os.PathLike) -> ChatTemplate:
  """The chat template of a Hugging Face tokenizer.

  Args:
    path: the tokenizer's directory, or a file in it (its
      `tokenizer.json` or `tokenizer_config.json`).

  Returns:
    The `ChatTemplate` of `chat_template.jinja` in that directory if there
    is one, else of `tokenizer_config.json`'s `chat_template`; with the
    named special tokens of `tokenizer_config.json`.

  Raises:
    ValueError: the directory has no `tokenizer_config.json` that reads,
      or no chat template.
  """
  directory = _config_dir(path)
  config_path = os.path.join(directory, TOKENIZER_CONFIG)
  needs = "chat data needs a tokenizer with a chat template"
  try:
    with open(config_path, encoding="utf-8") as f:
      config = json.load(f)
  except FileNotFoundError:
    raise ValueError(
        f"tokenizer {directory}: has no {TOKENIZER_CONFIG}; {needs}."
    ) from None
  except (OSError, ValueError) as e:
    raise ValueError(
        f"tokenizer {config_path}: cannot be read ({type(e).__name__}: {e})."
    ) from None
  if not isinstance(config, dict):
    raise ValueError(f"tokenizer {config_path}: is not a JSON object.")
  special = {
      name: text
      for name in SPECIAL_TOKENS
      if (text := _token_text(config.get(name))) is not None
  }
  file = os.path.join(directory, CHAT_TEMPLATE_FILE)
  if os.path.isfile(file):
    with open(file, encoding="utf-8") as f:
      return ChatTemplate(f.read(), special, file)
  source = config.get("chat_template")
  if isinstance(source, list):  # named templates: [{"name", "template"}]
    named = {
        t.get("name"): t.get("template") for t in source if isinstance(t, dict)
    }
    source = named.get("default")
  if not isinstance(source, str) or not source.strip():
    raise ValueError(
        f"tokenizer {config_path}: has no chat_template (and there is no "
        f"{CHAT_TEMPLATE_FILE} beside it); {needs}."
    )
  return ChatTemplate(source, special, config_path)


def _common_prefix(a: str, b: str) -> int:
  return len(os.path.commonprefix([a, b]))


def _with_stand_in(message: Mapping[str, Any], stand_in: str) -> dict:
  """`message` with its content (and reasoning) replaced by `stand_in`."""
  fields = {k: stand_in for k in REASONING_FIELDS if k in message}
  return {**message, **fields, "content": stand_in}


def _sentinels(text: str, count: int) -> list[str]:
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
  (sentinel,) = _sentinels(text, 1)
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
  marks = _sentinels(text, len(replies))
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
    messages: the conversation; every assistant message has a string
      "content".

  Returns:
    The pair `(text, spans)`, `template.render(messages)` and, for each
    assistant message in order, its content's [start, end) character span
    in `text`.

  Raises:
    ValueError: the template cannot render the conversation, or renders
      one assistant message in more than one place (spans that overlap).
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
