#!/usr/bin/env bash
# run 45 (issue 26): the statistics kernel pinned at 3 blocks per SM (__launch_bounds__) and the
# micro-step read once into shared memory. The cost of stats=True on the Qwen2.5-1.5B layout's
# world-1 micro-step (bench_manager --stats-rounds 5, on/off interleaved in each process) for this
# tree and 1e8b25b (run 44's, .devrun/prev.tar) alternated in three rounds; the whole GPU suite
# from an empty kernel cache with a per-test timeout; the 0.5B step (4 micro-steps of 16 x 1024,
# 7 steps, median) of lowgrad scatter_reduce without and with --stats, alternated in two rounds.
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
mkdir -p /tmp/prev && tar -xf .devrun/prev.tar -C /tmp/prev && rm -rf /tmp/cache-prev
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$(date +%s); timeout "$limit" "$@" > "$R/$name.log" 2>&1;
  echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; tail -${TAILN:-4} "$R/$name.log" | cut -c1-220; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
bench() { local v=$1 dir=$2 round=$3; ( cd $dir && LOWGRAD_CACHE_DIR=${4:-$LOWGRAD_CACHE_DIR} PYTHONPATH=. TAILN=3 step stats_${v}_$round 60 \
  python3 tools/bench_manager.py --strategies scatter_reduce,scatter_reduce+comm_stream --stats-rounds 5 --json $R/stats_${v}_$round.json ); }
for round in 1 2 3; do
  bench head $PWD $round
  bench prev /tmp/prev $round /tmp/cache-prev
done
rm -rf "$LOWGRAD_CACHE_DIR"
PYTHONPATH=. step gpu_tests 300 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short --durations=5
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0)
t() { local name=$1; shift; [ $(( $(date +%s) - T0 )) -gt 470 ] && { echo "== $name skipped (time)"; return; }
  PYTHONPATH=. timeout 60 python3 examples/train_transformer.py "${C[@]}" "$@" --json $R/$name.json > $R/$name.log 2>&1
  echo "== $name rc=$? $(( $(date +%s) - T0 ))s $(grep -o 'median step [0-9.]* ms' $R/$name.log)"; }
for round in 1 2; do
  t new_sr_$round --mode lowgrad --strategy scatter_reduce
  t stats_sr_$round --mode lowgrad --strategy scatter_reduce --stats $R/stats_sr_$round.jsonl
done
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
