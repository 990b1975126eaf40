"""python tests/junit_gate.py NAME JUNIT_XML PYTEST_EXIT: the verdict of a CI step that runs an extra suite
(tests/slurm/run.sh, tests/sglang_cpu/run.sh). Prints ``NAME: <p> passed, <f> failed, <s> skipped`` and exits 1 when
pytest failed, when a test failed, errored or was skipped, or when no test ran: a test that did not run is not a
pass. Standard library only (it runs under any of the suites' interpreters)."""

import sys
import xml.etree.ElementTree as ET


def counts(path: str) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


def main(name: str, path: str, rc: int) -> int:
    try:
        n = counts(path)
    except (OSError, ET.ParseError) as e:
        print(f"{name}: no test report ({e}); pytest exit code {rc}", file=sys.stderr)
        return 1
    failed = n["failures"] + n["errors"]
    passed = n["tests"] - failed - n["skipped"]
    print(f"{name}: {passed} passed, {failed} failed, {n['skipped']} skipped")
    if rc != 0 or passed == 0 or n["skipped"] or failed:
        print(
            f"{name}: FAILED (pytest exit code {rc}): a failure, an error, a skip or no test at all fails this step",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
