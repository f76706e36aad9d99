#!/usr/bin/env bash
# Issue-14 GPU session in one call: the Qwen2.5-0.5B-shaped model trained on the stdlib's source
# with PyTorch fp32 gradients, PyTorch bf16 gradients and lowgrad (unsharded, scatter_reduce), two
# seeds each; then real 0.5B gradients for tools/accuracy.py; a loss plot when matplotlib exists.
#   bash examples/run_transformer_gpu.sh [OUTDIR]     (default: $OUT, else ./transformer_runs)
#   (CPU smoke: SIZE=tiny STEPS=2 GRAD_MICRO=64 bash examples/run_transformer_gpu.sh /tmp/tt)
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUTDIR=${1:-${OUT:-transformer_runs}}
STEPS=${STEPS:-200}
mkdir -p "$OUTDIR"
COMMON=(--size "${SIZE:-0.5b}" --steps "$STEPS" --micro-steps 4 --batch 8 --seq 512 --log-every 50)
for seed in 0 1; do
  for run in "torch_fp32 --mode torch_fp32" "torch_bf16 --mode torch_bf16" \
             "lowgrad_unsharded --mode lowgrad --strategy unsharded" \
             "lowgrad_scatter_reduce --mode lowgrad --strategy scatter_reduce"; do
    set -- $run; name=$1; shift
    timeout 150 python3 examples/train_transformer.py "$@" "${COMMON[@]}" --seed "$seed" \
      --json "$OUTDIR/${name}_s$seed.json" > "$OUTDIR/${name}_s$seed.log" 2>&1
    echo "$name seed $seed: rc=$? $(tail -1 "$OUTDIR/${name}_s$seed.log")"
  done
done
timeout 120 python3 examples/train_transformer.py --size "${SIZE:-0.5b}" --save-grads "$OUTDIR/grads_0.5b.npy" \
  --micro-steps "${GRAD_MICRO:-2048}" --batch 2 --seq 256 > "$OUTDIR/save_grads.log" 2>&1 && \
  python3 tools/accuracy.py --grads "$OUTDIR/grads_0.5b.npy" --micro 32,128,512,2048 \
    --json "$OUTDIR/accuracy_0.5b.json" | tee "$OUTDIR/accuracy_0.5b.log"
rm -f "$OUTDIR/grads_0.5b.npy"
python3 - "$OUTDIR" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "examples")
from train_lm import plot_curves
runs = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*_s[01].json"))]
for r in runs:
    print(f"{r['label']:<36} loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}  step {r['step_ms_median']:.1f} ms  "
          f"torch peak {r['torch_peak_mib'] or 0:.0f} MiB")
plot_curves(runs, str(Path(sys.argv[1]) / "transformer_losses.png"))
PY
