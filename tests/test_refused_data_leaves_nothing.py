"""A run refused for its data (a row missing a key) left the run directory behind with an empty ``ckpt/`` (the run
lock's) and ``init_hf/`` (the tiny model it wrote), though it never began: the data is now read before the run
writes anything, and the refusal leaves nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command, missing", [("sft", "'response'"), ("rl", "'answer'")])
def test_a_run_refused_for_its_data_writes_nothing(tmp_path, command, missing):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "abc"}\n{"prompt": "abd"}\n')
    config = os.path.join(ROOT, "megadare", "configs", f"demo_{command}.yaml")
    run = tmp_path / "run"
    argv = [command, "--config", config, f"logging.run_dir={run}", "logging.tensorboard=false"]
    argv += ["data.synthetic=null", f"data.path={data}"]
    proc = subprocess.run(
        [sys.executable, "-m", "megadare.cli", *argv], capture_output=True, text=True, timeout=110, cwd=tmp_path
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stderr.startswith(f"megadare: error: {data}:1: missing field {missing}"), proc.stderr[-2000:]
    assert not run.exists(), sorted(str(p.relative_to(run)) for p in run.rglob("*"))
