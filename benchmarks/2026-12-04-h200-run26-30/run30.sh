#!/usr/bin/env bash
# run 30 (final tree): whole GPU suite (empty kernel cache), bench_manager at world 1 with the
# inline and the communication-stream path side by side, the demo
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$(date +%s); timeout "$limit" "$@" > "$R/$name.log" 2>&1; echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
step gpu_tests 170 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 60 --timeout-method=thread -rf --tb=short --durations=5
tail -3 $R/gpu_tests.log | cut -c1-300
step bench_manager 45 python3 tools/bench_manager.py --json $R/bench_manager.json; tail -11 $R/bench_manager.log | cut -c1-200
step demo 45 python3 -m lowgrad demo; grep -A6 "^strategy" $R/demo.log | cut -c1-200; tail -2 $R/demo.log | cut -c1-200
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
