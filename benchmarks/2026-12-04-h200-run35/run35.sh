#!/usr/bin/env bash
# run 35 (issues 25 and 26): the whole GPU suite from an empty kernel cache with a per-test timeout,
# the CLI/example tests on a GPU, the LM example's CUDA path, and the tools whose ratios
# BENCHMARKS.md records (bench_kernels, bench_manager, bench_graph, bench_layer), plus the cost of
# stats=True on the 1.5B layout's micro-step (bench_manager --stats-rounds, interleaved)
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
step cli_tests 120 python3 -m pytest -q -p no:cacheprovider --timeout 100 --timeout-method=thread -rf --tb=short tests/test__cli.py tests/test_examples.py
tail -2 $R/cli_tests.log | cut -c1-200
step train_lm_cuda 40 python3 examples/train_lm.py --device cuda --json $R/train_lm_cuda.json; tail -2 $R/train_lm_cuda.log | cut -c1-200
step bench_kernels 60 python3 tools/bench_kernels.py --json $R/bench_kernels.json; tail -12 $R/bench_kernels.log | cut -c1-200
step bench_manager 45 python3 tools/bench_manager.py --json $R/bench_manager.json; tail -10 $R/bench_manager.log | cut -c1-200
step bench_manager_stats 60 python3 tools/bench_manager.py --strategies scatter_reduce --stats-rounds 5 --json $R/bench_manager_stats.json; tail -4 $R/bench_manager_stats.log | cut -c1-200
step bench_graph 40 python3 tools/bench_graph.py --json $R/bench_graph.json; tail -5 $R/bench_graph.log | cut -c1-200
step bench_layer 40 python3 tools/bench_layer.py --json $R/bench_layer.json; tail -5 $R/bench_layer.log | cut -c1-200
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
