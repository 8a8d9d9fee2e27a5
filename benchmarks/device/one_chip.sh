#!/usr/bin/env bash
# The checks and figures that need an accelerator, on a machine of one TPU
# chip with its own JAX and no network (the workplace's device machine:
# Python 3.11, jax 0.10.2 with libtpu). This project's other requirements
# travel as wheels in .whl-tpu/ (benchmarks/device/README.md says which and
# how); the project runs from the checkout, not installed.
#
#   benchmarks/device/one_chip.sh [STEP ...]   # default: every step
#
# Steps (each under its own time limit, its output in $OUT/STEP.log):
#   tests      the tests that run only on a TPU (tests/models/test_attention.py's
#              SplashOnTpuTest: splash against the einsum)
#   attention  benchmarks/model/bench_attention.py accelerator
#   tiles      benchmarks/layer/bench_gmm_tiles.py: megablox gmm's tiles
#   plan       benchmarks/planning/plan_vs_run.py: a plan beside its run,
#              and a batch the plan says does not fit beside the chip's answer
#   generate   benchmarks/serving/bench_generate.py on a bf16 Mixtral shape
#              of 2.4 B parameters: the decode step against the chip's
#              weight-read limit
#   gmm        the Pallas grouped matmul: its tests compiled for the chip
#              (tests/kernels/test_tpu_kernels.py -k on_tpu), then
#              benchmarks/device/bench_gmm.py: a tile sweep, and dense /
#              ragged_dot / megablox / ours forward + backward side by side
#              at the issue's three shapes, equal and skewed groups; writes
#              $OUT/gmm/bench_gmm.json and $OUT/gmm/gmm_tiles.json (copy the
#              latter to linen_moe/_src/kernels/tpu/); 120 + 420 s at most,
#              each shape written as it ends; GMM_ARGS adds options
#              (e.g. "--shapes 8192,2048,5632,8 --top 2"). Not in the
#              default run.
#   gmm_tests  gmm's tests alone.
#   gate_up    the paired gate and up projections: their tests compiled for
#              the chip (tests/kernels/test_pallas_gate_up.py -k on_tpu), then
#              benchmarks/device/bench_gate_up.py: two calls beside the
#              paired kernels at several tiles, forward + backward, at the
#              layer benchmarks' shapes and Mixtral's; $OUT/gate_up/;
#              120 + 300 s at most; GATE_UP_ARGS adds options (e.g.
#              "--shapes 32768,4096,14336,8"). Not in the default run.
#   gather     benchmarks/device/bench_gather.py: XLA's row gather beside
#              the Pallas DMA row gather at a Qwen3-30B-A3B layer's sizes
#              (dispatch, masked dispatch, one combine gather, float32 in
#              both DMA forms), ms and fraction of the HBM roofline;
#              $OUT/gather/bench_gather.json; 120 s at most; GATHER_ARGS
#              adds options (e.g. "--block-rows 128 256 512 1024"). Not in
#              the default run.
#   mfu        benchmarks/device/bench_mfu.py: one decoder layer's MFU at
#              Mixtral-8x7B and Qwen3-30B-A3B layer dimensions (two depths,
#              the variants alternating); $OUT/mfu/bench_mfu.json; 400 s
#              at most; MFU_ARGS adds options (e.g. "--variants bf16
#              ragged_dot"). Not in the default run.
#   int8_mxu   benchmarks/device/bench_int8_mxu.py: int8 against bf16 on
#              the matrix unit (XLA's dense dot, our gmm at several tiles)
#              and the int8 path's quantizations, forward only;
#              $OUT/int8_mxu/; 150 s at most. Not in the default run.
#   profile    benchmarks/device/profile_step.py: the top device ops of a
#              few traced steps, by group; $OUT/profile/; PROFILE_ARGS adds
#              options (e.g. "--shape mixtral"). Not in the default run.
#   profile_layer  benchmarks/device/profile_layer.py: the MoE layer alone
#              (ours, "auto") and its dense equivalent, forward + backward
#              at bench_maxtext_layer.py's two shapes, traced and reduced
#              to the top device ops by group; $OUT/profile_layer/; 200 s
#              at most; PROFILE_LAYER_ARGS adds options. Not in the
#              default run.
#   maxtext    benchmarks/device/bench_maxtext_layer.py: MaxText 0.2.5's
#              MoE layer (megablox, ragged_dot, tokamax) beside ours (auto,
#              ragged_dot) and a dense gated MLP of the same FLOPs, forward +
#              backward, same weights and input, at 8 x 2048 x 5632 top-2
#              and 128 x 2048 x 768 top-8; $OUT/maxtext/; 480 s at most.
#              Needs .whl-maxtext/ carried (maxtext_wheels.py makes it)
#              beside .whl-tpu/; installs the rest from the machine's index
#              (MAXTEXT_INDEX: another index, for a rehearsal elsewhere);
#              MAXTEXT_ARGS adds options (e.g. "--variants dense ours_auto
#              maxtext_megablox"). Not in the default run.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/one_chip}
SITE=${SITE:-/tmp/site}  # where the carried wheels install
mkdir -p "$OUT"
if [ -d .whl-tpu ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index \
    --no-deps --no-compile --no-cache-dir --upgrade --ignore-requires-python \
    --target "$SITE" .whl-tpu/*.whl 2>&1 | tail -3
  export PYTHONPATH=${PYTHONPATH:-}:$SITE
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# linen_moe.configs is configs/ (setup.py's package_dir); a checkout that is
# not installed finds it through this link, made on the machine only.
[ -e linen_moe/configs ] || ln -s ../configs linen_moe/configs
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3

step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]}"
}

steps=${*:-tests attention tiles plan generate}
python3 -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'
for s in $steps; do
  case $s in
    tests)
      step tests 150 python3 -m pytest -q -p no:cacheprovider \
        tests/models/test_attention.py -k Splash ;;
    attention)
      step attention 120 python3 benchmarks/model/bench_attention.py \
        accelerator --seqs 2048 4096 8192 --repeats 10 ;;
    tiles)
      step tiles 240 python3 benchmarks/layer/bench_gmm_tiles.py ;;
    plan)
      step plan 220 python3 benchmarks/planning/plan_vs_run.py \
        --target tpu:v5e-1 --config qwen3_30b_a3b \
        --set num_layers=2 num_experts=32 vocab_size=32768 \
        --batch-size 4 --seq-len 4096 --remat full --steps 6
      # four times the batch: the plan says it does not fit, so should the chip
      step plan_too_big 220 python3 benchmarks/planning/plan_vs_run.py \
        --target tpu:v5e-1 --config qwen3_30b_a3b \
        --set num_layers=2 num_experts=32 vocab_size=32768 \
        --batch-size 16 --seq-len 4096 --remat full --steps 2 ;;
    gmm | gmm_tests)
      # The tests need pytest, absl and hypothesis (wheels); the bench only
      # jax and numpy, and checks ours against ragged_dot itself.
      if python3 -c 'import pytest, absl, hypothesis' 2>/dev/null; then
        step gmm_tests 120 python3 -m pytest -q -p no:cacheprovider \
          tests/kernels/test_tpu_kernels.py -k on_tpu
      else
        echo "== gmm_tests: skipped (no pytest / absl / hypothesis here)"
      fi
      [ "$s" = gmm ] || continue
      # shellcheck disable=SC2086  # GMM_ARGS: extra options, word-split
      step gmm 420 python3 benchmarks/device/bench_gmm.py --out "$OUT/gmm" \
        ${GMM_ARGS:-} ;;
    gate_up)
      # The tests of the paired kernels compiled for the chip, then the
      # gate and up projections paired beside two calls.
      if python3 -c 'import pytest, absl, hypothesis' 2>/dev/null; then
        step gate_up_tests 120 python3 -m pytest -q -p no:cacheprovider \
          tests/kernels/test_pallas_gate_up.py -k on_tpu
      fi
      # shellcheck disable=SC2086  # GATE_UP_ARGS: extra options, word-split
      step gate_up 300 python3 benchmarks/device/bench_gate_up.py \
        --out "$OUT/gate_up" ${GATE_UP_ARGS:-} ;;
    gather)
      # shellcheck disable=SC2086  # GATHER_ARGS: extra options, word-split
      step gather 120 python3 benchmarks/device/bench_gather.py \
        --out "$OUT/gather" ${GATHER_ARGS:-} ;;
    mfu)
      # shellcheck disable=SC2086  # MFU_ARGS: extra options, word-split
      step mfu 420 python3 benchmarks/device/bench_mfu.py --out "$OUT/mfu" \
        --budget-s 400 ${MFU_ARGS:-} ;;
    int8_mxu)
      step int8_mxu 150 python3 benchmarks/device/bench_int8_mxu.py \
        --out "$OUT/int8_mxu" ;;
    profile)
      # shellcheck disable=SC2086  # PROFILE_ARGS: extra options
      step profile 240 python3 benchmarks/device/profile_step.py \
        --out "$OUT/profile" ${PROFILE_ARGS:-} ;;
    profile_layer)
      # shellcheck disable=SC2086  # PROFILE_LAYER_ARGS: extra options
      step profile_layer 200 python3 benchmarks/device/profile_layer.py \
        --out "$OUT/profile_layer" ${PROFILE_LAYER_ARGS:-} ;;
    maxtext)
      if [ ! -d .whl-maxtext ]; then
        echo "== maxtext: skipped (no .whl-maxtext: carry it)"
        continue
      fi
      # The index's packages first (each with its requirements, one at a
      # time: a name the index lacks costs only itself), then the carried
      # wheels as they are; both after this project's .whl-tpu/.
      for name in $(python3 benchmarks/device/maxtext_wheels.py --index); do
        PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q \
          --only-binary=:all: --no-compile --no-cache-dir --upgrade \
          --index-url "${MAXTEXT_INDEX:-file:///opt/pypi/simple}" \
          --target "$SITE-maxtext/index" "$name" 2>&1 | tail -3
      done
      PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q \
        --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --ignore-requires-python --target "$SITE-maxtext/whl" \
        .whl-maxtext/*.whl 2>&1 | tail -3
      # shellcheck disable=SC2086  # MAXTEXT_ARGS: extra options
      step maxtext 480 env \
        PYTHONPATH="$PYTHONPATH:$SITE-maxtext/whl:$SITE-maxtext/index" \
        python3 benchmarks/device/bench_maxtext_layer.py \
        --out "$OUT/maxtext" ${MAXTEXT_ARGS:-} ;;
    generate)
      step generate 300 python3 benchmarks/serving/bench_generate.py \
        --set num_layers=8 num_heads=16 vocab_size=32000 emb_dim=2048 \
        moe_mlp_dim=5632 dtype=bfloat16 param_dtype=bfloat16 \
        --rounds 3 --steps 8 ;;
    *) echo "one_chip.sh: unknown step $s" >&2 ;;
  esac
done
