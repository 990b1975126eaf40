"""A SIGTERM to the whole job (Slurm's preemption or time limit, ``scancel``) at the edges of a run, where no
handler of the run's was in place yet or any more:

* ``megadare sft`` reading its config, before the run's set-up (imports, model build): it died by the default
  handler (exit 143, not a word); now 'stopped by SIGTERM before its first step', exit 0;
* ``megadare sft --nproc 2`` as its ranks start (the interpreter's start, torch's imports): the ranks died by it and
  the launcher reported them 'killed by SIGTERM' as an error (exit 2); now the same stop line, exit 0;
* after the loop, its last checkpoint written, before the cleanup: it died by the default handler, a finished run
  turned into a silent exit 143; now the run's summary says the SIGTERM came after the checkpoint, exit 0."""

from __future__ import annotations

import os
import signal

import pytest

from test_rl_group_sigterm import left_in_session, run_hooked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# megadare ARGV, whose HOOK_TARGET (module.attribute, or module.Class.method) sends SIGTERM to the whole process
# group (a session of its own) once it returned
HOOK = r"""
import importlib, os, signal, sys

path = os.environ["HOOK_TARGET"].split(".")
for i in range(len(path) - 1, 0, -1):
    try:
        owner = importlib.import_module(".".join(path[:i]))
        break
    except ImportError:
        continue
for name in path[i:-1]:
    owner = getattr(owner, name)
real = getattr(owner, path[-1])


def hooked(*a, **k):
    out = real(*a, **k)
    os.killpg(os.getpgid(0), signal.SIGTERM)
    return out


setattr(owner, path[-1], hooked)

if __name__ == "__main__":
    from megadare.cli import main

    sys.exit(main(sys.argv[1:]))
"""

STOPPED = "sft stopped by SIGTERM before its first step: nothing new to save;"


def _sft(tmp_path, target: str, *extra: str):
    config = os.path.join(ROOT, "megadare", "configs", "demo_sft.yaml")
    argv = ["sft", "--config", config, f"logging.run_dir={tmp_path / 'run'}", "logging.tensorboard=false", *extra]
    return run_hooked(tmp_path, HOOK, argv, {"HOOK_TARGET": target}, 200)


@pytest.mark.timeout(60)
def test_a_sigterm_while_the_command_reads_its_config_stops_it_in_one_line(tmp_path):
    proc, out, err = _sft(tmp_path, "megadare.cli.load_config")
    assert (proc.returncode, out.strip().splitlines()) == (0, [out.strip()]), (proc.returncode, out, err[-2000:])
    assert out.startswith(STOPPED) and err == "", (out, err[-2000:])
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.timeout(120)
def test_a_sigterm_as_the_ranks_start_is_a_stop_not_a_crash(tmp_path):
    proc, out, err = _sft(tmp_path, "megadare.parallel.launch._pass_sigterm_on", "--nproc", "2")
    assert proc.returncode == 0, (proc.returncode, out, err[-3000:])
    assert STOPPED in out and "killed by SIGTERM" not in err, (out, err[-3000:])
    assert left_in_session(proc.pid, 15) == []


@pytest.mark.timeout(200)
def test_a_sigterm_after_the_last_checkpoint_keeps_the_finished_run(tmp_path):
    proc, out, err = _sft(tmp_path, "megadare.trainer.loop.Loop.close", "train.steps=2", "optim.warmup_steps=1")
    assert proc.returncode == 0, (proc.returncode, out[-2000:], err[-3000:])
    assert "sft done at step 2" in out and "SIGTERM received after the last checkpoint was written" in out, out
    assert "Traceback" not in err, err[-3000:]
    assert os.path.isdir(tmp_path / "run" / "ckpt" / "iter_0000002"), sorted(os.listdir(tmp_path / "run" / "ckpt"))


@pytest.mark.parametrize("when", ["unwinding", "printing"])
def test_a_sigterm_on_an_error_on_its_way_out_keeps_the_error(monkeypatch, capsys, when):
    """A run refused in its set-up (a one-line error) that gets the job's SIGTERM while the error unwinds the
    set-up's cleanup, or while its line is printed, ends by that error (exit 2, the line), not as a stop (exit 0):
    the stop would hide why the run could not start."""
    from megadare import cli
    from megadare.errors import ConfigError

    def refused(args):
        try:
            raise ConfigError("data.path=x.jsonl: no such file")
        finally:  # the set-up's cleanup, which the SIGTERM interrupts
            if when == "unwinding":
                os.kill(os.getpid(), signal.SIGTERM)

    printed = cli.report_error

    def report_while_signalled(e):
        if when == "printing":
            os.kill(os.getpid(), signal.SIGTERM)
        printed(e)

    monkeypatch.setattr(cli, "_dispatch", refused)
    monkeypatch.setattr(cli, "report_error", report_while_signalled)
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or Ray's where an earlier test of this process ran ray.init
    assert cli.main(["sft", "--config", os.path.join(ROOT, "examples/configs/sft_sdar_tiny.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("megadare: error: data.path=x.jsonl: no such file") == 1
    assert signal.getsignal(signal.SIGTERM) is before  # the command's handling put back what it found


@pytest.mark.timeout(60)
def test_a_sigterm_while_plan_reads_its_config_stops_it_in_one_line(tmp_path):
    """``megadare plan`` died by the default handler (exit 143, not a word); it writes nothing, and says so."""
    argv = ["plan", "model.family=sdar", "model.tiny=true"]
    proc, out, err = run_hooked(tmp_path, HOOK, argv, {"HOOK_TARGET": "megadare.cli.load_config"}, 50)
    assert (proc.returncode, out, err) == (
        0,
        "plan stopped by SIGTERM before it wrote anything; run the same command again\n",
        "",
    ), (proc.returncode, out, err[-2000:])
