#!/usr/bin/env bash
# run 50 (issue 26): cearly (run 49) against credux: cearly with the warp sums of the non-finite count
# and the max by one redux.sync each (the sum of squares keeps its shuffle tree). Kernel level, then
# bench_manager for head against the better, 4 rounds alternated; then credux's statistics GPU tests.
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
V="head cearly credux"
for v in $V; do
  mkdir -p /tmp/t_$v && cp -r lowgrad kernels tools examples tests pyproject.toml /tmp/t_$v/
  [ $v != head ] && cp .devrun/$v/* /tmp/t_$v/kernels/
  rm -rf /tmp/cache_$v
done
for round in 1 2 3; do
  for v in $V; do
    ( cd /tmp/t_$v && LOWGRAD_CACHE_DIR=/tmp/cache_$v PYTHONPATH=. timeout 90 python3 $OLDPWD/.devrun/split.py $v $R/split_${v}_$round.json > $R/split_${v}_$round.log 2>&1; echo "rc=$?" >> $R/split_${v}_$round.log )
    echo "split $v $round $(( $(date +%s) - T0 ))s: $(tail -2 $R/split_${v}_$round.log | tr '\n' ' ')"
  done
done
BEST=$(python3 -c "
import json, statistics
r = {v: statistics.median(json.load(open(f'$R/split_{v}_{k}.json'))['ratio_median'] for k in (1, 2, 3)) for v in ('cearly', 'credux')}
print(min(r, key=r.get))")
echo "best $BEST"
for round in 1 2 3 4; do
  for v in head $BEST; do
    ( cd /tmp/t_$v && LOWGRAD_CACHE_DIR=/tmp/cache_$v PYTHONPATH=. timeout 60 python3 tools/bench_manager.py --strategies scatter_reduce --stats-rounds 5 --json $R/stats_${v}_$round.json > $R/stats_${v}_$round.log 2>&1; echo "rc=$?" >> $R/stats_${v}_$round.log )
    echo "stats $v $round $(( $(date +%s) - T0 ))s: $(tail -3 $R/stats_${v}_$round.log | head -1)"
  done
done
( cd /tmp/t_credux && LOWGRAD_CACHE_DIR=/tmp/cache_credux PYTHONPATH=. timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short tests/test_kernels_grad_stats_gpu.py tests/test_kernels_gpu.py tests/test_ops_stats.py tests/test_manager_stats_gpu.py > $R/credux_tests.log 2>&1; echo "rc=$?" >> $R/credux_tests.log )
echo "credux tests: $(tail -3 $R/credux_tests.log | tr '\n' ' ')"
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r50.tar r && rm -rf $R
