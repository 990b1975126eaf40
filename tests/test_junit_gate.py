"""tests/junit_gate.py, the verdict of the extra CI suites (real Slurm, real SGLang): a skip, a failure, an error,
no test at all, a missing report or a non-zero pytest exit fails the step; only tests that ran and passed pass."""

import pytest

from junit_gate import main


def report(tmp_path, tests=0, failures=0, errors=0, skipped=0, wrapped=True):
    suite = f'<testsuite name="pytest" tests="{tests}" failures="{failures}" errors="{errors}" skipped="{skipped}"/>'
    path = tmp_path / "junit.xml"
    path.write_text(f"<testsuites>{suite}</testsuites>" if wrapped else suite)
    return str(path)


@pytest.mark.parametrize("wrapped", [True, False])
def test_only_tests_that_ran_and_passed_pass(tmp_path, capsys, wrapped):
    assert main("suite", report(tmp_path, tests=5, wrapped=wrapped), 0) == 0
    assert "suite: 5 passed, 0 failed, 0 skipped" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fields,rc",
    [
        ({"tests": 5, "skipped": 1}, 0),
        ({"tests": 5, "skipped": 5}, 0),
        ({"tests": 0}, 5),
        ({"tests": 0}, 0),
        ({"tests": 5, "failures": 1}, 1),
        ({"tests": 5, "errors": 1}, 1),
        ({"tests": 5}, 1),
    ],
)
def test_a_skip_a_failure_or_no_test_fails_the_step(tmp_path, capsys, fields, rc):
    assert main("suite", report(tmp_path, **fields), rc) == 1
    assert "suite: FAILED" in capsys.readouterr().err


def test_a_missing_report_fails_the_step(tmp_path, capsys):
    assert main("suite", str(tmp_path / "none.xml"), 0) == 1
    assert "no test report" in capsys.readouterr().err
