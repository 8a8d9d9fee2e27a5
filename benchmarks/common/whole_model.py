"""The whole-model benchmark's model: its shape, its useful FLOPs, and the
reference decoder's train step, decoding and weight read, timed.

`model/bench_model.py` runs it beside a peer; `model/bench_host_memory.py`,
`model/bench_scan_unroll.py` and `model/profile_model.py` build the same
programs.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import yaml

import linen_moe
from linen_moe import decoding
from linen_moe import models
from linen_moe import training

from common import host_memory
from common import timing

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
  """Elements of every leaf of `tree`."""
  return int(sum(np.size(x) for x in jax.tree.leaves(tree)))


def seconds(fn, *args) -> float:
  """Wall seconds of `fn(*args)` run to completion."""
  return timing.time_call(fn, args)[0]


def with_changes(cfg: linen_moe.ModelConfig, items) -> linen_moe.ModelConfig:
  """`cfg` with "FIELD=VALUE" items applied (`--set` of the benchmarks), a
  field of ModelConfig or of its MoEConfig (`ModelConfig.replace`'s flat
  names), the value read as YAML, as `linen-moe --set` reads it."""
  changes = {}
  for item in items:
    name, sep, text = item.partition("=")
    if not sep:
      raise ValueError(f"--set {item!r}: expected FIELD=VALUE.")
    changes[name] = yaml.safe_load(text)
  return cfg.replace(**changes)


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
          models.unrolled_to_scanned
          if scan_layers
          else models.scanned_to_unrolled
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
    return seconds(
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
    return seconds(
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
    return prefill_s, float(np.median(times))

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
    compiled = seconds(self.read_step, self.variables["params"])
    start = time.perf_counter()
    for x in self.numpy_params:
      np.add.reduce(x, axis=None)
    return compiled, time.perf_counter() - start
