"""``megadare demo`` under a SIGTERM to the job (``scancel``) during its SFT stage: the stage saved and stopped, and
the demo went on to RL from that cut SFT, ending as a finished demo ('held-out accuracy: SFT ... -> RL ...',
exit 0) that never said it was stopped. Now it stops after the stage's checkpoint and says so in one line."""

from __future__ import annotations

import os
import signal

import pytest

import megadare.demo as demo_module
from megadare import stopping
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


def test_a_sigterm_during_the_rl_set_up_says_sft_was_saved(tmp_path, monkeypatch, capsys):
    """A SIGTERM after SFT finished, while RL set up (Ray starting): the demo said 'demo stopped by SIGTERM before
    its first step: nothing new to save', though SFT's 500 steps were saved and a rerun goes straight to RL."""

    def stage(worker, nproc, cfg, timeout_s):
        if worker is demo_module.sft_worker:
            return [{"stopped_by_signal": False, "step": 4}]
        raise StoppedBeforeTheLoop()  # what the RL worker raises on a SIGTERM before its first step

    monkeypatch.setattr(demo_module, "spawn", stage)
    argv = ["--workdir", str(tmp_path / "demo"), "--sft-steps", "4", "--rl-steps", "2"]
    assert demo_module.main(argv) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "demo stopped by SIGTERM during RL's set-up, after SFT finished at step 4 (its checkpoint saved); run the "
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
