#!/usr/bin/env bash
# Everything that needs the GPU, in one go (one device call): doctor, the GPU tests, the kernel,
# per-layer, CUDA-graph, manager and NCCL benchmarks, the demo, and the example LM trained through
# lowgrad's CUDA backend (SR bf16 vs fp32 vs round-to-nearest bf16 accumulation) with its loss plot.
# Outputs go to DIR/run/ and are packed into DIR/results.tar (the plot also as DIR/losses.png).
#   bash tools/gpu_session.sh [DIR]   (PYTHONPATH=. is set here; DIR by default $OUT/gpu_session, else
#   ./gpu_session; from the repository's root, a temporary folder: tools/_cli.py output-path)
set -u -o pipefail
OUTDIR=$(python3 "$(dirname "$0")/_cli.py" output-path gpu_session.sh gpu_session "${1:-}") || exit 2
OUTDIR=$(realpath -m "$OUTDIR")  # relative to the folder it was called from
cd "$(dirname "$0")/.."
python3 tools/_cli.py needs-gpu gpu_session.sh || exit 2  # one line and status 2 without a GPU
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0
# a fresh state: the kernel cache starts empty, so the suite compiles every kernel itself
export LOWGRAD_CACHE_DIR=${LOWGRAD_CACHE_DIR:-/tmp/lowgrad-session-cache}
rm -rf "$LOWGRAD_CACHE_DIR"
R=$OUTDIR/run
mkdir -p "$R/lm"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$R/$name.log" 2>&1; echo "rc=$?" >> "$R/$name.log"; }
step doctor 120 python3 -m lowgrad doctor; cat "$R/doctor.log"
step gpu_tests 420 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120; tail -4 "$R/gpu_tests.log"
step bench_kernels 200 python3 tools/bench_kernels.py --json "$R/bench_kernels.json"; tail -32 "$R/bench_kernels.log"
step bench_manager 200 python3 tools/bench_manager.py --json "$R/bench_manager.json"; tail -9 "$R/bench_manager.log"
step bench_layer 150 python3 tools/bench_layer.py --json "$R/bench_layer.json"; tail -16 "$R/bench_layer.log"
step bench_graph 150 python3 tools/bench_graph.py --json "$R/bench_graph.json"; tail -5 "$R/bench_graph.log"
step bench_manager_only 120 python3 tools/bench_manager.py --manager-only --strategies scatter_reduce,all_to_all \
  --json "$R/bench_manager_only.json"; tail -5 "$R/bench_manager_only.log"
step nccl_bench 150 python3 tools/nccl_bench.py --max-bytes 256M --dtypes bf16 --json "$R/nccl_bench.json"
tail -22 "$R/nccl_bench.log"
step demo 200 python3 -m lowgrad demo --json "$R/demo.json"; grep -v '^\[' "$R/demo.log" | head -8
LM=(--hidden 256 --layers 4 --embed 32 --batch 256 --micro-steps 8 --steps 100 --lr 5e-3 --weight-decay 0.1 --log-every 50)
# seed 1 runs of SR and fp32: the run-to-run noise the SR-vs-fp32 difference is compared with
for run in "sr_bf16" "fp32 --accum fp32" "rn_bf16 --accum rn_bf16" "sr_bf16_seed1 --seed 1" \
           "fp32_seed1 --accum fp32 --seed 1"; do
  set -- $run; name=$1; shift
  step "lm_$name" 150 python3 examples/train_lm.py --device cuda "$@" "${LM[@]}" --json "$R/lm/$name.json"; tail -2 "$R/lm_$name.log"
done
python3 examples/plot_losses.py "$R"/lm/*.json --out "$OUTDIR/losses.png" > "$R/plot.log" 2>&1; tail -8 "$R/plot.log"
tar -C "$R" -cf "$OUTDIR/results.tar" .
