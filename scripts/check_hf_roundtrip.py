"""Checks that transformers loads a checkpoint and reproduces given logits.

  /work/hf311/bin/python scripts/check_hf_roundtrip.py DIR INPUT_IDS.npy \\
      EXPECTED_LOGITS.npy [--tol 1e-4] [--generate GENERATE.npy]

DIR is a Hugging Face checkpoint directory (config.json and safetensors,
sharded or not), e.g. one this library saved. The script loads it with
`AutoModelForCausalLM.from_pretrained(DIR, output_loading_info=True)` in
float32 with eager attention, and fails if

  * transformers reports any missing, unexpected or mismatched key or load
    error;
  * the tensor names on disk are neither the names save_pretrained writes
    (the hub's per-expert names, `save_original_format=True`) nor
    transformers' in-memory names (fused experts,
    `save_original_format=False`): this also catches tensors transformers
    drops silently (its `_keys_to_ignore_on_load_unexpected`);
  * the logits of `model(input_ids).logits` differ from EXPECTED_LOGITS by
    more than --tol (max abs difference, printed either way);
  * with --generate, greedy `model.generate` from the first P tokens of
    INPUT_IDS (P = GENERATE's length minus --max-new-tokens) does not give
    GENERATE's tokens.

Exit status 0 when every check passes, 1 otherwise. It needs the venv the
fixtures script describes (scripts/make_hf_fixtures.py): torch and
transformers are not dependencies of this library.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np
from safetensors import safe_open
import torch
import transformers
from transformers import AutoModelForCausalLM

EAGER = {'attn_implementation': 'eager', 'experts_implementation': 'eager'}


def _disk_names(directory: pathlib.Path) -> dict[str, str]:
  """Tensor name -> dtype over every safetensors file the checkpoint uses."""
  index = directory / 'model.safetensors.index.json'
  if index.exists():
    files = sorted(set(json.loads(index.read_text())['weight_map'].values()))
  else:
    files = ['model.safetensors']
  names = {}
  for name in files:
    with safe_open(directory / name, 'pt') as f:
      for key in f.keys():
        if key in names:
          raise SystemExit(f'FAIL: {key} is in more than one shard')
        names[key] = str(f.get_slice(key).get_dtype())
  return names


def _expected_names(model) -> dict[str, set[str]]:
  """The two name sets transformers itself writes for this model."""
  # The functions save_pretrained calls: it drops tied weights, then
  # reverts its in-memory renamings (fused experts -> per-expert names).
  from transformers.core_model_loading import revert_weight_conversion
  from transformers.modeling_utils import remove_tied_weights_from_state_dict

  state = remove_tied_weights_from_state_dict(model.state_dict(), model)
  fused = set(state)
  # Without the conversions recorded at load time (a fused checkpoint
  # loads with none), revert_weight_conversion uses transformers' default
  # mapping for the model type: the hub's original names.
  loaded_with = getattr(model, '_weight_conversions', None)
  model._weight_conversions = None
  try:
    original = set(revert_weight_conversion(model, dict(state)))
  finally:
    model._weight_conversions = loaded_with
  if original == fused:
    return {'fused (the only form transformers writes for it)': fused}
  return {'per-expert (original format)': original, 'fused': fused}


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('directory', type=pathlib.Path)
  parser.add_argument('input_ids', type=pathlib.Path)
  parser.add_argument('expected_logits', type=pathlib.Path)
  parser.add_argument('--tol', type=float, default=1e-4)
  parser.add_argument('--generate', type=pathlib.Path, default=None)
  parser.add_argument('--max-new-tokens', type=int, default=8)
  args = parser.parse_args(argv)
  torch.set_num_threads(1)
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()

  failures = []
  try:
    model, info = AutoModelForCausalLM.from_pretrained(
        args.directory, dtype=torch.float32, output_loading_info=True, **EAGER
    )
  except Exception as error:  # noqa: BLE001 - report any load failure
    print(f'FAIL: transformers could not load {args.directory}: {error!r}')
    return 1
  model.eval()
  print(f'loaded {type(model).__name__} from {args.directory}')
  for kind, keys in info.items():
    if keys:
      failures.append(f'{kind}: {sorted(keys)}')

  on_disk = _disk_names(args.directory)
  dtypes = sorted(set(on_disk.values()))
  print(f'{len(on_disk)} tensors on disk, dtypes {dtypes}')
  candidates = _expected_names(model)
  matched = [k for k, names in candidates.items() if names == set(on_disk)]
  if matched:
    print(f'tensor names: {matched[0]}')
  else:
    kind, names = min(
        candidates.items(), key=lambda kv: len(kv[1] ^ set(on_disk))
    )
    extra = sorted(set(on_disk) - names)
    missing = sorted(names - set(on_disk))
    failures.append(
        'tensor names match no form transformers writes; against the '
        f'{kind} form, on disk but not expected: {extra}; expected but not '
        f'on disk: {missing}'
    )

  input_ids = torch.from_numpy(np.load(args.input_ids).astype(np.int64))
  expected = np.load(args.expected_logits)
  with torch.no_grad():
    logits = model(input_ids, use_cache=False).logits.float().numpy()
  if logits.shape != expected.shape:
    failures.append(f'logits shape {logits.shape} != {expected.shape}')
  else:
    diff = float(np.abs(logits - expected).max())
    print(f'max abs logit difference: {diff:.3e} (tolerance {args.tol:.0e})')
    if not diff <= args.tol:
      failures.append(f'logits differ by {diff:.3e} > {args.tol:.0e}')

  if args.generate is not None:
    want = np.load(args.generate)
    prompt_len = want.shape[1] - args.max_new_tokens
    prompt = input_ids[:, :prompt_len]
    with torch.no_grad():
      got = model.generate(
          prompt,
          attention_mask=torch.ones_like(prompt),
          max_new_tokens=args.max_new_tokens,
          do_sample=False,
          use_cache=True,
      ).numpy()
    if got.shape != want.shape or not np.array_equal(got, want):
      failures.append(f'generate gave {got.tolist()}, expected {want.tolist()}')
    else:
      print(f'generate: {args.max_new_tokens} greedy tokens match')

  for failure in failures:
    print(f'FAIL: {failure}')
  if not failures:
    print('OK')
  return 1 if failures else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
