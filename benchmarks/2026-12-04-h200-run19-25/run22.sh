#!/usr/bin/env bash
# run 22: what the scatter_reduce backward's extra ~3.7 ms per micro-step is (A/B in a patched copy)
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0 --mode lowgrad --strategy scatter_reduce)
t() { local name=$1; shift; timeout 50 python3 examples/train_transformer.py "${C[@]}" "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "== $name rc=$?"; tail -3 $R/$name.log | cut -c1-300; }
cd .ab/blk
t base
AB_NBUF=4 t nbuf4
AB_NOSIDE=1 t noside
AB_NBUF=24 t nbuf24
t base2
cd ../..
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
