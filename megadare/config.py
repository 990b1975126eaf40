"""One typed config tree for every command: dataclasses + OmegaConf, a YAML file plus ``key=value`` overrides.

    cfg = load_config("examples/configs/sdar_tiny.yaml", ["parallel.tp=2", "model.dtype=bf16"])
    validate(cfg, arch, world_size)   # layouts against the model, before any process starts

Unknown keys, wrong types, bad choices and impossible layouts raise ``ConfigError`` naming the dotted key and
the fix. Later sections (train, sft, rl, rollout, eval) are added as dataclasses here.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from megadare.algos import build_algorithm
from megadare.data.files import DataError, as_paths
from megadare.errors import ConfigError
from megadare.models.family import ModelArch
from megadare.parallel.layout import Layout
from megadare.rewards.sandbox import ISOLATIONS
from megadare.rollout.engine import (
    ALGORITHMS,
    CONFIDENCES,
    ENGINE_DEVICES,
    ENGINE_DTYPES,
    SCHEDULES,
    WEIGHT_TRANSPORTS,
    SamplingParams,
)
from megadare.rollout.setup import resolve_canvas, rollout_block


@dataclass
class ModelSection:
    hf_path: Optional[str] = None  # HF checkpoint directory (config.json + safetensors)
    family: Optional[str] = None  # build a random tiny model of this family instead (tests, demo)
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


@dataclass
class OptimSection:
    """The optimiser (megatron's Adam) and its learning-rate schedule; keys ``train.lr`` ... are aliases."""

    lr: float = 1e-5
    min_lr: float = 0.0
    warmup_steps: int = 0
    lr_decay_style: Literal["cosine", "constant", "linear"] = "cosine"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    distributed_optimizer: bool = True  # shard optimizer state over DP (ZeRO-1)


@dataclass
class DataSection:
    path: Any = None  # .jsonl / .parquet (or a list of them) with `messages`, prompt/response,
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
    normalize: Literal["answer_length", "masked_tokens"] = "answer_length"  # LLaDA | DARE
    t_per: Literal["block", "sample"] = "block"  # block mode: one t per block | per sample
    trace_shrink: int = 1


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
    # block sampler: the block's first position alone, then linspace)
    eps: float = 1e-3  # Dream: end point of the linspace schedule
    alg_temp: float = 0.0  # Dream: > 0 draws the committed positions ~ softmax(confidence / alg_temp)
    editing_threshold: float = 0.9  # editing: replace a decoded token whose new prediction is this confident
    max_post_steps: int = 16  # editing: refinement forwards after a block has no masks
    num_to_transfer: int = 1  # editing: masked positions committed per step at least
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eval_temperature: float = 0.0  # held-out evaluation decodes greedily by default
    chunk_size: int = 16  # prompts per engine request
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
    fp8_weights: bool = False  # sglang: push linear weights as 128x128 block fp8 (engines started from a
    # tools/checkpoint_convert/quantize.py --format fp8-block checkpoint)


@dataclass
class AlgoSection:
    name: str = "tracerl"  # see megadare.algos.REGISTRY
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
    # match score (trainer/offpolicy/replay.py SCORES)
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


def _literal_choices(annotation) -> Optional[tuple]:
    """The values a field annotated ``Literal[...]`` accepts (``Optional[Literal[...]]`` adds None, listed first);
    None for any other annotation."""
    if get_origin(annotation) is Union:
        args = get_args(annotation)
        literal = [a for a in args if get_origin(a) is Literal]
        return (None, *get_args(literal[0])) if literal and type(None) in args else None
    return get_args(annotation) if get_origin(annotation) is Literal else None


def choice_fields(section: type = Config, prefix: str = "") -> dict[str, tuple]:
    """{dotted key: accepted values} of every typed-choice field (annotated ``Literal[...]``) in ``section``."""
    out: dict[str, tuple] = {}
    hints = get_type_hints(section)
    for f in fields(section):
        if is_dataclass(hints[f.name]):
            out.update(choice_fields(hints[f.name], f"{prefix}{f.name}."))
        elif (options := _literal_choices(hints[f.name])) is not None:
            out[f"{prefix}{f.name}"] = options
    return out


CHOICES = choice_fields()  # read from the annotations: the one list of typed choices


def _not_one_of(key: str, value: Any, options: tuple) -> ConfigError:
    shown = ", ".join("null" if o is None else str(o) for o in options)
    return ConfigError(f"{key}={value!r} is not one of {shown}")


def check_choices(cfg: Config) -> None:
    """Every typed-choice field holds one of its values (else one line naming the key, the value and the choices):
    the loader runs it, and ``validate`` again for a config built or changed in Python."""
    for key, options in CHOICES.items():
        if (v := _get(cfg, key)) not in options:
            raise _not_one_of(cfg.as_written(key), v, options)


POSITIVE = (
    "parallel.tp",
    "parallel.pp",
    "parallel.ep",
    "parallel.etp",
    "parallel.cp",
    "parallel.vpp",
    "parallel.world_size",
    "model.block_size",
    "logging.log_interval",
    "train.steps",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.seq_length",
    "data.max_length",
    "data.synthetic_size",
    "sft.trace_shrink",
    "rl.steps",
    "rl.prompts_per_step",
    "rl.n_samples",
    "rl.ppo_epochs",
    "rl.mini_batches",
    "rl.eval_size",
    "rollout.num_engines",
    "rollout.max_new_tokens",
    "rollout.block_size",
    "rollout.steps_per_block",
    "rollout.chunk_size",
    "rollout.bucket_mb",
    "rollout.engine_tp",
    "dpo.n_mc",
    "dpo.canvas_length",
    "replay.k",
    "eval.n_samples",
    "eval.limit",
    "plan.nodes",
    "plan.gpus_per_node",
    "plan.rollout_batch",
)


def _all_keys(dc: Any, prefix: str = "") -> list[str]:
    out = []
    for f in fields(dc):
        v = getattr(dc, f.name)
        key = f"{prefix}{f.name}"
        out.append(key)
        if is_dataclass(v):
            out.extend(_all_keys(v, key + "."))
    return out


def _unknown(key: str) -> ConfigError:
    valid = _all_keys(Config()) + list(CONFIG_ALIASES)
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _translate(e: OmegaConfBaseException, source: str, written: dict[str, str]) -> ConfigError:
    key = getattr(e, "full_key", None) or ""
    if isinstance(e, ConfigKeyError):
        return _unknown(key)
    shown = written.get(key, key)  # the key as the user wrote it
    if isinstance(e, ValidationError) and key in CHOICES:  # OmegaConf refused a typed choice: our one line
        return _not_one_of(shown, e.value, CHOICES[key])
    if isinstance(e, ValidationError):  # the first line of OmegaConf's message (the rest names its internals)
        return ConfigError(f"{shown}: {str(e.msg if hasattr(e, 'msg') else e).splitlines()[0]} (in {source})")
    return ConfigError(f"{source}: {e}")


_MISSING = object()


def _pop_path(data: dict, dotted: str) -> Any:
    """Remove ``dotted`` from a nested mapping (and the sections it leaves empty); _MISSING when absent."""
    head, _, rest = dotted.partition(".")
    if not isinstance(data, dict) or head not in data:
        return _MISSING
    if not rest:
        return data.pop(head)
    value = _pop_path(data[head], rest)
    if value is not _MISSING and data[head] == {}:
        del data[head]
    return value


def _peek_path(data: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return _MISSING
        data = data[part]
    return data


def _put_path(data: dict, dotted: str, value: Any) -> None:
    *sections, leaf = dotted.split(".")
    for part in sections:
        data = data.setdefault(part, {})
    data[leaf] = value


def _disagree(values: list) -> bool:
    return any(v != values[0] for v in values[1:])  # by value: 16 and 16.0 agree; lists compare too


def _one_value(key: str, given: list[tuple[str, Any]], source: str) -> tuple[str, Any]:
    """(spelling, value) of one canonical key written under several spellings: they must agree. The old
    ``sft.lora_*`` / ``rl.lora_*`` pair both stand in a config written before ``lora`` (every saved config.yaml):
    there a value equal to the default is no setting and the other one counts."""
    if _disagree([v for _, v in given]) and all(name.split(".")[0] in ("sft", "rl") for name, _ in given):
        default = _get(Config(), key)
        given = [(n, v) for n, v in given if v != default] or given
    if _disagree([v for _, v in given]):
        spelled = ", ".join(f"{n}={v!r}" for n, v in given)
        raise ConfigError(f"{source}: {spelled} set one key ({key}) to different values; keep one")
    return given[0]


def canonical_keys(data: dict, source: str) -> tuple[dict, dict[str, str]]:
    """A nested config mapping with every key written under an alias (CONFIG_ALIASES) moved to its canonical key,
    and {canonical key: the spelling written} for the moved ones. Two spellings of one key with different values
    raise ConfigError naming both."""
    out = copy.deepcopy(data)
    found: dict[str, list[tuple[str, Any]]] = {}
    for old, new in CONFIG_ALIASES.items():
        if (value := _pop_path(out, old)) is not _MISSING:
            found.setdefault(new, []).append((old, value))
    written = {}
    for new, given in found.items():
        if (value := _peek_path(out, new)) is not _MISSING:
            given = [(new, value), *given]
        spelling, value = _one_value(new, given, source)
        _put_path(out, new, value)
        if spelling != new:
            written[new] = spelling
    return out, written


def _parsed(value: str) -> Any:
    """An override's value as OmegaConf reads it (``1e-3`` and ``0.001`` are one value)."""
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value}"]))["v"]


def _canonical_override(ov: str, seen: dict[str, tuple[str, str]]) -> tuple[str, str, str]:
    """(key as written, canonical key, value) of one ``key=value`` override; ``seen`` ({canonical key: (spelling,
    value)} of the overrides so far) catches one key set under two spellings to different values."""
    if "=" not in ov:
        raise ConfigError(f"override {ov!r} must look like key=value (e.g. parallel.tp=2)")
    key, value = ov.split("=", 1)
    key = key.strip()
    canonical = CONFIG_ALIASES.get(key, key)
    if canonical not in _all_keys(Config()):
        raise _unknown(key)
    before = seen.get(canonical)
    if before is not None and before[0] != key and _disagree([_parsed(before[1]), _parsed(value)]):
        raise ConfigError(
            f"overrides: {before[0]}={before[1]} and {key}={value} set one key ({canonical}) to different values; "
            "keep one"
        )
    seen[canonical] = (key, value)
    return key, canonical, value


def config_from_dict(data: dict, source: str = "<dict>") -> Config:
    base = OmegaConf.structured(Config)
    data, written = canonical_keys(data, source)
    try:
        merged = OmegaConf.merge(base, OmegaConf.create(data))
    except OmegaConfBaseException as e:
        raise _translate(e, source, written) from None
    return _finish(merged, written)


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """YAML file (optional) then dotted ``key=value`` overrides; users' old keys (CONFIG_ALIASES) moved to their
    canonical keys first; checked field by field."""
    conf = OmegaConf.structured(Config)
    written: dict[str, str] = {}
    seen: dict[str, tuple[str, str]] = {}
    try:
        if path:
            file_data, written = canonical_keys(OmegaConf.to_container(_load_yaml(path)), path)
            conf = OmegaConf.merge(conf, OmegaConf.create(file_data))
        for ov in overrides or []:
            key, canonical, value = _canonical_override(ov, seen)
            written.pop(canonical, None)
            if key != canonical:
                written[canonical] = key
            conf = OmegaConf.merge(conf, OmegaConf.from_dotlist([f"{canonical}={value}"]))
    except OmegaConfBaseException as e:
        raise _translate(e, path or "overrides", written) from None
    return _finish(conf, written)


def _load_yaml(path: str):
    """A config file as an OmegaConf mapping; a missing, unreadable or malformed file raises ConfigError in one
    line (the YAML error's line and column)."""
    try:
        conf = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {path!r} is not valid YAML: {what}{where}") from None
    if not OmegaConf.is_dict(conf):
        raise ConfigError(
            f"config file {path!r} must hold a mapping of sections (model:, train:, ...), "
            f"not a {type(OmegaConf.to_object(conf)).__name__}"
        )
    return conf


def _finish(conf, written: dict[str, str]) -> Config:
    cfg: Config = OmegaConf.to_object(conf)
    cfg._written = written  # for messages: the key as the user wrote it (Config.as_written)
    for k, v in cfg.model.tiny_config.items():
        if v is None:
            raise ConfigError(
                f"model.tiny_config has key {k!r} without a value; on the command line write "
                "'model.tiny_config={hidden_size: 128}' (a space after each colon)"
            )
    check_choices(cfg)
    for key in POSITIVE:
        v = _get(cfg, key)
        if v is not None and v < 1:
            raise ConfigError(f"{key}={v} must be a positive integer")
    for key in ("data.path", "data.eval_path"):
        try:
            as_paths(_get(cfg, key), key)
        except DataError as e:
            raise ConfigError(str(e)) from None
    if not 0.0 <= cfg.rewards.max_error_fraction <= 1.0:
        key = cfg.as_written("rewards.max_error_fraction")
        raise ConfigError(f"{key}={cfg.rewards.max_error_fraction} must be within [0, 1]")
    if not cfg.train.logits_chunk_mb > 0:
        raise ConfigError(f"train.logits_chunk_mb={cfg.train.logits_chunk_mb} must be > 0 (MiB of logits per chunk)")
    return cfg


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def resolve_sft_mode(cfg: Config, arch: Optional[ModelArch]) -> str:
    """sft.mode with 'auto' resolved: block diffusion for block-causal families, random masking otherwise."""
    if cfg.sft.mode != "auto":
        return cfg.sft.mode
    if arch is None:
        return "auto"
    return "block" if arch.is_block_diffusion else "random"


def validate(cfg: Config, arch: Optional[ModelArch], world_size: Optional[int] = None, *, algo=None) -> None:
    """Cross-checks of a whole config against the model (when known) and the world size; ``algo``: the
    configured algorithm when the caller has built it (``trainer/spec.resolve``)."""
    check_choices(cfg)
    p = cfg.parallel
    if arch is not None:  # the model's rules first (they name the key to change), then the world's
        Layout.of(p).check_model(arch)
        if arch.is_moe and p.tp > 1 and not p.sp:
            raise ConfigError(
                f"parallel.tp={p.tp} on the MoE model {arch.family} needs parallel.sp=true "
                "(megatron trains MoE layers under TP only with sequence parallelism)"
            )
        if cfg.model.block_size is not None and not arch.is_block_diffusion:
            raise ConfigError(
                f"model.block_size={cfg.model.block_size}: the {arch.family} family uses full "
                "attention and has no denoising blocks; remove model.block_size"
            )
    Layout.of(p, world_size or p.world_size)  # checks the sizes against the world
    t, sft = cfg.train, cfg.sft
    if not 0.0 < sft.noise_low <= sft.noise_high <= 1.0:
        raise ConfigError(
            f"sft.noise_low={sft.noise_low}, sft.noise_high={sft.noise_high}: need 0 < noise_low <= noise_high <= 1"
        )
    o, named = cfg.optim, cfg.as_written
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(
            f"{named('optim.lr')}={o.lr}, {named('optim.min_lr')}={o.min_lr}: need 0 <= min_lr <= lr and lr > 0"
        )
    if o.warmup_steps < 0 or o.warmup_steps > t.steps:
        raise ConfigError(f"{named('optim.warmup_steps')}={o.warmup_steps} must be within [0, train.steps={t.steps}]")
    if cfg.lora.rank < 0:
        raise ConfigError(f"{named('lora.rank')}={cfg.lora.rank} must be >= 0 (0 = full fine-tuning)")
    if cfg.rollout.max_batch < 0:
        raise ConfigError(
            f"rollout.max_batch={cfg.rollout.max_batch} must be >= 0 (0 = every prompt of a request at once)"
        )
    row = cfg.data.max_length * (2 if resolve_sft_mode(cfg, arch) == "block" else 1)
    if row > t.seq_length:
        raise ConfigError(
            f"data.max_length={cfg.data.max_length} gives rows of up to {row} tokens (block-diffusion "
            f"rows hold x_t ++ x_0), more than train.seq_length={t.seq_length}; raise "
            "train.seq_length or lower data.max_length"
        )
    if cfg.rollout.fp8_weights and cfg.rollout.engine != "sglang":
        raise ConfigError(
            "rollout.fp8_weights=true sends block-fp8 weights, which only SGLang engines serving an "
            "fp8-block checkpoint load; set rollout.engine=sglang or rollout.fp8_weights=false"
        )
    if t.seq_length % p.cp:
        raise ConfigError(f"train.seq_length={t.seq_length} must be divisible by parallel.cp={p.cp}")
    if resolve_canvas(cfg, arch) == "full" and cfg.offpolicy.partial_rollout:
        key = named("offpolicy.partial_rollout")
        raise ConfigError(
            f"{key}={cfg.offpolicy.partial_rollout} continues a response as a new prompt, which "
            f"cannot decode one fixed canvas (rl.canvas=full); set rl.canvas=eos or {key}=0"
        )
    check_decoder(cfg, arch)

    (algo or build_algorithm(cfg.algo.name, dict(cfg.algo.params))).check_config(cfg, arch)


_SAMPLER_KEYS = (
    "max_new_tokens",
    "algorithm",
    "threshold",
    "top_k",
    "top_p",
    "confidence",
    "schedule",
    "eps",
    "alg_temp",
    "editing_threshold",
    "max_post_steps",
    "num_to_transfer",
)


def check_decoder(cfg: Config, arch: Optional[ModelArch]) -> None:
    """The rollout's decoder as the engines will build it (``SamplingParams`` at the rollout and the evaluation
    temperature). Whether the RL algorithm can replay a token-editing trace is its own ``check_config``."""
    r = cfg.rollout
    block = rollout_block(cfg, arch)
    for temperature in (r.temperature, r.eval_temperature):
        try:
            SamplingParams(
                block_size=block,
                steps_per_block=r.steps_per_block or block,
                temperature=temperature,
                **{k: getattr(r, k) for k in _SAMPLER_KEYS},
            )
        except ValueError as e:
            named = sorted(
                (str(e).find(k), k)
                for k in _SAMPLER_KEYS + ("steps_per_block", "block_size", "temperature")
                if k in str(e)
            )
            raise ConfigError(f"rollout.{named[0][1] if named else 'algorithm'}: {e}") from None
