#!/usr/bin/env bash
# run 47 (issue 26): split the fused statistics' cost (kernel level: every layer's SR add with and
# without stats, 15 interleaved rounds per process) over four kernel trees: head (d1cec25), noelem
# (b's per-element statistics removed), sumsq (b's max removed), dpx (b's max from the bf16 bit
# patterns with Hopper's 16x2 max); then bench_manager's on/off cost for head and dpx alternated;
# then the dpx tree's statistics GPU tests.
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
for v in head noelem sumsq dpx; do
  mkdir -p /tmp/t_$v && cp -r lowgrad kernels tools examples tests pyproject.toml /tmp/t_$v/
  [ $v != head ] && cp .devrun/$v/add_sr.cu /tmp/t_$v/kernels/
  rm -rf /tmp/cache_$v
done
for round in 1 2 3; do
  for v in head noelem sumsq dpx; do
    ( cd /tmp/t_$v && LOWGRAD_CACHE_DIR=/tmp/cache_$v PYTHONPATH=. timeout 90 python3 $OLDPWD/.devrun/split.py $v $R/split_${v}_$round.json > $R/split_${v}_$round.log 2>&1; echo "rc=$?" >> $R/split_${v}_$round.log )
    echo "split $v $round $(( $(date +%s) - T0 ))s: $(tail -2 $R/split_${v}_$round.log | tr '\n' ' ')"
  done
done
for round in 1 2 3; do
  for v in head dpx; do
    ( cd /tmp/t_$v && LOWGRAD_CACHE_DIR=/tmp/cache_$v PYTHONPATH=. timeout 60 python3 tools/bench_manager.py --strategies scatter_reduce --stats-rounds 5 --json $R/stats_${v}_$round.json > $R/stats_${v}_$round.log 2>&1; echo "rc=$?" >> $R/stats_${v}_$round.log )
    echo "stats $v $round $(( $(date +%s) - T0 ))s: $(tail -3 $R/stats_${v}_$round.log | head -1)"
  done
done
( cd /tmp/t_dpx && LOWGRAD_CACHE_DIR=/tmp/cache_dpx PYTHONPATH=. timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short tests/test_kernels_grad_stats_gpu.py tests/test_kernels_gpu.py tests/test_ops_stats.py tests/test_manager_stats_gpu.py > $R/dpx_tests.log 2>&1; echo "rc=$?" >> $R/dpx_tests.log )
echo "dpx tests: $(tail -3 $R/dpx_tests.log | tr '\n' ' ')"
echo "elapsed $(( $(date +%s) - T0 ))s"
