#!/usr/bin/env bash
# The --world 2 half of tools/gpu_session.sh (run it through that script: bash tools/gpu_session.sh
# --world 2 [--dry-run] [DIR]; its --help says what runs). Arguments: DRY (0 or 1) and the folder given.
#
# Budget on 2 x H200 (GPU_SESSION_BUDGET, 570 s: the device call's 600 less a margin). Each piece's
# limit is its worst case, and the limits add up to the budget, so that every piece runs:
#   checks (lowgrad import, device count)           ~10 s
#   1. the five steps at world 1, one at a time      5 x 35 s = 175 s  (first: the 1.05x criterion needs them)
#   2. the five steps at world 2                     5 x 40 s = 200 s
#   3. nccl_bench at world 2 (blocking + torch,      35 + 25 s, then 2 x 15 s at world 1 = 90 s
#      then non-blocking), then world 1 both modes
#   4. the two-GPU tests                             90 s
#   5. the report and the tar                        ~5 s
# A piece with under 20 s left is skipped and named (the report marks what is missing). The steps
# run 5 training steps (the median of the last 3); nccl_bench 1 MB .. 256 MB at 10 iterations.
set -u -o pipefail
case "${1:-}" in -h|--help)
  echo "usage: bash tools/gpu_session.sh --world 2 [--dry-run] [DIR]   (this script is that call's --world 2 half;"
  echo "       bash tools/gpu_session.sh --help says what it runs and its time budget)"
  exit 0;;
esac
case "$#:${1:-0}" in [012]:0|[012]:1) ;; *)  # DRY and DIR, as tools/gpu_session.sh passes them
  echo "gpu_session_world2.sh: error: unrecognized arguments: $* (run it as bash tools/gpu_session.sh --world 2;" \
       "see --help)" >&2
  exit 2;;
esac
DRY=${1:-0}
OUTDIR=$(python3 "$(dirname "$0")/_cli.py" output-path gpu_session.sh gpu_session_world2 "${2:-}") || exit 2
OUTDIR=$(realpath -m "$OUTDIR")  # relative to the folder it was called from
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0
# kept between the pieces (and calls): the first lowgrad run compiles the kernels, the others load them
export LOWGRAD_CACHE_DIR=${LOWGRAD_CACHE_DIR:-/tmp/lowgrad-session-cache}
if [ "$DRY" = 0 ]; then
  python3 tools/_cli.py needs-gpu gpu_session.sh || exit 2  # one line and status 2 without a GPU
  n=$(python3 -c "import lowgrad; print(lowgrad.device_count())") || exit 2
  if [ "$n" -lt 2 ]; then echo "gpu_session.sh --world 2: needs two GPUs, $n visible" >&2; exit 2; fi
  TT=(--size 0.5b --steps 5 --micro-steps 4 --batch 4 --seq 1024 --log-every 0)
  # limits in seconds (the header's table): a world-1 step, a world-2 step, the NCCL benches, the tests
  L_W1=35 L_W2=40 L_NB2=35 L_NNB2=25 L_NB1=15 L_TEST=90
  BUDGET=${GPU_SESSION_BUDGET:-570}
else
  export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""  # the CPU, even where a GPU is visible
  TT=(--size tiny --steps 2 --micro-steps 2 --batch 2 --seq 32 --log-every 0)
  # a shared CPU is slower than the GPU at the tiny size: the limits only catch a hang here
  L_W1=120 L_W2=120 L_NB2=60 L_NNB2=60 L_NB1=60 L_TEST=60
  BUDGET=${GPU_SESSION_BUDGET:-850}
fi
NB=(--world 2 --min-bytes 1M --max-bytes 256M --dtypes bf16 --iters 10 --warmup 3)
R=$OUTDIR/run
mkdir -p "$R" || exit 2
echo "gpu_session --world 2$([ "$DRY" = 1 ] && echo ' --dry-run'): $OUTDIR, budget $BUDGET s"

# step NAME LIMIT CMD...: run CMD with its output in run/NAME.log, cut to the budget left
step() {
  local name=$1 limit=$2 left t0 rc; shift 2
  left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then echo "== $name: skipped, budget spent" | tee "$R/$name.log"; return; fi
  [ "$limit" -le "$left" ] || limit=$left
  t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$R/$name.log" 2>&1; rc=$?
  echo "rc=$rc" >> "$R/$name.log"
  echo "== $name: rc=$rc, $((SECONDS - t0)) s (limit $limit s)"
}

# train NAME NPROC LIMIT ARGS...: the 0.5B step under torchrun at NPROC processes (world 1: on GPU 0)
train() {
  local name=$1 nproc=$2 limit=$3; shift 3
  local json="$R/step_${name}_w${nproc}.json" cmd
  if [ "$DRY" = 1 ] && [ "$nproc" = 2 ] && [ "$1" = "--mode" ] && [ "$2" = "lowgrad" ]; then
    # lowgrad's host backend runs ranks as threads of one process: the same arguments, --world 2
    cmd=(python3 examples/train_transformer.py --world 2)
  else
    cmd=(python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" examples/train_transformer.py)
  fi
  if [ "$DRY" = 0 ] && [ "$nproc" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 step "step_${name}_w$nproc" "$limit" "${cmd[@]}" "$@" "${TT[@]}" --json "$json"
  else
    step "step_${name}_w$nproc" "$limit" "${cmd[@]}" "$@" "${TT[@]}" --json "$json"
  fi
}

RUNS=("lowgrad_scatter_reduce --mode lowgrad --strategy scatter_reduce"
      "lowgrad_all_to_all --mode lowgrad --strategy all_to_all"
      "lowgrad_unsharded --mode lowgrad --strategy unsharded"
      "ddp --mode ddp" "fsdp2 --mode fsdp2")

# 1. the world-1 baselines first, one at a time (alone on the host: no second run shares its CPU)
for run in "${RUNS[@]}"; do
  set -- $run; name=$1; shift
  train "$name" 1 "$L_W1" "$@"
done
# 2. the step at world 2
for run in "${RUNS[@]}"; do
  set -- $run; name=$1; shift
  train "$name" 2 "$L_W2" "$@"
done
# 3. NCCL at world 2, both modes (torch.distributed once, beside the default mode)
step nccl_blocking "$L_NB2" python3 tools/nccl_bench.py "${NB[@]}" --mode blocking --json "$R/nccl_blocking.json"
step nccl_nonblocking "$L_NNB2" python3 tools/nccl_bench.py "${NB[@]}" --mode nonblocking --no-torch \
  --json "$R/nccl_nonblocking.json"
# the world-1 bound (host us per call within 10% of the non-blocking mode's): both modes on GPU 0
for mode in blocking nonblocking; do
  step "nccl_w1_$mode" "$L_NB1" python3 tools/nccl_bench.py --world 1 --min-bytes 1M --max-bytes 16M --dtypes bf16 \
    --iters 10 --warmup 3 --mode "$mode" --no-torch --json "$R/nccl_w1_$mode.json"
done
# 4. the two-GPU tests and the communicator's one-GPU ones (last: a later device call can run them
#    alone); on the CPU they are collected and skipped
step tests_world2 "$L_TEST" python3 -m pytest -q -p no:cacheprovider --timeout 80 \
  tests/test_cuda_communicator_faults_gpu.py tests/test_bootstrap_gpu.py tests/test_cuda_communicator_gpu.py \
  tests/test_cuda_communicator_timeout_gpu.py
tail -3 "$R/tests_world2.log"
# 5. the tables
python3 tools/world2_report.py "$R" > "$R/world2_report.log" 2>&1; echo "rc=$?" >> "$R/world2_report.log"
cat "$R/world2_report.log"
tar -C "$R" -cf "$OUTDIR/results.tar" .
echo "gpu_session --world 2: $SECONDS s; results in $OUTDIR/results.tar"
