#!/usr/bin/env bash
# run 34 (the session's final tree): whole GPU suite (kernel cache emptied, per-test timeout), a short
# fault soak through the loopback, and the tools a user runs, for real, at their defaults where short
# (bench_manager, bench_graph, bench_layer, nccl_bench at world 1, a 20 s race hunt): the summary table
# of BENCHMARKS.md is regenerated from this run's JSON (benchmarks/runs.json, benchmarks/summarize.py)
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$(date +%s); timeout "$limit" "$@" > "$R/$name.log" 2>&1; echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
step gpu_tests 300 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short --durations=5
tail -3 $R/gpu_tests.log | cut -c1-300
step soak_w2 60 python3 tools/fault_soak.py --backend cuda --world 2 --steps 50 --json $R/soak_w2.json; tail -4 $R/soak_w2.log | cut -c1-200
step bench_manager 40 python3 tools/bench_manager.py --json $R/bench_manager.json; tail -10 $R/bench_manager.log | cut -c1-200
step bench_graph 40 python3 tools/bench_graph.py --json $R/bench_graph.json; tail -5 $R/bench_graph.log | cut -c1-200
step bench_layer 40 python3 tools/bench_layer.py --json $R/bench_layer.json; tail -5 $R/bench_layer.log | cut -c1-200
step nccl_bench 60 python3 tools/nccl_bench.py --world 1 --json $R/nccl_bench.json; tail -6 $R/nccl_bench.log | cut -c1-200
step race_w2 45 python3 tools/race_hunt.py --world 2 --seconds 20 --json $R/race_w2.json; tail -3 $R/race_w2.log | cut -c1-200
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
