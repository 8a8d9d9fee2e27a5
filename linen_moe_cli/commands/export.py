"""`linen-moe export`: a checkpoint's serving variables, no optimizer state;
as an orbax directory, or (`--format hf`) as a Hugging Face checkpoint that
transformers loads (`--format hf-fp8`: its linear weights in block fp8
with `weight_scale_inv`, the DeepSeek-V3 / Qwen3-FP8 layout).

Only reads the run's directory: it needs no lock, and may run beside a
training run on the same directory.
"""

from __future__ import annotations

import argparse

from linen_moe.checkpoint import check_new_directory

FORMATS = ("orbax", "hf", "hf-fp8", "adapters")


def register(subparsers) -> None:
  p = subparsers.add_parser(
      "export",
      help=(
          "write a checkpoint's serving variables (no optimizer state), or "
          "its float weights as a Hugging Face checkpoint (--format hf)"
      ),
  )
  p.add_argument(
      "--checkpoint-dir",
      required=True,
      metavar="RUN",
      help=(
          "a `linen-moe train` run's directory (its latest checkpoint, or"
          " --step)"
      ),
  )
  p.add_argument("--out", required=True, help="a new directory")
  p.add_argument(
      "--format",
      choices=FORMATS,
      default="orbax",
      help=(
          "orbax: the variables (linen_moe.checkpoint.load_export reads "
          "them); hf: config.json and safetensors in the hub's names; "
          "hf-fp8: the same with the linear weights in block fp8 (128 x 128 "
          "blocks, weight_scale_inv), as DeepSeek-V3 and Qwen3-FP8 ship; "
          "a LoRA run's hf export is the merged model "
          "(linen_moe.lora.merge); adapters: a LoRA run's adapters alone, in "
          "PEFT's format (adapter_config.json, adapter_model.safetensors: "
          "peft.PeftModel.from_pretrained loads them on the transformers "
          "model of the base): every adapter for Mixtral, Qwen3-MoE, "
          "DeepSeek-V3, Gemma-4, GLM-4.5 and MiniMax-M2; for GPT-OSS and "
          "Llama-4 all but the routed experts' (stored as x @ W, they have "
          "no PEFT form), with every adapter also in linen_moe's files "
          "beside them (adapters.safetensors, adapters.json: "
          "linen_moe.lora.load_adapters reads them); for a model with no "
          "Hugging Face form, linen_moe's files alone"
      ),
  )
  p.add_argument(
      "--dtype",
      choices=("float32", "bfloat16", "float16"),
      default=None,
      help="cast the parameters (fp8 state stays float32)",
  )
  p.add_argument(
      "--max-shard-size",
      default="2GB",
      help="--format hf/hf-fp8: the largest safetensors shard, e.g. 2GB",
  )
  p.add_argument("--step", type=int, default=None, help="default: the latest")
  p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  check_new_directory(args.out, "--out")
  if args.format in ("hf", "hf-fp8"):
    from linen_moe import decoding  # noqa: PLC0415 (imports jax)
    from linen_moe import hf  # noqa: PLC0415

    # The float weights, with what the run kept of its tokenizer.
    kept = decoding.load_model(
        args.checkpoint_dir, dtype=args.dtype, step=args.step
    )
    config, variables, step = kept.config, kept.variables, kept.step
    if config.moe.lora is not None:  # the adapters folded in
      from linen_moe import lora  # noqa: PLC0415

      config, variables = lora.merge(config, variables)
    files = hf.save_checkpoint(
        config.replace(quantization="none"),
        variables,
        args.out,
        max_shard_size=args.max_shard_size,
        weight_format="block_fp8" if args.format == "hf-fp8" else "float",
        generation_config=kept.generation_config or {},
        tokenizer_files=kept.tokenizer_files,
    )
    tokenizer = "the tokenizer" if kept.tokenizer_path else "no tokenizer"
    print(
        f"exported step {step} of {args.checkpoint_dir} to {args.out} "
        f"(Hugging Face{', block fp8' if args.format == 'hf-fp8' else ''}, "
        f"{len(files)} safetensors file(s), generation_config.json, "
        f"{tokenizer})"
    )
    return 0
  from linen_moe import checkpoint  # noqa: PLC0415 (imports jax)

  if args.format == "adapters":
    from linen_moe import lora  # noqa: PLC0415

    config, variables, step = checkpoint.read_variables(
        args.checkpoint_dir, dtype=args.dtype, step=args.step
    )
    if config.moe.lora is None:
      raise ValueError(
          f"--format adapters: {args.checkpoint_dir} is not a LoRA run "
          "(its config has lora_rank 0): there are no adapters to write."
      )
    from linen_moe import hf  # noqa: PLC0415

    match = hf.family_match(config)
    if not match.exports:  # PEFT loads onto a transformers model only
      lora.save_adapters(config, variables, args.out)
      print(
          f"exported the adapters of step {step} of {args.checkpoint_dir} to "
          f"{args.out} (rank {config.moe.lora_rank}) as linen_moe's "
          "adapters.safetensors and adapters.json (lora.load_adapters reads "
          "them), not PEFT's: this model has no Hugging Face form (the "
          f"nearest family, {match.model_type}, needs "
          f"{'; '.join(match.differences)})"
      )
      return 0
    with checkpoint.Checkpoints(args.checkpoint_dir, create=False) as ckpts:
      run = ckpts.meta(step).get("run", {})
    base = run.get("init_from_hf")
    files = hf.save_peft_adapters(
        config,
        variables,
        args.out,
        base_model_name_or_path=base,
        no_peft_form="linen_moe",
    )
    print(_adapters_line(args, step, config, match, base, files))
    return 0
  step = checkpoint.export(
      args.checkpoint_dir, args.out, dtype=args.dtype, step=args.step
  )
  print(f"exported step {step} of {args.checkpoint_dir} to {args.out}")
  return 0


def _adapters_line(args, step, config, match, base, files) -> str:
  """What `--format adapters` wrote, and what reads it."""
  names = {f.name for f in files}
  head = (
      f"exported the adapters of step {step} of {args.checkpoint_dir} to "
      f"{args.out} (rank {config.moe.lora_rank})"
  )
  peft = (
      "peft.PeftModel.from_pretrained(model, out) loads them onto the "
      f"transformers model of the base ({base})"
  )
  if "adapters.json" not in names:
    return f"{head} in PEFT's format: {peft}"
  own = (
      "linen_moe's adapters.safetensors and adapters.json hold every "
      "adapter (linen_moe.lora.load_adapters reads them onto the base: the "
      "run's model)"
  )
  without = (
      f"the routed experts of {match.model_type} are stored as x @ W and "
      "have no PEFT form"
  )
  if "adapter_config.json" not in names:
    return f"{head} as linen_moe's files alone ({without}): {own}"
  return (
      f"{head}: in PEFT's format all but the routed experts' ({without}; "
      f"{peft}, without the experts' adapters); {own}"
  )
