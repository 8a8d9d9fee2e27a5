"""The whole-model benchmark's peer: the same model in Hugging Face
transformers, in a worker process under another interpreter
(`peer_transformers.py`, which imports torch and transformers and neither
jax nor linen_moe)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import tempfile
from typing import Any

import linen_moe

# Run by the peer's interpreter, by path.
PEER_SCRIPT = pathlib.Path(__file__).resolve().parent / "peer_transformers.py"


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
