"""``megadare demo`` under a SIGTERM to the job (``scancel``) during its SFT stage: the stage saved and stopped, and
the demo went on to RL from that cut SFT, ending as a finished demo ('held-out accuracy: SFT ... -> RL ...',
exit 0) that never said it was stopped. Now it stops after the stage's checkpoint and says so in one line.

Outside its stages' loops (its set-up, before torch loads; between SFT and RL) the demo was not watched: a SIGTERM
killed it by the default handler (exit 143, not a word, what a Slurm user sees after ``scancel``). Now it stops
there as ``megadare sft`` does: one line naming the checkpoints its stages kept, exit 0."""

from __future__ import annotations

import os
import signal

import pytest

import megadare.demo as demo_module
from megadare import cli, stopping
from megadare.errors import StoppedBeforeTheLoop
from test_rl_group_sigterm import run_hooked
from test_sigterm_edges import HOOK


@pytest.mark.timeout(300)
def test_a_sigterm_during_the_demos_sft_stops_the_demo_there(tmp_path):
    work = tmp_path / "demo"
    argv = ["demo", "--workdir", str(work), "--sft-steps", "4", "--rl-steps", "2"]
    # the SFT loop's signal handling starts, then the whole job gets SIGTERM: SFT saves at step 1 and stops
    proc, out, err = run_hooked(
        tmp_path, HOOK, argv, {"HOOK_TARGET": "megadare.trainer.signals.StopSignal.__init__"}, 250
    )
    assert proc.returncode == 0, (proc.returncode, out, err[-3000:])
    lines = out.strip().splitlines()
    assert lines[-1] == (
        "demo stopped by SIGTERM during SFT at step 1 (its checkpoint saved); run the same command again to resume it"
    ), (out, err[-3000:])
    assert "held-out accuracy" not in out and not os.path.exists(work / "rl"), out
    assert os.path.isdir(work / "sft" / "ckpt" / "iter_0000001")


@pytest.mark.timeout(60)
def test_a_sigterm_while_the_demo_sets_up_stops_it_in_one_line(tmp_path):
    work = tmp_path / "demo"
    argv = ["demo", "--workdir", str(work), "--sft-steps", "2", "--rl-steps", "1"]
    # the work directory checked, before torch loads: the whole job gets SIGTERM
    proc, out, err = run_hooked(tmp_path, HOOK, argv, {"HOOK_TARGET": "megadare.demo_setup.check_workdir"}, 50)
    assert proc.returncode == 0, (proc.returncode, out, err[-3000:])
    assert out.strip().splitlines() == [
        "demo stopped by SIGTERM before its first step: nothing to save; run the same command again"
    ], (out, err[-3000:])
    assert err == "" and not os.path.exists(work / "sft"), err[-3000:]


@pytest.mark.timeout(300)
def test_a_sigterm_between_the_demos_stages_keeps_sft_and_says_so(tmp_path):
    work = tmp_path / "demo"
    argv = ["demo", "--workdir", str(work), "--sft-steps", "2", "--rl-steps", "1"]
    # SFT's ranks finished (its checkpoint at step 2 written), then the whole job gets SIGTERM before RL starts
    proc, out, err = run_hooked(tmp_path, HOOK, argv, {"HOOK_TARGET": "megadare.demo.spawn"}, 250)
    assert proc.returncode == 0, (proc.returncode, out, err[-3000:])
    assert out.strip().splitlines()[-1] == (
        "demo stopped by SIGTERM between steps: nothing new to save, its checkpoints kept (SFT at step 2); run the "
        "same command again to resume it"
    ), (out, err[-3000:])
    assert "Traceback" not in err and not os.path.exists(work / "rl"), (out, err[-3000:])
    assert os.path.isdir(work / "sft" / "ckpt" / "iter_0000002")


@pytest.mark.timeout(200)
def test_a_sigterm_during_the_foundation_demo_stops_it_in_one_line(tmp_path):
    # the first family's checkpoint converted, in the demo's temporary work directory: the whole job gets SIGTERM
    env = {"HOOK_TARGET": "megadare.demo_foundation.hf_to_megatron", "TMPDIR": str(tmp_path)}
    proc, out, err = run_hooked(tmp_path, HOOK, ["demo", "--foundation"], env, 150)
    assert proc.returncode == 0, (proc.returncode, out, err[-3000:])
    assert out.strip().splitlines()[-1] == (
        "demo stopped by SIGTERM before it wrote anything; run the same command again"
    ), (out, err[-3000:])
    assert "Traceback" not in err and not [p for p in os.listdir(tmp_path) if p.startswith("megadare_demo")]


@pytest.mark.timeout(300)
def test_a_sigterm_after_the_demos_rl_lets_it_finish(tmp_path):
    work = tmp_path / "demo"
    argv = ["demo", "--workdir", str(work), "--sft-steps", "2", "--rl-steps", "1"]
    # RL's last checkpoint written and its ranks ended, the curve drawn: then the whole job gets SIGTERM
    proc, out, err = run_hooked(tmp_path, HOOK, argv, {"HOOK_TARGET": "megadare.demo.plot_rl_curve"}, 250)
    assert proc.returncode == 0, (proc.returncode, out, err[-3000:])
    last = out.strip().splitlines()[-1]
    assert last.startswith("held-out accuracy: SFT "), (out, err[-3000:])
    assert last.endswith("; SIGTERM received after the last checkpoint was written: nothing lost"), out
    assert os.path.isfile(work / "reward_curve.png") and "Traceback" not in err, err[-3000:]


def test_a_sigterm_during_the_rl_set_up_says_sft_was_saved(tmp_path, monkeypatch, capsys):
    """A SIGTERM after SFT finished, while RL set up (Ray starting): the demo said 'demo stopped by SIGTERM before
    its first step: nothing new to save', though SFT's steps were saved and a rerun goes straight to RL."""
    work = tmp_path / "demo"

    def stage(worker, nproc, cfg, timeout_s):
        if worker is demo_module.sft_worker:  # SFT finished: its checkpoint's tracker, as the stage writes it
            os.makedirs(work / "sft" / "ckpt")
            (work / "sft" / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4")
            return [{"stopped_by_signal": False, "step": 4}]
        raise StoppedBeforeTheLoop()  # what the RL worker raises on a SIGTERM before its first step

    monkeypatch.setattr(demo_module, "spawn", stage)
    assert cli.main(["demo", "--workdir", str(work), "--sft-steps", "4", "--rl-steps", "2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "demo stopped by SIGTERM between steps: nothing new to save, its checkpoints kept (SFT at step 4); run the "
        "same command again to resume it"
    )


def test_a_sigterm_in_the_demos_second_run_stops_its_set_up():
    """The demo runs RL after SFT in one process: a SIGTERM while RL set up (Ray, the engines starting), or between
    the stages, was taken for one after SFT's loop (nothing to do) and the demo trained all of RL, ignoring it."""
    with stopping.watching():  # the command
        with stopping.watching():  # SFT
            stopping.loop_began()
            stopping.loop_ended()
        with stopping.watching(), pytest.raises(StoppedBeforeTheLoop):  # RL's set-up
            signal.raise_signal(signal.SIGTERM)
    with stopping.watching():
        with stopping.watching():
            stopping.loop_began()
            stopping.loop_ended()
        signal.raise_signal(signal.SIGTERM)  # between the stages
        with pytest.raises(StoppedBeforeTheLoop), stopping.watching():
            pass
