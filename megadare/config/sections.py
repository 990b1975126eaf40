"""The config tree's schema: one dataclass per section, the typed choices as ``Literal`` annotations, and ``Config``
holding them all. Loading (files, overrides, aliases) is :mod:`.loading`; settings against each other are
:mod:`.rules`; checks against the model and the world are megadare/trainer/checks.py."""

from __future__ import annotations

from dataclasses import dataclass, field, replace, fields
from typing import Any, Literal, Optional


from megadare.rewards.sandbox import ISOLATIONS
from megadare.rollout.choices import (
    ALGORITHMS,
    CONFIDENCES,
    ENGINE_DEVICES,
    ENGINE_DTYPES,
    FULL_ATTENTION_CACHES,
    SCHEDULES,
    WEIGHT_TRANSPORTS,
)


@dataclass
class ModelSection:
    hf_path: Optional[str] = None  # HF checkpoint directory (config.json + safetensors)
    # build a random tiny model of this family instead (tests, demo); the names models/family.py registers
    # (tests/test_newcomer_errors.py holds them equal), typed so a misspelt one is refused before torch loads
    family: Optional[Literal["dream", "llada", "llada2", "sdar", "sdar_moe"]] = None
    tiny: bool = False
    tiny_config: dict = field(default_factory=dict)  # config.json overrides of the tiny model (e.g. num_hidden_layers)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # bf16 keeps fp32 master weights
    block_size: Optional[int] = None  # denoising block (block-diffusion families); None = family default
    attention_backend: Literal["auto", "flex", "sdpa", "reference", "local"] = "auto"  # auto: flex on GPU, sdpa on CPU;
    # local (megatron's DotProductAttention: baseline, dense masks only)


@dataclass
class ParallelSection:
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    vpp: Optional[int] = None  # virtual pipeline stages per rank (interleaved 1F1B)
    ep: int = 1  # expert parallel
    etp: Optional[int] = None  # expert tensor parallel; None = tp (megatron's default)
    cp: int = 1  # context parallel
    sp: bool = False  # sequence parallel (needs tp > 1)
    world_size: Optional[int] = None  # None = from the launcher environment
    collective_timeout_s: int = 3600  # a rank waiting this long in a collective fails (a hung peer); in RL the
    # other ranks wait so for rank 0's rollout and scoring: keep it above rollout.timeout_s and a step's rollout


@dataclass
class CheckpointSection:
    load: Optional[str] = None  # initial weights: a Megatron checkpoint (model only, any layout)
    save: Optional[str] = None  # checkpoint root; None = <run_dir>/ckpt. A run resumes from its newest
    save_interval: int = 0  # steps; 0 = only at the end and on SIGTERM
    keep_last: int = 2  # complete checkpoints kept under the root


@dataclass
class LoggingSection:
    run_dir: str = "runs/default"
    tensorboard: bool = True
    jsonl: bool = True
    log_interval: int = 1


@dataclass
class TrainSection:
    steps: int = 100  # optimizer steps
    global_batch_size: int = 8  # examples per optimizer step (over all DP ranks)
    micro_batch_size: int = 1  # packed sequences per micro-batch
    seq_length: int = 2048  # packed sequence length (block mode rows are 2x prompt+response)
    recompute: Literal["none", "selective", "full"] = "none"  # selective: core attention; full: whole layers
    logits: Literal["scored", "full"] = "scored"  # scored: output layer only where the loss reads, no [tokens, vocab]
    # logits (models/head.py) | full: logits of every position (old path)
    logits_chunk_mb: float = 64.0  # scored: MiB of fp32 logits per chunk of tokens (V/tp wide)
    moe_aux_loss_coeff: Optional[float] = None  # None = the family's default
    moe_bias_update_rate: float = 1e-3  # aux-loss-free expert-bias balancing (families with expert bias)
    gradient_accumulation_fusion: bool = False  # weight grads accumulate into the fp32 main grads inside the GEMM
    # (megatron's flag without apex: models/step_fusions.py)
    fused_elementwise: Optional[bool] = None  # megatron's compiled SwiGLU and residual add, fused RMSNorm and RoPE
    # (step_fusions.py); None = on where a GPU measured it faster: CUDA, a dense model in bf16 / fp16
    grouped_experts: Optional[bool] = None  # MoE experts through grouped GEMMs, SequentialMLP's weights
    # (models/experts.py); None = on where measured faster: a CPU (a GPU: not yet measured)


@dataclass
class OptimSection:
    """The optimiser (megatron's Adam) and its learning-rate schedule; keys ``train.lr`` ... are aliases."""

    lr: float = 1e-5
    min_lr: float = 0.0
    warmup_steps: int = 0  # optimizer updates (RL: rl.steps x rl.ppo_epochs x rl.mini_batches in all)
    lr_decay_style: Literal["cosine", "constant", "linear"] = "cosine"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    distributed_optimizer: bool = True  # shard optimizer state over DP (ZeRO-1)


@dataclass
class DataSection:
    path: Any = None  # .jsonl / .json / .parquet (or a list of them) with `messages`, prompt/response,
    # *_ids fields, or verl/DARE rows (prompt messages + reward_model)
    synthetic: Optional[Literal["addition", "reverse"]] = None  # generated task (tests, demo) instead of a file
    synthetic_size: int = 512
    synthetic_correct: float = 1.0  # reverse task: fraction of correct demonstrations (rest copy the input)
    eval_path: Any = None  # RL: held-out prompts (a file or a list); synthetic tasks make their own
    prompt_key: str = "prompt"  # field names; dotted for nested fields (extra_info.question)
    response_key: str = "response"
    messages_key: str = "messages"
    max_length: int = 1024  # prompt + response tokens
    overlong: Literal["truncate", "drop", "error"] = "truncate"
    shuffle: bool = True


@dataclass
class SFTSection:
    mode: Literal["auto", "random", "block", "semi_ar", "trace"] = "auto"  # auto: block for block-diffusion
    # families, else random
    noise_low: float = 1e-3  # t ~ U(noise_low, noise_high)
    noise_high: float = 1.0
    weighting: Literal["inv_t", "none"] = "inv_t"  # inv_t: ELBO
    # LLaDA | the global batch's masked tokens | each sample's (DARE's trainers at micro_batch_size_per_gpu=1)
    normalize: Literal["answer_length", "masked_tokens", "masked_tokens_per_sample"] = "answer_length"
    # block mode: auto (the family's publisher draw, models/<family>.py ``sft_t_per``: SDAR, LLaDA2 one t per
    # sample) | one t per block | one t per sample
    t_per: Literal["auto", "block", "sample"] = "auto"
    trace_shrink: int = 1
    # pad every response to data.max_length and train on the pads (DARE: LLaDA with eos, SDAR, Dream with the pad id)
    pad_response: Literal["none", "eos", "pad"] = "none"


@dataclass
class RolloutSection:
    engine: Literal["native", "sglang"] = "native"  # native: the built-in torch engine
    num_engines: int = 1  # Ray engine actors
    engine_resources: dict = field(default_factory=lambda: {"num_cpus": 1})  # per actor, e.g. {num_gpus: 1}
    engine_tp: int = 1  # sglang: tensor-parallel size of one engine (num_gpus >= engine_tp)
    max_new_tokens: int = 64
    block_size: Optional[int] = None  # None = the model's block size (block families) / 32 (full attention)
    steps_per_block: Optional[int] = None  # None = block_size (one token per step)
    algorithm: Literal[ALGORITHMS] = "low_confidence_static"  # editing: LLaDA2.1 token editing
    threshold: float = 0.9
    confidence: Literal[CONFIDENCES] = (
        "model_prob"  # what low-confidence remasking ranks: model_prob | Dream's maskgit_plus,
    )
    # topk_margin, entropy
    schedule: Literal[SCHEDULES] = "even"  # tokens per step: even | linspace (Dream) | linspace_first (DARE's Dream
    # block sampler: the block's first position alone, then linspace) | linspace_remaining (DARE's MDPO for Dream)
    eps: float = 1e-3  # Dream: end point of the linspace schedule
    alg_temp: float = 0.0  # Dream: > 0 draws the committed positions ~ softmax(confidence / alg_temp)
    editing_threshold: float = 0.9  # editing: replace a decoded token whose new prediction is this confident
    max_post_steps: int = 16  # editing: refinement forwards after a block has no masks
    num_to_transfer: int = 1  # editing: masked positions committed per step at least
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eval_temperature: float = 0.0  # held-out evaluation decodes greedily by default
    eval_steps_per_block: int = 0  # held-out evaluation's denoising steps per block (0: steps_per_block; DARE's
    # recipes validate with max_response_length steps in all, one token per step)
    chunk_size: int = 16  # prompts per engine request
    timeout_s: float = 1800.0  # the longest an engine may stay silent (no request of a rollout finished, no answer
    # to a weight push) before the run stops naming it; generous for 30B rollouts, finite so a hung engine cannot
    # hold the GPUs forever
    bucket_mb: int = 512  # weight-sync bucket size
    weight_transport: Literal[WEIGHT_TRANSPORTS] = (
        "auto"  # auto | distributed (a gloo/NCCL group per pipeline-stage sender and all
    )
    # engines) | colocated (shared memory / CUDA IPC) | object_store (no
    # group: through rank 0 and Ray); auto = colocated on a one-host CPU run
    device: Literal[ENGINE_DEVICES] = "auto"  # built-in engine: auto (the GPU Ray assigned to the actor, else CPU) |
    # cpu | cuda
    dtype: Literal[ENGINE_DTYPES] = "auto"  # built-in engine weights and KV cache: auto (bfloat16 on CUDA, float32
    # on CPU) | float32 | bfloat16
    max_batch: int = 0  # built-in engine: rows decoded together; a request's further prompts
    # queue and enter as rows finish (continuous batching); 0 = all at once
    compile: bool = False  # built-in engine: torch.compile the block forward (CUDA graphs on CUDA)
    full_attention_cache: Literal[FULL_ATTENTION_CACHES] = "none"  # LLaDA / Dream in the built-in engine: none
    # (exact: every step recomputes the sequence) | prefix (Fast-dLLM: later steps of a block reuse the keys and
    # values before it from the block's first forward: DARE's use_cache=True) | dual (also those after it)
    fp8_weights: bool = False  # sglang: push linear weights as 128x128 block fp8 (engines started from a
    # tools/checkpoint_convert/quantize.py --format fp8-block checkpoint)


@dataclass
class AlgoSection:
    name: str = "tracerl"  # one of megadare.names.ALGORITHMS
    params: dict = field(default_factory=dict)  # the algorithm's hyper-parameters (eps_low, kl_coef, n_mc, ...);
    # unset keys take the published defaults


@dataclass
class RLSection:
    """The RL loop: steps, batch shape, epochs, held-out evaluation. Its other owners have their own sections:
    ``advantage``, ``offpolicy``, ``rewards``, ``lora`` (the old ``rl.*`` keys are aliases, CONFIG_ALIASES)."""

    steps: int = 100  # RL steps (rollout -> update -> weight sync)
    prompts_per_step: int = 16
    n_samples: int = 8  # responses per prompt (group size)
    ppo_epochs: int = 1  # passes over each rollout batch
    redraw_corruptions: Optional[bool] = None  # each epoch draws its own corruptions (epoch in the seed; old
    # log-probs of every epoch's rows before the first update); None = the
    # algorithm's choice (ESPO, d1: redraw; the rest keep one draw)
    canvas: Optional[Literal["full", "eos"]] = (
        None  # full (sample, mask, score and normalise all rollout.max_new_tokens
    )
    # positions, post-EOS tokens included: DARE's LLaDA/Dream) | eos (cut at
    # the first EOS); None = the family's default (full attention: full,
    # block diffusion: eos)
    mini_batches: int = 1  # optimizer steps per epoch
    eval_interval: int = 0  # steps; 0 = only before and after training
    eval_size: int = 64  # held-out prompts evaluated


@dataclass
class AdvantageSection:
    """Group-relative advantages from a prompt group's rewards (algos/advantages.py), and which groups train."""

    estimator: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"  # was rl.advantage
    std: Literal["unbiased", "population", "none"] = "unbiased"  # was rl.advantage_std
    filter_all_equal: bool = False  # drop groups whose rewards are all equal
    accuracy_band: Optional[list] = None  # [low, high]: drop groups with accuracy outside (dLLM-RL: [0.2, 0.8])


@dataclass
class OffPolicySection:
    """Asynchronous rollouts and their off-policy correction (trainer/offpolicy/)."""

    mode: Literal["sync", "one_step_off", "fully_async"] = (
        "sync"  # sync | one_step_off (step k+1's rollout overlaps step k's training) |
    )
    # fully_async (rollouts stream ahead, bounded by max_staleness)
    max_staleness: int = 1  # policy versions a rollout may lag behind (enforced; sync gives 0)
    partial_rollout: int = 0  # blocks per segment of a queued rollout (0: whole responses); each
    # weight update continues the queued responses on the new weights
    loss_mode: Literal["ppo", "decoupled", "bypass"] = (
        "ppo"  # ppo (ratio to the trainer's pre-update policy) | decoupled (IS
    )
    # behaviour -> proximal, clip proximal -> current) | bypass (clip
    # current / behaviour, no proximal pass)
    behaviour_logp: Literal["trainer", "engine"] = (
        "trainer"  # where behaviour log-probs come from: trainer (the same estimator on
    )
    # a snapshot of the behaviour version's weights) | engine (sampler
    # log-probs; trace-replay algorithms at shrink 1, temperature 1 only)
    rollout_is: Optional[Literal["token", "sequence", "geometric"]] = None  # D-ARL algorithm.rollout_is
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"  # truncate: TIS; mask: MIS / rejection
    rollout_is_threshold: float = 2.0  # upper threshold (D-ARL algorithm.rollout_is_threshold)
    rollout_is_threshold_low: Optional[float] = None  # None: 1/upper in mask mode, no lower bound in truncate
    rollout_is_veto: Optional[float] = None  # drop a sequence with any token ratio below this


@dataclass
class LoRASection:
    """LoRA adapters of the job that runs (SFT or RL; rank 0 = full fine-tuning). RL's reference is the policy with
    its adapters off (no second model). ``sft.lora_*`` and ``rl.lora_*`` are both aliases of these keys."""

    rank: int = 0
    alpha: float = 16.0
    targets: list = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


@dataclass
class DPOSection:
    beta: float = 0.2  # DPO temperature (LLaDA 1.5 / DARE recipe 0.2)
    n_mc: int = 4  # count-stratified masks per response, shared by policy and reference
    margin_norm: Literal["none", "canvas"] = "none"  # canvas: divide the margin by the response canvas R (DARE's
    # VRPO; its effective beta is beta / R)
    canvas_length: int = 512  # R for margin_norm=canvas (DARE's data.max_response_length)
    chosen_key: str = "chosen"  # preference records: prompt (data.prompt_key), chosen, rejected
    rejected_key: str = "rejected"


@dataclass
class ReplaySection:
    enable: bool = False  # D-ARL replay.enable: distribution-matched replay of stale samples
    k: int = 2  # replay.k: keep the samples of the last k behaviour versions
    pmis: bool = True  # replay.pmis: balance-heuristic weights over the k behaviour policies
    warmup: int = 1  # replay.warmup: policy versions seen before replay starts
    fraction: float = 0.25  # replayed samples per step, as a fraction of the fresh ones
    score: Literal["token_chi2", "seq_chi2", "token_k2", "token_k3", "log_ratio_var"] = "token_chi2"  # variance-guided
    # match score (trainer/offpolicy/replay_scores.py SCORES)
    level: Literal["sample", "group", "version"] = "group"  # group: keep prompt groups whole
    max_score: Optional[float] = None  # never replay units scoring above this


@dataclass
class EvalSection:
    tasks: list = field(default_factory=lambda: ["gsm8k"])  # gsm8k | math500 | aime24 | aime25 | humaneval | mbpp
    data_dir: Optional[str] = None  # directory holding <task>.jsonl / <task>.parquet
    paths: dict = field(default_factory=dict)  # {task: file} (overrides data_dir)
    n_samples: int = 1  # responses per problem (mean@n, pass@k, maj@k)
    k: list = field(default_factory=lambda: [1])  # pass@k / maj@k values (k <= n_samples)
    temperature: Optional[float] = None  # None: rollout.eval_temperature (n_samples > 1 needs > 0)
    limit: Optional[int] = None  # first N problems per task
    output_dir: Optional[str] = None  # per-sample JSONL + summary.json; None = <logging.run_dir>/eval
    prompt_style: Literal["boxed", "d1"] = "boxed"  # math prompts: boxed (dLLM-RL / SDAR, OpenCompass MATH 0-shot) | d1


@dataclass
class PlanSection:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0  # usable memory per GPU (H100 80 GB, H200 141 GB)
    rollout_gpus: int = 0  # GPUs given to rollout engines (0: colocated with the trainer)
    rollout_batch: int = 64  # concurrent sequences per engine (KV cache sizing)
    job: Literal["rl", "sft"] = "rl"  # rl: trainer + rollout engines; sft: trainer only
    prompt_length: int = 512  # prompt tokens per rollout sequence (KV cache: + rollout.max_new_tokens)
    reserve_gb: float = 3.0  # per GPU: CUDA context, NCCL buffers, allocator fragmentation


@dataclass
class CodeRewardSection:
    isolation: Literal[ISOLATIONS] = (
        "namespaces"  # namespaces: the OS sandbox (README "Code sandbox") | process: the weaker
    )
    # guard (seccomp + audit hook, writable filesystem) where the kernel
    # refuses namespaces; code rewards refuse to run rather than fall back


@dataclass
class RewardsSection:
    """How RL and evaluation score responses (megadare/rewards/)."""

    name: str = "auto"  # built-in reward name or "pkg.module:function"; auto: per row by
    # data_source / extra_info.task (megadare.rewards.registry.auto_rule)
    max_error_fraction: float = 0.0  # a step (or evaluation) whose rewards could not be computed for more
    # than this fraction of samples stops the run (a program or verifier
    # running past its own limit is a wrong answer, not a failure)
    answer_key: str = "answer"  # gold field (dotted: reward_model.ground_truth, verl's, is the fallback)
    truncated_as_wrong: bool = False  # responses that hit max_new_tokens get reward 0
    skip_rows_without_answer: bool = False  # leave out (and list) prompt rows whose gold is null / empty instead of
    # refusing the file (DARE's MATH train file has 4 such rows)
    code: CodeRewardSection = field(default_factory=CodeRewardSection)


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    sft: SFTSection = field(default_factory=SFTSection)
    rl: RLSection = field(default_factory=RLSection)
    advantage: AdvantageSection = field(default_factory=AdvantageSection)
    offpolicy: OffPolicySection = field(default_factory=OffPolicySection)
    rewards: RewardsSection = field(default_factory=RewardsSection)
    lora: LoRASection = field(default_factory=LoRASection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    replay: ReplaySection = field(default_factory=ReplaySection)
    dpo: DPOSection = field(default_factory=DPOSection)
    eval: EvalSection = field(default_factory=EvalSection)
    plan: PlanSection = field(default_factory=PlanSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    seed: int = 1234

    def as_written(self, key: str) -> str:
        """``key`` for a message, in the user's spelling: as the config's source wrote it (an old key of
        CONFIG_ALIASES); a key it did not write, in the old spelling it used for that section's other keys (it
        wrote ``rl.rollout_is``: ``rl.loss_mode``); else ``key``."""
        written = self.__dict__.get("_written", {})
        if key in written:
            return written[key]
        section = key.split(".")[0]
        old_sections = {w.split(".")[0] for k, w in written.items() if k.split(".")[0] == section}
        return next(
            (old for old, new in CONFIG_ALIASES.items() if new == key and old.split(".")[0] in old_sections), key
        )

    def replace(self, **sections) -> "Config":
        """A copy with ``sections`` replaced (``dataclasses.replace``) that still names keys as the source wrote them."""
        out = replace(self, **sections)
        out._written = self.__dict__.get("_written", {})
        return out


# Users' keys from before the sections by owner: permanent aliases {key as written: canonical key}. The loader
# moves them (YAML files, key=value overrides, config_from_dict) before OmegaConf checks types and choices.
def resolve_sft_mode(cfg: Config, arch: Any) -> str:
    """sft.mode with 'auto' resolved: block diffusion for block-causal families, random masking otherwise. ``arch``:
    the model's ``ModelArch`` (models/family.py, not imported: the config layer stays torch-free), None if unknown."""
    if cfg.sft.mode != "auto":
        return cfg.sft.mode
    if arch is None:
        return "auto"
    return "block" if arch.is_block_diffusion else "random"


def resolve_sft_t_per(cfg: Config, family_t_per: Optional[str]) -> str:
    """sft.t_per with 'auto' resolved: the family's declared draw (``family_t_per``, its publisher's SFT code),
    else one t per block."""
    if cfg.sft.t_per != "auto":
        return cfg.sft.t_per
    return family_t_per or "block"


CONFIG_ALIASES: dict[str, str] = {
    **{f"train.{f.name}": f"optim.{f.name}" for f in fields(OptimSection)},
    "rl.advantage": "advantage.estimator",
    "rl.advantage_std": "advantage.std",
    "rl.filter_all_equal": "advantage.filter_all_equal",
    "rl.accuracy_band": "advantage.accuracy_band",
    **{f"rl.{f.name}": f"offpolicy.{f.name}" for f in fields(OffPolicySection)},
    **{f"{job}.lora_{f.name}": f"lora.{f.name}" for job in ("sft", "rl") for f in fields(LoRASection)},
    "rl.reward": "rewards.name",
    "rl.max_reward_error_fraction": "rewards.max_error_fraction",
    "rl.answer_key": "rewards.answer_key",
    "rl.truncated_as_wrong": "rewards.truncated_as_wrong",
    "rl.skip_rows_without_answer": "rewards.skip_rows_without_answer",
}
