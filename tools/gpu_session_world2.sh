#!/usr/bin/env bash
# The --world 2 half of tools/gpu_session.sh (run it through that script: bash tools/gpu_session.sh
# --world 2 [--dry-run] [DIR]; its --help says what runs). Arguments: DRY (0 or 1) and the folder given.
set -u -o pipefail
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
  TT=(--size 0.5b --steps 6 --micro-steps 4 --batch 4 --seq 1024 --log-every 0)
  NB=(--world 2 --min-bytes 1M --max-bytes 1G --dtypes bf16 --iters 20 --warmup 5)
  TEST_TIMEOUT=170
else
  export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""  # the CPU, even where a GPU is visible
  TT=(--size tiny --steps 2 --micro-steps 2 --batch 2 --seq 32 --log-every 0)
  NB=(--world 2 --min-bytes 1M --max-bytes 1G --dtypes bf16 --iters 20 --warmup 5)
  TEST_TIMEOUT=60
fi
BUDGET=${GPU_SESSION_BUDGET:-570}  # seconds for everything: the device call's 600 less a margin
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

# train NAME NPROC GPU ARGS...: the 0.5B step under torchrun at NPROC processes (GPU: the one world 1 uses)
train() {
  local name=$1 nproc=$2 gpu=$3; shift 3
  local json="$R/step_${name}_w${nproc}.json" cmd
  if [ "$DRY" = 1 ] && [ "$nproc" = 2 ] && [ "$1" = "--mode" ] && [ "$2" = "lowgrad" ]; then
    # lowgrad's host backend runs ranks as threads of one process: the same arguments, --world 2
    cmd=(python3 examples/train_transformer.py --world 2)
  else
    cmd=(python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" examples/train_transformer.py)
  fi
  if [ "$DRY" = 0 ] && [ "$nproc" = 1 ]; then
    CUDA_VISIBLE_DEVICES=$gpu step "step_${name}_w$nproc" 100 "${cmd[@]}" "$@" "${TT[@]}" --json "$json"
  else
    step "step_${name}_w$nproc" 100 "${cmd[@]}" "$@" "${TT[@]}" --json "$json"
  fi
}

RUNS=("lowgrad_scatter_reduce --mode lowgrad --strategy scatter_reduce"
      "lowgrad_all_to_all --mode lowgrad --strategy all_to_all"
      "lowgrad_unsharded --mode lowgrad --strategy unsharded"
      "ddp --mode ddp" "fsdp2 --mode fsdp2")

# 1. NCCL at world 2, both modes (torch.distributed once, beside the default mode)
step nccl_blocking 90 python3 tools/nccl_bench.py "${NB[@]}" --mode blocking --json "$R/nccl_blocking.json"
step nccl_nonblocking 60 python3 tools/nccl_bench.py "${NB[@]}" --mode nonblocking --no-torch \
  --json "$R/nccl_nonblocking.json"
# the world-1 bound (host us per call within 10% of the non-blocking mode's): both modes on GPU 0
for mode in blocking nonblocking; do
  step "nccl_w1_$mode" 40 python3 tools/nccl_bench.py --world 1 --min-bytes 1M --max-bytes 16M --dtypes bf16 \
    --mode "$mode" --no-torch --json "$R/nccl_w1_$mode.json"
done
# 2. the step at world 2
for run in "${RUNS[@]}"; do
  set -- $run; name=$1; shift
  train "$name" 2 0,1 "$@"
done
# 3. the two-GPU tests and the communicator's one-GPU ones (before the world-1 baselines, which
#    BENCHMARKS.md already has from earlier runs); on the CPU they are collected and skipped
step tests_world2 "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider --timeout 170 \
  tests/test_cuda_communicator_faults_gpu.py tests/test_bootstrap_gpu.py tests/test_cuda_communicator_gpu.py \
  tests/test_cuda_communicator_timeout_gpu.py
tail -3 "$R/tests_world2.log"
# 4. the world-1 baselines, two at a time (one per GPU)
pair=()
for run in "${RUNS[@]}" ""; do
  if [ -n "$run" ]; then pair+=("$run"); fi
  if [ "${#pair[@]}" = 2 ] || { [ -z "$run" ] && [ "${#pair[@]}" = 1 ]; }; then
    gpu=0
    for one in "${pair[@]}"; do
      set -- $one; name=$1; shift
      train "$name" 1 "$gpu" "$@" &
      gpu=$((gpu + 1))
    done
    wait
    pair=()
  fi
done
# 5. the tables
python3 tools/world2_report.py "$R" > "$R/world2_report.log" 2>&1; echo "rc=$?" >> "$R/world2_report.log"
cat "$R/world2_report.log"
tar -C "$R" -cf "$OUTDIR/results.tar" .
echo "gpu_session --world 2: $SECONDS s; results in $OUTDIR/results.tar"
