"""benchmarks/gpu_check.py, the one-command GPU check: its runner (a failing, a hanging and a late step each become
a result, and the rest runs) and its CPU plumbing run (``--device cpu --tiny``: the same steps on tiny models)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent counts as gone
        return f.read().split()[2] != "Z"


def test_runner_records_each_failure_and_goes_on(tmp_path):
    gc = _gpu_check()
    py = sys.executable
    pidfile = tmp_path / "grandchild.pid"
    hang = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
        f"time.sleep(120)']); open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    steps = [
        gc.Step("boom", [[py, "-c", "print('dense  local 1 100'); raise SystemExit(3)"]], 30),
        gc.Step("hang", [[py, "-c", hang]], 4),
        gc.Step("after", [[py, "-c", "print('dense  sdpa 1 200')"]], 30),
    ]
    results = gc.run_all(steps, str(tmp_path), budget=100, env=dict(os.environ))
    assert [results[s]["status"] for s in ("boom", "hang", "after")] == ["fail", "timeout", "ok"]
    assert results["boom"]["rc"] == 3 and results["boom"]["rows"][0]["check"].startswith("dense  local")
    assert not _alive(int(pidfile.read_text())), "a timed-out step left a process running"
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["after"]["rows"][0]["check"] == "dense  sdpa 1 200"
    md = (tmp_path / "summary.md").read_text()
    assert "| boom | fail |" in md and "| hang | timeout |" in md and "| after | ok |" in md


def test_the_summary_title_says_the_machine_was_not_recorded_without_the_env_step():
    """A call of ``--only profile`` on an H200 once titled its summary "no GPU, torch ?": a result it never measured."""
    gc = _gpu_check()
    profile_only = {"profile": {"status": "ok", "s": 31.3, "rows": []}}
    assert gc.summary_markdown(profile_only).splitlines()[0] == (
        "# megadare GPU check: machine not recorded (the env step did not run)"
    )
    env_rows = [{"check": "gpu", "value": "NVIDIA H200"}, {"check": "import torch", "value": "2.11.0"}]
    with_env = {"env": {"status": "ok", "s": 1.0, "rows": env_rows}}
    assert gc.summary_markdown(with_env).splitlines()[0] == "# megadare GPU check: NVIDIA H200, torch 2.11.0"
    no_gpu = {"env": {"status": "ok", "s": 1.0, "rows": []}}
    assert gc.summary_markdown(no_gpu).splitlines()[0] == "# megadare GPU check: no GPU, torch ?"


def test_budget_skips_steps_that_no_longer_fit(tmp_path):
    gc = _gpu_check()
    steps = [
        gc.Step("slow", [[sys.executable, "-c", "import time; time.sleep(60)"]], 3),
        gc.Step("next", [[sys.executable, "-c", "print(1)"]], 60),
    ]
    results = gc.run_all(steps, str(tmp_path), budget=27, env=dict(os.environ))  # 22 s usable; 19 s after slow
    assert results["slow"]["status"] == "timeout" and results["next"]["status"] == "skipped"
    assert "budget left" in results["next"]["tail"][0]


def test_cpu_tiny_plumbing(tmp_path):
    """The GPU run's steps on the CPU with tiny models: versions, Megatron vs hf/ parity in fp32 and bf16, the
    attention kernels and megatron's local attention against SDPA (one family, to stay within CI's time); the
    profile with both step fusions on (models/step_fusions.py)."""
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--device",
            "cpu",
            "--tiny",
            "--only",
            "env,parity,attention,profile",
            "--profile-variant",
            "all",
            "--families",
            "sdar",
            "--out",
            str(out),
            "--budget",
            "500",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = json.loads((out / "results.json").read_text())
    assert r.returncode == 0, {k: (v["status"], v["tail"]) for k, v in results.items()}
    rows = {x["check"]: x for step in results.values() for x in step["rows"]}
    assert rows["import megatron.core"]["ok"] and rows["import megadare"]["ok"]
    for dtype in ("fp32", "bf16"):
        assert rows[f"sdar megatron sdpa {dtype} on cpu"]["ok"] is True
    assert rows["sdar megatron sdpa fp32 on cpu"]["value"] < 1e-4
    assert rows["megatron local == sdpa, train (packed x_t ++ x_0), fp32 logits"]["ok"] is True
    shares = {x["check"]: x["value"] for x in results["profile"]["rows"] if x["check"].startswith("device time")}
    assert shares["device time: matmul"] > 20 and shares["device time: attention"] > 0  # a tiny fp32 step: mm-bound
    assert "self time by kind of kernel" in (out / "profile_top_kernels.txt").read_text()
    assert results["profile"]["rows"][0]["variant"] == "all"
    md = (out / "summary.md").read_text()
    assert "| parity | ok |" in md and "## attention" in md
    assert (out / "gpu_check.log").stat().st_size > 0


def test_profile_sorts_kernels_by_kind():
    """The profile step's kinds, on kernel names an H100 / H200 profile of a train step shows."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from gpu_steps_runs import kernel_kind

    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off": "matmul",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits": "attention",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor": "optimizer",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>": (
            "loss (vocab-wide)"
        ),
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<direct_copy_kernel_cuda": "copies",
        "Memcpy DtoD (Device -> Device)": "copies",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps": "reductions",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>": "elementwise",
        "aten::mm": "matmul",
        "aten::mul": "elementwise",
        "some_triton_kernel_0": "other",
    }
    assert {n: kernel_kind(n) for n in names} == names


def test_rollout_compile_reproduces_eager_in_fp32():
    """benchmarks/rollout_compile.py (the GPU run's check that rollout.compile is the same decoder) on a CPU: the
    compiled engine's tokens and commit steps equal eager's, and the script says so in its result line (with SDPA
    held to its math kernel, the ``--sdpa`` switch the next GPU run times); and again after a weight push (which
    changed them) and a sleep / wake; with ``stop_at_eos`` the flags read a block late (CUDA's way) decode what
    reading them at once does, eager and compiled."""
    script = os.path.join(ROOT, "benchmarks", "rollout_compile.py")
    small = ["--dtype", "fp32", "--batch", "2", "--prompt", "16", "--new", "8", "--rounds", "1", "--sdpa", "math"]
    r = subprocess.run([sys.executable, script] + small, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("rollout compile fp32 on cpu, sdpa math"))
    assert "tokens equal 16/16, commit steps equal 16/16, rows identical 2/2" in line, line
    pushed = next(ln for ln in r.stdout.splitlines() if ln.startswith("rollout compile after a weight push"))
    assert pushed.count("rows identical 2/2") == 2 and "rows changed by the push 0/" not in pushed, pushed
    eos = next(ln for ln in r.stdout.splitlines() if ln.startswith("rollout compile stop at eos"))
    assert "read at once: eager 2/2 rows, compiled 2/2 rows" in eos and "; 0/2 rows stopped" not in eos, eos


def test_rollout_compile_names_an_sdpa_kernel_that_cannot_run():
    """``--sdpa efficient`` (no such kernel on a CPU; on the H200 none for the engine's grouped-KV call): one line
    naming the kernel and what to do, exit status 1, not torch's traceback; the progress line before it says how
    far the run got."""
    script = os.path.join(ROOT, "benchmarks", "rollout_compile.py")
    small = ["--dtype", "fp32", "--batch", "2", "--prompt", "16", "--new", "8", "--rounds", "1", "--sdpa", "efficient"]
    r = subprocess.run([sys.executable, script] + small, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("rollout compile: SDPA held to 'efficient' has no kernel") and "--sdpa" in last, last
    assert "model built (fp32, sdpa efficient)" in r.stderr


def test_cpu_tiny_train_variants(tmp_path):
    """The train step's command lines run on the CPU: the dense shape with the step fusions off and on
    (train_throughput.py --variants, models/step_fusions.py), one table row each, with the same gradient norm."""
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--only", "train", "--out", str(out), "--budget", "200"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    results = json.loads((out / "results.json").read_text())
    assert r.returncode == 0 and results["train"]["status"] == "ok", results["train"]
    table = [x["check"].split() for x in results["train"]["rows"] if x["check"].startswith("dense ")]
    assert [(row[1], row[2]) for row in table] == [("sdpa", "base"), ("sdpa", "all")], table
    assert all(float(row[4]) > 0 for row in table), table  # tokens/s measured, not FAILED / OOM
    base, fused = (float(row[10]) for row in table)  # the first step's gradient norm: fp32, the same rows
    assert fused == pytest.approx(base, rel=1e-4), table


def _variant_rows(shape: str, variants: list[str], batch: str = "1", *extra: str) -> list[list[str]]:
    """train_throughput.py's table rows of ``variants`` for one tiny step of ``shape`` with SDPA on this CPU."""
    tt = os.path.join(ROOT, "benchmarks", "train_throughput.py")
    args = ["--shape", shape, "--batch", batch, "--backends", "sdpa", "--seq", "64", "--steps", "1", *extra]
    r = subprocess.run(
        [sys.executable, tt, *args, "--variants", *variants], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.startswith(f"{shape} ")]
    assert [row[2] for row in rows] == variants, r.stdout
    return rows


def test_the_compiled_norm_variant_runs_compiled_norms_with_the_same_gradients():
    """``--variants fusedcnorm`` (every RMSNorm compiled, for the GPU's next measurement) is a row of its own that
    names the compiled norm and gives ``fused``'s first-step gradient norm."""
    rows = _variant_rows("dense", ["fused", "fusedcnorm"])
    assert "norm: compiled" in " ".join(rows[1]), rows[1]
    assert float(rows[1][10]) == pytest.approx(float(rows[0][10]), rel=1e-5), rows


def test_micro_batches_accumulate_into_one_step_of_the_whole_batch():
    """``--micro-batches 2`` (the next GPU call's MFU with a real run's gradient accumulation): two micro-batches of
    one row train the step that one micro-batch of both rows trains (the first step's gradient norm, fp32), and the
    row counts both micro-batches' tokens (its label ``1x2``)."""
    (whole,) = _variant_rows("dense", ["base"], "2")
    (accumulated,) = _variant_rows("dense", ["base"], "1", "--micro-batches", "2")
    assert accumulated[3] == "1x2", accumulated
    assert float(accumulated[10]) == pytest.approx(float(whole[10]), rel=1e-5), (whole, accumulated)


def test_moe_experts_benchmark_compares_the_same_math():
    """benchmarks/moe_experts.py (grouped GEMMs against megatron's SequentialMLP, for the GPU's next measurement)
    on the CPU: three contenders timed, and the grouped ones give SequentialMLP's output, input gradient and fc1
    weight gradient (fp32: to 1e-5), so a speed-up it prints is for the same layer."""
    script = os.path.join(ROOT, "benchmarks", "moe_experts.py")
    r = subprocess.run(
        [sys.executable, script, "--tokens", "128", "--rounds", "1"],
        cwd=os.path.join(ROOT, "benchmarks"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.startswith("  ")}
    assert {"sequential", "GroupedExperts", "grouped", "fc1"} <= set(rows), r.stdout
    rel = [float(v.split()[0].rstrip(",")) for ln in rows.values() for v in ln.split("rel ")[1:]]
    assert len(rel) == 7 and max(rel) < 1e-5, r.stdout


def test_cuda_check_on_a_machine_without_a_gpu_refuses_in_one_line(tmp_path, capsys):
    """`python benchmarks/gpu_check.py` on a CPU laptop ran every step for up to its 560 s budget, each failing or
    quietly taking the CPU path; it now stops at once, saying why and what to run instead."""
    import torch

    if torch.cuda.is_available() or any(n.startswith("nvidia") for n in os.listdir("/dev")):
        pytest.skip("this machine has a GPU")
    rc = _gpu_check().main(["--only", "env", "--out", str(tmp_path / "out"), "--budget", "60"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no CUDA GPU" in err[0] and "--device cpu --tiny" in err[0], err
    assert not (tmp_path / "out" / "results.json").exists()


def test_env_fails_on_a_missing_ray_only_when_the_rl_step_runs(tmp_path):
    """A training-only GPU call carries no Ray wheels (benchmarks/carry/base): its env step must not fail on
    ``import ray``; a call with the rl step must."""
    gc = _gpu_check()
    (tmp_path / "noray").mkdir()
    (tmp_path / "noray" / "ray.py").write_text("raise ImportError('ray is not carried')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "noray"), ROOT]), CUDA_VISIBLE_DEVICES="")
    rcs = {}
    for only in ("env,train", "env,rl"):
        d = str(tmp_path / only)
        args = types.SimpleNamespace(
            device="cpu", tiny=True, only=only.split(","), out=d, rows_dir=d, families="sdar", profile_variant="base"
        )
        args.timeout_scale = 1.0
        env_step = next(s for s in gc.build_steps(args, sys.executable) if s.name == "env")
        cmd = [c.replace(gc.BUDGET, "120") for c in env_step.commands[0]]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert os.path.exists(os.path.join(d, "env.json")), out.stderr[-2000:]
        rows = json.loads((tmp_path / only / "env.json").read_text())["rows"]
        ray = next(r for r in rows if r["check"] == "import ray")
        rcs[only] = (out.returncode, ray["ok"])
    assert rcs == {"env,train": (0, None), "env,rl": (1, False)}


def test_the_grouped_experts_variant_names_the_expert_forward_with_the_same_gradients():
    """``--variants grouped`` (the MoE experts through grouped GEMMs, models/experts.py, for the GPU's next
    measurement) names the expert forward that ran and gives ``base``'s first-step gradient norm (SequentialMLP)."""
    rows = _variant_rows("moe", ["base", "grouped"])
    assert "experts" not in " ".join(rows[0]) and "experts: grouped GEMMs" in " ".join(rows[1]), rows
    assert float(rows[1][10]) == pytest.approx(float(rows[0][10]), rel=1e-5), rows


def test_op_counts_attribute_a_steps_ops_to_their_sources():
    """train_throughput.py --op-counts (benchmarks/op_census.py): one bf16 step's ops by family and source, the
    printout the GPU session compares with its profile: the scored head's ``sub_`` (forward chunks and backward
    blocks), megatron DDP's gradient ``add_`` and its distributed optimizer's weight ``copy_``, torch's fused AdamW."""
    tt = os.path.join(ROOT, "benchmarks", "train_throughput.py")
    args = ["--shape", "dense", "--batch", "2", "--backends", "sdpa", "--seq", "64", "--dtype", "bf16"]
    r = subprocess.run(
        [sys.executable, tt, *args, "--op-counts", "--logits-chunk-mb", "0.25"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "dense  sdpa     base             2 ops of one step:" in out, out
    cells = [ln.split() for ln in out.splitlines() if ln[:1] not in ("", " ")]
    rows = {c[0]: int(c[1]) for c in cells if len(c) == 3 and c[1].isdigit()}  # family, ops, k elements
    assert rows["sub_"] == 8 + 16 and rows["_fused_adamw_"] == 2, out  # 8 chunks of 16 tokens, 16 blocks of 256 rows
    sources = [ln.split(None, 2) for ln in out.splitlines() if ln.startswith("    ")]
    assert ["8", "megadare/models/head.py:forward"] in [[c[0], c[2]] for c in sources], out
    assert "AccumulateGrad (megatron/core/distributed/distributed_data_parallel.py:hook)" in out, out
    assert "megatron/core/optimizer/distrib_optimizer.py:copy_group_params" in out, out
