#!/usr/bin/env bash
# The next GPU session's device call, prepared here (benchmarks/GPU.md "The next session's calls" says what each
# part answers). On the device machine, from the repository root, with carry ["benchmarks/carry/base"] (made here
# by benchmarks/gpu_carry.sh) and timeout_s 600:
#
#     bash benchmarks/gpu_next.sh
#
# Every run is time-boxed (about 500 s in all) and logs under $OUT (five files; a call brings back at most eight);
# each phase prints its start second, so a call cut short still says how far it got.
set -uo pipefail
P=/opt/torch/.venv/bin/python3
[ -x "$P" ] || P=python3
OUT=${OUT:-runs/gpu_next}
mkdir -p "$OUT"
T0=$(date +%s)
phase() { echo "=== $(($(date +%s) - T0)) s: $*"; }
"$P" -m pip install -q --no-deps --no-index --no-compile --target /tmp/gpu_check_site benchmarks/carry/base/*.whl ||
  exit 1
export PYTHONPATH=/tmp/gpu_check_site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
{ nvidia-smi; lscpu | head -20; } >"$OUT/env.txt" 2>&1
cd benchmarks || exit 1

phase "train: the fused step after the head's fewer passes, 4x larger head chunks"
{
  timeout 70 "$P" train_throughput.py --shape dense --batch 4 --backends sdpa --variants fused
  timeout 60 "$P" train_throughput.py --shape dense --batch 4 --backends sdpa --variants fused --logits-chunk-mb 256
} >"$OUT/train.log" 2>&1
grep -E "^dense|^(device|shape)" "$OUT/train.log"

phase "rollout: compiled bf16, a weight push and a sleep / wake, one profiled call"
timeout 170 "$P" rollout_compile.py --dtype bf16 --profile >"$OUT/rollout.log" 2>&1
grep -E "^rollout compile" "$OUT/rollout.log"

phase "rollout: the same compiled bf16 with the layout's separate q/k/v and gate/up GEMMs (the fusion's A/B)"
timeout 100 "$P" rollout_compile.py --dtype bf16 --compiled-only --unfused >"$OUT/rollout_unfused.log" 2>&1
grep -E "^rollout compile" "$OUT/rollout_unfused.log"

phase "rollout: fp32 token for token, before and after a push and a sleep / wake (CUDA graphs)"
timeout 120 "$P" rollout_compile.py --dtype fp32 --batch 8 --new 32 >"$OUT/rollout_fp32.log" 2>&1
echo "exit status $?"
grep -E "^rollout compile" "$OUT/rollout_fp32.log"
phase done
