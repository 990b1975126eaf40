"""Asynchronous RL end to end on CPU (Megatron actor + Ray-managed built-in engine):

* ``rl.mode=fully_async`` with ``max_staleness=0`` is the sync loop, bit for bit;
* the decoupled objective with trainer-side behaviour log-probs is the identity when the weights did not change
  (IS weights exactly 1, same losses and gradients as plain PPO);
* one-step-off with the decoupled objective: stale samples get IS weights != 1, the health metrics (staleness
  histogram, idle ratios, IS statistics) reach tensorboard;
* fully async with D-ARL replay: the replay buffer, the queued (stale) rollouts and the behaviour weight
  snapshots survive checkpoint/resume -- 1 step + resume + 2 steps == 3 steps straight.
"""

from __future__ import annotations

import math

import pytest

from ray_fixture import ray_cluster  # noqa: F401  (module-scoped local Ray cluster)
from test_rl_loop import _events, _rl_cfg, _run

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("ray_cluster")]

TIMING = ("time", "_s", "wait", "idle", "busy", "gbps", "GB")


def _learning(h: dict) -> dict:
    return {k: v for k, v in h.items() if not any(t in k for t in TIMING)}


def test_fully_async_zero_staleness_is_sync_and_correction_is_identity(tmp_path):
    """fully_async with max_staleness 0 == sync, every learning metric bit for bit; the decoupled and the bypass
    objectives with trainer-side behaviour log-probs on fresh samples: IS weights exactly 1 / nothing rejected,
    the same step as plain PPO."""
    sync = _run(_rl_cfg(tmp_path / "sync", "rl.steps=2", "checkpoint.save_interval=0"))
    fa = _run(
        _rl_cfg(
            tmp_path / "fa", "rl.steps=2", "rl.mode=fully_async", "rl.max_staleness=0", "checkpoint.save_interval=0"
        )
    )
    assert len(sync["history"]) == len(fa["history"]) == 2
    for a, b in zip(sync["history"], fa["history"]):
        assert _learning(a) == _learning(b)
    assert sync["evals"] == fa["evals"]
    dec = _run(
        _rl_cfg(
            tmp_path / "dec",
            "rl.steps=1",
            "checkpoint.save_interval=0",
            "rl.loss_mode=decoupled",
            "rl.rollout_is=sequence",
            "rl.rollout_is_mode=mask",
        )
    )
    byp = _run(
        _rl_cfg(
            tmp_path / "byp",
            "rl.steps=1",
            "checkpoint.save_interval=0",
            "rl.loss_mode=bypass",
            "rl.rollout_is=token",
            "rl.rollout_is_mode=mask",
        )
    )
    a, b, c = sync["history"][0], dec["history"][0], byp["history"][0]
    assert b["is/is_mean"] == b["is/is_max"] == b["is/is_min"] == 1.0 and b["is/rejected_fraction"] == 0.0
    assert b["is/kl"] == 0.0
    assert c["is_weight"] > 0  # bypass: nothing rejected, weights reported
    for k in ("reward", "pg_loss", "grad_norm", "clipfrac"):
        assert math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-9), (k, a[k], b[k])
        assert math.isclose(a[k], c[k], rel_tol=1e-6, abs_tol=1e-9), (k, a[k], c[k])


def test_one_step_off_partial_rollouts_with_decoupled_weights(tmp_path):
    """One rollout queued ahead, generated one block per segment (responses of 2 blocks): the second block of a
    rollout queued at step k is generated after update k, so trajectories mix versions k and k+1 (per-token
    versions; the stitched traces validate); stale tokens get IS weights != 1 against their own behaviour
    version; the health metrics reach tensorboard."""
    run = tmp_path / "off"
    off = _run(
        _rl_cfg(
            run,
            "rl.steps=3",
            "rl.mode=one_step_off",
            "rl.partial_rollout=1",
            "rollout.max_new_tokens=8",
            "rl.loss_mode=decoupled",
            "rl.rollout_is=token",
            "rl.rollout_is_threshold=5.0",
            "checkpoint.save_interval=0",
        )
    )
    h = off["history"]
    assert [x["async/staleness_max"] for x in h] == [0.0, 1.0, 1.0]
    assert h[0]["async/mixed_version_fraction"] == 0.0  # step 0: every segment on version 0
    assert h[1]["async/mixed_version_fraction"] > 0.5 and h[2]["async/mixed_version_fraction"] > 0.5
    assert h[0]["is/is_std"] == 0.0 and h[0]["is/is_mean"] == 1.0  # fresh: identity
    assert h[1]["is/is_std"] > 0.0 and h[1]["is/kl"] != 0.0  # stale: behaviour != proximal
    assert h[1]["async/staleness_hist/1"] == 1.0
    ev = _events(str(run))
    for tag in ("is/ess", "is/chi2", "async/staleness_hist/1", "async/trainer_idle_ratio", "async/rollout_idle_ratio"):
        assert tag in ev, (tag, sorted(ev))


def test_fully_async_replay_survives_resume(tmp_path):
    """max_staleness 2, decoupled IS, D-ARL replay (k=2, warm-up 1 version), 5 steps: replayed samples up to
    ahead + k versions old are weighted with their own version's snapshot; queued rollouts, the replay buffer and
    the weight snapshots are checkpointed; 2 steps + resume + 3 steps == 5 steps straight."""
    over = (
        "rl.steps=5",
        "rl.mode=fully_async",
        "rl.max_staleness=2",
        "rl.loss_mode=decoupled",
        "rl.rollout_is=token",
        "replay.enable=true",
        "replay.k=2",
        "replay.warmup=1",
        "replay.fraction=0.5",
        "replay.level=sample",
    )
    straight = _run(_rl_cfg(tmp_path / "a", *over))
    h = straight["history"]
    assert [x["async/staleness_max"] for x in h] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert all(x["replay/replayed"] > 0 for x in h[1:])
    assert h[4]["replay/replayed_staleness_max"] >= 3  # older than the queue: snapshots kept for it
    first = _run(_rl_cfg(tmp_path / "b", *over), max_steps=2)
    assert first["step"] == 2
    resumed = _run(_rl_cfg(tmp_path / "b", *over))
    assert resumed["step"] == 5 and len(resumed["history"]) == 3
    for a, b in zip(h[2:], resumed["history"]):
        la, lb = _learning(a), _learning(b)
        assert la.keys() == lb.keys()
        for k in la:
            assert math.isclose(la[k], lb[k], rel_tol=1e-6, abs_tol=1e-9), (k, la[k], lb[k])


@pytest.mark.parametrize(
    "over,match",
    [
        (["rl.rollout_is=token"], "rl.loss_mode=decoupled"),
        (["rl.loss_mode=decoupled", "rl.behaviour_logp=engine", "algo.name=d1"], "rl.behaviour_logp=engine"),
        (
            ["rl.loss_mode=decoupled", "rl.behaviour_logp=engine", "algo.name=cj_grpo", "rollout.temperature=0.7"],
            "temperature=1",
        ),
        (["replay.enable=true"], "replay.enable"),
        (["rl.partial_rollout=1"], "rl.partial_rollout"),
        (["rl.mode=fully_async", "rl.max_staleness=0", "rl.partial_rollout=1"], "queues none"),
        (["rl.mode=one_step_off", "rl.max_staleness=0"], "max_staleness=0"),
        (["rl.mode=one_step_off", "algo.name=d_treerpo"], "dependent rounds"),
    ],
)
def test_async_config_errors(tmp_path, over, match):
    from megadare.algos import build_algorithm
    from megadare.errors import ConfigError
    from megadare.models import get_family
    from megadare.trainer.offpolicy.queue import lookahead
    from megadare.trainer.offpolicy.settings import check_correction_config

    cfg = _rl_cfg(tmp_path, *over)
    fam = get_family("sdar")
    algo = build_algorithm(cfg.algo.name, dict(cfg.algo.params))
    with pytest.raises(ConfigError, match=match):
        check_correction_config(
            cfg, algo, fam.arch(fam.tiny_config()), lookahead(cfg.offpolicy.mode, cfg.offpolicy.max_staleness)
        )
