#!/usr/bin/env bash
# run 31 (issue 23 tree): whole GPU suite (kernel cache emptied, per-test timeout), the fault-injection
# soak on the GPU (CUDA world 1, loopback world 2 and 4), bench_manager, the demo
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$(date +%s); timeout "$limit" "$@" > "$R/$name.log" 2>&1; echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
git log -1 --format=%H > $R/commit.txt 2>/dev/null
step gpu_tests 300 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short --durations=8
tail -4 $R/gpu_tests.log | cut -c1-300
step soak_w1 80 python3 tools/fault_soak.py --backend cuda --world 1 --steps 300 --json $R/soak_w1.json; tail -14 $R/soak_w1.log | cut -c1-200
step soak_w2 80 python3 tools/fault_soak.py --backend cuda --world 2 --steps 150 --json $R/soak_w2.json; tail -14 $R/soak_w2.log | cut -c1-200
step soak_w4 60 python3 tools/fault_soak.py --backend cuda --world 4 --steps 60 --json $R/soak_w4.json; tail -14 $R/soak_w4.log | cut -c1-200
step bench_manager 45 python3 tools/bench_manager.py --json $R/bench_manager.json; tail -11 $R/bench_manager.log | cut -c1-200
step demo 45 python3 -m lowgrad demo; tail -3 $R/demo.log | cut -c1-200
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
