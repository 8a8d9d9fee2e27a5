"""Writes tiny GPT-OSS, GLM-4.5, MiniMax-M2 and Llama-4 checkpoints.

The same ground truth as scripts/make_hf_fixtures.py (whose helpers and
conventions this reuses: float32, eager attention and experts, fixed seeds,
routing and greedy margins, config ablations, meta.json with versions), for
the families whose features the four older ones lack:

  gpt_oss_sinks_swa_yarn      attention sinks, sliding / full layers, biases
                              on attention, router and experts, the clamped
                              SwiGLU (clipping on both sides), interleaved
                              gate / up columns, top-k then softmax routing,
                              YaRN with truncate=False
  glm4_moe_partial_qknorm_groups
                              partial rotary (half of each head), q/k norm,
                              q/k/v biases, a leading dense layer, shared
                              experts, sigmoid routing with a selection bias
                              in groups, routed scaling 2.5
  glm4_moe_nogroup_tied       the released routing (one group), no q/k norm,
                              two leading dense layers, tied embeddings
  minimax_m2_partial_qknorm   partial rotary from the legacy `rotary_dim`,
                              q/k RMSNorm over all heads at once, sigmoid
                              routing with a selection bias, renormalised
  llama4_text_nope_chunked    (Llama4ForCausalLM) MoE / dense layers
                              interleaved, a shared expert beside top-1
                              sigmoid routing that scales the expert INPUT,
                              NoPE layers, chunked attention (chunk 4 < S),
                              weightless q/k norm after the interleaved
                              rotary, attention temperature tuning, llama3
                              rope scaling
  llama4_conditional_text     the llama4_text_nope_chunked text tower saved
                              inside a Llama4ForConditionalGeneration with a
                              tiny vision tower (language_model.* names);
                              same logits
  llama4_text_all_moe         every layer MoE, no q/k norm, plain RoPE, a
                              chunk of 5

Besides the config ablations, each fixture lists `edits`: changes of a copy
of the model (a weight set to a neutral value, a layout read the other way,
a module computing the other convention) that must move the logits by at
least 1e-3; meta.json records each change and the family's own statistics
(how much of the SwiGLU the clamp clips, the attention mass on the sinks,
Llama-4's temperature scales).

GPT-OSS with MXFP4 experts: scripts/make_mxfp4_fixtures.py.

Same venv as scripts/make_hf_fixtures.py; from the repository root:

  /work/hf311/bin/python scripts/make_hf_family_fixtures.py
  /work/hf311/bin/python scripts/make_hf_family_fixtures.py --only minimax_m2_partial_qknorm

`--out DIR` writes somewhere else (e.g. to check that two runs agree).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import contextlib
import copy
import dataclasses
import json
import math
import pathlib
import sys
import types
from typing import Any

import make_hf_fixtures as base
import numpy as np
import torch
import transformers
from transformers.models.llama4 import modeling_llama4

# An edit of a copy of the model; it may return a context (a patch) inside
# which the copy runs.
Edit = Callable[[torch.nn.Module], Any]

GPT_OSS_NAMING = (
    'fused, as in memory (no conversion mapping): model.layers.N.mlp.experts.'
    'gate_up_proj [E, H, 2I] (x @ W; gate = columns 0::2, up = columns '
    '1::2, interleaved), .gate_up_proj_bias [E, 2I] (same interleave), '
    '.down_proj [E, I, H], .down_proj_bias [E, H]; router model.layers.N.'
    'mlp.router.{weight [E, H], bias [E]}; sinks model.layers.N.self_attn.'
    'sinks [num_attention_heads]'
)
GLM_NAMING = base.DEEPSEEK_PER_EXPERT
MINIMAX_NAMING = (
    'Mixtral hub names: model.layers.N.block_sparse_moe.experts.E.'
    '{w1,w3}.weight [I, H] (gate, up), .w2.weight [H, I]; router '
    'model.layers.N.block_sparse_moe.gate.weight [E, H]; selection bias '
    'model.layers.N.block_sparse_moe.e_score_correction_bias [E]'
)
LLAMA4_NAMING = (
    '{prefix}layers.N.feed_forward.experts.gate_up_proj [E, H, 2I] (x @ W; '
    'gate = columns [0, I), up = [I, 2I)), .experts.down_proj [E, I, H], '
    '.router.weight [E, H], .shared_expert.{{gate,up,down}}_proj.weight; '
    'dense layers {prefix}layers.N.feed_forward.{{gate,up,down}}_proj.weight'
)

NO_IDS = {'bos_token_id': None, 'eos_token_id': None, 'pad_token_id': None}


@dataclasses.dataclass
class FamilyFixture:
  """A fixture of make_hf_fixtures.py plus what only these families need.

  Attributes:
    fixture: the checkpoint (config, class, ablations, naming).
    edits: label -> an edit of a copy of the model that must move the
      logits (a convention no config key switches).
    text_of: save the text weights of this (causal) fixture inside
      `fixture`'s multimodal model instead of drawing new ones.
  """

  fixture: base.Fixture
  edits: dict[str, Edit] = dataclasses.field(default_factory=dict)
  text_of: str | None = None


def gpt_oss_base() -> dict[str, Any]:
  return {
      'vocab_size': 128,
      'hidden_size': 64,
      'intermediate_size': 16,
      'num_hidden_layers': 3,
      'num_attention_heads': 4,
      'num_key_value_heads': 2,
      'head_dim': 16,
      'num_local_experts': 4,
      'num_experts_per_tok': 2,
      'layer_types': [
          'sliding_attention',
          'full_attention',
          'sliding_attention',
      ],
      'sliding_window': 4,
      'attention_bias': True,
      'swiglu_alpha': 1.702,
      # Small enough that the clamp clips: gate and up are ~N(0, 0.8).
      'swiglu_limit': 1.0,
      'max_position_embeddings': 128,
      'rms_norm_eps': 1e-5,
      'rope_parameters': {
          'rope_type': 'yarn',
          'rope_theta': 10000.0,
          'factor': 4.0,
          'beta_fast': 32.0,
          'beta_slow': 1.0,
          'truncate': False,
          'original_max_position_embeddings': 32,
      },
      'tie_word_embeddings': False,
      **NO_IDS,
  }


def glm4_moe_base() -> dict[str, Any]:
  return {
      'vocab_size': 144,
      'hidden_size': 64,
      'intermediate_size': 48,
      'moe_intermediate_size': 8,
      'num_hidden_layers': 3,
      'num_attention_heads': 4,
      'num_key_value_heads': 2,
      'head_dim': 16,
      'n_routed_experts': 8,
      'num_experts_per_tok': 3,
      'n_shared_experts': 2,
      'n_group': 4,
      'topk_group': 2,
      'norm_topk_prob': True,
      'routed_scaling_factor': 2.5,
      'first_k_dense_replace': 1,
      'use_qk_norm': True,
      'attention_bias': True,
      # The released checkpoints' MTP layer (model.layers.<L>.*) is not
      # built by transformers; a tiny one would be an unexpected key.
      'num_nextn_predict_layers': 0,
      'max_position_embeddings': 128,
      'rms_norm_eps': 1e-5,
      'rope_parameters': {
          'rope_type': 'default',
          'rope_theta': 10000.0,
          'partial_rotary_factor': 0.5,
      },
      'tie_word_embeddings': False,
      **NO_IDS,
  }


def minimax_m2_base() -> dict[str, Any]:
  return {
      'vocab_size': 136,
      'hidden_size': 64,
      'intermediate_size': 8,
      'num_hidden_layers': 3,
      'num_attention_heads': 4,
      'num_key_value_heads': 2,
      'head_dim': 16,
      'num_local_experts': 8,
      'num_experts_per_tok': 3,
      # The released config's legacy key: partial_rotary_factor 8 / 16.
      'rotary_dim': 8,
      'max_position_embeddings': 128,
      'rms_norm_eps': 1e-6,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': 10000.0},
      'tie_word_embeddings': False,
      **NO_IDS,
  }


def llama4_text_base() -> dict[str, Any]:
  return {
      'vocab_size': 128,
      'hidden_size': 64,
      'intermediate_size': 16,
      'intermediate_size_mlp': 48,
      'num_hidden_layers': 4,
      'num_attention_heads': 4,
      'num_key_value_heads': 2,
      'head_dim': 16,
      'num_local_experts': 4,
      'num_experts_per_tok': 1,
      'interleave_moe_layer_step': 2,  # MoE layers 1, 3 (Maverick)
      # RoPE in layers 0, 1 (chunked), NoPE in 2, 3 (full): one of each in
      # a dense and in a MoE layer.
      'no_rope_layers': [1, 1, 0, 0],
      'attention_chunk_size': 4,
      'use_qk_norm': True,
      'attn_temperature_tuning': True,
      # Scales 1 + 0.1 log1p(floor((p + 1) / 4)): > 1 from position 3 on.
      'floor_scale': 4,
      'attn_scale': 0.1,
      'max_position_embeddings': 128,
      'rms_norm_eps': 1e-5,
      'rope_parameters': {
          'rope_type': 'llama3',
          'rope_theta': 10000.0,
          'factor': 8.0,
          'low_freq_factor': 1.0,
          'high_freq_factor': 4.0,
          'original_max_position_embeddings': 16,
      },
      'tie_word_embeddings': False,
      **NO_IDS,
  }


TINY_VISION = {
    'hidden_size': 16,
    'num_hidden_layers': 1,
    'num_attention_heads': 2,
    'intermediate_size': 32,
    'image_size': 28,
    'patch_size': 14,
    'vision_output_dim': 16,
    'projector_input_dim': 16,
    'projector_output_dim': 16,
}


# --- edits -----------------------------------------------------------------


def _fill(suffixes: tuple[str, ...], value: float) -> Edit:
  """Sets every tensor whose name ends with one of `suffixes` to `value`."""

  def edit(model):
    hits = 0
    with torch.no_grad():
      for name, tensor in model.state_dict().items():
        if name.endswith(suffixes):
          tensor.fill_(value)
          hits += 1
    if not hits:
      raise ValueError(f'no tensor ends with {suffixes}')

  return edit


def _gate_up_halves(model) -> None:
  """GPT-OSS read as if gate_up_proj were [gate | up] halves: the columns
  permuted so that transformers' interleaved reading computes that."""
  with torch.no_grad():
    for name, tensor in model.state_dict().items():
      if name.endswith(('experts.gate_up_proj', 'experts.gate_up_proj_bias')):
        half = tensor.shape[-1] // 2
        halves = tensor.clone()
        tensor[..., 0::2] = halves[..., :half]
        tensor[..., 1::2] = halves[..., half:]


def _swiglu_without_plus_one(model) -> None:
  """GPT-OSS's gate computing up * glu instead of (up + 1) * glu."""

  def apply_gate(self, gate_up):
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=self.limit)
    up = up.clamp(min=-self.limit, max=self.limit)
    return up * gate * torch.sigmoid(gate * self.alpha)

  for module in model.modules():
    if type(module).__name__ == 'GptOssExperts':
      module._apply_gate = types.MethodType(apply_gate, module)


class _PerHeadNorm(torch.nn.Module):
  """An RMSNorm of each head with the slice of a [N * D] weight: what
  MiniMax-M2's q/k norm would be if it normalised per head."""

  def __init__(self, norm, head_dim: int):
    super().__init__()
    self.norm, self.head_dim = norm, head_dim

  def forward(self, x):
    heads = x.view(*x.shape[:-1], -1, self.head_dim)
    rms = torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6)
    weight = self.norm.weight.view(-1, self.head_dim)
    return (heads * rms * weight).view(x.shape)


def _qk_norm_off(model) -> None:
  for name, module in model.named_modules():
    if name.endswith('self_attn'):
      module.q_norm = module.k_norm = torch.nn.Identity()


def _qk_norm_per_head(model) -> None:
  for module in model.modules():
    if type(module).__name__ == 'MiniMaxM2Attention':
      module.q_norm = _PerHeadNorm(module.q_norm, module.head_dim)
      module.k_norm = _PerHeadNorm(module.k_norm, module.head_dim)


def _llama4_scale_outputs(model) -> None:
  """Llama-4's router score multiplying each expert's output instead of
  its input (the experts are gated MLPs without biases, so top-1 with a
  score s gives expert(s x) != s expert(x))."""

  def forward(self, hidden_states):
    x = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(x)  # [T, E]
    experts = scores.shape[1]
    out = self.experts(x.repeat(experts, 1)).view(experts, -1, x.shape[-1])
    routed = (out * scores.transpose(0, 1)[..., None]).sum(0)
    return self.shared_expert(x) + routed, logits

  for module in model.modules():
    if type(module).__name__ == 'Llama4TextMoe':
      module.forward = types.MethodType(forward, module)


def _llama4_half_split_rope(model):
  """Llama-4's rotary applied to the pairs (i, i + D/2), not (2i, 2i + 1)."""
  del model

  def apply(xq, xk, freqs_cis):
    def rotate(x):
      half = x.shape[-1] // 2
      pair = torch.complex(x[..., :half].float(), x[..., half:].float())
      out = pair * freqs_cis[:, :, None, :]
      return torch.cat([out.real, out.imag], dim=-1).type_as(x)

    return rotate(xq), rotate(xk)

  return _patched(modeling_llama4, 'apply_rotary_emb', apply)


@contextlib.contextmanager
def _patched(module, name: str, value):
  old = getattr(module, name)
  setattr(module, name, value)
  try:
    yield
  finally:
    setattr(module, name, old)


# --- fixtures --------------------------------------------------------------


def _fixtures() -> list[FamilyFixture]:
  """Every fixture; each one's seed base is fixed so runs repeat."""
  rope = gpt_oss_base()['rope_parameters']
  gpt_oss = FamilyFixture(
      base.Fixture(
          name='gpt_oss_sinks_swa_yarn',
          purpose=(
              'GPT-OSS: layers sliding (window 4 < S), full, sliding; a '
              'random sink logit per query head in every softmax; random '
              'biases on q/k/v/o, the router and both expert projections; '
              'clamped SwiGLU with alpha 1.702 and limit 1.0 (clipping the '
              'gate above and the up projection on both sides); gate / up '
              'interleaved in the fused expert tensor; top-2 of the router '
              'logits then softmax over the two; YaRN factor 4, original '
              'max 32, beta 32 / 1, truncate False (the released setting, '
              'fractional correction range); GQA 4 / 2, head_dim 16.'
          ),
          covers=[
              'attention_sinks',
              'layer_types',
              'sliding_window',
              'attention_bias',
              'router_bias',
              'expert_bias',
              'clamped_swiglu',
              'interleaved_gate_up',
              'topk_then_softmax',
              'yarn_truncate_false',
              'untied',
              'fused_expert_names',
          ],
          config_cls='GptOssConfig',
          config=gpt_oss_base(),
          model_cls='GptOssForCausalLM',
          naming=GPT_OSS_NAMING,
          seed=21000,
          ablations={
              'sliding_window 5 (window off by one)': {'sliding_window': 5},
              'every layer full attention': {
                  'layer_types': ['full_attention'] * 3
              },
              'swiglu_limit 1e6 (no clamp)': {'swiglu_limit': 1e6},
              'swiglu_alpha 1.0': {'swiglu_alpha': 1.0},
              'rope truncate True': {
                  'rope_parameters': {**rope, 'truncate': True}
              },
              'no rope scaling': {
                  'rope_parameters': {
                      'rope_type': 'default',
                      'rope_theta': 10000.0,
                  }
              },
          },
      ),
      edits={
          'no sinks (sinks = -inf)': _fill(('.sinks',), -math.inf),
          'sinks 0': _fill(('.sinks',), 0.0),
          'router bias 0': _fill(('mlp.router.bias',), 0.0),
          'expert biases 0': _fill(
              ('gate_up_proj_bias', 'down_proj_bias'), 0.0
          ),
          'attention biases 0': _fill(
              tuple(f'self_attn.{p}_proj.bias' for p in 'qkvo'), 0.0
          ),
          'gate / up read as halves': _gate_up_halves,
          'SwiGLU without the + 1 on up': _swiglu_without_plus_one,
      },
  )

  glm = FamilyFixture(
      base.Fixture(
          name='glm4_moe_partial_qknorm_groups',
          purpose=(
              'GLM-4.5: partial_rotary_factor 0.5 (the first 8 of 16 dims '
              'rotate, rotate_half pairs (i, i + 4), the rest pass), q/k '
              'RMSNorm per head before the rotary, q/k/v biases (o none), '
              'layer 0 dense (first_k_dense_replace 1), 2 shared experts '
              'beside 8 routed in 4 groups (top-2 groups, top-3 experts), '
              'sigmoid scores + random e_score_correction_bias for the '
              'choice only, norm_topk_prob, routed_scaling_factor 2.5.'
          ),
          covers=[
              'partial_rotary',
              'qk_norm',
              'attention_bias_qkv',
              'first_k_dense_replace',
              'shared_experts',
              'sigmoid_routing',
              'e_score_correction_bias',
              'group_routing',
              'norm_topk_prob_true',
              'routed_scaling',
              'untied',
              'per_expert_names',
          ],
          config_cls='Glm4MoeConfig',
          config=glm4_moe_base(),
          model_cls='Glm4MoeForCausalLM',
          naming=GLM_NAMING,
          seed=22000,
          ablations={
              'partial_rotary_factor 1.0': {
                  'rope_parameters': {
                      'rope_type': 'default',
                      'rope_theta': 10000.0,
                      'partial_rotary_factor': 1.0,
                  }
              },
              'n_group 1 (no group selection)': {'n_group': 1, 'topk_group': 1},
              'routed_scaling_factor 1.0': {'routed_scaling_factor': 1.0},
              'norm_topk_prob False': {'norm_topk_prob': False},
          },
      ),
      edits={
          'e_score_correction_bias 0': _fill(('e_score_correction_bias',), 0.0),
          'q/k/v biases 0': _fill(
              tuple(f'self_attn.{p}_proj.bias' for p in 'qkv'), 0.0
          ),
          'q/k norm off': _qk_norm_off,
          'shared experts off': _fill(('shared_experts.down_proj.weight',), 0),
      },
  )
  cfg = glm4_moe_base()
  cfg.update({
      'num_hidden_layers': 4,
      'first_k_dense_replace': 2,
      'n_group': 1,
      'topk_group': 1,
      'n_shared_experts': 1,
      'routed_scaling_factor': 1.0,
      'use_qk_norm': False,
      'tie_word_embeddings': True,
  })
  glm_air = FamilyFixture(
      base.Fixture(
          name='glm4_moe_nogroup_tied',
          purpose=(
              'GLM-4.5 with the released routing (n_group 1, routed scaling '
              '1.0 as GLM-4.5-Air), no q/k norm (GLM-4.5-Air), layers 0-1 '
              'dense, one shared expert, partial rotary 0.5, q/k/v biases, '
              'tied embeddings.'
          ),
          covers=[
              'partial_rotary',
              'no_qk_norm',
              'first_k_dense_replace',
              'shared_experts',
              'sigmoid_routing',
              'e_score_correction_bias',
              'no_groups',
              'tied',
              'per_expert_names',
          ],
          config_cls='Glm4MoeConfig',
          config=cfg,
          model_cls='Glm4MoeForCausalLM',
          naming=GLM_NAMING,
          seed=23000,
          ablations={
              'norm_topk_prob False': {'norm_topk_prob': False},
              'routed_scaling_factor 2.5': {'routed_scaling_factor': 2.5},
          },
      ),
      edits={
          'e_score_correction_bias 0': _fill(('e_score_correction_bias',), 0.0),
      },
  )

  minimax = FamilyFixture(
      base.Fixture(
          name='minimax_m2_partial_qknorm',
          purpose=(
              'MiniMax-M2: rotary_dim 8 of head_dim 16 (the legacy key, '
              'partial_rotary_factor 0.5), q_norm / k_norm RMSNorms over all '
              'heads at once (weights [N * D] and [K * D]) before the '
              'rotary, sigmoid scores + random e_score_correction_bias for '
              'the choice (top-3 of 8), the chosen sigmoids renormalised, '
              'GQA 4 / 2, no biases, untied.'
          ),
          covers=[
              'partial_rotary',
              'rotary_dim',
              'qk_norm_all_heads',
              'sigmoid_routing',
              'e_score_correction_bias',
              'norm_topk_prob_true',
              'untied',
              'per_expert_names',
          ],
          config_cls='MiniMaxM2Config',
          config=minimax_m2_base(),
          model_cls='MiniMaxM2ForCausalLM',
          naming=MINIMAX_NAMING,
          seed=24000,
          ablations={
              'partial_rotary_factor 1.0': {
                  'rope_parameters': {
                      'rope_type': 'default',
                      'rope_theta': 10000.0,
                      'partial_rotary_factor': 1.0,
                  }
              },
              'rms_norm_eps 1e-2': {'rms_norm_eps': 1e-2},
          },
      ),
      edits={
          'e_score_correction_bias 0': _fill(('e_score_correction_bias',), 0.0),
          'q/k norm per head': _qk_norm_per_head,
          'q/k norm off': _qk_norm_off,
      },
  )

  llama4_rope = llama4_text_base()['rope_parameters']
  llama4 = FamilyFixture(
      base.Fixture(
          name='llama4_text_nope_chunked',
          purpose=(
              'Llama-4 text (Llama4ForCausalLM): layers 0, 2 dense '
              '(intermediate_size_mlp 48), 1, 3 MoE (interleave_moe_layer_'
              'step 2, as Maverick): a shared expert plus top-1 of 4 experts '
              'whose sigmoid score scales the expert input; layers 0, 1 RoPE '
              'with chunked attention (chunk 4 < S), layers 2, 3 NoPE with '
              'full attention and temperature tuning (floor_scale 4, '
              'attn_scale 0.1); weightless q/k RMSNorm after the rotary on '
              'the RoPE layers; interleaved (complex) rotary with llama3 '
              'scaling (factor 8, low 1, high 4, original 16).'
          ),
          covers=[
              'interleave_moe_layer_step',
              'intermediate_size_mlp',
              'shared_expert',
              'top1_sigmoid_routing',
              'router_scales_input',
              'no_rope_layers',
              'chunked_attention',
              'qk_l2_norm_after_rope',
              'attn_temperature_tuning',
              'rope_interleaved',
              'llama3_rope',
              'untied',
              'fused_expert_names',
          ],
          config_cls='Llama4TextConfig',
          config=llama4_text_base(),
          model_cls='Llama4ForCausalLM',
          naming=LLAMA4_NAMING.format(prefix='model.'),
          seed=25000,
          ablations={
              'attention_chunk_size 5': {'attention_chunk_size': 5},
              'attn_temperature_tuning False': {
                  'attn_temperature_tuning': False
              },
              'floor_scale 5': {'floor_scale': 5},
              'use_qk_norm False': {'use_qk_norm': False},
              'no NoPE layers (every layer RoPE, chunked)': {
                  'no_rope_layers': [1, 1, 1, 1]
              },
              'no rope scaling': {
                  'rope_parameters': {
                      'rope_type': 'default',
                      'rope_theta': llama4_rope['rope_theta'],
                  }
              },
          },
      ),
      edits={
          'router score on the expert output': _llama4_scale_outputs,
          'rotary pairs (i, i + D/2)': _llama4_half_split_rope,
          'shared expert off': _fill(('shared_expert.down_proj.weight',), 0),
      },
  )
  conditional = FamilyFixture(
      base.Fixture(
          name='llama4_conditional_text',
          purpose=(
              'The llama4_text_nope_chunked text tower (same weights, same '
              'outputs) saved inside the multimodal '
              'Llama4ForConditionalGeneration (model_type llama4, text under '
              'text_config) with a tiny random vision tower: text tensors '
              'named language_model.model.* and language_model.lm_head.'
              'weight, beside vision_model.* and multi_modal_projector.*.'
          ),
          covers=['conditional_generation_names', 'vision_tower_skipped'],
          config_cls='Llama4Config',
          config={'vision_config': TINY_VISION},
          text_config=llama4_text_base(),
          model_cls='Llama4ForConditionalGeneration',
          naming=LLAMA4_NAMING.format(prefix='language_model.model.'),
          seed=26000,
          reload_cls='Llama4ForConditionalGeneration',
      ),
      text_of=llama4.fixture.name,
  )
  cfg = llama4_text_base()
  cfg.update({
      'num_hidden_layers': 3,
      'interleave_moe_layer_step': 1,
      'no_rope_layers': [1, 1, 0],
      'attention_chunk_size': 5,
      'use_qk_norm': False,
      'floor_scale': 3,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': 500000.0},
  })
  llama4_all_moe = FamilyFixture(
      base.Fixture(
          name='llama4_text_all_moe',
          purpose=(
              'Llama-4 text as Scout: every layer MoE (shared expert + top-1 '
              'of 4), no q/k norm, plain RoPE (theta 500000), layers 0, 1 '
              'chunked (chunk 5), layer 2 NoPE with temperature tuning '
              '(floor_scale 3).'
          ),
          covers=[
              'every_layer_moe',
              'shared_expert',
              'top1_sigmoid_routing',
              'router_scales_input',
              'no_rope_layers',
              'chunked_attention',
              'no_qk_norm',
              'attn_temperature_tuning',
              'rope_interleaved',
              'untied',
              'fused_expert_names',
          ],
          config_cls='Llama4TextConfig',
          config=cfg,
          model_cls='Llama4ForCausalLM',
          naming=LLAMA4_NAMING.format(prefix='model.'),
          seed=27000,
          ablations={
              'attention_chunk_size 4': {'attention_chunk_size': 4},
              'attn_temperature_tuning False': {
                  'attn_temperature_tuning': False
              },
          },
      ),
      edits={'router score on the expert output': _llama4_scale_outputs},
  )
  return [gpt_oss, glm, glm_air, minimax, llama4, conditional, llama4_all_moe]


# --- statistics ------------------------------------------------------------


def _swiglu_clipping(model, input_ids) -> dict[str, float]:
  """The share of the routed gate values the clamp lowers and of the up
  values it clips (either side), over every GPT-OSS expert call."""
  counts = {'gate': [0, 0], 'up': [0, 0]}

  def record(self, gate_up):
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    counts['gate'][0] += int((gate > self.limit).sum())
    counts['up'][0] += int((up.abs() > self.limit).sum())
    counts['gate'][1] += gate.numel()
    counts['up'][1] += up.numel()
    return type(self)._apply_gate(self, gate_up)

  other = copy.deepcopy(model)
  for module in other.modules():
    if type(module).__name__ == 'GptOssExperts':
      module._apply_gate = types.MethodType(record, module)
  with torch.no_grad():
    other(input_ids, use_cache=False)
  return {
      'gate_share_above_limit': counts['gate'][0] / counts['gate'][1],
      'up_share_outside_limit': counts['up'][0] / counts['up'][1],
  }


def _sink_mass(model, input_ids) -> dict[str, float]:
  """The probability the sinks take (1 - the row sum of the key weights)."""
  with torch.no_grad():
    out = model(input_ids, use_cache=False, output_attentions=True)
  mass = torch.stack([1 - a.sum(-1) for a in out.attentions])
  return {
      'sink_mass_mean': float(mass.mean()),
      'sink_mass_min': float(mass.min()),
      'sink_mass_max': float(mass.max()),
  }


def _stats(model, input_ids) -> dict[str, Any]:
  """The family's own numbers, each checked to be what the fixture is for."""
  config = model.config.get_text_config()
  stats: dict[str, Any] = {}
  if config.model_type == 'gpt_oss':
    stats |= _swiglu_clipping(model, input_ids)
    stats |= _sink_mass(model, input_ids)
    if min(stats['gate_share_above_limit'], stats['up_share_outside_limit']) < (
        0.02
    ):
      raise RuntimeError(f'the SwiGLU clamp hardly clips: {stats}')
    if stats['sink_mass_mean'] < 0.02:
      raise RuntimeError(f'the sinks take almost nothing: {stats}')
  if config.model_type == 'llama4_text' and config.attn_temperature_tuning:
    positions = np.arange(base.SEQ_LEN + base.MAX_NEW_TOKENS)
    scales = (
        np.log1p(np.floor((positions + 1.0) / config.floor_scale))
        * config.attn_scale
        + 1.0
    )
    stats['attn_temperature_scales_by_position'] = [
        round(float(s), 6) for s in scales
    ]
    stats['layer_types'] = list(config.layer_types)
    stats['moe_layers'] = list(config.moe_layers)
  return stats


# --- writing ---------------------------------------------------------------


def _edit_changes(spec: FamilyFixture, model, input_ids, logits):
  """Max abs logit change under each edit (on a copy of the model)."""
  changes = {}
  for label, edit in spec.edits.items():
    other = copy.deepcopy(model)
    context = edit(other) or contextlib.nullcontext()
    with context, torch.no_grad():
      moved = other(input_ids, use_cache=False).logits
    changes[label] = float((moved - logits).abs().max())
    if not changes[label] >= 1e-3:
      raise RuntimeError(f'{spec.fixture.name}: edit {label} changes nothing')
  return changes


def _draw_tower(model, seed: int) -> None:
  """Draws every tensor outside `language_model.` from `seed` (a vision
  tower that no text logit reads, only its names and shapes matter)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if not name.startswith('language_model.'):
        p.copy_(base.WEIGHT_STD * torch.randn(p.shape, generator=gen))


def _conditional(spec: FamilyFixture, source) -> tuple:
  """The source fixture's text weights inside spec's multimodal model."""
  seed, text_model, input_ids, text_out = source
  model = base.build(spec.fixture)
  _draw_tower(model, spec.fixture.seed)
  model.language_model.load_state_dict(text_model.state_dict(), strict=True)
  out = base.run_model(model, input_ids)
  diff = float((out['logits'] - text_out['logits']).abs().max())
  if diff > 1e-6 or not torch.equal(out['generated'], text_out['generated']):
    raise RuntimeError(f'{spec.fixture.name}: text tower differs by {diff}')
  return seed, model, input_ids, out


def _finish_meta(spec: FamilyFixture, out_root: pathlib.Path, built) -> None:
  """Adds the edits' logit changes and the family's statistics to the
  meta.json that make_hf_fixtures._write wrote."""
  _, model, input_ids, out = built
  path = out_root / spec.fixture.name / 'meta.json'
  meta = json.loads(path.read_text())
  meta['edits_max_abs_logit_change'] = _edit_changes(
      spec, model, input_ids, out['logits']
  )
  meta['family_stats'] = _stats(model, input_ids)
  if spec.text_of:
    meta['text_weights_of'] = spec.text_of
    meta['tower_seed'] = spec.fixture.seed
  path.write_text(json.dumps(meta, indent=2) + '\n')


def make_fixtures(out_root: pathlib.Path, only: set[str] | None) -> None:
  out_root.mkdir(parents=True, exist_ok=True)
  built = {}
  specs = _fixtures()
  for spec in specs:
    name = spec.fixture.name
    needed = only is None or name in only
    if spec.text_of:
      if not needed:
        continue
      if spec.text_of not in built:
        source = next(s for s in specs if s.fixture.name == spec.text_of)
        built[spec.text_of] = base._pick_seed(source.fixture)
      built[name] = _conditional(spec, built[spec.text_of])
    elif needed or any(s.text_of == name for s in specs):
      built[name] = base._pick_seed(spec.fixture)
    if needed:
      base._write(spec.fixture, out_root, built[name])
      _finish_meta(spec, out_root, built[name])


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', type=pathlib.Path, default=base.FIXTURES)
  parser.add_argument('--only', action='append', default=None)
  args = parser.parse_args(argv)
  torch.set_num_threads(1)
  torch.use_deterministic_algorithms(True)
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  make_fixtures(args.out, set(args.only) if args.only else None)


if __name__ == '__main__':
  main(sys.argv[1:])
