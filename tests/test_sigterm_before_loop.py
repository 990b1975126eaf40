"""A SIGTERM to the whole job (Slurm's preemption, ``kill -TERM -- -PGID``) while a run sets up, before its first
step (models build, Ray's engines start, the checkpoint loads): ``megadare sft`` died by the default handler (exit
143), ``megadare rl`` by Ray's own (``sys.exit(15)`` from ``ray.init`` on: exit 15), neither saying a word. Now the
set-up unwinds (Ray ends, the run lock is released), the command says 'stopped by SIGTERM before its first step' in
one line and exits 0, as a run stopped in its loop does, and no process of the job is left."""

from __future__ import annotations

import os

import pytest

from test_rl_group_sigterm import left_in_session, run_hooked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# megadare rl|sft whose set-up sends SIGTERM to its whole process group (a session of its own) at the end of
# ``TARGET`` (rl: ``push_weights``, the engines up and the checkpoint loaded; sft: ``setup_sft``), before the loop
HOOK = r"""
import importlib, os, signal, sys

module, name = os.environ["HOOK_TARGET"].rsplit(".", 1)
target = importlib.import_module(module)
real = getattr(target, name)


def hooked(*a, **k):
    out = real(*a, **k)
    os.killpg(os.getpgid(0), signal.SIGTERM)
    return out


setattr(target, name, hooked)

if __name__ == "__main__":
    from megadare.cli import main

    sys.exit(main(sys.argv[1:]))
"""

_RL = [
    "rl.steps=2",
    "rl.eval_size=4",
    "rl.eval_interval=0",
    "rl.prompts_per_step=2",
    "rl.n_samples=2",
    "train.micro_batch_size=2",
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "command, target, extra",
    [
        ("sft", "megadare.trainer.sft_loop.setup_sft", ["train.steps=12"]),
        ("rl", "megadare.trainer.rl.push_weights", _RL),
    ],
)
def test_a_sigterm_while_the_run_sets_up_ends_it_in_one_line_leaving_nothing(tmp_path, command, target, extra):
    config = os.path.join(ROOT, "megadare", "configs", f"demo_{command}.yaml")
    argv = [command, "--config", config, f"logging.run_dir={tmp_path / 'run'}", "logging.tensorboard=false", *extra]
    proc, out, err = run_hooked(tmp_path, HOOK, argv, {"HOOK_TARGET": target}, 220)
    assert proc.returncode == 0, (proc.returncode, out[-2000:], err[-3000:])
    assert f"{command} stopped by SIGTERM before its first step: nothing new to save;" in out, (out, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert left_in_session(proc.pid, 15) == []
