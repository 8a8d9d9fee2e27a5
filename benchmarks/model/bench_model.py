"""Whole-model benchmark: the train step and greedy decoding of the reference
decoder, optionally beside the same model in Hugging Face transformers.

  python benchmarks/model/bench_model.py                # the Mixtral shape
  python benchmarks/model/bench_model.py --model tiny_mixtral tiny_qwen3_moe
  python benchmarks/model/bench_model.py --peer /path/to/torch-venv/bin/python
  python benchmarks/model/bench_model.py --peer PY --record model_cpu_2core

With LINEN_MOE_REUSE_HOST_MEMORY=1 it restarts itself first with host memory
that compiled programs reuse (`common/host_memory.py`, as `linen-moe train`
does), and the peer runs with the same.

What one run measures, in one process (ours) beside one worker process (the
peer, `peer_transformers.py` under the `--peer` interpreter):

  train     one step of `training.make_train_step` with the default optimizer
            (forward, loss, backward, clip to global norm 1, AdamW) at
            `--batch` x `--seq`; its trace+lower and compile seconds; useful
            GFLOP/s (the matmuls of the active experts, attention and logits,
            forward + backward) as a fraction of a float32 matmul roofline
            measured in the same rounds (`common/timing.roofline_step`).
  decode    per decode batch (`--decode-batch`, default 8 and 1): the first
            call of `decoding.greedy_generate` (trace, compile and run; timed
            before anything else of that batch is compiled), then greedy
            generation of `--new` tokens after a `--prompt`-token prompt
            (tokens/s = batch x new / seconds of the whole call, prefill
            included, as transformers' `generate` is timed), the prefill alone
            (prompt tokens/s) and one `decoding.decode_step` (new tokens/s),
            with both programs' compile seconds.
  limit     the weight-read limit: one read of every parameter (a compiled
            sum over each leaf, and a NumPy sum; the faster counts), the
            bytes one decode step must read at least, so batch / read seconds
            bounds decode tokens/s; decode is reported as a fraction of it.

Each round times every item once, ours and the peer's alternating, so both
sides see the same machine load; the tables show medians over `--rounds`.
On a shared machine read the ratios, not the absolute times.

Both sides count their parameters, which must be equal. Until a checkpoint
loader is available both use random weights of the same shapes;
`--checkpoint DIR` (a directory transformers' `save_pretrained` wrote) gives
both sides the very same weights (our side through `linen_moe.hf`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common import host_memory

if __name__ == "__main__":  # before jax is imported: the restart repeats it
  host_memory.reexec_with_reused_memory()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

import linen_moe  # noqa: E402

from common import machine  # noqa: E402
from common import timing  # noqa: E402
from common import whole_model  # noqa: E402
from common.whole_model import Ours  # noqa: E402
import model_report  # noqa: E402
import peer_client  # noqa: E402

REFERENCE_DIR = pathlib.Path(__file__).resolve().parents[1] / "reference"
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"


def _median(values) -> float:
  return float(statistics.median(values))


@dataclasses.dataclass
class Options:
  """What one run measures (the command line's flags)."""

  batch: int = 8
  seq: int = 256
  decode_batches: tuple[int, ...] = (8, 1)
  prompt: int = 16
  new: int = 32
  rounds: int = 5
  steps: int = 8
  train: bool = True
  decode: bool = True
  peer: str | None = None
  checkpoint: str | None = None
  peer_attn: str | None = None
  peer_experts: str | None = None
  layers: str = "config"


def _roofline_gflops():
  step, args = timing.roofline_step()
  jax.block_until_ready(step(*args))
  flops = timing.roofline_flops()
  return lambda: flops / whole_model.seconds(step, *args) / 1e9


def run_model(name: str, opts: Options) -> dict[str, Any]:
  """Every measurement of one model: a dict of figures (seconds, tokens/s,
  ratios) and the medians' raw samples."""
  cfg = whole_model.model_config(name)
  layers = {"scanned": True, "unrolled": False}.get(opts.layers)
  ours = Ours(cfg, opts.checkpoint, scan_layers=layers)
  cfg = ours.cfg
  out: dict[str, Any] = {
      "model": name,
      "params": ours.params,
      "layers": "scanned" if cfg.scan_layers else "unrolled",
  }
  samples: dict[str, list[float]] = {}

  def sample(key, value):
    samples.setdefault(key, []).append(value)

  # First calls, before anything else compiles their programs.
  if opts.decode:
    for b in opts.decode_batches:
      out[f"b{b}_first_generate_s"] = ours.first_generate(
          b, opts.prompt, opts.new
      )
  peer = None
  if opts.peer:
    peer = peer_client.Peer(opts.peer)
    setup = peer.request(
        "setup",
        model=None if opts.checkpoint else peer_client.peer_model(cfg),
        checkpoint=opts.checkpoint,
        attn_implementation=opts.peer_attn,
        experts_implementation=opts.peer_experts,
    )
    out["peer"] = setup
    if setup["params"] != out["params"]:
      peer.close()
      raise RuntimeError(
          f"{name}: parameter counts differ (ours {out['params']:,}, "
          f"transformers {setup['params']:,}): not the same model."
      )
  try:
    roofline = _roofline_gflops()
    out["weight_bytes"] = ours.setup_read()
    if opts.train:
      out.update({
          f"train_{k}": v
          for k, v in ours.setup_train(opts.batch, opts.seq).items()
      })
      if peer:  # its first steps warm up the allocator
        peer.request("train", batch=opts.batch, seq=opts.seq, steps=1)
    prompts = {}
    for b in opts.decode_batches if opts.decode else ():
      prompts[b] = ours.tokens(b, opts.prompt)
      setup = ours.setup_decode(prompts[b], opts.new)
      out.update({f"b{b}_{k}": v for k, v in setup.items()})
      if peer:
        peer.request(
            "generate", batch=b, prompt=opts.prompt, new=opts.new, repeats=1
        )
    roofline(), ours.read()  # compiled again after setup_decode's clear
    for _ in range(opts.rounds):
      sample("roofline_gflops", roofline())
      compiled, numpy_read = ours.read()
      sample("read_s", min(compiled, numpy_read))
      sample("read_compiled_s", compiled)
      sample("read_numpy_s", numpy_read)
      if opts.train:
        sample("train_step_s", ours.train())
        if peer:
          reply = peer.request("train", batch=opts.batch, seq=opts.seq, steps=1)
          sample("peer_train_step_s", reply["step_s"][0])
      for b, prompt in prompts.items():
        sample(f"b{b}_generate_s", ours.generate(prompt, opts.new))
        prefill_s, step_s = ours.prefill_and_steps(prompt, opts.new, opts.steps)
        sample(f"b{b}_prefill_s", prefill_s)
        sample(f"b{b}_decode_step_s", step_s)
        if peer:
          reply = peer.request(
              "generate", batch=b, prompt=opts.prompt, new=opts.new, repeats=1
          )
          sample(f"peer_b{b}_generate_s", reply["generate_s"][0])
          sample(f"peer_b{b}_prefill_s", reply["prefill_s"][0])
  finally:
    if peer:
      peer.close()
  out.update({k: _median(v) for k, v in samples.items()})
  out["samples"] = samples
  _derive(out, cfg, opts)
  return out


def _derive(out: dict[str, Any], cfg, opts: Options) -> None:
  """Throughputs and ratios from the medians."""
  if opts.train:
    flops = whole_model.train_flops(cfg, opts.batch, opts.seq)
    out["train_tokens_per_s"] = opts.batch * opts.seq / out["train_step_s"]
    gflops = flops / out["train_step_s"] / 1e9
    out["train_gflops"] = gflops
    out["train_roofline_fraction"] = gflops / out["roofline_gflops"]
    if "peer_train_step_s" in out:
      out["train_speedup"] = out["peer_train_step_s"] / out["train_step_s"]
  for b in opts.decode_batches if opts.decode else ():
    new_tokens = b * opts.new
    out[f"b{b}_generate_tokens_per_s"] = new_tokens / out[f"b{b}_generate_s"]
    out[f"b{b}_prefill_tokens_per_s"] = b * opts.prompt / out[f"b{b}_prefill_s"]
    out[f"b{b}_decode_tokens_per_s"] = b / out[f"b{b}_decode_step_s"]
    # A decode step inside greedy_generate's loop: the call less a prefill.
    loop_s = (out[f"b{b}_generate_s"] - out[f"b{b}_prefill_s"]) / max(
        opts.new - 1, 1
    )
    out[f"b{b}_loop_step_s"] = loop_s
    out[f"b{b}_loop_tokens_per_s"] = b / loop_s
    out[f"b{b}_loop_read_fraction"] = out["read_s"] / loop_s
    out[f"b{b}_read_limit_tokens_per_s"] = b / out["read_s"]
    out[f"b{b}_decode_read_fraction"] = (
        out["read_s"] / out[f"b{b}_decode_step_s"]
    )
    if f"peer_b{b}_generate_s" in out:
      peer_s = out[f"peer_b{b}_generate_s"]
      out[f"peer_b{b}_generate_tokens_per_s"] = new_tokens / peer_s
      out[f"b{b}_generate_speedup"] = peer_s / out[f"b{b}_generate_s"]
      out[f"peer_b{b}_prefill_tokens_per_s"] = (
          b * opts.prompt / out[f"peer_b{b}_prefill_s"]
      )
      out[f"b{b}_prefill_speedup"] = (
          out[f"peer_b{b}_prefill_s"] / out[f"b{b}_prefill_s"]
      )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
      "--model",
      nargs="+",
      default=[whole_model.MIXTRAL_SHAPE],
      help=(
          f"{whole_model.MIXTRAL_SHAPE} (the default) or shipped config names "
          f"({', '.join(linen_moe.available_configs())})"
      ),
  )
  parser.add_argument("--batch", type=int, default=8, help="train batch")
  parser.add_argument("--seq", type=int, default=256, help="train length")
  parser.add_argument(
      "--decode-batch", type=int, nargs="+", default=[8, 1], dest="decode"
  )
  parser.add_argument("--prompt", type=int, default=16)
  parser.add_argument("--new", type=int, default=32, help="tokens generated")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument(
      "--steps", type=int, default=8, help="decode steps timed per round"
  )
  parser.add_argument(
      "--layers",
      choices=("config", "scanned", "unrolled"),
      default="config",
      help="our decoder's layer layout (default: the config's scan_layers)",
  )
  parser.add_argument("--no-train", action="store_true")
  parser.add_argument("--no-decode", action="store_true")
  parser.add_argument(
      "--peer",
      metavar="PYTHON",
      help=(
          "an interpreter with torch and transformers: run the same model "
          "there, alternating with ours"
      ),
  )
  parser.add_argument(
      "--peer-attn", help="transformers attn_implementation (its default)"
  )
  parser.add_argument(
      "--peer-experts",
      help="transformers experts_implementation (its default)",
  )
  parser.add_argument(
      "--checkpoint",
      metavar="DIR",
      help="a transformers checkpoint both sides load (else random weights)",
  )
  parser.add_argument(
      "--out", default=str(RESULTS / "model.json"), help="JSON results"
  )
  parser.add_argument(
      "--record",
      metavar="NAME",
      help="also write NAME.json and NAME.txt in benchmarks/reference/",
  )
  args = parser.parse_args(argv)
  for flag in ("batch", "seq", "prompt", "new", "rounds", "steps"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag} must be >= 1; got {getattr(args, flag)}.")
  if any(b < 1 for b in args.decode):
    parser.error(f"--decode-batch must be >= 1; got {args.decode}.")
  if args.new < 2:
    parser.error(f"--new must be >= 2 (a decode step); got {args.new}.")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  opts = Options(
      batch=args.batch,
      seq=args.seq,
      decode_batches=tuple(args.decode),
      prompt=args.prompt,
      new=args.new,
      rounds=args.rounds,
      steps=args.steps,
      train=not args.no_train,
      decode=not args.no_decode,
      peer=args.peer,
      checkpoint=args.checkpoint,
      peer_attn=args.peer_attn,
      peer_experts=args.peer_experts,
      layers=args.layers,
  )
  options = dataclasses.asdict(opts)
  # What was run, not where: no interpreter or checkpoint paths recorded.
  options["peer"] = "transformers" if opts.peer else None
  if opts.checkpoint:
    options["checkpoint"] = os.path.basename(os.path.normpath(opts.checkpoint))
  results = {"machine": machine.machine(), "options": options}
  results["models"] = [run_model(name, opts) for name in args.model]
  results["end_load_average"] = list(os.getloadavg())
  text = model_report.report(results)
  print(text)
  outputs = [pathlib.Path(args.out)]
  if args.record:
    outputs.append(REFERENCE_DIR / f"{args.record}.json")
  for path in outputs:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    path.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
  return 0


if __name__ == "__main__":
  sys.exit(main())
