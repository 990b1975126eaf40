"""``megadare eval`` under a SIGTERM to the whole job (Slurm's time limit, ``scancel``) while it evaluates its
second task: it died by Ray's handler (exit 134, not a word of ours), its summary.json naming the first task alone
as if that were the whole run, and an earlier eval's files of the other tasks left beside it. Now: exit 0, one
line naming the task kept, the one cut and the one not started and how to run them; nothing of the cut task, and
summary.json says which tasks are left."""

from __future__ import annotations

import json
import os

import pytest

from test_rl_group_sigterm import left_in_session, run_hooked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "eval")

# megadare ARGV, whose HOOK_TARGET (module.Class.method) sends SIGTERM to the whole process group (a session of
# its own) once its HOOK_CALL-th call returned
HOOK = r"""
import importlib, os, signal, sys

module, cls, name = os.environ["HOOK_TARGET"].rsplit(".", 2)
owner = getattr(importlib.import_module(module), cls)
real, calls = getattr(owner, name), []


def hooked(*a, **k):
    out = real(*a, **k)
    calls.append(1)
    if len(calls) == int(os.environ["HOOK_CALL"]):
        os.killpg(os.getpgid(0), signal.SIGTERM)
    return out


setattr(owner, name, hooked)

if __name__ == "__main__":
    from megadare.cli import main

    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_a_sigterm_mid_task_keeps_the_finished_tasks_and_names_the_rest(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    earlier = ["samples_math500.jsonl", "samples_countdown.jsonl", "summary.csv", ".megadare-eval.json"]
    for name in earlier:  # an earlier eval's outputs: none may pass for this run's
        (out / name).write_text("{}\n")
    argv = [
        "eval",
        "--tasks",
        "gsm8k,math500,countdown",
        "model.family=sdar",
        "model.tiny=true",
        "model.block_size=4",
        f"logging.run_dir={tmp_path / 'run'}",
        f"eval.data_dir={FIXTURES}",
        "eval.n_samples=2",
        "eval.k=[1,2]",
        "eval.temperature=1.0",
        "eval.limit=2",
        f"eval.output_dir={out}",
        "rollout.max_new_tokens=8",
        "rollout.num_engines=1",
    ]
    # each task submits one request per sample round (2): the 3rd is math500's first, in flight at the SIGTERM
    env = {"HOOK_TARGET": "megadare.rollout.manager.RolloutManager.submit", "HOOK_CALL": "3"}
    proc, stdout, err = run_hooked(tmp_path, HOOK, argv, env, 250)
    assert proc.returncode == 0, (proc.returncode, stdout, err[-3000:])
    last = stdout.strip().splitlines()[-1]
    assert last == (
        f"eval stopped by SIGTERM: gsm8k finished and kept in {out} (samples_<task>.jsonl, summary.json); math500 "
        "cut (nothing of it written), countdown not started; run the rest with --tasks math500,countdown and a new "
        "eval.output_dir (a rerun does not skip finished tasks)"
    ), (stdout, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert sorted(os.listdir(out)) == [".megadare-eval.json", "samples_gsm8k.jsonl", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert (list(summary["tasks"]), summary["tasks_left"]) == (["gsm8k"], ["math500", "countdown"])
    assert len((out / "samples_gsm8k.jsonl").read_text().splitlines()) == 2 * 2
    assert left_in_session(proc.pid, 15) == []
