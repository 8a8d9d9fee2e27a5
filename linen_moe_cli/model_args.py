"""The flags that choose and override a model config, shared by commands.

Imports no jax: the config names and quantization modes are read without it.
"""

from __future__ import annotations

import argparse
import functools
import re

import yaml

from linen_moe import available_configs
from linen_moe.quantization import MODES
from linen_moe.quantization import SERVING_MODES

LAYERS = ("scanned", "unrolled")
# `--serve MODE`: the storage of the expert weights a model serves from
# (none: the float weights), in `generate` and in `plan`.
SERVE = ("none", *SERVING_MODES)


class _Yaml12Floats(yaml.SafeLoader):
  """PyYAML's safe loader that also reads `1e-3` as a float.

  PyYAML follows YAML 1.1, whose floats need a dot (`1.0e-3`); YAML 1.2 and
  every user writing `--set router_z_loss_weight=1e-3` do not.
  """


_Yaml12Floats.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def check_serve(args: argparse.Namespace) -> None:
  """`--serve MODE` runs its own mode: `--quantization`, if given, is it."""
  serve = getattr(args, "serve", None)
  if serve not in (None, "none") and args.quantization not in (None, serve):
    raise ValueError(
        f"--quantization {args.quantization} with --serve {serve}: "
        "serving weights run in their own mode; drop --quantization or "
        f"pass --quantization {serve}."
    )


@functools.cache
def config_list() -> str:
  """The shipped configs, each with the Hugging Face `model_type` that
  `export --format hf` writes it as, or "no HF form" and the nearest
  family (`linen_moe.hf.family_match`; reads the YAML files, no jax)."""
  from linen_moe import hf  # noqa: PLC0415 (no jax)
  from linen_moe import load_model_config  # noqa: PLC0415

  items = []
  for name in available_configs():
    match = hf.family_match(load_model_config(name))
    if match.exports:
      items.append(f"{name} [hf: {match.model_type}]")
    else:
      n = len(match.differences)
      items.append(
          f"{name} [no HF form: {n} field{'s' * (n > 1)} differ from "
          f"{match.model_type}]"
      )
  return (
      "shipped (in brackets, the Hugging Face model_type export --format hf "
      "writes): "
      + ", ".join(items)
  )


def add_model_args(p: argparse.ArgumentParser) -> None:
  """--config, --quantization, --sparse-matmul, --capacity-factor,
  --layers and --set (read back with `model_overrides`)."""
  p.add_argument(
      "--config",
      default="tiny_mixtral",
      help=f"a config name or a path to a .yml file; {config_list()}",
  )
  p.add_argument(
      "--quantization",
      choices=tuple(MODES),
      default=None,
      help="override the config's quantization",
  )
  p.add_argument(
      "--sparse-matmul",
      action=argparse.BooleanOptionalAction,
      default=None,
      help="override the config's matmul path",
  )
  p.add_argument(
      "--capacity-factor",
      type=float,
      default=None,
      help="override the capacity factor (<= 0: dropless)",
  )
  p.add_argument(
      "--layers",
      choices=LAYERS,
      default=None,
      help="scan the decoder blocks or unroll them",
  )
  p.add_argument(
      "--set",
      action="append",
      default=[],
      metavar="FIELD=VALUE",
      help=(
          "override any config field (repeatable; the value is read as YAML), "
          "e.g. --set routed_bias=false --set router_z_loss_weight=1e-3"
      ),
  )


def parse_set(items: list[str]) -> dict:
  """["field=value", ...] -> {field: YAML value}; raises ValueError on an
  item without '=' (unknown fields are the config's to reject)."""
  overrides = {}
  for item in items:
    field, sep, value = item.partition("=")
    if not sep or not field.strip():
      raise ValueError(
          f"--set {item!r}: expected FIELD=VALUE, e.g. routed_bias=false."
      )
    overrides[field.strip()] = yaml.load(value, _Yaml12Floats)  # noqa: S506
  return overrides


def model_overrides(args: argparse.Namespace) -> dict:
  """Config overrides named on the command line (`add_model_args`)."""
  overrides = parse_set(args.set)
  if args.quantization is not None:
    overrides["quantization"] = args.quantization
  if args.sparse_matmul is not None:
    overrides["sparse_matmul"] = args.sparse_matmul
  if args.capacity_factor is not None:
    overrides["capacity_factor"] = args.capacity_factor
  if args.layers is not None:
    overrides["scan_layers"] = args.layers == "scanned"
  if getattr(args, "remat", None) is not None:  # train's and plan's flag
    overrides["remat"] = args.remat
  return overrides
