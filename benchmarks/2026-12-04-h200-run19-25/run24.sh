#!/usr/bin/env bash
# run 24: the whole GPU suite at HEAD (empty kernel cache), the step-time table, a GPU-only profile,
# the demo, and 100-step loss curves (5 runs at once)
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
R=$OUT/r; mkdir -p $R/curves
T0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$(date +%s); timeout "$limit" "$@" > "$R/$name.log" 2>&1; echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; }
git log --oneline -1 > $R/commit.txt 2>&1; git status --short | grep -v "^?? .ab" >> $R/commit.txt; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $R/commit.txt
step gpu_tests 230 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 60 --timeout-method=thread -rf --tb=short --durations=5
tail -4 $R/gpu_tests.log | cut -c1-400
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0)
for run in "t_torch_bf16 --mode torch_bf16" "t_lg_sr --mode lowgrad --strategy scatter_reduce" "t_lg_unsh --mode lowgrad --strategy unsharded"; do
  set -- $run; name=$1; shift
  step $name 50 python3 examples/train_transformer.py "$@" "${C[@]}" --json $R/$name.json; tail -4 $R/$name.log | cut -c1-300
done
step p_lg_sr 50 python3 examples/train_transformer.py --mode lowgrad --strategy scatter_reduce "${C[@]}" --steps 6 --profile --json $R/p_lg_sr.json
grep -E "side_hidden|side_ms|gpu_span|\"7\"|add_sr|copy_u8|median step" $R/p_lg_sr.log
step demo 60 python3 -m lowgrad demo; tail -5 $R/demo.log | cut -c1-300
echo "elapsed $(( $(date +%s) - T0 ))s"
L=(--size 0.5b --steps 100 --micro-steps 4 --batch 8 --seq 512 --log-every 20 --strategy scatter_reduce)
pids=()
for run in "torch_bf16_s0 --mode torch_bf16 --seed 0" "torch_bf16_s1 --mode torch_bf16 --seed 1" \
           "ldsr_s0 --mode lowgrad --rounding ldsr --seed 0" "ldsr_s1 --mode lowgrad --rounding ldsr --seed 1" \
           "rn_s0 --mode lowgrad --rounding rn --seed 0"; do
  set -- $run; name=$1; shift
  timeout 240 python3 examples/train_transformer.py "$@" "${L[@]}" --json $R/curves/$name.json > $R/curves/$name.log 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait $p; done
for f in $R/curves/*.log; do echo "$(basename $f): $(tail -1 $f)"; done
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
