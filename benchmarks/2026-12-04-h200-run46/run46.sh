#!/usr/bin/env bash
# run 46 (issue 26, the session's final kernels = 1e8b25b's, which run 44's whole GPU suite
# verified): the 0.5B step (4 micro-steps of 16 x 1024, 7 steps, median) of lowgrad
# scatter_reduce without and with --stats (read_stats queued before the optimizer step), alternated
# in two rounds, then one more round of the stats cost on the Qwen2.5-1.5B layout's micro-step.
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0)
t() { local name=$1; shift; timeout 45 python3 examples/train_transformer.py "${C[@]}" "$@" --json $R/$name.json > $R/$name.log 2>&1
  echo "== $name rc=$? $(( $(date +%s) - T0 ))s $(grep -o 'median step [0-9.]* ms' $R/$name.log)"; }
for round in 1 2; do
  t new_sr_$round --mode lowgrad --strategy scatter_reduce
  t stats_sr_$round --mode lowgrad --strategy scatter_reduce --stats $R/stats_sr_$round.jsonl
done
timeout 40 python3 tools/bench_manager.py --strategies scatter_reduce --stats-rounds 5 --json $R/stats_1.json > $R/stats_1.log 2>&1
echo "== stats_1 rc=$? $(grep -E '^scatter_reduce ' $R/stats_1.log | tail -1)"
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
