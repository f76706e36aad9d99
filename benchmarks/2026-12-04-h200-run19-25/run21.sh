#!/usr/bin/env bash
# run 21: step time after the kernel-lookup fix; side-kernel grid A/B; profile again
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0)
t() { local name=$1; shift; timeout 50 python3 examples/train_transformer.py "${C[@]}" "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "== $name rc=$?"; tail -4 $R/$name.log | cut -c1-400; }
t t_torch_bf16 --mode torch_bf16
t t_lg_sr --mode lowgrad --strategy scatter_reduce
t t_lg_unsh --mode lowgrad --strategy unsharded
cd .ab/blk
for b in 132 396; do AB_BLOCKS=$b t t_lg_sr_b$b --mode lowgrad --strategy scatter_reduce; done
cd ../..
timeout 50 python3 examples/train_transformer.py "${C[@]}" --steps 5 --cprofile 2 --mode lowgrad --strategy scatter_reduce > $R/cp_lg_sr.log 2>&1
grep -E "lowgrad|torch.py|acquire|copy_|launch|to'|float" $R/cp_lg_sr.log | head -30 | cut -c1-170
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
