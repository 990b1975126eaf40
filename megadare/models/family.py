"""What every model family states, and the registry that recognises a checkpoint's family.

A family file (sdar.py, llada2.py, llada.py, dream.py) defines one or more ``Family`` objects (with
``models.hf.decoder_family``) and registers them. A family is recognised by the ``architectures`` entry of the checkpoint's config.json. The family is the
single place that states: the mask token id, the default block size, the attention kind, how config.json maps
to a Megatron ``TransformerConfig`` and layer spec, and the one HF <-> Megatron parameter table.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Optional

from megadare.errors import ModelConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from megadare.models.mapping import ParamMap


class MaskKind(str, Enum):
    """The attention masks of megadare (models/attention.py). A family's own mask is block-causal (block-diffusion
    families: SDAR, TraDo, LLaDA2) or bidirectional (LLaDA, Dream); block-diffusion is the training mask of the
    block-causal families (x_t ++ x_0). A member equals its string value ("block_causal" == MaskKind.BLOCK_CAUSAL)."""

    BIDIRECTIONAL = "bidirectional"
    BLOCK_CAUSAL = "block_causal"
    BLOCK_DIFFUSION = "block_diffusion"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ModelArch:
    """Architecture facts of one checkpoint, normalised across families (read from config.json)."""

    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int  # dense MLP width (dense layers of a MoE model too)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    mask_token_id: int
    attention: MaskKind  # the family's mask: BLOCK_CAUSAL or BIDIRECTIONAL (a string value is read as one)
    block_size: int  # default denoising block (block-diffusion families); 0 otherwise
    rotary_percent: float = 1.0
    qk_norm: bool = False
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    logits_shift: int = 0  # Dream: logits at i predict token i+1
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    num_shared_experts: int = 0
    first_k_dense: int = 0  # leading dense layers of a MoE model
    moe_score_function: str = "softmax"  # "softmax" | "sigmoid"
    moe_norm_topk_prob: bool = True
    moe_routed_scaling: float = 1.0
    moe_num_groups: int = 0  # group-limited routing (0 = off)
    moe_topk_groups: int = 0
    moe_expert_bias: bool = False

    def __post_init__(self) -> None:
        if self.attention not in (MaskKind.BLOCK_CAUSAL, MaskKind.BIDIRECTIONAL):
            raise ModelConfigError(f"attention={self.attention!r} must be 'block_causal' or 'bidirectional'")
        object.__setattr__(self, "attention", MaskKind(self.attention))

    @property
    def is_block_diffusion(self) -> bool:
        """A block-diffusion family (block-causal attention, denoising block by block: SDAR, TraDo, LLaDA2)."""
        return self.attention is MaskKind.BLOCK_CAUSAL

    @property
    def training_mask(self) -> MaskKind:
        """The mask whole-response RL and DPO rows train with: block diffusion (x_t ++ x_0) for block-diffusion
        families, the family's bidirectional mask otherwise."""
        return MaskKind.BLOCK_DIFFUSION if self.is_block_diffusion else MaskKind.BIDIRECTIONAL

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_layers(self) -> list[int]:
        """Indices of MoE layers (all but the leading dense ones) -- empty for dense models."""
        if not self.is_moe:
            return []
        return list(range(self.first_k_dense, self.num_layers))


@dataclass
class Family:
    """One model family. Concrete families fill in the callables in their own file (``models.hf.decoder_family``)."""

    name: str
    architectures: tuple[str, ...]
    # config.json dict -> normalised facts (validates keys, raises ModelConfigError naming the key)
    arch: Callable[[dict], ModelArch]
    # config.json dict -> the HF-layout torch model class instance (megadare.models.hf)
    hf_model: Callable[[dict], "torch.nn.Module"]
    # config.json dict -> the one HF <-> Megatron parameter table (list of ParamMap rows)
    mapping: Callable[[dict], list["ParamMap"]]
    # small config.json for tests and the demo (random weights); kwargs override fields
    tiny_config: Optional[Callable[..., dict]] = None
    extra: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {}
_BY_ARCH: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.name in FAMILIES:
        raise ValueError(f"family {family.name!r} registered twice")
    FAMILIES[family.name] = family
    for a in family.architectures:
        _BY_ARCH[a] = family
    return family


def _ensure_loaded() -> None:
    # Import the family files so they register themselves.
    from megadare.models import dream, llada, llada2, sdar  # noqa: F401  # cycle: each imports this module


def read_hf_config(path_or_dict: str | os.PathLike | dict) -> dict:
    """config.json as a dict, from a checkpoint directory, a config.json path, or a dict."""
    if isinstance(path_or_dict, dict):
        return path_or_dict
    p = os.fspath(path_or_dict)
    if os.path.isdir(p):
        _refuse_megatron_dir(p)
        p = os.path.join(p, "config.json")
    if not os.path.exists(p):
        what = "no config.json found" if os.path.isdir(os.fspath(path_or_dict)) else "does not exist"
        raise ModelConfigError(f"{p}: {what}; point to an HF checkpoint directory")
    with open(p) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            fix = (
                "put the checkpoint's own config.json there"
                if os.path.isdir(os.fspath(path_or_dict))
                else "point to an HF checkpoint directory (its config.json)"
            )
            raise ModelConfigError(f"{p}: not valid JSON ({e}); {fix}") from e
    if not isinstance(hf, dict):
        raise ModelConfigError(
            f"{p}: holds a JSON {type(hf).__name__}, not an object of the model's settings (architectures, "
            "hidden_size, ...); put the checkpoint's own config.json there"
        )
    return hf


def _refuse_megatron_dir(path: str) -> None:
    """A Megatron checkpoint (a run's ckpt/ or an iter_* in it) where an HF one is expected: say how to export it."""
    names = set(os.listdir(path))
    if "config.json" in names or not (
        {"latest_checkpointed_iteration.txt", "metadata.json"} & names or any(n.startswith("iter_") for n in names)
    ):
        return
    raise ModelConfigError(
        f"{path} is a Megatron checkpoint, not an HF one; export it first: megadare convert megatron-to-hf "
        f"--ckpt {path} --out NEW_DIR, then point to NEW_DIR"
    )


def family_of(hf_config: str | os.PathLike | dict) -> Family:
    """The family that serves a checkpoint, recognised by config.json's ``architectures``."""
    _ensure_loaded()
    cfg = read_hf_config(hf_config)
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in _BY_ARCH:
            return _BY_ARCH[a]
    known = ", ".join(sorted(_BY_ARCH))
    raise ModelConfigError(
        f"config.json architectures={archs!r} is not a known dLLM family; known architectures: {known}"
    )


def get_family(name: str) -> Family:
    _ensure_loaded()
    if name not in FAMILIES:
        raise ModelConfigError(f"unknown family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


# Names a config.json may use for a key megadare reads: the attribute_map of transformers' own config classes
# (transformers 5 saves Qwen3-MoE's ``num_experts`` as ``num_local_experts``: Qwen3MoeConfig.attribute_map).
# tests/test_hf_models.py checks this table against the installed transformers' config classes.
KEY_ALIASES: dict[str, tuple[str, ...]] = {"num_experts": ("num_local_experts",)}
# transformers 5 saves ``rope_theta`` (and ``partial_rotary_factor`` where a model has one) inside ``rope_parameters``
ROPE_PARAMETER_KEYS = ("rope_theta", "partial_rotary_factor")


def canonical_config(cfg: dict, where: str) -> dict:
    """config.json with the keys megadare reads under their canonical names: a key written under an alias that
    transformers accepts for it (``KEY_ALIASES``) or inside transformers 5's ``rope_parameters`` is copied to its
    canonical name. The same key under two names with different values is an error; so is a ``rope_parameters``
    of a ``rope_type`` other than ``default`` or a ``rope_scaling`` (a RoPE scaling megadare does not implement),
    for every family: the publishers' code applies it, so ignoring it would load a different model."""
    out = dict(cfg)
    scaling = out.get("rope_scaling")
    if scaling and not (isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default"):
        raise ModelConfigError(
            f"{where}: config.json rope_scaling={scaling!r} is not supported; megadare implements plain RoPE, as "
            "the published dLLM checkpoints use: remove it, or train a model without it"
        )
    found: dict[str, list[tuple[str, Any]]] = {}
    for key, names in KEY_ALIASES.items():
        for name in names:
            if out.get(name) is not None:
                found.setdefault(key, []).append((name, out[name]))
    rope = out.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, dict):
            raise ModelConfigError(f"{where}: config.json rope_parameters={rope!r} must be a mapping")
        if rope.get("rope_type", "default") != "default":
            raise ModelConfigError(
                f"{where}: config.json rope_parameters={rope!r}: rope_type "
                f"{rope['rope_type']!r} is not supported; megadare implements plain RoPE "
                "(rope_type 'default'), as the published dLLM checkpoints use"
            )
        for key in ROPE_PARAMETER_KEYS:
            if rope.get(key) is not None:
                found.setdefault(key, []).append((f"rope_parameters.{key}", rope[key]))
    for key, values in found.items():
        if out.get(key) is not None:
            values = [(key, out[key])] + values
        if len({v for _, v in values}) > 1:
            raise ModelConfigError(
                f"{where}: config.json gives {key!r} different values under different names: "
                + ", ".join(f"{n}={v!r}" for n, v in values)
                + "; keep one"
            )
        out[key] = values[0][1]
    return out


def require(cfg: dict, key: str, typ: type | tuple[type, ...], where: str) -> Any:
    """cfg[key], checked for presence and type, with an error naming the key and the checkpoint."""
    if key not in cfg:
        raise ModelConfigError(f"{where}: config.json has no {key!r}; it is required for this family")
    v = cfg[key]
    if isinstance(v, bool) and typ in (int, float):
        raise ModelConfigError(f"{where}: config.json {key!r}={v!r} must be a number")
    if not isinstance(v, typ):
        raise ModelConfigError(f"{where}: config.json {key!r}={v!r} has type {type(v).__name__}, expected {typ}")
    return v
