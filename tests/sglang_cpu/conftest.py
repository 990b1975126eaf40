"""Real-SGLang tests (run by tests/sglang_cpu/run.sh in the SGLang test venv; every module skips where sglang is
not installed, e.g. in the main suite). sglang's CPU engine is switched on before sglang is imported."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (HERE, os.path.dirname(HERE)):  # real_sglang here; tiny, dist, ray_fixture in tests/
    if path not in sys.path:
        sys.path.insert(0, path)


def pytest_terminal_summary(terminalreporter):
    if "real_sglang" not in sys.modules:
        return
    results = sys.modules["real_sglang"].RESULTS
    if results:
        terminalreporter.section("SGLang vs built-in engine")
        for line in results:
            terminalreporter.write_line(line)
