"""Writes tiny block-fp8 checkpoints and the logits of their dequantized model.

The released DeepSeek-V3 and Qwen3-FP8 checkpoints store their linear
weights as float8_e4m3fn, each beside a `weight_scale_inv` with one float
scale per [bm, bn] block of W [out, in] (`quantization_config: {
"quant_method": "fp8", "weight_block_size": [bm, bn]}` in config.json;
the last row and column of blocks may be partial). This script writes
tiny checkpoints in that layout, and what transformers computes for them,
with the venv of scripts/make_hf_fixtures.py (plus `accelerate`, which
transformers needs to load an fp8 checkpoint):

  tests/fixtures/hf/<fixture>/
    config.json, generation_config.json
                      save_pretrained's, plus quantization_config (and for
                      DeepSeek-V3, num_nextn_predict_layers 1)
    model.safetensors fp8 weights and float32 scales for every tensor of a
                      module transformers makes an FP8Linear or FP8Experts
                      (attention, dense and shared MLPs, every routed
                      expert, per-expert hub names); norms, embeddings,
                      routers and lm_head float32. DeepSeek-V3's also hold
                      a multi-token-prediction layer past
                      num_hidden_layers, fp8 like the release's.
    input_ids.npy, logits.npy, generate.npy, meta.json
                      as tests/fixtures/hf/README.md says, of the
                      DEQUANTIZED model (float32 weights fp8 * scale).

How: a fixture model of scripts/make_hf_fixtures.py is drawn from a seed;
the tensors save_pretrained would write are quantized block by block by
this script (scale max|block| / 448, values rounded to e4m3) and
dequantized by transformers' own `_dequantize_fp8_weight` (its code for
this layout, partial blocks included) into a float model, the reference.
A seed is kept only when the reference's routing and greedy choices win by
MIN_MARGIN. Then transformers loads the fp8 directory itself
(`from_pretrained`, which without a GPU dequantizes on load): its logits
must be the reference's. It can only where every block is whole or the
tensor is smaller than one block: its CPU dequantization derives the
block from the scale grid and refuses a partial block (rows % scale rows
!= 0); meta.json records its answer.

  /work/venv-hf/bin/python scripts/make_fp8_fixtures.py
  /work/venv-hf/bin/python scripts/make_fp8_fixtures.py --check DIR \\
      INPUT_IDS.npy LOGITS.npy

`--check` loads DIR (a block-fp8 checkpoint, e.g. one this library
saved) with transformers and fails unless it loads with no missing or
mismatched key and its logits are LOGITS to --tol.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import shutil
import sys
import tempfile

import make_hf_fixtures as base
import numpy as np
from safetensors.torch import save_file
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.integrations import finegrained_fp8

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE = '_scale_inv'


@dataclasses.dataclass
class Fp8Fixture:
  name: str
  purpose: str
  fixture: base.Fixture
  block: tuple[int, int]
  mtp: bool = False  # add a multi-token-prediction layer, as DeepSeek-V3


def _fixtures() -> list[Fp8Fixture]:
  deepseek = base.Fixture(
      name='deepseek_v3_fp8_block128',
      purpose='',
      covers=[],
      config_cls='DeepseekV3Config',
      config={**base.deepseek_base(), 'num_hidden_layers': 2},
      model_cls='DeepseekV3ForCausalLM',
      naming=base.DEEPSEEK_PER_EXPERT,
      seed=11000,
  )
  qwen = base.qwen_base()
  # Dims that are no multiple of 16: partial blocks at the right and the
  # bottom edge of every matrix (q_proj [48, 40], k_proj [24, 40],
  # o_proj [40, 48], the dense MLP [36, 40], the experts [20, 40]).
  qwen.update({
      'hidden_size': 40,
      'head_dim': 12,
      'intermediate_size': 36,
      'moe_intermediate_size': 20,
  })
  qwen3 = base.Fixture(
      name='qwen3_moe_fp8_block16',
      purpose='',
      covers=[],
      config_cls='Qwen3MoeConfig',
      config=qwen,
      model_cls='Qwen3MoeForCausalLM',
      naming=base.QWEN_PER_EXPERT,
      seed=12000,
  )
  return [
      Fp8Fixture(
          name=deepseek.name,
          purpose=(
              'DeepSeek-V3 in its released layout, block [128, 128]: every '
              'tensor is smaller than a block (one partial block each); MLA '
              'with q_lora, group routing, a dense layer then a MoE layer, '
              'and a multi-token-prediction layer (model.layers.2.*, fp8 '
              'too) past num_hidden_layers=2 with num_nextn_predict_layers '
              '1, which a loader skips.'
          ),
          fixture=deepseek,
          block=(128, 128),
          mtp=True,
      ),
      Fp8Fixture(
          name=qwen3.name,
          purpose=(
              'Qwen3-MoE, block [16, 16] on dims that are no multiple of 16: '
              'partial blocks at the bottom and right edge of every fp8 '
              'matrix; a dense layer 0 then MoE layers, q/k norms.'
          ),
          fixture=qwen3,
          block=(16, 16),
      ),
  ]


def _hub_state(model) -> dict[str, torch.Tensor]:
  """The tensors save_pretrained writes (hub names, tied ones dropped)."""
  from transformers.core_model_loading import revert_weight_conversion
  from transformers.modeling_utils import remove_tied_weights_from_state_dict

  state = remove_tied_weights_from_state_dict(model.state_dict(), model)
  state = revert_weight_conversion(model, state)
  return {k: v.detach().contiguous() for k, v in sorted(state.items())}


def _fp8_names(model, names) -> set[str]:
  """The tensors transformers loads into an FP8Linear / FP8Experts
  (`replace_with_fp8_linear`: every plain nn.Linear and every `.experts`
  module, but lm_head, its default skip)."""
  linear = {
      f'{name}.weight'
      for name, module in model.named_modules()
      if type(module) is torch.nn.Linear and name != 'lm_head'
  }
  experts = {n for n in names if '.experts.' in n and n.endswith('.weight')}
  return (linear & set(names)) | experts


def quantize(weight: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
  """(fp8 [r, c], float32 scale_inv [ceil(r/bm), ceil(c/bn)]) of a float
  [r, c]: per block, scale max|block| / 448 (1 for zeros), values
  block / scale rounded to e4m3."""
  bm, bn = block
  rows, cols = weight.shape
  scales = torch.ones(math.ceil(rows / bm), math.ceil(cols / bn))
  values = torch.empty(rows, cols, dtype=FP8)
  for i in range(scales.shape[0]):
    for j in range(scales.shape[1]):
      at = (slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn))
      amax = weight[at].abs().max()
      if amax > 0:
        scales[i, j] = amax / FP8_MAX
      values[at] = (weight[at] / scales[i, j]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
  return values, scales


def _numpy_dequantize(values, scales, block) -> np.ndarray:
  """A second dequantization, by whole-tensor expansion of the scales."""
  rows, cols = values.shape
  grid = np.repeat(np.repeat(scales.numpy(), block[0], 0), block[1], 1)
  return values.float().numpy() * grid[:rows, :cols]


def _quantized(model, block) -> tuple[dict, dict]:
  """(the fp8 files' tensors, the dequantized float tensors), hub names."""
  state = _hub_state(model)
  fp8 = _fp8_names(model, state)
  disk, float_state = {}, {}
  for name, tensor in state.items():
    if name not in fp8:
      disk[name] = float_state[name] = tensor
      continue
    values, scales = quantize(tensor, block)
    disk[name], disk[name + SCALE] = values, scales
    weight = finegrained_fp8._dequantize_fp8_weight(
        values, scales, list(block), torch.float32
    )
    if not np.array_equal(
        weight.numpy(), _numpy_dequantize(values, scales, block)
    ):
      raise RuntimeError(f'{name}: two dequantizations disagree')
    float_state[name] = weight
  return disk, float_state


def _mtp_tensors(disk: dict, layers: int, block) -> dict[str, torch.Tensor]:
  """A multi-token-prediction layer `layers` as DeepSeek-V3 stores it
  (model.layers.61.* there): the last layer's tensors plus eh_proj (fp8),
  enorm, hnorm, its own embedding and shared head."""
  last = f'model.layers.{layers - 1}.'
  mtp = f'model.layers.{layers}.'
  out = {
      mtp + k[len(last) :]: v.clone()
      for k, v in disk.items()
      if k.startswith(last)
  }
  hidden = disk['model.embed_tokens.weight'].shape[1]
  gen = torch.Generator().manual_seed(layers)
  eh = 0.1 * torch.randn(hidden, 2 * hidden, generator=gen)
  out[mtp + 'eh_proj.weight'], out[mtp + 'eh_proj.weight' + SCALE] = quantize(
      eh, block
  )
  for norm in ('enorm', 'hnorm', 'shared_head.norm'):
    out[f'{mtp}{norm}.weight'] = torch.ones(hidden)
  out[mtp + 'embed_tokens.weight'] = disk['model.embed_tokens.weight'].clone()
  out[mtp + 'shared_head.head.weight'] = disk['lm_head.weight'].clone()
  return out


def _reference(fixture: base.Fixture, model, float_state) -> torch.nn.Module:
  """The fixture's model with the dequantized weights, through
  save_pretrained's files (transformers' own renaming on load)."""
  with tempfile.TemporaryDirectory() as tmp:
    model.save_pretrained(tmp)
    save_file(
        float_state,
        pathlib.Path(tmp) / 'model.safetensors',
        metadata={'format': 'pt'},
    )
    ref, info = AutoModelForCausalLM.from_pretrained(
        tmp, dtype=torch.float32, output_loading_info=True, **base.EAGER
    )
  bad = {k: v for k, v in info.items() if v}
  if bad:
    raise RuntimeError(f'{fixture.name}: reference loading info {bad}')
  return ref.eval()


def _pick_seed(spec: Fp8Fixture):
  fixture = spec.fixture
  for seed in range(fixture.seed, fixture.seed + base.SEED_TRIES):
    model = base.build(fixture)
    base.randomize(model, seed)
    disk, float_state = _quantized(model, spec.block)
    ref = _reference(fixture, model, float_state)
    ids = base.make_input_ids(seed, base.vocab_of(ref))
    out = base.run_model(ref, ids)
    if min(out['router_margin'], out['greedy_margin']) >= base.MIN_MARGIN:
      return seed, model, disk, ids, out
  raise RuntimeError(f'{spec.name}: no seed with margins')


def transformers_logits(directory: pathlib.Path, ids, allowed_unexpected=''):
  """transformers' logits of a block-fp8 directory (dequantized on load
  without a GPU), or the error it raises; any missing, mismatched or
  unexpected key (but names starting with `allowed_unexpected`) is one."""
  try:
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True, **base.EAGER
    )
  except Exception as error:  # noqa: BLE001 - recorded, not hidden
    return None, f'{type(error).__name__}: {str(error)[:400]}'
  unexpected = [
      k
      for k in info.get('unexpected_keys', ())
      if not (allowed_unexpected and k.startswith(allowed_unexpected))
  ]
  bad = {k: sorted(v) for k, v in info.items() if v and k != 'unexpected_keys'}
  if unexpected:
    bad['unexpected_keys'] = sorted(unexpected)
  if bad:
    return None, f'loading info {bad}'
  with torch.no_grad():
    return model.eval()(ids, use_cache=False).logits, None


def _why(disk: dict, block) -> str:
  """What transformers' CPU dequantization says of the first fp8 tensor
  with a partial block."""
  for name, values in disk.items():
    scales = disk.get(name + SCALE)
    if scales is None or not any(
        n % b for n, b in zip(values.shape, block, strict=True)
    ):
      continue
    try:
      finegrained_fp8.Fp8Dequantize(None)._dequantize_one(values, scales)
    except ValueError as error:
      return f'its Fp8Dequantize on {name}: {error}'
    return f'its Fp8Dequantize accepts {name}'
  return 'no tensor has a partial block'


def _write(spec: Fp8Fixture, out_root: pathlib.Path) -> None:
  seed, model, disk, ids, out = _pick_seed(spec)
  if not torch.equal(out['generated'], out['reference']):
    raise RuntimeError(f'{spec.name}: generate != uncached greedy')
  directory = out_root / spec.name
  if directory.exists():
    shutil.rmtree(directory)
  model.save_pretrained(directory)
  config = json.loads((directory / 'config.json').read_text())
  quantization = {
      'activation_scheme': 'dynamic',
      'fmt': 'e4m3',
      'quant_method': 'fp8',
      'weight_block_size': list(spec.block),
  }
  config['quantization_config'] = quantization
  layers = config['num_hidden_layers']
  if spec.mtp:
    config['num_nextn_predict_layers'] = 1
    disk |= _mtp_tensors(disk, layers, spec.block)
  (directory / 'config.json').write_text(json.dumps(config, indent=2) + '\n')
  save_file(disk, directory / 'model.safetensors', metadata={'format': 'pt'})
  np.save(directory / 'input_ids.npy', ids.numpy().astype(np.int32))
  logits = out['logits'].numpy().astype(np.float32)
  np.save(directory / 'logits.npy', logits)
  np.save(directory / 'generate.npy', out['generated'].numpy().astype(np.int32))
  mtp = f'model.layers.{layers}.' if spec.mtp else ''
  theirs, refused = transformers_logits(directory, ids, mtp)
  if theirs is not None:
    diff = float((theirs - out['logits']).abs().max())
    if diff > 1e-5:
      raise RuntimeError(f'{spec.name}: transformers off by {diff}')
    load = f'loads it, logits max abs diff {diff:.1e} from the reference'
  else:
    load = f'refuses it: {refused}; {_why(disk, spec.block)}'
  fp8 = sorted(n for n in disk if n + SCALE in disk)
  meta = {
      'fixture': spec.name,
      'purpose': spec.purpose,
      'architecture': type(model).__name__,
      'model_type': model.config.model_type,
      'quantization_config': quantization,
      'fp8_tensors': len(fp8),
      'fp8_tensor_names_example': fp8[:3],
      'float_tensors': sorted(
          n for n in disk if n not in fp8 and SCALE not in n
      ),
      'mtp_layer': mtp or None,
      'reference': (
          'logits.npy, generate.npy: the fixture model with every fp8 '
          "tensor replaced by transformers' _dequantize_fp8_weight(fp8, "
          'scale_inv, weight_block_size, float32) (checked equal to a NumPy '
          'dequantization), loaded by from_pretrained in float32'
      ),
      'transformers_cpu_fp8_load': load,
      'files': (
          sorted(p.name for p in directory.iterdir())
          + ['input_ids.npy', 'logits.npy', 'generate.npy']
      ),
      **base.run_meta(seed, out),
  }
  (directory / 'meta.json').write_text(json.dumps(meta, indent=2) + '\n')
  size = sum(p.stat().st_size for p in directory.iterdir())
  print(f'{spec.name}: seed {seed}, {size / 1024:.0f} KB; transformers {load}')


def check(directory: pathlib.Path, ids_path, logits_path, tol: float) -> int:
  ids = torch.from_numpy(np.load(ids_path).astype(np.int64))
  logits, refused = transformers_logits(directory, ids)
  if logits is None:
    print(f'FAIL: transformers {refused}')
    return 1
  diff = float(np.abs(logits.numpy() - np.load(logits_path)).max())
  print(f'transformers loaded {directory}; max abs logit diff {diff:.2e}')
  if not diff <= tol:
    print(f'FAIL: over {tol:.0e}')
    return 1
  print('OK')
  return 0


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', type=pathlib.Path, default=base.FIXTURES)
  parser.add_argument('--only', action='append', default=None)
  parser.add_argument('--check', nargs=3, type=pathlib.Path, default=None)
  parser.add_argument('--tol', type=float, default=1e-4)
  args = parser.parse_args(argv)
  torch.set_num_threads(1)
  torch.use_deterministic_algorithms(True)
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  if args.check:
    return check(*args.check, args.tol)
  for spec in _fixtures():
    if args.only is None or spec.name in args.only:
      _write(spec, args.out)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
