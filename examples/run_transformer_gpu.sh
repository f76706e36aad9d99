#!/usr/bin/env bash
# The transformer's GPU measurements in one call (about 5 minutes on an H200):
#  1. step time and memory, each run alone on the GPU: PyTorch bf16 gradients, lowgrad scatter_reduce
#     (default rounding) and unsharded, 16 x 1024 bytes per micro-step, 4 micro-steps;
#  2. a profiled lowgrad run (GPU time per stream; how much of lowgrad's stream overlaps compute);
#  3. loss curves of every mode at once (step times not comparable there): PyTorch fp32 and bf16,
#     lowgrad ldsr / sr / rn, two seeds where it matters;
#  4. real 0.5B gradients through tools/accuracy.py; 5. the loss plot.
#   bash examples/run_transformer_gpu.sh [OUTDIR]     (default: $OUT/transformer_runs, else ./transformer_runs;
#   from the repository's root, a temporary folder: tools/_cli.py output-path, the tools' rule)
#   (CPU smoke: SIZE=tiny STEPS=2 GRAD_MICRO=8 BATCH=2 SEQ=32 bash examples/run_transformer_gpu.sh /tmp/tt)
# The last line is the verdict, PASS or FAIL (exit status 1 when a run failed); with the 0.5B model
# and no GPU it says so in one line on stderr and exits with status 2 (the CPU smoke run above has
# no profiled run: --profile measures GPU streams).
set -u -o pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0;; esac
OUTDIR=$(python3 "$(dirname "$0")/../tools/_cli.py" output-path run_transformer_gpu.sh transformer_runs "$@") || exit 2
OUTDIR=$(realpath -m -- "$OUTDIR")  # relative to the folder it was called from
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SIZE=${SIZE:-0.5b}
if python3 tools/_cli.py needs-gpu run_transformer_gpu.sh 2> /dev/null; then gpu=1; else gpu=0; fi
if [ "$gpu" = 0 ] && [ "$SIZE" != tiny ]; then
  python3 tools/_cli.py needs-gpu run_transformer_gpu.sh \
    "the CPU smoke run: SIZE=tiny STEPS=2 GRAD_MICRO=8 BATCH=2 SEQ=32 bash examples/run_transformer_gpu.sh DIR"
  exit 2
fi
mkdir -p "$OUTDIR/curves" || exit 2
failed=()
T=(--size "$SIZE" --steps 7 --micro-steps 4 --batch "${BATCH:-16}" --seq "${SEQ:-1024}" --log-every 0)
for run in "t_torch_bf16 --mode torch_bf16" "t_lowgrad_scatter_reduce --mode lowgrad --strategy scatter_reduce" \
           "t_lowgrad_unsharded --mode lowgrad --strategy unsharded"; do
  set -- $run; name=$1; shift
  timeout 90 python3 examples/train_transformer.py "$@" "${T[@]}" --json "$OUTDIR/$name.json" > "$OUTDIR/$name.log" 2>&1
  rc=$?; [ $rc = 0 ] || failed+=("$name")
  echo "$name: rc=$rc $(tail -1 "$OUTDIR/$name.log")"
done
if [ "$gpu" = 1 ]; then
  timeout 90 python3 examples/train_transformer.py --mode lowgrad --strategy scatter_reduce "${T[@]}" --profile \
    --json "$OUTDIR/profile.json" > "$OUTDIR/profile.log" 2>&1
  rc=$?; [ $rc = 0 ] || failed+=(profile)
  echo "profile: rc=$rc $(grep -E 'side_hidden' "$OUTDIR/profile.log")"
else
  echo "profile: skipped (no GPU)"
fi
L=(--size "$SIZE" --steps "${STEPS:-50}" --micro-steps 4 --batch "${BATCH:-8}" --seq "${SEQ:-512}" --log-every 10)
pids=()
for run in "torch_fp32_s0 --mode torch_fp32 --seed 0" "torch_bf16_s0 --mode torch_bf16 --seed 0" \
           "torch_bf16_s1 --mode torch_bf16 --seed 1" "ldsr_s0 --mode lowgrad --rounding ldsr --seed 0" \
           "ldsr_s1 --mode lowgrad --rounding ldsr --seed 1" "sr_s0 --mode lowgrad --rounding sr --seed 0" \
           "rn_s0 --mode lowgrad --rounding rn --seed 0"; do
  set -- $run; name=$1; shift
  timeout 200 python3 examples/train_transformer.py "$@" --strategy scatter_reduce "${L[@]}" \
    --json "$OUTDIR/curves/$name.json" > "$OUTDIR/curves/$name.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || failed+=("curve(pid $p)"); done
for f in "$OUTDIR"/curves/*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done
timeout 150 python3 examples/train_transformer.py --size "$SIZE" --save-grads "$OUTDIR/grads.npy" \
  --micro-steps "${GRAD_MICRO:-256}" --batch 2 --seq 256 > "$OUTDIR/save_grads.log" 2>&1 && \
  python3 tools/accuracy.py --grads "$OUTDIR/grads.npy" --micro 32,128,"${GRAD_MICRO:-256}" \
    --json "$OUTDIR/accuracy.json" | tee "$OUTDIR/accuracy.log" || failed+=(accuracy)
rm -f "$OUTDIR/grads.npy"
python3 - "$OUTDIR" <<'PY'
import json, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, "examples")
from importlib.util import find_spec
from plot_losses import plot_curves
runs = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1], "curves").glob("*.json"))]
for r in runs:
    print(f"{r['label']:<40} loss {r['loss'][0]:.3f} -> mean of the last 10 steps {np.mean(r['loss'][-10:]):.3f}")
k = min(10, min(len(r["loss"]) for r in runs)) if runs else 1
smooth = [{"label": r["label"], "loss": list(np.convolve(r["loss"], np.ones(k) / k, mode="valid"))} for r in runs]
if find_spec("matplotlib"):
    plot_curves(smooth, str(Path(sys.argv[1]) / "transformer_losses.png"))
else:
    print("matplotlib is not installed: no plot written")
PY
if [ ${#failed[@]} = 0 ]; then
  echo "PASS: every run exited 0 (each one's loss fell and stayed finite) and the accuracy table was written ($OUTDIR)"
else
  echo "FAIL: ${failed[*]} failed (logs in $OUTDIR)"; exit 1
fi
