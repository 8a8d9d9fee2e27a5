"""Trains each shipped config named after a Hugging Face family with the
command line, exports it with `linen-moe export --format hf`, and checks in
transformers that the export loads and computes our logits.

Two halves, in two venvs (CI has no torch):

  # 1. this project's venv: for tiny_mixtral, tiny_qwen3_moe,
  #    tiny_gemma4_text and tiny_deepseek_v3_mla, `linen-moe tokenizer
  #    train` (64 tokens of the license texts), `linen-moe train` (3 steps
  #    on those texts, in WORK/NAME/run) and `linen-moe export --format hf`
  #    (WORK/NAME/hf); then our float32 logits of the trained checkpoint on
  #    two rows of the texts' ids (WORK/NAME/input_ids.npy, logits.npy).
  .venv/bin/python scripts/make_export_fixtures.py ours --work WORK

  # 2. the fixture venv of scripts/make_hf_fixtures.py (torch,
  #    transformers): scripts/check_hf_roundtrip.py on each export (no
  #    missing, unexpected or mismatched key; the names save_pretrained
  #    writes; logits within 1e-4), `AutoTokenizer` on the export gives the
  #    tokenizer.json's ids, and `GenerationConfig` its stop id.
  python scripts/make_export_fixtures.py transformers --work WORK

The second half writes tests/fixtures/hf_export/NAME/: the export's
`config.json`, `tensors.json` (each tensor's name, shape and dtype) and
`transformers.json` (what transformers reported: the largest logit
difference, the tokenizer's ids, the stop id, the versions). The test suite
(tests/cli/test_cli_export_hf.py) checks that an export today writes that
config.json and those tensors, and (slow) that each config trained and
exported by the command line reads back with the trained logits.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "hf_export"
CONFIGS = ("tiny_mixtral", "tiny_qwen3_moe", "tiny_gemma4_text",
           "tiny_deepseek_v3_mla")  # fmt: skip
TEXT = "Permission is hereby granted, free of charge, to any person"
ROWS, LENGTH = 2, 12


def _cli(*argv: str) -> None:
  """Runs `linen-moe argv` (this venv's), as a user does."""
  command = [sys.executable, "-m", "linen_moe_cli.main", *argv]
  if subprocess.run(command, check=False).returncode:
    raise SystemExit(f"linen-moe {' '.join(argv)} failed")


def ours(work: pathlib.Path) -> None:
  import jax.numpy as jnp  # noqa: PLC0415

  from linen_moe import Decoder  # noqa: PLC0415
  from linen_moe import checkpoint  # noqa: PLC0415
  from linen_moe import data  # noqa: PLC0415
  from linen_moe import testing  # noqa: PLC0415

  if work.exists():
    shutil.rmtree(work)
  corpus = work / "corpus"
  corpus.mkdir(parents=True)
  for i, path in enumerate(testing.license_texts()):
    shutil.copy(path, corpus / f"{i:02d}.txt")
  tokenizer = work / "tokenizer.json"
  _cli("tokenizer", "train", *map(str, sorted(corpus.iterdir())),
       "--vocab-size", "64", "--out", str(tokenizer))  # fmt: skip
  tok = data.load_tokenizer(tokenizer)
  text = " ".join(p.read_text() for p in sorted(corpus.iterdir())[:2])
  ids = np.asarray(tok.encode(text).ids[: ROWS * LENGTH], np.int32)
  ids = ids.reshape(ROWS, LENGTH)
  for name in CONFIGS:
    run, out = work / name / "run", work / name / "hf"
    _cli("train", "--config", name, "--steps", "3", "--batch-size", "4",
         "--seq-len", "16", "--no-progress", "--data", str(corpus),
         "--tokenizer", str(tokenizer), "--checkpoint-dir", str(run))  # fmt: skip
    _cli("export", "--checkpoint-dir", str(run), "--out", str(out),
         "--format", "hf")  # fmt: skip
    config, variables, _ = checkpoint.read_variables(run)
    config = config.replace(quantization="none")
    logits, _ = Decoder(config).apply(variables, jnp.asarray(ids))
    np.save(work / name / "input_ids.npy", ids)
    np.save(work / name / "logits.npy", np.asarray(logits, np.float32))
    (work / name / "text.json").write_text(
        json.dumps({"text": TEXT, "ids": tok.encode(TEXT).ids}) + "\n"
    )
    print(f"{name}: trained, exported to {out}")


def _tensors(directory: pathlib.Path) -> dict[str, list]:
  from safetensors import safe_open  # noqa: PLC0415

  out = {}
  for path in sorted(directory.glob("*.safetensors")):
    with safe_open(path, "np") as f:
      for key in sorted(f.keys()):
        piece = f.get_slice(key)
        out[key] = [list(piece.get_shape()), piece.get_dtype()]
  return out


def transformers_half(work: pathlib.Path) -> None:
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  sys.path.insert(0, str(ROOT / "scripts"))
  import check_hf_roundtrip  # noqa: PLC0415

  failed = []
  for name in CONFIGS:
    export = work / name / "hf"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      status = check_hf_roundtrip.main([
          str(export), str(work / name / "input_ids.npy"),
          str(work / name / "logits.npy"), "--tol", "1e-4",
      ])  # fmt: skip
    report = printed.getvalue()
    print(f"== {name}\n{report}")
    diff = float(report.split("max abs logit difference: ")[1].split()[0])
    text = json.loads((work / name / "text.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(export)
    hf_ids = tok(text["text"])["input_ids"]
    generation = transformers.GenerationConfig.from_pretrained(export)
    checks = {
        "check_hf_roundtrip": "OK" if status == 0 else "FAIL",
        "max_abs_logit_difference": diff,
        "tokenizer_class": type(tok).__name__,
        "tokenizer_ids_match": hf_ids == text["ids"],
        "tokenizer_ids": hf_ids,
        "eos_token_id": generation.eos_token_id,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    print(json.dumps({k: v for k, v in checks.items() if k != "tokenizer_ids"}))
    if (
        status
        or not checks["tokenizer_ids_match"]
        or checks["eos_token_id"] != 0
    ):
      failed.append(name)
    target = OUT / name
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(export / "config.json", target / "config.json")
    (target / "tensors.json").write_text(
        json.dumps(_tensors(export), indent=1) + "\n"
    )
    (target / "transformers.json").write_text(
        json.dumps(checks, indent=2) + "\n"
    )
  if failed:
    raise SystemExit(f"FAIL: {failed}")
  print(f"OK: {len(CONFIGS)} exports; fixtures in {OUT}")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("half", choices=("ours", "transformers"))
  p.add_argument("--work", type=pathlib.Path, required=True)
  args = p.parse_args()
  if args.half == "ours":
    ours(args.work)
  else:
    transformers_half(args.work)


if __name__ == "__main__":
  main()
