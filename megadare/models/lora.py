"""LoRA adapters on megatron's tensor-parallel linear layers (TP and TP + sequence parallelism), with merge.

``apply_lora`` wraps the attention / MLP projections of built model chunks (``ColumnParallelLinear``
``linear_qkv`` / ``linear_fc1``, ``RowParallelLinear`` ``linear_proj`` / ``linear_fc2``) in ``LoRALinear``:

    y = base(x) + (alpha / r) * B(A(x)),     A: in -> r (Kaiming-uniform, as PEFT),  B: r -> out (zeros)

and freezes every other parameter of the chunks. ``merge_lora`` folds the adapters into the base weight shards
and puts the plain megatron modules back, so the existing converters export the result to HF.

Tensor parallelism (p = TP size, s = alpha / r). Only megatron's own mapping functions are used, so autograd
performs every reduction and no gradient hook / finalize step is needed:

* column-parallel base (weight sharded on its output dim): A [r, in] is replicated, B [out/p, r] is sharded
  like the weight (dim 0). Forward:

      x_full = x                                        (no SP: x is replicated)
      x_full = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)   (SP)
      z = copy_to_tensor_model_parallel_region(A x_full)          # fwd identity, bwd all-reduce
      y_shard = s * B_shard z

  Each rank's B_shard only sees its slice of dL/dy, so dL/dz is a partial sum; the copy region all-reduces it.
  Hence dA = dz_full x_full^T is complete and identical on every TP rank, and dL/dx_full = A^T dz_full is
  the full (replicated) input gradient: under SP the gather's backward (tensor_parallel_output_grad=False)
  just takes this rank's sequence rows of it, without SP it adds to the base layer's already all-reduced
  input gradient. dB_shard = dy_shard z^T is local by construction.

* row-parallel base (weight sharded on its input dim): A [r, in/p] is sharded on dim 1, B [out, r] is
  replicated. Forward:

      z = reduce_from_tensor_model_parallel_region(A_shard x_shard)   # fwd all-reduce, bwd identity
      y = s * B z                                                     # full output, same on all TP ranks
      y = scatter_to_sequence_parallel_region(y)                      (SP: fwd split, bwd all-gather)

  Without SP the output (like the base's all-reduced output) is replicated, so dL/dy is the same on every
  rank; under SP the scatter's backward all-gathers the sequence shards of dL/dy. Either way dB = dy z^T is
  complete and identical on every TP rank, dz is replicated and dA_shard = dz x_shard^T is this shard's
  exact gradient.

Replicated adapters (column A, row B) carry no ``tensor_model_parallel`` attribute, so megatron's grad-norm
counts them once; sharded ones (column B, row A) are marked TP-partitioned like the base weight. No adapter
is marked ``sequence_parallel`` (their grads are already complete, finalize_model_grads must not reduce them).

RL (``lora.rank``): the reference model is the same chunks with the adapters off (``adapters_disabled``,
DARE's ``compute_dtreerpo_log_prob``), and the rollout engines get the merged weights W + s B A
(``merged_weights``: the base weight's data is swapped for the merged tensor while the sync reads it, then put
back untouched).

Checkpoints: ``LoRALinear.state_dict`` / ``load_state_dict`` / ``sharded_state_dict`` keep the base layer's
keys unchanged (``...linear_qkv.weight``) and add ``...linear_qkv.lora_A`` / ``...lora_B``, sharded over TP as
above (``lora_B`` of a gated ``linear_fc1`` goes through megatron's SwiGLU factory like the weight), so a LoRA
checkpoint loads under another TP layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.transformer.mlp import MLP, apply_swiglu_sharded_factory
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import unwrap_model

from megadare.names import LORA_TARGETS

DEFAULT_TARGETS = LORA_TARGETS  # the one table (megadare/names.py): the config layer checks lora.targets by it
ADAPTERS = ("lora_A", "lora_B")


def _seed(seed: int, layer_number: int, name: str) -> int:
    h = hashlib.sha256(f"megadare-lora/{seed}/{layer_number}/{name}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def kaiming_uniform_a(rank: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """PEFT's A init: ``kaiming_uniform_(A, a=sqrt(5))`` on [r, in], i.e. U(-1/sqrt(in), 1/sqrt(in)), fp32."""
    gain = math.sqrt(2.0 / (1 + 5.0))
    bound = gain * math.sqrt(3.0 / in_features)
    return torch.empty(rank, in_features, dtype=torch.float32).uniform_(-bound, bound, generator=generator)


@dataclass(frozen=True)
class LoRASpec:
    """The adapter every wrapped linear gets: rank r, alpha (scaling alpha / r) and the seed of A's init."""

    rank: int
    alpha: float
    seed: int = 0


class LoRALinear(torch.nn.Module):
    """A frozen megatron Column/RowParallelLinear plus a TP-aware low-rank update (see the module doc).

    ``forward`` keeps the base's ``(output, bias)`` interface. Attributes the wrapper lacks (``weight``,
    ``config``, ``tp_group``...) are read from the base module.
    """

    def __init__(self, base: torch.nn.Module, spec: LoRASpec, layer_number: int = 0, name: str = "", glu: bool = False):
        super().__init__()
        rank, alpha = spec.rank, spec.alpha
        if isinstance(base, ColumnParallelLinear):
            self.kind = "column"
        elif isinstance(base, RowParallelLinear):
            self.kind = "row"
        else:
            raise TypeError(f"{name}: LoRA wraps ColumnParallelLinear / RowParallelLinear, not {type(base).__name__}")
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.enabled = True  # False: the base layer alone (the reference model of RL)
        self.r = int(rank)
        self.alpha = float(alpha)
        self.scaling = self.alpha / self.r
        self.glu = bool(glu)
        self.layer_number = layer_number
        self.lora_name = name
        w = base.weight
        tp_rank = base.tp_group.rank()
        gen = torch.Generator().manual_seed(_seed(spec.seed, layer_number, name))
        a_full = kaiming_uniform_a(self.r, base.input_size, gen)
        if self.kind == "column":
            a = a_full
            b = torch.zeros(base.output_size_per_partition, self.r)
        else:
            n = base.input_size_per_partition
            a = a_full[:, tp_rank * n : (tp_rank + 1) * n]
            b = torch.zeros(base.output_size, self.r)
        self.lora_A = torch.nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
        self.lora_B = torch.nn.Parameter(b.to(device=w.device, dtype=w.dtype).contiguous())
        sharded = self.lora_B if self.kind == "column" else self.lora_A
        set_tensor_model_parallel_attributes(sharded, True, 0 if self.kind == "column" else 1, 1)
        for p in (self.lora_A, self.lora_B):
            setattr(p, "allreduce", getattr(w, "allreduce", True))  # reduced over data parallel like the weight
        self._register_state_dict_hook(_strip_base_prefix)
        self._register_load_state_dict_pre_hook(_add_base_prefix)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if modules is not None and "base" in modules:
                return getattr(modules["base"], name)
            raise

    # ------------------------------------------------------------------ forward
    def lora_delta(self, x: torch.Tensor, gather_output: bool = False) -> torch.Tensor:
        """s * B(A(x)) laid out like the base layer's output (sharded / SP-scattered as the base's)."""
        base = self.base
        g = base.tp_group
        A, B = self.lora_A, self.lora_B
        if self.kind == "column":
            if base.sequence_parallel:
                # full sequence for A; the grad of x_full is complete on every rank -> backward only splits
                x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=g)
            z = F.linear(x.to(A.dtype), A)
            z = copy_to_tensor_model_parallel_region(z, group=g)  # bwd: sum the B-shard partials
            y = F.linear(z, B) * self.scaling
            if gather_output:
                y = gather_from_tensor_model_parallel_region(y, group=g)
            return y
        if not base.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, group=g)
        z = F.linear(x.to(A.dtype), A)
        z = reduce_from_tensor_model_parallel_region(z, group=g)  # sum of input-shard partials
        y = F.linear(z, B) * self.scaling
        if base.sequence_parallel:
            y = scatter_to_sequence_parallel_region(y, group=g)  # like the base's reduce-scatter
        return y

    def forward(self, x: torch.Tensor, *args, **kwargs):
        out, bias = self.base(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        gather = False
        if self.kind == "column":
            rt = kwargs.get("runtime_gather_output", args[1] if len(args) > 1 else None)
            gather = self.base.gather_output if rt is None else bool(rt)
        return out + self.lora_delta(x, gather).to(out.dtype), bias

    def backward_dw(self) -> None:
        self.base.backward_dw()

    # ------------------------------------------------------------------ merge
    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's base weight shard with the adapter folded in (fp32 math, base dtype)."""
        w = self.base.weight
        delta = self.scaling * (self.lora_B.float() @ self.lora_A.float())
        return (w.float() + delta).to(w.dtype)

    # ------------------------------------------------------------------ checkpoints
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The base layer's sharded keys unchanged plus ``prefix + lora_A`` / ``lora_B`` (TP-sharded)."""
        sd = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        axis = {"lora_B": 0} if self.kind == "column" else {"lora_A": 1}
        adapters = make_sharded_tensors_for_checkpoint(
            {"lora_A": self.lora_A, "lora_B": self.lora_B},
            prefix,
            axis,
            sharded_offsets,
            tp_group=self.base.tp_group,
            dp_cp_group=(metadata or {})["dp_cp_group"],
        )
        if self.glu:
            # [gate_shard; up_shard] per rank, like the fc1 weight: split so the global tensor is layout-free
            singleton = (metadata or {}).get("singleton_local_shards", False)
            adapters[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(
                adapters[f"{prefix}lora_B"], sharded_offsets, singleton
            )
        sd.update(adapters)
        return sd

    def extra_repr(self) -> str:
        return f"kind={self.kind}, r={self.r}, alpha={self.alpha}"


def _strip_base_prefix(module, state_dict, prefix, local_metadata):
    """state_dict(): ``prefix.base.X`` -> ``prefix.X`` (the plain layer's keys)."""
    p = prefix + "base."
    for k in [k for k in state_dict if k.startswith(p)]:
        state_dict[prefix + k[len(p) :]] = state_dict.pop(k)


def _add_base_prefix(state_dict, prefix, *_):  # torch's load pre-hook also passes metadata, strict, key lists
    """load_state_dict(): ``prefix.X`` -> ``prefix.base.X`` for everything but the adapters."""
    for k in [k for k in state_dict if k.startswith(prefix)]:
        rest = k[len(prefix) :]
        if rest.split(".", 1)[0] not in ADAPTERS and not rest.startswith("base."):
            state_dict[prefix + "base." + rest] = state_dict.pop(k)


# ====================================================================== model-level API
def _targets_in(chunk: torch.nn.Module, targets: Iterable[str]):
    """(parent, attr, full name, layer number, name in the layer (the seed's), glu) of each wrappable linear; the
    routed experts' are left out (their expert-parallel communication is not the TP scheme of the module doc)."""
    targets = set(targets)
    found = []
    for lname, layer in chunk.named_modules():
        if not isinstance(layer, TransformerLayer):
            continue
        for rel, mod in layer.named_modules():
            if not rel:
                continue
            parent_name, _, attr = rel.rpartition(".")
            if attr not in targets or not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                continue
            if ".experts." in f".{rel}.":
                continue
            parent = layer.get_submodule(parent_name) if parent_name else layer
            glu = attr == "linear_fc1" and isinstance(parent, MLP) and bool(parent.config.gated_linear_unit)
            found.append((parent, attr, f"{lname}.{rel}", int(layer.layer_number), rel, glu))
    return found


def apply_lora(chunks, rank: int, alpha: float, targets=DEFAULT_TARGETS, seed: int = 0) -> list[str]:
    """Wrap the matching linears of every chunk in ``LoRALinear`` and freeze all other parameters.

    Call it on the bare chunks (before ``wrap_ddp`` / ``build_optimizer``). The adapters' init depends only on
    (seed, global layer number, module name), not on the TP/PP layout. Returns the wrapped module names.
    """
    spec = LoRASpec(rank, alpha, seed)
    names = []
    for chunk in chunks:
        model = unwrap_model(chunk)
        for p in model.parameters():
            p.requires_grad_(False)
        for parent, attr, full, layer_number, seed_name, glu in _targets_in(model, targets):
            base = getattr(parent, attr)
            setattr(parent, attr, LoRALinear(base, spec, layer_number, seed_name, glu))
            names.append(full)
    if not names:
        again = any(isinstance(m, LoRALinear) for c in chunks for m in unwrap_model(c).modules())
        raise ValueError(
            "apply_lora: the chunks already carry LoRA adapters"
            if again
            else f"apply_lora: no ColumnParallelLinear/RowParallelLinear named {tuple(targets)} found"
        )
    return names


def lora_modules(chunks) -> list[tuple[str, LoRALinear]]:
    out = []
    for i, chunk in enumerate(chunks):
        pre = f"model{i}." if len(chunks) > 1 else ""
        out += [(pre + n, m) for n, m in unwrap_model(chunk).named_modules() if isinstance(m, LoRALinear)]
    return out


def lora_parameters(chunks) -> list[str]:
    """Names of the trainable (adapter) parameters, as in the chunks' state dicts (``model{i}.`` under VPP)."""
    return [f"{n}.{a}" for n, _ in lora_modules(chunks) for a in ADAPTERS]


def lora_state_dict(chunks) -> dict[str, torch.Tensor]:
    """This rank's adapter shards, detached: {``<module>.lora_A`` / ``.lora_B``: tensor}."""
    return {f"{n}.{a}": getattr(m, a).detach() for n, m in lora_modules(chunks) for a in ADAPTERS}


@torch.no_grad()
def merge_lora(chunks) -> list[str]:
    """Fold s * B @ A into each base weight shard and put the plain megatron module back.

    Column: W_shard += s * B_shard @ A; row: W_shard += s * B @ A_shard -- per rank, no communication. The
    chunks' ``sharded_state_dict`` then has exactly the plain model's keys. Nothing is unfrozen: every base
    parameter keeps ``requires_grad=False`` (set it yourself to train the merged model). Call it on the bare
    chunks or DDP-wrapped ones; a DDP wrapper / optimizer built around the LoRA model is stale afterwards.
    Returns the merged module names.
    """
    merged = []
    for chunk in chunks:
        model = unwrap_model(chunk)
        for name, mod in list(model.named_modules()):
            if not isinstance(mod, LoRALinear):
                continue
            mod.base.weight.data.copy_(mod.merged_weight())
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, mod.base)
            merged.append(name)
    return merged


@contextlib.contextmanager
def adapters_disabled(chunks) -> Iterator[None]:
    """Inside, every adapter of ``chunks`` is off: the chunks compute the frozen base model."""
    mods = [m for _, m in lora_modules(chunks)]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.enabled = True


@contextlib.contextmanager
def merged_weights(chunks) -> Iterator[None]:
    """Inside, each wrapped base weight holds W + s B A (what ``merge_lora`` would write), so readers of the
    state dict (the weight sync) see the merged model; the original tensors are put back afterwards."""
    saved = []
    with torch.no_grad():
        for _, m in lora_modules(chunks):
            w = m.base.weight
            saved.append((w, w.data))
            w.data = m.merged_weight()
    try:
        yield
    finally:
        for w, data in saved:
            w.data = data
