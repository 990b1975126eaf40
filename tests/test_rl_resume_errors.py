"""RL resume refusals are one line (megadare's own error), not a traceback."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from megadare.config import load_config
from megadare.errors import RunStateError
from megadare.trainer.data_order import StepSampler
from megadare.trainer.offpolicy.queue import lookahead
from megadare.trainer.rl_setup import _resume

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_resuming(tmp_path, ckpt, overrides=(), **fields) -> SimpleNamespace:
    """The parts of an RLRun ``_resume`` reads, of the demo's config with ``overrides``, whose policy resumes step 2
    from ``ckpt``; ``fields``: snapshots, ahead, buffer and the like."""
    cfg = load_config(os.path.join(ROOT, "megadare", "configs", "demo_rl.yaml"), list(overrides))
    sampler = StepSampler(8, cfg.rl.prompts_per_step, cfg.seed, cfg.data.shuffle)
    state = {"step": 2, "resumed_from": str(ckpt), "data_order": sampler.settings()}
    parts = dict(snapshots=None, ahead=lookahead(cfg.offpolicy.mode, cfg.offpolicy.max_staleness), buffer=None)
    return SimpleNamespace(
        cfg=cfg,
        policy=SimpleNamespace(resume=lambda *a, **k: state),
        spec=SimpleNamespace(source=None),
        algo=SimpleNamespace(name=cfg.algo.name),
        save_root=str(tmp_path / "ckpt"),
        rollouts=SimpleNamespace(sampler=sampler),
        **{**parts, **fields},
    )


def test_missing_weight_snapshots_on_resume_is_a_run_state_error(tmp_path):
    """A checkpoint without this rank's weight snapshots (another layout) while stale rollouts are queued: the
    run cannot correct them. This raised a bare RuntimeError (a traceback); it is a one-line RunStateError."""
    ckpt = tmp_path / "ckpt" / "iter_0000002"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text("{}")
    run = _run_resuming(tmp_path, ckpt, snapshots=SimpleNamespace(load_state_dict=lambda s: None), ahead=1)
    with pytest.raises(RunStateError, match=f"{ckpt} has no weight snapshots for this rank"):
        _resume(run)


def test_queued_rollouts_under_settings_they_do_not_fit_are_refused_naming_the_key(tmp_path):
    """A one-step-off checkpoint holds the rollout queued for the next step, 4 responses for each of 2 prompts;
    resumed with more, its responses were scored against the wrong prompts (4 per prompt read as 8: most against a
    neighbouring prompt's gold) and grouped wrongly without a word; with fewer the step died of a raw IndexError.
    Refused in one line naming the key (a queue too short for it: the next test); a longer queue takes it."""
    import torch

    ckpt = tmp_path / "ckpt" / "iter_0000002"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text("{}")
    made_by_version_1 = SimpleNamespace(policy_version=1)
    torch.save({"queue": {2: ([0, 1], [made_by_version_1] * 8)}, "replay": None}, ckpt / "rl_async.pt")

    def resume(*over: str):
        run = _run_resuming(tmp_path, ckpt, over)
        _resume(run)
        return run

    with pytest.raises(RunStateError, match=r"queued for RL steps 3..3, made with rl.n_samples=4 \(this config: 8\)"):
        resume("rl.mode=one_step_off", "rl.n_samples=8")
    longer = resume("rl.mode=fully_async", "rl.max_staleness=2", "rl.n_samples=4")
    assert longer.step == 2


def test_weight_snapshots_of_another_layout_are_refused_naming_it(tmp_path):
    """Resumed in another layout of the same world size (tp 2 -> dp 2), each rank found a snapshots file of its
    rank number holding another layout's shards and took it: the first stale step's behaviour pass copied them into
    the parameters and died of a raw shape error (or, had the shapes matched, corrected with the wrong weights).
    Refused at the resume in one line naming the layout."""
    import torch

    from megadare.trainer.offpolicy.queue import WeightSnapshots

    ckpt = tmp_path / "ckpt" / "iter_0000002"
    (ckpt / "weight_snapshots").mkdir(parents=True)
    (ckpt / "metadata.json").write_text("{}")
    halves = {2: [torch.zeros(2, 4), torch.zeros(2)]}  # rank 0's tensor-parallel half of a 4x4 linear layer
    torch.save(halves, ckpt / "weight_snapshots" / "rank_00000.pt")
    # this layout: the whole layer on the rank
    run = _run_resuming(tmp_path, ckpt, snapshots=WeightSnapshots([torch.nn.Linear(4, 4)]), ahead=1)
    with pytest.raises(RunStateError, match=r"its snapshot of policy version 2 holds 2 tensors, this rank has 2 "):
        _resume(run)
    with pytest.raises(RunStateError, match=r"\(the 0th: \(2, 4\) vs \(4, 4\)\): it was saved under another parallel"):
        _resume(run)


# megadare rl with the second checkpoint write of a step (policy or value model) killing the process (SIGKILL)
KILL_AT_SECOND_SAVE = r"""
import os, signal, sys
from megadare.trainer import policy
real, calls = policy.save_train_checkpoint, []
def save(*a, **k):
    calls.append(a[0])
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
policy.save_train_checkpoint = save
from megadare.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(600)
def test_a_kill_between_the_two_saves_of_the_first_checkpoint_leaves_a_run_that_goes_on(tmp_path):
    """TraceRL saved the policy, then the value model: a SIGKILL between the two saves of a run's first checkpoint
    left a policy checkpoint without its value model, and every rerun stopped with 'no intact checkpoint ...
    move them aside to start the run over'. The value model is now saved first and the policy's rename commits
    the step: the rerun sets the lone value checkpoint aside and trains from the start."""
    import subprocess
    import sys

    run = tmp_path / "rl"
    argv = [
        "rl",
        "--config",
        os.path.join(ROOT, "megadare", "configs", "demo_rl.yaml"),
        f"logging.run_dir={run}",
        "rl.steps=1",
        "rl.eval_size=4",
        "rl.eval_interval=0",
        "rl.prompts_per_step=2",
        "rl.n_samples=2",
        "train.micro_batch_size=2",
        "logging.tensorboard=false",
        "algo.params={value_model: true, value_lr: 1e-3}",
    ]
    killed = subprocess.run([sys.executable, "-c", KILL_AT_SECOND_SAVE, *argv], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    rerun = subprocess.run([sys.executable, "-m", "megadare", *argv], capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert "iter_0000001 is newer than the step resumed (0); moved it aside" in rerun.stderr, rerun.stderr
    assert os.path.isdir(run / "ckpt" / "iter_0000001") and os.path.isdir(run / "ckpt_value" / "iter_0000001")


def test_resume_with_the_value_model_turned_on_or_off_is_refused_naming_the_key(tmp_path, monkeypatch):
    """TraceRL checkpoints trained without a value model resumed with algo.params.value_model=true: every
    checkpoint was passed over as damaged (its value model missing) and the run stopped with 'no intact
    checkpoint ... move them aside to start the run over' (doing so restarts from step 0); the reverse dropped
    the value model's training without a word. Both are now refused in one line naming the key."""
    import json

    from megadare.convert.manifest import write_manifest
    from megadare.trainer import checkpoint
    from megadare.trainer.policy import Policy, ValueModel

    monkeypatch.setattr(checkpoint, "load_train_checkpoint", lambda *a, **k: {"step": 2})
    root = tmp_path / "ckpt"
    d = root / "iter_0000002"
    d.mkdir(parents=True)
    (d / "train_state.json").write_text(json.dumps({"step": 2}))
    (d / "megadare.json").write_text(json.dumps({"written_by": "megadare rl", "algo": "tracerl"}))
    write_manifest(str(d))
    with_value = Policy([], None, None, value=ValueModel([], None, None))
    with pytest.raises(RunStateError, match=r"trained with no value model .* this config trains one \(algo.params"):
        with_value.resume(str(root), None, "megadare rl", None, algo="tracerl")
    value = tmp_path / "ckpt_value" / "iter_0000002"
    value.mkdir(parents=True)
    with pytest.raises(RunStateError, match=r"trained with one value model .*algo.params.value_model=false"):
        Policy([], None, None).resume(str(root), None, "megadare rl", None, algo="tracerl")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["offpolicy.max_staleness=1"], "2 versions stale\\), more than offpolicy.max_staleness=1"),
        (
            ["offpolicy.mode=one_step_off"],
            "2 versions stale\\), whose weight snapshot offpolicy.mode=one_step_off does not keep",
        ),
    ],
)
def test_a_resume_that_cannot_train_its_queued_rollouts_is_refused_naming_the_keys(
    tmp_path, monkeypatch, overrides, match
):
    """A checkpoint of fully_async with max_staleness 2 queues the rollout of RL step 3 made by version 0. Resumed
    with offpolicy.max_staleness=1 it stopped at that step in a bare RuntimeError ('... staler than
    offpolicy.max_staleness=1'); resumed with offpolicy.mode=one_step_off (one version ahead) the first step
    dropped version 0's weight snapshot and the step's behaviour pass stopped in 'RuntimeError: no weight snapshot
    of policy version 0'. Both are refused at the resume, in one line naming the keys."""
    from megadare.trainer import rl_setup
    from megadare.trainer.offpolicy.queue import WeightSnapshots

    ckpt = tmp_path / "ckpt" / "iter_0000002"
    ckpt.mkdir(parents=True)
    base = ["offpolicy.mode=fully_async", "offpolicy.max_staleness=2", "offpolicy.loss_mode=decoupled"]
    saved = {  # the queue after step 2's take: steps 2 and 3, started on versions 0 and 1 (the demo's 8 samples)
        "rl_async": {
            "queue": {
                2: ([0], [SimpleNamespace(policy_version=0)] * 8),
                3: ([1], [SimpleNamespace(policy_version=1)] * 8),
            }
        },
        "weight_snapshots": {0: [], 1: []},
    }
    monkeypatch.setattr(rl_setup, "load_checkpoint_object", lambda path, name, per_rank=False: saved[name])
    run = _run_resuming(tmp_path, ckpt, base + overrides, snapshots=WeightSnapshots([]))
    with pytest.raises(
        RunStateError, match=f"{ckpt}: the queued rollout of RL step 3 comes from policy version 0 \\({match}"
    ):
        rl_setup._resume(run)


def test_a_queued_partial_rollout_is_checked_by_the_versions_of_its_segments():
    """A checkpoint saves a queued partial rollout between its segments (``PartialRollout.state_dict``, a dict);
    the resume's check of the queued rollouts read every entry as a list of trajectories and died of an
    AttributeError on the dict's key. It reads the segments generated so far: the oldest names its staleness."""
    from megadare.trainer.offpolicy.correction import restored_queue_problem
    from megadare.trainer.offpolicy.queue import PARTIAL_STATE

    segments = [[SimpleNamespace(policy_version=1), SimpleNamespace(policy_version=2)], []]  # prompt 1: none yet
    queue = {3: ([0, 1], {PARTIAL_STATE: {"parts": segments}})}
    for staleness, problem in [(1, "comes from policy version 1 (2 versions stale), more than "), (2, None)]:
        over = ["offpolicy.mode=fully_async", f"offpolicy.max_staleness={staleness}"]
        cfg = load_config(os.path.join(ROOT, "megadare", "configs", "demo_rl.yaml"), over)
        got = restored_queue_problem(cfg, queue, lookahead(cfg.offpolicy.mode, staleness), (), None)
        assert (got if got is None else got.split("RL step 4 ")[1][: len(problem)]) == problem, got
