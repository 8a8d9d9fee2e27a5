"""Writes a tiny GPT-OSS checkpoint with MXFP4 experts, and the logits of
its dequantized model.

The released gpt-oss checkpoints store their routed experts in MXFP4
(config.json `quantization_config: {"quant_method": "mxfp4",
"modules_to_not_convert": [...]}`), every other tensor in bfloat16:

  model.layers.N.mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]
  model.layers.N.mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H/32]
  model.layers.N.mlp.experts.down_proj_blocks     uint8 [E, H, I/32, 16]
  model.layers.N.mlp.experts.down_proj_scales     uint8 [E, H, I/32]

Rows are output features (the in-memory [E, in, out] transposed; gate_up's
rows interleave gate and up), 32 input values share a scale byte s meaning
2 ** (s - 127), byte j of a block holds value 2j in its low nibble and
2j + 1 in its high one, a nibble indexing the E2M1 values (transformers'
`integrations.mxfp4.FP4_VALUES`).

This script draws a gpt_oss fixture model of scripts/make_hf_family_fixtures.py
(sinks, biases, clamped SwiGLU, YaRN, sliding / full layers; H = I = 64,
two blocks per row of both projections), quantizes its expert weights
with the OCP MX rule (a shared scale 2 ** (floor(log2 amax) - 2) per 32
values, values rounded to the nearest E2M1 number, saturating at 6) and
writes them in that layout, biases and the other tensors float32:

  tests/fixtures/hf/gpt_oss_mxfp4/
    config.json       save_pretrained's plus quantization_config
    model.safetensors the MXFP4 experts and the float tensors
    input_ids.npy, logits.npy, generate.npy, meta.json
                      as tests/fixtures/hf/README.md says, of the
                      DEQUANTIZED model

The reference is the model whose expert weights are transformers' own
dequantization of those bytes (`convert_moe_packed_tensors`, checked equal
to this script's), kept only when its routing and greedy choices win by
MIN_MARGIN; transformers' own load of the directory (which dequantizes on
a machine without Triton) must give its logits. Same venv as
scripts/make_hf_fixtures.py; from the repository root:

  /work/hf311/bin/python scripts/make_mxfp4_fixtures.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

import make_fp8_fixtures as fp8
import make_hf_family_fixtures as family
import make_hf_fixtures as base
import numpy as np
from safetensors.torch import save_file
import torch
import transformers
from transformers.integrations import mxfp4

NAMING = (
    'MXFP4 (the released layout): model.layers.N.mlp.experts.'
    '{gate_up_proj,down_proj}_{blocks,scales} (uint8 [E, out, in/32, 16] and '
    '[E, out, in/32]); biases and the rest float32, named as '
    'gpt_oss_sinks_swa_yarn'
)

MXFP4_BLOCK = 32
# The E2M1 values by nibble (transformers' FP4_VALUES): 0-7 positive, the
# sign bit 8.
E2M1 = torch.tensor(mxfp4.FP4_VALUES, dtype=torch.float32)
MXFP4_CONFIG = {
    'modules_to_not_convert': [
        'model.layers.*.self_attn',
        'model.layers.*.mlp.router',
        'model.embed_tokens',
        'lm_head',
    ],
    'quant_method': 'mxfp4',
}


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
  """(blocks uint8 [..., R, C/32, 16], scales uint8 [..., R, C/32]) of a
  float [..., R, C], C a multiple of 32: per 32 values along C the scale
  2 ** (floor(log2 amax) - 2) (E8M0, byte = exponent + 127; 1 for zeros),
  each value / scale rounded to the nearest E2M1 number (ties to the
  smaller magnitude, saturating at 6), value 2j in the low nibble of byte
  j, 2j + 1 in the high one."""
  *lead, cols = weight.shape
  groups = weight.reshape(*lead, cols // MXFP4_BLOCK, MXFP4_BLOCK)
  amax = groups.abs().amax(-1)
  exponent = torch.where(
      amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax)
  )
  scaled = groups / torch.exp2(exponent)[..., None]
  magnitudes = E2M1[:8]
  index = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)
  nibbles = index + 8 * ((scaled < 0) & (index > 0))
  pairs = nibbles.reshape(*nibbles.shape[:-1], MXFP4_BLOCK // 2, 2)
  blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
  return blocks, (exponent + 127).to(torch.uint8)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
  """float32 [..., R, C] of `quantize_mxfp4`'s bytes (this script's own
  reading, checked against transformers')."""
  low = E2M1[(blocks & 0x0F).long()]
  high = E2M1[(blocks >> 4).long()]
  values = torch.stack([low, high], -1).flatten(-2)  # [..., R, G, 32]
  values = values * torch.exp2(scales.float() - 127)[..., None]
  return values.flatten(-2)


def _mxfp4_state(model) -> tuple[dict, dict]:
  """(the files' tensors, the float state transformers' dequantization
  of them gives), hub names."""
  disk, float_state = {}, {}
  for name, tensor in fp8._hub_state(model).items():
    if not name.endswith(('experts.gate_up_proj', 'experts.down_proj')):
      disk[name] = float_state[name] = tensor
      continue
    # In memory [E, in, out]; on disk rows are outputs: [E, out, in].
    blocks, scales = quantize_mxfp4(tensor.transpose(1, 2).contiguous())
    disk[name + '_blocks'], disk[name + '_scales'] = blocks, scales
    theirs = mxfp4.convert_moe_packed_tensors(
        blocks, scales, dtype=torch.float32
    )
    ours = dequantize_mxfp4(blocks, scales).transpose(1, 2)
    if not torch.equal(theirs, ours):
      raise RuntimeError(f'{name}: two MXFP4 dequantizations disagree')
    float_state[name] = theirs.contiguous()
  return disk, float_state


def _mxfp4_fixture() -> base.Fixture:
  cfg = family.gpt_oss_base()
  cfg.update({
      'num_hidden_layers': 2,
      'layer_types': ['sliding_attention', 'full_attention'],
      # Two 32-value blocks per row of both projections.
      'intermediate_size': 64,
  })
  return base.Fixture(
      name='gpt_oss_mxfp4',
      purpose='',
      covers=[],
      config_cls='GptOssConfig',
      config=cfg,
      model_cls='GptOssForCausalLM',
      naming=NAMING,
      seed=28000,
  )


def _pick_mxfp4_seed(fixture: base.Fixture):
  for seed in range(fixture.seed, fixture.seed + base.SEED_TRIES):
    model = base.build(fixture)
    base.randomize(model, seed)
    disk, float_state = _mxfp4_state(model)
    model.load_state_dict(float_state, strict=True)
    ids = base.make_input_ids(seed, base.vocab_of(model))
    out = base.run_model(model, ids)
    if min(out['router_margin'], out['greedy_margin']) >= base.MIN_MARGIN:
      return seed, model, disk, ids, out
  raise RuntimeError(f'{fixture.name}: no seed with margins')


def write_mxfp4(out_root: pathlib.Path) -> None:
  fixture = _mxfp4_fixture()
  seed, model, disk, ids, out = _pick_mxfp4_seed(fixture)
  if not torch.equal(out['generated'], out['reference']):
    raise RuntimeError(f'{fixture.name}: generate != uncached greedy')
  directory = out_root / fixture.name
  if directory.exists():
    shutil.rmtree(directory)
  model.save_pretrained(directory)
  config = json.loads((directory / 'config.json').read_text())
  config['quantization_config'] = MXFP4_CONFIG
  (directory / 'config.json').write_text(json.dumps(config, indent=2) + '\n')
  save_file(disk, directory / 'model.safetensors', metadata={'format': 'pt'})
  np.save(directory / 'input_ids.npy', ids.numpy().astype(np.int32))
  np.save(directory / 'logits.npy', out['logits'].numpy().astype(np.float32))
  np.save(directory / 'generate.npy', out['generated'].numpy().astype(np.int32))
  theirs, refused = fp8.transformers_logits(directory, ids)
  if theirs is None:
    raise RuntimeError(f'{fixture.name}: transformers {refused}')
  diff = float((theirs - out['logits']).abs().max())
  if diff > 1e-5:
    raise RuntimeError(f'{fixture.name}: transformers off by {diff}')
  packed = sorted(n for n in disk if n.endswith(('_blocks', '_scales')))
  meta = {
      'fixture': fixture.name,
      'purpose': (
          'GPT-OSS (2 layers: sliding window 4, full; sinks, biases, clamped '
          'SwiGLU, YaRN as gpt_oss_sinks_swa_yarn) with its routed experts '
          'in the released MXFP4 layout: H = 64 and I = 64, two 32-value '
          'blocks per row of both projections.'
      ),
      'architecture': type(model).__name__,
      'model_type': model.config.model_type,
      'quantization_config': MXFP4_CONFIG,
      'expert_naming_on_disk': fixture.naming,
      'mxfp4_tensors': {
          n: [str(disk[n].dtype), list(disk[n].shape)] for n in packed
      },
      'scale_bytes_range': [
          int(min(disk[n].min() for n in packed if n.endswith('_scales'))),
          int(max(disk[n].max() for n in packed if n.endswith('_scales'))),
      ],
      'mxfp4_layout': (
          'blocks [E, out, in/32, 16] uint8: byte j of a block holds value 2j '
          '(low nibble) and 2j + 1 (high nibble), a nibble indexing the E2M1 '
          'values [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, '
          '-6]; scales [E, out, in/32] uint8, value = e2m1 * 2 ** (scale - '
          '127); W_disk[e] = W_memory[e].T, so gate_up rows are interleaved '
          '(gate = even rows, up = odd)'
      ),
      'quantizer': (
          'OCP MX: scale 2 ** (floor(log2 amax) - 2) per 32 values, nearest '
          'E2M1 value (ties to the smaller magnitude), saturating at 6'
      ),
      'reference': (
          'logits.npy, generate.npy: the model with every expert tensor '
          "replaced by transformers' convert_moe_packed_tensors(blocks, "
          "scales, float32) (checked equal to this script's dequantization)"
      ),
      'transformers_cpu_mxfp4_load': (
          'from_pretrained dequantizes it (without Triton, as here); logits '
          'max abs diff '
          f'{diff:.1e} from the reference'
      ),
      'float_tensors': sorted(n for n in disk if n not in packed),
      'files': (
          sorted(p.name for p in directory.iterdir())
          + ['input_ids.npy', 'logits.npy', 'generate.npy']
      ),
      'dtype': 'float32',
      **base.run_meta(seed, out),
  }
  (directory / 'meta.json').write_text(json.dumps(meta, indent=2) + '\n')
  size = sum(p.stat().st_size for p in directory.iterdir())
  print(
      f'{fixture.name}: seed {seed}, {size / 1024:.0f} KB; transformers'
      f' {diff:.1e}'
  )


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', type=pathlib.Path, default=base.FIXTURES)
  args = parser.parse_args(argv)
  torch.set_num_threads(1)
  torch.use_deterministic_algorithms(True)
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  write_mxfp4(args.out)


if __name__ == '__main__':
  main(sys.argv[1:])
