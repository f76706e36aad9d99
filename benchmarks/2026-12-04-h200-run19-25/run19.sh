#!/usr/bin/env bash
# run 19: whole GPU suite at the current tree (empty kernel cache), then where the step time goes
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$(date +%s); timeout "$limit" "$@" > "$R/$name.log" 2>&1; echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; }
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $R/commit.txt
step gpu_tests 230 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 60 --timeout-method=thread -rf --tb=short --durations=5
tail -8 $R/gpu_tests.log | cut -c1-400
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0)
for run in "t_torch_bf16 --mode torch_bf16" "t_lg_sr --mode lowgrad --strategy scatter_reduce" \
           "t_lg_unsh --mode lowgrad --strategy unsharded" "t_lg_sr_nooverlap --mode lowgrad --strategy scatter_reduce --no-overlap"; do
  set -- $run; name=$1; shift
  step $name 50 python3 examples/train_transformer.py "$@" "${C[@]}" --json $R/$name.json; tail -4 $R/$name.log | cut -c1-600
done
(cd .ab/old && PYTHONPATH=. timeout 50 python3 examples/train_transformer.py --mode lowgrad --strategy scatter_reduce "${C[@]}" --json $R/t_old_lg_sr.json > $R/t_old_lg_sr.log 2>&1); echo "== old"; tail -4 $R/t_old_lg_sr.log | cut -c1-600
step p_lg_sr 50 python3 examples/train_transformer.py --mode lowgrad --strategy scatter_reduce "${C[@]}" --steps 6 --profile --json $R/p_lg_sr.json
grep -E "side_hidden|side_ms|gpu_span|\"7\"|final|median step" $R/p_lg_sr.log
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
