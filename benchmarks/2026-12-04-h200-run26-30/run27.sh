#!/usr/bin/env bash
# run 27 (tree of 2ffa784): 300-step loss curves, six runs at once; beside them, the 0.5B model's real
# gradients over 2048 micro-batches and tools/accuracy.py at 512/1024/2048
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
R=$OUT/r; mkdir -p $R/curves
T0=$(date +%s)
git status --short | grep -v "^?? .ab" > $R/status.txt
L=(--size 0.5b --steps 300 --micro-steps 4 --batch 8 --seq 512 --log-every 10 --strategy scatter_reduce)
pids=()
for run in "torch_fp32_s0 --mode torch_fp32 --seed 0" "torch_bf16_s0 --mode torch_bf16 --seed 0" "torch_bf16_s1 --mode torch_bf16 --seed 1" \
           "ldsr_s0 --mode lowgrad --rounding ldsr --seed 0" "ldsr_s1 --mode lowgrad --rounding ldsr --seed 1" \
           "rn_s0 --mode lowgrad --rounding rn --seed 0"; do
  set -- $run; name=$1; shift
  timeout 500 python3 examples/train_transformer.py "$@" "${L[@]}" --json $R/curves/$name.json > $R/curves/$name.log 2>&1 &
  pids+=($!)
done
( timeout 300 python3 examples/train_transformer.py --size 0.5b --save-grads /tmp/g.npy --micro-steps 2048 --batch 2 --seq 256 > $R/grads.log 2>&1
  echo "grads rc=$? $(( $(date +%s) - T0 ))s" >> $R/grads.log
  timeout 120 python3 tools/accuracy.py --grads /tmp/g.npy --micro 32,128,512,1024,2048 --json $R/acc_0.5b.json > $R/acc_0.5b.log 2>&1
  echo "acc rc=$? $(( $(date +%s) - T0 ))s" >> $R/acc_0.5b.log ) &
pids+=($!)
for p in "${pids[@]}"; do wait $p; done
tail -n 3 $R/grads.log; tail -n 8 $R/acc_0.5b.log | cut -c1-200
for f in $R/curves/*.log; do echo "$(basename $f): $(tail -n 1 $f)"; done
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
