"""One typed config tree for every command: dataclasses + OmegaConf, a YAML file plus ``key=value`` overrides.

    cfg = load_config("examples/configs/sdar_tiny.yaml", ["parallel.tp=2", "model.dtype=bf16"])
    validate(cfg, arch, world_size)   # layouts against the model, before any process starts

Unknown keys, wrong types, bad choices and impossible layouts raise ``ConfigError`` naming the dotted key and
the fix. Three files, one job each: ``sections.py`` (the schema: one dataclass per section, typed choices,
``CONFIG_ALIASES``), ``loading.py`` (files, overrides, aliases, field checks) and ``checks.py`` (cross-checks
against the model and the world size).
"""

from megadare.config.sections import (
    ModelSection,
    ParallelSection,
    CheckpointSection,
    LoggingSection,
    TrainSection,
    OptimSection,
    DataSection,
    SFTSection,
    RolloutSection,
    AlgoSection,
    RLSection,
    AdvantageSection,
    OffPolicySection,
    LoRASection,
    DPOSection,
    ReplaySection,
    EvalSection,
    PlanSection,
    CodeRewardSection,
    RewardsSection,
    Config,
    CONFIG_ALIASES,
)

from megadare.config.loading import (
    choice_fields,
    CHOICES,
    check_choices,
    POSITIVE,
    canonical_keys,
    config_from_dict,
    load_config,
    to_yaml,
)

from megadare.config.checks import (
    resolve_sft_mode,
    validate,
    check_decoder,
)


__all__ = [
    "ModelSection",
    "ParallelSection",
    "CheckpointSection",
    "LoggingSection",
    "TrainSection",
    "OptimSection",
    "DataSection",
    "SFTSection",
    "RolloutSection",
    "AlgoSection",
    "RLSection",
    "AdvantageSection",
    "OffPolicySection",
    "LoRASection",
    "DPOSection",
    "ReplaySection",
    "EvalSection",
    "PlanSection",
    "CodeRewardSection",
    "RewardsSection",
    "Config",
    "CONFIG_ALIASES",
    "choice_fields",
    "CHOICES",
    "check_choices",
    "POSITIVE",
    "canonical_keys",
    "config_from_dict",
    "load_config",
    "to_yaml",
    "resolve_sft_mode",
    "validate",
    "check_decoder",
]
