"""Where the whole model's train step or decode step spends its time.

Compiles one program of the whole-model benchmark's model (the train step, the
prefill, one decode step, or greedy_generate's whole program), runs it under `jax.profiler`
(`common/profiling.op_times`) and prints its slowest XLA ops, milliseconds per
call, each with the part of the model its HLO metadata names (attention,
the KV cache update, the MoE's router and expert matmuls, norms, logits and
loss, the optimizer, the finite check), then the total per part.

  python benchmarks/model/profile_model.py decode
  python benchmarks/model/profile_model.py train --model tiny_mixtral
  python benchmarks/model/profile_model.py decode --unrolled --batch 1
  python benchmarks/model/profile_model.py generate  # the whole call
"""

from __future__ import annotations

import argparse
import collections
import functools
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from linen_moe import decoding
from linen_moe import models

from common import profiling
from common import whole_model

_METADATA = re.compile(r'^\s*(?:ROOT )?%(\S+) = .*op_name="([^"]*)"')

# (part, substrings of an op's source path), first match wins.
PARTS = (
    (
        "layer weights sliced by the scan",
        ("while/body/jit(dynamic_index_in_dim)",),
    ),
    # The update runs in the taken branch of the finite check's lax.cond
    # (`skip.apply_if_finite`), whose ops carry only the branch's path.
    (
        "optimizer",
        (
            "adam",
            "clip",
            "global_norm",
            "apply_updates",
            "scale_by",
            "cond/branch_1_fun",
        ),
    ),
    ("finite check", ("all_finite", "keep_if_finite", "isfinite")),
    ("loss", ("cross_entropy", "log_softmax", "decoder_loss")),
    ("kv cache update", ("attention._cached",)),
    ("attention", ("attention",)),
    ("moe router", ("/moe/gate", "route", "top_k")),
    ("moe experts", ("_dot",)),
    ("moe other", ("/moe",)),
    ("norms", ("norm",)),
    ("logits / embedding", ("embed", "attend")),
)


def op_sources(hlo_text: str) -> dict[str, str]:
  """HLO op name -> the source path (`op_name` metadata) it was traced from."""
  out = {}
  for line in hlo_text.splitlines():
    match = _METADATA.match(line)
    if match:
      out[match.group(1)] = match.group(2)
  return out


# Host-side work of a call (dispatch, argument handling, transfers).
_HOST = ("ExecuteReplicated", "shard_args", "batched_copy", "BatchedCopy")


def part(op: str, source: str) -> str:
  """The part of the model an op (its name, its source path) belongs to
  (`PARTS`), with " (bwd)" for the backward pass."""
  if op.startswith(_HOST):
    return "host (dispatch, transfers)"
  name = "other"
  for candidate, keys in PARTS:
    if any(k in source for k in keys):
      name = candidate
      break
  if "transpose(" in source and name not in ("optimizer", "finite check"):
    name += " (bwd)"
  return name


def per_layer(cfg, variables):
  """`variables` laid out per layer (`layers_{i}/`), as `prefill` and
  `decode_step` hand them to their program on one CPU device: each layer's
  leaves views of the stacked host buffers (`models.scanned_to_unrolled` of
  NumPy arrays), not slices made inside the program."""
  host = jax.tree.map(np.asarray, dict(variables))
  return jax.device_put(models.scanned_to_unrolled(host, cfg.stack_plan))


def _program(what: str, cfg, args):
  """(compiled program, run() -> outputs) of one step, its inputs kept."""
  ours = whole_model.Ours(cfg, None)
  if what == "train":
    ours.setup_train(args.batch, args.seq)
    return ours.train_step, ours.train
  prompt = ours.tokens(args.batch, args.prompt)
  length = args.prompt + args.new
  if what == "generate":  # greedy_generate's one program, prefill included
    program, call = decoding.generate_program(
        cfg, ours.variables, prompt, args.new
    )
    compiled = program.lower(*call).compile()
    dynamic = call[1:3]  # the config and the lengths are static
    return compiled, lambda: compiled(*dynamic)
  state = {"cache": decoding.init_cache(cfg, args.batch, length)}
  if what == "prefill":
    fn, arg = decoding.prefill, prompt
  else:
    fn, arg = decoding.decode_step, prompt[:, 0]
  # The per-layer variables prefill and decode_step hand their program (a
  # traced stack would be sliced inside it, which those calls never do).
  variables = per_layer(cfg, ours.variables)
  step = jax.jit(functools.partial(fn, cfg), donate_argnums=1)
  compiled = step.lower(variables, state["cache"], arg).compile()

  def run():
    if what == "prefill":
      state["cache"] = decoding.init_cache(cfg, args.batch, length)
    token, _, state["cache"] = compiled(variables, state["cache"], arg)
    return token

  if what == "decode":  # a cache that holds the prompt
    _, _, state["cache"] = decoding.prefill(
        cfg, ours.variables, state["cache"], prompt
    )
  return compiled, run


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "what", choices=("train", "prefill", "decode", "generate")
  )
  parser.add_argument("--model", default=whole_model.MIXTRAL_SHAPE)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256, help="train length")
  parser.add_argument("--prompt", type=int, default=16)
  parser.add_argument("--new", type=int, default=32)
  parser.add_argument("--unrolled", action="store_true", help="unrolled layers")
  parser.add_argument("--dense", action="store_true", help="the dense path")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--hlo", help="also write the compiled HLO text here")
  args = parser.parse_args()
  cfg = whole_model.model_config(args.model)
  if args.unrolled:
    cfg = cfg.replace(scan_layers=False)
  if args.dense:
    cfg = cfg.replace(sparse_matmul=False)
  compiled, run = _program(args.what, cfg, args)
  hlo = compiled.as_text()
  if args.hlo:
    with open(args.hlo, "w", encoding="utf-8") as f:
      f.write(hlo)
  sources = op_sources(hlo)
  times = profiling.op_times(run, args.steps)
  parts = collections.Counter()
  for name, ms in times.items():
    parts[part(name, sources.get(name, ""))] += ms
  print(
      f"{args.what} of {args.model} (batch {args.batch}): ops of one call, ms"
      f" (sum {sum(times.values()):.2f})"
  )
  for name, ms in times.most_common(args.top):
    source = sources.get(name, "")
    print(f"{ms:8.2f}  {name:40s} {part(name, source):22s} {source[-90:]}")
  print("\nby part, ms")
  for name, ms in parts.most_common():
    print(f"{ms:8.2f}  {name}")


if __name__ == "__main__":
  jnp.zeros(())  # backend up before the profiler starts
  main()
