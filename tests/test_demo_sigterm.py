"""``megadare demo`` under a SIGTERM to the job (``scancel``) during its SFT stage: the stage saved and stopped, and
the demo went on to RL from that cut SFT, ending as a finished demo ('held-out accuracy: SFT ... -> RL ...',
exit 0) that never said it was stopped. Now it stops after the stage's checkpoint and says so in one line."""

from __future__ import annotations

import os

import pytest

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
