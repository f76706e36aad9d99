#!/usr/bin/env bash
# run 52 (issue 26): the commit's code. The whole GPU suite from an empty kernel cache with a
# per-test timeout; the cost of stats=True (bench_manager --stats-rounds 5, inline and
# comm_stream) for this tree, d1cec25 (.devrun/head.tar) and this tree again; bench_kernels; the
# 0.5B step (4 micro-steps of 16 x 1024, 7 steps, median) without and with --stats.
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
mkdir -p /tmp/head && tar -xf .devrun/head.tar -C /tmp/head && rm -rf /tmp/cache-head
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$(date +%s); timeout "$limit" "$@" > "$R/$name.log" 2>&1;
  echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; tail -${TAILN:-4} "$R/$name.log" | cut -c1-220; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
PYTHONPATH=. step gpu_tests 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short --durations=5
bench() { local v=$1 dir=$2 round=$3; ( cd $dir && LOWGRAD_CACHE_DIR=${4:-$LOWGRAD_CACHE_DIR} PYTHONPATH=. TAILN=3 step stats_${v}_$round 60 \
  python3 tools/bench_manager.py --strategies scatter_reduce,scatter_reduce+comm_stream --stats-rounds 5 --json $R/stats_${v}_$round.json ); }
bench new $PWD 1
bench head /tmp/head 1 /tmp/cache-head
bench new $PWD 2
PYTHONPATH=. TAILN=12 step bench_kernels 60 python3 tools/bench_kernels.py --json $R/bench_kernels.json
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0)
t() { local name=$1; shift; [ $(( $(date +%s) - T0 )) -gt 480 ] && { echo "== $name skipped (time)"; return; }
  PYTHONPATH=. timeout 60 python3 examples/train_transformer.py "${C[@]}" "$@" --json $R/$name.json > $R/$name.log 2>&1
  echo "== $name rc=$? $(( $(date +%s) - T0 ))s $(grep -o 'median step [0-9.]* ms' $R/$name.log)"; }
t new_sr_1 --mode lowgrad --strategy scatter_reduce
t stats_sr_1 --mode lowgrad --strategy scatter_reduce --stats $R/stats_sr_1.jsonl
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r52.tar r && rm -rf $R
