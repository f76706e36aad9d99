#!/usr/bin/env bash
# run 40 (issue 26: the statistics' cost): trees put in .devrun/ beforehand: new3.tar (6e675c1 + the
# asynchronous statistics read, acc9ec0: the fast path for low-discrepancy SR too, the deferred
# non-finite check), n3v6.tar (the same with no per-element statistics: slots and finish only, an
# experiment), old.tar (d6ebd6d, before this session). The GPU tests of the kernels and of the managers'
# statistics on new3 (empty kernel cache); then the cost of stats=True on the Qwen2.5-1.5B layout's
# world-1 micro-step (bench_manager --stats-rounds 3, on/off interleaved), the trees alternated in two
# rounds; bench_manager, bench_kernels and bench_layer on new3.
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
V="new3 n3v6 old"
for v in $V; do mkdir -p /tmp/$v && tar -xf .devrun/$v.tar -C /tmp/$v; done
step() { local name=$1 tree=$2 limit=$3; shift 3; echo "== $name ($tree)"; local t0=$(date +%s);
  (cd /tmp/$tree && LOWGRAD_CACHE_DIR=/tmp/cache-$tree timeout "$limit" "$@") > "$R/$name.log" 2>&1;
  echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; tail -${TAILN:-4} "$R/$name.log" | cut -c1-220; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
step gpu_subset new3 240 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short \
  tests/test_kernels_gpu.py tests/test_kernels_grad_stats_gpu.py tests/test_manager_stats_gpu.py tests/test_managers_gpu.py
for round in 1 2; do for v in $V; do
  TAILN=3 step stats_${v}_$round $v 60 python3 tools/bench_manager.py --strategies scatter_reduce,scatter_reduce+comm_stream \
    --stats-rounds 3 --json $R/stats_${v}_$round.json
done; done
TAILN=9 step bench_manager_new3 new3 45 python3 tools/bench_manager.py --json $R/bench_manager_new3.json
TAILN=12 step bench_kernels_new3 new3 60 python3 tools/bench_kernels.py --json $R/bench_kernels_new3.json
step bench_layer_new3 new3 40 python3 tools/bench_layer.py --json $R/bench_layer_new3.json
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
