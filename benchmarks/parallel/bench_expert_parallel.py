"""Expert-parallel traffic: all-gather + reduce-scatter against ragged
all-to-all, measured from compiled programs here and modelled at scale.

Measured: one sparse `RoutedMoE` layer, forward and backward (parameter and
input gradients), compiled on 8 simulated CPU devices (`expert=8`) with each
`expert_parallel` strategy. The bytes each device sends through the
collectives of the expert-parallel body are read from the compiled HLO
(`linen_moe.hlo.sent_bytes`) and set beside `ep_traffic`'s model of the
same layer. XLA:CPU runs the ragged exchange emulated (an all-to-all of
padded buffers), so for it the table also gives what the real op would send
for this routing (the rows that leave each device, from the router's
choices) and its buffers, read from the lowered device program (which holds
the real `ragged_all_to_all`).

Modelled: `ep_traffic` at the scales of released models (bf16 activations),
bytes per device per MoE layer, forward + backward, and the time each takes
at stated per-device link bandwidths, with the strategy `auto` picks.

  python benchmarks/parallel/bench_expert_parallel.py
  python benchmarks/parallel/bench_expert_parallel.py --json out.json

Devices are simulated, so no time is measured here: bytes are what a real
mesh would move for the same program.
"""

from __future__ import annotations

import argparse
import os
import sys

DEVICES = 8
if "jax" not in sys.modules:
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={DEVICES}"
  )

import json  # noqa: E402
import re  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from linen_moe import RoutedMoE  # noqa: E402
from linen_moe import hlo  # noqa: E402
from linen_moe import load_moe_config  # noqa: E402
from linen_moe import sharding  # noqa: E402

# What this checks is private: the traffic model `expert_parallel="auto"`
# decides by (set here beside the compiled programs' bytes), and the switch
# that lowers the real ragged exchange on a CPU instead of its emulation.
from linen_moe._src.kernels import ragged_collectives  # noqa: E402, TID251
from linen_moe._src.parallel import ep_traffic  # noqa: E402, TID251

KIB = 1024
# Layers measured here: (name, config overrides, batch, seq).
LAYERS = {
    # top-2 of 8 experts on 8 devices: D / k = 4.
    "tiny_mixtral": ({}, 8, 8),
    # top-8 of 64 experts on 8 devices: D / k = 1.
    "top8_of_64": (
        dict(num_experts=64, num_experts_per_tok=8, emb_dim=128),
        8,
        32,
    ),
}
# Released models: (emb, top-k, routed experts).
MODELS = {
    "DeepSeek-V3": (7168, 8, 256),
    "Qwen3-30B-A3B": (2048, 8, 128),
    "Mixtral 8x7B": (4096, 2, 8),
}
MODEL_EP = {
    "DeepSeek-V3": (8, 64, 256),
    "Qwen3-30B-A3B": (8, 16, 64, 128),
    "Mixtral 8x7B": (2, 4, 8),
}
TOKENS = (4096, 16384)
# Per-device link bandwidth, bytes/s per direction (idealised: every byte of
# the exchange at this rate).
LINKS = {
    "400Gb/s": 400e9 / 8,  # one 400 Gb/s NIC per GPU (InfiniBand NDR)
    "NVLink4": 450e9,  # H100/H200 NVLink 4, 900 GB/s both ways
    "v5p ICI": 4800e9 / 8,  # TPU v5p: 4,800 Gb/s of ICI per chip
}
_TENSOR = re.compile(r"tensor<([\dx]+)x[a-z]+\d*>")


def _layer(name: str):
  overrides, batch, seq = LAYERS[name]
  cfg = load_moe_config("tiny_mixtral", **overrides)
  x = jax.random.normal(jax.random.key(3), (batch, seq, cfg.emb_dim))
  variables = sharding.unbox(RoutedMoE(cfg).init(jax.random.key(0), x))
  return cfg, x, variables


def _grad(cfg):
  def loss(variables, x):
    return jnp.sum(RoutedMoE(cfg).apply(variables, x)[0] ** 2)

  return jax.jit(jax.grad(loss, (0, 1)))


def _real_rows(cfg, x, variables, ep: int) -> float:
  """Mean over devices of the assignments that leave a device for another
  one, for this routing (tokens split over `ep` devices in order, experts
  in contiguous blocks)."""
  # The router's choices: top-k of the gate logits (the layer's
  # topk_then_softmax routing picks exactly these).
  logits = x.reshape(-1, cfg.emb_dim) @ variables["params"]["gate"]["kernel"]
  indices = np.asarray(jax.lax.top_k(logits, cfg.num_experts_per_tok)[1])
  tokens = indices.shape[0] // ep
  source = np.arange(indices.shape[0])[:, None] // tokens
  dest = indices // (cfg.num_experts // ep)
  return float(np.sum(dest != source)) / ep


def _buffers(lowered_text: str) -> list[tuple[int, int]]:
  """(operand rows, output rows) of each ragged_all_to_all of a lowered
  (StableHLO) program."""
  out = []
  for line in lowered_text.splitlines():
    if "@ragged_all_to_all" in line:
      shapes = _TENSOR.findall(line.rsplit(":", 1)[1])
      out.append((int(shapes[0].split("x")[0]), int(shapes[1].split("x")[0])))
  return out


def measure(name: str) -> dict:
  cfg, x, variables = _layer(name)
  mesh = sharding.make_mesh(f"expert={DEVICES}")
  tokens = x.shape[0] * x.shape[1] // DEVICES
  problem = ep_traffic.Problem(
      tokens=tokens,
      emb=cfg.emb_dim,
      k=cfg.num_experts_per_tok,
      ep=DEVICES,
      act_bytes=jnp.dtype(cfg.dtype).itemsize,
      experts_per_device=cfg.num_experts // DEVICES,
  )
  row = {"layer": name, "problem": vars(problem)}
  for strategy in ("all_gather", "ragged_all_to_all"):
    c = cfg.replace(expert_parallel=strategy)
    with sharding.mesh_context(mesh):
      text = _grad(c).lower(variables, x).compile().as_text()
    row[strategy] = {
        "hlo": hlo.sent_bytes(text, DEVICES, "shard_map"),
        "model": vars(
            ep_traffic.traffic(problem, strategy, strategy != "all_gather")
        ),
    }
  ragged = cfg.replace(expert_parallel="ragged_all_to_all")
  with (
      sharding.mesh_context(mesh),
      mock.patch.object(
          ragged_collectives, "needs_emulation", lambda *_: False
      ),
  ):
    lowered = _grad(ragged).lower(variables, x).as_text()
  rows = _real_rows(cfg, x, variables, DEVICES)
  # Out and back, forward and (transposed) backward; the forward's count
  # all-gather and the backward's offset all-to-alls as in the model.
  exchange = 2 * rows * problem.emb * problem.act_bytes
  counts = (DEVICES - 1) * DEVICES * problem.experts_per_device * 4
  offsets = 2 * 2 * (DEVICES - 1) * 4
  row["real_op"] = {
      "rows_leaving_per_device": rows,
      "forward": exchange + counts,
      "backward": exchange + offsets,
      "model": vars(ep_traffic.ragged_traffic(problem)),
      "buffers": _buffers(lowered),
  }
  return row


def model_table() -> list[dict]:
  rows = []
  for model, (emb, k, experts) in MODELS.items():
    for ep in MODEL_EP[model]:
      for tokens in TOKENS:
        p = ep_traffic.Problem(tokens, emb, k, ep, 2, max(1, experts // ep))
        gather = ep_traffic.all_gather_traffic(p)
        ragged = ep_traffic.ragged_traffic(p)
        rows.append({
            "model": model,
            "ep": ep,
            "tokens": tokens,
            "all_gather_bytes": gather.total,
            "ragged_bytes": ragged.total,
            "ratio": gather.total / ragged.total,
            "auto": ep_traffic.choose(p),
            "ms": {
                link: {
                    "all_gather": 1e3 * sum(gather.seconds(bw)),
                    "ragged_all_to_all": 1e3 * sum(ragged.seconds(bw)),
                }
                for link, bw in LINKS.items()
            },
        })
  return rows


def _kib(b: float) -> str:
  return f"{b / KIB:9.1f}"


def print_measured(rows: list[dict]) -> None:
  print(f"Measured on {DEVICES} simulated CPU devices (expert={DEVICES}), one")
  print("layer's forward / backward, KiB each device sends (= receives):\n")
  print(
      "| layer | strategy | HLO fwd | HLO bwd | model fwd | model bwd |\n"
      "|---|---|---|---|---|---|"
  )
  for r in rows:
    for strategy, label in (
        ("all_gather", "all_gather"),
        ("ragged_all_to_all", "ragged, emulated"),
    ):
      m = r[strategy]
      print(
          f"| {r['layer']} | {label} | {_kib(m['hlo']['forward'])} |"
          f" {_kib(m['hlo']['backward'])} | {_kib(m['model']['forward'])} |"
          f" {_kib(m['model']['backward'])} |"
      )
    real = r["real_op"]
    print(
        f"| {r['layer']} | ragged, real op (this routing) |"
        f" {_kib(real['forward'])} | {_kib(real['backward'])} |"
        f" {_kib(real['model']['forward'])} |"
        f" {_kib(real['model']['backward'])} |"
    )
  print("\nReal-op buffers (operand rows, output rows) in the lowered device")
  print("program, per layer:")
  for r in rows:
    print(f"  {r['layer']}: {r['real_op']['buffers']}")


def print_model(rows: list[dict]) -> None:
  links = list(LINKS)
  print("\nModelled per device per MoE layer, forward + backward, bf16:\n")
  header = (
      "| model | EP | tokens/device | all_gather MiB | ragged MiB | ratio |"
  )
  header += "".join(f" {link} ms (ag / ragged) |" for link in links)
  print(header + " auto |")
  print("|---" * (6 + len(links) + 1) + "|")
  for r in rows:
    times = "".join(
        f" {r['ms'][link]['all_gather']:.2f} / "
        f"{r['ms'][link]['ragged_all_to_all']:.2f} |"
        for link in links
    )
    print(
        f"| {r['model']} | {r['ep']} | {r['tokens']} |"
        f" {r['all_gather_bytes'] / 2**20:.1f} |"
        f" {r['ragged_bytes'] / 2**20:.1f} | {r['ratio']:.2f} |{times}"
        f" {r['auto']} |"
    )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", nargs="*", default=list(LAYERS))
  parser.add_argument("--json", help="also write the figures to this file")
  parser.add_argument(
      "--model-only", action="store_true", help="skip the compiled programs"
  )
  args = parser.parse_args(argv)
  measured = [] if args.model_only else [measure(n) for n in args.layers]
  modelled = model_table()
  if measured:
    print_measured(measured)
  print_model(modelled)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"measured": measured, "modelled": modelled}, f, indent=1)


if __name__ == "__main__":
  main()
