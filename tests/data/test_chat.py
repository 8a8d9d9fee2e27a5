"""Chat data: our rendering of chat templates against transformers' (text
and ids, from tests/fixtures/chat, written by scripts/make_chat_fixtures.py,
one template a model family the library loads), the loss mask against
transformers' assistant mask of each template's `{% generation %}`-marked
copy and against cases checked by hand, the generation prompt against the
training ids before each reply, the rows the train step reads, and bad
input named in one line (file and line) before any work."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import shutil

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
from tokenizers import Tokenizer

from linen_moe import data
from linen_moe._src.data import chat as chat_data
from linen_moe._src.data import chat_rows
from linen_moe._src.data import chat_spans
from linen_moe._src.hf import families
from linen_moe._src.testing import helpers

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "chat"
# The chat fixture of each model type the library loads (a template in the
# style of the family's released one).
FIXTURE_OF = {
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3",
    "deepseek_v3": "deepseek_v3",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
    "gpt_oss": "gpt_oss",
    "llama4": "llama4",
    "llama4_text": "llama4",
    "glm4_moe": "glm4_moe",
    "minimax_m2": "minimax_m2",
}
STYLES = (*sorted(set(FIXTURE_OF.values())), "qwen3_generation")
# Replies whose first token a mask can miss (every fixture has them).
FIRST_CHARACTERS = {
    "digit_first": "4",
    "space_first": " ",
    "punctuation_first": '"',
    "multibyte_first": "☕",
}


def _fixture(name: str):
  """(template, tokenizer, expected.json) of a fixture."""
  directory = FIXTURES / name
  with open(directory / "expected.json", encoding="utf-8") as f:
    expected = json.load(f)
  tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
  return data.load_chat_template(directory), tokenizer, expected


def _has_reply(case: dict) -> bool:
  return any(m["role"] == "assistant" for m in case["messages"])


def _masked_runs(tokenizer, text, mask) -> list[str]:
  """The text each run of masked tokens covers in `text`."""
  offsets = tokenizer.encode(text, add_special_tokens=False).offsets
  runs, start = [], None
  for t, masked in enumerate([*mask, False]):
    if masked and start is None:
      start = offsets[t][0]
    elif not masked and start is not None:
      runs.append(text[start : offsets[t - 1][1]])
      start = None
  return runs


def _write_jsonl(path: str, rows: list) -> str:
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
  return path


class RenderingTest(parameterized.TestCase):

  @parameterized.parameters(*STYLES)
  def test_text_and_ids_equal_transformers(self, name):
    template, tokenizer, expected = _fixture(name)
    self.assertEqual(dict(template.special_tokens), expected["special_tokens"])
    self.assertGreaterEqual(len(expected["cases"]), 12)
    for case in expected["cases"]:
      with self.subTest(
          case=case["name"], prompt=case["add_generation_prompt"]
      ):
        text = template.render(case["messages"], case["add_generation_prompt"])
        self.assertEqual(text, case["text"])
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        self.assertEqual(ids, case["ids"])

  def test_template_errors_are_transformers_errors(self):
    template, _, expected = _fixture("mixtral")
    self.assertLen(expected["errors"], 2)
    for case in expected["errors"]:
      with self.assertRaisesRegex(
          ValueError, "chat_template.jinja cannot render"
      ):
        template.render(case["messages"])
      try:
        template.render(case["messages"])
      except ValueError as e:
        self.assertTrue(str(e).endswith(case["error"]), str(e))

  def test_template_inside_tokenizer_config(self):
    # The Qwen3 fixture keeps its template in tokenizer_config.json, as the
    # released repositories do; the Mixtral one in chat_template.jinja.
    self.assertFalse((FIXTURES / "qwen3" / "chat_template.jinja").exists())
    template = data.load_chat_template(FIXTURES / "qwen3" / "tokenizer.json")
    self.assertTrue(template.where.endswith("tokenizer_config.json"))
    template = data.load_chat_template(FIXTURES / "mixtral")
    self.assertTrue(template.where.endswith("chat_template.jinja"))


class MaskTest(parameterized.TestCase):

  def test_every_family_has_a_fixture(self):
    self.assertEqual(set(FIXTURE_OF), set(families.FAMILIES))

  @parameterized.parameters(*STYLES)
  def test_equals_transformers_assistant_mask(self, name):
    # transformers' mask of the template's marked copy (its `{% generation
    # %}` around what the assistant writes after the generation prompt, up
    # to and with the end of its turn) is an independent reference; ours
    # reads the unmarked template.
    template, tokenizer, expected = _fixture(name)
    if name != "qwen3_generation":
      self.assertNotIn("generation %}", template.source)
    cases = [
        c
        for c in expected["cases"]
        if _has_reply(c) and not c["add_generation_prompt"]
    ]
    self.assertGreaterEqual(len(cases), 11)
    firsts = {c["name"]: c["messages"][-1]["content"][:1] for c in cases}
    for case_name, character in FIRST_CHARACTERS.items():
      self.assertEqual(firsts[case_name], character)
    for case in cases:
      with self.subTest(case=case["name"]):
        ids, mask = chat_data.encode_conversation(
            template, tokenizer, case["messages"]
        )
        self.assertEqual(ids.tolist(), case["ids"])
        self.assertEqual(mask.astype(int).tolist(), case["assistant_masks"])

  @parameterized.parameters(*STYLES)
  def test_generation_prompt_is_what_training_reads(self, name):
    # Before each reply, training reads the ids of transformers' rendering
    # up to the reply's first masked token (transformers' mask); the
    # generation prompt of the messages before it, tokenized, must be those
    # ids (for a reply whose reasoning the template writes, the template's
    # whole generation prompt: MiniMax-M2's <think> is then in the
    # training text).
    template, tokenizer, expected = _fixture(name)
    checked = 0
    for case in expected["cases"]:
      if case["add_generation_prompt"] or not _has_reply(case):
        continue
      mask = case["assistant_masks"]
      firsts = [
          t for t, m in enumerate(mask) if m and (t == 0 or not mask[t - 1])
      ]
      messages = case["messages"]
      replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
      self.assertLen(firsts, len(replies))
      for i, first in zip(replies, firsts, strict=True):
        with self.subTest(case=case["name"], reply=i):
          fields = set(messages[i]) & set(chat_spans.REASONING_FIELDS)
          if any(messages[i][f] in case["text"] for f in fields):
            prompt = template.render(messages[:i], add_generation_prompt=True)
          else:
            prompt = template.generation_prompt(messages[:i])
            self.assertEqual(
                template.generation_prompt_ids(messages[:i], tokenizer),
                case["ids"][:first],
            )
          ids = tokenizer.encode(prompt, add_special_tokens=False).ids
          self.assertEqual(ids, case["ids"][:first])
          checked += 1
    self.assertGreaterEqual(checked, 14)

  def test_generation_prompt_ends_where_training_text_parts(self):
    # Gemma 4 and MiniMax-M2 prompt a reply with text (an empty thought
    # channel, "<think>\n") that a reply without reasoning does not follow
    # in training; the prompt stops before it. Others: the whole prompt.
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    for name, cut in (
        ("gemma4", "<|channel>thought\n<channel|>"),
        ("minimax_m2", "<think>\n"),
        ("mixtral", ""),
        ("qwen3", ""),
        ("gpt_oss", ""),
    ):
      with self.subTest(name=name):
        template, _, _ = _fixture(name)
        whole = template.render(question, add_generation_prompt=True)
        self.assertTrue(whole.endswith(cut))
        self.assertEqual(
            template.generation_prompt(question), whole[: len(whole) - len(cut)]
        )

  def test_generation_prompt_ids_stop_before_a_token_the_reply_needs(self):
    # The assistant's header in training (w11) is not the generation
    # prompt (w12): the two part inside a word, after "w1". Training
    # learns the whole w11; the prompt's ids stop before it, where the
    # prompt's text ("... w1 w1") would not.
    from tokenizers import models as tok_models  # noqa: PLC0415
    from tokenizers import pre_tokenizers  # noqa: PLC0415

    tokenizer = Tokenizer(
        tok_models.WordLevel({f"w{i}": i for i in range(16)}, unk_token="w0")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    template = data.ChatTemplate(
        "{% for m in messages %}w11 {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}w12{% endif %}"
    )
    question = [{"role": "user", "content": "w1"}]
    reply = [*question, {"role": "assistant", "content": "w5"}]
    ids, mask = chat_data.encode_conversation(template, tokenizer, reply)
    self.assertEqual(ids.tolist(), [11, 1, 11, 5])
    self.assertEqual(mask.tolist(), [False, False, True, True])
    self.assertEqual(template.generation_prompt(question), "w11 w1 w1")
    self.assertEqual(
        template.generation_prompt_ids(question, tokenizer), [11, 1]
    )

  @parameterized.named_parameters(
      (
          "qwen3_multi_turn",
          "qwen3",
          "multi_turn",
          [
              "Seven is a prime number.<|im_end|>",
              "<think>\n\n</think>\n\nTwo is the only even prime.<|im_end|>",
          ],
      ),
      (
          "qwen3_system_prompt",
          "qwen3",
          "system_prompt",
          ["Hello!<|im_end|>", "<think>\n\n</think>\n\nHello again!<|im_end|>"],
      ),
      (  # the last turn's empty <think> block: the model writes it
          "qwen3_empty_reply",
          "qwen3",
          "empty_reply",
          ["<think>\n\n</think>\n\n<|im_end|>"],
      ),
      (  # the reasoning is the assistant's; earlier turns lose theirs
          "qwen3_reasoning",
          "qwen3",
          "reasoning",
          [
              "3 + 4 = 7.<|im_end|>",
              "<think>\nAdd again.\n</think>\n\n5 + 6 = 11.<|im_end|>",
          ],
      ),
      (
          "qwen3_reasoning_field",
          "qwen3",
          "reasoning_field",
          ["<think>\n8 times 2.\n</think>\n\n16.<|im_end|>"],
      ),
      (
          "qwen3_unicode",
          "qwen3",
          "unicode",
          ["<think>\n\n</think>\n\nIci: ☕ (¡olé!)<|im_end|>"],
      ),
      (  # "▁Seven": the reply's first token carries the template's space
          "mixtral_multi_turn",
          "mixtral",
          "multi_turn",
          [" Seven is a prime number.</s>", " Two is the only even prime.</s>"],
      ),
      (  # the system prompt is folded into the first user turn
          "mixtral_system_prompt",
          "mixtral",
          "system_prompt",
          [" Hello!</s>", " Hello again!</s>"],
      ),
      ("mixtral_digit_first", "mixtral", "digit_first", [" 4.</s>"]),
      ("mixtral_space_first", "mixtral", "space_first", ["  Hello!</s>"]),
      (  # the turn's header is the generation prompt's
          "deepseek_v3_digit_first",
          "deepseek_v3",
          "digit_first",
          ["4.<｜end▁of▁sentence｜>"],
      ),
      (  # the generation prompt's empty thought channel is not written
          "gemma4_digits_multi_turn",
          "gemma4",
          "digits_multi_turn",
          ["4.<turn|>", "7.<turn|>"],
      ),
      ("gemma4_space_first", "gemma4", "space_first", ["Hello!<turn|>"]),
      (  # the channel is the assistant's; the last turn ends in <|return|>
          "gpt_oss_digits_multi_turn",
          "gpt_oss",
          "digits_multi_turn",
          [
              "<|channel|>final<|message|>4.<|end|>",
              "<|channel|>final<|message|>7.<|return|>",
          ],
      ),
      (
          "gpt_oss_thinking",
          "gpt_oss",
          "thinking",
          [
              "<|channel|>analysis<|message|>8 times 2.<|end|><|start|>"
              "assistant<|channel|>final<|message|>16.<|return|>"
          ],
      ),
      ("llama4_space_first", "llama4", "space_first", ["Hello!<|eot|>"]),
      (  # no end token: the next turn's <|user|> ends a reply
          "glm4_moe_multi_turn",
          "glm4_moe",
          "multi_turn",
          [
              "\n<think></think>\nSeven is a prime number.<|user|>",
              "\n<think></think>\nTwo is the only even prime.",
          ],
      ),
      (  # the generation prompt's <think> is not written without reasoning
          "minimax_m2_digit_first",
          "minimax_m2",
          "digit_first",
          ["4.[e~["],
      ),
      (  # ... and is the prompt's with it
          "minimax_m2_reasoning_field",
          "minimax_m2",
          "reasoning_field",
          ["8 times 2.\n</think>\n\n16.[e~["],
      ),
  )
  def test_by_hand(self, name, case_name, replies):
    template, tokenizer, expected = _fixture(name)
    case = next(
        c
        for c in expected["cases"]
        if c["name"] == case_name and not c["add_generation_prompt"]
    )
    ids, mask = chat_data.encode_conversation(
        template, tokenizer, case["messages"]
    )
    self.assertEqual(ids.tolist(), case["ids"])
    self.assertEqual(_masked_runs(tokenizer, case["text"], mask), replies)
    # Everything else (system, user, headers) is not learned.
    unmasked = tokenizer.decode(
        [int(i) for i, m in zip(ids, mask, strict=True) if not m],
        skip_special_tokens=False,
    )
    for message in case["messages"]:
      if message["role"] != "assistant" and message["content"]:
        self.assertIn(message["content"].split()[-1], unmasked)

  @parameterized.parameters(*STYLES)
  def test_one_rendering_finds_what_one_per_reply_finds(self, name):
    template, _, expected = _fixture(name)
    renders = []

    class Counting(data.ChatTemplate):

      def render(self, messages, add_generation_prompt=False):
        renders.append(1)
        return super().render(messages, add_generation_prompt)

    counting = Counting(template.source, template.special_tokens)
    for case in expected["cases"]:
      if not _has_reply(case) or case["add_generation_prompt"]:
        continue
      with self.subTest(case=case["name"]):
        renders.clear()
        text, spans = chat_spans.content_spans(counting, case["messages"])
        reasoning = any(
            set(m) & set(chat_spans.REASONING_FIELDS) for m in case["messages"]
        )
        if "<think>" not in text and not reasoning:  # by what they hold
          self.assertLen(renders, 2)  # the conversation, then all replies
        self.assertEqual(
            spans,
            chat_spans.spans_one_by_one(template, case["messages"], text),
        )

  def test_qwen3_multi_turn_positions(self):
    # Token by token: ChatML turns are <|im_start|> role \n content
    # <|im_end|> \n; the mask is True on the reply's tokens and its
    # <|im_end|>, nowhere else.
    template, tokenizer, _ = _fixture("qwen3")
    messages = [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Say it again."},
        {"role": "assistant", "content": "Hello again!"},
    ]
    ids, mask = chat_data.encode_conversation(template, tokenizer, messages)
    end = tokenizer.token_to_id("<|im_end|>")
    start = tokenizer.token_to_id("<|im_start|>")
    ends = np.flatnonzero(ids == end).tolist()
    starts = np.flatnonzero(ids == start).tolist()
    self.assertLen(ends, 4)
    self.assertLen(starts, 4)
    want = np.zeros(len(ids), bool)
    # Reply k: after "<|im_start|>assistant\n" (3 tokens) up to and with
    # its <|im_end|>.
    header = len(
        tokenizer.encode(
            "<|im_start|>assistant\n", add_special_tokens=False
        ).ids
    )
    think = len(
        tokenizer.encode(
            "<think>\n\n</think>\n\n", add_special_tokens=False
        ).ids
    )
    want[starts[1] + header : ends[1] + 1] = True
    want[starts[3] + header : ends[3] + 1] = True
    # The last reply's empty <think> block is the assistant's to write.
    self.assertEqual(
        ids[starts[3] + header : starts[3] + header + think].tolist(),
        tokenizer.encode(
            "<think>\n\n</think>\n\n", add_special_tokens=False
        ).ids,
    )
    np.testing.assert_array_equal(mask, want)

  def test_loss_mask_of_offsets(self):
    # Tokens [0, 2) [2, 5) [5, 5) [5, 9) [9, 10); spans [2, 6) and [10, 10).
    offsets = np.array([[0, 2], [2, 5], [5, 5], [5, 9], [9, 10]])
    mask = chat_data.loss_mask_of(offsets, [(2, 6), (10, 10)])
    np.testing.assert_array_equal(mask, [0, 1, 1, 1, 1])
    mask = chat_data.loss_mask_of(offsets, [(0, 2)])
    np.testing.assert_array_equal(mask, [1, 1, 0, 0, 0])


def _step_weights(mask: np.ndarray) -> np.ndarray:
  """What the train step counts: target t + 1 where mask[t] and mask[t + 1]
  (`linen_moe.training.loss_weights`, without its scaling)."""
  return mask[..., :-1] & mask[..., 1:]


class RowsTest(absltest.TestCase):

  def test_step_mask_counts_exactly_the_learned_targets(self):
    # Every loss mask of 12 positions without a lone unlearned position
    # between two learned ones.
    for bits in itertools.product((False, True), repeat=12):
      a = np.array(bits)
      if np.any(a[:-2] & ~a[1:-1] & a[2:]):
        continue
      np.testing.assert_array_equal(
          _step_weights(chat_rows.chat_step_mask(a)), a[1:], err_msg=str(a)
      )

  def _chat(self, packing="pad", seq_len=16):
    tmp = helpers.tempdir(self)
    rows = []
    for i in range(12):
      messages = [{"role": "user", "content": f"Question {i}?"}]
      messages.append({"role": "assistant", "content": "Answer " * (i % 4 + 1)})
      rows.append({"messages": messages})
    path = _write_jsonl(os.path.join(tmp, "chats.jsonl"), rows)
    chat = data.read_chat(path, str(FIXTURES / "qwen3" / "tokenizer.json"))
    pipeline = data.ChatPipeline(
        chat, seq_len=seq_len, batch_size=2, packing=packing, eval_fraction=0.2
    )
    return chat, pipeline

  def test_read_chat_documents(self):
    chat, _ = self._chat()
    template, tokenizer, _ = _fixture("qwen3")
    self.assertLen(chat, 12)
    self.assertTrue(chat.origins[3].endswith("chats.jsonl:4"))
    self.assertEqual(chat.corpus.format, "chat")
    self.assertEqual(chat.corpus.eod_id, tokenizer.token_to_id("<|im_end|>"))
    for i, (ids, mask) in enumerate(chat.documents()):
      messages = [
          {"role": "user", "content": f"Question {i}?"},
          {"role": "assistant", "content": "Answer " * (i % 4 + 1)},
      ]
      want_ids, want_mask = chat_data.encode_conversation(
          template, tokenizer, messages
      )
      np.testing.assert_array_equal(ids, want_ids)
      np.testing.assert_array_equal(mask, want_mask)

  def test_rows_count_the_assistant_tokens(self):
    # pad: every conversation in one row of 64; pack: rows of 16 across them.
    for packing, seq_len in (("pad", 64), ("pack", 16)):
      chat, pipeline = self._chat(packing, seq_len)
      learned = 0
      for rows in (pipeline.train, pipeline.eval):
        for i in range(len(rows)):
          item = rows[i]
          start = int(rows.windows.starts[i])
          length = int(rows.windows.lengths[i])
          want = np.zeros(seq_len - 1, bool)  # the row's targets 1..S-1
          want[: length - 1] = chat.loss_mask[start + 1 : start + length]
          np.testing.assert_array_equal(_step_weights(item["mask"]), want)
          np.testing.assert_array_equal(
              item["tokens"][:length], chat.corpus.read(start, start + length)
          )
          learned += int(want.sum())
      if packing == "pad":  # all but each conversation's first token
        firsts = chat.loss_mask[chat.corpus.documents[:, 0]].sum()
        self.assertEqual(learned, int(chat.loss_mask.sum() - firsts))
    batch = next(pipeline.train_iterator())
    self.assertEqual(batch["tokens"].shape, (2, 16))
    loss_tokens = pipeline.describe()["corpus"]["loss_tokens"]
    self.assertEqual(loss_tokens, int(chat.loss_mask.sum()))

  def test_first_fit_rows_count_the_assistant_tokens(self):
    # Whole conversations as segments of rows of 128: the targets counted
    # (mask at t and t + 1, one segment) are the assistant's tokens but
    # each conversation's first, never one across two conversations.
    chat, pipeline = self._chat("first_fit", 128)
    learned, packed = 0, 0
    for rows in (pipeline.train, pipeline.eval):
      for i in range(len(rows)):
        item, pieces = rows[i], rows.windows.pieces(i)
        packed += len(pieces) > 1
        seg = item["segment_ids"]
        counted = item["mask"][:-1] & item["mask"][1:] & (seg[:-1] == seg[1:])
        want, at = np.zeros(127, bool), 0
        for start, length in pieces:
          want[at : at + length - 1] = chat.loss_mask[
              start + 1 : start + length
          ]
          at += length
        np.testing.assert_array_equal(counted, want)
        learned += int(want.sum())
    self.assertGreater(packed, 0)
    firsts = chat.loss_mask[chat.corpus.documents[:, 0]].sum()
    self.assertEqual(learned, int(chat.loss_mask.sum() - firsts))

  def test_rows_refuse_what_the_mask_cannot_say(self):
    chat, _ = self._chat()
    mask = chat.loss_mask.copy()
    at = int(np.flatnonzero(mask)[0])
    mask[at + 1], mask[at + 2] = False, True  # learned, not, learned
    bad = data.ChatCorpus(chat.corpus, mask, chat.origins, chat.template)
    with self.assertRaisesRegex(ValueError, r"chats.jsonl:1: token \d+, which"):
      data.ChatPipeline(bad, seq_len=16, batch_size=2)
    with self.assertRaisesRegex(ValueError, "packing='first' is invalid"):
      data.ChatPipeline(chat, seq_len=16, batch_size=2, packing="first")


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("missing_role", {"messages": [{"content": "Hi"}]}, r':1: message 0 has no "role"'),
      (
          "unknown_role",
          {"messages": [{"role": "robot", "content": "Hi"}]},
          ":1: message 0 has the unknown role 'robot'; expected one of",
      ),
      (
          "no_content",
          {"messages": [{"role": "user", "content": None}]},
          r':1: message 0 \(user\) has no string "content"',
      ),
      ("no_messages", {"turns": []}, ':1: expected an object with a non-empty "messages"'),
      ("not_json", "{not json", ":1: is not a JSON object"),
      (
          "no_reply",
          {"messages": [{"role": "user", "content": "Hi"}]},
          ":1: the conversation has no assistant message",
      ),
  )  # fmt: skip
  def test_file_and_line(self, row, message):
    tmp = helpers.tempdir(self)
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}  # fmt: skip
    path = _write_jsonl(os.path.join(tmp, "c.jsonl"), [row, good])
    with self.assertRaisesRegex(ValueError, "c.jsonl" + message):
      chat_data.read_conversations(path)
    # The second line too: the line number is the file's.
    path = _write_jsonl(os.path.join(tmp, "d.jsonl"), [good, "", row])
    with self.assertRaisesRegex(
        ValueError, "d.jsonl" + message.replace(":1:", ":3:")
    ):
      chat_data.read_conversations(path)

  def test_template_refusal_names_the_line(self):
    tmp = helpers.tempdir(self)
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    ]  # fmt: skip
    path = _write_jsonl(os.path.join(tmp, "c.jsonl"), rows)
    with self.assertRaisesRegex(
        ValueError, "c.jsonl:2: .*chat_template.jinja cannot render the conv.*roles must alternate"
    ):  # fmt: skip
      data.read_chat(path, str(FIXTURES / "mixtral" / "tokenizer.json"))

  def test_tokenizer_without_chat_template(self):
    tmp = helpers.tempdir(self)
    for name in ("tokenizer.json", "tokenizer_config.json"):
      shutil.copy(FIXTURES / "mixtral" / name, os.path.join(tmp, name))
    with self.assertRaisesRegex(
        ValueError, "tokenizer_config.json: has no chat_template"
    ):
      data.load_chat_template(tmp)
    os.remove(os.path.join(tmp, "tokenizer_config.json"))
    with self.assertRaisesRegex(ValueError, "has no tokenizer_config.json"):
      data.read_chat(tmp, os.path.join(tmp, "tokenizer.json"))


if __name__ == "__main__":
  absltest.main()
