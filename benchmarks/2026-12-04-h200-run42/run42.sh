#!/usr/bin/env bash
# run 42 (issue 26): the 0.5B model's 300-step run with --stats (the defaults of
# examples/train_transformer.py) and one NaN injected into one parameter's gradient at one
# micro-step, then tools/grad_report.py over its log
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
timeout 250 python3 examples/train_transformer.py --stats $R/run300.jsonl --inject-nan 150:2:model.layers.17.mlp.down_proj.weight \
  --json $R/run300.json > $R/run300.log 2>&1; echo "== run300 rc=$? $(( $(date +%s) - T0 ))s"; tail -6 $R/run300.log | cut -c1-250
timeout 40 python3 tools/grad_report.py --log $R/run300.jsonl --out $R/report > $R/report.log 2>&1; echo "== report rc=$?"; tail -4 $R/report.log | cut -c1-200
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
