set -o pipefail; export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -m lowgrad doctor 2>&1 | tee $OUT/doctor.log
python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -30 | tee $OUT/gpu_tests.log
python3 tools/bench_kernels.py --json $OUT/bench_kernels.json > $OUT/bench_kernels.log 2>&1; tail -45 $OUT/bench_kernels.log
python3 tools/bench_manager.py --json $OUT/bench_manager.json 2>&1 | tee $OUT/bench_manager.log | tail -12
python3 -m lowgrad demo --json $OUT/demo.json 2>/dev/null | tee $OUT/demo.log
