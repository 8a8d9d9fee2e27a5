"""The public face: every public name, listed once here, and at most 200.

A name added to or removed from a public module's `__all__` (`linen_moe`,
its public modules, `nnx_adapter`) fails this test until the list below
says so: the public API changes on purpose, in a reviewed diff, and the
budget of 200 names keeps it small. Plumbing goes to a private module (or
to `linen_moe.frontend`, the contract of a second front end), with its old
public spelling answering for one release (`linen_moe._src.deprecation`).
"""

import importlib

from absl.testing import absltest

MAX_NAMES = 200

PUBLIC = {
    "linen_moe": (
        "__version__",
        "available_configs",
        "Decoder",
        "KernelFallbackWarning",
        "load_model_config",
        "load_moe_config",
        "MATMUL_PATHS",
        "ModelConfig",
        "MoEAux",
        "MoEConfig",
        "RoutedAndSharedMoE",
        "RoutedMoE",
        "SharedExpert",
    ),
    "linen_moe.checkpoint": (
        "abstract",
        "check_new_directory",
        "Checkpoints",
        "config_dict",
        "DamagedCheckpointError",
        "export",
        "load_export",
        "read_variables",
    ),
    "linen_moe.data": (
        "assistant_spans",
        "BIN_DTYPES",
        "CHAT_FORMAT",
        "ChatCorpus",
        "ChatPipeline",
        "ChatTemplate",
        "Corpus",
        "DataPipeline",
        "FORMATS",
        "global_batch",
        "load_chat_template",
        "load_tokenizer",
        "PACKINGS",
        "process_rows",
        "read_chat",
        "read_corpus",
        "train_bpe_tokenizer",
    ),
    "linen_moe.decoding": (
        "cache_bytes_per_token",
        "decode_step",
        "generate",
        "generate_program",
        "generate_stream",
        "GenerationResult",
        "greedy_generate",
        "init_cache",
        "load_model",
        "prefill",
        "Sampling",
    ),
    "linen_moe.distributed": (
        "DEFAULT_HEARTBEAT_TIMEOUT_S",
        "DEFAULT_INIT_TIMEOUT_S",
        "global_array",
        "initialize",
        "is_main_process",
        "launch",
    ),
    "linen_moe.frontend": (
        "accumulate_gradients",
        "all_finite",
        "compiled_init",
        "hidden_decoder_loss",
        "is_adapter",
        "jit_once",
        "keep_if_finite",
        "layer_aux",
        "layer_name",
        "LAYERS_AXIS",
        "logits_of",
        "loss_weights",
        "output_head",
        "overwrite_with_gradient",
        "per_layer_aux",
        "resolve_positions",
        "resolved_unroll",
        "routed_bias_rule",
        "scale_embeddings",
        "ShardedRun",
        "STACK",
        "stack_body",
        "state_from",
        "train_batch",
        "tree_of",
        "validate_segments",
        "validate_tokens_if_concrete",
        "VARIABLES",
        "variables_of",
    ),
    "linen_moe.hf": (
        "family_match",
        "load_checkpoint",
        "model_config",
        "save_checkpoint",
        "save_peft_adapters",
    ),
    "linen_moe.hlo": (
        "collective_summary",
        "collectives",
        "contractions",
        "quantized_types_at_contractions",
        "sent_bytes",
    ),
    "linen_moe.lora": (
        "count_trainable",
        "init_adapters",
        "join",
        "load_adapters",
        "merge",
        "save_adapters",
        "split",
        "TARGETS",
    ),
    "linen_moe.models": (
        "CHECKPOINT_NAMES",
        "DecoderBlock",
        "embedding",
        "output_kernel",
        "remat_block",
        "remat_policy",
        "RMSNorm",
        "scan_blocks",
        "scanned_to_unrolled",
        "segment_positions",
        "StackPlan",
        "unrolled_to_scanned",
    ),
    "linen_moe.planning": (
        "check_mesh",
        "CHIPS",
        "model_flops",
        "parse_target",
        "Plan",
        "plan",
        "prepare_process",
        "target_devices",
    ),
    "linen_moe.quantization": (
        "CALL_SITES",
        "expert_weight_bytes",
        "MODES",
        "quantize_weights",
        "SERVING_MODES",
    ),
    "linen_moe.routing": (
        "load_balance_loss",
        "route",
        "routed_bias_update",
        "router_z_loss",
        "RouterResult",
    ),
    "linen_moe.serving": (),
    "linen_moe.sharding": (
        "constrain",
        "DEFAULT_RULES",
        "logical_shardings",
        "make_mesh",
        "MESH_AXES",
        "mesh_context",
        "unbox",
    ),
    "linen_moe.testing": (
        "FAMILY_CONFIGS",
        "kernels_on_cpu",
        "license_texts",
        "run_capturing",
        "slow",
        "TINY_CONFIGS",
        "use_compilation_cache",
        "use_fast_compile",
    ),
    "linen_moe.tokens": (
        "checked",
        "valid_token_mask",
        "validate_tokens",
    ),
    "linen_moe.training": (
        "Callback",
        "frontend",
        "FRONTENDS",
        "register_frontend",
        "chunked_cross_entropy",
        "cross_entropy",
        "decoder_loss",
        "default_optimizer",
        "init_train_state",
        "learning_rate_schedule",
        "LinenFrontend",
        "make_eval_step",
        "make_train_step",
        "MarkovData",
        "reuse_host_memory",
        "run",
        "RunOptions",
        "RunResult",
        "RunStopped",
        "SCHEDULES",
        "ShardedTraining",
        "StopRequest",
        "train_state_from_variables",
        "TrainingFrontend",
        "TrainState",
        "weight_decay_mask",
    ),
    "linen_moe.variables": (
        "CACHE",
        "OVERWRITE_WITH_GRADIENT",
        "rng_dict",
        "RNG_STREAMS",
        "STATE_COLLECTIONS",
        "UPDATED_BY_RULE",
    ),
    "nnx_adapter": (
        "accumulate_gradients",
        "apply_gradients",
        "Decoder",
        "decoder_loss",
        "EagerToNNX",
        "Fp8State",
        "frontend",
        "generate",
        "greedy_generate",
        "init_train_state",
        "linen_to_nnx",
        "make_train_step",
        "nnx_to_linen",
        "NNXFrontend",
        "RuleState",
        "train_step",
        "TrainState",
        "value_and_grad",
    ),
}


class PublicNamesTest(absltest.TestCase):

  def test_every_face_exports_exactly_its_list(self):
    for face, names in PUBLIC.items():
      module = importlib.import_module(face)
      self.assertEqual(sorted(module.__all__), sorted(names), face)
      for name in names:
        self.assertTrue(hasattr(module, name), f"{face}.{name}")

  def test_at_most_the_budget(self):
    self.assertLessEqual(sum(map(len, PUBLIC.values())), MAX_NAMES)

  def test_every_public_module_is_listed(self):
    listed = {face.removeprefix("linen_moe.") for face in PUBLIC}
    self.assertEqual(
        sorted(_public_modules()), sorted(listed - {"linen_moe", "nnx_adapter"})
    )


def _public_modules() -> list[str]:
  """The public modules of `linen_moe`: its files not starting with `_`."""
  import pkgutil  # noqa: PLC0415

  import linen_moe  # noqa: PLC0415

  return [
      m.name
      for m in pkgutil.iter_modules(linen_moe.__path__)
      if not m.name.startswith("_") and m.name != "configs"
  ]


if __name__ == "__main__":
  absltest.main()
