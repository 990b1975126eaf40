"""A fake Slurm allocation for the launch scripts' tests (tests/test_slurm_scripts.py): fake srun / ray /
torchrun / scontrol / python on PATH that append one JSON line per call to a log (see that file's docstring for
how each behaves), the ``Cluster`` that sets them up, and the HF model directories the scripts are given."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "examples" / "slurm"
HF = {"sdar30b": "SDAR-30B-A3B", "llada2_mini": "LLaDA2.0-mini", "llada2_flash": "LLaDA2.0-flash"}

FAKES = r"""
import json, os, signal, subprocess, sys, time

LOG, STATE = os.environ["FAKE_LOG"], os.environ["FAKE_STATE"]
HOSTS = os.environ["FAKE_HOSTS"].split(",")
HOST = os.environ.get("SLURMD_NODENAME", "batch")
TOOL = os.path.basename(sys.argv[0])
ARGS = sys.argv[1:]
NODES = os.path.join(STATE, "ray_nodes")


def log(**kw):
    kw.setdefault("tool", TOOL)
    kw.setdefault("host", HOST)
    kw["t"] = time.time()
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(kw) + "\n").encode())
    finally:
        os.close(fd)


def rc_of(r):
    return r if r >= 0 else 128 - r


def srun():
    opts, i = {}, 0
    while i < len(ARGS) and ARGS[i].startswith("-"):
        a = ARGS[i]
        if a in ("-w", "-N", "-n", "-c", "-J"):
            opts[a] = ARGS[i + 1]
            i += 2
            continue
        k, _, v = a.partition("=")
        opts[k] = v
        i += 1
    cmd = ARGS[i:]
    nodelist = opts.get("--nodelist") or opts.get("-w")
    n = int(opts.get("--nodes") or opts.get("-N") or len(HOSTS))
    nodes = nodelist.split(",") if nodelist else HOSTS[:n]
    assert len(nodes) == n, (nodes, n)
    log(opts=opts, cmd=cmd, nodes=nodes)
    procs = []

    def forward(sig, frame):
        log(event="forward", signal=signal.Signals(sig).name)
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass

    def kill(sig, frame):  # the real srun: SIGTERM / 2x SIGINT -> SIGKILL to the step
        log(event="kill", signal=signal.Signals(sig).name)
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    for s in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, forward)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, kill)
    for k, h in enumerate(nodes):
        env = dict(os.environ, SLURMD_NODENAME=h, SLURM_NODEID=str(k), SLURM_PROCID=str(k),
                   SLURM_STEP_NODELIST=",".join(nodes))
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, cwd=opts.get("--chdir")))
    sys.exit(max(rc_of(p.wait()) for p in procs))


def ray():
    sub = ARGS[0]
    mine = os.path.join(NODES, HOST)
    if sub == "start":
        log(argv=ARGS)
        opt = dict(a.partition("=")[::2] for a in ARGS if a.startswith("--"))
        if "--head" in ARGS:
            with open(os.path.join(STATE, "ray_head"), "w") as f:
                f.write(f"{opt['--node-ip-address']}:{opt['--port']}")
        else:
            with open(os.path.join(STATE, "ray_head")) as f:
                if f.read() != opt["--address"]:
                    print("ray: cannot reach the GCS at", opt["--address"], file=sys.stderr)
                    sys.exit(1)
        hang = HOST in os.environ.get("FAKE_RAY_HANG", "").split(",")
        if not hang:
            os.makedirs(NODES, exist_ok=True)
            with open(mine, "w") as f:
                json.dump({"gpus": int(opt["--num-gpus"])}, f)
        if "--block" in ARGS:
            stop = []
            signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
            end = time.time() + 60
            while not stop and time.time() < end:
                time.sleep(0.05)
            log(event="ray-stopped", by="SIGTERM" if stop else "timeout",
                usr2_ignored=signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN)
            if os.path.exists(mine):
                os.remove(mine)
            sys.exit(1 if stop else 0)
        return
    if sub == "stop":
        log(argv=ARGS)
        return
    if sub == "status":
        log(argv=ARGS)
        head = os.path.join(STATE, "ray_head")
        addr = [a.partition("=")[2] for a in ARGS if a.startswith("--address=")]
        if not os.path.exists(head) or open(head).read() != (addr[0] if addr else ""):
            print("ConnectionError: could not find any running Ray instance", file=sys.stderr)
            sys.exit(1)
        nodes = sorted(os.listdir(NODES)) if os.path.isdir(NODES) else []
        gpus = sum(json.load(open(os.path.join(NODES, n)))["gpus"] for n in nodes)
        lines = ["======== Autoscaler status: 2025-01-01 00:00:00 ========", "Node status",
                 "-" * 40, "Active:"]
        lines += [f" 1 node_{abs(hash(n)):x}" for n in nodes[:1]] or [" (no active nodes)"]
        lines += ["Idle:"] + [f" 1 node_{abs(hash(n)):x}" for n in nodes[1:]]
        lines += ["Pending:", " (no pending nodes)", "Recent failures:", " 1 node_deadbeef", "", "Resources",
                  "-" * 40, "Usage:", f" 0.0/{float(gpus)} GPU", "", "Demands:", " (no resource demands)"]
        print("\n".join(lines))
        return
    sys.exit(f"fake ray: {ARGS}")


def torchrun():
    watched = ("RAY_ADDRESS", "NCCL_DEBUG", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
               "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "CUDA_DEVICE_MAX_CONNECTIONS")
    log(argv=ARGS, env={k: os.environ.get(k) for k in watched},
        usr2_ignored=signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN)
    rank = subprocess.Popen([sys.executable, __file__, "__rank__"])

    def term(sig, frame):  # real torchrun forwards SIGTERM to its ranks (and SIGKILLs them later)
        log(event="torchrun-got-TERM")
        rank.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, term)
    sys.exit(rc_of(rank.wait()))


def rank():
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    log(tool="rank", event="ready", usr2_ignored=signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN)
    end = time.time() + float(os.environ.get("FAKE_TRAIN_S", "0"))
    while not got and time.time() < end:
        time.sleep(0.05)
    if got:
        log(tool="rank", event="TERM")
        time.sleep(0.2)  # the final checkpoint
        log(tool="rank", event="checkpointed")
    else:
        log(tool="rank", event="trained-out")  # FAKE_TRAIN_S over without a stop request
    sys.exit(0)


def scontrol():
    if ARGS[:2] == ["show", "hostnames"]:
        print("\n".join(HOSTS))
        return
    log(argv=ARGS)


def hostname():
    if any(a in ("--ip-address", "-i", "-I") for a in ARGS):
        print(f"10.0.0.{HOSTS.index(HOST) + 1} fe80::1")
    else:
        print(HOST)


def python():  # stands in for the converter's python
    log(argv=ARGS)


def other():
    log(argv=ARGS)


if ARGS[:1] == ["__rank__"]:
    rank()
else:
    {"srun": srun, "ray": ray, "torchrun": torchrun, "scontrol": scontrol, "hostname": hostname,
     "fakepython": python}.get(TOOL, other)()
"""

HF_FALLBACK = {  # only used when examples/configs/hf/<model>/config.json is missing
    "sdar30b": {
        "architectures": ["SDARMoeForCausalLM"],
        "model_type": "sdar_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "llada2_mini": {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "vocab_size": 157184,
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "moe_intermediate_size": 512,
        "num_hidden_layers": 20,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 256,
        "num_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-6,
        "rope_theta": 600000,
    },
    "llada2_flash": {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "vocab_size": 157184,
        "hidden_size": 4096,
        "intermediate_size": 9216,
        "moe_intermediate_size": 1024,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 256,
        "num_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-6,
        "rope_theta": 600000,
    },
}


def model_dir(tmp_path: Path, name: str) -> str:
    shipped = REPO / "examples" / "configs" / "hf" / HF[name]
    if (shipped / "config.json").is_file():
        return str(shipped)
    d = tmp_path / "hf" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(HF_FALLBACK[name]))
    return str(d)


class Cluster:
    """Fake tools on PATH, a fake allocation of ``nodes`` hosts, and the call log."""

    def __init__(self, tmp_path: Path, nodes: int, model: str, **env: str):
        self.tmp = tmp_path
        self.hosts = [f"gpu{i + 1:02d}" for i in range(nodes)]
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        fakes = bin_dir / "fakes.py"
        fakes.write_text(f"#!{sys.executable}\n{FAKES}")
        fakes.chmod(0o755)
        for tool in ("srun", "sbatch", "scontrol", "ray", "torchrun", "hostname", "fakepython"):
            (bin_dir / tool).symlink_to(fakes)
        (tmp_path / "state").mkdir()
        self.log_path = tmp_path / "calls.jsonl"
        data = tmp_path / "data.jsonl"
        data.write_text('{"prompt": "1+1?", "answer": "2", "messages": [{"role": "user", "content": "hi"}]}\n')
        self.model = model_dir(tmp_path, model)
        self.data = str(data)
        self.run_dir = str(tmp_path / "run")
        self.env = {
            "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
            "HOME": os.environ.get("HOME", str(tmp_path)),
            "LANG": "C.UTF-8",
            "FAKE_LOG": str(self.log_path),
            "FAKE_STATE": str(tmp_path / "state"),
            "FAKE_HOSTS": ",".join(self.hosts),
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": f"gpu[01-{nodes:02d}]",
            "SLURM_NNODES": str(nodes),
            "SLURM_GPUS_ON_NODE": "8",
            "SLURM_CPUS_ON_NODE": "16",
            "SLURM_SUBMIT_DIR": str(REPO),
            "MODEL": self.model,
            "DATA": self.data,
            "RUN_DIR": self.run_dir,
            "RAY_POLL_S": "0.1",
            "PYTHON": sys.executable,
            "PREFLIGHT": "0",
        }
        self.env.update(env)

    def start(self, script: str) -> subprocess.Popen:
        self.out = open(self.tmp / "out.txt", "w")
        return subprocess.Popen(
            ["bash", str(SLURM / script)],
            cwd=REPO,
            env=self.env,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def run(self, script: str, timeout: float = 40) -> int:
        p = self.start(script)
        try:
            return p.wait(timeout=timeout)
        finally:
            self.stop(p)

    def stop(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        self.out.close()

    def output(self) -> str:
        return (self.tmp / "out.txt").read_text()

    def calls(self, tool: str | None = None, **match) -> list[dict]:
        if not self.log_path.exists():
            return []
        rows = [json.loads(line) for line in self.log_path.read_text().splitlines()]
        return [r for r in rows if (tool is None or r["tool"] == tool) and all(r.get(k) == v for k, v in match.items())]

    def steps(self, *prefix: str) -> list[dict]:
        """srun calls whose command starts with ``prefix`` (after `bash common.sh node-run`, the node wrapper)."""
        out = []
        for r in self.calls("srun"):
            cmd = r.get("cmd", [])
            if cmd[1:3] == [str(SLURM / "common.sh"), "node-run"]:
                cmd = cmd[3:]
            if tuple(cmd[: len(prefix)]) == prefix:
                out.append(r)
        return out

    def ray_teardown_ok(self) -> float:
        """Every node's Ray was stopped by SIGTERM to its `ray start --block` (SIGUSR2 ignored, so only the wrapper
        acted on srun's forward), `ray stop` never ran and no step was killed; the time of the last stop."""
        stopped = self.calls("ray", event="ray-stopped")
        assert sorted(s["host"] for s in stopped) == sorted(self.hosts), stopped
        assert all(s["by"] == "SIGTERM" and s["usr2_ignored"] for s in stopped), stopped
        assert self.calls("ray", argv=["stop"]) == [] and self.calls("ray", argv=["stop", "--force"]) == []
        assert self.calls("srun", event="kill") == []
        return max(s["t"] for s in stopped)


def opt(argv: list[str], name: str) -> str:
    vals = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    assert len(vals) == 1, (name, argv)
    return vals[0]
