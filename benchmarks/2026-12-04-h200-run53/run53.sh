#!/usr/bin/env bash
# run 53 (issue 26): b11b1d4 (run 52's commit with the warp sums of the count and the max back to
# d1cec25's shuffles). The GPU test files of the kernels and the statistics from an empty kernel
# cache; kernel level (split.py) for this tree, d1cec25 and 49b6c77 (run 52's), 2 rounds; the inline
# cost of stats=True (bench_manager --strategies scatter_reduce --stats-rounds 5): this tree,
# d1cec25, this tree.
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
mkdir -p /tmp/t_head /tmp/t_c52 && tar -xf .devrun/head.tar -C /tmp/t_head && tar -xf .devrun/c52.tar -C /tmp/t_c52
ln -s $PWD /tmp/t_new
rm -rf /tmp/cache_*
( LOWGRAD_CACHE_DIR=/tmp/cache_new PYTHONPATH=. timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 100 --timeout-method=thread -rf --tb=short tests/test_kernels_grad_stats_gpu.py tests/test_kernels_gpu.py tests/test_manager_stats_gpu.py tests/test_ops_stats.py > $R/gpu_tests.log 2>&1; echo "rc=$?" >> $R/gpu_tests.log )
echo "gpu tests $(( $(date +%s) - T0 ))s: $(tail -2 $R/gpu_tests.log | tr '\n' ' ')"
for round in 1 2; do
  for v in head c52 new; do
    ( cd /tmp/t_$v && LOWGRAD_CACHE_DIR=/tmp/cache_$v PYTHONPATH=. timeout 60 python3 /tmp/t_new/.devrun/split.py $v $R/split_${v}_$round.json > $R/split_${v}_$round.log 2>&1; echo "rc=$?" >> $R/split_${v}_$round.log )
    echo "split $v $round $(( $(date +%s) - T0 ))s: $(tail -2 $R/split_${v}_$round.log | tr '\n' ' ')"
  done
done
for x in new:1 head:1 new:2; do v=${x%:*}; round=${x#*:}
  [ $(( $(date +%s) - T0 )) -gt 170 ] && { echo "stats $v $round skipped (time)"; continue; }
  ( cd /tmp/t_$v && LOWGRAD_CACHE_DIR=/tmp/cache_$v PYTHONPATH=. timeout 40 python3 tools/bench_manager.py --strategies scatter_reduce --stats-rounds 5 --json $R/stats_${v}_$round.json > $R/stats_${v}_$round.log 2>&1; echo "rc=$?" >> $R/stats_${v}_$round.log )
  echo "stats $v $round $(( $(date +%s) - T0 ))s: $(tail -3 $R/stats_${v}_$round.log | head -1)"
done
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r53.tar r && rm -rf $R
