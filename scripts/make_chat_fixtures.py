"""Writes tiny tokenizers with chat templates, and transformers' renderings
and assistant masks.

`linen_moe.data` renders chat templates itself (jinja2, as transformers
does) and finds what the assistant wrote without `{% generation %}`
markers; the tests compare its text, ids and loss masks to what
transformers gives for the same files. CI has no transformers, so this
script, run by hand in a reference venv (transformers, tokenizers and
jinja2 are all it needs; see below), writes both sides once and the
fixtures are committed:

  tests/fixtures/chat/<name>/
    tokenizer.json         a small BPE trained here on TEXT and the cases
                           (deterministic)
    tokenizer_config.json  its special tokens (and, for "qwen3", the chat
                           template, as the released Qwen3 repositories
                           store it)
    chat_template.jinja    the template where transformers 5's
                           `save_pretrained` puts it (the others)
    expected.json          for each case: the messages,
                           add_generation_prompt, transformers'
                           `apply_chat_template(..., tokenize=False)` text,
                           its ids (tokenize=True) and its
                           `assistant_masks` (return_assistant_tokens_mask)
                           of the template with `{% generation %}` markers
                           ("marked_template", which renders the same
                           text); the errors the template raises for ERRORS.

One fixture a model family the library loads (linen_moe/_src/hf/families.py),
each template written here in the style of that family's released one
(the hub is not reachable from here): "mixtral", "qwen3" (Qwen3-MoE),
"deepseek_v3", "gemma4", "gpt_oss", "llama4", "glm4_moe", "minimax_m2";
and "qwen3_generation", ChatML with `{% generation %}` markers of its own.
The markers of a family's marked copy enclose what the assistant writes
after the generation prompt (the rendering of the messages before it with
add_generation_prompt=True, as far as the conversation holds it), up to and
with the token that ends its turn: Mixtral's `' ' + content + eos_token`
after `[/INST]`, Qwen3's `<think>` block of the last turn, GPT-OSS's
`<|channel|>final<|message|>` and its `<|return|>`, GLM-4.5's
`\\n<think></think>\\n` and the `<|user|>` that ends its turn (its template
writes no end token: the next turn's opens it); Gemma 4's and MiniMax-M2's
generation prompts write what a reply without reasoning does not (an empty
thought channel, `<think>\\n`): their markers start after the text the
two share.

Run from the repository root:

  python3.11 -m venv /work/wt/refvenv
  /work/wt/refvenv/bin/pip install torch==2.13.0 transformers jinja2 tokenizers
  /work/wt/refvenv/bin/python scripts/make_chat_fixtures.py
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
# The `{% generation %}` tags of a marked template (removed: the family's).
MARKERS = re.compile(r'^ *\{%-?\s*(?:end)?generation\s*-?%\}\n', re.M)

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
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
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
        {%- generation %}
        {{- ' ' + message['content'] + eos_token }}
        {%- endgeneration %}
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

DEEPSEEK_V3_TEMPLATE = """\
{%- set ns = namespace(system_prompt='') %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- set ns.system_prompt = ns.system_prompt + message['content'] %}
    {%- endif %}
{%- endfor %}
{{- bos_token + ns.system_prompt }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '<｜User｜>' + message['content'] }}
    {%- elif message['role'] == 'assistant' %}
        {%- set content = message['content'] %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<｜Assistant｜>' }}
        {%- generation %}
        {{- content + '<｜end▁of▁sentence｜>' }}
        {%- endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<｜Assistant｜>' }}
{%- endif %}
"""

# Gemma 4: turns `<|turn>role ... <turn|>`, the assistant's role "model";
# with thinking off (the default) the generation prompt opens and closes an
# empty thought channel that a reply without reasoning does not hold.
GEMMA4_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<|turn>' + role + '\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}
        {{- message['content'] | trim + '<turn|>' }}
        {%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<turn|>' }}
    {%- endif %}
    {{- '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|turn>model\\n' }}
    {%- if not enable_thinking | default(false) %}
        {{- '<|channel>thought\\n<channel|>' }}
    {%- endif %}
{%- endif %}
"""

# GPT-OSS (harmony): the last assistant message of a conversation ends in
# <|return|> and keeps its reasoning (analysis channel); earlier ones end
# in <|end|>; the generation prompt is `<|start|>assistant`.
GPT_OSS_TEMPLATE = """\
{{- '<|start|>system<|message|>You are a helpful assistant.\\nReasoning: medium\\n\\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' }}
{%- if messages[0].role == 'system' %}
    {{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0].content + '<|end|>' }}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == 'user' %}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|start|>assistant' }}
        {%- generation %}
        {%- if loop.last and not add_generation_prompt %}
            {%- if message.thinking is defined %}
                {{- '<|channel|>analysis<|message|>' + message.thinking + '<|end|><|start|>assistant' }}
            {%- endif %}
            {{- '<|channel|>final<|message|>' + message.content + '<|return|>' }}
        {%- else %}
            {{- '<|channel|>final<|message|>' + message.content + '<|end|>' }}
        {%- endif %}
        {%- endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant' }}
{%- endif %}
"""

LLAMA4_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {{- '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}
        {{- message['content'] | trim + '<|eot|>' }}
        {%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<|eot|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|header_start|>assistant<|header_end|>\\n\\n' }}
{%- endif %}
"""

# GLM-4.5: no end-of-turn token; a turn ends where the next opens
# (`<|user|>`, which generation stops at). The assistant's `<think>` block
# keeps its reasoning after the last user message only.
GLM4_MOE_TEMPLATE = """\
{{- '[gMASK]<sop>' }}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {{- '<|system|>\\n' + message.content }}
    {%- elif message.role == 'user' %}
        {{- '<|user|>\\n' + message.content }}
    {%- elif message.role == 'assistant' %}
        {{- '<|assistant|>' }}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if reasoning and loop.index0 > ns.last_user %}
            {{- '\\n<think>' + reasoning.strip() + '</think>' }}
        {%- else %}
            {{- '\\n<think></think>' }}
        {%- endif %}
        {%- if message.content.strip() %}
            {{- '\\n' + message.content.strip() }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>' }}
{%- endif %}
"""

# The same text, marked: the `<|user|>` that opens the turn after a reply
# is written with the reply, inside its markers.
GLM4_MOE_MARKED = """\
{{- '[gMASK]<sop>' }}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {{- '<|system|>\\n' + message.content }}
    {%- elif message.role == 'user' %}
        {%- if loop.previtem is not defined or loop.previtem.role != 'assistant' %}
            {{- '<|user|>' }}
        {%- endif %}
        {{- '\\n' + message.content }}
    {%- elif message.role == 'assistant' %}
        {{- '<|assistant|>' }}
        {%- generation %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if reasoning and loop.index0 > ns.last_user %}
            {{- '\\n<think>' + reasoning.strip() + '</think>' }}
        {%- else %}
            {{- '\\n<think></think>' }}
        {%- endif %}
        {%- if message.content.strip() %}
            {{- '\\n' + message.content.strip() }}
        {%- endif %}
        {%- if loop.nextitem is defined and loop.nextitem.role == 'user' %}
            {{- '<|user|>' }}
        {%- endif %}
        {%- endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>' }}
{%- endif %}
"""

# MiniMax-M2: `]~b]role\n ... [e~[\n`; the generation prompt opens a
# `<think>` block, which a reply keeps only with its reasoning after the
# last user message.
MINIMAX_M2_TEMPLATE = """\
{{- bos_token }}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {{- ']~b]system\\n' + message.content + '[e~[\\n' }}
    {%- elif message.role == 'user' %}
        {{- ']~b]user\\n' + message.content + '[e~[\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- ']~b]ai\\n' }}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if reasoning and loop.index0 > ns.last_user %}
            {{- '<think>\\n' }}
            {%- generation %}
            {{- reasoning + '\\n</think>\\n\\n' + message.content + '[e~[' }}
            {%- endgeneration %}
        {%- else %}
            {%- generation %}
            {{- message.content + '[e~[' }}
            {%- endgeneration %}
        {%- endif %}
        {{- '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- ']~b]ai\\n<think>\\n' }}
{%- endif %}
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
    # Replies that start with a digit, a space, punctuation, a multi-byte
    # character: the first token of each is the one a mask can miss.
    'digit_first': [_m('user', 'What is 2 + 2?'), _m('assistant', '4.')],
    'space_first': [_m('user', 'Greet me.'), _m('assistant', ' Hello!')],
    'punctuation_first': [
        _m('user', 'What did she say?'),
        _m('assistant', '"Paris," she said.'),
    ],
    'multibyte_first': [
        _m('user', 'What is hot?'),
        _m('assistant', '☕ is hot.'),
    ],
    'capital': [
        _m('user', 'What is the capital of France?'),
        _m('assistant', 'Paris.'),
    ],
    'digits_multi_turn': [
        SYSTEM,
        _m('user', 'What is 2 + 2?'),
        _m('assistant', '4.'),
        _m('user', 'And 3 + 4?'),
        _m('assistant', '7.'),
    ],
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
# Reasoning in a field, for the families whose templates read one: kept
# after the last user message, dropped before it.
REASONING_CASES = {
    'reasoning_field': [
        _m('user', 'Double 8.'),
        _m('assistant', '16.', reasoning_content='8 times 2.'),
    ],
    'reasoning_multi_turn': [
        _m('user', 'Double 8.'),
        _m('assistant', '16.', reasoning_content='8 times 2.'),
        _m('user', 'And 9?'),
        _m('assistant', '18.', reasoning_content='9 times 2.'),
    ],
}
GPT_OSS_CASES = {
    'thinking': [
        _m('user', 'Double 8.'),
        _m('assistant', '16.', thinking='8 times 2.'),
    ],
    'thinking_multi_turn': [
        _m('user', 'Double 8.'),
        _m('assistant', '16.', thinking='8 times 2.'),
        _m('user', 'And 9?'),
        _m('assistant', '18.', thinking='9 times 2.'),
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
# The text of the Mixtral template's turns, so that its tokenizer reads
# them (as Mixtral's own does: `[`, `INST`, `]`).
MIXTRAL_TEXT = ['[INST] [/INST] [INST] [/INST]']


def _corpus(extra=()) -> list[str]:
  out = [*TEXT, *extra]
  for group in (CASES, QWEN3_CASES, REASONING_CASES, GPT_OSS_CASES):
    for conversation in group.values():
      out.extend(m['content'] for m in conversation)
  return out


def byte_level_tokenizer(
    special: list[str], vocab_size: int = 360
) -> tokenizers.Tokenizer:
  """Byte-level BPE (as Qwen3's, DeepSeek-V3's, GPT-OSS's, Llama 4's,
  GLM-4.5's and MiniMax-M2's), with `special` as its added tokens."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=special,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  tok.train_from_iterator(_corpus(), trainer)
  return tok


def metaspace_tokenizer(
    special: list[str], prepend: str, vocab_size: int, extra=()
) -> tokenizers.Tokenizer:
  """Metaspace BPE with single digits (as SentencePiece's, Mixtral's and
  Gemma's: " 4" is `▁` and `4`)."""
  tok = tokenizers.Tokenizer(models.BPE(unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Metaspace(prepend_scheme=prepend),
      pre_tokenizers.Digits(individual_digits=True),
  ])
  tok.decoder = decoders.Metaspace(prepend_scheme=prepend)
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=special,
      limit_alphabet=120,
      show_progress=False,
  )
  tok.train_from_iterator(_corpus(extra), trainer)
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


def _render(tok, messages, prompt, template=None) -> tuple[str, dict]:
  kwargs = {'add_generation_prompt': prompt, 'chat_template': template}
  text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
  out = tok.apply_chat_template(
      messages,
      tokenize=True,
      return_dict=True,
      return_assistant_tokens_mask=template is not None,
      **kwargs,
  )
  return text, out


def _expected(directory: str, marked: str, cases: dict, errors: dict) -> dict:
  tok = transformers.AutoTokenizer.from_pretrained(directory)
  unk = tok.unk_token_id
  rendered = []
  for name, messages in cases.items():
    for prompt in (False, True):
      text, out = _render(tok, messages, prompt)
      marked_text, marked_out = _render(tok, messages, prompt, marked)
      if marked_text != text or marked_out['input_ids'] != out['input_ids']:
        raise AssertionError(f'{directory}: {name}: the marked copy differs')
      if unk is not None and unk in out['input_ids']:
        raise AssertionError(f'{directory}: {name}: {text!r} has <unk>')
      rendered.append({
          'name': name,
          'add_generation_prompt': prompt,
          'messages': messages,
          'text': text,
          'ids': list(out['input_ids']),
          'assistant_masks': list(marked_out['assistant_masks']),
      })
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
      'marked_template': marked,
      'cases': rendered,
      'errors': failures,
  }


def _family(name, tok, marked, cases, errors=None, real=None, **special):
  """(directory, marked template, cases, errors) of one fixture, saved
  with `real` (default: `marked` without its markers)."""
  real = MARKERS.sub('', marked) if real is None else real
  directory = _save(name, tok, real, name == 'qwen3', **special)
  return directory, marked, cases, errors or {}


def main() -> None:
  FIXTURES.mkdir(parents=True, exist_ok=True)
  qwen = byte_level_tokenizer(['<|endoftext|>', '<|im_start|>', '<|im_end|>'])
  chatml = {'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>'}
  think = ['<think>', '</think>']
  fixtures = {
      'qwen3': _family(
          'qwen3', qwen, QWEN3_TEMPLATE, {**CASES, **QWEN3_CASES}, **chatml
      ),
      'mixtral': _family(
          'mixtral',
          metaspace_tokenizer(
              ['<unk>', '<s>', '</s>'], 'first', 200, MIXTRAL_TEXT
          ),
          MIXTRAL_TEMPLATE,
          CASES,
          ERRORS,
          bos_token='<s>',
          eos_token='</s>',
          unk_token='<unk>',
      ),
      'qwen3_generation': _family(
          'qwen3_generation',
          qwen,
          QWEN3_GENERATION_TEMPLATE,
          {**CASES, 'tool_result': QWEN3_CASES['tool_result']},
          real=QWEN3_GENERATION_TEMPLATE,
          **chatml,
      ),
      'deepseek_v3': _family(
          'deepseek_v3',
          byte_level_tokenizer([
              '<｜begin▁of▁sentence｜>',
              '<｜end▁of▁sentence｜>',
              '<｜User｜>',
              '<｜Assistant｜>',
          ]),
          DEEPSEEK_V3_TEMPLATE,
          CASES,
          bos_token='<｜begin▁of▁sentence｜>',
          eos_token='<｜end▁of▁sentence｜>',
      ),
      'gemma4': _family(
          'gemma4',
          metaspace_tokenizer(
              [
                  '<pad>',
                  '<eos>',
                  '<bos>',
                  '<unk>',
                  '<|turn>',
                  '<turn|>',
                  '<|channel>',
                  '<channel|>',
              ],
              'never',
              240,
          ),
          GEMMA4_TEMPLATE,
          CASES,
          bos_token='<bos>',
          eos_token='<eos>',
          pad_token='<pad>',
          unk_token='<unk>',
      ),
      'gpt_oss': _family(
          'gpt_oss',
          byte_level_tokenizer([
              '<|startoftext|>',
              '<|endoftext|>',
              '<|start|>',
              '<|end|>',
              '<|message|>',
              '<|channel|>',
              '<|return|>',
          ]),
          GPT_OSS_TEMPLATE,
          {**CASES, **GPT_OSS_CASES},
          eos_token='<|return|>',
          pad_token='<|endoftext|>',
      ),
      'llama4': _family(
          'llama4',
          byte_level_tokenizer([
              '<|begin_of_text|>',
              '<|end_of_text|>',
              '<|header_start|>',
              '<|header_end|>',
              '<|eot|>',
          ]),
          LLAMA4_TEMPLATE,
          CASES,
          bos_token='<|begin_of_text|>',
          eos_token='<|eot|>',
      ),
      'glm4_moe': _family(
          'glm4_moe',
          byte_level_tokenizer([
              '<|endoftext|>',
              '[gMASK]',
              '<sop>',
              '<|system|>',
              '<|user|>',
              '<|assistant|>',
              '<|observation|>',
              *think,
          ]),
          GLM4_MOE_MARKED,
          {**CASES, **REASONING_CASES},
          real=GLM4_MOE_TEMPLATE,
          eos_token='<|endoftext|>',
          pad_token='<|endoftext|>',
      ),
      'minimax_m2': _family(
          'minimax_m2',
          byte_level_tokenizer([']~!b[', ']~b]', '[e~[', *think]),
          MINIMAX_M2_TEMPLATE,
          {**CASES, **REASONING_CASES},
          bos_token=']~!b[',
          eos_token='[e~[',
      ),
  }
  for name, (directory, marked, cases, errors) in fixtures.items():
    expected = _expected(directory, marked, cases, errors)
    path = pathlib.Path(directory) / 'expected.json'
    path.write_text(json.dumps(expected, indent=1, ensure_ascii=False) + '\n')
    print(
        f'{name}: {len(expected["cases"])} renderings, '
        f'{len(expected["errors"])} errors -> {path}'
    )


if __name__ == '__main__':
  main()
