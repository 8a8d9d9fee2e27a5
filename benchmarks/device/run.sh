#!/usr/bin/env bash
# The device run: installs the accelerator build of jax that this project
# pins (and Tokamax on GPU) into a venv, then runs device_run.py beside this
# file, which writes its figures as JSON for benchmarks/reference/. Meant to
# end within ten minutes on one GPU or TPU host (installs ~1-2 min, the run
# BUDGET_S=480 s).
#
#   benchmarks/device/run.sh                      # GPU or TPU, from PyPI
#   benchmarks/device/run.sh --wheels DIR         # offline: wheels in DIR
#   benchmarks/device/run.sh --cpu-dry-run        # rehearse here, tiny
#   OUT=/some/dir benchmarks/device/run.sh        # where the JSON goes
#
# A host without network (--wheels) needs, for Python 3.12: jax, jaxlib and
# jax-cuda13-plugin + jax-cuda13-pjrt (GPU) or libtpu (TPU) of the pinned
# jax version, tokamax and its requirements (GPU), and this project's
# requirements that the host lacks.
set -euo pipefail
cd "$(dirname "$0")/../.."

dry=0
wheels=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-dry-run) dry=1; shift ;;
    --wheels) wheels=$(realpath "$2"); shift 2 ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
out_dir=${OUT:-benchmarks/reference}
mkdir -p "$out_dir"
stamp=$(date +%Y-%m-%d)

if [ "$dry" = 1 ]; then
  python=${PYTHON:-.venv/bin/python}
  exec timeout 900 "$python" benchmarks/device/device_run.py \
    --cpu-dry-run --out "$out_dir/device_cpu-dry-run_$stamp.json"
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  platform=gpu
elif ls /dev/accel* >/dev/null 2>&1 || ls /dev/vfio/* >/dev/null 2>&1; then
  platform=tpu
else
  echo "run.sh: no GPU (nvidia-smi) or TPU (/dev/accel*) here;" \
    "use --cpu-dry-run to rehearse" >&2
  exit 1
fi

# The jax pin, read from pyproject.toml (e.g. "jax>=0.12,<0.13").
pin=$(sed -n 's/^ *"\(jax>=[^"]*\)",.*$/\1/p' pyproject.toml | head -1)
pin_range=${pin#jax}
case "$platform" in
  gpu) accel=("jax[cuda13]$pin_range" "tokamax>=0.0.17,<0.1") ;;
  tpu) accel=("jax[tpu]$pin_range") ;;
esac

venv=${VENV:-/tmp/linen_moe_device}
# System site packages: reuse what the host has (flax, optax, ...) where the
# versions fit; pip upgrades what does not.
[ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
pip_install() {
  if [ -n "$wheels" ]; then
    "$venv/bin/python" -m pip install -q --no-index --find-links "$wheels" "$@"
  else
    "$venv/bin/python" -m pip install -q "$@"
  fi
}
start=$(date +%s)
pip_install "${accel[@]}"
pip_install -e .
echo "installed in $(( $(date +%s) - start )) s:" \
  "$("$venv/bin/python" -c 'import jax; print(jax.__version__, jax.devices())')"

kind=$("$venv/bin/python" -c \
  'import jax; print(jax.devices()[0].device_kind.replace(" ", "-"))')
PYTHONUNBUFFERED=1 exec timeout 560 "$venv/bin/python" \
  benchmarks/device/device_run.py --out "$out_dir/device_${kind}_$stamp.json"
