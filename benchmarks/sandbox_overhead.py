"""Per-program cost of the code sandbox: ``rewards.code.isolation=namespaces`` (the OS sandbox) against ``process``
(the previous guard: same rlimits, seccomp and audit hook, no namespaces but a network one), in one process, rounds
alternated so a loaded machine slows both alike.

    python benchmarks/sandbox_overhead.py [--rounds 6] [--per-round 20]

Two programs: a trivial one (``print(1)``: pure sandbox overhead) and an assert-style test case (the test mode an
RL code reward runs, DARE's preamble included). Prints, per mode, the median wall time per program and the CPU time
(user + system of the children, per program), and the ratio namespaces / process.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("process", "namespaces")


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=20)
    a = ap.parse_args()
    from megadare.rewards.code_forms import PREAMBLE
    from megadare.rewards.sandbox import SandboxLimits, check_isolation, run_program

    print("namespaces layers:", ", ".join(check_isolation("namespaces")))
    programs = {
        "trivial": dict(code="print(1)"),
        "test_case": dict(code=PREAMBLE + "def add(a, b):\n    return a + b\n", tests="assert add(2, 3) == 5\n"),
    }
    wall = {(p, m): [] for p in programs for m in MODES}
    cpu = {(p, m): [] for p in programs for m in MODES}
    for r in range(a.rounds):
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            for name, kw in programs.items():
                c0 = _children_cpu()
                for _ in range(a.per_round):
                    t0 = time.perf_counter()
                    res = run_program(**kw, limits=SandboxLimits(timeout_s=30, isolation=mode))
                    wall[name, mode].append(time.perf_counter() - t0)
                    assert res.status == "ok" and res.tests_passed is not False, res
                cpu[name, mode].append((_children_cpu() - c0) / a.per_round)
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    print(f"\n{'program':10s} {'mode':11s} {'wall ms (median)':>17s} {'cpu ms/program':>15s}")
    for name in programs:
        for mode in MODES:
            print(
                f"{name:10s} {mode:11s} {1e3 * statistics.median(wall[name, mode]):17.1f} "
                f"{1e3 * statistics.median(cpu[name, mode]):15.1f}"
            )
        w = statistics.median(wall[name, "namespaces"]) / statistics.median(wall[name, "process"])
        c = statistics.median(cpu[name, "namespaces"]) / statistics.median(cpu[name, "process"])
        print(f"{name:10s} namespaces / process: wall x{w:.2f}, cpu x{c:.2f}")


if __name__ == "__main__":
    main()
