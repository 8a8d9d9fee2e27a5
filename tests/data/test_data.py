"""`linen_moe.data`: files to corpora, Hugging Face tokenizers as checkpoints
ship them (the configured end-of-document token, the tokenizer's own ids),
packing and padding against examples worked by hand, the masked loss
against a NumPy loop, seeded shuffling, each process's share, the iterator
state in a checkpoint on another process count, and bad input named in one
line before any work."""

from __future__ import annotations

import json
import os
import re
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
from etils import epath
import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import checkpoint
from linen_moe import data
from linen_moe import frontend
from linen_moe import load_model_config
from linen_moe import models
from linen_moe import testing
from linen_moe import training
from linen_moe._src.data import checkpointing
from linen_moe._src.data import packing as packing_lib
from linen_moe._src.data import tokenization
from linen_moe._src.testing import helpers

# A pre-tokenized stream of three documents, each ending with EOD = 0.
EOD = 0
STREAM = [5, 6, 7, 0, 8, 9, 0, 3, 4, 5, 6, 7, 0]


def _write(path: str, content: str | bytes) -> str:
  mode = "wb" if isinstance(content, bytes) else "w"
  with open(path, mode) as f:
    f.write(content)
  return path


class _Tokenizer:
  """A tokenizer (BPE, 256 tokens) trained once on the license texts."""

  path = None

  @classmethod
  def get(cls) -> str:
    if cls.path is None:
      directory = tempfile.mkdtemp()
      cls.path = os.path.join(directory, "tokenizer.json")
      data.train_bpe_tokenizer(testing.license_texts(), 256, cls.path)
    return cls.path


def _stream_corpus(test, stream=STREAM, dtype="uint16") -> data.Corpus:
  path = os.path.join(helpers.tempdir(test), "ids.bin")
  np.asarray(stream, dtype).tofile(path)
  return data.read_corpus(path, dtype=dtype, vocab_size=16, eod_id=EOD)


def _rows(sequences: packing_lib.Sequences) -> tuple[list, list]:
  items = [sequences[i] for i in range(len(sequences))]
  return (
      [x["tokens"].tolist() for x in items],
      [x["mask"].astype(int).tolist() for x in items],
  )


class PackingTest(absltest.TestCase):
  """The sequences of a 13-id stream of documents [5 6 7 0] [8 9 0]
  [3 4 5 6 7 0], worked by hand."""

  def test_documents_end_after_each_eod(self):
    corpus = _stream_corpus(self)
    self.assertEqual(corpus.documents.tolist(), [[0, 4], [4, 7], [7, 13]])
    self.assertEqual(corpus.read(2, 9).tolist(), [7, 0, 8, 9, 0, 3, 4])

  def test_pack_across_documents(self):
    tokens, masks = _rows(packing_lib.pack(_stream_corpus(self), 4))
    # 13 ids make 3 windows of 4; the last id is not used.
    self.assertEqual(tokens, [[5, 6, 7, 0], [8, 9, 0, 3], [4, 5, 6, 7]])
    self.assertEqual(masks, [[1, 1, 1, 1]] * 3)

  def test_pad_within_documents(self):
    tokens, masks = _rows(packing_lib.pad(_stream_corpus(self), 4, pad_id=15))
    self.assertEqual(
        tokens,
        [[5, 6, 7, 0], [8, 9, 0, 15], [3, 4, 5, 6], [7, 0, 15, 15]],
    )
    self.assertEqual(
        masks, [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    )

  def test_pad_leaves_out_windows_without_a_target(self):
    # [1 2 3 4 0] in windows of 4: the second window would hold only "0".
    tokens, _ = _rows(packing_lib.pad(_stream_corpus(self, [1, 2, 3, 4, 0]), 4))
    self.assertEqual(tokens, [[1, 2, 3, 4]])

  def test_first_fit_packs_whole_documents_as_segments(self):
    # seq 7: windows [5 6 7 0] [8 9 0] [3 4 5 6 7 0]; longest first, the
    # 6 opens row A, the 4 row B, the 3 fits in B; B starts first.
    rows = packing_lib.first_fit(_stream_corpus(self), 7, pad_id=15)
    items = [rows[i] for i in range(len(rows))]
    self.assertEqual(
        [x["tokens"].tolist() for x in items],
        [[5, 6, 7, 0, 8, 9, 0], [3, 4, 5, 6, 7, 0, 15]],
    )
    self.assertEqual(
        [x["segment_ids"].tolist() for x in items],
        [[1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1, 0]],
    )
    self.assertEqual(
        [x["positions"].tolist() for x in items],
        [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0]],
    )
    self.assertEqual(items[1]["mask"].tolist(), [1] * 6 + [0])
    self.assertAlmostEqual(rows.fill_fraction, 13 / 14)
    first, second = rows.split(1)
    self.assertEqual(first[0]["tokens"].tolist(), items[0]["tokens"].tolist())
    self.assertEqual(second[0]["tokens"].tolist(), items[1]["tokens"].tolist())
    for x in items:  # the positions the decoders would derive
      np.testing.assert_array_equal(
          models.segment_positions(x["segment_ids"][None])[0], x["positions"]
      )

  def test_first_fit_rows_match_a_plain_loop(self):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 33, 300)
    rows, room = [], []  # the definition, one row at a time
    for p in np.argsort(-lengths, kind="stable"):
      r = next((r for r, left in enumerate(room) if left >= lengths[p]), None)
      if r is None:
        rows.append([]), room.append(32)
        r = len(rows) - 1
      rows[r].append(int(p))
      room[r] -= int(lengths[p])
    self.assertEqual(packing_lib.first_fit_rows(lengths, 32), rows)

  def test_first_fit_fills_the_license_texts(self):
    corpus = data.read_corpus(
        testing.license_texts(), tokenizer=_Tokenizer.get(), vocab_size=256
    )
    rows = packing_lib.first_fit(corpus, 1024)
    self.assertGreaterEqual(rows.fill_fraction, 0.95)
    self.assertLess(packing_lib.pad(corpus, 1024).fill_fraction, 0.95)
    pipeline = data.DataPipeline(
        corpus, seq_len=1024, batch_size=2, packing="first_fit"
    )
    self.assertGreaterEqual(pipeline.describe()["fill_fraction"], 0.95)
    self.assertEqual(
        sorted(next(pipeline.train_iterator())),
        ["mask", "positions", "segment_ids", "tokens"],
    )

  def test_files_concatenate_in_sorted_order(self):
    directory = helpers.tempdir(self)
    np.save(os.path.join(directory, "b.npy"), np.array([3, 4], np.int32))
    np.save(os.path.join(directory, "a.npy"), np.array([1, 2, 0], np.int64))
    corpus = data.read_corpus(directory, vocab_size=8)
    self.assertEqual(corpus.format, "npy")
    self.assertEqual(corpus.read(0, 5).tolist(), [1, 2, 0, 3, 4])
    # Without an end-of-document id, a file is a document.
    self.assertEqual(corpus.documents.tolist(), [[0, 3], [3, 5]])

  def test_text_documents_end_with_eod(self):
    directory = helpers.tempdir(self)
    texts = {"a.txt": "the license text", "b.txt": "  \n", "c.txt": "granted"}
    for name, text in texts.items():
      _write(os.path.join(directory, name), text)
    tokenizer = data.load_tokenizer(_Tokenizer.get())
    corpus = data.read_corpus(
        os.path.join(directory, "*.txt"), tokenizer=_Tokenizer.get()
    )
    eod = tokenizer.token_to_id("<|endoftext|>")
    self.assertEqual(corpus.eod_id, eod)
    expected = [
        *tokenizer.encode("the license text").ids,
        eod,
        *tokenizer.encode("granted").ids,
        eod,
    ]  # b.txt holds only white space: no document
    self.assertEqual(corpus.read(0, corpus.num_tokens).tolist(), expected)
    self.assertLen(corpus.documents, 2)
    self.assertEqual(
        tokenizer.decode(corpus.read(*corpus.documents[0]).tolist()),
        "the license text",
    )


def _numpy_masked_loss(logits, tokens, mask) -> float:
  """Mean over real targets of -log softmax(logits[b, t])[tokens[b, t+1]],
  a target being real where the ids at t and t + 1 both are."""
  total, count = 0.0, 0
  for b in range(tokens.shape[0]):
    for t in range(tokens.shape[1] - 1):
      if mask[b, t] and mask[b, t + 1]:
        row = logits[b, t].astype(np.float64)
        logz = np.log(np.sum(np.exp(row - row.max()))) + row.max()
        total += logz - row[tokens[b, t + 1]]
        count += 1
  return total / count


def _padded_mask() -> np.ndarray:
  """<bool>[4, 16]: 8, 5 and 3 real ids then padding, and 3 real ids after
  padding (padded on the left): 7 + 4 + 2 + 2 = 15 real targets."""
  mask = np.arange(16)[None, :] < np.array([8, 5, 3, 0])[:, None]
  mask[3, 13:] = True
  return mask


class MaskedLossTest(absltest.TestCase):

  def test_cross_entropy_counts_only_real_targets(self):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 6, 11)).astype(np.float32)
    tokens = rng.integers(0, 11, (3, 6)).astype(np.int32)
    mask = np.array([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]], bool)
    got = training.cross_entropy(
        jnp.asarray(logits), jnp.asarray(tokens), frontend.loss_weights(mask)
    )
    np.testing.assert_allclose(
        float(got), _numpy_masked_loss(logits, tokens, mask), rtol=1e-5
    )
    # An all-ones mask is the plain mean.
    np.testing.assert_allclose(
        float(
            training.cross_entropy(
                logits, tokens, frontend.loss_weights(np.ones((3, 6), bool))
            )
        ),
        float(training.cross_entropy(logits, tokens)),
        rtol=1e-6,
    )

  def test_train_step_ignores_padding(self):
    """The step's cross-entropy (two microbatches holding 11 and 4 real
    targets) is the NumPy mean over all 15 real ones, of the decoder's own
    logits; what stands in the padding after the real ids changes nothing
    of it. (The shapes and optimizer are those of tests/corpus_fixture.py's
    runs: one compiled step for both.)"""
    cfg = load_model_config("tiny_mixtral", num_layers=1)
    model, tx = Decoder(cfg), training.default_optimizer(3e-3)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (4, 16)).astype(np.int32)
    mask = _padded_mask()
    state = training.LinenFrontend.init(cfg, tx, tokens, jax.random.key(0))
    variables = {"params": state.params}
    logits, _ = jax.jit(model.apply)(variables, tokens)
    expected = _numpy_masked_loss(np.asarray(logits), tokens, mask)
    # The held-out loss sums the same terms.
    total, count = jax.jit(training.make_eval_step(model))(
        variables, tokens, mask
    )
    self.assertEqual(float(count), 15)
    np.testing.assert_allclose(float(total) / 15, expected, rtol=1e-5)

    step = jax.jit(
        training.LinenFrontend.make_step(cfg, tx, grad_accum=2),
        donate_argnums=0,
    )
    # Padding after a row's last real id (causal attention: the real ids
    # never see it) gets other ids.
    last = 15 - np.argmax(mask[:, ::-1], axis=1)
    after = np.arange(16)[None, :] > last[:, None]
    junk = np.where(after, rng.integers(0, cfg.vocab_size, (4, 16)), tokens)
    self.assertFalse(np.array_equal(junk, tokens))
    key = jax.random.key(1)
    losses = []
    for ids in (tokens, junk.astype(np.int32)):
      copy = jax.tree.map(jnp.copy, state)
      _, metrics = step(copy, ids, key, mask)
      losses.append(float(metrics["cross_entropy"]))
    np.testing.assert_allclose(losses[0], expected, rtol=1e-5)
    self.assertEqual(losses[1], losses[0])

  @testing.slow  # the steps share train_batch and the loss weights
  def test_nnx_step_ignores_padding(self):
    """The NNX step counts the same targets (the tokens and weights of
    `test_train_step_ignores_padding`)."""
    import nnx_adapter  # noqa: PLC0415

    cfg = load_model_config("tiny_mixtral", num_layers=1)
    tx = training.default_optimizer(3e-3)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (4, 16)).astype(np.int32)
    mask = _padded_mask()
    state = nnx_adapter.NNXFrontend.init(cfg, tx, tokens, jax.random.key(0))
    model, _ = state.merge()
    logits, _ = model(tokens)
    expected = _numpy_masked_loss(np.asarray(logits), tokens, mask)
    step = jax.jit(nnx_adapter.NNXFrontend.make_step(cfg, tx, grad_accum=2))
    _, metrics = step(state, tokens, jax.random.key(1), mask)
    np.testing.assert_allclose(
        float(metrics["cross_entropy"]), expected, rtol=1e-5
    )


def _released_style_tokenizer(directory: str, eos_config=None) -> str:
  """A tokenizer.json laid out like a released checkpoint's: byte-level BPE,
  "<s>" prepended by its post-processor, "</s>" and "<|endoftext|>" among
  its special tokens; with a tokenizer_config.json naming `eos_config` as
  `eos_token` when given."""
  from tokenizers import Tokenizer  # noqa: PLC0415
  from tokenizers import decoders  # noqa: PLC0415
  from tokenizers import models  # noqa: PLC0415
  from tokenizers import pre_tokenizers  # noqa: PLC0415
  from tokenizers import processors  # noqa: PLC0415
  from tokenizers import trainers  # noqa: PLC0415

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  special = ["<s>", "</s>", "<|endoftext|>"]
  tokenizer.train(
      testing.license_texts()[:2],
      trainers.BpeTrainer(
          vocab_size=300,
          special_tokens=special,
          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
          show_progress=False,
      ),
  )
  tokenizer.post_processor = processors.TemplateProcessing(
      single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
  )
  path = os.path.join(directory, "tokenizer.json")
  tokenizer.save(path)
  if eos_config is not None:
    _write(
        os.path.join(directory, "tokenizer_config.json"),
        json.dumps({"bos_token": "<s>", "eos_token": eos_config}),
    )
  return path


class TokenizerTest(absltest.TestCase):
  """Hugging Face `tokenizer.json` files, as checkpoints ship them."""

  def test_a_checkpoints_tokenizer(self):
    """The tokenizer beside a checkpoint is found; its configured
    `eos_token` ends each document (before the names tried otherwise); the
    ids are the tokenizer's own, its "<s>" included."""
    checkpoint_dir = helpers.tempdir(self)
    path = _released_style_tokenizer(
        checkpoint_dir, {"content": "</s>", "special": True}
    )
    self.assertEqual(tokenization.find_tokenizer(checkpoint_dir), path)
    self.assertIsNone(tokenization.find_tokenizer(helpers.tempdir(self)))
    tokenizer = data.load_tokenizer(path)
    bos, eos, endoftext = (
        tokenizer.token_to_id(t) for t in ("<s>", "</s>", "<|endoftext|>")
    )
    self.assertEqual(tokenization.end_of_document_id(tokenizer, path), eos)
    # Without the config, the first of EOD_TOKENS in the vocabulary.
    self.assertEqual(tokenization.end_of_document_id(tokenizer), endoftext)

    text = "Permission is granted, free of charge.\nÄ ☃"
    directory = helpers.tempdir(self)
    _write(os.path.join(directory, "a.txt"), text)
    corpus = data.read_corpus(directory, tokenizer=path, vocab_size=300)
    plain = tokenizer.encode(text, add_special_tokens=False).ids
    self.assertEqual(corpus.eod_id, eos)
    self.assertEqual(
        corpus.read(0, corpus.num_tokens).tolist(), [bos, *plain, eos]
    )
    self.assertEqual(tokenizer.decode(plain), text)  # byte-level: exact
    self.assertEqual(corpus.describe()["tokenizer"], path)

  def test_eos_token_as_a_string(self):
    directory = helpers.tempdir(self)
    path = _released_style_tokenizer(directory, "<s>")
    tokenizer = data.load_tokenizer(path)
    self.assertEqual(
        tokenization.end_of_document_id(tokenizer, path),
        tokenizer.token_to_id("<s>"),
    )
    # A config naming a token the vocabulary lacks falls back to the names.
    _write(
        os.path.join(directory, "tokenizer_config.json"),
        json.dumps({"eos_token": "<none>"}),
    )
    self.assertEqual(
        tokenization.end_of_document_id(tokenizer, path),
        tokenizer.token_to_id("<|endoftext|>"),
    )

  def test_no_end_of_document_token(self):
    """A tokenizer with none of the usual names needs the id given."""
    from tokenizers import Tokenizer  # noqa: PLC0415
    from tokenizers import models  # noqa: PLC0415
    from tokenizers import pre_tokenizers  # noqa: PLC0415

    directory = helpers.tempdir(self)
    path = os.path.join(directory, "tokenizer.json")
    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, "[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(path)
    text = _write(os.path.join(directory, "a.txt"), "a b a")
    with self.assertRaisesRegex(
        ValueError,
        f"tokenizer {re.escape(path)}: has no end-of-document token .*"
        r"--eod-id",
    ):
      data.read_corpus(text, tokenizer=path)
    corpus = data.read_corpus(text, tokenizer=path, eod_id=2)
    self.assertEqual(corpus.read(0, corpus.num_tokens).tolist(), [0, 1, 0, 2])


# 400 random ids in [1, 16), with EOD = 0 every 13th: no two windows alike.
LONG_STREAM = np.random.default_rng(0).integers(1, 16, 400)
LONG_STREAM[12::13] = EOD


def _pipeline(test, seed=0, batch_size=4, **kwargs) -> data.DataPipeline:
  return data.DataPipeline(
      _stream_corpus(test, LONG_STREAM),
      seq_len=8,
      batch_size=batch_size,
      seed=seed,
      **kwargs,
  )


def _take(iterator, n: int) -> list[np.ndarray]:
  return [next(iterator)["tokens"] for _ in range(n)]


class PipelineTest(parameterized.TestCase):

  def test_seeded_shuffle(self):
    a, b = _pipeline(self, seed=3), _pipeline(self, seed=3)
    first = _take(a.train_iterator(), 5)
    np.testing.assert_array_equal(first, _take(b.train_iterator(), 5))
    other = _take(_pipeline(self, seed=4).train_iterator(), 5)
    self.assertFalse(np.array_equal(first, other))

  def test_epochs_cover_every_sequence_once(self):
    pipeline = _pipeline(self, eval_fraction=0.0)
    n = len(pipeline.train)
    self.assertEqual(n, 50)  # 400 // 8
    every = np.concatenate(_take(pipeline.train_iterator(), 25))  # 2 epochs
    expected = sorted(tuple(pipeline.train[i]["tokens"]) for i in range(n))
    first, second = every[:n], every[n:]
    for epoch in (first, second):
      self.assertEqual(sorted(map(tuple, epoch)), expected)
    self.assertFalse(np.array_equal(first, second))  # reshuffled

  def test_held_out_sequences_are_the_last_ones(self):
    pipeline = _pipeline(self, eval_fraction=0.1)
    self.assertEqual((len(pipeline.train), len(pipeline.eval)), (45, 5))
    held_out = [tuple(pipeline.eval[i]["tokens"]) for i in range(5)]
    trained = {tuple(pipeline.train[i]["tokens"]) for i in range(45)}
    self.assertEqual(held_out[0], tuple(LONG_STREAM[360:368]))
    self.assertEmpty(trained & set(held_out))
    (batch,) = list(pipeline.eval_dataset(1))
    np.testing.assert_array_equal(batch["tokens"], np.array(held_out[:4]))
    with self.assertRaisesRegex(ValueError, "2 held-out batches of 4 need 8"):
      pipeline.eval_dataset(2)

  @parameterized.parameters(2, 4)
  def test_each_process_reads_a_disjoint_share(self, processes):
    """Process p of P reads rows [p B / P, (p + 1) B / P) of each global
    batch; the shares are disjoint and make up the global batches."""
    pipeline = _pipeline(self, batch_size=8)
    whole = _take(pipeline.train_iterator(), 6)
    size = 8 // processes
    shares = [
        _take(pipeline.train_iterator(slice(p * size, (p + 1) * size)), 6)
        for p in range(processes)
    ]
    for k in range(6):
      np.testing.assert_array_equal(
          np.concatenate([share[k] for share in shares]), whole[k]
      )
    self.assertEqual(
        pipeline.train_dataset(slice(0, 4))[0]["tokens"].shape[0], 4
    )
    with self.assertRaisesRegex(ValueError, "rows=2:5 is not an equal block"):
      pipeline.train_dataset(slice(2, 5))

  def test_process_rows_of_a_sharding(self):
    mesh = jax.make_mesh((1,), ("data",))
    sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("data")
    )
    rows = data.process_rows(sharding, (8, 4))
    self.assertEqual((rows.start, rows.stop), (0, 8))
    local = {"tokens": np.arange(32, dtype=np.int32).reshape(8, 4)}
    batch = data.global_batch(local, rows, sharding, 8)
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), local["tokens"])

  def test_state_moves_to_any_global_batch(self):
    pipeline = _pipeline(self)
    iterator = pipeline.train_iterator()
    expected = _take(iterator, 7)
    resumed = pipeline.train_iterator()
    resumed.set_state({"next_index": 4})
    np.testing.assert_array_equal(_take(resumed, 3), expected[4:])


class IteratorCheckpointTest(absltest.TestCase):
  """The iterator's state as the `data` item of a checkpoint."""

  def test_saved_and_restored(self):
    pipeline = _pipeline(self)
    directory = helpers.tempdir(self)
    iterator = pipeline.train_iterator()
    tree = {"step": jnp.int32(0)}
    with checkpoint.Checkpoints(directory) as ckpts:
      ckpts.save(1, tree, {})
      _take(iterator, 3)
      ckpts.save(3, tree, {}, data=iterator)
      after = _take(iterator, 2)
    with checkpoint.Checkpoints(directory) as ckpts:
      self.assertEqual((ckpts.has_data(1), ckpts.has_data(3)), (False, True))
      resumed = ckpts.restore_data(pipeline.train_iterator(), 3)
      np.testing.assert_array_equal(_take(resumed, 2), after)
      with self.assertRaisesRegex(ValueError, "holds no data iterator state"):
        ckpts.restore_data(pipeline.train_iterator(), 1)

  def test_state_of_other_process_counts(self):
    """States saved by 2 processes restore on 1 when they agree (the global
    position), and are refused when they differ."""
    handler = checkpointing.IteratorCheckpointHandler()
    pipeline = _pipeline(self)
    for states, error in (
        ([5, 5], None),
        ([5, 6], "in different states .* resume on 2 processes"),
    ):
      directory = epath.Path(helpers.tempdir(self))
      for p, k in enumerate(states):
        (directory / f"process_{p}-of-2.json").write_text(
            json.dumps({"next_index": k})
        )
      iterator = pipeline.train_iterator()
      if error:
        with self.assertRaisesRegex(ValueError, error):
          handler.restore(directory, item=iterator)
      else:
        handler.restore(directory, item=iterator)
        self.assertEqual(iterator.get_state(), {"next_index": 5})


class BadInputTest(parameterized.TestCase):
  """Each is one line naming the file and the problem."""

  def _check(self, message: str, fn, *args, **kwargs):
    with self.assertRaisesRegex(ValueError, message) as caught:
      fn(*args, **kwargs)
    self.assertNotIn("\n", str(caught.exception))

  def test_missing_files(self):
    missing = os.path.join(helpers.tempdir(self), "nothing")
    self._check(f"data {missing}: no such file", data.read_corpus, missing)
    pattern = os.path.join(helpers.tempdir(self), "*.txt")
    self._check(
        f"data {re.escape(pattern)}: no file matches",
        data.read_corpus,
        pattern,
    )

  def test_empty_corpus(self):
    directory = helpers.tempdir(self)
    for name in ("a.txt", "b.txt"):
      _write(os.path.join(directory, name), "\n \n")
    self._check(
        r"a.txt \(and 1 more files\): the corpus is empty \(2 files",
        data.read_corpus,
        directory,
        tokenizer=_Tokenizer.get(),
    )
    empty = _write(os.path.join(directory, "ids.bin"), b"")
    self._check(
        "ids.bin: the corpus is empty", data.read_corpus, empty, dtype="uint32"
    )

  def test_sequence_longer_than_the_corpus(self):
    corpus = _stream_corpus(self)
    for packing in data.PACKINGS:
      self._check(
          r"ids.bin: the corpus has 13 tokens, fewer than seq_len=14",
          data.DataPipeline,
          corpus,
          seq_len=14,
          batch_size=1,
          packing=packing,
      )
    self._check(
        "ids.bin: its 1 sequences of 13 tokens leave none to train on",
        data.DataPipeline,
        corpus,
        seq_len=13,
        batch_size=1,
    )

  def test_tokenizer_larger_than_the_model(self):
    self._check(
        r"tokenizer .*tokenizer.json: its vocabulary of 256 tokens is larger"
        " than the model's vocab_size=100",
        data.load_tokenizer,
        _Tokenizer.get(),
        vocab_size=100,
    )
    text = _write(os.path.join(helpers.tempdir(self), "a.txt"), "text")
    self._check(
        "vocabulary of 256 tokens is larger than the model's vocab_size=64",
        data.read_corpus,
        text,
        tokenizer=_Tokenizer.get(),
        vocab_size=64,
    )

  @parameterized.parameters("npy", "bin")
  def test_ids_outside_the_vocabulary(self, fmt):
    path = os.path.join(helpers.tempdir(self), f"ids.{fmt}")
    ids = np.array([3, 1, 300, 2, 999], np.uint16)
    if fmt == "npy":
      np.save(path, ids)
    else:
      ids.tofile(path)
    self._check(
        rf"ids.{fmt}: id 300 at position 2 is outside \[0, vocab_size=256\) "
        r"of the model \(2 such ids",
        data.read_corpus,
        path,
        dtype="uint16",
        vocab_size=256,
    )
    if fmt == "npy":
      np.save(path, np.array([1, -1]))
      self._check("id -1 at position 1", data.read_corpus, path, vocab_size=9)

  def test_corrupt_tokenizer(self):
    directory = helpers.tempdir(self)
    for name, content in (
        ("cut.json", '{"model": {"type": "BPE"'),
        ("wrong.json", '{"model": 3}'),
    ):
      path = _write(os.path.join(directory, name), content)
      self._check(
          f"tokenizer {path}: cannot be read as a tokenizer.json",
          data.load_tokenizer,
          path,
      )
    self._check(
        "tokenizer .*none.json: no such file",
        data.load_tokenizer,
        os.path.join(directory, "none.json"),
    )

  def test_malformed_files(self):
    directory = helpers.tempdir(self)
    odd = _write(os.path.join(directory, "odd.bin"), b"\x01\x02\x03")
    self._check(
        "odd.bin: its 3 bytes are not a whole number of uint16 ids",
        data.read_corpus,
        odd,
        dtype="uint16",
    )
    self._check(
        "odd.bin: a flat binary file carries no dtype", data.read_corpus, odd
    )
    square = os.path.join(directory, "square.npy")
    np.save(square, np.zeros((2, 2), np.int32))
    self._check(
        r"square.npy: holds an array of shape \(2, 2\)",
        data.read_corpus,
        square,
    )
    floats = os.path.join(directory, "floats.npy")
    np.save(floats, np.zeros(3, np.float32))
    self._check("floats.npy: holds float32 values", data.read_corpus, floats)
    binary = _write(os.path.join(directory, "b.txt"), b"ok \xff\xfe")
    self._check(
        "b.txt: is not UTF-8 text",
        data.read_corpus,
        binary,
        tokenizer=_Tokenizer.get(),
    )
    self._check("b.txt: text needs a tokenizer", data.read_corpus, binary)


if __name__ == "__main__":
  absltest.main()
