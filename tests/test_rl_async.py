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

from test_rl_loop import _events, _rl_cfg, _run, ray_cluster  # noqa: F401  (module-scoped Ray fixture)

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("ray_cluster")]

TIMING = ("time", "_s", "wait", "idle", "busy", "gbps", "GB")


def _learning(h: dict) -> dict:
    return {k: v for k, v in h.items() if not any(t in k for t in TIMING)}


def test_fully_async_with_zero_staleness_is_the_sync_loop(tmp_path):
    sync = _run(_rl_cfg(tmp_path / "sync", "rl.steps=2", "checkpoint.save_interval=0"))
    fa = _run(_rl_cfg(tmp_path / "fa", "rl.steps=2", "rl.mode=fully_async", "rl.max_staleness=0",
                      "checkpoint.save_interval=0"))
    assert len(sync["history"]) == len(fa["history"]) == 2
    for a, b in zip(sync["history"], fa["history"]):
        assert _learning(a) == _learning(b)                         # every learning metric, bit for bit
    assert sync["evals"] == fa["evals"]


def test_decoupled_correction_is_the_identity_without_staleness(tmp_path):
    ppo = _run(_rl_cfg(tmp_path / "ppo", "rl.steps=1", "checkpoint.save_interval=0"))
    dec = _run(_rl_cfg(tmp_path / "dec", "rl.steps=1", "checkpoint.save_interval=0", "rl.loss_mode=decoupled",
                       "rl.rollout_is=sequence", "rl.rollout_is_mode=mask"))
    a, b = ppo["history"][0], dec["history"][0]
    assert b["is/is_mean"] == b["is/is_max"] == b["is/is_min"] == 1.0 and b["is/rejected_fraction"] == 0.0
    assert b["is/kl"] == 0.0
    for k in ("reward", "pg_loss", "grad_norm", "clipfrac"):
        assert math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-9), (k, a[k], b[k])


def test_one_step_off_decoupled_weights_stale_samples(tmp_path):
    run = tmp_path / "off"
    off = _run(_rl_cfg(run, "rl.steps=3", "rl.mode=one_step_off", "checkpoint.save_interval=0",
                       "rl.loss_mode=decoupled", "rl.rollout_is=token", "rl.rollout_is_threshold=5.0"))
    h = off["history"]
    assert [x["async/staleness_max"] for x in h] == [0.0, 1.0, 1.0]
    assert h[0]["is/is_std"] == 0.0 and h[0]["is/is_mean"] == 1.0    # fresh: identity
    assert h[1]["is/is_std"] > 0.0 and h[1]["is/kl"] != 0.0            # stale: behaviour != proximal
    assert h[1]["async/staleness_hist/1"] == 1.0
    ev = _events(str(run))
    for tag in ("is/ess", "is/chi2", "async/staleness_hist/1", "async/trainer_idle_ratio",
                "async/rollout_idle_ratio"):
        assert tag in ev, (tag, sorted(ev))


def test_fully_async_replay_survives_resume(tmp_path):
    """max_staleness 2, decoupled IS, D-ARL replay (k=2, warm-up 1 version): queued rollouts, the replay buffer
    and the weight snapshots are checkpointed; the resumed run continues exactly."""
    over = ("rl.steps=3", "rl.mode=fully_async", "rl.max_staleness=2", "rl.loss_mode=decoupled",
            "rl.rollout_is=token", "replay.enable=true", "replay.k=2", "replay.warmup=1", "replay.fraction=0.5",
            "replay.level=sample")
    straight = _run(_rl_cfg(tmp_path / "a", *over))
    h = straight["history"]
    assert [x["async/staleness_max"] for x in h] == [0.0, 1.0, 2.0]
    assert h[1]["replay/replayed"] > 0 and h[2]["replay/replayed"] > 0
    first = _run(_rl_cfg(tmp_path / "b", *over), max_steps=1)
    assert first["step"] == 1
    resumed = _run(_rl_cfg(tmp_path / "b", *over))
    assert resumed["step"] == 3 and len(resumed["history"]) == 2
    for a, b in zip(h[1:], resumed["history"]):
        la, lb = _learning(a), _learning(b)
        assert la.keys() == lb.keys()
        for k in la:
            assert math.isclose(la[k], lb[k], rel_tol=1e-6, abs_tol=1e-9), (k, la[k], lb[k])


def test_partial_rollouts_continue_on_new_weights(tmp_path):
    """Responses of 2 blocks generated one block per segment, one rollout queued ahead: the second block of a
    rollout queued at step k is generated after update k, so trajectories mix versions k and k+1 (per-token
    versions), the stitched traces are valid, and the decoupled loss takes each token's own behaviour version."""
    run = _run(_rl_cfg(tmp_path / "p", "rl.steps=3", "rl.mode=one_step_off", "rl.partial_rollout=1",
                       "rollout.max_new_tokens=8", "rl.loss_mode=decoupled", "rl.rollout_is=token",
                       "checkpoint.save_interval=0"))
    h = run["history"]
    assert h[0]["async/mixed_version_fraction"] == 0.0                  # step 0: every segment on version 0
    assert h[1]["async/mixed_version_fraction"] > 0.5 and h[2]["async/mixed_version_fraction"] > 0.5
    assert [x["async/staleness_max"] for x in h] == [0.0, 1.0, 1.0]
    assert h[1]["is/is_std"] > 0.0


def test_async_config_errors(tmp_path):
    with pytest.raises(Exception, match="rl.loss_mode=decoupled"):
        _run(_rl_cfg(tmp_path / "x", "rl.rollout_is=token"))
    with pytest.raises(Exception, match="rl.behaviour_logp=engine"):
        _run(_rl_cfg(tmp_path / "y", "rl.loss_mode=decoupled", "rl.behaviour_logp=engine",
                     "algo.name=d1"))
    with pytest.raises(Exception, match="rl.partial_rollout"):
        _run(_rl_cfg(tmp_path / "w", "rl.partial_rollout=1"))
    with pytest.raises(Exception, match="replay.enable"):
        _run(_rl_cfg(tmp_path / "z", "replay.enable=true"))
