#!/usr/bin/env bash
# run 43 (issue 26: the micro-step rows finished once per step, in stats(), instead of at every
# micro-step): the whole GPU suite from an empty kernel cache with a per-test timeout on 776cf80;
# then the cost of stats=True on the Qwen2.5-1.5B layout's world-1 micro-step (bench_manager
# --stats-rounds 5, on/off interleaved in each process) for three trees in rounds: 776cf80 (this
# tree, with the header twins folded), 1dac8b1 (the per-step finish alone) and 22960ff (the
# per-micro-step finish, run 41's code); bench_kernels on this tree.
# The other trees come as .devrun/{mid,old}.tar (git archive of those commits), each with its own
# kernel cache.
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
for v in mid old; do mkdir -p /tmp/$v && tar -xf .devrun/$v.tar -C /tmp/$v; rm -rf /tmp/cache-$v; done
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$(date +%s); timeout "$limit" "$@" > "$R/$name.log" 2>&1;
  echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; tail -${TAILN:-4} "$R/$name.log" | cut -c1-220; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
PYTHONPATH=. step gpu_tests 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short --durations=5
bench() { local v=$1 dir=$2 round=$3; ( cd $dir && LOWGRAD_CACHE_DIR=${4:-$LOWGRAD_CACHE_DIR} PYTHONPATH=. TAILN=3 step stats_${v}_$round 60 \
  python3 tools/bench_manager.py --strategies scatter_reduce,scatter_reduce+comm_stream --stats-rounds 5 --json $R/stats_${v}_$round.json ); }
for round in 1 2 3; do
  bench head $PWD $round
  bench mid /tmp/mid $round /tmp/cache-mid
  [ $round -le 2 ] && bench old /tmp/old $round /tmp/cache-old
done
PYTHONPATH=. TAILN=12 step bench_kernels 60 python3 tools/bench_kernels.py --json $R/bench_kernels.json
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
