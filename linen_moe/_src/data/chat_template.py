"""A tokenizer's chat template, rendered as transformers renders it, and the
generation prompt a reply follows.

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

`ChatTemplate.generation_prompt` (and `generation_prompt_ids`, what
`linen-moe generate --chat` feeds a model) is the text a reply follows in
training: the rendering of the messages and a reply, cut where the
assistant's span starts (`chat_spans.assistant_spans`, from the end of the
generation prompt). Where a template's generation prompt writes what the
training text does not (Gemma 4's empty thought channel, MiniMax-M2's
`<think>`, before a reply without reasoning), it ends where training's
unlearned text does.

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

from linen_moe._src.data import chat_spans

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
      (
          message[k]
          for k in chat_spans.REASONING_FIELDS
          if message.get(k) is not None
      ),
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
    span starts (`chat_spans.assistant_spans`): the generation prompt
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
      The prompt's ids, no special tokens added (the template writes
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
    (reply,) = chat_spans.sentinels(prompt + self.source, 1)
    probe = [*messages, {"role": "assistant", "content": reply}]
    text, spans = chat_spans.assistant_spans(self, probe)
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
  needs = (
      "chat data and generate --chat need a tokenizer with a chat"
      " template, as a released"
      f" model's tokenizer folder has: a {TOKENIZER_CONFIG} beside its"
      ' tokenizer.json with the "chat_template" (Jinja text) and the special'
      f' tokens it writes ("eos_token", ...), or a {CHAT_TEMPLATE_FILE}'
      " beside that file"
  )
  try:
    with open(config_path, encoding="utf-8") as f:
      config = json.load(f)
  except FileNotFoundError:
    raise ValueError(
        f"tokenizer folder {os.path.abspath(directory)}: has no"
        f" {TOKENIZER_CONFIG}; {needs}."
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
