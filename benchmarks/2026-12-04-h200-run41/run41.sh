#!/usr/bin/env bash
# run 41 (issue 26, the session's final kernels and the asynchronous statistics read): the whole GPU
# suite from an empty kernel cache with a per-test timeout; the cost of stats=True on the
# Qwen2.5-1.5B layout's world-1 micro-step (bench_manager --stats-rounds 5, on/off interleaved, two
# processes); bench_manager, bench_kernels, bench_layer; then the 0.5B step (4 micro-steps of
# 16 x 1024 bytes, 7 steps, median) of lowgrad scatter_reduce without and with --stats (read_stats
# queued before the optimizer step, resolved after it), alternated in three rounds
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$(date +%s); timeout "$limit" "$@" > "$R/$name.log" 2>&1;
  echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; tail -${TAILN:-4} "$R/$name.log" | cut -c1-220; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
step gpu_tests 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short --durations=5
for round in 1 2; do
  TAILN=3 step stats_$round 60 python3 tools/bench_manager.py --strategies scatter_reduce,scatter_reduce+comm_stream --stats-rounds 5 --json $R/stats_$round.json
done
TAILN=9 step bench_manager 45 python3 tools/bench_manager.py --json $R/bench_manager.json
TAILN=12 step bench_kernels 60 python3 tools/bench_kernels.py --json $R/bench_kernels.json
step bench_layer 40 python3 tools/bench_layer.py --json $R/bench_layer.json
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0)
t() { local name=$1; shift; timeout 70 python3 examples/train_transformer.py "${C[@]}" "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - T0 ))s $(grep -o 'median step [0-9.]* ms' $R/$name.log)"; }
for round in 1 2 3; do
  t new_sr_$round --mode lowgrad --strategy scatter_reduce
  t stats_sr_$round --mode lowgrad --strategy scatter_reduce --stats $R/stats_sr_$round.jsonl
done
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
