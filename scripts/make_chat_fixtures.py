"""Writes tiny tokenizers with chat templates, and transformers' renderings.

`linen_moe.data` renders chat templates itself (jinja2, as transformers
does); the tests compare its text, ids and masks to what transformers
gives for the same files. CI has no transformers, so this script, run by
hand in the fixture venv (see scripts/make_hf_fixtures.py; transformers,
tokenizers and jinja2 are all it needs), writes both sides once and the
fixtures are committed:

  tests/fixtures/chat/<name>/
    tokenizer.json         a small BPE trained here on TEXT (deterministic)
    tokenizer_config.json  its special tokens (and, for "qwen3", the chat
                           template, as the released Qwen3 repositories
                           store it)
    chat_template.jinja    the template where transformers 5's
                           `save_pretrained` puts it ("mixtral",
                           "qwen3_generation")
    expected.json          for each case of CASES: the messages,
                           add_generation_prompt, transformers'
                           `apply_chat_template(..., tokenize=False)` text
                           and its ids (tokenize=True); for templates with
                           `{% generation %}`, its `assistant_masks`; and
                           the errors the template raises for ERRORS.

The templates are written here in the styles of the released models:
"qwen3" (ChatML turns, `<think>` blocks: the last assistant turn after the
last user message gets an empty one, earlier turns lose their reasoning),
"mixtral" (`[INST] ... [/INST]` with the system prompt folded into the
first user turn, `raise_exception` for roles out of turn) and
"qwen3_generation" (ChatML with `{% generation %}` around each assistant
reply and its end token, the markers transformers reads for its mask;
written without whitespace control, so that it renders right only with
`trim_blocks` and `lstrip_blocks`, and with `tojson` on tool results).

Run from the repository root:

  /work/venv-hf/bin/python scripts/make_chat_fixtures.py
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import tokenizers
from tokenizers import decoders
from tokenizers import models
from tokenizers import pre_tokenizers
from tokenizers import processors
from tokenizers import trainers
import transformers

REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = REPO / 'tests' / 'fixtures' / 'chat'

QWEN3_TEMPLATE = """\
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set i = messages|length - 1 - loop.index0 %}
    {%- if message.role == "user" and ns.last_query == messages|length - 1 %}
        {%- set ns.last_query = i %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "system" %}
        {{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

MIXTRAL_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

QWEN3_GENERATION_TEMPLATE = """\
{# No whitespace control: this one relies on trim_blocks and lstrip_blocks. #}
{% for message in messages %}
    {% if message.role == "assistant" %}
<|im_start|>assistant
{% generation %}{{ message.content }}<|im_end|>{% endgeneration %}

    {% elif message.role == "tool" %}
<|im_start|>user
<tool_response>{{ message.content | tojson }}</tool_response><|im_end|>
    {% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


def _m(role: str, content: str, **more) -> dict:
  return {'role': role, 'content': content, **more}


SYSTEM = _m('system', 'You are a careful assistant. Answer briefly.')
CASES = {
    'single_turn': [
        _m('user', 'What is 2 + 2?'),
        _m('assistant', '2 + 2 = 4.'),
    ],
    'multi_turn': [
        _m('user', 'Name a prime number.'),
        _m('assistant', 'Seven is a prime number.'),
        _m('user', 'And an even one?'),
        _m('assistant', 'Two is the only even prime.'),
    ],
    'system_prompt': [
        SYSTEM,
        _m('user', 'Say hello.'),
        _m('assistant', 'Hello!'),
        _m('user', 'Say it again.'),
        _m('assistant', 'Hello again!'),
    ],
    'unicode': [
        _m('user', 'Où est le café? → ☕'),
        _m('assistant', 'Ici: ☕ (¡olé!)'),
    ],
    'empty_reply': [
        _m('user', 'Say nothing.'),
        _m('assistant', ''),
    ],
    'prompt_only': [SYSTEM, _m('user', 'What is the capital of France?')],
}
# Conversations the Qwen3 style alone renders (reasoning, tool results);
# the Mixtral style refuses their roles.
QWEN3_CASES = {
    'reasoning': [
        _m('user', 'What is 3 + 4?'),
        _m('assistant', '<think>\nAdd them.\n</think>\n\n3 + 4 = 7.'),
        _m('user', 'And 5 + 6?'),
        _m('assistant', '<think>\nAdd again.\n</think>\n\n5 + 6 = 11.'),
    ],
    'reasoning_field': [
        _m('user', 'Double 8.'),
        _m('assistant', '16.', reasoning_content='8 times 2.'),
    ],
    'tool_result': [
        _m('user', 'What is the weather?'),
        _m('assistant', 'Let me look.'),
        _m('tool', 'Sunny, 21 C & "dry" <hot>.'),
        _m('assistant', 'It is sunny and 21 C.'),
    ],
}
ERRORS = {
    'roles_out_of_turn': [
        _m('user', 'One.'),
        _m('user', 'Two.'),
        _m('assistant', 'Three.'),
    ],
    'tool_role': [_m('user', 'Weather?'), _m('tool', 'Sunny.')],
}

# What the tokenizers are trained on: every case's text and some prose.
TEXT = [
    (
        'The quick brown fox jumps over the lazy dog. A prime number has no '
        'divisor but one and itself. The capital of France is Paris.'
    ),
    'Assistants answer questions; users ask them. Hello, hello again!',
]


def _corpus() -> list[str]:
  out = list(TEXT)
  for conversation in [*CASES.values(), *QWEN3_CASES.values()]:
    out.extend(m['content'] for m in conversation)
  return out


def qwen3_tokenizer() -> tokenizers.Tokenizer:
  """Byte-level BPE (as Qwen3's), ChatML's special tokens."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  trainer = trainers.BpeTrainer(
      vocab_size=320,
      special_tokens=['<|endoftext|>', '<|im_start|>', '<|im_end|>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  tok.train_from_iterator(_corpus(), trainer)
  return tok


def mixtral_tokenizer() -> tokenizers.Tokenizer:
  """Metaspace BPE (as Mixtral's SentencePiece), under 256 tokens."""
  tok = tokenizers.Tokenizer(models.BPE(unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme='first')
  tok.decoder = decoders.Metaspace(prepend_scheme='first')
  trainer = trainers.BpeTrainer(
      vocab_size=200,
      special_tokens=['<unk>', '<s>', '</s>'],
      limit_alphabet=120,
      show_progress=False,
  )
  tok.train_from_iterator(_corpus(), trainer)
  return tok


def _save(name: str, tok, template: str, in_config: bool, **special) -> str:
  out = FIXTURES / name
  if out.exists():
    shutil.rmtree(out)
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, chat_template=template, **special
  )
  fast.save_pretrained(str(out))
  if in_config:  # the template inside tokenizer_config.json, as on the hub
    (out / 'chat_template.jinja').unlink()
    config_path = out / 'tokenizer_config.json'
    config = json.loads(config_path.read_text())
    config['chat_template'] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
  return str(out)


def _expected(directory: str, cases: dict, errors: dict) -> dict:
  tok = transformers.AutoTokenizer.from_pretrained(directory)
  has_generation = (
      re.search(r'{%-?\s*generation', tok.chat_template) is not None
  )
  rendered = []
  for name, messages in cases.items():
    for prompt in (False, True):
      text = tok.apply_chat_template(
          messages, tokenize=False, add_generation_prompt=prompt
      )
      out = tok.apply_chat_template(
          messages,
          tokenize=True,
          add_generation_prompt=prompt,
          return_dict=True,
          return_assistant_tokens_mask=has_generation,
      )
      case = {
          'name': name,
          'add_generation_prompt': prompt,
          'messages': messages,
          'text': text,
          'ids': list(out['input_ids']),
      }
      if has_generation:
        case['assistant_masks'] = list(out['assistant_masks'])
      rendered.append(case)
  failures = []
  for name, messages in errors.items():
    try:
      tok.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # noqa: BLE001 (jinja2's TemplateError)
      failures.append({'name': name, 'messages': messages, 'error': str(e)})
    else:
      raise AssertionError(f'{directory}: {name} rendered')
  return {
      'transformers': transformers.__version__,
      'tokenizers': tokenizers.__version__,
      'special_tokens': tok.special_tokens_map,
      'cases': rendered,
      'errors': failures,
  }


def main() -> None:
  FIXTURES.mkdir(parents=True, exist_ok=True)
  qwen = qwen3_tokenizer()
  chatml = {'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>'}
  fixtures = {
      'qwen3': (
          _save('qwen3', qwen, QWEN3_TEMPLATE, True, **chatml),
          {**CASES, **QWEN3_CASES},
          {},
      ),
      'mixtral': (
          _save(
              'mixtral',
              mixtral_tokenizer(),
              MIXTRAL_TEMPLATE,
              False,
              bos_token='<s>',
              eos_token='</s>',
              unk_token='<unk>',
          ),
          CASES,
          ERRORS,
      ),
      'qwen3_generation': (
          _save(
              'qwen3_generation',
              qwen,
              QWEN3_GENERATION_TEMPLATE,
              False,
              **chatml,
          ),
          {**CASES, 'tool_result': QWEN3_CASES['tool_result']},
          {},
      ),
  }
  for name, (directory, cases, errors) in fixtures.items():
    expected = _expected(directory, cases, errors)
    path = pathlib.Path(directory) / 'expected.json'
    path.write_text(json.dumps(expected, indent=1, ensure_ascii=False) + '\n')
    print(
        f'{name}: {len(expected["cases"])} renderings, '
        f'{len(expected["errors"])} errors -> {path}'
    )


if __name__ == '__main__':
  main()
