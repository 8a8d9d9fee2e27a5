"""Writes tiny Hugging Face checkpoints and transformers' outputs for them.

The library's Hugging Face loaders must compute the logits transformers
computes, from the files transformers writes. CI has neither torch nor
transformers, so this script, run by hand in a separate venv, writes both
sides once and the fixtures are committed:

  tests/fixtures/hf/<fixture>/
    config.json, generation_config.json, *.safetensors
                      as `save_pretrained` writes them (per-expert hub names
                      by default; fused `gate_up_proj` where meta.json says)
    input_ids.npy     int32 [2, S]
    logits.npy        float32 [2, S, V], `model(input_ids).logits`
    generate.npy      int32 [2, P + 8], greedy `model.generate` from the
                      first P tokens of input_ids (P in meta.json)
    meta.json         purpose, versions, naming, seed, margins

  tests/fixtures/hf/param_counts.json  (with --param-counts)
                      real-size models built on the meta device from
                      configs/hf/<model>/config.json: total and active
                      parameter counts and every tensor's name and shape
                      (scripts/hf_param_counts.py).

The newer families (GPT-OSS, GLM-4.5, MiniMax-M2, Llama-4) are written by
scripts/make_hf_family_fixtures.py, GPT-OSS's MXFP4 experts by
scripts/make_mxfp4_fixtures.py, both with these helpers.

Every model is float32, eval mode, eager attention and the eager (per-expert
loop) experts implementation. Weights are drawn from a fixed torch seed on
one CPU thread, so two runs on one machine write the same bytes (another
CPU's matmul kernels may round logits.npy differently in its last bits:
the files' weights, inputs and tokens stay the same). A seed is kept only when
every routing decision and every greedy token wins by a margin (see
MIN_MARGIN), so an implementation that differs from transformers only by
float rounding makes the same choices.

The venv (outside the repo; torch 2.13.0 is a CPU build already on disk):

  /root/.pyenv/versions/3.11*/bin/python3.11 -m venv /work/hf311
  /work/hf311/bin/pip install torch==2.13.0 transformers safetensors numpy

Run from the repository root:

  /work/hf311/bin/python scripts/make_hf_fixtures.py            # fixtures
  /work/hf311/bin/python scripts/make_hf_fixtures.py --param-counts
  /work/hf311/bin/python scripts/make_hf_fixtures.py --only mixtral_gqa_swa

`--out DIR` writes somewhere else (e.g. to check that two runs agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
from typing import Any

import hf_param_counts
import numpy as np
import torch
import transformers

REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = REPO / 'tests' / 'fixtures' / 'hf'

BATCH = 2
SEQ_LEN = 12
PROMPT_LEN = 5
MAX_NEW_TOKENS = 8
# Smallest gap allowed between the last chosen and the first rejected
# candidate of every top-k (router probabilities or scores, group scores)
# and between the two best logits of every greedy step.
MIN_MARGIN = 1e-4
SEED_TRIES = 64

# std of every weight matrix, embedding and expert tensor.
WEIGHT_STD = 0.1
# Norm weights and other scales that start at one: 1 + N(0, SCALE_STD).
SCALE_STD = 0.25
# GPT-OSS's attention sinks (a logit per head): N(0, SINK_STD).
SINK_STD = 1.0

EAGER = {'attn_implementation': 'eager', 'experts_implementation': 'eager'}

MIXTRAL_PER_EXPERT = (
    'per-expert hub names: model.layers.N.block_sparse_moe.experts.E.'
    '{w1,w3}.weight [I, H] (gate, up), .w2.weight [H, I] (down); router '
    'model.layers.N.block_sparse_moe.gate.weight [E, H]'
)
MIXTRAL_FUSED = (
    'fused (transformers 5 in-memory layout, save_original_format=False): '
    'model.layers.N.mlp.experts.gate_up_proj [E, 2I, H] (rows [0, I) gate '
    '= w1, rows [I, 2I) up = w3), .down_proj [E, H, I] (= w2); router '
    'model.layers.N.mlp.gate.weight [E, H]'
)
QWEN_PER_EXPERT = (
    'per-expert hub names: model.layers.N.mlp.experts.E.{gate_proj,up_proj}'
    '.weight [I, H], .down_proj.weight [H, I]; router model.layers.N.mlp.'
    'gate.weight [E, H]'
)
DEEPSEEK_EXTRA = (
    '; routing bias model.layers.N.mlp.gate.e_score_correction_bias [E]; '
    'shared experts model.layers.N.mlp.shared_experts.{gate,up,down}_proj.'
    'weight'
)
DEEPSEEK_PER_EXPERT = QWEN_PER_EXPERT + DEEPSEEK_EXTRA
GEMMA_FUSED = (
    'fused (Gemma-4 has no per-expert form): {prefix}layers.N.experts.'
    'gate_up_proj [E, 2I, H] (rows [0, I) gate, [I, 2I) up), .down_proj '
    '[E, H, I]; router {prefix}layers.N.router.{{proj.weight [E, H], scale '
    '[H], per_expert_scale [E]}}'
)


@dataclasses.dataclass
class Fixture:
  name: str
  purpose: str
  covers: list[str]
  config_cls: str
  config: dict[str, Any]
  model_cls: str
  naming: str
  text_config: dict[str, Any] | None = None
  save_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Re-save another fixture's model (same weights, same outputs).
  resave_of: str | None = None
  seed: int = 0
  # Config changes that must move the logits (recorded in meta.json): each
  # proves the fixture tells that convention apart.
  ablations: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  # The transformers class that reloads the written files (a multimodal
  # checkpoint needs its own; AutoModelForCausalLM may pick the text model).
  reload_cls: str = 'AutoModelForCausalLM'


def _mixtral_base() -> dict[str, Any]:
  return {
      'vocab_size': 64,
      'hidden_size': 32,
      'intermediate_size': 24,
      'num_hidden_layers': 2,
      'num_attention_heads': 4,
      'num_key_value_heads': 2,
      'head_dim': 12,
      'num_local_experts': 4,
      'num_experts_per_tok': 2,
      'sliding_window': 4,
      'max_position_embeddings': 64,
      'rms_norm_eps': 1e-5,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': 10000.0},
      'tie_word_embeddings': False,
      'bos_token_id': None,
      'eos_token_id': None,
      'pad_token_id': None,
  }


def qwen_base() -> dict[str, Any]:
  return {
      'vocab_size': 80,
      'hidden_size': 32,
      'intermediate_size': 48,
      'moe_intermediate_size': 12,
      'num_hidden_layers': 3,
      'num_attention_heads': 4,
      'num_key_value_heads': 2,
      'head_dim': 16,
      'num_experts': 8,
      'num_experts_per_tok': 3,
      'decoder_sparse_step': 1,
      'mlp_only_layers': [0],
      'norm_topk_prob': True,
      'max_position_embeddings': 64,
      'rms_norm_eps': 1e-6,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': 10000.0},
      'use_sliding_window': False,
      'tie_word_embeddings': False,
      'bos_token_id': None,
      'eos_token_id': None,
      'pad_token_id': None,
  }


def deepseek_base() -> dict[str, Any]:
  return {
      'vocab_size': 72,
      'hidden_size': 32,
      'intermediate_size': 40,
      'moe_intermediate_size': 8,
      'num_hidden_layers': 3,
      'num_attention_heads': 4,
      'num_key_value_heads': 4,
      'q_lora_rank': 24,
      'kv_lora_rank': 20,
      'qk_nope_head_dim': 8,
      'qk_rope_head_dim': 16,
      'v_head_dim': 12,
      'n_routed_experts': 16,
      'n_shared_experts': 2,
      'num_experts_per_tok': 4,
      'n_group': 4,
      'topk_group': 2,
      'norm_topk_prob': True,
      'routed_scaling_factor': 2.5,
      'first_k_dense_replace': 1,
      'rope_interleave': True,
      'max_position_embeddings': 128,
      'rms_norm_eps': 1e-6,
      'rope_parameters': {
          'rope_type': 'yarn',
          'rope_theta': 10000.0,
          'factor': 4.0,
          'original_max_position_embeddings': 32,
          'beta_fast': 8.0,
          'beta_slow': 1.0,
          'mscale': 1.0,
          'mscale_all_dim': 0.8,
      },
      'tie_word_embeddings': False,
      'num_mtp_layers': 0,
      'bos_token_id': None,
      'eos_token_id': None,
      'pad_token_id': None,
  }


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
  return {k: v for k, v in d.items() if k != key}


def _gemma_text_base() -> dict[str, Any]:
  return {
      'vocab_size': 96,
      'hidden_size': 32,
      'intermediate_size': 24,
      'moe_intermediate_size': 8,
      'num_hidden_layers': 4,
      'num_attention_heads': 4,
      'num_key_value_heads': 2,
      'head_dim': 8,
      'global_head_dim': 16,
      'num_global_key_value_heads': 1,
      'attention_k_eq_v': True,
      'layer_types': [
          'sliding_attention',
          'full_attention',
          'sliding_attention',
          'full_attention',
      ],
      'sliding_window': 4,
      'enable_moe_block': True,
      'num_experts': 6,
      'top_k_experts': 2,
      'hidden_size_per_layer_input': 0,
      'final_logit_softcapping': 3.0,
      'max_position_embeddings': 64,
      'rms_norm_eps': 1e-6,
      'rope_parameters': {
          'sliding_attention': {'rope_type': 'default', 'rope_theta': 10000.0},
          'full_attention': {
              'rope_type': 'proportional',
              'partial_rotary_factor': 0.25,
              'rope_theta': 1000000.0,
          },
      },
      'tie_word_embeddings': True,
      'bos_token_id': None,
      'eos_token_id': None,
      'pad_token_id': 0,
  }


def _fixtures() -> list[Fixture]:
  """Every fixture; each one's seed base is fixed so runs repeat."""
  fixtures = []

  fixtures.append(
      Fixture(
          name='mixtral_gqa_swa',
          purpose=(
              'Mixtral: GQA (4 query, 2 KV heads) with head_dim 12 != '
              'hidden/heads = 8, sliding window 4 < S, untied head.'
          ),
          covers=[
              'gqa',
              'head_dim_explicit',
              'sliding_window',
              'untied',
              'per_expert_names',
          ],
          config_cls='MixtralConfig',
          config=_mixtral_base(),
          model_cls='MixtralForCausalLM',
          naming=MIXTRAL_PER_EXPERT,
          seed=1000,
          ablations={
              'sliding_window 5 (window off by one)': {'sliding_window': 5},
              'no sliding window': {'sliding_window': None},
          },
      )
  )
  fixtures.append(
      Fixture(
          name='mixtral_gqa_swa_fused',
          purpose=(
              'The mixtral_gqa_swa model re-saved with '
              'save_pretrained(save_original_format=False): transformers 5 '
              'fused expert tensors; same weights, same outputs.'
          ),
          covers=['fused_expert_names'],
          config_cls='MixtralConfig',
          config=_mixtral_base(),
          model_cls='MixtralForCausalLM',
          naming=MIXTRAL_FUSED,
          save_kwargs={'save_original_format': False},
          resave_of='mixtral_gqa_swa',
      )
  )
  cfg = _mixtral_base()
  cfg.update({
      'num_hidden_layers': 3,
      'num_key_value_heads': 1,
      'head_dim': None,
      'num_local_experts': 8,
      'sliding_window': None,
      'tie_word_embeddings': True,
  })
  fixtures.append(
      Fixture(
          name='mixtral_tied_sharded',
          purpose=(
              'Mixtral: tied embeddings (no lm_head.weight on disk), one KV '
              'head, head_dim = hidden/heads (not set), no sliding window, '
              '8 experts top-2, saved in shards with '
              'model.safetensors.index.json.'
          ),
          covers=['tied', 'mqa', 'full_causal', 'sharded', 'per_expert_names'],
          config_cls='MixtralConfig',
          config=cfg,
          model_cls='MixtralForCausalLM',
          naming=MIXTRAL_PER_EXPERT,
          save_kwargs={'max_shard_size': '100KB'},
          seed=2000,
          ablations={'rms_norm_eps 1e-6': {'rms_norm_eps': 1e-6}},
      )
  )

  fixtures.append(
      Fixture(
          name='qwen3_moe_dense0_norm',
          purpose=(
              'Qwen3-MoE: layer 0 dense (mlp_only_layers=[0]), layers 1-2 '
              'MoE, q/k RMSNorm per head before RoPE, norm_topk_prob=True, '
              'head_dim 16 != hidden/heads = 8, GQA, untied.'
          ),
          covers=[
              'mlp_only_layers',
              'qk_norm',
              'norm_topk_prob_true',
              'untied',
              'per_expert_names',
          ],
          config_cls='Qwen3MoeConfig',
          config=qwen_base(),
          model_cls='Qwen3MoeForCausalLM',
          naming=QWEN_PER_EXPERT,
          seed=3000,
          ablations={'norm_topk_prob False': {'norm_topk_prob': False}},
      )
  )
  cfg = qwen_base()
  cfg.update({
      'num_hidden_layers': 4,
      'decoder_sparse_step': 2,
      'mlp_only_layers': [],
      'norm_topk_prob': False,
      'tie_word_embeddings': True,
  })
  fixtures.append(
      Fixture(
          name='qwen3_moe_step2_nonorm_tied',
          purpose=(
              'Qwen3-MoE: decoder_sparse_step=2 (layers 1 and 3 MoE, 0 and 2 '
              'dense), norm_topk_prob=False (top-k softmax probabilities '
              'used as they are), tied embeddings.'
          ),
          covers=[
              'decoder_sparse_step',
              'norm_topk_prob_false',
              'tied',
              'per_expert_names',
          ],
          config_cls='Qwen3MoeConfig',
          config=cfg,
          model_cls='Qwen3MoeForCausalLM',
          naming=QWEN_PER_EXPERT,
          seed=4000,
          ablations={'norm_topk_prob True': {'norm_topk_prob': True}},
      )
  )

  fixtures.append(
      Fixture(
          name='deepseek_v3_qlora_yarn_groups',
          purpose=(
              'DeepSeek-V3: MLA with q_lora_rank, YaRN (factor 4, original '
              'max 32, beta_fast 8, beta_slow 1, mscale 1.0 != '
              'mscale_all_dim 0.8 so both the cos/sin attention factor and '
              'the softmax-scale correction matter), v_head_dim 12 != '
              'qk_nope_head_dim 8, 2 shared experts, 16 routed experts in 4 '
              'groups with top-2 groups and top-4 experts, norm_topk_prob '
              'True, routed_scaling_factor 2.5, first_k_dense_replace 1, '
              'random e_score_correction_bias, rope_interleave True (the '
              'released default).'
          ),
          covers=[
              'mla_q_lora',
              'yarn',
              'v_head_dim',
              'shared_experts',
              'group_routing',
              'norm_topk_prob_true',
              'routed_scaling',
              'first_k_dense_replace',
              'e_score_correction_bias',
              'rope_interleave_true',
              'untied',
              'per_expert_names',
          ],
          config_cls='DeepseekV3Config',
          config=deepseek_base(),
          model_cls='DeepseekV3ForCausalLM',
          naming=DEEPSEEK_PER_EXPERT,
          seed=5000,
          ablations={
              'rope_interleave False': {'rope_interleave': False},
              'no mscale_all_dim (no softmax-scale correction)': {
                  'rope_parameters': _without(
                      deepseek_base()['rope_parameters'], 'mscale_all_dim'
                  )
              },
              'routed_scaling_factor 1.0': {'routed_scaling_factor': 1.0},
              'n_group 1 (no group selection)': {'n_group': 1, 'topk_group': 1},
          },
      )
  )
  cfg = deepseek_base()
  cfg.update({
      'q_lora_rank': None,
      'num_hidden_layers': 4,
      'first_k_dense_replace': 2,
      'n_routed_experts': 8,
      'n_shared_experts': 3,
      'num_experts_per_tok': 3,
      'n_group': 1,
      'topk_group': 1,
      'norm_topk_prob': False,
      'routed_scaling_factor': 1.5,
      'rope_interleave': False,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': 10000.0},
      'max_position_embeddings': 64,
      'tie_word_embeddings': True,
  })
  fixtures.append(
      Fixture(
          name='deepseek_v3_plain_nogroup',
          purpose=(
              'DeepSeek-V3: MLA without q_lora (q_proj), no rope scaling, '
              'n_group 1, norm_topk_prob False with routed_scaling_factor '
              '1.5, first_k_dense_replace 2, 3 shared experts, '
              'rope_interleave False (half-split rotate_half), tied '
              'embeddings.'
          ),
          covers=[
              'mla_no_q_lora',
              'default_rope',
              'no_groups',
              'norm_topk_prob_false',
              'routed_scaling',
              'first_k_dense_replace',
              'rope_interleave_false',
              'tied',
              'per_expert_names',
          ],
          config_cls='DeepseekV3Config',
          config=cfg,
          model_cls='DeepseekV3ForCausalLM',
          naming=DEEPSEEK_PER_EXPERT,
          seed=6000,
          ablations={
              'rope_interleave True': {'rope_interleave': True},
              'norm_topk_prob True': {'norm_topk_prob': True},
          },
      )
  )

  fixtures.append(
      Fixture(
          name='gemma4_text_moe_keqv',
          purpose=(
              'Gemma-4 text (Gemma4ForCausalLM, gemma4_text): sliding/full '
              'layers alternating, sliding_window 4 < S, attention_k_eq_v on '
              '(full layers: no v_proj, 1 KV head of global_head_dim 16; '
              'sliding layers: 2 KV heads of head_dim 8), proportional RoPE '
              'with partial_rotary_factor 0.25 on full layers, MoE block '
              '(6 experts top-2) beside the dense MLP, final logit '
              'soft-capping 3.0, hidden_size_per_layer_input 0, tied, random '
              'layer_scalar, router scale and per_expert_scale.'
          ),
          covers=[
              'layer_types',
              'sliding_window',
              'attention_k_eq_v',
              'global_head_dim',
              'num_global_key_value_heads',
              'proportional_rope',
              'moe_block',
              'softcap',
              'tied',
              'fused_expert_names',
          ],
          config_cls='Gemma4TextConfig',
          config=_gemma_text_base(),
          model_cls='Gemma4ForCausalLM',
          naming=GEMMA_FUSED.format(prefix='model.'),
          seed=7000,
          ablations={
              'sliding_window 5 (window off by one)': {'sliding_window': 5},
              'no final_logit_softcapping': {'final_logit_softcapping': None},
          },
      )
  )
  cfg = _gemma_text_base()
  cfg.update({
      'attention_k_eq_v': False,
      'tie_word_embeddings': False,
      'layer_types': [
          'sliding_attention',
          'sliding_attention',
          'full_attention',
      ],
      'num_hidden_layers': 3,
  })
  fixtures.append(
      Fixture(
          name='gemma4_text_moe_untied',
          purpose=(
              'Gemma-4 text with attention_k_eq_v off: every layer has '
              'v_proj, and num_global_key_value_heads is then IGNORED by '
              'transformers (full layers keep num_key_value_heads 2, only '
              'head_dim becomes global_head_dim 16); layers sliding, '
              'sliding, full; untied head.'
          ),
          covers=[
              'attention_k_eq_v_off',
              'global_head_dim',
              'sliding_window',
              'moe_block',
              'softcap',
              'untied',
              'fused_expert_names',
          ],
          config_cls='Gemma4TextConfig',
          config=cfg,
          model_cls='Gemma4ForCausalLM',
          naming=GEMMA_FUSED.format(prefix='model.'),
          seed=8000,
          ablations={
              'sliding_window 3 (window off by one)': {'sliding_window': 3},
          },
      )
  )
  fixtures.append(
      Fixture(
          name='gemma4_conditional_text',
          purpose=(
              'Gemma-4 saved as the multimodal Gemma4ForConditionalGeneration '
              '(model_type gemma4, text under text_config, no vision or '
              'audio tower): text tensors named model.language_model.*, head '
              'tied to model.language_model.embed_tokens.weight.'
          ),
          covers=['conditional_generation_names', 'attention_k_eq_v', 'tied'],
          config_cls='Gemma4Config',
          config={'vision_config': None, 'audio_config': None},
          text_config=_gemma_text_base(),
          model_cls='Gemma4ForConditionalGeneration',
          naming=GEMMA_FUSED.format(prefix='model.language_model.'),
          seed=9000,
      )
  )
  return fixtures


def build(fixture: Fixture, overrides=None) -> torch.nn.Module:
  config_cls = getattr(transformers, fixture.config_cls)
  kwargs = dict(fixture.config)
  kwargs.update(overrides or {})
  if fixture.text_config is not None:
    kwargs['text_config'] = dict(fixture.text_config)
  config = config_cls(**kwargs, **EAGER)
  model = getattr(transformers, fixture.model_cls)(config)
  return model.eval()


def randomize(model: torch.nn.Module, seed: int) -> None:
  """Draws every parameter and persistent buffer from `seed`.

  Weights are N(0, WEIGHT_STD); 1-D parameters that transformers
  initialises to ones (norm weights, Gemma-4's router scale and
  per_expert_scale) become 1 + N(0, SCALE_STD); DeepSeek's
  e_score_correction_bias is N(0, 0.1) and Gemma-4's layer_scalar
  U(0.5, 1.5). Biases (parameters named `*bias`: attention, router and
  expert biases, which transformers initialises to zero) are
  N(0, WEIGHT_STD) and GPT-OSS's attention sinks N(0, SINK_STD). Anything
  else is an error, so no tensor keeps its init.
  """
  gen = torch.Generator().manual_seed(seed)

  def normal(shape):
    return torch.randn(shape, generator=gen, dtype=torch.float32)

  params = dict(model.named_parameters())
  buffers = dict(model.named_buffers())
  with torch.no_grad():
    for name in model.state_dict():
      if name in params:
        p = params[name]
        if name.endswith('bias'):
          p.copy_(WEIGHT_STD * normal(p.shape))
        elif name.endswith('.sinks'):
          p.copy_(SINK_STD * normal(p.shape))
        elif p.ndim == 1:
          if not torch.all(p == 1):
            raise ValueError(f'1-D parameter {name} does not start at one')
          p.copy_(1.0 + SCALE_STD * normal(p.shape))
        else:
          p.copy_(WEIGHT_STD * normal(p.shape))
      elif name in buffers:
        b = buffers[name]
        if name.endswith('e_score_correction_bias'):
          b.copy_(0.1 * normal(b.shape))
        elif name.endswith('layer_scalar'):
          b.copy_(0.5 + torch.rand(b.shape, generator=gen))
        else:
          raise ValueError(f'unexpected persistent buffer {name}')
      elif name == 'lm_head.weight':
        pass  # tied: the same tensor as the embedding, drawn once
      else:
        raise ValueError(f'{name} is neither parameter nor buffer')


class _Margins:
  """Records the smallest top-k margin of every router call."""

  def __init__(self, model: torch.nn.Module):
    self.values: list[float] = []
    self.handles = []
    for module in model.modules():
      kind = type(module).__name__
      if kind in ('MixtralTopKRouter', 'Qwen3MoeTopKRouter'):
        self.handles.append(module.register_forward_hook(self._softmax))
      elif kind in ('DeepseekV3TopkRouter', 'Glm4MoeTopkRouter'):
        self.handles.append(module.register_forward_hook(self._deepseek))
      elif kind == 'Gemma4TextRouter':
        self.handles.append(module.register_forward_hook(self._gemma))
      elif kind == 'GptOssTopKRouter':  # top-k of the logits
        self.handles.append(module.register_forward_hook(self._logits(0)))
      elif kind == 'Llama4Router':  # returns (scores, logits)
        self.handles.append(module.register_forward_hook(self._logits(1)))
      elif kind == 'MiniMaxM2TopKRouter':
        self.handles.append(module.register_forward_hook(self._minimax))

  @staticmethod
  def _gap(scores: torch.Tensor, k: int) -> float:
    top = torch.topk(scores, k + 1, dim=-1).values
    gap = top[:, k - 1] - top[:, k]
    return float(gap.min())

  def _softmax(self, module, inputs, outputs):
    del inputs
    probs = torch.softmax(outputs[0].float(), dim=-1)
    self.values.append(self._gap(probs, module.top_k))

  def _logits(self, index: int):
    def hook(module, inputs, outputs):
      del inputs
      self.values.append(self._gap(outputs[index].float(), module.top_k))

    return hook

  def _minimax(self, module, inputs, outputs):
    # The selection bias is the router's second argument.
    choice = outputs[0].float().sigmoid() + inputs[1]
    self.values.append(self._gap(choice, module.top_k))

  def _gemma(self, module, inputs, outputs):
    del inputs
    self.values.append(self._gap(outputs[0], module.config.top_k_experts))

  def _deepseek(self, module, inputs, outputs):
    del inputs
    scores = outputs[0].float().sigmoid()
    choice = scores + module.e_score_correction_bias
    groups, experts = module.num_group, module.num_experts
    if groups > 1:
      group_scores = (
          choice.view(-1, groups, experts // groups)
          .topk(2, dim=-1)[0]
          .sum(dim=-1)
      )
      self.values.append(self._gap(group_scores, module.topk_group))
      keep = torch.topk(group_scores, module.topk_group, dim=-1)[1]
      mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
      mask = mask.repeat_interleave(experts // groups, dim=-1)
      choice = choice.masked_fill(mask == 0, float('-inf'))
    top = torch.topk(choice, module.top_k + 1, dim=-1).values
    gap = top[:, module.top_k - 1] - top[:, module.top_k]
    self.values.append(float(gap.min()))

  def remove(self):
    for handle in self.handles:
      handle.remove()


def _greedy_uncached(model, prompt) -> tuple[torch.Tensor, float]:
  """Greedy decoding by full recomputation: the reference for generate."""
  seq = prompt
  margin = float('inf')
  for _ in range(MAX_NEW_TOKENS):
    logits = model(seq, use_cache=False).logits[:, -1].float()
    top = torch.topk(logits, 2, dim=-1).values
    margin = min(margin, float((top[:, 0] - top[:, 1]).min()))
    seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
  return seq, margin


def run_model(model, input_ids) -> dict[str, Any]:
  margins = _Margins(model)
  with torch.no_grad():
    logits = model(input_ids, use_cache=False).logits
    prompt = input_ids[:, :PROMPT_LEN]
    generated = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=MAX_NEW_TOKENS,
        min_new_tokens=0,
        do_sample=False,
        use_cache=True,
    )
    reference, greedy_margin = _greedy_uncached(model, prompt)
  margins.remove()
  return {
      'logits': logits,
      'generated': generated,
      'reference': reference,
      'router_margin': min(margins.values, default=float('inf')),
      'greedy_margin': greedy_margin,
  }


def _ablate(fixture: Fixture, model, input_ids, logits) -> dict[str, float]:
  """Max abs logit change under each ablation (same weights)."""
  changes = {}
  for label, overrides in fixture.ablations.items():
    other = build(fixture, overrides)
    other.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
      moved = other(input_ids, use_cache=False).logits
    changes[label] = float((moved - logits).abs().max())
    if changes[label] < 1e-3:
      raise RuntimeError(f'{fixture.name}: ablation {label} changes nothing')
  return changes


def run_meta(seed: int, out: dict[str, Any]) -> dict[str, Any]:
  """The versions, seed, generate settings and margins a meta.json of a
  quantized fixture ends with (`out` from `run_model`)."""
  return {
      'transformers_version': transformers.__version__,
      'torch_version': torch.__version__,
      'seed': seed,
      'prompt_len': PROMPT_LEN,
      'max_new_tokens': MAX_NEW_TOKENS,
      'min_router_margin': out['router_margin'],
      'min_greedy_margin': out['greedy_margin'],
      'margin_threshold': MIN_MARGIN,
  }


def make_input_ids(seed: int, vocab: int) -> torch.Tensor:
  gen = torch.Generator().manual_seed(seed + 1)
  return torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=gen)


def vocab_of(model) -> int:
  return model.config.get_text_config().vocab_size


def _pick_seed(fixture: Fixture):
  """The first seed from fixture.seed whose decisions all have margins."""
  for seed in range(fixture.seed, fixture.seed + SEED_TRIES):
    model = build(fixture)
    randomize(model, seed)
    input_ids = make_input_ids(seed, vocab_of(model))
    out = run_model(model, input_ids)
    if min(out['router_margin'], out['greedy_margin']) >= MIN_MARGIN:
      return seed, model, input_ids, out
  raise RuntimeError(f'{fixture.name}: no seed with margins >= {MIN_MARGIN}')


def _check_reload(
    directory: pathlib.Path,
    input_ids,
    logits,
    cls: str = 'AutoModelForCausalLM',
) -> float:
  """Loads the written files back and returns the max abs logit diff."""
  model, info = getattr(transformers, cls).from_pretrained(
      directory, dtype=torch.float32, output_loading_info=True, **EAGER
  )
  bad = {k: sorted(v) for k, v in info.items() if v}
  if bad:
    raise RuntimeError(f'{directory}: loading info {bad}')
  with torch.no_grad():
    again = model.eval()(input_ids, use_cache=False).logits
  return float((again - logits).abs().max())


def _write(fixture: Fixture, out_root: pathlib.Path, built: dict) -> None:
  seed, model, input_ids, out = built
  if not torch.equal(out['generated'], out['reference']):
    raise RuntimeError(f'{fixture.name}: generate != uncached greedy')
  directory = out_root / fixture.name
  if directory.exists():
    shutil.rmtree(directory)
  model.save_pretrained(directory, **fixture.save_kwargs)
  files = sorted(p.name for p in directory.iterdir())
  shards = [f for f in files if f.endswith('.safetensors')]
  sharded = 'model.safetensors.index.json' in files
  if 'max_shard_size' in fixture.save_kwargs and (
      len(shards) < 2 or not sharded
  ):
    raise RuntimeError(f'{fixture.name}: expected >= 2 shards, got {files}')
  np.save(directory / 'input_ids.npy', input_ids.numpy().astype(np.int32))
  logits = out['logits'].numpy().astype(np.float32)
  np.save(directory / 'logits.npy', logits)
  np.save(
      directory / 'generate.npy',
      out['generated'].numpy().astype(np.int32),
  )
  reload_diff = _check_reload(
      directory, input_ids, out['logits'], fixture.reload_cls
  )
  ablations = _ablate(fixture, model, input_ids, out['logits'])
  # Not always 0.0: CPU matmuls on the loaded (memory-mapped) tensors may
  # round differently; anything past float32 noise is a loading bug.
  if reload_diff > 1e-5:
    raise RuntimeError(f'{fixture.name}: reloaded logits off by {reload_diff}')
  text_config = model.config.get_text_config()
  meta = {
      'fixture': fixture.name,
      'purpose': fixture.purpose,
      'covers': fixture.covers,
      'architecture': type(model).__name__,
      'model_type': model.config.model_type,
      'text_model_type': text_config.model_type,
      'expert_naming_on_disk': fixture.naming,
      'tied_embeddings': bool(text_config.tie_word_embeddings),
      'sharded': sharded,
      'files': files + ['input_ids.npy', 'logits.npy', 'generate.npy'],
      'resave_of': fixture.resave_of,
      'transformers_version': transformers.__version__,
      'torch_version': torch.__version__,
      'dtype': 'float32',
      'attn_implementation': 'eager',
      'experts_implementation': 'eager',
      'seed': seed,
      'weight_std': WEIGHT_STD,
      'scale_std': SCALE_STD,
      'input_ids_shape': list(input_ids.shape),
      'logits_shape': list(logits.shape),
      'logits_call': 'model(input_ids, use_cache=False).logits, no mask',
      'prompt_len': PROMPT_LEN,
      'max_new_tokens': MAX_NEW_TOKENS,
      'generate_call': (
          'model.generate(input_ids[:, :prompt_len], attention_mask=ones, '
          'max_new_tokens=8, do_sample=False, use_cache=True); eos_token_id '
          'is None, so all 8 tokens are generated; generate.npy holds '
          'prompt + new tokens'
      ),
      'generate_matches_uncached_greedy': True,
      'min_router_margin': out['router_margin'],
      'min_greedy_margin': out['greedy_margin'],
      'margin_threshold': MIN_MARGIN,
      'reload_max_abs_diff': reload_diff,
      'logits_std': float(logits.std()),
      'logits_abs_max': float(np.abs(logits).max()),
      'ablations_max_abs_logit_change': ablations,
  }
  (directory / 'meta.json').write_text(json.dumps(meta, indent=2) + '\n')
  size = sum(p.stat().st_size for p in directory.iterdir())
  print(
      f'{fixture.name}: seed {seed}, {size / 1024:.0f} KB, router margin '
      f'{out["router_margin"]:.2e}, greedy margin {out["greedy_margin"]:.2e}'
  )


def make_fixtures(out_root: pathlib.Path, only: set[str] | None) -> None:
  out_root.mkdir(parents=True, exist_ok=True)
  built = {}
  fixtures = _fixtures()
  for fixture in fixtures:
    if only is not None and fixture.name not in only:
      continue
    source = fixture
    if fixture.resave_of is not None:
      source = next(f for f in fixtures if f.name == fixture.resave_of)
    if source.name not in built:
      built[source.name] = _pick_seed(source)
    _write(fixture, out_root, built[source.name])


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', type=pathlib.Path, default=FIXTURES)
  parser.add_argument('--only', action='append', default=None)
  parser.add_argument('--param-counts', action='store_true')
  args = parser.parse_args(argv)
  torch.set_num_threads(1)
  torch.use_deterministic_algorithms(True)
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  if args.param_counts:
    hf_param_counts.param_counts(args.out)
  else:
    make_fixtures(args.out, set(args.only) if args.only else None)


if __name__ == '__main__':
  main(sys.argv[1:])
