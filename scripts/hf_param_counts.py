"""The released models' parameter counts, as transformers builds them.

Writes tests/fixtures/hf/param_counts.json: each model of configs/hf/<model>/
config.json built on the meta device (nothing allocated), with

  total_params      the sum of numel over model.parameters() (a tied
                    embedding counted once; persistent buffers such as
                    e_score_correction_bias listed apart)
  active_params     what one token's forward reads: total_params less the
                    routed experts it is not sent to, (E - k) / E of every
                    `*.experts` module's [E, ...] tensors (k the config's
                    num_experts_per_tok, Gemma-4's top_k_experts); shared
                    experts, dense layers, attention, routers, norms, the
                    whole embedding table and the head all count
  active_params_without_embedding
                    the same less the input embedding table when it is not
                    the head's (a token reads one row of it): the convention
                    of OpenAI's gpt-oss card
  model_card        (the newer families) the card's figures and the
                    relative differences, explained in `source`

and every tensor's name and shape in memory and on disk. Run from the
repository root with the venv of scripts/make_hf_fixtures.py (which calls
this for --param-counts):

  /work/hf311/bin/python scripts/hf_param_counts.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from typing import Any

import numpy as np
import torch
import transformers
from transformers import AutoConfig

REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = REPO / 'tests' / 'fixtures' / 'hf'
REAL_CONFIGS = REPO / 'configs' / 'hf'

# configs/hf/<name>/config.json -> the class transformers builds for it, and
# the keys dropped before building (they change no shapes).
REAL_MODELS = {
    'mixtral_8x7b': ('MixtralForCausalLM', []),
    'qwen3_30b_a3b': ('Qwen3MoeForCausalLM', []),
    'deepseek_v3': ('DeepseekV3ForCausalLM', ['quantization_config']),
    'gemma4_26b_a4b': ('Gemma4ForConditionalGeneration', []),
    'gpt_oss_120b': ('GptOssForCausalLM', ['quantization_config']),
    'gpt_oss_20b': ('GptOssForCausalLM', ['quantization_config']),
    'glm4_5': ('Glm4MoeForCausalLM', []),
    'glm4_5_air': ('Glm4MoeForCausalLM', []),
    'llama4_scout': ('Llama4ForConditionalGeneration', []),
    'llama4_maverick': ('Llama4ForConditionalGeneration', []),
    'minimax_m2': ('MiniMaxM2ForCausalLM', ['quantization_config']),
}
# Released values that transformers' typed configs refuse, read as the
# release's own transformers read them: (section, key) -> conversion.
COERCE = {
    'llama4_scout': {('text_config', 'attn_temperature_tuning'): bool},
    'llama4_maverick': {('text_config', 'attn_temperature_tuning'): bool},
}
# The multimodal classes and their text decoder alone.
TEXT_ONLY = {
    'Gemma4ForConditionalGeneration': 'Gemma4ForCausalLM',
    'Llama4ForConditionalGeneration': 'Llama4ForCausalLM',
}
# The model cards' figures (total, active per token, where they are stated).
MODEL_CARDS = {
    'gpt_oss_120b': (116.83e9, 5.13e9, "OpenAI's gpt-oss model card"),
    'gpt_oss_20b': (20.91e9, 3.61e9, "OpenAI's gpt-oss model card"),
    'glm4_5': (355e9, 32e9, 'zai-org/GLM-4.5 README'),
    'glm4_5_air': (106e9, 12e9, 'zai-org/GLM-4.5 README'),
    'llama4_scout': (109e9, 17e9, "Meta's Llama 4 model card"),
    'llama4_maverick': (400e9, 17e9, "Meta's Llama 4 model card"),
    'minimax_m2': (230e9, 10e9, 'MiniMaxAI/MiniMax-M2 model card'),
}

NOTES = {
    'mixtral_8x7b': (
        'mistralai/Mixtral-8x7B-v0.1 config.json as released (transformers '
        '4.36 style: rope_theta, torch_dtype), written from memory and '
        'checked against public copies; MixtralConfig defaults (its '
        'docstring checkpoint) agree except max_position_embeddings (131072 '
        'default, 32768 released) and router_aux_loss_coef (0.001, 0.02).'
    ),
    'qwen3_30b_a3b': (
        'Qwen/Qwen3-30B-A3B config.json as released (transformers 4.51 '
        'style), written from memory and checked against public copies; the '
        '-Base variant differs only in max_position_embeddings 32768 and '
        'eos_token_id 151643. Qwen3MoeConfig defaults are a smaller model '
        '(24 layers, norm_topk_prob False, no head_dim).'
    ),
    'deepseek_v3': (
        'deepseek-ai/DeepSeek-V3 config.json as released (transformers 4.33 '
        'style, rope_scaling type yarn), written from memory and checked '
        'against public copies; DeepseekV3Config defaults agree on every '
        'size (they differ in max_position_embeddings 4096 and no rope '
        'scaling). Unsure: whether the release also lists aux_loss_alpha '
        '(training only, omitted). The released weights are fp8 '
        '(quantization_config, dropped before building here): every fp8 '
        'linear also has a float32 <name>.weight_scale_inv [ceil(out/128), '
        'ceil(in/128)] on disk, not counted. transformers does not build '
        'the MTP layer (num_nextn_predict_layers 1, on disk as '
        'model.layers.61.*, ignored on load): not counted.'
    ),
    'gemma4_26b_a4b': (
        'google/gemma-4-26B-A4B config.json (multimodal '
        'Gemma4ForConditionalGeneration, transformers 5.5 style), as '
        'transcribed in MaxText (src/maxtext/checkpoint_conversion/utils/'
        'hf_model_configs.py, gemma4_26b_dict); the text sizes also agree '
        "with MaxText's gemma4-26b.yml and this repo's configs/"
        'gemma4_26b.yml. Least sure: the vision_config details (they do not '
        'touch the text model). text_only lists Gemma4ForCausalLM built '
        'from text_config alone (names model.*); the released checkpoint '
        'names the text tensors model.language_model.* and adds '
        'model.vision_tower.* and model.embed_vision.*.'
    ),
    'gpt_oss_120b': (
        'openai/gpt-oss-120b config.json as released (transformers '
        '4.55.0.dev0 style: rope_scaling, rope_theta; extra keys '
        'experts_per_token and initial_context_length that GptOssConfig '
        'keeps as plain attributes), written from memory and checked against '
        'public copies of the raw file (the same keys and values quoted in '
        "other projects' tests, with the layer-0 tensor names of its "
        'model.safetensors.index.json). GptOssConfig defaults agree on every '
        "size (they are gpt-oss-20b's but for 36 layers and 128 experts) "
        'except router_aux_loss_coef (0.001 default, 0.9 released). The '
        'released experts are MXFP4 (quantization_config, dropped before '
        'building here): on disk each layer has mlp.experts.gate_up_proj_'
        '{blocks [128, 5760, 90, 16], scales [128, 5760, 90]} and '
        'down_proj_{blocks [128, 2880, 90, 16], scales [128, 2880, 90]} '
        'uint8 instead of the float tensors listed; every other tensor is '
        'bfloat16.'
    ),
    'gpt_oss_20b': (
        "openai/gpt-oss-20b config.json as released: gpt_oss_120b's with "
        '24 layers and 32 experts (the GptOssConfig docstring checkpoint), '
        'written from memory and checked against public copies. MXFP4 '
        'experts as gpt_oss_120b (blocks [32, 5760, 90, 16] and '
        '[32, 2880, 90, 16]).'
    ),
    'glm4_5': (
        'zai-org/GLM-4.5 config.json as released (transformers 4.54 style: '
        'rope_theta, partial_rotary_factor at the top, rope_scaling null), '
        'written from memory and checked against public descriptions '
        "(Megatron-Bridge's GLM 4.5 page, slime's glm4.5-355B-A32B "
        'arguments: 92 layers, 3 dense, hidden 5120, FFN 12288, 96 / 8 '
        'heads of 128, q/k/v biases, rotary 0.5 at base 1e6, q/k norm, 160 '
        'experts top-8 of width 1536, one shared, scaling 2.5, vocabulary '
        '151552). Least sure: pad / eos token ids. Glm4MoeConfig defaults '
        "are GLM-4.5-Air's sizes. transformers does not build the MTP "
        'layer (num_nextn_predict_layers 1, on disk as model.layers.92.*, '
        'ignored on load): not counted (see not_built).'
    ),
    'glm4_5_air': (
        'zai-org/GLM-4.5-Air config.json as released, as glm4_5 with 46 '
        'layers (1 dense), hidden 4096, FFN 10944, 128 experts of width '
        '1408, routed_scaling_factor 1.0 and no q/k norm (the Glm4MoeConfig '
        "defaults, checked against Megatron-Bridge's and slime's "
        'GLM-4.5-Air descriptions). The MTP layer (model.layers.46.*) is '
        'not built: not counted (see not_built).'
    ),
    'llama4_scout': (
        'meta-llama/Llama-4-Scout-17B-16E config.json (multimodal '
        'Llama4ForConditionalGeneration, transformers 4.51 style) as quoted '
        'in public copies of the released file (rope_scaling llama3 factor '
        '8, low 1, high 4, original 8192; max_position_embeddings 262144; '
        'the -Instruct release differs in those two). Released with '
        '"attn_temperature_tuning": 4, an int that transformers 5\'s strict '
        'Llama4TextConfig (a bool field) refuses: read as True before '
        'building here (4.51 tested it for truth). text_only lists '
        'Llama4ForCausalLM built from text_config alone (names model.*); the '
        'released checkpoint names the text tensors language_model.model.* '
        'and language_model.lm_head.weight and adds vision_model.* and '
        'multi_modal_projector.*.'
    ),
    'llama4_maverick': (
        "meta-llama/Llama-4-Maverick-17B-128E config.json: llama4_scout's "
        'with 128 experts, interleave_moe_layer_step 2 (moe_layers 1, 3, '
        '..., 47: the others dense with intermediate_size_mlp 16384), '
        'use_qk_norm false, no rope scaling and max_position_embeddings '
        "1048576, as quoted in public copies (TensorRT-LLM's two-layer "
        'Maverick test config). attn_temperature_tuning 4 read as True, as '
        'for llama4_scout.'
    ),
    'minimax_m2': (
        'MiniMaxAI/MiniMax-M2 config.json (remote-code release, transformers '
        '4.46 style: rotary_dim, rope_theta), written from memory and '
        "checked against public copies (other projects' tests quoting "
        'its keys); MiniMaxM2Config defaults agree on every size. Keys '
        'transformers ignores and a loader must check: use_qk_norm true and '
        'qk_norm_type "per_layer" (q/k norms over all heads, what '
        'transformers always builds), scoring_func "sigmoid", '
        'use_routing_bias true, shared_intermediate_size 0, attn_type_list '
        '(all 1: softmax attention), use_mtp with num_mtp_modules 3 '
        '(transformers builds no MTP module; whether the release carries '
        'their weights is not known here). Least sure: shared_moe_mode and '
        'attn_type_list being present. The released weights are block-fp8 '
        '(quantization_config, [128, 128] blocks; gate, '
        'e_score_correction_bias and lm_head unquantized), dropped before '
        'building here.'
    ),
}


def _collapse(shapes: dict[str, list[int]]) -> dict[str, Any]:
  """Per-expert names with the expert index replaced by '*', and counts."""
  out: dict[str, Any] = {}
  for name, shape in shapes.items():
    key = re.sub(r'\.experts\.\d+\.', '.experts.*.', name)
    if key == name:
      out[name] = shape
      continue
    entry = out.setdefault(key, {'shape': shape, 'count': 0})
    if entry['shape'] != shape:
      raise ValueError(f'{key}: shapes differ between experts')
    entry['count'] += 1
  return out


def _on_disk_shapes(model) -> dict[str, list[int]]:
  """The names save_pretrained would write (its own reverse mapping)."""
  from transformers.core_model_loading import revert_weight_conversion
  from transformers.modeling_utils import remove_tied_weights_from_state_dict

  state = remove_tied_weights_from_state_dict(model.state_dict(), model)
  state = revert_weight_conversion(model, state)
  return {k: list(v.shape) for k, v in sorted(state.items())}


def _top_k(config) -> int:
  text = config.get_text_config()
  k = getattr(text, 'num_experts_per_tok', None)
  return k if k is not None else text.top_k_experts


def _active(model, config) -> dict[str, int]:
  """Active parameters per token (see the module docstring)."""
  k = _top_k(config)
  idle = 0
  for name, module in model.named_modules():
    if name.endswith('.experts'):
      tensors = list(module.parameters(recurse=False))
      experts = tensors[0].shape[0]
      if any(t.shape[0] != experts for t in tensors):
        raise ValueError(f'{name}: expert tensors of different E')
      idle += sum(t.numel() for t in tensors) * (experts - k) // experts
  total = sum(p.numel() for p in model.parameters())
  embedding = model.get_input_embeddings().weight
  head = model.get_output_embeddings().weight
  tied = head is embedding
  return {
      'embedding_params': embedding.numel(),
      'lm_head_params': 0 if tied else head.numel(),
      'active_params': total - idle,
      'active_params_without_embedding': (
          total - idle - (0 if tied else embedding.numel())
      ),
  }


def _count(model, config) -> dict[str, Any]:
  params = sum(p.numel() for p in model.parameters())
  state = model.state_dict()
  in_memory = {k: list(v.shape) for k, v in state.items()}
  head = next(k for k in state if k.endswith('lm_head.weight'))
  buffers = {
      k: list(v.shape)
      for k, v in state.items()
      if k not in dict(model.named_parameters()) and k != head
  }
  on_disk = _on_disk_shapes(model)
  tied = head not in on_disk
  if tied:
    in_memory.pop(head, None)
  return {
      'architecture': type(model).__name__,
      'total_params': params,
      'persistent_buffers': buffers,
      'buffer_elements': sum(int(np.prod(s)) for s in buffers.values()),
      'tied_embeddings': tied,
      'tensors_on_disk_count': len(on_disk),
      'tensors_on_disk': _collapse(on_disk),
      'tensors_in_memory': (
          'same as tensors_on_disk' if in_memory == on_disk else in_memory
      ),
      **_active(model, config),
  }


def _mtp_layer_params(model, config) -> int:
  """One multi-token-prediction layer as DeepSeek-V3 and GLM-4.5 store it:
  a MoE decoder layer (as the model's last) plus eh_proj [H, 2H] and the
  enorm, hnorm and shared_head.norm weights [H] (its embed_tokens and
  shared_head.head, where stored, are copies of the model's, not counted)."""
  hidden = config.hidden_size
  layer = sum(p.numel() for p in model.model.layers[-1].parameters())
  return layer + 2 * hidden * hidden + 3 * hidden


def _versus_card(name: str, entry: dict[str, Any]) -> dict[str, Any]:
  total, active, where = MODEL_CARDS[name]
  ours = entry['total_params']
  card = {
      'total': total,
      'active': active,
      'where': where,
      'total_rel_diff': round(ours / total - 1, 5),
      'active_rel_diff': round(entry['active_params'] / active - 1, 5),
      'active_without_embedding_rel_diff': round(
          entry['active_params_without_embedding'] / active - 1, 5
      ),
  }
  if 'not_built' in entry and 'params' in entry['not_built']:
    with_mtp = ours + entry['not_built']['params']
    card['total_with_mtp_rel_diff'] = round(with_mtp / total - 1, 5)
  return card


def _config(name: str, drop: list[str]):
  raw = json.loads((REAL_CONFIGS / name / 'config.json').read_text())
  for key in drop:
    raw.pop(key, None)
  for (section, key), convert in COERCE.get(name, {}).items():
    raw[section][key] = convert(raw[section][key])
  return AutoConfig.for_model(raw.pop('model_type'), **raw)


def param_counts(out_root: pathlib.Path) -> None:
  result = {
      'transformers_version': transformers.__version__,
      'torch_version': torch.__version__,
      'how': (
          'models built on the meta device from configs/hf/<name>/config.json;'
          ' total_params = sum of numel over model.parameters() (a tied '
          'embedding counted once; persistent buffers such as '
          'e_score_correction_bias and layer_scalar listed apart); '
          'tensors_in_memory = model.state_dict() (fused experts); '
          'tensors_on_disk = what save_pretrained writes (per-expert names '
          'collapsed to experts.* with a count). active_params = '
          'total_params less (E - k) / E of every routed-experts module '
          '(k experts per token); active_params_without_embedding also less '
          'the untied input embedding table (scripts/hf_param_counts.py).'
      ),
      'models': {},
  }
  for name, (model_cls, drop) in REAL_MODELS.items():
    config = _config(name, drop)
    with torch.device('meta'):
      model = getattr(transformers, model_cls)(config)
    path = REAL_CONFIGS / name / 'config.json'
    entry = {'config': str(path.relative_to(REPO)), 'source': NOTES[name]}
    entry.update(_count(model, config))
    if model_cls in TEXT_ONLY:
      with torch.device('meta'):
        text = getattr(transformers, TEXT_ONLY[model_cls])(config.text_config)
      entry['text_only'] = _count(text, config)
    if model_cls == 'DeepseekV3ForCausalLM':
      entry['not_built'] = (
          f'{config.num_nextn_predict_layers} MTP layer(s) (model.layers.61.*)'
      )
    if model_cls == 'Glm4MoeForCausalLM':
      layers = config.num_nextn_predict_layers
      entry['not_built'] = {
          'what': (
              f'{layers} MTP layer(s) (model.layers.'
              f'{config.num_hidden_layers}.*), ignored on load'
          ),
          'params': layers * _mtp_layer_params(model, config),
          'how': _mtp_layer_params.__doc__.split(':', 1)[1].strip(),
      }
    if name in MODEL_CARDS:
      entry['model_card'] = _versus_card(name, entry)
    result['models'][name] = entry
    print(f'{name}: {entry["total_params"]:,} parameters')
  out_root.mkdir(parents=True, exist_ok=True)
  text = json.dumps(result, indent=1)
  # One line per shape: [4096, 14336] rather than a line per dimension.
  text = re.sub(
      r'\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]',
      lambda m: '[' + ', '.join(re.split(r',\s*', m.group(1))) + ']',
      text,
  )
  (out_root / 'param_counts.json').write_text(text + '\n')


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', type=pathlib.Path, default=FIXTURES)
  args = parser.parse_args(argv)
  transformers.logging.set_verbosity_error()
  param_counts(args.out)


if __name__ == '__main__':
  main(sys.argv[1:])
