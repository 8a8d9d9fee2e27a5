"""Fine-tunes a Hugging Face fixture in fp8 and saves it back, for transformers.

  .venv/bin/python scripts/hf_finetune_roundtrip.py FIXTURE_DIR OUT_DIR \\
      [--steps 3] [--quantization fp8]

Loads FIXTURE_DIR (`linen_moe.hf.load_checkpoint`), takes --steps train
steps in --quantization on synthetic tokens over its vocabulary, saves the
float weights to OUT_DIR/checkpoint (`hf.save_checkpoint`) and writes
OUT_DIR/input_ids.npy and OUT_DIR/logits.npy: this decoder's float32 logits
for those weights. Then, in the fixtures' venv (torch + transformers):

  python scripts/check_hf_roundtrip.py OUT_DIR/checkpoint \\
      OUT_DIR/input_ids.npy OUT_DIR/logits.npy

shows that transformers loads the directory with no missing or unexpected
key and computes the same logits.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import Decoder
from linen_moe import hf
from linen_moe import training


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("fixture", type=pathlib.Path)
  parser.add_argument("out", type=pathlib.Path)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--quantization", default="fp8")
  args = parser.parse_args()
  config, variables = hf.load_checkpoint(
      args.fixture, quantization=args.quantization
  )
  model = Decoder(config)
  optimizer = training.default_optimizer(1e-2)
  state = training.train_state_from_variables(variables, optimizer)
  step = jax.jit(training.make_train_step(model, optimizer))
  data = training.MarkovData(config.vocab_size).batches(4, 16, seed=0)
  for i in range(args.steps):
    state, metrics = step(state, jnp.asarray(next(data)), jax.random.key(i))
    print(f"step {i}: loss {float(metrics['loss']):.4f}")
  trained = {"params": state.params}
  if state.rule_state:  # DeepSeek's routed biases, Gemma-4's layer scalars
    trained["updated_by_rule"] = state.rule_state
  before = variables["params"]["embed"]["embedding"]
  moved = float(jnp.abs(state.params["embed"]["embedding"] - before).max())
  print(f"embedding moved by up to {moved:.3g}")
  if state.rule_state:
    rule = jax.tree.map(
        lambda a, b: float(jnp.abs(a - b).max()),
        variables["updated_by_rule"],
        state.rule_state,
    )
    print(f"updated_by_rule moved by up to {max(jax.tree.leaves(rule)):.3g}")
  hf.save_checkpoint(config, trained, args.out / "checkpoint")
  ids = np.load(args.fixture / "input_ids.npy")
  float_config = config.replace(quantization="none")
  logits, _ = Decoder(float_config).apply(trained, jnp.asarray(ids))
  np.save(args.out / "input_ids.npy", ids)
  np.save(args.out / "logits.npy", np.asarray(logits, np.float32))
  print(f"wrote {args.out}/checkpoint, input_ids.npy, logits.npy")


if __name__ == "__main__":
  main()
