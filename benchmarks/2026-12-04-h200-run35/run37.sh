#!/usr/bin/env bash
# run 37 (the session's final tree): the whole GPU suite from an empty kernel cache with a per-test
# timeout; then the 0.5B step (4 micro-steps of 16 x 1024 bytes, 7 steps, median) of lowgrad
# scatter_reduce without and with --stats (the statistics read before the optimizer step) and
# PyTorch bf16, interleaved in two rounds
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short \
  --durations=5 > $R/gpu_tests.log 2>&1; echo "gpu_tests rc=$? $(( $(date +%s) - T0 ))s"; tail -4 $R/gpu_tests.log | cut -c1-300
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0)
t() { local name=$1; shift; timeout 70 python3 examples/train_transformer.py "${C[@]}" "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - T0 ))s $(grep -o 'median step [0-9.]* ms' $R/$name.log)"; }
for round in 1 2; do
  t new_sr_$round --mode lowgrad --strategy scatter_reduce
  t stats_sr_$round --mode lowgrad --strategy scatter_reduce --stats $R/stats_sr_$round.jsonl
  t torch_$round --mode torch_bf16
done
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
