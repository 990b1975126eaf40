"""Trainer memory per GPU: weights, gradients, optimizer states, activations -- megatron-core's accounting.

Model state (megatron DistributedOptimizer docs, "bytes per parameter"; megadare's DDP keeps fp32 gradient
buffers, ``grad_reduce_in_fp32=True`` in trainer/optim.py):

    weights    = P * w,              w = 2 (bf16 / fp16) or 4 (fp32)
    gradients  = P * 4               fp32 grad buffer, not sharded (ZeRO-1)
    optimizer  = P * o / D,          o = 12 for bf16 / fp16 (4 fp32 master + 8 Adam m, v), 8 for fp32 (the master
                                     is the weight itself); D = data-parallel size with the distributed optimizer
                                     (dense params: dp * cp; expert params: expert-dp = world / (etp * ep * pp)),
                                     1 without it
    -> bf16: 6 + 12/D bytes per parameter, fp32: 8 + 8/D (megatron's table: 6 + 12/d and 8 + 8/d).

P is the GPU's own shard (``params.rank_params``). An RL job whose algorithm anchors a KL term to a reference
model holds a second, frozen copy of the weights (``reference = P_rank * w``).

Activations: the method of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", arXiv:2205.05198, Sec. 4: count every tensor a layer saves for backward), applied to what megadare's
layers save -- checked tensor by tensor with ``torch.autograd.graph.saved_tensors_hooks`` on CPU (tests/test_plan.py):
HF-order RMSNorm (an fp32 copy of its input, the normalised input, and its output saved by the next linear),
megatron's unfused SwiGLU (gate+up output 2f, silu output f, ``x_linear + offset`` f, product f: 5f; routed
experts also keep the prob-scaled product: 6f), no dropout (no masks). Korthikanti's 34sbh + 5as^2b becomes,
per layer and micro-batch (a = activation bytes, 2 bf16 / 4 fp32; b micro-batch rows; S = train.seq_length tokens
per row -- block-diffusion rows hold x_t ++ x_0, so S is twice the text they carry, see config.resolve_sft_mode;
n = S*b/cp tokens on the GPU; n_sp = n/t with parallel.sp, else n; t = tp; q = a_h*d, kv = g*d):

    norms              n_sp * 2h * (4 + 2a)            input and pre-MLP RMSNorm (+ the QKV / MLP input)
    attention          n * a * (q + 2kv + (q + kv) + q) / t     QKV output, rotated q/k, output-projection input
    QK norm            n * (a (q + kv) + 4 (q + kv)) / t        normalised q/k, fp32 copies (fp32: k aliases QKV)
    RoPE               n * 4 * d_rot * a               cos / sin of q and k, per position of each packed row
    core attention     n * (a q + 4 a_h) / t           flash / flex output and log-sum-exp
      + sdpa           b * S^2 * a                     the dense mask, as an additive float bias
      + local / ref.   b * (a_h / (t cp)) * S^2 * p + b * S^2    softmax probs (p = 4 reference, a local), mask
    dense MLP          n * a * 5f / t
    MoE                n * a * 5 (n_s f_e) / t         shared expert
                       n_sp * (5E + 20k)               router logits, probs, routing map, top-k indices
                       n_sp * a * k * (etp*h + 6 f_e)  dispatched tokens (gathered over ETP), routed experts

Recompute: ``none`` keeps all of it; ``selective`` (megatron's ``core_attn``) drops the core-attention term;
``full`` (uniform, one layer per checkpoint) keeps a * n_sp * h per layer plus one layer's full activations
while that layer is recomputed. Sequence-parallel regions divide by t only with parallel.sp (Korthikanti Table 2).

Pipeline (1F1B): pipeline rank r holds the activations of min(m, pp - r) micro-batches (m per optimizer step);
interleaved (vpp > 1), min(m*vpp, 2(pp - r - 1) + (vpp - 1)pp + 1) model chunks of L/(pp*vpp) layers -- rank 0
holds L(1 + (pp-1)/(pp*vpp)) layer-micro-batches (Korthikanti Sec. 4.2.3). The last stage also holds one
micro-batch's final norm n_sp * h * (4 + 2a) and its output layer + loss (``train.logits``, models/head.py):

    full     n * V_pad/t * (a + 4)                  model-dtype logits of every position and the fp32 softmax that
                                                    vocab-parallel cross entropy keeps for backward
    scored   c * V_pad/t * (4 + a' + 4e)            one chunk of fp32 logits (a' = a for bf16 / fp16: the matmul
           + n_s * h * (a + 4)                      output before the cast; e = 1 with the entropy RL reports; the
           + min(V_pad/t * h * a', chunk_mb)        backward's blocks of vocabulary rows are no larger), the gathered
                                                    scored hidden states and the fp32 sum of their gradient, a bf16
                                                    model's upcast block (on a CPU; a CUDA GEMM sums into fp32 itself)

with n_s = n / 2 scored positions at most for x_t ++ x_0 rows (block SFT, RL on a block family: only x_t is
scored), n otherwise, and c = min(n_s, chunk_tokens(V_pad/t, train.logits_chunk_mb)) tokens per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from megadare.algos import build_algorithm
from megadare.config import Config, resolve_sft_mode
from megadare.models.head import chunk_tokens
from megadare.models.mapping import padded_vocab_size
from megadare.models.family import ModelArch
from megadare.parallel.layout import Layout
from megadare.plan.params import rank_params, stage_layers

GIB = float(2**30)
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OPTIM_BYTES = {"bf16": 12, "fp16": 12, "fp32": 8}
GRAD_BYTES = 4
MATERIALISED = ("local", "reference")  # attention backends that store the S x S softmax
QUADRATIC = MATERIALISED + ("sdpa",)  # ... or an S x S mask; auto (flex on GPU) and flex keep neither


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one GPU of pipeline rank ``rank``."""

    rank: int
    params: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    reference: float
    reserve: float
    in_flight: int  # micro-batches (model chunks with vpp) whose activations are held

    @property
    def total(self) -> float:
        return (
            self.weights + self.grads + self.optimizer + self.activations + self.logits + self.reference + self.reserve
        )

    @property
    def static(self) -> float:
        """What stays resident while rollout engines run on the same GPU (activations are freed)."""
        return self.weights + self.grads + self.optimizer + self.reference + self.reserve


def trainer_world(cfg: Config) -> int:
    """The trainer's GPUs in the plan: the cluster's less the rollout engines'."""
    pl = cfg.plan
    return pl.nodes * pl.gpus_per_node - pl.rollout_gpus


def trainer_layout(cfg: Config) -> Layout:
    return Layout.of(cfg.parallel, trainer_world(cfg))


def model_state_bytes(
    arch: ModelArch, lay: Layout, dtype: str, distributed_optimizer: bool, rank: int = 0
) -> tuple[int, float, float, float]:
    """(parameters, weight, gradient, optimizer bytes) on one GPU of pipeline rank ``rank``."""
    rp = rank_params(arch, lay, rank)
    o = OPTIM_BYTES[dtype]
    d_dense = lay.dp * lay.cp if distributed_optimizer else 1
    d_expert = lay.expert_dp if distributed_optimizer else 1
    return (
        rp.total,
        float(rp.total * WEIGHT_BYTES[dtype]),
        float(rp.total * GRAD_BYTES),
        o * rp.dense / d_dense + o * rp.expert / d_expert,
    )


def layer_activation_bytes(arch: ModelArch, moe: bool, lay: Layout, cfg: Config) -> tuple[float, float]:
    """(bytes kept under selective recompute, core-attention bytes it drops) of one layer and micro-batch of
    cfg.train's shape, in cfg.model's dtype and attention backend."""
    seq, mbs, act = cfg.train.seq_length, cfg.train.micro_batch_size, WEIGHT_BYTES[cfg.model.dtype]
    backend = cfg.model.attention_backend
    h, d, t = arch.hidden_size, arch.head_dim, lay.tp
    heads, q, kv = arch.num_attention_heads, arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    n = seq * mbs / lay.cp
    n_sp = n / t if lay.sp else n
    attn = act * (q + 2 * kv + (q + kv) + q)
    if arch.qk_norm:
        attn += act * (q + kv) + 4 * ((q + kv) if act < 4 else q)
    kept = n_sp * 2 * h * (4 + 2 * act) + n * attn / t + 4 * d * arch.rotary_percent * act * n
    if moe:
        f_e = arch.moe_ffn_hidden_size
        kept += n * act * 5 * arch.num_shared_experts * f_e / t + n_sp * (5 * arch.num_experts + 20 * arch.moe_topk)
        kept += n_sp * act * arch.moe_topk * (lay.etp * h + 6 * f_e)
    else:
        kept += n * act * 5 * arch.ffn_hidden_size / t
    core = n * (act * q + 4 * heads) / t
    if backend == "sdpa":
        core += mbs * seq * seq * act
    elif backend in MATERIALISED:
        probs = 4 if backend == "reference" else act
        core += mbs * heads / (t * lay.cp) * seq * seq * probs + mbs * seq * seq
    return kept, core


def in_flight(lay: Layout, micro_batches: int, rank: int) -> int:
    """Model chunks (micro-batches when vpp is off) whose activations pipeline rank ``rank`` holds at peak."""
    if lay.vpp is None:
        return max(1, min(micro_batches, lay.pp - rank))
    warmup = 2 * (lay.pp - rank - 1) + (lay.vpp - 1) * lay.pp
    return max(1, min(micro_batches * lay.vpp, warmup + 1))


def stage_activation_bytes(arch: ModelArch, lay: Layout, cfg: Config, micro_batches: int, rank: int) -> float:
    """Activations held by pipeline rank ``rank`` at its peak under cfg.train.recompute."""
    t = cfg.train
    act = WEIGHT_BYTES[cfg.model.dtype]
    moe_layers = set(arch.moe_layers())
    layers = stage_layers(arch, lay.pp, lay.vpp, rank)
    full_layers = []
    for i in layers:
        kept, core = layer_activation_bytes(arch, i in moe_layers, lay, cfg)
        full_layers.append(kept + (0.0 if t.recompute == "selective" else core))
    chunks = in_flight(lay, micro_batches, rank)
    per_chunk = len(layers) / (lay.vpp or 1)
    if t.recompute == "full":
        n_sp = t.seq_length * t.micro_batch_size / lay.cp / (lay.tp if lay.sp else 1)
        return act * n_sp * arch.hidden_size * per_chunk * chunks + max(full_layers)
    return sum(full_layers) / (lay.vpp or 1) * chunks


def scored_head(arch: ModelArch, lay: Layout, cfg: Config) -> tuple[float, int]:
    """(scored positions of one micro-batch at most, tokens per logits chunk) on a last-stage GPU."""
    n = cfg.train.seq_length * cfg.train.micro_batch_size / lay.cp
    block_rows = arch.is_block_diffusion and (cfg.plan.job == "rl" or resolve_sft_mode(cfg, arch) == "block")
    scored = n / 2 if block_rows else n
    vocab = padded_vocab_size(arch.vocab_size, lay.tp) // lay.tp
    return scored, int(min(scored, chunk_tokens(vocab, cfg.train.logits_chunk_mb)))


def logits_bytes(arch: ModelArch, lay: Layout, cfg: Config) -> float:
    """One micro-batch's final norm, output layer and loss on the last stage (``train.logits``, module doc)."""
    act = WEIGHT_BYTES[cfg.model.dtype]
    n = cfg.train.seq_length * cfg.train.micro_batch_size / lay.cp
    vocab = padded_vocab_size(arch.vocab_size, lay.tp) / lay.tp
    norm = (n / lay.tp if lay.sp else n) * arch.hidden_size * (4 + 2 * act)
    if cfg.train.logits == "full":
        return n * vocab * (act + 4) + norm
    scored, chunk = scored_head(arch, lay, cfg)
    cast = act if act < 4 else 0
    per_logit = 4 + cast + (4 if cfg.plan.job == "rl" else 0)
    wgrad = min(vocab * arch.hidden_size * cast, cfg.train.logits_chunk_mb * 2**20) if cast else 0.0
    return chunk * vocab * per_logit + scored * arch.hidden_size * (act + 4) + wgrad + norm


def logits_path(arch: ModelArch, lay: Layout, cfg: Config) -> str:
    """How the output layer runs, for the report."""
    if cfg.train.logits == "full":
        return "full: logits of every position"
    scored, chunk = scored_head(arch, lay, cfg)
    return f"scored: only the <= {int(scored)} scored positions of a micro-batch, logits in chunks of {chunk} tokens"


def micro_batches_per_step(cfg: Config, lay: Layout) -> int:
    """Micro-batches per optimizer step on one DP rank: SFT from train.global_batch_size, RL from the rollout
    batch (prompts_per_step * n_samples / mini_batches rows)."""
    rows = (
        cfg.train.global_batch_size
        if cfg.plan.job == "sft"
        else cfg.rl.prompts_per_step * cfg.rl.n_samples // cfg.rl.mini_batches
    )
    return max(1, -(-rows // (cfg.train.micro_batch_size * lay.dp)))


def needs_reference(cfg: Config) -> bool:
    if cfg.plan.job != "rl":
        return False
    return build_algorithm(cfg.algo.name, dict(cfg.algo.params)).needs_ref


def trainer_stages(cfg: Config, arch: ModelArch, lay: Layout) -> list[StageMemory]:
    """Memory of every pipeline rank (one GPU each; all GPUs of a rank hold the same)."""
    dtype = cfg.model.dtype
    m = micro_batches_per_step(cfg, lay)
    ref = needs_reference(cfg)
    out = []
    for r in range(lay.pp):
        n, w, g, o = model_state_bytes(arch, lay, dtype, cfg.optim.distributed_optimizer, r)
        out.append(
            StageMemory(
                rank=r,
                params=n,
                weights=w,
                grads=g,
                optimizer=o,
                activations=stage_activation_bytes(arch, lay, cfg, m, r),
                logits=logits_bytes(arch, lay, cfg) if r == lay.pp - 1 else 0.0,
                reference=w if ref else 0.0,
                reserve=cfg.plan.reserve_gb * GIB,
                in_flight=in_flight(lay, m, r),
            )
        )
    return out
