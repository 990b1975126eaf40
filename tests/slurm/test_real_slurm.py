"""The Slurm launch scripts (examples/slurm/) submitted with `sbatch --wait` to a real Slurm on this host.

tests/slurm/run.sh starts the cluster (tests/slurm/cluster.sh: slurmctld + 2 slurmd on one host, 1 count-only GPU
each), runs this file and stops it; MEGADARE_SLURM (the cluster's state directory) switches these tests on. The
main suite skips them. Tiny random models on CPU; the knobs that make a CPU run of a 30B config (the tiny model,
fp32, one GPU per node, engines on the CPU although Ray hands them a count-only GPU, short steps) go through the scripts' environment (MODEL, EXTRA_OVERRIDES, ENGINE_CPUS, ...)
exactly as a user's would: the scripts and configs are the shipped ones.

What a single host cannot show (many hosts, real GPUs, NCCL) stays in tests/test_slurm_scripts.py (shims).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CLUSTER = os.environ.get("MEGADARE_SLURM")

pytestmark = pytest.mark.skipif(not CLUSTER, reason="needs a real Slurm: tests/slurm/run.sh starts one and runs these")

RL_TINY = (
    "model.tiny=true model.dtype=fp32 parallel.tp=1 parallel.sp=false parallel.pp=1 parallel.ep=1 "
    "parallel.etp=null train.seq_length=128 data.max_length=48 rl.prompts_per_step=2 rl.n_samples=4 "
    "rl.mini_batches=2 "  # the example configs' 4 mini-batches need 4 prompt groups a step (trainer/checks.py)
    "rl.reward=slurm_reward:parity rl.truncated_as_wrong=false rollout.engine=native "
    "rollout.max_new_tokens=8 rollout.steps_per_block=4 "
    "rollout.device=cpu"
)  # the nodes' GPUs are count-only: rollout.device=auto would (rightly) refuse them
JOB_TIMEOUT_S = 900
NEVER = ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "JobHeldAdmin")


def free_port() -> int:
    """A free port below the kernel's ephemeral range and above Ray's worker ports (10002-19999): a port bound to 0
    falls in the range where `ray start` later picks its own random ports, and one of them took the trainer's
    MASTER_PORT once (torchrun: EADDRINUSE)."""
    for port in random.Random().sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999")


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text``."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{p.name}: {cmd[:200]}")
    return found


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny HF checkpoints (SDAR-MoE, LLaDA2 with 4-token blocks), math prompts and SFT conversations."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny import write_tiny_hf

    root = tmp_path_factory.mktemp("tiny")
    math = root / "math.jsonl"
    math.write_text("".join(json.dumps({"prompt": f"What is {a}+{a}?", "answer": str(2 * a)}) + "\n" for a in range(8)))
    chat = root / "chat.jsonl"
    chat.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"{a}+{a}?"}, {"role": "assistant", "content": str(2 * a)}]}
            )
            + "\n"
            for a in range(16)
        )
    )
    return {
        "sdar_moe": write_tiny_hf(root, "sdar_moe", 0),
        "llada2": write_tiny_hf(root, "llada2", 0, block_size=4),
        "math": str(math),
        "chat": str(chat),
    }


class Job:
    """One submission of a script from the repository root, with its own run directory, Ray temp dir and ports."""

    def __init__(self, tmp: Path, script: str, nodes: int, *sbatch_args: str, **env: str):
        self.tmp, self.script, self.nodes, self.sbatch_args = tmp, script, nodes, list(sbatch_args)
        self.run_dir = tmp / "run"
        self.ray_tmp = tempfile.mkdtemp(prefix="mdray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        home = tmp / "home"  # a user who ran Ray before: ~/.ray/auth_token makes `ray start` turn on token auth
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text("0" * 64)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_", "SBATCH_"))}
        self.env.update(
            {
                "SLURM_CONF": str(Path(CLUSTER) / "etc" / "slurm.conf"),
                "HOME": str(home),
                "PYTHONPATH": f"{REPO}:{HERE}",
                "RUN_DIR": str(self.run_dir),
                "RAY_TMPDIR": self.ray_tmp,
                "RAY_PORT": str(free_port()),
                "MASTER_PORT": str(free_port()),
                "RAY_POLL_S": "2",
                "RAY_WAIT_TIMEOUT_S": "240",
                "PYTHON": "python",
            }
        )
        if sys.prefix != sys.base_prefix:  # the venv running pytest: the script's VENV knob activates it
            self.env["VENV"] = sys.prefix
        self.env.update(env)
        self.job_id = None
        self.proc = None

    def submit(self) -> None:
        cmd = [
            "sbatch",
            "--wait",
            "--parsable",
            f"--nodes={self.nodes}",
            "--gpus-per-node=1",
            "--time=30",
            f"--output={self.tmp}/slurm-%j.out",
            *self.sbatch_args,
            f"examples/slurm/{self.script}",
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline().strip()
        assert re.fullmatch(r"\d+(;\S+)?", line), (line, self.proc.stderr.read() if self.proc.poll() else "")
        self.job_id = line.split(";")[0]

    def pending_reason(self) -> str:
        r = subprocess.run(
            ["squeue", "-h", "-j", self.job_id, "-o", "%T %r"], env=self.env, capture_output=True, text=True
        )
        state, _, reason = r.stdout.strip().partition(" ")
        return reason if state == "PENDING" else ""

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> int:
        deadline = time.time() + timeout
        while self.proc.poll() is None:
            reason = self.pending_reason()
            if reason in NEVER or time.time() > deadline:
                subprocess.run(["scancel", self.job_id], env=self.env)
                self.proc.wait()
                pytest.fail(
                    f"job {self.job_id}: "
                    + (
                        f"pending with reason {reason}: it can never run here"
                        if reason in NEVER
                        else f"ran past {timeout}s"
                    )
                    + f"\n{self.output()[-4000:]}"
                )
            time.sleep(2)
        return self.proc.returncode

    def run(self) -> int:
        self.submit()
        return self.wait()

    def output(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob("slurm-*.out")))

    def starts(self) -> list[str]:
        path = self.run_dir / "slurm" / "jobs.log"
        return path.read_text().splitlines() if path.exists() else []

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def ray_left(self) -> list[str]:
        return processes_mentioning(self.ray_tmp)

    def cleanup(self) -> None:
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture
def job(tmp_path):
    made = []

    def make(script: str, nodes: int, *sbatch_args: str, **env: str) -> Job:
        (tmp_path / f"job{len(made)}").mkdir()
        made.append(Job(tmp_path / f"job{len(made)}", script, nodes, *sbatch_args, **env))
        return made[-1]

    yield make
    for j in made:
        if j.proc is not None and j.proc.poll() is None:
            subprocess.run(["scancel", j.job_id], env=j.env)
            j.proc.wait(timeout=120)
        j.cleanup()


def assert_rl_run(j: Job, steps: int, ckpt_steps: list[int]) -> None:
    out = j.output()
    n = j.nodes
    assert f"ray: {n}/{n} nodes joined" in out, out[-4000:]  # head on n1 (and a worker on n2): one cluster
    assert "trainer: 1 nodes x 1 GPUs" in out  # GPUS_PER_NODE from Slurm's SLURM_GPUS_ON_NODE
    assert sorted(p.name for p in (j.run_dir / "slurm").glob("ray-n*.log")) == [f"ray-n{i + 1}.log" for i in range(n)]
    assert f"rl done at step {steps}" in out
    assert out.rstrip().endswith("exit 0"), out[-2000:]
    m = j.metrics()
    assert [r["step"] for r in m] == list(range(1, steps + 1))  # every step once: none trained twice
    assert all(r["response_length"] > 0 and r["rollout_s"] > 0 for r in m)  # the built-in engines served
    assert any("grad_norm" in r for r in m)  # and the trainer updated
    ckpt = j.run_dir / "ckpt"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [f"iter_{s:07d}" for s in ckpt_steps]
    assert all((ckpt / f"iter_{s:07d}" / "metadata.json").exists() for s in ckpt_steps)
    assert list((j.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "ray: stopped" in out and j.ray_left() == []  # this job's Ray is gone


def test_rl_sdar30b_preempted_by_usr1_requeues_and_resumes(job, tiny):
    """rl_sdar30b.sh, tiny SDAR-MoE, 2 nodes (trainer on n1, the engine on n2): `scancel --signal=USR1 --batch`
    (what `#SBATCH --signal=B:USR1@300` sends) after the first step -> checkpoint, Ray down, `scontrol requeue`;
    Slurm restarts the job, which resumes at the next step and finishes; `sbatch --wait` returns 0."""
    j = job(
        "rl_sdar30b.sh",
        2,
        MODEL=tiny["sdar_moe"],
        DATA=tiny["math"],
        ROLLOUT_NODES="1",
        ENGINE_GPUS="1",
        ENGINE_CPUS="1",
        EXTRA_OVERRIDES=f"{RL_TINY} rl.steps=4",
    )
    j.submit()
    deadline = time.time() + JOB_TIMEOUT_S
    while not j.metrics():
        assert j.proc.poll() is None, j.output()[-4000:]
        assert time.time() < deadline, j.output()[-4000:]
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", j.job_id], env=j.env, check=True)
    assert j.wait() == 0, j.output()[-6000:]
    out = j.output()
    first, second = out.split("exit 0", 1)
    assert "caught SIGUSR1" in first and f"requeued job {j.job_id}" in first
    stopped = int(re.search(r"rl stopped by signal at step (\d+)", first).group(1))
    assert 1 <= stopped < 4, first[-3000:]
    assert [line.split(" on ")[0][20:] for line in j.starts()] == [
        f"job {j.job_id} restart 0",
        f"job {j.job_id} restart 1",
    ]
    assert "rl done at step 4" in second and "caught SIG" not in second
    assert_rl_run(j, 4, [stopped, 4])  # the stop's checkpoint and the last (save_interval 10, keep_last 2)


def test_rl_llada2_mini_colocated_leaves_other_ray_processes_alone(job, tiny, tmp_path):
    """rl_llada2_mini.sh, tiny LLaDA2, 1 node, ROLLOUT_NODES=0 (the engine on the trainer's GPU): 2 RL steps end
    to end. A process named `raylet` that is not the job's (another Ray on the node) survives the job's teardown
    (`ray stop` would have killed it)."""
    bystander_bin = tmp_path / "raylet"
    shutil.copy("/bin/sleep", bystander_bin)
    bystander = subprocess.Popen([str(bystander_bin), "900"])
    try:
        j = job(
            "rl_llada2_mini.sh",
            1,
            MODEL=tiny["llada2"],
            DATA=tiny["math"],
            ROLLOUT_NODES="0",
            ENGINE_GPUS="1",
            ENGINE_CPUS="1",
            EXTRA_OVERRIDES=f"{RL_TINY} rl.steps=2",
        )
        assert j.run() == 0, j.output()[-6000:]
        assert len(j.starts()) == 1
        assert_rl_run(j, 2, [2])
        assert bystander.poll() is None, "the job's Ray teardown killed another Ray process on the node"
    finally:
        bystander.kill()
        bystander.wait()


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """convert_hf_to_megatron.sh: the tiny SDAR-MoE to a Megatron checkpoint validated for EP 2."""
    tmp = tmp_path_factory.mktemp("convert")
    out = tmp / "mcore"
    # the script asks for 16 CPUs (--cpus-per-task): these nodes have 2, so the job would pend forever with reason
    # PartitionConfig; a user with small nodes passes -c as well
    j = Job(
        tmp,
        "convert_hf_to_megatron.sh",
        1,
        "--cpus-per-task=2",
        MODEL=tiny["sdar_moe"],
        OUT=str(out),
        TP="1",
        PP="1",
        EP="2",
        ETP="1",
    )
    try:
        rc = j.run()
    finally:
        j.cleanup()
    return j, rc, out


def test_convert_hf_to_megatron_round_trips(converted, tiny, tmp_path):
    import torch

    from megadare.convert.hf_megatron import megatron_to_hf
    from megadare.models.safetensors_io import SafetensorsReader

    j, rc, out = converted
    assert rc == 0, j.output()[-4000:]
    assert (out / "metadata.json").exists() and "converter exited with 0" in j.output()
    back = megatron_to_hf(str(out), str(tmp_path / "back"), progress=False)
    a, b = dict(SafetensorsReader(tiny["sdar_moe"]).items()), dict(SafetensorsReader(back).items())
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sft_sdar_two_nodes_from_the_converted_checkpoint(job, tiny, converted):
    """sft_sdar.sh on 2 nodes x 1 GPU: one torchrun per node (node ranks from SLURMD_NODENAME), world 2, EP 2,
    starting from the converted checkpoint (INIT_CKPT)."""
    _, rc, ckpt = converted
    assert rc == 0, "the conversion failed (test_convert_hf_to_megatron_round_trips)"
    j = job(
        "sft_sdar.sh",
        2,
        MODEL=tiny["sdar_moe"],
        DATA=tiny["chat"],
        INIT_CKPT=str(ckpt),
        EXTRA_OVERRIDES="model.tiny=true model.dtype=fp32 parallel.tp=1 parallel.sp=false parallel.pp=1 "
        "parallel.ep=2 parallel.etp=1 train.steps=3 train.global_batch_size=4 "
        "train.seq_length=128 train.warmup_steps=1 data.max_length=48",
    )
    assert j.run() == 0, j.output()[-6000:]
    out = j.output()
    assert "trainer: 2 nodes x 1 GPUs" in out and "sft done at step 3" in out
    assert [r["step"] for r in j.metrics()] == [1, 2, 3]
    state = json.loads((j.run_dir / "ckpt" / "iter_0000003" / "train_state.json").read_text())
    assert state["world_size"] == 2
    assert list((j.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "ray:" not in out  # SFT starts no Ray


def test_bad_config_fails_in_the_preflight(job, tiny):
    """A layout the model cannot take fails in `megadare rl --dry-run`, naming the key, before Ray or torchrun."""
    j = job(
        "rl_llada2_mini.sh",
        1,
        MODEL=tiny["llada2"],
        DATA=tiny["math"],
        ROLLOUT_NODES="0",
        ENGINE_GPUS="1",
        ENGINE_CPUS="1",
        EXTRA_OVERRIDES=f"{RL_TINY} parallel.ep=3",
    )
    assert j.run() == 1
    out = j.output()
    assert "parallel.ep=3: model has 8 experts, not divisible by 3" in out, out[-3000:]
    assert "megadare rl --dry-run rejected the config" in out
    assert "ray:" not in out and "trainer:" not in out
    assert not list((j.run_dir / "slurm").glob("ray-*.log")) and not (j.run_dir / "ckpt").exists()
    assert j.ray_left() == []


def test_a_taken_master_port_fails_in_one_line_after_ray_is_up(job, tiny):
    """A process listening on MASTER_PORT (Ray's random ports can land there) ends the job in one line naming the
    knob, before torchrun's traceback, and the job's Ray is stopped."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        j = job(
            "rl_llada2_mini.sh",
            1,
            MODEL=tiny["llada2"],
            DATA=tiny["math"],
            ROLLOUT_NODES="0",
            ENGINE_GPUS="1",
            ENGINE_CPUS="1",
            MASTER_PORT=str(port),
            EXTRA_OVERRIDES=f"{RL_TINY} rl.steps=1",
        )
        assert j.run() == 1
    out = j.output()
    assert f"error: MASTER_PORT={port} is taken on " in out, out[-3000:]
    assert "Traceback" not in out and "trainer:" not in out
    assert "ray: stopped" in out and j.ray_left() == []
