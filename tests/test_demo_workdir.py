"""`megadare demo`'s work directory: each demo has its own by default, and one holding another demo is refused in
one line (a resumed run would report that demo's accuracy under this one's name). No training runs here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megadare import cli
from megadare.config import to_yaml
from megadare.demo_setup import DemoRun, check_workdir, default_workdir
from megadare.errors import RunStateError


def _finished_demo(workdir: str, family: str = "sdar", algo: str = "tracerl") -> None:
    """The config.yaml files a finished demo leaves in ``workdir`` (what the runs write at their start)."""
    for stage, cfg in zip(("sft", "rl"), DemoRun(workdir, algo=algo, family=family).configs()):
        os.makedirs(os.path.join(workdir, stage))
        with open(os.path.join(workdir, stage, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))


def test_each_demo_has_its_own_default_workdir():
    assert default_workdir("sdar", "tracerl") == "runs/demo"  # the README's outputs of `megadare demo`
    dirs = {default_workdir(f, a) for f in ("sdar", "llada") for a in ("tracerl", "justgrpo")}
    assert len(dirs) == 4


def test_workdir_of_another_demo_is_refused(tmp_path):
    wd = str(tmp_path / "demo")
    _finished_demo(wd)
    check_workdir(DemoRun(wd))  # the same demo again: it resumes
    check_workdir(DemoRun(wd, rl_steps=60))
    with pytest.raises(RunStateError, match=r"holds the demo of tracerl on a tiny sdar .*--workdir NEW_DIR"):
        check_workdir(DemoRun(wd, algo="coupled_grpo"))
    with pytest.raises(RunStateError, match=r"holds the demo of a tiny sdar .*sft.*--workdir NEW_DIR"):
        check_workdir(DemoRun(wd, algo="justgrpo", family="llada"))


def test_cli_demo_error_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "default")  # demo.main sets it when unset; keep it to this test
    wd = str(tmp_path / "demo")
    _finished_demo(wd)
    assert cli.main(["demo", "--workdir", wd, "--algo", "coupled_grpo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megadare: error: ") and err.count("\n") == 1 and "--workdir NEW_DIR" in err


def test_a_refused_demo_prints_its_error_alone(tmp_path, capsys, monkeypatch):
    """`megadare demo --algo justgrpo` (a full-attention algorithm on the default block family) printed the demo's
    "SFT then RL ..." heading, then the error: the refusal is now the only output."""
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    assert cli.main(["demo", "--workdir", str(tmp_path / "demo"), "--algo", "justgrpo"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("megadare: error: ") and out.err.count("\n") == 1
    assert not os.path.exists(tmp_path / "demo")


def test_a_short_sft_warms_up_for_its_own_length_at_most(tmp_path):
    """`megadare demo --sft-steps 3` was refused (demo_sft.yaml warms up for 10 steps): the warm-up now fits."""
    sft, _ = DemoRun(str(tmp_path / "demo"), sft_steps=3).configs()
    assert (sft.train.steps, sft.optim.warmup_steps) == (3, 3)
    sft, _ = DemoRun(str(tmp_path / "demo"), sft_steps=50).configs()
    assert (sft.train.steps, sft.optim.warmup_steps) == (50, 10)


def test_a_workdir_holding_files_no_demo_writes_is_refused(tmp_path):
    """--workdir pointed at a directory of the user's (a project, the home directory): the demo wrote sft/, rl/
    and reward_curve.png into it among the user's files, replacing a reward_curve.png of theirs. Now refused in
    one line before any training; a new, empty or previous demo's directory is used as before."""
    wd = tmp_path / "project"
    wd.mkdir()
    (wd / "notes.txt").write_text("mine")
    (wd / "reward_curve.png").write_bytes(b"my plot")
    with pytest.raises(RunStateError, match=f"{wd} holds {wd}/notes.txt, which no demo writes"):
        check_workdir(DemoRun(str(wd)))
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(RunStateError, match="is a file"):
        check_workdir(DemoRun(str(tmp_path / "a_file")))
    check_workdir(DemoRun(str(tmp_path / "new")))
    (tmp_path / "empty").mkdir()
    check_workdir(DemoRun(str(tmp_path / "empty")))


def test_a_refused_workdir_is_refused_before_torch_loads(tmp_path):
    """`megadare demo --workdir examples` (a directory of the user's) was refused only after torch, megatron and ray
    loaded (6.7 s on a 2-core VM, ~37 s on a busy one): the work directory is now checked first, torch-free."""
    wd = tmp_path / "project"
    wd.mkdir()
    (wd / "notes.txt").write_text("mine")
    probe = (
        "import sys; from megadare.cli import main; rc = main(['demo', '--workdir', sys.argv[1]]); "
        "print(rc, 'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", probe, str(wd)], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["2", "False"], (proc.stdout, proc.stderr[-2000:])
    assert proc.stderr.startswith("megadare: error: ") and "which no demo writes" in proc.stderr, proc.stderr
