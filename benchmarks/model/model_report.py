"""The whole-model benchmark's tables: ours beside the peer, and where a
run stands against the project's goals."""

from __future__ import annotations

from typing import Any

from common import host_memory


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
