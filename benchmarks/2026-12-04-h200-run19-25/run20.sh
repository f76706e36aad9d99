#!/usr/bin/env bash
# run 20: Python profiles of the 0.5B step (lowgrad scatter_reduce and torch bf16)
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
python3 --version
C=(--size 0.5b --steps 5 --micro-steps 4 --batch 16 --seq 1024 --log-every 0 --cprofile 2)
timeout 60 python3 examples/train_transformer.py --mode lowgrad --strategy scatter_reduce "${C[@]}" > $R/cp_lg_sr.log 2>&1; echo "rc=$?"
head -60 $R/cp_lg_sr.log | cut -c1-200
timeout 60 python3 examples/train_transformer.py --mode torch_bf16 "${C[@]}" > $R/cp_torch.log 2>&1; echo "rc=$?"
head -30 $R/cp_torch.log | cut -c1-200
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
