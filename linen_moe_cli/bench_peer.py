"""Peer results for `linen-moe bench --peer`: another library's step times.

A peer file is JSON measured elsewhere (e.g. MaxText's MoE layer on the same
machine, forward+backward of the same shapes), so that both libraries share
one table and one chart:

  {"name": "MaxText 0.2.5",
   "rows": [{"size": "gemma_like", "path": "dense_dropping",
             "dtype": "float32", "step_s": 1.64}, ...]}

`size` is a key of `bench.SIZES` (or a sweep's case name such as "E=64"),
`path` one of `linen_moe.config.PATHS`, `dtype` defaults to float32. A row
may carry "error" instead of "step_s" (e.g. out of memory).
"""

from __future__ import annotations

import json
from typing import Any


def load_peer(path: str) -> dict[str, Any]:
  """Reads and checks a peer file; ValueError names what is wrong."""
  try:
    with open(path, encoding="utf-8") as f:
      peer = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"--peer {path!r}: cannot read JSON ({e}).") from e
  if not isinstance(peer, dict) or not isinstance(peer.get("rows"), list):
    raise ValueError(
        f"--peer {path!r}: expected an object with a 'rows' list; got"
        f" {type(peer).__name__} with keys"
        f" {sorted(peer) if isinstance(peer, dict) else []}."
    )
  peer.setdefault("name", "peer")
  for i, row in enumerate(peer["rows"]):
    missing = {"size", "path"} - set(row)
    if missing or not ("step_s" in row or "error" in row):
      raise ValueError(
          f"--peer {path!r}: row {i} {row} needs 'size', 'path' and "
          "'step_s' (seconds) or 'error'."
      )
    row.setdefault("dtype", "float32")
  return peer


def peer_row(peer: dict[str, Any] | None, row: dict[str, Any]):
  """The peer's row for our `row` (same size, path, dtype), or None."""
  if peer is None:
    return None
  for p in peer["rows"]:
    if (p["size"], p["path"], p["dtype"]) == (
        row["size"],
        row["path"],
        row.get("dtype", "float32"),
    ):
      return p
  return None
