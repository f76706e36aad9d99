#!/usr/bin/env bash
# run 38 (issue 26: the statistics' cost): two trees, each a `git archive` put in .devrun/ beforehand
# (new.tar: the fast SR path and the per-group statistics; old.tar: the tree before them). The whole
# GPU suite on the new tree from an empty kernel cache with a per-test timeout; then, alternating the
# trees, the cost of stats=True on the Qwen2.5-1.5B layout's world-1 micro-step (bench_manager
# --stats-rounds, on/off interleaved in each process), bench_manager's ratios to its floor,
# bench_kernels and bench_layer.
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
for v in new old; do mkdir -p /tmp/$v && tar -xf .devrun/$v.tar -C /tmp/$v; done
step() { local name=$1 tree=$2 limit=$3; shift 3; echo "== $name ($tree)"; local t0=$(date +%s);
  (cd /tmp/$tree && LOWGRAD_CACHE_DIR=/tmp/cache-$tree timeout "$limit" "$@") > "$R/$name.log" 2>&1;
  echo "rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$R/$name.log"; tail -${TAILN:-4} "$R/$name.log" | cut -c1-220; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/card.txt
rm -rf /tmp/cache-new /tmp/cache-old
step gpu_tests new 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 --timeout-method=thread -rf --tb=short --durations=5
for round in 1 2; do for v in new old; do
  step stats_${v}_$round $v 60 python3 tools/bench_manager.py --strategies scatter_reduce,scatter_reduce+comm_stream --stats-rounds 5 --json $R/stats_${v}_$round.json
done; done
for v in new old; do
  TAILN=8 step bench_manager_$v $v 45 python3 tools/bench_manager.py --json $R/bench_manager_$v.json
  TAILN=12 step bench_kernels_$v $v 60 python3 tools/bench_kernels.py --json $R/bench_kernels_$v.json
  step bench_layer_$v $v 40 python3 tools/bench_layer.py --json $R/bench_layer_$v.json
done
echo "elapsed $(( $(date +%s) - T0 ))s"
tar -C $OUT -cf $OUT/r.tar r && rm -rf $R
