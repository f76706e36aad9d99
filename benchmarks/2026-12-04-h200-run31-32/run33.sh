#!/usr/bin/env bash
# run 33 (the session's final tree): whole GPU suite (kernel cache emptied, per-test timeout), a short soak
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$(date +%s); timeout "$limit" "$@" > "$R/$name.log" 2>&1; echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
step gpu_tests 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short --durations=5
tail -4 $R/gpu_tests.log | cut -c1-300
step soak_w2 70 python3 tools/fault_soak.py --backend cuda --world 2 --steps 80 --json $R/soak_w2.json; tail -5 $R/soak_w2.log | cut -c1-200
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
