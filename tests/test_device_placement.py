"""Device placement on a GPU, checked on the CPU (issue 23): every tensor where CUDA wants it.

tests/device_standin.py gives one spawned process a stand-in GPU: ``torch.cuda.is_available()`` is True, CUDA
device arguments mean a device whose tensors report ``meta`` but hold real CPU values, and an op that mixes such a
tensor with a CPU tensor raises as CUDA would. Under it, for every family (SDAR, SDAR-MoE, LLaDA, LLaDA2, Dream):

* the Megatron model chunks ``build_model_chunks`` returns hold every parameter and buffer on the GPU (megatron
  creates most there; our RMSNorm and the MoE router weight started on the CPU: issue item 3);
* ``forward_logits`` takes the callers' CPU ``input_ids`` (and makes its default positions) on the model's device
  (item 4), and its logits equal the hf/ reference model's on the CPU;
* the hf/ model (the built-in engine's model) runs a forward on the GPU (RoPE's ``inv_freq`` was made on the CPU:
  item 1) and the built-in engine generates on it;
and, for a dense and a MoE family, one ``train_step`` (loss, backward, distributed optimizer) on the GPU gives the
loss and gradient norm of the same step on the CPU, a value head attaches on the GPU, and a weight sync moves the
trainer's weights into an engine on the GPU (its logits then equal the trainer's).

Also here: megatron-core's MoE router without Transformer Engine and without the CPU layer (item 2), the
FlexAttention block masks and compile count across micro-batches (item 6), and the colocated CUDA IPC path's
device index and synchronisation (item 5; the transport choice is in tests/test_weight_sync.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback

import pytest
import torch

from dist import run_distributed
from tiny import write_tiny_hf

FAMILIES = ["sdar", "sdar_moe", "llada", "llada2", "dream"]
TRAINED = ["sdar", "llada2"]  # one dense, one MoE (sigmoid router, expert bias, shared expert)


def _error(e: BaseException) -> str:
    """The error and the innermost frame of megadare / megatron / torch.nn that raised it."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "megadare" in f.filename or "megatron" in f.filename]
    at = f" at {frames[-1].filename.rsplit('site-packages/', 1)[-1]}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {str(e)[:300]}{at}"


def _record(out: dict, key: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        out[key] = {"ok": True, "value": fn()}
    except Exception as e:  # noqa: BLE001 - reported per case to the parent
        out[key] = {"ok": False, "error": _error(e)}
    out[key]["s"] = round(time.perf_counter() - t0, 2)


def _megatron_cases(out: dict, name: str, hf_dir: str, ids: torch.Tensor, ref: torch.Tensor) -> None:
    from megadare.convert.hf_megatron import load_hf_into_model
    from megadare.models import gpt
    from megadare.models.attention import family_mask
    from megadare.models.family import family_of, read_hf_config
    from megadare.trainer.forward import forward_logits

    from device_standin import cpu_tensors

    cfg = read_hf_config(hf_dir)
    arch = family_of(cfg).arch(cfg)
    chunks = gpt.build_model_chunks(arch, gpt.transformer_config(arch), attention_backend="sdpa")
    _record(out, f"{name}/megatron params on GPU", lambda: cpu_tensors(chunks[0]))
    for c in chunks:
        c.cuda()  # as megatron's trainer does: the next case sees inputs only
    load_hf_into_model(chunks, hf_dir)
    _record(
        out,
        f"{name}/forward_logits CPU inputs",
        lambda: float((forward_logits(chunks, ids, arch.vocab_size, family_mask(arch)).cpu() - ref).abs().max()),
    )


def _hf_cases(out: dict, name: str, hf_dir: str, ids: torch.Tensor, ref: torch.Tensor) -> None:
    from megadare.models import load_hf_model
    from megadare.models.attention import family_mask
    from megadare.models.family import family_of, read_hf_config
    from megadare.rollout.engine import SamplingParams
    from megadare.rollout.native import NativeEngine

    cfg = read_hf_config(hf_dir)
    arch = family_of(cfg).arch(cfg)
    S = ids.shape[1]

    def hf_forward():
        model = load_hf_model(hf_dir, device="cuda")
        with torch.no_grad():
            got = model(ids.to("cuda"), attention_mask=family_mask(arch).dense(S, S, device="cuda"))
        return float((got.cpu() - ref).abs().max())

    def engine_step():
        engine = NativeEngine(load_hf_model(hf_dir), arch, eos_token_id=arch.vocab_size - 3, device="cuda")
        params = SamplingParams(max_new_tokens=4, block_size=4, steps_per_block=2, temperature=1.0, stop_at_eos=False)
        return [len(t.response_ids) for t in engine.generate([[5, 6, 7]], params)]

    _record(out, f"{name}/hf forward on GPU", hf_forward)
    _record(out, f"{name}/engine step on GPU", engine_step)


def _train_step(hf_dir: str) -> dict:
    """One SFT-style train_step of the checkpoint's Megatron model (loss, backward, distributed optimizer)."""
    from dist import random_step, tiny_trainer

    torch.manual_seed(0)
    _, model, opt, sched, arch, _ = tiny_trainer({}, hf_dir, lr=1e-3)
    report = random_step(model, opt, sched, arch)
    return {k: report[k] for k in ("loss", "grad_norm")}


def _trainer_cases(out: dict, name: str, hf_dir: str) -> None:
    from megadare.algos.value_model import attach_value_head
    from megadare.models import gpt, load_hf_model
    from megadare.models.attention import family_mask
    from megadare.models.family import family_of, read_hf_config
    from megadare.rollout.native import NativeEngine
    from megadare.rollout.weight_sync.sync import SyncSettings, WeightSync
    from megadare.trainer.forward import forward_logits

    from device_standin import cpu_tensors

    cfg = read_hf_config(hf_dir)
    fam = family_of(cfg)
    arch = fam.arch(cfg)
    _record(out, f"{name}/train_step on GPU", lambda: _train_step(hf_dir))

    def value_head():
        chunks = gpt.build_model_chunks(arch, gpt.transformer_config(arch), attention_backend="sdpa")
        attach_value_head(chunks)
        return cpu_tensors(chunks[0])

    def weight_sync():
        chunks = gpt.build_model_chunks(arch, gpt.transformer_config(arch), attention_backend="sdpa")
        # float32: compared with the float32 trainer at 1e-4 (the engine's own default on CUDA is bfloat16)
        engine = NativeEngine(
            load_hf_model(hf_dir), arch, eos_token_id=arch.vocab_size - 3, device="cuda", dtype=torch.float32
        )
        sync = WeightSync(chunks, fam.mapping(cfg), [engine], SyncSettings(transport="object_store"))
        sync.push(1)
        ids = torch.randint(0, arch.vocab_size - 3, (1, 8), generator=torch.Generator().manual_seed(1))
        trainer = forward_logits(chunks, ids, arch.vocab_size, family_mask(arch)).cpu()
        return float((engine.logits(ids) - trainer).abs().max())  # a fresh random model: not the checkpoint's

    _record(out, f"{name}/value head on GPU", value_head)
    _record(out, f"{name}/weight sync into a GPU engine", weight_sync)


def _worker(rank: int, world: int, ckpts: dict) -> dict:
    from megadare.models.attention import family_mask
    from megadare.models import load_hf_model
    from megadare.parallel import destroy_distributed, init_distributed

    from device_standin import standin_gpu

    init_distributed()
    out: dict = {}
    try:
        for name in TRAINED:  # first: megatron keeps some tensors in globals (the MoE aux-loss scale)
            _record(out, f"{name}/train_step on CPU", lambda: _train_step(ckpts[name]))
        for name, hf_dir in ckpts.items():
            model = load_hf_model(hf_dir)
            arch = model.arch
            ids = torch.randint(0, arch.vocab_size - 3, (2, 8), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                ref = model(ids, attention_mask=family_mask(arch).dense(8, 8))
            with standin_gpu():
                _megatron_cases(out, name, hf_dir, ids, ref)
                _hf_cases(out, name, hf_dir, ids, ref)
                if name in TRAINED:
                    _trainer_cases(out, name, hf_dir)
    finally:
        destroy_distributed()
    return out


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    ckpts = {}
    for i, name in enumerate(FAMILIES):
        over = {"block_size": 4} if name in ("sdar", "sdar_moe", "llada2") else {}
        ckpts[name] = write_tiny_hf(root, name, 40 + i, **over)
    return run_distributed(_worker, 1, ckpts, timeout_s=600)[0]


def _ok(placed: dict, key: str):
    r = placed[key]
    assert r["ok"], f"{key}: {r['error']}"
    return r["value"]


@pytest.mark.parametrize("name", FAMILIES)
def test_megatron_chunks_live_on_the_gpu(placed, name):
    assert _ok(placed, f"{name}/megatron params on GPU") == [], "parameters / buffers left on the CPU"


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_logits_moves_cpu_inputs_to_the_model(placed, name):
    assert _ok(placed, f"{name}/forward_logits CPU inputs") < 1e-4  # vs the hf/ model on the CPU, fp32


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_model_and_engine_run_on_the_gpu(placed, name):
    assert _ok(placed, f"{name}/hf forward on GPU") < 1e-5  # the same model on the CPU
    assert _ok(placed, f"{name}/engine step on GPU") == [4]


@pytest.mark.parametrize("name", TRAINED)
def test_train_step_value_head_and_weight_sync_on_the_gpu(placed, name):
    gpu, cpu = _ok(placed, f"{name}/train_step on GPU"), _ok(placed, f"{name}/train_step on CPU")
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=1e-5) and gpu["grad_norm"] > 0
    assert gpu["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=1e-4)
    assert _ok(placed, f"{name}/value head on GPU") == []
    assert _ok(placed, f"{name}/weight sync into a GPU engine") < 1e-4


def test_standin_catches_a_cpu_tensor_meeting_the_gpu():
    """The stand-in itself: the errors CUDA raises are raised, what CUDA accepts is accepted."""
    from device_standin import Mismatch, OnDevice, standin_gpu

    with standin_gpu():
        x = torch.randn(3, 4, device="cuda")
        assert isinstance(x, OnDevice) and x.device.type == "meta"
        with pytest.raises(Mismatch, match="aten.mul.Tensor"):
            x * torch.ones(4)
        with pytest.raises(Mismatch, match="aten.embedding"):
            torch.nn.functional.embedding(torch.zeros(2, dtype=torch.long), x)
        with pytest.raises(Mismatch, match="Generator"):
            torch.rand(3, device="cuda", generator=torch.Generator().manual_seed(0))
        y = x * torch.tensor(2.0) + x[torch.tensor([0, 2])].sum()  # CPU scalars and CPU indices are fine
        assert torch.equal(y.cpu(), x.cpu() * 2 + x.cpu()[[0, 2]].sum())
        assert type(x.cpu()) is torch.Tensor and (x > 0).sum().item() == int((x.cpu() > 0).sum())


# ---------------------------------------------------------------------------------------------- item 2
_ROUTER_WITHOUT_CPU_LAYER = """
import torch
import megadare.models.gpt  # applies models/mcore_fixes.py, as every model build does
from megadare.parallel import cpu
from megatron.core.transformer.moe.moe_utils import router_gating_linear
assert not cpu.is_installed()
x, w = torch.randn(5, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
out = router_gating_linear(x, w, None, torch.float32)
out.sum().backward()
assert torch.allclose(out, x @ w.t(), atol=1e-6) and w.grad is not None
print("ROUTER_OK")
"""


def test_moe_router_runs_without_transformer_engine_or_the_cpu_layer():
    """megatron-core 0.16.1 reads ``moe_utils.te_general_gemm``, defined only when TE imports: without TE every MoE
    forward raised NameError on a GPU, where the CPU layer (which used to define it) is rightly inert."""
    r = subprocess.run(
        [sys.executable, "-c", _ROUTER_WITHOUT_CPU_LAYER],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert "ROUTER_OK" in r.stdout, r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- item 5
def test_cuda_ipc_handle_names_its_gpu_by_uuid(monkeypatch):
    """The colocated transport's CUDA IPC handle carries the sender's device *index*, which means another GPU (or
    none) in an engine actor whose CUDA_VISIBLE_DEVICES Ray narrowed: the handle names the GPU by UUID and the
    engine rebuilds it at its own index of that GPU (what SGLang's patch_torch.py does for the same reason)."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    import megadare.rollout.weight_sync.groups as wg

    # the argument the engine rewrites is the storage's device in this torch's rebuild function
    assert list(inspect.signature(rebuild_cuda_tensor).parameters)[wg._IPC_DEVICE_ARG] == "storage_device"
    seen = []
    args = tuple(f"arg{i}" for i in range(15))
    monkeypatch.setattr(wg, "cuda_index_of", {"GPU-7f": 3}.__getitem__)
    got = wg.open_shared(("cuda", "GPU-7f", (lambda *a: seen.append(a) or "tensor", args)))
    assert got == "tensor" and seen[0][wg._IPC_DEVICE_ARG] == 3
    assert [a for i, a in enumerate(seen[0]) if i != wg._IPC_DEVICE_ARG] == [a for i, a in enumerate(args) if i != 6]
    monkeypatch.undo()
    if not torch.cuda.is_available():  # no GPU visible: a one-line error naming the fix
        with pytest.raises(RuntimeError, match="not visible in this engine process.*weight_transport=distributed"):
            wg.cuda_index_of("GPU-7f")


def test_colocated_waits_for_the_device_before_each_hand_over(monkeypatch, tmp_path):
    """GPU copies are asynchronous: the sender must finish writing a bucket into the shared buffer before it says
    "ready", and the engine must finish loading out of it before it acknowledges (the sender then overwrites it).
    Checked by the order of calls on the CPU path, which runs the same code (device_sync is a no-op here)."""
    import megadare.rollout.weight_sync.groups as wg
    import megadare.rollout.weight_sync.transport as wt
    from megadare.rollout.weight_sync.plan import Flat

    calls = []
    record = lambda name: lambda *a, **k: calls.append(name)  # noqa: E731
    for mod in (wg, wt):
        monkeypatch.setattr(mod, "device_sync", record("sync"))
    monkeypatch.setattr(wt, "broadcast_from_sender", record("ready"))
    monkeypatch.setattr(wt.dist, "barrier", record("ack"))
    sender = object.__new__(wt.GroupTransport)
    sender.how, sender.pg, sender.shared = "shared", None, wg.SharedBuffer(64, torch.device("cpu"))
    try:
        sender.send(0, None, [])
        assert calls == ["sync", "ready", "ack"]
        calls.clear()
        flat = Flat(torch.float32, ("w",), ((4,),))
        sender.shared.tensor[:16].view(torch.float32).copy_(torch.arange(4.0))
        monkeypatch.setattr(wg, "broadcast_from_sender", lambda t, pg: (t.fill_(0), calls.append("ready")))
        receiver = wg.WeightReceiver("cpu")
        receiver.groups = {"g": None}
        loaded = []
        receiver.receive_shared(
            [("g", [[flat]])],
            [sender.shared.handle],
            lambda named: (loaded.extend(t.clone() for _, t in named), calls.append("load")),
        )
        assert calls == ["ready", "load", "sync", "ack"] and torch.equal(loaded[0], torch.arange(4.0))
    finally:
        sender.shared.close()
