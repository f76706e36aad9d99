#!/usr/bin/env bash
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
export LOWGRAD_CACHE_DIR=/tmp/lowgrad-session-cache
rm -rf "$LOWGRAD_CACHE_DIR"
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 60 --timeout-method=thread -rf --tb=short --durations=5 > $OUT/gpu_tests.log 2>&1
echo "rc=$?"; tail -12 $OUT/gpu_tests.log | cut -c1-300
cd .ab/oldlb && timeout 30 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 25 --timeout-method=thread -rf --tb=line tests/test_loopback_gpu.py -k ring_of_sends > $OUT/old_loopback.log 2>&1
echo "old loopback rc=$?"; tail -3 $OUT/old_loopback.log | cut -c1-300
