"""The peer side of `bench_model.py --peer PYTHON`: the same model in
Hugging Face transformers on PyTorch, timed on request.

Run by `linen_moe_cli.bench_model`, by path, with the peer's interpreter (a
venv with torch and transformers; this file imports nothing of linen_moe,
so that venv needs neither jax nor this package; nothing here imports it). It is a worker: one JSON request per line on
stdin, one JSON reply per line on stdout, so the driver can alternate the
two sides step by step, in one run, under the same machine load.

Requests (`op` and its fields) and replies:

  {"op": "setup", "model": {...}, "checkpoint": null, "threads": 2,
   "attn_implementation": null, "experts_implementation": null}
      builds the model: from `checkpoint` (a directory `save_pretrained`
      wrote; both sides then hold the very same weights) or, when null, from
      random weights of the shapes `model` gives (`hf_config` keys of a
      transformers config, plus "model_type"). The implementations default to
      transformers' own choice. -> {"params": N, "versions": {...},
      "attn_implementation": ..., "experts_implementation": ...}
  {"op": "train", "batch": B, "seq": S, "steps": n}
      n train steps on random tokens: forward with labels (next-token
      cross-entropy plus the router's load-balance loss), backward, clip to
      global norm 1, AdamW. -> {"step_s": [...]}
  {"op": "generate", "batch": B, "prompt": P, "new": N, "repeats": n}
      greedy `generate` of exactly N new tokens (no stop token), and the
      prefill alone (one forward of the prompt with a cache).
      -> {"generate_s": [...], "prefill_s": [...]}
  {"op": "sample", "lengths": [P0, P1, ...], "new": N, "temperature": t,
   "top_p": p, "repeats": n}
      sampled `generate` of exactly N new tokens for a batch of prompts of
      the given lengths, left padded with an attention mask (the padding
      transformers' decoder-only models expect), `do_sample=True` with the
      temperature and top-p given (top-k off). -> {"generate_s": [...]}
  {"op": "quit"}

Timings are wall seconds of each call, measured here.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import transformers

# transformers' config class per `model_type` this peer knows.
_CONFIGS = {"mixtral": "MixtralConfig"}
# Where the model runs: "cpu" (the default), or "cuda" for the GPU run
# (benchmarks/gpu/gpu_run.py's vs_torch step sets it).
DEVICE = torch.device(os.environ.get("LINEN_MOE_PEER_DEVICE", "cpu"))


def _now() -> float:
  """The wall clock, after the device's queued work (CUDA runs async)."""
  if DEVICE.type == "cuda":
    torch.cuda.synchronize()
  return time.perf_counter()


class Peer:
  """The model and its optimizer, built once by `setup`."""

  def __init__(self):
    self.model = None
    self.optimizer = None
    self.vocab = 0

  def setup(
      self,
      model: dict,
      checkpoint: str | None = None,
      threads: int = 2,
      attn_implementation: str | None = None,
      experts_implementation: str | None = None,
  ) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    kwargs = {"dtype": torch.float32}
    if attn_implementation:
      kwargs["attn_implementation"] = attn_implementation
    if experts_implementation:
      kwargs["experts_implementation"] = experts_implementation
    if checkpoint:
      self.model = transformers.AutoModelForCausalLM.from_pretrained(
          checkpoint, **kwargs
      )
    else:
      fields = dict(model)
      kind = fields.pop("model_type")
      if kind not in _CONFIGS:
        raise ValueError(
            f"model_type {kind!r} has no peer here; known: {sorted(_CONFIGS)}"
        )
      config = getattr(transformers, _CONFIGS[kind])(**fields)
      self.model = transformers.AutoModelForCausalLM.from_config(
          config, **kwargs
      )
    self.model.to(DEVICE)
    self.model.config.output_router_logits = True  # the load-balance loss
    self.vocab = self.model.config.vocab_size
    self.optimizer = torch.optim.AdamW(
        self.model.parameters(), lr=1e-2, weight_decay=0.0
    )
    config = self.model.config
    return {
        "params": sum(p.numel() for p in self.model.parameters()),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        "device": str(DEVICE),
        "attn_implementation": config._attn_implementation,  # noqa: SLF001
        "experts_implementation": getattr(
            config, "_experts_implementation", None
        ),
        "threads": torch.get_num_threads(),
        # OpenMP threads spin while they wait: on a loaded machine PASSIVE
        # keeps a 2-thread torch from fighting for the cores it waits on.
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
    }

  def _tokens(self, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, self.vocab, (batch, seq), device=DEVICE)

  def train(self, batch: int, seq: int, steps: int) -> dict:
    self.model.train()
    tokens = self._tokens(batch, seq)
    times = []
    for _ in range(steps):
      start = _now()
      loss = self.model(input_ids=tokens, labels=tokens).loss
      loss.backward()
      torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
      self.optimizer.step()
      self.optimizer.zero_grad(set_to_none=True)
      times.append(_now() - start)
    return {"step_s": times, "loss": float(loss)}

  @torch.inference_mode()
  def generate(self, batch: int, prompt: int, new: int, repeats: int) -> dict:
    self.model.eval()
    tokens = self._tokens(batch, prompt)
    generate_s, prefill_s = [], []
    for _ in range(repeats):
      start = _now()
      out = self.model.generate(
          tokens,
          attention_mask=torch.ones_like(tokens),
          max_new_tokens=new,
          min_new_tokens=new,
          do_sample=False,
          eos_token_id=None,
          pad_token_id=0,
      )
      generate_s.append(_now() - start)
      if out.shape != (batch, prompt + new):
        raise RuntimeError(f"generate returned {tuple(out.shape)}")
      start = _now()
      self.model(
          input_ids=tokens,
          use_cache=True,
          past_key_values=transformers.DynamicCache(config=self.model.config),
          logits_to_keep=1,
      )
      prefill_s.append(_now() - start)
    return {"generate_s": generate_s, "prefill_s": prefill_s}


def sample(
    peer: Peer,
    lengths: list[int],
    new: int,
    temperature: float,
    top_p: float,
    repeats: int,
) -> dict:
  """The `sample` op (see the module docstring)."""
  peer.model.eval()
  width = max(lengths)
  tokens = torch.zeros((len(lengths), width), dtype=torch.long)
  mask = torch.zeros_like(tokens)
  for i, n in enumerate(lengths):
    tokens[i, width - n :] = torch.randint(1, peer.vocab, (n,))
    mask[i, width - n :] = 1
  tokens, mask = tokens.to(DEVICE), mask.to(DEVICE)
  generate_s = []
  for r in range(repeats):
    torch.manual_seed(r)
    start = _now()
    with torch.no_grad():
      out = peer.model.generate(
          tokens,
          attention_mask=mask,
          max_new_tokens=new,
          min_new_tokens=new,
          do_sample=True,
          temperature=temperature,
          top_p=top_p,
          top_k=None,
          eos_token_id=None,
          pad_token_id=0,
          # The load-balance loss (on for `train`) would weigh each decode
          # step's router logits by the whole attention mask: no aux loss.
          output_router_logits=False,
      )
    generate_s.append(_now() - start)
    if out.shape != (len(lengths), width + new):
      raise RuntimeError(f"generate returned {tuple(out.shape)}")
  return {"generate_s": generate_s}


def main() -> int:
  peer = Peer()
  ops = {
      "setup": peer.setup,
      "train": peer.train,
      "generate": peer.generate,
      "sample": lambda **kw: sample(peer, **kw),
  }
  for line in sys.stdin:
    request = json.loads(line)
    op = request.pop("op")
    if op == "quit":
      break
    try:
      reply = ops[op](**request)
    except Exception as e:  # noqa: BLE001 -- reported to the driver
      reply = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(reply), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
