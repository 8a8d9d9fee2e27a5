"""The quantization x path matrix: does every cell train, really quantized?

A cell is (config, quantization, path, layers, front end). Running it builds
the reference decoder, compiles one training step, reads the compiled HLO for
the quantized element types, runs two steps and checks that the loss is
finite, the parameters moved and (fp8 flavours) every call site's fp8 state
moved and differs from every other site's.
"""

from __future__ import annotations

from collections.abc import Iterator
import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linen_moe import MATMUL_PATHS
from linen_moe import hlo
from linen_moe import load_model_config
from linen_moe import testing
from linen_moe.quantization import MODES
from linen_moe.training import FRONTENDS as _FRONTENDS
from linen_moe.training import MarkovData
from linen_moe.training import default_optimizer
from linen_moe.training import frontend
from linen_moe_cli.model_args import LAYERS
import nnx_adapter  # noqa: F401 (registers the "nnx" front end)

FRONTENDS = tuple(_FRONTENDS)

PATH_TITLES = {
    "sparse": "sparse (gmm)",
    "dense": "dense",
    "dense_dropping": "dense + dropping",
}
CONFIGS = testing.TINY_CONFIGS
# The whole-model families (`FAMILY_CONFIGS`), each in every quantization
# mode on one (path, layers, front end): the fewest cells that show every
# mode trains each (24 beside the 192 of the product; the layer's paths are
# the product's), the families spread over the paths, layers and front ends.
FAMILY_CELLS = {  # one entry per FAMILY_CONFIGS name (tested)
    "tiny_deepseek_v3_mla": ("sparse", "scanned", "linen"),
    "tiny_gemma4_text": ("dense", "unrolled", "nnx"),
    "tiny_gpt_oss": ("dense_dropping", "unrolled", "nnx"),
    "tiny_llama4": ("sparse", "unrolled", "linen"),
    "tiny_glm4_moe": ("dense", "scanned", "nnx"),
    "tiny_minimax_m2": ("sparse", "scanned", "nnx"),
}
MATRIX_LEARNING_RATE = 1e-3
# The element types a compiled training step must feed its contractions.
EXPECTED_TYPES = {name: mode.hlo_types for name, mode in MODES.items()}


@dataclasses.dataclass(frozen=True)
class Cell:
  config: str
  quantization: str
  path: str
  layers: str = "scanned"
  frontend: str = "linen"

  def model_config(self, **overrides: Any):
    # A scanned cell compiles the stack's loop (scan_unroll=1), as every
    # stack longer than scan.AUTO_UNROLL_MAX_LENGTH does: the tiny configs'
    # short stacks would otherwise run in line, the unrolled cells' program.
    # (An unrolled cell has no stack: the field does nothing there.)
    return load_model_config(
        self.config,
        quantization=self.quantization,
        scan_layers=self.layers == "scanned",
        scan_unroll=1,
        **MATMUL_PATHS[self.path],
        **overrides,
    )


@dataclasses.dataclass
class CellResult:
  cell: Cell
  losses: tuple[float, ...] = ()
  quantized_types: frozenset[str] = frozenset()
  compile_s: float = 0.0
  step_s: float = 0.0
  error: str | None = None

  @property
  def ok(self) -> bool:
    return self.error is None

  def summary(self) -> str:
    if not self.ok:
      return f"FAILS: {self.error}"
    types = ",".join(sorted(self.quantized_types)) or "float"
    return f"trains {self.losses[0]:.3f}->{self.losses[1]:.3f} [{types}]"


def _site_states(fp8_state) -> dict[str, np.ndarray]:
  """Flattens fp8 state into one vector per call site (`.../wi_0_dot`)."""
  sites: dict[str, list[np.ndarray]] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(fp8_state):
    keys = [getattr(k, "key", getattr(k, "name", str(k))) for k in path]
    site = "/".join(str(k) for k in keys[:-1])
    sites.setdefault(site, []).append(np.ravel(np.asarray(leaf)))
  return {s: np.concatenate(v) for s, v in sites.items()}


def _any_changed(before, after) -> bool:
  moved = jax.tree.map(
      lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), before, after
  )
  return any(jax.tree.leaves(moved))


def check_trained(cell: Cell, before, after, losses) -> None:
  """Raises AssertionError unless the step trained as it should."""
  fe = frontend(cell.frontend)
  if not all(np.isfinite(losses)):
    raise AssertionError(f"non-finite loss {losses}")
  if not losses[1] < losses[0]:
    raise AssertionError(f"loss did not fall on the same batch: {losses}")
  if not _any_changed(fe.params(before), fe.params(after)):
    raise AssertionError("no parameter changed")
  rate = cell.model_config().moe.routed_bias_update_rate
  if rate > 0 and not _any_changed(fe.rule_state(before), fe.rule_state(after)):
    raise AssertionError("no routed_bias moved")
  if not MODES[cell.quantization].keeps_state:
    return
  old, new = _site_states(fe.fp8_state(before)), _site_states(
      fe.fp8_state(after)
  )
  if not new:
    raise AssertionError("no fp8 state found")
  frozen = [s for s in new if np.array_equal(old[s], new[s])]
  if frozen:
    raise AssertionError(f"fp8 state did not move at {frozen}")
  names = sorted(new)
  for a, b in itertools.combinations(names, 2):
    if np.array_equal(new[a], new[b]):
      raise AssertionError(f"fp8 state of {a} equals that of {b}")


def run_cell(
    cell: Cell, batch: int = 2, seq: int = 8, **overrides: Any
) -> CellResult:
  """Compiles and runs two training steps of one cell; never raises."""
  result = CellResult(cell)
  try:
    cfg = cell.model_config(**overrides)
    fe = frontend(cell.frontend)
    optimizer = default_optimizer(MATRIX_LEARNING_RATE)
    tokens = jnp.asarray(next(MarkovData(cfg.vocab_size).batches(batch, seq)))
    rng = jax.random.key(0)
    state = fe.init(cfg, optimizer, tokens, rng)
    start = time.perf_counter()
    compiled = (
        jax.jit(fe.make_step(cfg, optimizer))
        .lower(state, tokens, rng)
        .compile()
    )
    result.compile_s = time.perf_counter() - start
    result.quantized_types = frozenset(
        hlo.quantized_types_at_contractions(compiled.as_text())
    )
    expected = EXPECTED_TYPES[cell.quantization]
    missing = expected - result.quantized_types
    if missing:
      raise AssertionError(
          f"compiled step lacks quantized types {sorted(missing)} (found "
          f"{sorted(result.quantized_types) or 'none'})"
      )
    if not MODES[cell.quantization].quantized and result.quantized_types:
      raise AssertionError(
          f"unquantized step holds {sorted(result.quantized_types)}"
      )
    state1, m1 = compiled(state, tokens, jax.random.key(1))
    start = time.perf_counter()
    # The same batch again: a step that trains lowers its loss on it.
    state2, m2 = compiled(state1, tokens, jax.random.key(2))
    jax.block_until_ready(state2)
    result.step_s = time.perf_counter() - start
    result.losses = (float(m1["loss"]), float(m2["loss"]))
    check_trained(cell, state, state2, result.losses)
  except Exception as e:  # noqa: BLE001 (a cell reports any failure)
    result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return result


def _run_group(cells: list[Cell]) -> list[CellResult]:
  return [run_cell(cell) for cell in cells]


def run_cells(
    groups: list[list[Cell]], workers: int = 1
) -> Iterator[list[CellResult]]:
  """Runs groups of cells, yielding each group's results in order.

  With `workers` > 1, cells run in that many fresh processes (spawned, so
  each starts its own JAX) that compile side by side: a cell's time is mostly
  single-threaded XLA compilation. Each cell is one task, so a slow group does
  not hold a worker for long.
  """
  if workers <= 1:
    for group in groups:
      yield _run_group(group)
    return
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(workers, context) as pool:
    futures = [[pool.submit(run_cell, cell) for cell in g] for g in groups]
    for group in futures:
      yield [f.result() for f in group]


def cells(
    configs=CONFIGS,
    quantizations=tuple(MODES),
    paths=tuple(MATMUL_PATHS),
    layers=LAYERS,
    frontends=FRONTENDS,
) -> list[Cell]:
  product = itertools.product(configs, frontends, layers, quantizations, paths)
  return [
      Cell(config, quant, path, layer, fe)
      for config, fe, layer, quant, path in product
  ]


def family_cells(quantizations=tuple(MODES)) -> list[list[Cell]]:
  """One group per family config: its cells in every mode (`FAMILY_CELLS`)."""
  return [
      [Cell(config, q, path, layers, fe) for q in quantizations]
      for config, (path, layers, fe) in FAMILY_CELLS.items()
  ]


def format_table(results: list[CellResult]) -> str:
  """One table: rows quantization modes, columns the three paths."""
  first = results[0].cell
  lines = [
      f"config={first.config} frontend={first.frontend} layers={first.layers}"
  ]
  width = max(len(r.summary()) for r in results) + 2
  header = f"{'':<10}" + "".join(
      f"{PATH_TITLES[p]:<{width}}" for p in MATMUL_PATHS
  )
  lines.append(header)
  by_cell = {(r.cell.quantization, r.cell.path): r for r in results}
  for q in MODES:
    row = [
        by_cell[(q, p)].summary() if (q, p) in by_cell else "-"
        for p in MATMUL_PATHS
    ]
    if all(r == "-" for r in row):
      continue
    lines.append(f"{q:<10}" + "".join(f"{r:<{width}}" for r in row))
  return "\n".join(lines)
