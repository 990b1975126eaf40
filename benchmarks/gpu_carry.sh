#!/usr/bin/env bash
# Download the Python 3.12 wheels the GPU machine's image lacks, for `benchmarks/gpu_check.py --carry`.
#
#   bash benchmarks/gpu_carry.sh [OUT]        # here, where pip reaches PyPI; OUT defaults to benchmarks/carry
#
# OUT/base  megadare's requirements missing on the image (Python 3.12, torch 2.11 + CUDA, transformers 5.17, no
#           Transformer Engine): megatron-core, omegaconf, antlr4 (omegaconf's parser), math-verify,
#           latex2sympy2_extended (math-verify's parser)
# OUT/ray   Ray for `megadare rl` (engine actors): its wheel repacked without the Java worker jar and the
#           dashboard's source maps (benchmarks/slim_ray.py), plus jsonschema and its three dependencies
# Both folders are git-ignored: a device call carries them by name (GPU.md), each call at most 64 MiB with the
# repository's own files. EXTRA="pkg==ver ..." adds wheels to OUT/base (an import the env step shows missing).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-$HERE/carry}
PY=${PY:-python3}
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
      --platform any)
dl() {
  local dest=$1
  shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none "${PLAT[@]}" -d "$dest" "$@" 2>&1 | { grep -v 'is ignored' || true; }
  test "${PIPESTATUS[0]}" = 0
}
rm -rf "$OUT/base" "$OUT/ray"
mkdir -p "$OUT/base" "$OUT/ray"
# the versions megadare is tested with (its venv); megatron-core's range is setup.py's
# shellcheck disable=SC2086
dl "$OUT/base" megatron-core==0.16.1 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 math-verify==0.9.0 \
  latex2sympy2_extended==1.11.0 ${EXTRA:-}
dl "$OUT/ray" jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dl "$tmp" ray==2.60.0
for w in "$tmp"/ray-*.whl; do
  "$PY" "$HERE/slim_ray.py" "$w" "$OUT/ray/$(basename "$w")"
done
limit=$((64 * 1024 * 1024))
for d in base ray; do
  n=$(find "$OUT/$d" -name '*.whl' | wc -l)
  b=$(du -cb "$OUT/$d"/*.whl | tail -1 | cut -f1)
  echo "$OUT/$d: $n wheels, $b bytes ($((b / 1024 / 1024)) MiB)"
done
repo=$(git -C "$HERE/.." ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
all=$(du -cb "$OUT"/base/*.whl "$OUT"/ray/*.whl | tail -1 | cut -f1)
echo "repository files: $repo bytes; repository + base + ray: $((repo + all)) bytes (a call may carry $limit)"
[ $((repo + all)) -lt "$limit" ] || { echo "over the 64 MiB a device call carries: carry ray in a call of its own" >&2; exit 1; }
