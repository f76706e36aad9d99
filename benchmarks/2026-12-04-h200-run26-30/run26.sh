#!/usr/bin/env bash
# run 26: whole GPU suite (inline world-1 accumulation, empty kernel cache), then the step-time A/B:
# HEAD before (cabaa95), micro-step 0 into the shards only (AB_AONLY), both (the tree), unsharded, torch
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 60 --timeout-method=thread -rf --tb=short --durations=5 > $R/gpu_tests.log 2>&1
echo "suite rc=$? $(( $(date +%s) - T0 ))s"; tail -4 $R/gpu_tests.log | cut -c1-300
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0)
t() { local name=$1 dir=$2; shift 2; ( cd $dir && timeout 50 python3 examples/train_transformer.py "${C[@]}" "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "== $name rc=$?"; tail -1 $R/$name.log | cut -c1-200 ); }
t torch_a . --mode torch_bf16
t head_sr .ab/head --mode lowgrad --strategy scatter_reduce
t new_sr . --mode lowgrad --strategy scatter_reduce
AB_AONLY=1 t aonly_sr .ab/aonly --mode lowgrad --strategy scatter_reduce
t new_unsh . --mode lowgrad --strategy unsharded
t new_sr2 . --mode lowgrad --strategy scatter_reduce
t torch_b . --mode torch_bf16
t head_sr2 .ab/head --mode lowgrad --strategy scatter_reduce
t p_new_sr . --mode lowgrad --strategy scatter_reduce --steps 6 --profile
grep -E "side|add_sr|copy" $R/p_new_sr.log | head -12
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
