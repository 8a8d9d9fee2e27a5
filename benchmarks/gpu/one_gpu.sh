#!/usr/bin/env bash
# The checks and figures that need an NVIDIA GPU, on a machine with its own
# JAX and no package index (the workplace's H200 device machine: Python
# 3.12.3, jax/jaxlib/jax-cuda13-plugin 0.11.2, flax, optax, orbax, chex,
# torch 2.11, transformers 5.17). What this project needs beyond those
# travels as wheels in .whl-gpu/ (benchmarks/gpu/gpu_wheels.py builds it;
# benchmarks/gpu/README.md says how to carry it); the project runs from the
# checkout.
#
#   benchmarks/gpu/one_gpu.sh [STEP ...]                # on the GPU
#   benchmarks/gpu/one_gpu.sh --cpu-dry-run [STEP ...]  # a rehearsal here
#
# Steps (benchmarks/gpu/gpu_run.py --list; each under its own time limit,
# all of them within one device call's): env tests kernels layer decode mfu
# profile vs_torch. Default: env tests (gpu_run.CALLS[0]). Writes
# $OUT/gpu_run.json, $OUT/gpu_run.txt and $OUT/gpu_run.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/one_gpu}
SITE=${SITE:-/tmp/site-gpu}  # where the carried wheels install
WHEELS=${WHEELS:-.whl-gpu}
PYTHON=${PYTHON:-python3}
export SITE
mkdir -p "$OUT"
if [ -d "$WHEELS" ]; then
  # Only the wheels whose distribution the machine lacks: its own packages
  # stay the ones imported, wherever its sys.path puts them.
  mapfile -t wheels < <("$PYTHON" benchmarks/gpu/gpu_run.py \
    --missing-wheels "$WHEELS")
  if [ "${#wheels[@]}" -gt 0 ]; then
    echo "installing ${#wheels[@]} carried wheels into $SITE"
    PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install --isolated -q \
      --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}" 2>&1 |
      tail -3
  fi
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE
fi
# linen_moe.configs is configs/ (setup.py's package_dir); the checkout, which
# pytest puts first for tests/, finds it through this link, made only where
# the import fails (the machine; an editable install here has it), and
# removed after the run (it is no file of the project).
if ! "$PYTHON" -c 'import linen_moe.configs' 2>/dev/null; then
  ln -s ../configs linen_moe/configs
  trap 'rm -f linen_moe/configs' EXIT
fi
"$PYTHON" benchmarks/gpu/gpu_run.py --out "$OUT" "$@"
