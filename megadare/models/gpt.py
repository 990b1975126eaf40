"""Build the Megatron ``GPTModel`` of any family from its normalised ``ModelArch``.

Every family is a decoder-only transformer that megatron-core already knows; what differs is captured by
``ModelArch`` (QK norm, QKV bias, partial RoPE, MoE routing, leading dense layers). This file turns it into a
``TransformerConfig`` and a layer spec: megatron's local (non-TE) linear layers, our SP-capable RMSNorm and our
dLLM core attention (models/attention.py), swapped in as spec submodules -- no fork of megatron's layers.

``DLLMGPTModel`` adds two things to ``GPTModel``: RoPE from explicit ``position_ids`` (block-diffusion training
feeds x_t ++ x_0 where x_0 token i sits at position i again, and packed samples restart at 0), and the output
layer on the scored positions only when the trainer passes a ``ScoredTargets`` as ``labels`` (models/head.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megadare.models.mapping import padded_vocab_size
from megadare.models import mcore_fixes
from megadare.models.attention import DLLMCoreAttention
from megadare.models.family import ModelArch
from megadare.models.head import HeadSettings, ScoredTargets, scored_output
from megadare.models.norm import RMSNorm

mcore_fixes.apply()

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_config(arch: ModelArch, dtype: str = "fp32", **overrides) -> TransformerConfig:
    """ModelArch (+ the live parallel layout) -> megatron TransformerConfig."""
    ps = parallel_state
    params_dtype = DTYPES[dtype]
    kw = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=params_dtype,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        pipeline_dtype=params_dtype,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        sequence_parallel=False,
    )
    if arch.is_moe:
        kw.update(
            num_moe_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_router_topk=arch.moe_topk,
            moe_router_score_function=arch.moe_score_function,
            # softmax + renormalised top-k == softmax over the top-k logits (megatron's default order);
            # softmax without renormalisation == softmax over all experts first.
            moe_router_pre_softmax=arch.moe_score_function == "softmax" and not arch.moe_norm_topk_prob,
            moe_router_enable_expert_bias=arch.moe_expert_bias,
            moe_router_topk_scaling_factor=arch.moe_routed_scaling if arch.moe_routed_scaling != 1.0 else None,
            moe_router_num_groups=arch.moe_num_groups or None,
            moe_router_group_topk=arch.moe_topk_groups or None,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_layer_freq=[0 if i < arch.first_k_dense else 1 for i in range(arch.num_layers)],
            moe_shared_expert_intermediate_size=(
                arch.num_shared_experts * arch.moe_ffn_hidden_size if arch.num_shared_experts else None
            ),
            moe_shared_expert_overlap=False,
        )
    kw.update(overrides)
    return TransformerConfig(**kw)


@dataclass(frozen=True)
class LayerModules:
    """The modules a training run may swap in a layer spec, the same weights either way: ``norm`` ``RMSNorm`` or
    ``FusedRMSNorm`` (``train.fused_elementwise``), ``experts`` megatron's ``SequentialMLP`` or ``GroupedExperts``
    (``train.grouped_experts``, models/experts.py)."""

    norm: type = RMSNorm
    experts: type = SequentialMLP


def _dense_mlp() -> ModuleSpec:
    return ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )


def _moe_mlp(experts: type) -> ModuleSpec:
    mlp = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=experts, submodules=mlp),
            shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=mlp),
        ),
        metainfo={"fuse_pre_mlp_layernorm": False},
    )


def _core_attention(backend: str):
    """Our dLLM core attention, or megatron's own ``DotProductAttention`` ("local": the baseline that
    materialises the score matrix; it takes Megatron-convention bool mask tensors, not MaskSpecs)."""
    if backend == "local":
        return DotProductAttention
    return functools.partial(DLLMCoreAttention, backend=backend)


def layer_spec(
    arch: ModelArch, moe: bool, attention_backend: str = "auto", modules: LayerModules = LayerModules()
) -> ModuleSpec:
    """One transformer layer: RMSNorm -> attention (fused QKV, optional QK norm) -> RMSNorm -> MLP or MoE, with
    ``modules``' norm and experts.

    Checkpoint keys follow megatron's TE-spec names (input norm fused into linear_qkv, dense pre-MLP norm
    fused into linear_fc1), so our distributed checkpoints load into TE-spec models and back.
    """
    norm = modules.norm
    keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if not moe:
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.arbitrary},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=_core_attention(attention_backend),
                    linear_proj=RowParallelLinear,
                    q_layernorm=norm if arch.qk_norm else IdentityOp,
                    k_layernorm=norm if arch.qk_norm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=_moe_mlp(modules.experts) if moe else _dense_mlp(),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def block_spec(
    arch: ModelArch,
    config: TransformerConfig,
    vp_stage: Optional[int] = None,
    attention_backend: str = "auto",
    modules: LayerModules = LayerModules(),
) -> TransformerBlockSubmodules:
    """The layers this pipeline stage (and virtual stage) builds, dense or MoE per layer."""
    moe_layers = set(arch.moe_layers())
    specs = [layer_spec(arch, i in moe_layers, attention_backend, modules) for i in range(arch.num_layers)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + n], layer_norm=modules.norm)


class DLLMGPTModel(GPTModel):
    """GPTModel whose RoPE follows explicit ``position_ids`` ([B, S] or [S]) when they are given.

    Under context parallelism the caller passes this rank's contiguous chunk of ``position_ids`` (with the
    matching token chunk); the RoPE table is indexed by those positions directly. megatron's
    ``RotaryEmbedding.forward`` would cut its table into the zigzag CP layout, which is not ours, so the table is
    built here from ``inv_freq`` (``rope_table``) and megatron's own rotary computation is skipped.

    ``head_settings``: how a training step computes the output layer (trainer/step.py reads it).
    """

    head_settings: HeadSettings = HeadSettings()

    def _postprocess(self, hidden_states, labels=None, **kwargs):
        """``labels`` a ``ScoredTargets``: the output layer at the scored positions only (models/head.py)."""
        if isinstance(labels, ScoredTargets):
            return scored_output(self, hidden_states, labels) if self.post_process else hidden_states
        return super()._postprocess(hidden_states, labels=labels, **kwargs)

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        if position_ids is None or self.position_embedding_type != "rope":
            return super()._preprocess(input_ids, position_ids, *args, **kwargs)
        # skip megatron's (CP-sliced, discarded) table: with no rope type _preprocess builds none
        self.position_embedding_type = "none"
        try:
            out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        finally:
            self.position_embedding_type = "rope"
        pos = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
        if pos.shape[0] > 1 and not bool((pos == pos[:1]).all()):
            emb = rope_table(self.rotary_pos_emb, pos.t()).unsqueeze(2)  # [S, B, 1, rot_dim]
        else:
            emb = rope_table(self.rotary_pos_emb, pos[0])[:, None, None]  # [S, 1, 1, rot_dim]
        return (out[0], emb, *out[2:])


def rope_table(rope, positions: torch.Tensor) -> torch.Tensor:
    """megatron's unsliced RoPE embedding (``RotaryEmbedding.get_emb`` before any CP slicing) at arbitrary
    positions: [..., rot_dim] for ``positions`` of shape [...]. Bitwise equal to ``get_emb(P)[positions]``."""
    inv_freq = rope.inv_freq
    if inv_freq.device != positions.device:
        inv_freq = inv_freq.to(positions.device)
    seq = positions.to(inv_freq.dtype)
    if rope.seq_len_interpolation_factor is not None:
        seq = seq * (1 / rope.seq_len_interpolation_factor)
    freqs = seq.unsqueeze(-1) * inv_freq  # == torch.outer for 1-D positions
    if not rope.rotary_interleaved:
        return torch.cat((freqs, freqs), dim=-1)
    return torch.stack((freqs, freqs), dim=-1).flatten(-2)


def build_model(
    arch: ModelArch,
    config: TransformerConfig,
    vp_stage: Optional[int] = None,
    attention_backend: str = "auto",
    head: Optional[HeadSettings] = None,
    modules: LayerModules = LayerModules(),
) -> DLLMGPTModel:
    """The model chunk of this rank (and virtual stage). Logits stay vocab-parallel unless gathered. ``modules``:
    the norm and experts modules (``LayerModules``)."""
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = DLLMGPTModel(
        config=config,
        transformer_layer_spec=block_spec(arch, config, vp_stage, attention_backend, modules),
        vocab_size=padded_vocab_size(arch.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=arch.rotary_percent,
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        parallel_output=True,
        vp_stage=vp_stage,
    )
    if head is not None:
        model.head_settings = head
    return model


def build_model_chunks(
    arch: ModelArch,
    config: TransformerConfig,
    attention_backend: str = "auto",
    head: Optional[HeadSettings] = None,
    modules: LayerModules = LayerModules(),
) -> list[DLLMGPTModel]:
    """All model chunks of this rank: one per virtual pipeline stage (one without interleaving), on this rank's
    GPU when there is one. megatron creates most weights there already (``use_cpu_initialization=False``), but
    modules built by plain torch (our RMSNorm, the MoE router's weight) start on the CPU; megatron's own trainer
    moves every chunk with ``.cuda()`` as this does. ``head``: how a training step runs the output layer;
    ``modules``: see ``build_model``."""
    vpp = config.virtual_pipeline_model_parallel_size or 1
    chunks = [build_model(arch, config, i if vpp > 1 else None, attention_backend, head, modules) for i in range(vpp)]
    if torch.cuda.is_available():
        for c in chunks:
            c.cuda(torch.cuda.current_device())
    return chunks
