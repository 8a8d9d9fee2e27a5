"""Chat data: our rendering of chat templates against transformers' (text
and ids, from tests/fixtures/chat, written by scripts/make_chat_fixtures.py),
the loss mask against transformers' `{% generation %}` mask and against
cases checked by hand, the rows the train step reads, and bad input named
in one line (file and line) before any work."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
from tokenizers import Tokenizer

from linen_moe import data
from linen_moe._src.data import chat as chat_data
from linen_moe._src.data import chat_rows
from linen_moe._src.data import chat_template

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "chat"
STYLES = ("qwen3", "mixtral", "qwen3_generation")


def _fixture(name: str):
  """(template, tokenizer, expected.json) of a fixture."""
  directory = FIXTURES / name
  with open(directory / "expected.json", encoding="utf-8") as f:
    expected = json.load(f)
  tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
  return data.load_chat_template(directory), tokenizer, expected


def _has_reply(case: dict) -> bool:
  return any(m["role"] == "assistant" for m in case["messages"])


def _masked_runs(tokenizer, ids, mask) -> list[str]:
  """The text of each run of masked tokens, special tokens kept."""
  runs = []
  for masked, group in itertools.groupby(
      zip(ids, mask, strict=True), lambda p: p[1]
  ):
    if masked:
      runs.append(
          tokenizer.decode(
              [int(i) for i, _ in group], skip_special_tokens=False
          )
      )
  return runs


def _tempdir(test: absltest.TestCase) -> str:
  directory = tempfile.mkdtemp()
  test.addCleanup(shutil.rmtree, directory, ignore_errors=True)
  return directory


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

  def test_equals_transformers_generation_mask(self):
    # The template marks each reply and its <|im_end|> with {% generation
    # %}; transformers' mask of it is an independent reference.
    template, tokenizer, expected = _fixture("qwen3_generation")
    cases = [
        c
        for c in expected["cases"]
        if _has_reply(c) and not c["add_generation_prompt"]
    ]
    self.assertGreaterEqual(len(cases), 5)
    for case in cases:
      with self.subTest(case=case["name"]):
        ids, mask = chat_data.encode_conversation(
            template, tokenizer, case["messages"]
        )
        self.assertEqual(ids.tolist(), case["ids"])
        self.assertEqual(mask.astype(int).tolist(), case["assistant_masks"])

  @parameterized.named_parameters(
      (
          "qwen3_multi_turn",
          "qwen3",
          "multi_turn",
          [
              "Seven is a prime number.<|im_end|>",
              "Two is the only even prime.<|im_end|>",
          ],
      ),
      (
          "qwen3_system_prompt",
          "qwen3",
          "system_prompt",
          ["Hello!<|im_end|>", "Hello again!<|im_end|>"],
      ),
      (  # the last turn's empty <think> block is the template's
          "qwen3_empty_reply",
          "qwen3",
          "empty_reply",
          ["<|im_end|>"],
      ),
      (  # the reasoning is the assistant's; earlier turns lose theirs
          "qwen3_reasoning",
          "qwen3",
          "reasoning",
          [
              "3 + 4 = 7.<|im_end|>",
              "Add again.\n</think>\n\n5 + 6 = 11.<|im_end|>",
          ],
      ),
      (
          "qwen3_reasoning_field",
          "qwen3",
          "reasoning_field",
          ["8 times 2.\n</think>\n\n16.<|im_end|>"],
      ),
      (
          "qwen3_unicode",
          "qwen3",
          "unicode",
          ["Ici: ☕ (¡olé!)<|im_end|>"],
      ),
      (  # "▁Seven": the reply's first token carries the template's space
          "mixtral_multi_turn",
          "mixtral",
          "multi_turn",
          ["Seven is a prime number.</s>", "Two is the only even prime.</s>"],
      ),
      (  # the system prompt is folded into the first user turn
          "mixtral_system_prompt",
          "mixtral",
          "system_prompt",
          ["Hello!</s>", "Hello again!</s>"],
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
    self.assertEqual(_masked_runs(tokenizer, ids, mask), replies)
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
        text, spans = chat_template.assistant_spans(counting, case["messages"])
        if "<think>" not in text:  # replies rendered by what they hold
          self.assertLen(renders, 2)  # the conversation, then all replies
        self.assertEqual(
            spans,
            chat_template.spans_one_by_one(template, case["messages"], text),
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
    # Reply k: after "<|im_start|>assistant\n" (3 tokens; the last turn
    # adds "<think>\n\n</think>\n\n") up to and with its <|im_end|>.
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
    want[starts[3] + header + think : ends[3] + 1] = True
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
    tmp = _tempdir(self)
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
    tmp = _tempdir(self)
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
    tmp = _tempdir(self)
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
    tmp = _tempdir(self)
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
