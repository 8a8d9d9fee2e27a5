"""A model ready to generate, from a training run's directory or a Hugging
Face checkpoint folder: `load_model` (`linen_moe.decoding.load_model`),
what the command line's `generate` and Hugging Face `export` call.

A run directory (`RunOptions.checkpoint_dir`) gives its latest (or
`step`'s) checkpoint and the tokenizer files and `generation_config.json`
the run kept (`tokenizer_files`); a Hugging Face folder (with its
`config.json`) gives its weights, tokenizer and generation config. The
stop ids are the generation config's `eos_token_id`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from linen_moe._src.config.model_config import ModelConfig
from linen_moe._src.config.quantization_modes import SERVING_MODES
from linen_moe._src.config.variables import OVERWRITE_WITH_GRADIENT
from linen_moe._src.data import tokenization
from linen_moe._src.hf import generation_config as generation_config_file
from linen_moe._src.hf.load import CONFIG_FILE
from linen_moe._src.run import tokenizer_files


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """A model loaded for generation (`load_model`).

  Attributes:
    config: its `ModelConfig` (a serving config with serving weights).
    variables: its variables (what `Decoder.apply` and
      `decoding.generate` take).
    tokenizer: its `tokenizers.Tokenizer`, or None (none there, or the
      `tokenizers` package is missing).
    tokenizer_path: the `tokenizer.json` read, or None.
    stop_ids: the ids that end a generation (`eos_token_id`), maybe ().
    generation_config: its `generation_config.json`, or None.
    tokenizer_files: the tokenizer files beside it (for an export).
    step: the training step read (None for a Hugging Face folder).
  """

  config: ModelConfig
  variables: dict
  tokenizer: Any
  tokenizer_path: str | None
  stop_ids: tuple[int, ...]
  generation_config: dict | None
  tokenizer_files: tuple[str, ...]
  step: int | None = None


def load_model(
    path: str | os.PathLike,
    *,
    serve: str = "none",
    quantization: str | None = None,
    tokenizer: str | os.PathLike | None = None,
    step: int | None = None,
    dtype: str | None = None,
) -> LoadedModel:
  """A training run's model, or a Hugging Face checkpoint's, ready to
  generate with its tokenizer and stop ids.

  Example usage:

    model = linen_moe.decoding.load_model("runs/tiny_mixtral-20261207-1200")
    ids = model.tokenizer.encode("Hello").ids
    result = linen_moe.decoding.generate(
        model.config, model.variables, [ids], max_new_tokens=16,
        stop_ids=model.stop_ids,
    )

  Args:
    path: a run's `checkpoint_dir`, or a Hugging Face checkpoint folder
      (one holding `config.json`).
    serve: "none" (float weights), or a serving mode ("int8", "fp8"): the
      expert weights converted to it (`quantization.quantize_weights`; a
      Hugging Face checkpoint's as its tensors are read).
    quantization: with float weights, the mode they compute in: "none",
      or a run's own mode (which keeps its fp8 state); None: a run's
      variables as it trained them (its mode), a Hugging Face
      checkpoint's in "none".
    tokenizer: a `tokenizer.json` to use instead of the one in `path`.
    step: a run's checkpoint to read (default: the latest).
    dtype: a run's floating parameters cast to it as they are read
      (`checkpoint.read_variables`).

  Returns:
    The `LoadedModel`.

  Raises:
    ValueError: `path` is neither, `serve` or `quantization` is not a
      mode, a run's float weights asked in another mode than the one it
      trained in, or a tokenizer file that does not exist.
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise ValueError(f"path={path!r} is invalid: it is not a directory.")
  if serve != "none" and serve not in SERVING_MODES:
    raise ValueError(
        f"serve={serve!r} is invalid: expected 'none' or one of "
        f"{tuple(SERVING_MODES)}."
    )
  is_hf = os.path.isfile(os.path.join(path, CONFIG_FILE))
  if is_hf:
    config, variables, read_step = *_hf_model(path, serve, quantization), None
  else:
    config, variables, read_step = _run_model(
        path, serve, quantization, step, dtype
    )
  tokenizer_path = tokenizer and os.fspath(tokenizer)
  if tokenizer_path is None:
    tokenizer_path = tokenization.find_tokenizer(path)
  elif not os.path.isfile(tokenizer_path):
    raise ValueError(f"tokenizer={tokenizer_path!r}: no such file.")
  generation = generation_config_file.read(path)
  kept = tuple(
      p
      for p in (os.path.join(path, f) for f in tokenizer_files.TOKENIZER_FILES)
      if os.path.isfile(p)
  )
  return LoadedModel(
      config=config,
      variables=variables,
      tokenizer=_tokenizer(tokenizer_path),
      tokenizer_path=tokenizer_path,
      stop_ids=tuple(generation_config_file.stop_ids(generation)),
      generation_config=generation,
      tokenizer_files=kept,
      step=read_step,
  )


def _hf_model(path: str, serve: str, quantization: str | None):
  from linen_moe._src.hf import load as hf_load  # noqa: PLC0415 (jax)

  serving = serve != "none"
  return hf_load.load_checkpoint(
      path,
      quantization=serve if serving else quantization or "none",
      serving=serving,
  )


def _run_model(path, serve, quantization, step, dtype):
  """(config, variables, step) of a run's checkpoint, as `load_model`
  says."""
  from linen_moe._src.checkpoint import export  # noqa: PLC0415 (jax)

  config, variables, read_step = export.read_variables(
      path, dtype=dtype, step=step
  )
  if serve != "none":
    from linen_moe._src.quantization import serving  # noqa: PLC0415

    served = serving.quantize_weights(
        config.replace(quantization=serve), variables
    )
    return *served, read_step
  if quantization is None:  # as trained
    return config, variables, read_step
  mode = quantization
  if mode == "none":  # every collection but the fp8 state (routed biases too)
    float_vars = {
        k: v for k, v in variables.items() if k != OVERWRITE_WITH_GRADIENT
    }
    return config.replace(quantization="none"), float_vars, read_step
  if mode != config.moe.quantization:
    raise ValueError(
        f"quantization={mode!r} is invalid: {path} trained in "
        f"{config.moe.quantization!r}; its float weights compute in that "
        f"mode or in 'none' (or serve them converted: `serve` {mode})."
    )
  return config, variables, read_step


def _tokenizer(path: str | None):
  """The `tokenizers.Tokenizer` of `path`, or None (no path, or no
  `tokenizers` package)."""
  if path is None:
    return None
  try:
    import tokenizers  # noqa: F401, PLC0415
  except ImportError:
    return None
  return tokenization.load_tokenizer(path)
