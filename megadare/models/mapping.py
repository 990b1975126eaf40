"""The HF <-> Megatron parameter table: rows, the tensor transforms they use, and the table builder.

The Megatron side of every row is a key of megatron's distributed checkpoint, written with
``singleton_local_shards`` metadata: global layer and expert numbers, SwiGLU ``linear_fc1`` split into
``weight_w`` (gate) and ``weight_v`` (up), TE-style names for norms fused into the following linear. That key
space does not depend on the parallel layout: the same table serves the converter (HF <-> checkpoint), loading
HF weights straight into a sharded model, and weight sync (gathered shards -> HF names).

Transforms (the only places where tensors change shape):
* ``qkv``: separate q/k/v projections <-> megatron's fused QKV, interleaved per query group
  ``[g0: q(heads/groups * d), k(d), v(d); g1: ...]`` (so a contiguous split by TP keeps groups whole).
* ``fused_qkv``: LLaDA2's ``query_key_value`` = [q; k; v] stacked <-> the interleaved layout.
* ``vocab``: rows padded to the layout-independent padded vocabulary (models/gpt.py) <-> cut back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megadare.models.family import ModelArch, ModelConfigError

OPS = ("copy", "qkv", "fused_qkv", "vocab")
# The padded vocabulary must not depend on the layout, so checkpoints stay loadable under any TP.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp: int = 1) -> int:
    """Vocabulary padded to a multiple of 128 (and of TP): independent of the layout for TP <= 128."""
    multiple = VOCAB_PAD_MULTIPLE
    while multiple % tp:
        multiple *= 2
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class ParamMap:
    """One row: a Megatron checkpoint key and the HF tensor(s) it is made of."""

    mcore: str
    hf: tuple[str, ...]
    op: str = "copy"
    heads: int = 0  # qkv ops: attention heads, kv groups, head dim
    groups: int = 0
    head_dim: int = 0
    vocab: int = 0  # vocab op: real rows, padded rows
    padded_vocab: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown mapping op {self.op!r}")
        want = 3 if self.op == "qkv" else 1
        if len(self.hf) != want:
            raise ValueError(f"{self.mcore}: op {self.op} takes {want} HF tensor(s), got {self.hf}")

    # ---------------------------------------------------------------- HF -> Megatron
    def to_mcore(self, hf_tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.op == "copy":
            return hf_tensors[0]
        if self.op == "vocab":
            t = hf_tensors[0]
            if t.shape[0] != self.vocab:
                raise ValueError(f"{self.hf[0]}: {t.shape[0]} rows, config says vocab {self.vocab}")
            if self.padded_vocab == self.vocab:
                return t
            pad = t.new_zeros((self.padded_vocab - self.vocab, *t.shape[1:]))
            return torch.cat([t, pad], dim=0)
        if self.op == "qkv":
            q, k, v = hf_tensors
        else:
            q, k, v = torch.split(hf_tensors[0], self._qkv_sizes(), dim=0)
        return interleave_qkv(q, k, v, self.heads, self.groups, self.head_dim)

    # ---------------------------------------------------------------- Megatron -> HF
    def to_hf(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.op == "copy":
            return [t]
        if self.op == "vocab":
            return [t[: self.vocab]]
        q, k, v = split_qkv(t, self.heads, self.groups, self.head_dim)
        if self.op == "qkv":
            return [q, k, v]
        return [torch.cat([q, k, v], dim=0)]

    def mcore_shape(self, hf_shapes: list[list[int]]) -> list[int]:
        """Global shape of the Megatron tensor given the HF tensors' shapes (no data needed)."""
        if self.op == "copy":
            return list(hf_shapes[0])
        if self.op == "vocab":
            return [self.padded_vocab, *hf_shapes[0][1:]]
        rows = (self.heads + 2 * self.groups) * self.head_dim
        return [rows, *hf_shapes[0][1:]]

    def hf_shape_problem(self, hf_shapes: list[list[int]]) -> Optional[str]:
        """What in the HF tensors' header shapes disagrees with the config.json the table was built from (the
        vocabulary's rows, the attention's q / k / v rows), else None."""
        if self.op == "vocab" and hf_shapes[0][0] != self.vocab:
            return f"{self.hf[0]} has {hf_shapes[0][0]} rows, config.json's vocab_size is {self.vocab}"
        if self.op not in ("qkv", "fused_qkv"):
            return None
        sizes = self._qkv_sizes()
        want = sizes if self.op == "qkv" else [sum(sizes)]
        got = [shape[0] for shape in hf_shapes]
        if got == want:
            return None
        return (
            f"{', '.join(self.hf)} have {got} rows, config.json's {self.heads} heads, {self.groups} key-value "
            f"heads of {self.head_dim} give {want}"
        )

    def _qkv_sizes(self) -> list[int]:
        return [self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim]


def interleave_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, head_dim: int
) -> torch.Tensor:
    """[q; k; v] (HF rows) -> megatron's per-group interleaved rows. Works for weights and biases."""
    rest = q.shape[1:]
    qg = q.reshape(groups, heads // groups * head_dim, *rest)
    kg = k.reshape(groups, head_dim, *rest)
    vg = v.reshape(groups, head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(t: torch.Tensor, heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Inverse of ``interleave_qkv``."""
    rest = t.shape[1:]
    per = heads // groups * head_dim
    g = t.reshape(groups, per + 2 * head_dim, *rest)
    q = g[:, :per].reshape(heads * head_dim, *rest)
    k = g[:, per : per + head_dim].reshape(groups * head_dim, *rest)
    v = g[:, per + head_dim :].reshape(groups * head_dim, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


@dataclass(frozen=True)
class HFNames:
    """A family's HF parameter names. Layer templates take ``{i}`` (layer) and ``{e}`` (expert).

    ``q``/``k``/``v`` for separate projections, or ``qkv`` for a fused [q; k; v] projection. ``*_bias``
    templates only where the family has biases. MoE names only for MoE families.
    """

    embed: str
    final_norm: str
    lm_head: str
    input_norm: str
    post_norm: str
    o: str
    q: str = ""
    k: str = ""
    v: str = ""
    qkv: str = ""
    q_bias: str = ""
    k_bias: str = ""
    v_bias: str = ""
    q_norm: str = ""
    k_norm: str = ""
    gate: str = ""
    up: str = ""
    down: str = ""
    router: str = ""
    expert_bias: str = ""
    expert_gate: str = ""
    expert_up: str = ""
    expert_down: str = ""
    shared_gate: str = ""
    shared_up: str = ""
    shared_down: str = ""


def build_table(arch: ModelArch, n: HFNames, padded_vocab: Optional[int] = None) -> list[ParamMap]:
    """The full table of a checkpoint: every Megatron key with the HF tensors it is made of."""
    pv = padded_vocab or padded_vocab_size(arch.vocab_size)
    qkv = dict(heads=arch.num_attention_heads, groups=arch.num_kv_heads, head_dim=arch.head_dim)
    rows = [ParamMap("embedding.word_embeddings.weight", (n.embed,), "vocab", vocab=arch.vocab_size, padded_vocab=pv)]
    moe_layers = set(arch.moe_layers())
    for i in range(arch.num_layers):
        L = f"decoder.layers.{i}."
        f = lambda tmpl, **kw: tmpl.format(i=i, **kw)  # noqa: E731
        rows.append(ParamMap(L + "self_attention.linear_qkv.layer_norm_weight", (f(n.input_norm),)))
        if n.qkv:
            rows.append(ParamMap(L + "self_attention.linear_qkv.weight", (f(n.qkv),), "fused_qkv", **qkv))
        else:
            rows.append(ParamMap(L + "self_attention.linear_qkv.weight", (f(n.q), f(n.k), f(n.v)), "qkv", **qkv))
        if arch.qkv_bias:
            rows.append(
                ParamMap(L + "self_attention.linear_qkv.bias", (f(n.q_bias), f(n.k_bias), f(n.v_bias)), "qkv", **qkv)
            )
        if arch.qk_norm:
            rows.append(ParamMap(L + "self_attention.q_layernorm.weight", (f(n.q_norm),)))
            rows.append(ParamMap(L + "self_attention.k_layernorm.weight", (f(n.k_norm),)))
        rows.append(ParamMap(L + "self_attention.linear_proj.weight", (f(n.o),)))
        if i in moe_layers:
            rows.append(ParamMap(L + "pre_mlp_layernorm.weight", (f(n.post_norm),)))
            rows.append(ParamMap(L + "mlp.router.weight", (f(n.router),)))
            if arch.moe_expert_bias:
                rows.append(ParamMap(L + "mlp.router.expert_bias", (f(n.expert_bias),)))
            for e in range(arch.num_experts):
                E = L + f"mlp.experts.experts.{e}."
                rows.append(ParamMap(E + "linear_fc1.weight_w", (f(n.expert_gate, e=e),)))
                rows.append(ParamMap(E + "linear_fc1.weight_v", (f(n.expert_up, e=e),)))
                rows.append(ParamMap(E + "linear_fc2.weight", (f(n.expert_down, e=e),)))
            if arch.num_shared_experts:
                S = L + "mlp.shared_experts."
                rows.append(ParamMap(S + "linear_fc1.weight_w", (f(n.shared_gate),)))
                rows.append(ParamMap(S + "linear_fc1.weight_v", (f(n.shared_up),)))
                rows.append(ParamMap(S + "linear_fc2.weight", (f(n.shared_down),)))
        else:
            rows.append(ParamMap(L + "mlp.linear_fc1.layer_norm_weight", (f(n.post_norm),)))
            rows.append(ParamMap(L + "mlp.linear_fc1.weight_w", (f(n.gate),)))
            rows.append(ParamMap(L + "mlp.linear_fc1.weight_v", (f(n.up),)))
            rows.append(ParamMap(L + "mlp.linear_fc2.weight", (f(n.down),)))
    rows.append(ParamMap("decoder.final_layernorm.weight", (n.final_norm,)))
    if not arch.tie_word_embeddings:
        rows.append(ParamMap("output_layer.weight", (n.lm_head,), "vocab", vocab=arch.vocab_size, padded_vocab=pv))
    return rows


def check_table(rows: list[ParamMap], hf_names: set[str], where: str) -> None:
    """Every HF tensor is used exactly once and every table entry exists: a silent mismatch loads wrong weights."""
    used: dict[str, str] = {}
    for r in rows:
        for h in r.hf:
            if h in used:
                raise ValueError(f"{where}: HF tensor {h!r} mapped twice ({used[h]} and {r.mcore})")
            used[h] = r.mcore
    missing = sorted(set(used) - hf_names)
    extra = sorted(hf_names - set(used))
    if missing or extra:
        msg = [f"{where}: the checkpoint does not match its config.json"]
        if missing:
            msg.append(f"missing tensors ({len(missing)}): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if extra:
            msg.append(f"unexpected tensors ({len(extra)}): {extra[:8]}{' ...' if len(extra) > 8 else ''}")
        raise ModelConfigError("; ".join(msg) + "; put the checkpoint's own config.json beside its safetensors")
