"""Sampled generation of a batch of prompts of mixed lengths, and the decode
step against the weight-read limit, optionally beside transformers.

  python benchmarks/serving/bench_generate.py
  python benchmarks/serving/bench_generate.py --peer /path/to/torch-venv/bin/python

The whole-model benchmark's shape (`common/whole_model.py`, a 57M-parameter
Mixtral in float32), random weights. One run, in rounds, ours and the
peer's alternating so both see the same machine load:

  generate  `decoding.generate` of `--batch` prompts whose lengths are drawn
            from [`--min-prompt`, `--max-prompt`] (seeded), exactly `--new`
            new tokens each (no stop id), sampled with `--temperature` and
            `--top-p`: tokens/s = batch x new / seconds of the whole call,
            prefill included, warm (compiled by a first call, timed apart).
  peer      transformers' `generate` of the same lengths, left padded with an
            attention mask, `do_sample=True` with the same temperature and
            top-p (`peer_transformers.py`'s `sample`), timed the same way.
  loop      the decode step as `generate` runs it, inside its program's
            while loop (sampling included, no dispatch): the same call with
            2 new tokens, timed beside the one above (the same compiled
            program: the cache's bucket holds both), and the difference
            over the `--new` - 2 extra steps.
  step      one decode step of the same batch as a call of its own
            (`decoding.decode_step`, dispatch included: what a caller that
            streams pays).
  read      the weight-read limit: one read of every parameter (the faster
            of a compiled sum and a NumPy sum), the least a decode step
            reads; both steps are reported as fractions of it (>= 0.7
            wanted).

Medians over `--rounds`; on a shared machine read the ratios.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "model"))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from linen_moe import decoding  # noqa: E402

from common import whole_model  # noqa: E402
import peer_client  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default=whole_model.MIXTRAL_SHAPE)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--min-prompt", type=int, default=16)
  p.add_argument("--max-prompt", type=int, default=128)
  p.add_argument("--new", type=int, default=32)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--top-p", type=float, default=0.9)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=8, help="decode steps timed")
  p.add_argument(
      "--peer", default=None, metavar="PYTHON", help="a torch venv's python"
  )
  p.add_argument(
      "--set",
      nargs="*",
      default=[],
      metavar="FIELD=VALUE",
      help="config changes, e.g. num_layers=8 dtype=bfloat16",
  )
  return p.parse_args(argv)


def _bucket(n: int, minimum: int = 1) -> int:
  """The power of two >= max(n, minimum): `generate`'s buckets (its
  docstring; prompts bucket from 32 columns)."""
  return 1 << (max(n, minimum) - 1).bit_length()


def run(opts: argparse.Namespace) -> dict:
  cfg = whole_model.with_changes(whole_model.model_config(opts.model), opts.set)
  ours = whole_model.Ours(cfg, None)
  rng = np.random.default_rng(0)
  lengths = rng.integers(opts.min_prompt, opts.max_prompt + 1, opts.batch)
  prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in lengths]
  sampling = dict(temperature=opts.temperature, top_p=opts.top_p)

  def ours_generate(seed: int, new: int = opts.new) -> float:
    start = time.perf_counter()
    result = decoding.generate(
        ours.cfg,
        ours.variables,
        prompts,
        max_new_tokens=new,
        seed=seed,
        sampling=decoding.Sampling(**sampling),
    )
    seconds = time.perf_counter() - start
    assert all(len(t) == new for t in result.tokens)
    return seconds

  longest = _bucket(int(max(lengths)), 32)
  if _bucket(longest + 2) != _bucket(longest + opts.new):
    raise ValueError(
        f"--new {opts.new}: the 2-token call would compile another cache"
        " size; pick --new so that both fit the same bucket."
    )

  out = {
      "model": opts.model,
      "params": ours.params,
      "lengths": lengths.tolist(),
      "first_generate_s": ours_generate(0),  # trace, compile, run
  }
  peer = None
  if opts.peer:
    peer = peer_client.Peer(opts.peer)
    setup = peer.request("setup", model=peer_client.peer_model(cfg))
    out["peer_versions"] = setup.get("versions")
    peer.request(  # warm
        "sample", lengths=out["lengths"], new=2, repeats=1, **sampling
    )
  read_bytes = ours.setup_read()
  square = [prompts[0][: opts.min_prompt]] * opts.batch
  prompt = jax.numpy.asarray(square, jax.numpy.int32)
  ours.prefill_and_steps(prompt, opts.steps + 1, opts.steps)  # compile
  rows = {
      "ours_s": [],
      "peer_s": [],
      "loop_step_s": [],
      "step_s": [],
      "read_s": [],
  }
  for r in range(opts.rounds):
    ours_s = ours_generate(r + 1)
    rows["ours_s"].append(ours_s)
    short_s = ours_generate(r + 1, new=2)
    rows["loop_step_s"].append((ours_s - short_s) / (opts.new - 2))
    if peer is not None:
      reply = peer.request(
          "sample", lengths=out["lengths"], new=opts.new, repeats=1, **sampling
      )
      rows["peer_s"].append(reply["generate_s"][0])
    rows["step_s"].append(
        ours.prefill_and_steps(prompt, opts.steps + 1, opts.steps)[1]
    )
    rows["read_s"].append(min(ours.read()))
  if peer is not None:
    peer.close()
  tokens = opts.batch * opts.new
  med = {k: statistics.median(v) for k, v in rows.items() if v}
  out["ours_tokens_per_s"] = tokens / med["ours_s"]
  if "peer_s" in med:
    out["peer_tokens_per_s"] = tokens / med["peer_s"]
  out["read_bytes"] = read_bytes
  out["step_tokens_per_s"] = opts.batch / med["step_s"]
  out["limit_tokens_per_s"] = opts.batch / med["read_s"]
  out["step_fraction_of_limit"] = med["read_s"] / med["step_s"]
  out["loop_step_tokens_per_s"] = opts.batch / med["loop_step_s"]
  out["loop_step_fraction_of_limit"] = med["read_s"] / med["loop_step_s"]
  return out


def format_report(out: dict, opts: argparse.Namespace) -> str:
  lines = [
      (
          f"{out['model']} ({out['params']:,} params), batch {opts.batch}, "
          f"prompt lengths {out['lengths']}, {opts.new} new tokens each, "
          f"temperature {opts.temperature}, top_p {opts.top_p}"
      ),
      (
          "  first generate (trace, compile, run):"
          f" {out['first_generate_s']:.1f} s"
      ),
      f"  ours generate: {out['ours_tokens_per_s']:.1f} tokens/s",
  ]
  if "peer_tokens_per_s" in out:
    ratio = out["ours_tokens_per_s"] / out["peer_tokens_per_s"]
    lines.append(
        f"  transformers generate: {out['peer_tokens_per_s']:.1f} tokens/s "
        f"(ours {ratio:.2f}x; {out['peer_versions']})"
    )
  else:
    lines.append("  transformers: not run (--peer PYTHON)")
  lines.append(
      f"  weight-read limit: {out['limit_tokens_per_s']:.1f} tokens/s "
      f"({out['read_bytes'] / 2**20:.0f} MiB a step)"
  )
  lines.append(
      f"  decode step in generate's loop: {out['loop_step_tokens_per_s']:.1f}"
      f" tokens/s, {out['loop_step_fraction_of_limit']:.2f} of the limit"
  )
  lines.append(
      "  decode step as a call (decode_step): "
      f"{out['step_tokens_per_s']:.1f} tokens/s, "
      f"{out['step_fraction_of_limit']:.2f} of the limit"
  )
  return "\n".join(lines)


def main(argv=None) -> int:
  opts = parse_args(argv)
  print(format_report(run(opts), opts))
  return 0


if __name__ == "__main__":
  sys.exit(main())
