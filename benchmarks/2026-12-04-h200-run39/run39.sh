#!/usr/bin/env bash
# run 39 (issue 26, an experiment on the statistics' cost): trees put in .devrun/ beforehand, each the
# committed tree (new.tar, a159384) with StatsAcc::add8 in kernels/grad_stats.cuh cut down: v3 no
# branch for the non-finite count (sum of squares and max of every group, count 0), v4 the branch
# but no max in the common group, v5 only the sum of squares, v6 nothing per element (slots and the
# per-micro-step finish only). The cost of stats=True on the Qwen2.5-1.5B layout's world-1 micro-step
# (bench_manager --stats-rounds 3, on/off interleaved in each process), the trees alternated in two rounds.
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
V="new v3 v4 v5 v6"
for v in $V; do mkdir -p /tmp/$v && tar -xf .devrun/$v.tar -C /tmp/$v; done
for round in 1 2; do for v in $V; do
  (cd /tmp/$v && LOWGRAD_CACHE_DIR=/tmp/cache-$v timeout 60 python3 tools/bench_manager.py --strategies scatter_reduce \
     --stats-rounds 3 --json $R/stats_${v}_$round.json) > $R/stats_${v}_$round.log 2>&1
  echo "$v round $round rc=$? $(grep -E '^scatter_reduce +[0-9.]+ +[0-9.]+ +1\.' $R/stats_${v}_$round.log)"
done; done
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
