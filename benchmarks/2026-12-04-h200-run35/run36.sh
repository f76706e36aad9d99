#!/usr/bin/env bash
# run 36 (issues 25 and 26): the 0.5B training step (4 micro-steps of 16 x 1024 bytes, 7 steps,
# median) for PyTorch bf16, lowgrad scatter_reduce at this tree, at this tree with --stats, and at
# the session's first HEAD (.ab/head: a worktree of ca03990), interleaved in three rounds; then the
# 300-step 0.5B run with --stats and one injected NaN, and grad_report over its log
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0)
t() { local name=$1 dir=$2; shift 2; ( cd $dir && PYTHONPATH=. timeout 70 python3 examples/train_transformer.py "${C[@]}" "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - T0 ))s $(grep -o 'median step [0-9.]* ms' $R/$name.log)" ); }
for round in 1 2 3; do
  t torch_$round . --mode torch_bf16
  t new_sr_$round . --mode lowgrad --strategy scatter_reduce
  t stats_sr_$round . --mode lowgrad --strategy scatter_reduce --stats $R/stats_sr_$round.jsonl
  t head_sr_$round .ab/head --mode lowgrad --strategy scatter_reduce
done
timeout 150 python3 examples/train_transformer.py --stats $R/run300.jsonl --inject-nan 150:2:model.layers.17.mlp.down_proj.weight \
  --json $R/run300.json > $R/run300.log 2>&1; echo "== run300 rc=$? $(( $(date +%s) - T0 ))s"; tail -6 $R/run300.log | cut -c1-250
timeout 60 python3 tools/grad_report.py --log $R/run300.jsonl --out $R/report > $R/report.log 2>&1; echo "== report rc=$?"; tail -4 $R/report.log | cut -c1-200
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
