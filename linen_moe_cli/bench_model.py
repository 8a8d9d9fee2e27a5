"""Whole-model benchmark: the train step and greedy decoding of the reference
decoder, optionally beside the same model in Hugging Face transformers.

  python benchmarks/bench_model.py                      # the Mixtral shape
  python benchmarks/bench_model.py --model tiny_mixtral tiny_qwen3_moe
  python benchmarks/bench_model.py --peer /path/to/torch-venv/bin/python
  python benchmarks/bench_model.py --peer PY --record model_cpu_2core

(`benchmarks/bench_model.py` runs this module's `main`.)

What one run measures, in one process (ours) beside one worker process (the
peer, `peer_transformers.py` under the `--peer` interpreter):

  train     one step of `training.make_train_step` with the default optimizer
            (forward, loss, backward, clip to global norm 1, AdamW) at
            `--batch` x `--seq`; its trace+lower and compile seconds; useful
            GFLOP/s (the matmuls of the active experts, attention and logits,
            forward + backward) as a fraction of a float32 matmul roofline
            measured in the same rounds (`linen_moe_cli.bench.roofline_step`).
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
import datetime
import functools
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import linen_moe  # noqa: E402
from linen_moe import decoding  # noqa: E402
from linen_moe import training  # noqa: E402
from linen_moe_cli import bench  # noqa: E402
from linen_moe_cli import host_memory  # noqa: E402

# Run by the peer's interpreter, by path: it imports neither jax nor this
# package.
PEER_SCRIPT = pathlib.Path(__file__).resolve().parent / "peer_transformers.py"
REFERENCE_DIR = pathlib.Path("benchmarks") / "reference"

# The whole-model benchmark shape: a small Mixtral, 56,644,096 parameters.
MIXTRAL_SHAPE = "mixtral_57m"


def model_config(name: str) -> linen_moe.ModelConfig:
  """`MIXTRAL_SHAPE` (vocab 4096, emb 512, 4 layers of 8 heads, 8 experts
  top-2 of width 1024, tied embeddings, float32) or a shipped config name."""
  if name == MIXTRAL_SHAPE:
    moe = linen_moe.MoEConfig(
        num_experts=8,
        num_experts_per_tok=2,
        emb_dim=512,
        moe_mlp_dim=1024,
        load_balance_loss_weight=0.01,
    )
    return linen_moe.ModelConfig(
        moe=moe, vocab_size=4096, num_layers=4, num_heads=8
    )
  return linen_moe.load_model_config(name)


def peer_model(cfg: linen_moe.ModelConfig) -> dict[str, Any]:
  """The transformers config (`model_type` and its fields) of the same model,
  for random weights on the peer side.

  Raises:
    ValueError: when transformers' Mixtral cannot express `cfg`; the message
      names the field.
  """
  moe = cfg.moe
  routing = moe.routing
  if routing == "softmax_then_topk" and moe.norm_topk_prob:
    routing = "topk_then_softmax"  # the same weights: Mixtral's own rule
  unsupported = {
      "routing": (routing, "topk_then_softmax"),
      "shared_experts": (moe.shared_experts, 0),
      "mlp_activations": (moe.mlp_activations, ("silu", "linear")),
      "per_expert_scale": (moe.per_expert_scale, False),
      "routed_bias": (moe.routed_bias, False),
      "num_routing_groups": (moe.num_routing_groups, 1),
      "routed_scaling_factor": (moe.routed_scaling_factor, 1.0),
      "router_input_norm": (cfg.router_input_norm, False),
      "post_moe_norms": (cfg.post_moe_norms, False),
  }
  for field, (value, mixtral) in unsupported.items():
    if value != mixtral:
      raise ValueError(
          f"{field}={value!r}: transformers' Mixtral has {mixtral!r}; no peer "
          "model for this config."
      )
  return {
      "model_type": "mixtral",
      "vocab_size": cfg.vocab_size,
      "hidden_size": moe.emb_dim,
      "intermediate_size": moe.moe_mlp_dim,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_heads,
      "head_dim": cfg.resolved_head_dim,
      "num_local_experts": moe.num_experts,
      "num_experts_per_tok": moe.num_experts_per_tok,
      "tie_word_embeddings": True,
      "rope_theta": cfg.rope_max_wavelength,
      "rms_norm_eps": cfg.norm_eps,
      "router_aux_loss_coef": moe.load_balance_loss_weight,
      "sliding_window": None,
      "max_position_embeddings": 4096,
  }


def train_flops(cfg: linen_moe.ModelConfig, batch: int, seq: int) -> float:
  """Useful FLOPs of one train step (forward + backward = 3 forwards): per
  token the active experts' 3 matmuls (k of them), the attention projections,
  the full (not causally halved) scores and values, the router and the tied
  logits."""
  moe = cfg.moe
  m, h, k = moe.emb_dim, moe.moe_mlp_dim, moe.num_experts_per_tok
  inner = cfg.num_heads * cfg.resolved_head_dim
  per_layer = 3 * k * m * h + 4 * m * inner + m * moe.num_experts
  matmul_params = cfg.num_layers * per_layer + m * cfg.vocab_size
  attention = cfg.num_layers * 2 * seq * inner  # QK^T and PV, per token
  return 3.0 * 2.0 * batch * seq * (matmul_params + attention)


def param_count(tree) -> int:
  return int(sum(np.size(x) for x in jax.tree.leaves(tree)))


def _median(values) -> float:
  return float(statistics.median(values))


def _seconds(fn, *args) -> float:
  """Wall seconds of `fn(*args)` run to completion."""
  return bench.time_call(fn, args)[0]


class Ours:
  """The reference decoder, its train step and its decoding."""

  def __init__(
      self,
      cfg,
      checkpoint: str | None,
      seed: int = 0,
      scan_layers: bool | None = None,
  ):
    """`scan_layers` (None: the config's) picks the layer layout; the weights
    are the same either way (drawn scanned, then unrolled)."""
    if checkpoint:
      try:
        from linen_moe import hf  # noqa: PLC0415
      except ImportError as e:
        raise ValueError(
            "--checkpoint needs linen_moe.hf (the Hugging Face loader), "
            f"which this version lacks ({e})."
        ) from e
      cfg, variables = hf.load_checkpoint(checkpoint)
    else:
      sample = jnp.zeros((1, 8), jnp.int32)
      variables = linen_moe.Decoder(cfg).init(jax.random.key(seed), sample)
    # The init runs asynchronously: wait for it, or the first timed call
    # (first_generate) waits for it and counts it (about 4 s here).
    variables = jax.block_until_ready(linen_moe.sharding.unbox(dict(variables)))
    if scan_layers is not None and scan_layers != cfg.scan_layers:
      convert = (
          linen_moe.unrolled_to_scanned
          if scan_layers
          else linen_moe.scanned_to_unrolled
      )
      variables = convert(variables, cfg.num_layers)
      cfg = cfg.replace(scan_layers=scan_layers)
    self.cfg = cfg
    self.variables = variables
    self.rng = np.random.default_rng(seed)

  @property
  def params(self) -> int:
    return param_count(self.variables["params"])

  def tokens(self, batch: int, seq: int) -> jax.Array:
    return jnp.asarray(
        self.rng.integers(0, self.cfg.vocab_size, (batch, seq)), jnp.int32
    )

  # -- training -------------------------------------------------------------

  def setup_train(self, batch: int, seq: int) -> dict[str, float]:
    """Builds and compiles the train step; its trace+lower and compile s."""
    model = linen_moe.Decoder(self.cfg)
    optimizer = training.default_optimizer()
    self.train_state = training.train_state_from_variables(
        self.variables, optimizer
    )
    step = jax.jit(training.make_train_step(model, optimizer), donate_argnums=0)
    self.train_tokens = self.tokens(batch, seq)
    key = jax.random.key(1)
    start = time.perf_counter()
    lowered = step.lower(self.train_state, self.train_tokens, key)
    traced = time.perf_counter()
    self.train_step = lowered.compile()
    done = time.perf_counter()
    self.train_state = jax.tree.map(jnp.copy, self.train_state)
    return {"trace_s": traced - start, "compile_s": done - traced}

  def train(self) -> float:
    """Seconds of one train step; then `host_memory.settle`, untimed."""
    start = time.perf_counter()
    self.train_state, metrics = self.train_step(
        self.train_state, self.train_tokens, jax.random.key(2)
    )
    jax.block_until_ready((self.train_state, metrics))
    seconds = time.perf_counter() - start
    host_memory.settle()
    return seconds

  # -- decoding -------------------------------------------------------------

  def first_generate(self, batch: int, prompt: int, new: int) -> float:
    """Seconds of the first `greedy_generate` call at this batch (trace,
    compile and run): call it before anything else compiles its programs."""
    tokens = self.tokens(batch, prompt)
    return _seconds(
        decoding.greedy_generate, self.cfg, self.variables, tokens, new
    )

  def setup_decode(self, prompt: jax.Array, new: int) -> dict[str, float]:
    """Trace+lower and compile seconds of the programs for `prompt` [B, P]
    and `new` tokens: `greedy_generate`'s one program
    (`decoding.generate_program`), and the prefill and decode-step programs
    of step-by-step decoding (compiled again here to time them)."""
    b, p = prompt.shape
    program, args = decoding.generate_program(
        self.cfg, self.variables, prompt, new
    )
    out = {}
    jax.clear_caches()  # the first call compiled it: compile it afresh
    start = time.perf_counter()
    lowered = program.lower(*args)
    traced = time.perf_counter()
    lowered.compile()
    out["generate_trace_s"] = traced - start
    out["generate_compile_s"] = time.perf_counter() - traced
    self.generate(prompt, new)  # compiled for the timed calls
    cache = decoding.init_cache(self.cfg, b, p + new)
    for name, fn, arg in (
        ("prefill", decoding.prefill, prompt),
        ("decode_step", decoding.decode_step, prompt[:, 0]),
    ):
      jitted = jax.jit(functools.partial(fn, self.cfg))
      start = time.perf_counter()
      lowered = jitted.lower(self.variables, cache, arg)
      traced = time.perf_counter()
      lowered.compile()
      out[f"{name}_trace_s"] = traced - start
      out[f"{name}_compile_s"] = time.perf_counter() - traced
    return out

  def generate(self, prompt: jax.Array, new: int) -> float:
    """Seconds of `greedy_generate` of `new` tokens after `prompt`."""
    return _seconds(
        decoding.greedy_generate, self.cfg, self.variables, prompt, new
    )

  def prefill_and_steps(
      self, prompt: jax.Array, new: int, steps: int
  ) -> tuple[float, float]:
    """(prefill seconds, median decode-step seconds over `steps` steps)."""
    b, p = prompt.shape
    cache = decoding.init_cache(self.cfg, b, p + new)
    jax.block_until_ready(cache)
    start = time.perf_counter()
    token, _, cache = decoding.prefill(self.cfg, self.variables, cache, prompt)
    jax.block_until_ready(token)
    prefill_s = time.perf_counter() - start
    times = []
    for _ in range(min(steps, new - 1)):
      start = time.perf_counter()
      token, _, cache = decoding.decode_step(
          self.cfg, self.variables, cache, token
      )
      jax.block_until_ready(token)
      times.append(time.perf_counter() - start)
    return prefill_s, _median(times)

  # -- the weight-read limit -------------------------------------------------

  def setup_read(self):
    params = self.variables["params"]
    self.read_step = jax.jit(
        lambda p: sum(jnp.sum(x, dtype=jnp.float32) for x in jax.tree.leaves(p))
    )
    jax.block_until_ready(self.read_step(params))
    self.numpy_params = [np.asarray(x) for x in jax.tree.leaves(params)]
    return sum(x.nbytes for x in self.numpy_params)

  def read(self) -> tuple[float, float]:
    """(compiled read seconds, NumPy read seconds) of every parameter."""
    compiled = _seconds(self.read_step, self.variables["params"])
    start = time.perf_counter()
    for x in self.numpy_params:
      np.add.reduce(x, axis=None)
    return compiled, time.perf_counter() - start


class Peer:
  """A peer worker (`peer_transformers.py` by default) in its own process
  under another interpreter; `request` sends one line of JSON and reads its
  reply."""

  def __init__(self, python: str, script: os.PathLike | str | None = None):
    # Its warnings go to a file: a pipe nobody reads would fill and block it.
    self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
    self.proc = subprocess.Popen(
        [python, os.fspath(script or PEER_SCRIPT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=self.stderr,
        text=True,
    )

  def _stderr_tail(self) -> str:
    self.stderr.seek(0)
    return " | ".join(self.stderr.read().strip().splitlines()[-5:])

  def request(self, op: str, **fields) -> dict[str, Any]:
    """The peer's reply to `op`; RuntimeError if it fails or exits."""
    try:
      self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
      self.proc.stdin.flush()
    except BrokenPipeError:
      pass  # it exited: reported below
    line = self.proc.stdout.readline()
    if not line:
      self.proc.wait(timeout=60)
      raise RuntimeError(
          f"the peer exited ({self.proc.returncode}) on {op!r}: "
          f"{self._stderr_tail()}"
      )
    reply = json.loads(line)
    if "error" in reply:
      raise RuntimeError(f"peer {op}: {reply['error']}")
    return reply

  def close(self) -> None:
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.close()
      except BrokenPipeError:
        pass
      self.proc.wait(timeout=60)
    self.stderr.close()


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
  step, args = bench.roofline_step()
  jax.block_until_ready(step(*args))
  m, k, n = bench.ROOFLINE_SHAPE
  flops = 3 * 2 * m * k * n
  return lambda: flops / _seconds(step, *args) / 1e9


def run_model(name: str, opts: Options) -> dict[str, Any]:
  """Every measurement of one model: a dict of figures (seconds, tokens/s,
  ratios) and the medians' raw samples."""
  cfg = model_config(name)
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
    peer = Peer(opts.peer)
    setup = peer.request(
        "setup",
        model=None if opts.checkpoint else peer_model(cfg),
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
    flops = train_flops(cfg, opts.batch, opts.seq)
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


def _cpuinfo() -> str:
  """The text of /proc/cpuinfo, or "" where there is none."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      return f.read()
  except OSError:
    return ""


def _cpu_name(cpuinfo: str) -> str:
  for line in cpuinfo.splitlines():
    if line.startswith("model name"):
      return line.split(":", 1)[1].strip()
  return platform.processor() or platform.machine()


# Vector units a CPU flag names, widest first. Recorded because the model
# name does not tell machines apart: two that both said "AMD EPYC" measured
# this benchmark's float32 roofline at 351 and 88 GFLOP/s.
_VECTOR_FLAGS = ("avx512f", "avx2", "avx", "sve", "asimd", "sse2")


def vector_isa(cpuinfo: str) -> str:
  """The widest of `_VECTOR_FLAGS` among the first processor's flags in
  `cpuinfo` (the text of /proc/cpuinfo), or "unknown"."""
  for line in cpuinfo.splitlines():
    key, _, value = line.partition(":")
    if key.strip() in ("flags", "Features"):
      flags = set(value.split())
      return next((f for f in _VECTOR_FLAGS if f in flags), "unknown")
  return "unknown"


def machine() -> dict[str, Any]:
  """The date, the machine and the versions a run was measured with."""
  import flax  # noqa: PLC0415

  cpuinfo = _cpuinfo()
  return {
      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      "cpu": _cpu_name(cpuinfo),
      "vector_isa": vector_isa(cpuinfo),
      "cores": os.cpu_count(),
      "platform": platform.platform(),
      "load_average": list(os.getloadavg()),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "flax": flax.__version__,
      "linen_moe": linen_moe.__version__,
      "env": {
          k: os.environ[k]
          for k in (
              "XLA_FLAGS",
              "OMP_WAIT_POLICY",
              "OMP_NUM_THREADS",
              host_memory.ENV,
          )
          if k in os.environ
      },
  }


def _fmt(value: float, unit: str = "") -> str:
  if value >= 100:
    return f"{value:,.0f}{unit}"
  if value >= 10:
    return f"{value:.1f}{unit}"
  return f"{value:.3g}{unit}"


def report(results: dict[str, Any]) -> str:
  """The tables of a run, as text."""
  opts, env = results["options"], results["machine"]
  lines = [
      (
          f"bench_model {env['date']}  {env['cpu']}"
          f" ({env.get('vector_isa', 'vector units unrecorded')}),"
          f" {env['cores']} cores, load"
          f" average {env['load_average'][0]:.1f} at the start,"
          f" {results['end_load_average'][0]:.1f} at the end"
      ),
      (
          f"jax {env['jax']}, flax {env['flax']}, linen_moe {env['linen_moe']};"
          f" medians of {opts['rounds']} rounds, both sides alternating"
      ),
      "host malloc (both sides): "
      + env["env"].get(host_memory.ENV, "glibc's defaults"),
  ]
  for r in results["models"]:
    lines.append("")
    head = f"== {r['model']} ({r['layers']} layers): {r['params']:,} parameters"
    peer = r.get("peer")
    if peer:
      v = peer["versions"]
      head += (
          f" (transformers {v['transformers']}, torch {v['torch']}: "
          f"{peer['params']:,}; attention {peer['attn_implementation']}, "
          f"experts {peer['experts_implementation']}, "
          f"{peer['threads']} threads)"
      )
    lines.append(head)
    lines.append(
        f"float32 matmul roofline {r['roofline_gflops']:.1f} GFLOP/s; "
        f"weights {r['weight_bytes'] / 2**20:.1f} MiB read in "
        f"{r['read_s'] * 1e3:.2f} ms (compiled "
        f"{r['read_compiled_s'] * 1e3:.2f}, NumPy "
        f"{r['read_numpy_s'] * 1e3:.2f})"
    )
    rows = [("", "linen_moe", "transformers", "ratio")]
    if "train_step_s" in r:
      rows.append((
          f"train step, batch {opts['batch']} x seq {opts['seq']}",
          _fmt(r["train_step_s"], " s"),
          _fmt(r["peer_train_step_s"], " s") if peer else "-",
          f"{r['train_speedup']:.2f}x" if peer else "-",
      ))
      rows.append((
          "  compile (trace+lower, compile)",
          f"{r['train_trace_s']:.1f} + {r['train_compile_s']:.1f} s",
          "-",
          "",
      ))
      rows.append((
          "  useful GFLOP/s, of roofline",
          f"{r['train_gflops']:.1f}, {r['train_roofline_fraction']:.2f}",
          "",
          "",
      ))
    for b in opts["decode_batches"] if opts["decode"] else ():
      p = f"b{b}_"
      has_peer = f"peer_{p}generate_s" in r
      rows.append((
          (
              f"greedy generate, batch {b}, prompt {opts['prompt']}, "
              f"{opts['new']} new (tok/s)"
          ),
          _fmt(r[p + "generate_tokens_per_s"]),
          _fmt(r[f"peer_{p}generate_tokens_per_s"]) if has_peer else "-",
          f"{r[p + 'generate_speedup']:.2f}x" if has_peer else "-",
      ))
      rows.append((
          "  prefill (prompt tok/s)",
          _fmt(r[p + "prefill_tokens_per_s"]),
          _fmt(r[f"peer_{p}prefill_tokens_per_s"]) if has_peer else "-",
          f"{r[p + 'prefill_speedup']:.2f}x" if has_peer else "-",
      ))
      rows.append((
          "  decode step (ms; tok/s)",
          (
              f"{r[p + 'decode_step_s'] * 1e3:.1f}; "
              f"{_fmt(r[p + 'decode_tokens_per_s'])}"
          ),
          "",
          "",
      ))
      rows.append((
          "  decode step in generate's loop (ms; tok/s)",
          (
              f"{r[p + 'loop_step_s'] * 1e3:.1f}; "
              f"{_fmt(r[p + 'loop_tokens_per_s'])}"
          ),
          "",
          "",
      ))
      rows.append((
          "  weight-read limit (tok/s); step's, loop's fraction",
          (
              f"{_fmt(r[p + 'read_limit_tokens_per_s'])}; "
              f"{r[p + 'decode_read_fraction']:.2f}, "
              f"{r[p + 'loop_read_fraction']:.2f}"
          ),
          "",
          "",
      ))
      rows.append((
          "  first greedy_generate call",
          _fmt(r[p + "first_generate_s"], " s"),
          "",
          "",
      ))
      compile = [
          r[p + f"{k}_trace_s"] + r[p + f"{k}_compile_s"]
          for k in ("generate", "prefill", "decode_step")
      ]
      rows.append((
          "  compile generate; prefill, decode step (s)",
          "{:.1f}; {:.1f}, {:.1f}".format(*compile),
          "",
          "",
      ))
    goals = _goals(r, opts)
    if goals:
      rows.append(("goals", "", "", ""))
      rows.extend((f"  {g}", v, "", "") for g, v in goals)
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
      lines.append(
          "  ".join(
              c.ljust(w) if i == 0 else c.rjust(w)
              for i, (c, w) in enumerate(zip(row, widths, strict=True))
          ).rstrip()
      )
  return "\n".join(lines)


def _goals(r: dict[str, Any], opts: dict[str, Any]) -> list[tuple[str, str]]:
  """Where the run stands against the project's targets for the whole model
  (decode >= 2x the peer and >= 0.7 of the weight-read limit, train >= 1.3x
  the peer, first call < 5 s); only what was measured."""
  out = []
  for b in opts["decode_batches"] if opts["decode"] else ():
    p = f"b{b}_"
    if p + "generate_speedup" in r:
      out.append((
          f"batch {b} generate >= 2x transformers",
          f"{r[p + 'generate_speedup']:.2f}x",
      ))
    out.append((
        f"batch {b} generate's decode step >= 0.7 of the read limit",
        f"{r[p + 'loop_read_fraction']:.2f}",
    ))
    out.append((
        f"batch {b} first greedy_generate < 5 s",
        f"{r[p + 'first_generate_s']:.1f} s",
    ))
  if "train_speedup" in r:
    out.append(
        ("train step >= 1.3x transformers", f"{r['train_speedup']:.2f}x")
    )
  return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
      "--model",
      nargs="+",
      default=[MIXTRAL_SHAPE],
      help=(
          f"{MIXTRAL_SHAPE} (the default) or shipped config names "
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
      "--out", default="benchmarks/results/model.json", help="JSON results"
  )
  parser.add_argument(
      "--record",
      metavar="NAME",
      help=(
          f"also write {REFERENCE_DIR}/NAME.json and NAME.txt (from the "
          "repository root)"
      ),
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
  results = {"machine": machine(), "options": options}
  results["models"] = [run_model(name, opts) for name in args.model]
  results["end_load_average"] = list(os.getloadavg())
  text = report(results)
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
