#!/bin/bash
# tests/slurm/run.sh [pytest args]: start a real Slurm on this host (tests/slurm/cluster.sh), run
# tests/slurm/test_real_slurm.py against it, stop it. Fails when a test fails or is skipped, or when no test ran
# (tests/junit_gate.py).
# Run from an environment with megadare installed (python, ray and torchrun on PATH: e.g. the CI venv).
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
cluster=tests/slurm/cluster.sh
trap '"$cluster" stop || true' EXIT
exports=$("$cluster" start)  # a failed start stops here (set -e), not at the first use of its exports
eval "$exports"
echo "real Slurm up in $(($(date +%s) - start)) s"
export MEGADARE_SLURM SLURM_CONF
set +e
python -m pytest -q -p no:cacheprovider -rs --junitxml="$MEGADARE_SLURM/junit.xml" tests/slurm/test_real_slurm.py "$@"
rc=$?
set -e
echo "real-Slurm step: $(($(date +%s) - start)) s in all (install, cluster, jobs)"
python3 tests/junit_gate.py real-Slurm "$MEGADARE_SLURM/junit.xml" "$rc"
