"""`linen-moe train --data-format chat`: conversations in JSONL through the
tokenizer's chat template, batches whose loss counts the assistant's
tokens only, bad input named in one line (file and line) before any
step, and a fine-tune whose `generate --chat` answers what it was taught.
Rendering and masks against transformers: test_chat.py."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

from absl.testing import absltest
import jax
import numpy as np

from linen_moe import data
from linen_moe import frontend
from linen_moe import load_model_config
from linen_moe import testing
from linen_moe._src.data import chat as chat_data
from linen_moe._src.run import sources as train_data
from linen_moe._src.testing import helpers
from linen_moe._src.testing.marks import heavy
from linen_moe.training import RunOptions
from linen_moe_cli import main as cli

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "chat"
# 200 tokens: it fits the tiny configs' vocabulary of 256.
TOKENIZER = str(FIXTURES / "mixtral" / "tokenizer.json")
QUESTIONS = ("What is 2 + 2?", "Name a prime number.", "Say hello.")
ANSWERS = ("2 + 2 = 4.", "Seven is a prime number.", "Hello!")


def _conversation(i: int) -> dict:
  messages = []
  if i % 3 == 0:
    messages.append({"role": "system", "content": "Answer briefly."})
  for t in range(1 + i % 2):
    k = (i + t) % 3
    messages.append({"role": "user", "content": QUESTIONS[k]})
    messages.append({"role": "assistant", "content": ANSWERS[k]})
  return {"messages": messages}


class _Chats(helpers.TempDirMixin, absltest.TestCase):
  """A chat file of 40 conversations, shared by the class."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp()
    cls.chats = os.path.join(cls.tmp, "chats.jsonl")
    with open(cls.chats, "w", encoding="utf-8") as f:
      for i in range(40):
        f.write(json.dumps(_conversation(i)) + "\n")

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.tmp, ignore_errors=True)
    super().tearDownClass()

  def argv(self, *extra: str) -> list[str]:
    return [
        "train",
        "--set",
        "num_layers=1",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--data",
        self.chats,
        "--data-format",
        "chat",
        "--tokenizer",
        TOKENIZER,
        "--no-progress",
        *extra,
    ]


class BatchesTest(_Chats):

  def test_the_loss_counts_the_replies(self):
    opts = RunOptions(
        data=self.chats,
        data_format="chat",
        tokenizer=TOKENIZER,
        batch_size=4,
        seq_len=128,  # a conversation a row
    )
    self.assertEqual(opts.packing, "pad")  # chat data is padded by default
    cfg = load_model_config(opts.model_name)
    source = train_data.CorpusSource(cfg, opts, None)
    tokens, mask, *_ = next(source.batches(0))  # and segment ids, positions
    self.assertIsNotNone(mask)
    weights = np.asarray(frontend.loss_weights(mask)) > 0  # [B, S - 1]
    # The targets counted, decoded row by row: the replies and their </s>.
    from tokenizers import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_file(TOKENIZER)
    tokens = np.asarray(jax.device_get(tokens))
    for row, counted in zip(tokens, weights, strict=True):
      text = tok.decode(row[1:][counted].tolist(), skip_special_tokens=False)
      self.assertTrue(text, row)
      for piece in text.split("</s>")[:-1]:
        self.assertIn(piece.strip(), ANSWERS)
      self.assertTrue(text.endswith("</s>"), text)
      for question in QUESTIONS:
        self.assertNotIn(question, text)
    self.assertEqual(source.meta["pipeline"]["corpus"]["format"], "chat")


class BadInputTest(_Chats):
  """Each bad input is one line naming the file (and line), exit status 2,
  before any step (no metrics row, no checkpoint)."""

  def test_bad_input_before_any_step(self):
    tmp = self.tempdir()
    lines = [json.dumps(_conversation(i)) for i in range(3)]

    def chat_file(name: str, bad_line: dict) -> str:
      path = os.path.join(tmp, name)
      with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join([*lines[:2], json.dumps(bad_line), lines[2]]))
      return path

    no_role = chat_file("no_role.jsonl", {"messages": [{"content": "Hi"}]})
    robot = chat_file(
        "robot.jsonl", {"messages": [{"role": "robot", "content": "Hi"}]}
    )
    plain = os.path.join(tmp, "plain")  # a tokenizer without a template
    os.makedirs(plain)
    shutil.copy(TOKENIZER, os.path.join(plain, "tokenizer.json"))
    with open(os.path.join(plain, "tokenizer_config.json"), "w") as f:
      json.dump({"eos_token": "</s>"}, f)
    alone = os.path.join(tmp, "alone")  # no tokenizer_config.json at all
    os.makedirs(alone)
    shutil.copy(TOKENIZER, os.path.join(alone, "tokenizer.json"))
    cases = [
        (["--data", no_role], r'no_role.jsonl:3: message 0 has no "role"'),
        (["--data", robot], "robot.jsonl:3: message 0 has the unknown role"),
        (
            ["--tokenizer", os.path.join(plain, "tokenizer.json")],
            "plain/tokenizer_config.json: has no chat_template",
        ),
        (
            ["--tokenizer", os.path.join(alone, "tokenizer.json")],
            "alone: has no tokenizer_config.json",
        ),
    ]
    for extra, message in cases:
      with self.subTest(message=message):
        directory = os.path.join(tmp, "run")
        code, out, err = testing.run_capturing(
            cli.main,
            [
                *self.argv("--steps", "2", "--checkpoint-dir", directory),
                *extra,
            ],
        )
        self.assertEqual(code, 2, out + err)
        self.assertRegex(err, f"^linen-moe: error: .*{message}")
        self.assertEqual(err.count("\n"), 1, err)
        self.assertFalse(os.path.exists(os.path.join(directory, "1")))
        self.assertFalse(
            os.path.exists(os.path.join(directory, "metrics.jsonl"))
        )

  def test_chat_needs_a_tokenizer(self):
    code, _, err = testing.run_capturing(
        cli.main,
        ["train", "--data", self.chats, "--data-format", "chat"],
    )
    self.assertEqual(code, 2)
    self.assertRegex(err, "data_format='chat' .* needs a tokenizer with a chat")


@testing.slow
class TrainTest(_Chats):

  def test_held_out_loss_falls(self):
    directory = self.tempdir()
    code, out, err = testing.run_capturing(
        cli.main,
        self.argv(
            "--steps",
            "24",
            "--learning-rate",
            "3e-3",
            "--lr-schedule",
            "cosine",
            "--warmup-steps",
            "4",
            "--eval-every",
            "8",
            "--eval-batches",
            "1",
            "--checkpoint-dir",
            directory,
        ),
    )
    self.assertEqual(code, 0, err)
    rows = helpers.read_jsonl(os.path.join(directory, "metrics.jsonl"))
    held_out = [r["eval_loss"] for r in rows if "eval_loss" in r]
    self.assertLen(held_out, 3)
    self.assertLess(held_out[-1], held_out[0])
    self.assertIn("held-out loss", out)


# Five questions, each reply starting where a loss mask can miss its first
# token (Mixtral's template writes ' ' + reply after [/INST]; a digit is a
# token of its own, so " 4." is "▁", "4", "."): a letter, a digit, a
# space, punctuation, a multi-byte character.
QA = (
    ("What is the capital of France?", "Paris."),
    ("What is 2 + 2?", "4."),
    ("Greet me.", " Hello!"),
    ("What did she say?", '"Paris," she said.'),
    ("What is hot?", "☕ is hot."),
)


@heavy
class FineTuneAnswersTest(absltest.TestCase):
  """Issue 62: 200 conversations over five question/answer pairs, a tiny
  Mixtral trained on them for 30 steps, then `generate --chat` on each
  question from the run's checkpoint (its tokenizer and chat template):
  greedy decoding gives the trained reply, every id of it, and its end
  (about 40 s training and 25 s generating on 2 cores, most of it
  compiling)."""

  def test_generate_chat_answers_what_it_was_taught(self):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    chats = os.path.join(tmp, "chats.jsonl")
    with open(chats, "w", encoding="utf-8") as f:
      for i in range(200):
        question, answer = QA[i % len(QA)]
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
        f.write(json.dumps({"messages": messages}) + "\n")
    run = os.path.join(tmp, "run")
    code, out, err = testing.run_capturing(
        cli.main,
        [
            "train",
            "--config",
            "tiny_mixtral",
            "--set",
            "num_layers=1",
            "--data",
            chats,
            "--data-format",
            "chat",
            "--tokenizer",
            TOKENIZER,
            "--seq-len",
            "32",
            "--batch-size",
            "8",
            "--steps",
            "30",
            "--no-progress",
            "--checkpoint-dir",
            run,
        ],
    )
    self.assertEqual(code, 0, out + err)
    prompts = os.path.join(tmp, "prompts.txt")
    with open(prompts, "w", encoding="utf-8") as f:
      f.write("".join(question + "\n" for question, _ in QA))
    results = os.path.join(tmp, "answers.jsonl")
    code, out, err = testing.run_capturing(
        cli.main,
        [
            "generate",
            "--checkpoint-dir",
            run,
            "--chat",
            "--prompts-file",
            prompts,
            "--new-tokens",
            "12",
            "--output",
            results,
        ],
    )
    self.assertEqual(code, 0, out + err)
    from tokenizers import Tokenizer  # noqa: PLC0415

    template = data.load_chat_template(run)
    tok = Tokenizer.from_file(os.path.join(run, "tokenizer.json"))
    answers = helpers.read_jsonl(results)
    self.assertLen(answers, len(QA))
    for (question, answer), result in zip(QA, answers, strict=True):
      with self.subTest(question=question):
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
        ids, mask = chat_data.encode_conversation(template, tok, messages)
        # The reply is the learned tokens, "</s>" last; the prompt, the
        # training text before the first of them.
        self.assertEqual(result["text"], answer)
        self.assertEqual(result["new_ids"], ids[mask].tolist())
        self.assertEqual(result["finish_reason"], "stop")
        first = int(np.argmax(mask))
        self.assertEqual(result["prompt_ids"], ids[:first].tolist())


if __name__ == "__main__":
  absltest.main()
