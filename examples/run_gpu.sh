#!/usr/bin/env bash
# The LM example on the GPU in one go: the numpy engine driving lowgrad's CUDA backend on GPU 0 (and
# on two GPUs where there are two) in every accumulation mode and strategy, plus the toy size on the
# host backend. Each run writes OUTDIR/NAME.json and NAME.log; at the end a table, a plot (with
# matplotlib) and the checks: every loss falls below 0.8 x its start, and sr_bf16 ends within 0.05
# of fp32. The last line is the verdict, PASS or FAIL; exit status 1 when a run failed or a check did
# not hold, 2 (one line on stderr, nothing run) without a GPU: on the CPU, run
# python examples/train_lm.py instead.
#   bash examples/run_gpu.sh [OUTDIR]   (default: $OUT/lm_runs, else ./lm_runs; from the repository's
#   root, a temporary folder: tools/_cli.py output-path, the tools' rule)
set -u -o pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0;; esac
PY=${PYTHON:-python3}
OUTDIR=$("$PY" "$(dirname "$0")/../tools/_cli.py" output-path run_gpu.sh lm_runs "$@") || exit 2
OUTDIR=$(realpath -m -- "$OUTDIR")  # relative to the folder it was called from
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" tools/_cli.py needs-gpu run_gpu.sh \
  "python examples/train_lm.py trains on the CPU (the host backend)" || exit 2
mkdir -p "$OUTDIR" || exit 2
# 347k parameters, 2048 examples per step. The text is small: the training loss goes far below the
# held-out loss (memorisation); the comparisons are about the training curves.
SIZE=(--hidden 256 --layers 4 --embed 32 --batch 256 --micro-steps 8 --steps 150 --lr 5e-3 --weight-decay 0.1 --log-every 25)
fail=0

run() {  # NAME ARGS...: one training run, bounded in time
  local name=$1; shift
  echo "== $name: $*"
  if timeout 150 "$PY" examples/train_lm.py "$@" --json "$OUTDIR/$name.json" > "$OUTDIR/$name.log" 2>&1; then
    tail -2 "$OUTDIR/$name.log"
  else
    echo "FAILED (exit $?)"; tail -30 "$OUTDIR/$name.log"; fail=1
  fi
}

"$PY" -m lowgrad doctor 2>&1 | head -20
gpus=$("$PY" -c "import lowgrad; print(lowgrad.device_count())" 2>/dev/null || echo 0)
echo "GPUs: $gpus"
run host_toy
run sr_bf16          --device cuda "${SIZE[@]}"
run fp32             --device cuda "${SIZE[@]}" --accum fp32
run rn_bf16          --device cuda "${SIZE[@]}" --accum rn_bf16
run unsharded_sr     --device cuda "${SIZE[@]}" --strategy unsharded
run a2a_offload      --device cuda "${SIZE[@]}" --strategy all_to_all --offload
if [ "$gpus" -ge 2 ]; then
  run world2_sr      --device cuda "${SIZE[@]}" --world 2
  run world2_rn      --device cuda "${SIZE[@]}" --world 2 --accum rn_bf16
fi

shopt -s nullglob
jsons=("$OUTDIR"/*.json)
[ ${#jsons[@]} -gt 0 ] && "$PY" examples/plot_losses.py "${jsons[@]}" --out "$OUTDIR/losses.png"
"$PY" - "$OUTDIR" <<'PYEOF' || fail=1
import json, pathlib, sys
runs = {f.stem: json.loads(f.read_text()) for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
end = {k: sum(r["loss"][-10:]) / len(r["loss"][-10:]) for k, r in runs.items()}
bad = [k for k, r in runs.items() if not end[k] < 0.8 * r["loss"][0]]
if "sr_bf16" in end and "fp32" in end and abs(end["sr_bf16"] - end["fp32"]) > 0.05:
    bad.append(f"sr_bf16 {end['sr_bf16']:.3f} vs fp32 {end['fp32']:.3f}")
print(f"checks: {len(runs)} runs, " + ("all hold" if not bad else "FAILED: " + ", ".join(bad)))
sys.exit(1 if bad else 0)
PYEOF
if [ $fail = 0 ]; then
  echo "PASS: every run finished, every loss fell below 0.8 x its start, sr_bf16 ended within 0.05 of fp32 ($OUTDIR)"
else
  echo "FAIL: a run failed or a check did not hold (see above; logs in $OUTDIR)"
fi
exit $fail
