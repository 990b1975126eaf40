"""HF <-> Megatron conversion: one mapping table per family, streamed tensor by tensor.

* ``hf_to_megatron(hf_dir, out_dir, Layout(tp=2, pp=2))``: HF safetensors -> a Megatron distributed checkpoint. The
  checkpoint's keys are layout-independent (see mcore_ckpt), so it loads under the requested layout and under
  any other; the layout is validated up front against the architecture and recorded as the default.
* ``megatron_to_hf(ckpt_dir, out_dir)``: back to HF safetensors in the publisher's names, with config.json and
  tokenizer files carried from the source.
* ``load_hf_into_model(chunks, hf_dir)``: an HF checkpoint straight into a sharded live model, no conversion.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from megadare.console import progress_bar
from megadare.models.mapping import ParamMap, check_table
from megadare.convert.outputs import check_export_target, mark_export
from megadare.convert.mcore_ckpt import (
    HF_SUBDIR,
    intact_checkpoint_dir,
    checkpoint_keys,
    copy_hf_files,
    load_checkpoint,
    read_meta,
    read_tensors,
    resolve_checkpoint_dir,
    save_checkpoint,
    write_tensors,
)
from megadare.models.safetensors_io import (
    SafetensorsReader,
    ShardedSafetensorsWriter,
    copy_passthrough_files,
)
from megadare.convert.sharded_load import fill_model_from_global
from megadare.models.family import Family, ModelArch, ModelConfigError, family_of, read_hf_config
from megadare.models import hf_shape_mismatches
from megadare.parallel.layout import Layout

__all__ = [
    "hf_to_megatron",
    "megatron_to_hf",
    "load_hf_into_model",
    "save_checkpoint",
    "load_checkpoint",
    "mapping_for",
    "HFSource",
]


def _progress(total: int, desc: str, enabled: bool):
    return progress_bar(total=total, desc=desc, unit="tensor", disable=not enabled, dynamic_ncols=True)


def mapping_for(hf_config: dict) -> tuple[Family, ModelArch, list[ParamMap]]:
    fam = family_of(hf_config)
    return fam, fam.arch(hf_config), fam.mapping(hf_config)


class HFSource:
    """Global Megatron tensors produced on demand from an HF checkpoint through the family table."""

    def __init__(self, hf_dir: str, dtype: Optional[torch.dtype] = None):
        self.hf_dir = hf_dir
        self.config = read_hf_config(hf_dir)
        self.family, self.arch, self.table = mapping_for(self.config)
        self.reader = SafetensorsReader(hf_dir)
        ignore = self.family.extra.get("ignore_hf", ())
        names = {k for k in self.reader.keys() if not any(k.endswith(s) for s in ignore)}
        check_table(self.table, names, hf_dir)
        for r in self.table:  # a config.json of another checkpoint (or edited) fails here, not mid-conversion
            shapes = [self.reader.shape(h) for h in r.hf]
            problem = r.hf_shape_problem(shapes)
            if r.op == "vocab" and problem is None and list(shapes[0][1:]) != [self.arch.hidden_size]:
                problem = f"{r.hf[0]} is {list(shapes[0])}, config.json's hidden_size is {self.arch.hidden_size}"
            if problem is not None:
                break
        else:  # every other tensor (MLP and expert widths, norms, layers' shapes) against the hf/ model's
            problem = hf_shape_mismatches(self.config, self.reader) or None
        if problem is not None:
            raise ModelConfigError(
                f"{hf_dir}: config.json does not describe these weights ({problem}); put the checkpoint's own "
                "config.json beside its safetensors"
            )
        self.rows = {r.mcore: r for r in self.table}
        self.dtype = dtype

    def shapes(self) -> dict[str, tuple[list[int], torch.dtype]]:
        out = {}
        for r in self.table:
            dt = self.dtype if self.dtype is not None else self.reader.dtype(r.hf[0])
            out[r.mcore] = (r.mcore_shape([self.reader.shape(h) for h in r.hf]), dt)
        return out

    def __call__(self, key: str) -> torch.Tensor:
        if key not in self.rows:
            raise KeyError(f"{self.hf_dir}: the {self.family.name} table has no Megatron key {key!r}")
        r = self.rows[key]
        t = r.to_mcore([self.reader.get(h) for h in r.hf])
        return t.to(self.dtype) if self.dtype is not None else t


def hf_to_megatron(
    hf_dir: str,
    out_dir: str,
    layout: Layout = Layout(),
    *,
    dtype: Optional[torch.dtype] = None,
    progress: bool = True,
) -> str:
    """Convert an HF checkpoint directory into a Megatron distributed checkpoint (single process, streaming).
    ``layout``: the parallel layout it is checked against and records as its default (any layout loads it).
    ``out_dir`` must be new, empty or a previous Megatron export, outside the source (``outputs``)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"hf_to_megatron: layout={layout!r} is not a Layout; pass Layout(tp=..., pp=..., ep=...)")
    src = HFSource(hf_dir, dtype)
    check_export_target(out_dir, "megatron", [hf_dir])
    layout.check_model(src.arch)
    shapes = src.shapes()
    bar = _progress(len(shapes), "hf -> megatron", progress)

    def produce(key: str) -> torch.Tensor:
        t = src(key)
        bar.update(1)
        return t

    meta = {
        "family": src.family.name,
        "architecture": src.arch.architecture,
        "source": os.path.abspath(hf_dir),
        "layout": {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "vpp": layout.vpp},
        "format": "megadare-torch_dist-v1",
    }
    try:
        write_tensors(
            out_dir,
            shapes,
            produce,
            meta=meta,
            before_publish=lambda staging: _finish_export(staging, hf_dir),
        )
    finally:
        bar.close()
    return out_dir


def _finish_export(staging: str, hf_dir: str) -> None:
    """What a converted checkpoint carries beside its tensors: the source's config.json and tokenizer files, and
    the mark of a Megatron export."""
    copy_hf_files(staging, hf_dir)
    mark_export(staging, "megatron", [hf_dir])


def megatron_to_hf(
    ckpt_dir: str,
    out_dir: str,
    max_shard_bytes: int = 2 << 30,
    dtype: Optional[torch.dtype] = None,
    progress: bool = True,
) -> str:
    """Export a Megatron distributed checkpoint (written by megadare) to HF safetensors, tensor by tensor.
    ``out_dir`` must be new, empty or a previous HF export, outside the checkpoint and its run (``outputs``)."""
    check_export_target(out_dir, "hf", [ckpt_dir, resolve_checkpoint_dir(ckpt_dir)])
    ckpt_dir = intact_checkpoint_dir(ckpt_dir)
    meta = read_meta(ckpt_dir)
    hf_files = os.path.join(ckpt_dir, HF_SUBDIR)
    with open(os.path.join(hf_files, "config.json")) as f:
        config = json.load(f)
    fam, arch, table = mapping_for(config)
    known = checkpoint_keys(ckpt_dir)
    missing = [r.mcore for r in table if r.mcore not in known]
    if missing:
        raise ValueError(
            f"{ckpt_dir}: checkpoint lacks {len(missing)} tensors of the {fam.name} table, "
            f"e.g. {missing[:4]}; was it written for another config.json?"
        )
    bar = _progress(len(table), "megatron -> hf", progress)
    try:
        with ShardedSafetensorsWriter(out_dir, max_shard_bytes=max_shard_bytes) as w:
            for r in table:
                t = _merged_lora(ckpt_dir, r.mcore, known, meta)
                for name, h in zip(r.hf, r.to_hf(t)):
                    w.add(name, h.to(dtype) if dtype is not None else h)
                bar.update(1)
            copy_passthrough_files(hf_files, w.staging_dir)
            mark_export(w.staging_dir, "hf", [ckpt_dir])
    finally:
        bar.close()
    return out_dir


def _merged_lora(ckpt_dir: str, key: str, known: dict, meta: dict) -> torch.Tensor:
    """A checkpoint tensor, with a LoRA adapter pair folded in when the checkpoint has one for it:
    W + (alpha / r) * B @ A on the global (layout-independent) tensors, computed in fp32."""
    t = read_tensors(ckpt_dir, [key], known)[key]
    module, _, leaf = key.rpartition(".")
    if leaf not in ("weight", "weight_w", "weight_v"):  # _w / _v: megatron's split halves of a SwiGLU fc1
        return t
    a_key, b_key = f"{module}.lora_A", f"{module}.lora_B{leaf[len('weight') :]}"
    if a_key not in known:
        return t
    lora = meta.get("lora")
    if not lora:
        raise ValueError(
            f"{ckpt_dir}: holds LoRA adapters ({a_key}) but megadare.json has no 'lora' "
            "{rank, alpha} entry to scale them"
        )
    ab = read_tensors(ckpt_dir, [a_key, b_key], known)
    scale = float(lora["alpha"]) / float(lora["rank"])
    return (t.float() + scale * ab[b_key].float() @ ab[a_key].float()).to(t.dtype)


def load_hf_into_model(chunks: list[torch.nn.Module], hf_dir: str) -> None:
    """Load an HF checkpoint straight into this rank's sharded model chunks (every rank calls this)."""
    src = HFSource(hf_dir)
    cache: dict[str, torch.Tensor] = {}

    def produce(key: str) -> torch.Tensor:
        # A key can be asked twice on one rank (tied embedding on the first and last PP stage).
        if key not in cache:
            cache.clear()
            cache[key] = src(key)
        return cache[key]

    fill_model_from_global(chunks, produce)
