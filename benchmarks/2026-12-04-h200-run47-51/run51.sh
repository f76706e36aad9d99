#!/usr/bin/env bash
# run 51 (issue 26): the candidate kernels (working tree: the rare path picked by the add's finite8,
# the counter's micro-step read in the prologue and before the last warp sums, the count and max
# by redux.sync) against d1cec25 (head) and credux (run 50's). Kernel level, 15 interleaved rounds
# per process, 3 rounds; then bench_manager's on/off cost, head against the better, 4 rounds.
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
mkdir -p /tmp/t_head && tar -xf .devrun/head.tar -C /tmp/t_head
mkdir -p /tmp/t_credux && tar -xf .devrun/head.tar -C /tmp/t_credux && cp .devrun/credux/* /tmp/t_credux/kernels/
mkdir -p /tmp/t_cpre && cp -r lowgrad kernels tools examples tests pyproject.toml /tmp/t_cpre/
V="head credux cpre"
rm -rf /tmp/cache_*
for round in 1 2 3; do
  for v in $V; do
    ( cd /tmp/t_$v && LOWGRAD_CACHE_DIR=/tmp/cache_$v PYTHONPATH=. timeout 90 python3 $OLDPWD/.devrun/split.py $v $R/split_${v}_$round.json > $R/split_${v}_$round.log 2>&1; echo "rc=$?" >> $R/split_${v}_$round.log )
    echo "split $v $round $(( $(date +%s) - T0 ))s: $(tail -2 $R/split_${v}_$round.log | tr '\n' ' ')"
  done
done
BEST=$(python3 -c "
import json, statistics
r = {v: statistics.median(json.load(open(f'$R/split_{v}_{k}.json'))['ratio_median'] for k in (1, 2, 3)) for v in ('credux', 'cpre')}
print(min(r, key=r.get))")
echo "best $BEST"
for round in 1 2 3 4; do
  for v in head $BEST; do
    ( cd /tmp/t_$v && LOWGRAD_CACHE_DIR=/tmp/cache_$v PYTHONPATH=. timeout 60 python3 tools/bench_manager.py --strategies scatter_reduce --stats-rounds 5 --json $R/stats_${v}_$round.json > $R/stats_${v}_$round.log 2>&1; echo "rc=$?" >> $R/stats_${v}_$round.log )
    echo "stats $v $round $(( $(date +%s) - T0 ))s: $(tail -3 $R/stats_${v}_$round.log | head -1)"
  done
done
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r51.tar r && rm -rf $R
