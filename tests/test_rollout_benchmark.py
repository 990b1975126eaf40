"""benchmarks/rollout_throughput.py's baseline: today's engine read from git into a private copy, which must not
outlive the run, and a checkout that cannot show it (a shallow clone) is one line with the fix, not a traceback; the
copy's decoders are its own (a ref since decoders.py left native.py), and a ref before that split still loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(ref: str, tmp_path) -> subprocess.CompletedProcess:
    code = (
        "import sys, rollout_peers as rp\n"
        f"base = rp.load_baseline({ref!r})\n"
        "print('loaded', base is not None and hasattr(base.native, 'NativeEngine'))\n"
        "print('copy', sys.path[0])\n"
        "decoder = getattr(getattr(base, 'native', None), 'BlockDiffusionDecoder', None)\n"
        "print('decoders', getattr(decoder, '__module__', None))\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.join(ROOT, "benchmarks"),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copies(tmp_path) -> list[str]:
    return [p for p in os.listdir(tmp_path) if p.startswith("megadare-baseline-")]


def test_an_unreadable_baseline_is_one_line_and_leaves_nothing(tmp_path):
    r = _load("0000000", tmp_path)
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stdout.splitlines() if line.startswith("baseline:")]
    assert len(notes) == 1 and "at 0000000" in notes[0] and "--baseline-ref none" in notes[0], r.stdout
    assert "loaded False" in r.stdout
    assert not _copies(tmp_path)  # the private folder was made, and removed at exit


def test_a_baseline_copy_lives_as_long_as_the_run(tmp_path):
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: the baseline is read with git show")
    r = _load("HEAD", tmp_path)
    assert r.returncode == 0 and "loaded True" in r.stdout, r.stdout + r.stderr
    copy = r.stdout.split("copy ", 1)[1].strip()
    assert copy.startswith(str(tmp_path)) and not os.path.exists(copy) and not _copies(tmp_path)


def test_a_baseline_decodes_with_its_own_decoders(tmp_path):
    """native.py imports its decoders from decoders.py (issue 27's split): the copy's native must run the copy's
    decoders, not the package's (which run the package's step, the engine being measured). A ref before the
    split (the default, ce9edaf) has no decoders.py and still loads."""
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: the baseline is read with git show")
    r = _load("HEAD", tmp_path)
    assert "loaded True" in r.stdout and "decoders _megadare_baseline_HEAD.decoders" in r.stdout, r.stdout + r.stderr
    if subprocess.run(["git", "-C", ROOT, "cat-file", "-e", "ce9edaf"], capture_output=True).returncode:
        pytest.skip("ce9edaf is not in this checkout (a shallow clone)")
    r = _load("ce9edaf", tmp_path)
    assert "loaded True" in r.stdout, r.stdout + r.stderr


def test_a_recent_baseline_ref_runs_in_the_benchmark(tmp_path):
    """A ref after ce9edaf (HEAD here) died in the clock of its forwards: its engine's ``_forward`` became
    ``forward``. It runs now, on a shape that takes seconds."""
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: the baseline is read with git show")
    tiny = ["--batch", "2", "--prompt", "8", "--new", "8", "--rounds", "1", "--layers", "1", "--vocab", "256"]
    r = subprocess.run(
        [sys.executable, "rollout_throughput.py", "--baseline-ref", "HEAD", "--threads", "1", *tiny],
        cwd=os.path.join(ROOT, "benchmarks"),
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rollout megadare today (HEAD) " in r.stdout, r.stdout


def test_a_ref_that_does_not_load_is_refused_in_one_line_naming_it_and_the_file(tmp_path):
    """The copy imports what BASELINE_FILES does not list (rollout/engine.py, models/) from this checkout: a ref
    whose files import a name the checkout no longer has ended in an ImportError traceback. Now one line names the
    ref, the file and the name."""
    code = (
        "import rollout_peers as rp\n"
        "real = rp._git_show\n"
        "def show(ref, path):\n"
        "    src, why = real('HEAD', path)\n"
        "    if path.endswith('native.py'):\n"
        "        src = src.replace('\\nfrom megadare.', '\\nfrom megadare.rollout.engine import GoneSince\\nfrom megadare.', 1)\n"
        "    return src, why\n"
        "rp._git_show = show\n"
        "rp.load_baseline('abc1234')\n"
    )
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: the baseline is read with git show")
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.join(ROOT, "benchmarks"),
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("baseline: megadare/rollout/native.py at abc1234 does not load"), lines[0]
    assert "GoneSince" in lines[0] and "megadare.rollout.engine" in lines[0] and "--baseline-ref none" in lines[0]
    assert not _copies(tmp_path)
