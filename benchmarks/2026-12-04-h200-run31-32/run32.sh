#!/usr/bin/env bash
# run 32: the 0.5B step-time A/B after the non-finite check (one host read of the norm per step):
# PyTorch bf16, scatter_reduce at this tree and at the previous HEAD (.ab/head: a copy of f1fd7bf),
# interleaved in rounds; a short run with an injected NaN step
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0)
t() { local name=$1 dir=$2; shift 2; ( cd $dir && timeout 60 python3 examples/train_transformer.py "${C[@]}" "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - T0 ))s"; tail -1 $R/$name.log | cut -c1-200 ); }
timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 60 --timeout-method=thread tests/test_kernels_gpu.py -k "bad_arguments or fill" > $R/kernels_gpu.log 2>&1; echo "kernels_gpu rc=$?"; tail -1 $R/kernels_gpu.log
for round in 1 2 3; do
  t torch_$round . --mode torch_bf16
  t new_sr_$round . --mode lowgrad --strategy scatter_reduce
  t head_sr_$round .ab/head --mode lowgrad --strategy scatter_reduce
done
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
