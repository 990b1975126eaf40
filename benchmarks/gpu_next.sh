#!/usr/bin/env bash
# The next GPU session's device call, prepared here (benchmarks/GPU.md "The next session's calls" says what each
# part answers). On the device machine, from the repository root, with carry ["benchmarks/carry/base"] (made here
# by benchmarks/gpu_carry.sh) and timeout_s 600:
#
#     bash benchmarks/gpu_next.sh
#
# Every run is time-boxed (about 470 s in all) and logs under $OUT (four files; a call brings back at most eight);
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

phase "train: the fused step, head chunk 64 MiB / 256 MiB / 64 MiB again (an A/B in one call, fresh processes)"
{
  for mb in 64 256 64; do
    timeout 60 "$P" train_throughput.py --shape dense --batch 4 --backends sdpa --variants fused --logits-chunk-mb $mb
  done
} >"$OUT/train.log" 2>&1
grep -E "^dense|^device" "$OUT/train.log"

phase "train: a real run's global batch, 2 and 4 micro-batches of 4 rows a step (the optimizer's passes spread)"
{
  timeout 75 "$P" train_throughput.py --shape dense --batch 4 --backends sdpa --variants fused --micro-batches 2
  timeout 100 "$P" train_throughput.py --shape dense --batch 4 --backends sdpa --variants fused --micro-batches 4
  timeout 75 "$P" train_throughput.py --shape dense --batch 8 --backends sdpa --variants fused
} >"$OUT/train_accum.log" 2>&1
grep -E "^dense" "$OUT/train_accum.log"

phase "rollout: compiled bf16, profiled (the GPU kernels' share of the wall, after the profile's sum was mended)"
timeout 150 "$P" rollout_compile.py --dtype bf16 --profile >"$OUT/rollout.log" 2>&1
grep -E "^rollout compile" "$OUT/rollout.log"
phase done
