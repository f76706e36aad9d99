#!/usr/bin/env bash
# run 23: side-kernel interference: comm-stream priority, cache-streaming loads/stores in the SR kernels
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
C=(--size 0.5b --steps 7 --micro-steps 4 --batch 16 --seq 1024 --log-every 0 --mode lowgrad --strategy scatter_reduce)
t() { local name=$1; shift; PYTHONPATH=. timeout 50 python3 examples/train_transformer.py "${C[@]}" "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "== $name rc=$?"; tail -3 $R/$name.log | cut -c1-300; }
cd .ab/blk; t base; AB_PRIO0=1 t prio0
cd ../cs; t cs; AB_PRIO0=1 t cs_prio0
cd ../blk; t base2
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
