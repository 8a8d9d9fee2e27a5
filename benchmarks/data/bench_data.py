"""Is the input pipeline ever the bottleneck? Its tokens/s against the train
step's, at the tiny and the medium size, measured in one run.

The corpus is the license texts of the installed packages
(`testing.license_texts()`) with a 256-token BPE tokenizer trained on them.
For each size (batch x seq; the decoder tiny_mixtral with that size's emb
and mlp):

  pipeline   `DataPipeline.train_iterator()` batches, each placed on the
             device (`jnp.asarray` of tokens and mask, waited for): what a
             step takes from the data, packed and padded;
  step       the jitted Linen train step on such a batch (the mask for
             padded batches), waited for, after a warm-up;

measured in alternating rounds so that both see the same machine load;
medians of the rounds' tokens/s and their ratio are printed (the pipeline
should stay >= 10x the step's consumption). The one-time cost of reading
and tokenizing the corpus is printed too.

  python benchmarks/data/bench_data.py
  python benchmarks/data/bench_data.py --rounds 5 --sizes tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from linen_moe import data
from linen_moe import load_model_config
from linen_moe import testing
from linen_moe import training

# batch, seq, emb, mlp: the tiny and medium sizes of `layer/bench_moe.py`.
SIZES = {"tiny": (8, 32, 64, 128), "medium": (8, 512, 512, 1024)}


def read_corpus(tokenizer_path: str) -> tuple[data.Corpus, float]:
  files = testing.license_texts()
  data.train_bpe_tokenizer(files, 256, tokenizer_path)
  start = time.perf_counter()
  corpus = data.read_corpus(files, tokenizer=tokenizer_path, vocab_size=256)
  return corpus, time.perf_counter() - start


def pipeline_round(pipeline: data.DataPipeline, iterator, batches: int):
  """Tokens/s of `batches` batches read and placed on the device."""
  start = time.perf_counter()
  for _ in range(batches):
    batch = next(iterator)
    placed = jnp.asarray(batch["tokens"]), jnp.asarray(batch["mask"])
    jax.block_until_ready(placed)
  seconds = time.perf_counter() - start
  return batches * pipeline.batch_size * pipeline.seq_len / seconds


def step_round(step, state, batch, masked: bool, steps: int):
  """(state, tokens/s) of `steps` train steps on `batch`."""
  tokens, mask = batch
  start = time.perf_counter()
  for i in range(steps):
    key = jax.random.key(i)
    if masked:
      state, metrics = step(state, tokens, key, mask)
    else:
      state, metrics = step(state, tokens, key)
    jax.block_until_ready(metrics["loss"])
  seconds = time.perf_counter() - start
  return state, steps * tokens.shape[0] * tokens.shape[1] / seconds


def bench_size(name, corpus, args):
  b, s, m, h = SIZES[name]
  cfg = load_model_config("tiny_mixtral", emb_dim=m, moe_mlp_dim=h)
  tx = training.default_optimizer()
  step = jax.jit(training.LinenFrontend.make_step(cfg, tx), donate_argnums=0)
  rows = []
  for packing in data.PACKINGS:
    pipeline = data.DataPipeline(
        corpus, seq_len=s, batch_size=b, packing=packing, seed=0
    )
    iterator = pipeline.train_iterator()
    first = pipeline.train_dataset()[0]
    batch = (jnp.asarray(first["tokens"]), jnp.asarray(first["mask"]))
    masked = packing == "pad"
    state = training.LinenFrontend.init(cfg, tx, batch[0], jax.random.key(0))
    state, _ = step_round(step, state, batch, masked, 1)  # compile
    pipeline_round(pipeline, iterator, 2)  # threads started
    feed, train = [], []
    for _ in range(args.rounds):
      feed.append(pipeline_round(pipeline, iterator, args.batches))
      state, rate = step_round(step, state, batch, masked, args.steps)
      train.append(rate)
    rows.append(
        (name, packing, statistics.median(feed), statistics.median(train))
    )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", nargs="+", default=list(SIZES))
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--batches", type=int, default=200)
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    corpus, seconds = read_corpus(os.path.join(tmp, "tokenizer.json"))
  print(
      f"corpus: {len(corpus.files)} files, {corpus.num_tokens} tokens, read "
      f"and tokenized in {seconds:.3f}s ({corpus.num_tokens / seconds:,.0f} "
      "tokens/s, once per run)"
  )
  print(
      f"{'size':8} {'packing':8} {'pipeline tok/s':>15} {'step tok/s':>12} "
      f"{'ratio':>8}"
  )
  for name in args.sizes:
    for size, packing, feed, train in bench_size(name, corpus, args):
      print(
          f"{size:8} {packing:8} {feed:15,.0f} {train:12,.0f} "
          f"{feed / train:7.0f}x"
      )


if __name__ == "__main__":
  main()
