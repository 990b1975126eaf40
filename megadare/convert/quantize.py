"""Quantized export of a trained checkpoint for serving: FP8 / NVFP4 with NVIDIA ModelOpt, block FP8 with torch.

    quantize_export("/ckpt/sdar-rl-hf", "/ckpt/sdar-rl-fp8", fmt="fp8")           # modelopt, W8A8 per tensor
    quantize_export("/ckpt/sdar-rl-hf", "/ckpt/q", fmt="fp8", calib=Calibration(["my prompt"], gen_tokens=64))
    quantize_export("runs/x/ckpt", "/ckpt/sdar-rl-nvfp4", fmt="nvfp4")             # Megatron ckpt, CUDA only
    quantize_export("/ckpt/sdar-rl-hf", "/ckpt/sdar-rl-fp8b", fmt="fp8-block")     # torch only (rollout engines)

``src`` is an HF checkpoint directory (config.json + safetensors + tokenizer files, what ``megatron_to_hf`` writes)
or a Megatron checkpoint written by megadare (converted to HF first, in a temporary directory). Formats:

* ``fp8`` -- ModelOpt ``FP8_DEFAULT_CFG``: per-tensor e4m3 weights ``weight_scale = amax(|W|) / 448`` and static
  per-tensor activation scales ``input_scale = amax(|x|) / 448`` calibrated on a few prompts; written by ModelOpt's
  unified HF export (``export_hf_checkpoint``): ``weight`` (F8_E4M3) + ``weight_scale`` + ``input_scale`` per
  linear, ``hf_quant_config.json`` and ``quantization_config`` (``quant_method: modelopt``) in config.json.
  SGLang / vLLM / TensorRT-LLM load it as a ModelOpt FP8 checkpoint.
* ``nvfp4`` -- ModelOpt ``NVFP4_DEFAULT_CFG`` (e2m1 values in 16-element blocks with e4m3 block scales and a
  global fp32 scale): same export path; ModelOpt's NVFP4 quantizer runs only on CUDA, so this needs a GPU.
* ``fp8-block`` -- no ModelOpt: 128x128-block e4m3 weights + ``weight_scale_inv`` (megadare.convert.fp8) and
  ``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], ...}``: the checkpoint an
  SGLang rollout engine starts from when the trainer pushes fp8 weights (``fp8.fp8_rollout_weights``).

Calibration (ModelOpt formats, :class:`Calibration`): each prompt is run as the serving engine sees it, prompt
followed by ``gen_tokens`` mask tokens (the response being denoised), and once more with half of the prompt tokens
masked (the noised inputs of training), under the family's own attention mask. Only the family's linear layers are
quantized (``fp8.linear_hf_names``); the LM head, embeddings, norms and routers stay in the source dtype.
The output is assembled in a fresh sibling of ``out`` and renamed into place, so a crash never leaves a partial
``out``; ``out`` must be new, empty or a previous export of the same format, outside the source (convert.outputs).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from megadare.convert.hf_megatron import megatron_to_hf
from megadare.convert.fp8 import BLOCK, fp8_block_quant_config, fp8_rollout_weights, linear_hf_names
from megadare.convert.mcore_ckpt import MegatronCheckpointError, resolve_checkpoint_dir
from megadare.convert.outputs import check_export_target, mark_export, publish, staging_dir
from megadare.data.tokenizer import ByteTokenizer, HFTokenizer
from megadare.models import load_hf_model
from megadare.models.family import family_of, read_hf_config
from megadare.models.safetensors_io import (
    SafetensorsReader,
    ShardedSafetensorsWriter,
    copy_passthrough_files,
    fresh_sibling,
)

__all__ = [
    "FORMATS",
    "MODELOPT_INSTALL",
    "DEFAULT_PROMPTS",
    "ModelOptMissing",
    "Calibration",
    "require_modelopt",
    "quantize_export",
    "calibration_batches",
]

FORMATS = ("fp8", "nvfp4", "fp8-block")
MODELOPT_INSTALL = 'pip install nvidia-modelopt  (or the extra: pip install "megadare[quant]")'
DEFAULT_PROMPTS = (
    "Question: What is 17 * 23? Think step by step, then give the final answer.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize the causes of the French Revolution in three sentences.",
    "If a train travels 120 km in 1.5 hours, what is its average speed in km/h?",
    "Translate to French: The weather is nice today, let us go for a walk.",
    "Explain the difference between a list and a tuple in Python.",
    "Solve for x: 3x + 7 = 22. Show your work.",
    "Write a short story about a robot that learns to paint.",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
Calib = Optional[Sequence[Union[str, Sequence[int]]]]


@dataclass(frozen=True)
class Calibration:
    """How the ModelOpt formats calibrate their activation scales: ``prompts`` (strings, tokenized with the
    checkpoint's tokenizer, or token-id lists; None = :data:`DEFAULT_PROMPTS`), each followed by ``gen_tokens`` mask
    tokens and cut to ``max_len`` tokens, run on ``device`` (default cuda when available, else cpu; the model is
    held in fp32 on cpu, in the checkpoint's dtype on cuda)."""

    prompts: Calib = None
    gen_tokens: int = 32
    max_len: int = 512
    device: Optional[str] = None


class ModelOptMissing(ImportError):
    """NVIDIA ModelOpt (``nvidia-modelopt``) is needed for this format and is not installed."""


class NeedsCuda(RuntimeError):
    """The format quantizes only on a CUDA GPU and none is used."""


def _calibration_device(fmt: str, calib: Calibration, version: str) -> torch.device:
    dev = torch.device(calib.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if fmt == "nvfp4" and dev.type != "cuda":
        raise NeedsCuda(
            f"fmt='nvfp4' needs a CUDA GPU: ModelOpt's NVFP4 quantizer (dynamic block "
            f"quantization, modelopt {version}) runs only on CUDA; run on a GPU machine or use "
            "fmt='fp8'"
        )
    return dev


# ModelOpt warnings that are false for megadare's hf/ models (each checked by tests/test_quantize.py): its Megatron
# plugin's note on GPTModel.sharded_state_dict (this export never saves a Megatron checkpoint); "tied weights may
# not be deduplicated ... upgrade to transformers>=5.0" (our hf/ models are not transformers PreTrainedModels and
# lack all_tied_weights_keys: the export writes the source's tensors, a tied lm_head not duplicated); a tensor
# copy-construct hint inside its export. Its note on an untested transformers version stays.
MODELOPT_FALSE_ALARMS = (
    r"GPTModel\.sharded_state_dict is not the version ModelOpt patches",
    r"This model may contain tied/shared weights",
    r"To copy construct from a tensor",
)


@contextlib.contextmanager
def _without_modelopt_false_alarms():
    with warnings.catch_warnings():
        for message in MODELOPT_FALSE_ALARMS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


def require_modelopt() -> tuple[str, Any, Any]:
    """(version, ``modelopt.torch.quantization``, ``modelopt.torch.export.export_hf_checkpoint``)."""
    try:
        with _without_modelopt_false_alarms():
            import modelopt  # optional: nvidia-modelopt, for fp8 / nvfp4 only
            import modelopt.torch.quantization as mtq
            from modelopt.torch.export import export_hf_checkpoint
    except ImportError as e:
        raise ModelOptMissing(
            f"quantized export with fmt 'fp8' / 'nvfp4' needs NVIDIA ModelOpt, which is not "
            f"installed ({e}); install it with: {MODELOPT_INSTALL}. fmt='fp8-block' needs only "
            "torch."
        ) from e
    return str(getattr(modelopt, "__version__", "?")), mtq, export_hf_checkpoint


def quantize_export(
    src: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str = "fp8",
    calib: Calibration = Calibration(),
    *,
    block: Sequence[int] = BLOCK,
    progress: bool = True,
) -> str:
    """Quantize the checkpoint ``src`` (HF dir or megadare Megatron checkpoint) into the HF checkpoint ``out``.

    ``calib``: the calibration of the ModelOpt formats (:class:`Calibration`: prompts, generated tokens, length,
    device). ``block``: tile of ``fp8-block``. Returns ``out``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"quantize_export: fmt={fmt!r}; choose one of {', '.join(FORMATS)}")
    if not isinstance(calib, Calibration):
        raise TypeError(f"quantize_export: calib={calib!r:.80}; pass Calibration(prompts, gen_tokens=..., device=...)")
    src, out = os.fspath(src), os.fspath(out).rstrip(os.sep)
    ckpt = _megatron_source(src)  # a wrong path is refused before ModelOpt's import (seconds)
    check_export_target(out, f"hf-{fmt}", [src] + ([ckpt] if ckpt else []))
    modelopt = require_modelopt() if fmt != "fp8-block" else None  # fail before any conversion work
    if modelopt:
        _calibration_device(fmt, calib, modelopt[0])
    staging = staging_dir(out)
    tmp_hf = None
    try:
        hf_dir, tmp_hf = _hf_dir(src, ckpt, out, progress)
        cfg = _read_config(hf_dir)
        if fmt == "fp8-block":
            _export_fp8_block(hf_dir, cfg, staging, block)
        else:
            _export_modelopt(modelopt, hf_dir, cfg, staging, fmt, calib)
        mark_export(staging, f"hf-{fmt}", [src])
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if tmp_hf:
            shutil.rmtree(tmp_hf, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------- source and output
def _megatron_source(src: str) -> Optional[str]:
    """None for an HF checkpoint directory, else the megadare Megatron checkpoint ``src`` names (ValueError when
    it is neither)."""
    if os.path.exists(os.path.join(src, "config.json")):
        return None
    try:
        return resolve_checkpoint_dir(src)
    except MegatronCheckpointError as e:
        raise ValueError(
            f"{src}: neither an HF checkpoint directory (config.json + *.safetensors) nor a megadare "
            f"Megatron checkpoint ({e})"
        ) from e


def _hf_dir(src: str, ckpt: Optional[str], out: str, progress: bool) -> tuple[str, Optional[str]]:
    """(HF checkpoint dir, temporary dir to remove afterwards or None)."""
    if ckpt is None:
        return src, None
    tmp = fresh_sibling(out, "hf", create=False)
    megatron_to_hf(ckpt, tmp, progress=progress)
    return tmp, tmp


def _read_config(hf_dir: str) -> dict:
    cfg = read_hf_config(hf_dir)
    if cfg.get("quantization_config"):
        raise ValueError(
            f"{hf_dir}/config.json already has a quantization_config "
            f"({cfg['quantization_config'].get('quant_method', '?')}); quantize the full-precision "
            "checkpoint instead"
        )
    return cfg


def _export_fp8_block(hf_dir: str, cfg: dict, staging: str, block: Sequence[int]) -> None:
    linear = linear_hf_names(cfg)
    with SafetensorsReader(hf_dir) as r, ShardedSafetensorsWriter(staging) as w:
        missing = sorted(linear - set(r.keys()))
        if missing:
            raise ValueError(
                f"{hf_dir}: the checkpoint lacks linear weights of its family table, e.g. "
                f"{missing[:4]}; does config.json match the safetensors?"
            )
        for name, t in fp8_rollout_weights(r.items(), linear, block):
            w.add(name, t)
        copy_passthrough_files(hf_dir, w.staging_dir)
        with open(os.path.join(w.staging_dir, "config.json"), "w") as f:
            json.dump({**cfg, "quantization_config": fp8_block_quant_config(block)}, f, indent=2)


# ---------------------------------------------------------------------------------------------- calibration
def calibration_batches(
    hf_dir: str, cfg: dict, calib: Calib = None, gen_tokens: int = 32, max_len: int = 512, seed: int = 0
) -> list[torch.Tensor]:
    """Token sequences [S] the calibration runs: per prompt, ``prompt + [mask] * gen_tokens`` and the prompt
    with half of its tokens replaced by the mask token (seeded)."""
    arch = family_of(cfg).arch(cfg)
    items = list(DEFAULT_PROMPTS if calib is None else calib)
    if not items:
        raise ValueError("calibration needs at least one prompt")
    if all(isinstance(p, str) for p in items):
        tok = _tokenizer(hf_dir, arch.vocab_size, arch.mask_token_id)
        ids = [tok.encode(p) for p in items]
    elif any(isinstance(p, str) for p in items):
        raise ValueError("calibration prompts must be all strings or all token-id lists, not a mix")
    else:
        ids = [[int(t) for t in p] for p in items]
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, p in enumerate(ids):
        bad = [t for t in p if not 0 <= t < arch.vocab_size]
        if not p:
            raise ValueError(f"calibration prompt {n} is empty")
        if bad:
            raise ValueError(
                f"calibration prompt {n}: token ids {bad[:4]} are outside the vocabulary "
                f"0..{arch.vocab_size - 1} of the checkpoint"
            )
        p = torch.tensor(p[: max(1, max_len - gen_tokens)])
        out.append(torch.cat([p, torch.full((gen_tokens,), arch.mask_token_id)]))
        noised = p.clone()
        noised[torch.rand(len(p), generator=g) < 0.5] = arch.mask_token_id
        out.append(noised)
    return out


def _tokenizer(hf_dir: str, vocab_size: int, mask_token_id: int):
    if any(os.path.exists(os.path.join(hf_dir, f)) for f in _TOKENIZER_FILES):
        return HFTokenizer(hf_dir, mask_token_id)
    if vocab_size <= ByteTokenizer.vocab_size:  # the byte-level tiny models of tests and demos
        return ByteTokenizer()
    raise ValueError(
        f"{hf_dir}: no tokenizer files ({', '.join(_TOKENIZER_FILES)}) to tokenize the calibration "
        "prompts; copy the tokenizer into the checkpoint, or pass token ids (calib=[[ids], ...])"
    )


# ---------------------------------------------------------------------------------------------- modelopt
def _export_modelopt(modelopt: tuple, hf_dir: str, cfg: dict, staging: str, fmt: str, calib: Calibration) -> None:
    version, mtq, export_hf_checkpoint = modelopt
    dev = _calibration_device(fmt, calib, version)
    with SafetensorsReader(hf_dir) as r:
        src_dtype = r.dtype(r.keys()[0])
    model = load_hf_model(hf_dir, dtype=torch.float32 if dev.type == "cpu" else src_dtype, device=dev)
    batches = calibration_batches(hf_dir, cfg, calib.prompts, calib.gen_tokens, calib.max_len)
    base = mtq.FP8_DEFAULT_CFG if fmt == "fp8" else mtq.NVFP4_DEFAULT_CFG
    qcfg = _only_linears(base, model, linear_hf_names(cfg))

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for ids in batches:
                m(ids.to(dev)[None])

    with _without_modelopt_false_alarms():
        mtq.quantize(model, qcfg, forward_loop)
        _fill_uncalibrated_experts(model)
        _as_pretrained(model, cfg, hf_dir, src_dtype, dev)
        export_hf_checkpoint(model, dtype=src_dtype, export_dir=staging, max_shard_size=2 << 30)
    with open(os.path.join(staging, "config.json")) as f:
        if "quantization_config" not in json.load(f):
            raise RuntimeError(
                f"modelopt {version} exported {staging} without a quantization_config in "
                "config.json: nothing was quantized (check the calibration and the model)"
            )


def _only_linears(base: dict, model: torch.nn.Module, linear: frozenset[str]) -> dict:
    """A copy of a ModelOpt config that also disables every ``nn.Linear`` outside the family's linear layers (the
    LM head under any name: the model applies it with F.linear, so it would never be calibrated)."""
    qcfg = copy.deepcopy(base)
    skip = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and f"{n}.weight" not in linear]
    for n in skip:
        if isinstance(qcfg["quant_cfg"], list):  # modelopt >= 0.4x: ordered list of entries
            qcfg["quant_cfg"].append({"quantizer_name": f"{n}.*", "enable": False})
        else:  # older: {pattern: attributes}
            qcfg["quant_cfg"][f"{n}.*"] = {"enable": False}
    return qcfg


def _fill_uncalibrated_experts(model: torch.nn.Module) -> int:
    """ModelOpt exports no ``input_scale`` for a linear whose input quantizer saw no token: an expert that no
    calibration token was routed to. Give it the largest amax of the same projection among its layer's experts
    (ModelOpt's own rule for its fused-expert modules). Returns how many were filled."""
    groups: dict[str, list[tuple[str, Any, Optional[torch.Tensor]]]] = {}
    for name, m in model.named_modules():
        q = getattr(m, "input_quantizer", None)
        if q is None or not getattr(q, "is_enabled", False):
            continue
        try:
            amax = q.amax
        except AssertionError:  # dynamic quantizers have no calibrated amax
            continue
        groups.setdefault(re.sub(r"(experts?\.)\d+\.", r"\1*.", name), []).append((name, q, amax))
    filled = 0
    for key, qs in groups.items():
        seen = [a.float().max() for _, _, a in qs if a is not None and bool((a > 0).all())]
        todo = [(n, q) for n, q, a in qs if a is None or not bool((a > 0).all())]
        if not todo:
            continue
        if not seen:
            raise RuntimeError(
                f"calibration never reached {todo[0][0]} (nor any module like {key}): its input "
                "scale is unknown; calibrate with more or longer prompts"
            )
        top = torch.stack(seen).max()
        for _, q in todo:
            q.amax = top.clone()
            filled += 1
    return filled


def _as_pretrained(model: torch.nn.Module, cfg: dict, hf_dir: str, dtype: torch.dtype, dev: torch.device) -> None:
    """Give the family's plain ``nn.Module`` what ModelOpt's HF export reads of a transformers model: ``config``,
    ``device`` and ``save_pretrained`` (writing megadare's sharded safetensors + the source's config/tokenizer;
    ModelOpt then adds quantization_config and hf_quant_config.json)."""
    model.config = types.SimpleNamespace(**{**cfg, "torch_dtype": dtype})
    model.device = dev

    def save_pretrained(
        export_dir: str, state_dict: Optional[dict] = None, max_shard_size: Any = 2 << 30, **_: Any
    ) -> None:
        state = model.state_dict() if state_dict is None else state_dict
        shard = max_shard_size if isinstance(max_shard_size, int) else 2 << 30
        with ShardedSafetensorsWriter(export_dir, max_shard_bytes=shard) as w:
            for k, v in state.items():
                w.add(k, v)
            copy_passthrough_files(hf_dir, w.staging_dir)

    model.save_pretrained = save_pretrained
