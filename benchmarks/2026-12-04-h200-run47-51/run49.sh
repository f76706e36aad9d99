#!/usr/bin/env bash
# run 49 (issue 26): the end of launch of the fused statistics kernel, on top of cond (the rare
# path picked by the add's finite8): cshm (the micro-step for b's set read from shared memory,
# stored there by one thread in the prologue), cearly (the counter read before the last warp
# reduction), and two measurement-only cuts: cnoctr (no counter read at the end) and cnoflush (no
# barrier and slot write). Kernel level, 15 interleaved rounds per process, 3 rounds; then
# bench_manager's on/off cost for head against the best of cond/cshm/cearly, alternated.
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
V="head cond cshm cearly cnoctr cnoflush"
for v in $V; do
  mkdir -p /tmp/t_$v && cp -r lowgrad kernels tools examples tests pyproject.toml /tmp/t_$v/
  [ $v != head ] && cp .devrun/$v/add_sr.cu /tmp/t_$v/kernels/
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
r = {v: statistics.median(json.load(open(f'$R/split_{v}_{k}.json'))['ratio_median'] for k in (1, 2, 3)) for v in ('cond', 'cshm', 'cearly')}
print(min(r, key=r.get))")
echo "best $BEST"
for round in 1 2 3; do
  for v in head $BEST; do
    ( cd /tmp/t_$v && LOWGRAD_CACHE_DIR=/tmp/cache_$v PYTHONPATH=. timeout 60 python3 tools/bench_manager.py --strategies scatter_reduce --stats-rounds 5 --json $R/stats_${v}_$round.json > $R/stats_${v}_$round.log 2>&1; echo "rc=$?" >> $R/stats_${v}_$round.log )
    echo "stats $v $round $(( $(date +%s) - T0 ))s: $(tail -3 $R/stats_${v}_$round.log | head -1)"
  done
done
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r49.tar r && rm -rf $R
