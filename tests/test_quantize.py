"""Quantized export (megadare.convert.quantize) and fp8 rollout weights (megadare.convert.fp8).

Always run: the torch-only fp8 casts (error bound, exact scales, SGLang names), the block-fp8 checkpoint, the
Megatron-checkpoint source, the CLI tool and the missing-ModelOpt error. Only where ``nvidia-modelopt`` imports
(CI does not install it): a CPU FP8 calibration + HF export of a tiny model, checked against the original logits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from fp8_reference import dequantize_fp8

from megadare.convert.fp8 import (
    BLOCK,
    FP8_MAX,
    fp8_block_quant_config,
    fp8_rollout_weights,
    linear_hf_names,
    quantize_fp8_block,
    quantize_fp8_per_tensor,
)
from megadare.convert.quantize import (
    MODELOPT_FALSE_ALARMS,
    MODELOPT_INSTALL,
    Calibration,
    ModelOptMissing,
    quantize_export,
)
from megadare.models.safetensors_io import SafetensorsReader
from megadare.models import read_hf_config as read_config
from tiny import write_tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Logits of the dequantized tiny model vs the original: relative L2 error. FP8 rounding moves each weight by up
# to 2^-4 of itself (about 2.7% relative L2 per matrix); this random 2-layer model amplifies weight noise about
# 3x (Gaussian noise of that size moves its logits about 7.6%). Measured: 0.050 (weights), 0.075 (+activations).
LOGITS_RTOL = 0.15


def _within_fp8_bound(deq: torch.Tensor, w: torch.Tensor, step: torch.Tensor) -> bool:
    """|deq - w| <= max(2^-4 |w|, 2^-10 s) elementwise (normal: half an ulp of 3 mantissa bits; subnormal:
    half the subnormal step 2^-9 s), with a 1e-6 relative allowance for fp32 arithmetic."""
    bound = torch.maximum(w.abs() * 2.0**-4, step * 2.0**-10) * (1 + 1e-6) + 1e-12
    return bool(((deq - w).abs() <= bound).all())


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (1, 5), (257, 129)])
def test_block_fp8_error_bound_and_exact_scales(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.02
    w[0, 0] = 3.0  # an outlier only its own tile sees
    if shape[0] > 128 and shape[1] > 128:
        w[128:256, 128:256] = 0  # an all-zero tile: finite scale, exact zeros back
    q, s = quantize_fp8_block(w)
    nb, kb = -(-shape[0] // 128), -(-shape[1] // 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (nb, kb)
    for i in range(nb):  # scale = amax(tile) / 448, tile by tile
        for j in range(kb):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert s[i, j] == tile.abs().max().clamp(min=1e-12) / FP8_MAX
    deq = dequantize_fp8(q, s, BLOCK)
    step = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    assert _within_fp8_bound(deq, w, step)
    assert deq.abs().max() == w.abs().max()  # the amax element is exactly representable (448 * s)
    if shape[0] > 128 and shape[1] > 128:
        assert not deq[128:256, 128:256].any()


def test_per_tensor_fp8_error_bound_and_exact_scale():
    torch.manual_seed(1)
    w = torch.randn(96, 80, dtype=torch.bfloat16)
    q, s = quantize_fp8_per_tensor(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (1,) and s.dtype == torch.float32
    assert torch.equal(s, (w.float().abs().max() / FP8_MAX).reshape(1))  # fp32 arithmetic, bit-exact
    assert _within_fp8_bound(dequantize_fp8(q, s), w.float(), s)


@pytest.mark.parametrize("family", ["sdar", "sdar_moe", "llada2", "llada"])
def test_rollout_weights_follow_sglang_names(family):
    """Linear weights -> (weight fp8, weight_scale_inv) in stream order; everything else passes through as is.
    LLaDA2's fused query_key_value is one linear; LLaDA's LM head (transformer.ff_out) is not one."""
    from megadare.convert.hf_megatron import mapping_for
    from megadare.models import build_hf_model, get_family

    cfg = get_family(family).tiny_config()
    table = mapping_for(cfg)[2]
    linear = linear_hf_names(table)
    assert linear == linear_hf_names(cfg)
    named = list(build_hf_model(cfg).state_dict().items())
    assert not any(
        n.endswith(
            (
                "norm.weight",
                "embed_tokens.weight",
                "word_embeddings.weight",
                "mlp.gate.weight",
                "lm_head.weight",
                "transformer.ff_out.weight",
                "transformer.wte.weight",
            )
        )
        for n in linear
    )
    if family == "llada2":
        assert "model.layers.0.attention.query_key_value.weight" in linear
    out = list(fp8_rollout_weights(named, linear))
    expect = []
    for n, t in named:
        expect += [n, n[: -len("weight")] + "weight_scale_inv"] if n in linear else [n]
    assert [n for n, _ in out] == expect
    got = dict(out)
    for n, t in named:
        if n not in linear:
            assert got[n] is t
            continue
        q, s = got[n], got[n[: -len("weight")] + "weight_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and q.shape == t.shape
        assert s.dtype == torch.float32 and s.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        assert _within_fp8_bound(dequantize_fp8(q, s, BLOCK), t, s.max())
    per_tensor = dict(fp8_rollout_weights(named, linear, block=None))
    name = sorted(linear)[0]
    assert per_tensor[name[: -len("weight")] + "weight_scale"].shape == (1,)
    assert not any(k.endswith("weight_scale_inv") for k in per_tensor)


def test_rollout_weights_reject_bad_linears():
    with pytest.raises(ValueError, match="does not end in '.weight'"):
        list(fp8_rollout_weights([("a.proj", torch.ones(2, 2))], {"a.proj"}))
    with pytest.raises(ValueError, match="2-D floating-point"):
        list(fp8_rollout_weights([("a.bias", torch.ones(4))], lambda n: True))


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory):
    return write_tiny_hf(tmp_path_factory.mktemp("hf"), "sdar", 3)


def _dequantized_model(src_dir: str, qdir: str, scale_suffix: str, block):
    from megadare.models import load_hf_model

    model = load_hf_model(src_dir)
    r = SafetensorsReader(qdir)
    state = {}
    for k in model.state_dict():
        t = r.get(k)
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize_fp8(t, r.get(k[: -len("weight")] + scale_suffix), block)
        state[k] = t
    model.load_state_dict(state)
    return model, r


def test_fp8_block_checkpoint_matches_rollout_stream(sdar_dir, tmp_path):
    """fmt='fp8-block' (no ModelOpt): the engine's start checkpoint holds exactly what fp8_rollout_weights pushes."""
    from megadare.models import load_hf_model

    out = str(tmp_path / "fp8b")
    os.makedirs(out)  # an existing output is replaced, atomically
    assert quantize_export(sdar_dir, out, fmt="fp8-block") == out
    assert not os.path.exists(out + ".tmp") and sorted(os.listdir(tmp_path)) == ["fp8b"]
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert (
        cfg["quantization_config"]
        == fp8_block_quant_config()
        == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    )
    src = SafetensorsReader(sdar_dir)
    stream = dict(fp8_rollout_weights(src.items(), linear_hf_names(cfg)))
    r = SafetensorsReader(out)
    assert set(r.keys()) == set(stream)
    assert all(
        torch.equal(
            r.get(k).view(torch.uint8) if r.dtype(k) == torch.float8_e4m3fn else r.get(k),
            v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
        )
        for k, v in stream.items()
    )
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        ref = load_hf_model(sdar_dir)(ids)
        got = _dequantized_model(sdar_dir, out, "weight_scale_inv", BLOCK)[0](ids)
    assert 0 < _rel(got, ref) < LOGITS_RTOL
    with pytest.raises(ValueError, match="already has a quantization_config"):
        quantize_export(out, str(tmp_path / "again"), fmt="fp8-block")


def test_megatron_checkpoint_source(sdar_dir, tmp_path):
    from megadare.convert.hf_megatron import hf_to_megatron

    ck = str(tmp_path / "ck")
    hf_to_megatron(sdar_dir, ck, progress=False)
    a = quantize_export(ck, str(tmp_path / "from_ck"), fmt="fp8-block", progress=False)
    b = quantize_export(sdar_dir, str(tmp_path / "from_hf"), fmt="fp8-block")
    ra, rb = SafetensorsReader(a), SafetensorsReader(b)
    assert set(ra.keys()) == set(rb.keys())
    assert all(torch.equal(ra.get(k).view(torch.uint8), rb.get(k).view(torch.uint8)) for k in ra.keys())
    assert not os.path.exists(str(tmp_path / "from_ck") + ".tmp-hf")
    with pytest.raises(ValueError, match="neither an HF checkpoint directory"):
        quantize_export(str(tmp_path), str(tmp_path / "x"), fmt="fp8-block")
    with pytest.raises(ValueError, match="choose one of fp8, nvfp4, fp8-block"):
        quantize_export(sdar_dir, str(tmp_path / "x"), fmt="int4")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_missing_modelopt_names_the_install(sdar_dir, tmp_path, monkeypatch, fmt):
    for mod in ("modelopt", "modelopt.torch", "modelopt.torch.quantization", "modelopt.torch.export"):
        monkeypatch.setitem(sys.modules, mod, None)  # import of a None entry raises ImportError
    with pytest.raises(ModelOptMissing, match="pip install nvidia-modelopt") as e:
        quantize_export(sdar_dir, str(tmp_path / "q"), fmt=fmt)
    assert isinstance(e.value, ImportError) and "megadare[quant]" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_package_imports_without_modelopt():
    code = (
        "import sys; sys.modules['modelopt'] = None; import megadare.convert.quantize, megadare.convert.fp8; "
        "print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "quantize_tool", os.path.join(ROOT, "tools/checkpoint_convert/quantize.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_tool(sdar_dir, tmp_path, monkeypatch, capsys):
    tool = _tool()
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is 2 + 2?\n\n[1, 2, 3]\n")
    assert tool.read_calib_prompts(str(prompts)) == ["What is 2 + 2?", [1, 2, 3]]
    out = str(tmp_path / "o")
    assert tool.main(["--hf", sdar_dir, "--out", out, "--format", "fp8-block", "--calib-prompts", str(prompts)]) == 0
    assert "quantization_config" in json.load(open(os.path.join(out, "config.json")))
    for mod in ("modelopt", "modelopt.torch", "modelopt.torch.quantization", "modelopt.torch.export"):
        monkeypatch.setitem(sys.modules, mod, None)
    assert tool.main(["--hf", sdar_dir, "--out", str(tmp_path / "m"), "--format", "fp8"]) == 2
    assert MODELOPT_INSTALL in capsys.readouterr().err


def test_cli_tool_nvfp4_without_cuda_is_one_line(sdar_dir, tmp_path, monkeypatch, capsys):
    """nvfp4 on a machine without CUDA: refused before any work, in one line (not a traceback after the
    conversion). ModelOpt is stood in for (CI does not install it): the refusal happens before it is used."""
    import megadare.convert.quantize as quantize

    monkeypatch.setattr(quantize, "require_modelopt", lambda: ("0.0-standin", None, None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = str(tmp_path / "q")
    assert _tool().main(["--hf", sdar_dir, "--out", out, "--format", "nvfp4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err and "fmt='fp8'" in err
    assert os.listdir(tmp_path) == []


def test_calibration_batches_are_dllm_inputs(sdar_dir):
    from megadare.convert.quantize import calibration_batches
    from megadare.models import read_hf_config

    cfg = read_hf_config(sdar_dir)
    b = calibration_batches(sdar_dir, cfg, ["hello world"], gen_tokens=8)
    assert len(b) == 2 and b[0].tolist() == [ord(c) for c in "hello world"] + [cfg["mask_token_id"]] * 8
    assert len(b[1]) == 11 and (b[1] == cfg["mask_token_id"]).any()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        calibration_batches(sdar_dir, cfg, [[1, 999]])


# ------------------------------------------------------------------------------------------ with ModelOpt only
def _modelopt_or_skip():
    try:
        from megadare.convert.quantize import require_modelopt

        return require_modelopt()
    except ModelOptMissing as e:
        pytest.skip(f"nvidia-modelopt not installed ({MODELOPT_INSTALL}): {e.__cause__}")


def test_modelopt_fp8_export_cpu(sdar_dir, tmp_path):
    """ModelOpt FP8 (W8A8 per tensor) on CPU: fp8 linears + weight/input scales + quantization config, and the
    dequantized model (weights, then also activations through input_scale) close to the original logits."""
    from megadare.models import load_hf_model

    version = _modelopt_or_skip()[0]
    out = str(tmp_path / "fp8")
    tool = [
        sys.executable,
        os.path.join(ROOT, "tools/checkpoint_convert/quantize.py"),
        "--hf",
        sdar_dir,
        "--out",
        out,
        "--format",
        "fp8",
    ]
    run = subprocess.run(tool, capture_output=True, text=True)
    if run.returncode and "cuda" in run.stderr.lower():
        pytest.skip(f"modelopt {version}: the FP8 path needs CUDA here ({run.stderr[-300:]})")
    assert run.returncode == 0, run.stderr[-3000:]
    for false_alarm in MODELOPT_FALSE_ALARMS:  # ModelOpt's warnings that do not hold for our hf/ models
        assert not re.search(false_alarm, run.stderr), run.stderr
    cfg = json.load(open(os.path.join(out, "config.json")))
    qcfg = json.load(open(os.path.join(out, "hf_quant_config.json")))
    assert cfg["quantization_config"]["quant_method"] == "modelopt"
    assert qcfg["quantization"]["quant_algo"] == "FP8"
    linear = linear_hf_names(cfg)
    model, r = _dequantized_model(sdar_dir, out, "weight_scale", None)
    fp8 = {k for k in r.keys() if r.dtype(k) == torch.float8_e4m3fn}
    assert fp8 == linear
    orig = load_hf_model(sdar_dir).state_dict()
    for k in fp8:
        s = r.get(k[: -len("weight")] + "weight_scale").float()
        assert s.numel() == 1 and s.item() >= orig[k].abs().max().item() / FP8_MAX * (1 - 1e-6)
        assert r.get(k[: -len("weight")] + "input_scale").item() > 0
        assert _within_fp8_bound(dequantize_fp8(r.get(k), s), orig[k], s)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        ref = load_hf_model(sdar_dir)(ids)
        w8 = model(ids)
        for name, mod in model.named_modules():  # activations through fp8 with the exported input_scale
            if f"{name}.weight" in linear:
                s = r.get(f"{name}.input_scale").float()
                mod.register_forward_pre_hook(
                    lambda m, a, s=s: ((a[0] / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s,)
                )
        w8a8 = model(ids)
    assert 0 < _rel(w8, ref) < LOGITS_RTOL
    assert 0 < _rel(w8a8, ref) < LOGITS_RTOL


def test_modelopt_fp8_moe_experts_without_tokens_get_scales(tmp_path):
    """Two one-token calibration sequences reach at most 4 of 8 experts per layer (top-2): the others get the
    largest input amax of the same projection among the layer's experts, so every expert linear still has
    weight_scale and input_scale."""
    _modelopt_or_skip()
    d = write_tiny_hf(tmp_path, "sdar_moe", 5)
    out = quantize_export(d, str(tmp_path / "q"), fmt="fp8", calib=Calibration([[5]], gen_tokens=0, device="cpu"))
    r = SafetensorsReader(out)
    fp8 = {k for k in r.keys() if r.dtype(k) == torch.float8_e4m3fn}
    assert fp8 == linear_hf_names(read_config(out))
    for k in fp8:
        assert r.get(k[: -len("weight")] + "weight_scale").item() > 0
        assert r.get(k[: -len("weight")] + "input_scale").item() > 0
    for proj in ("gate_proj", "up_proj", "down_proj"):
        scales = [r.get(f"model.layers.0.mlp.experts.{e}.{proj}.input_scale").item() for e in range(8)]
        assert scales.count(max(scales)) >= 5  # >= 4 uncalibrated share the max of the calibrated


def test_modelopt_nvfp4_needs_cuda(sdar_dir, tmp_path):
    _modelopt_or_skip()
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: NVFP4 runs there")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        quantize_export(sdar_dir, str(tmp_path / "q"), fmt="nvfp4")
    assert os.listdir(tmp_path) == []


def test_a_wrong_source_is_refused_before_modelopt_loads(tmp_path):
    """A mistyped --hf path was refused only after ModelOpt's import (~10 CPU-s, a minute on a loaded machine)."""
    code = (
        "import sys\n"
        "from megadare.convert.quantize import quantize_export\n"
        "try:\n"
        f"    quantize_export({str(tmp_path / 'no-such-model')!r}, {str(tmp_path / 'out')!r}, fmt='fp8')\n"
        "except ValueError as e:\n"
        "    print('refused', 'modelopt' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["refused", "False"], out.stderr[-2000:]
