#!/bin/bash
# tests/slurm/run.sh [pytest args]: start a real Slurm on this host (tests/slurm/cluster.sh), run
# tests/slurm/test_real_slurm.py against it, stop it. Fails when a test fails or when no test ran.
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
ran=$(python3 -c "import sys, xml.etree.ElementTree as E; s = E.parse(sys.argv[1]).getroot(); s = s if s.tag == 'testsuite' else s[0]; print(int(s.get('tests')) - int(s.get('skipped')))" "$MEGADARE_SLURM/junit.xml")
echo "real-Slurm tests: $ran ran, pytest exit $rc, $(($(date +%s) - start)) s in all (install, cluster, jobs)"
if ((rc == 0 && ran == 0)); then
  echo "tests/slurm/run.sh: no real-Slurm test ran -- failing" >&2
  exit 1
fi
exit "$rc"
