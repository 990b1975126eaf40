#!/usr/bin/env bash
# Real-SGLang tests on CPU (what CI runs after the main suite):
#   1. build the SGLang test venv, or reuse it: outside the repo, at
#      ${MEGADARE_SGLANG_VENV:-$HOME/.cache/megadare/sglang-venv-<hash of the files that define it>};
#      sglang (--no-deps) + the Python requirements its CPU path imports + the named stand-ins of this folder
#      (standins/: a torch-only sgl_kernel, an sglang plugin for the paged KV allocator; guard_torchvision.py);
#   2. install megadare into it (editable, no dependencies: requirements.txt has what the tests need);
#   3. run tests/sglang_cpu/test_*.py with it, sglang's CPU engine switched on (SGLANG_USE_CPU_ENGINE=1).
# Fails when a test fails, is skipped, or when no test ran. Extra arguments go to pytest (e.g. -k sdar).
set -euo pipefail
STEP_START=$(date +%s)
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON="${MEGADARE_SGLANG_PYTHON:-python3}"

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' \
  || { echo "sglang-cpu: $PYTHON is older than 3.10 (sglang 0.5.21 needs >= 3.10); set MEGADARE_SGLANG_PYTHON" >&2; exit 1; }
DEFINING=(requirements.txt requirements-nodeps.txt guard_torchvision.py standins/pyproject.toml
          standins/sgl_kernel/__init__.py standins/sglang_cpu_standin.py)
HASH="$( { "$PYTHON" -c 'import sys; print(sys.version_info[:2])'
          (cd "$HERE" && cat "${DEFINING[@]}" && sed -n '/^build_venv()/,/^}/p' run.sh); } | sha256sum | cut -c1-12)"
VENV="${MEGADARE_SGLANG_VENV:-$HOME/.cache/megadare/sglang-venv-$HASH}"
MARK="$VENV/.megadare-sglang-venv"
V="$VENV/bin"

build_venv() {
  local t0 cons
  t0=$(date +%s)
  "$PYTHON" -m venv "$VENV"
  "$V/python" -m pip install -qq --no-warn-conflicts --upgrade pip
  # torch first, as .ci/run installs it (the CPU build where the index has one); then keep it, whatever is asked
  "$V/python" -m pip install -qq --no-warn-conflicts torch==2.13.0
  cons="$VENV/constraints.txt"
  "$V/python" -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' > "$cons"
  "$V/python" -m pip install -qq --no-warn-conflicts --no-deps -r "$HERE/requirements-nodeps.txt"
  "$V/python" -m pip install -qq --no-warn-conflicts -c "$cons" -r "$HERE/requirements.txt"
  "$V/python" "$HERE/guard_torchvision.py"
  "$V/python" -m pip install -qq --no-warn-conflicts --no-deps --no-build-isolation "$HERE/standins"
  rm -rf "$HERE/standins/build" "$HERE"/standins/*.egg-info
  echo "$HASH" > "$MARK"
  echo "sglang-cpu: venv built (install time) in $(( $(date +%s) - t0 )) s at $VENV"
}

mkdir -p "$(dirname "$VENV")"
exec 9> "$VENV.lock"
flock -x 9                                              # one build at a time per venv
if [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$HASH" ]; then
  VENV_STATE="reused"
  echo "sglang-cpu: reusing the venv at $VENV"
else
  if [ -e "$VENV" ]; then
    if [ ! -f "$MARK" ]; then
      echo "sglang-cpu: $VENV exists and is not a venv this script built; remove it or set MEGADARE_SGLANG_VENV" >&2
      exit 1
    fi
    rm -rf "$VENV"                                      # built by this script from other inputs
  fi
  build_venv || { echo "sglang-cpu: building the venv failed; removing the partial venv" >&2; rm -rf "$VENV"; exit 1; }
  VENV_STATE="built"
  if [ -z "${MEGADARE_SGLANG_VENV:-}" ]; then          # venvs (3 GB each) this script built from older inputs
    for old in "$(dirname "$VENV")"/sglang-venv-*; do   # unless a run holds it (its lock)
      if [ "$old" != "$VENV" ] && [ -f "$old/.megadare-sglang-venv" ]; then
        (exec 8> "$old.lock" && flock -n -x 8 && rm -rf "$old" "$old.lock") || true
      fi
    done
  fi
fi

t0=$(date +%s)
(cd "$REPO" && "$V/python" -m pip install -qq --no-warn-conflicts --no-deps --no-build-isolation -e .)
echo "sglang-cpu: megadare installed (editable) in $(( $(date +%s) - t0 )) s"
flock -s 9                                              # shared while the tests use the venv

REPORT_DIR="$(mktemp -d)"
trap 'rm -rf "$REPORT_DIR"' EXIT
JUNIT="$REPORT_DIR/sglang_cpu.xml"
set +e
(cd "$REPO" && SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$REPO" \
   "$V/python" -m pytest -q tests/sglang_cpu --junitxml="$JUNIT" "$@")
rc=$?
set -e
echo "sglang-cpu: step took $(( $(date +%s) - STEP_START )) s (venv $VENV_STATE)"
"$V/python" "$REPO/tests/junit_gate.py" sglang-cpu "$JUNIT" "$rc"
