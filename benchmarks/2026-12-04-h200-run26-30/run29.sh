#!/usr/bin/env bash
# run 29 (final tree): whole GPU suite (empty kernel cache), race hunts at world 1 (inline path) and 4
# (loopback copy kernel now from copy.cuh), bench_manager and bench_graph at world 1, step times, demo
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$(date +%s); timeout "$limit" "$@" > "$R/$name.log" 2>&1; echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
step gpu_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 60 --timeout-method=thread -rf --tb=short --durations=5
tail -3 $R/gpu_tests.log | cut -c1-300
step race_w1 70 python3 tools/race_hunt.py --world 1 --seconds 35 --json $R/race_w1.json; tail -3 $R/race_w1.log | cut -c1-300
step race_w4 70 python3 tools/race_hunt.py --world 4 --seconds 35 --json $R/race_w4.json; tail -3 $R/race_w4.log | cut -c1-300
step bench_manager 90 python3 tools/bench_manager.py --json $R/bench_manager.json; tail -9 $R/bench_manager.log | cut -c1-200
step bench_graph 60 python3 tools/bench_graph.py --json $R/bench_graph.json; tail -6 $R/bench_graph.log | cut -c1-200
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0)
for run in "t_torch_bf16 --mode torch_bf16" "t_lg_sr --mode lowgrad --strategy scatter_reduce" "t_lg_unsh --mode lowgrad --strategy unsharded" "t_torch_fp32 --mode torch_fp32" "t_lg_sr_rsr --mode lowgrad --strategy scatter_reduce --rounding sr" "t_lg_sr2 --mode lowgrad --strategy scatter_reduce"; do
  set -- $run; name=$1; shift
  step $name 50 python3 examples/train_transformer.py "$@" "${C[@]}" --json $R/$name.json; tail -2 $R/$name.log | cut -c1-200
done
step demo 60 python3 -m lowgrad demo; tail -4 $R/demo.log | cut -c1-300
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
