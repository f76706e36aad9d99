#!/usr/bin/env bash
# run 44 (issue 26): run 43's per-step finish with b's slot set picked after the loop (80
# registers again). The cost of stats=True on the Qwen2.5-1.5B layout's world-1 micro-step
# (bench_manager --stats-rounds 5, on/off interleaved in each process) for this tree and 22960ff
# (run 41's code, .devrun/old.tar) alternated in three rounds; the whole GPU suite from an empty
# kernel cache with a per-test timeout; bench_manager, bench_kernels, bench_layer.
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
mkdir -p /tmp/old && tar -xf .devrun/old.tar -C /tmp/old && rm -rf /tmp/cache-old
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$(date +%s); timeout "$limit" "$@" > "$R/$name.log" 2>&1;
  echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; tail -${TAILN:-4} "$R/$name.log" | cut -c1-220; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
bench() { local v=$1 dir=$2 round=$3; ( cd $dir && LOWGRAD_CACHE_DIR=${4:-$LOWGRAD_CACHE_DIR} PYTHONPATH=. TAILN=3 step stats_${v}_$round 60 \
  python3 tools/bench_manager.py --strategies scatter_reduce,scatter_reduce+comm_stream --stats-rounds 5 --json $R/stats_${v}_$round.json ); }
for round in 1 2 3; do
  bench head $PWD $round
  bench old /tmp/old $round /tmp/cache-old
done
rm -rf "$LOWGRAD_CACHE_DIR"
PYTHONPATH=. step gpu_tests 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short --durations=5
PYTHONPATH=. TAILN=9 step bench_manager 45 python3 tools/bench_manager.py --json $R/bench_manager.json
PYTHONPATH=. TAILN=12 step bench_kernels 60 python3 tools/bench_kernels.py --json $R/bench_kernels.json
PYTHONPATH=. step bench_layer 40 python3 tools/bench_layer.py --json $R/bench_layer.json
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
