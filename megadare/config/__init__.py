"""One typed config tree for every command: dataclasses + OmegaConf, a YAML file plus ``key=value`` overrides.

    cfg = load_config("examples/configs/sdar_tiny.yaml", ["parallel.tp=2", "model.dtype=bf16"])
    validate(cfg, arch, world_size)   # megadare.trainer.checks: layouts against the model, before any process starts

Unknown keys, wrong types, bad choices and values out of range raise ``ConfigError`` naming the dotted key and
the fix. One job a file: ``sections.py`` (the schema: one dataclass per section, typed choices,
``CONFIG_ALIASES``), ``loading.py`` (files, overrides, aliases, field checks), ``foreign.py`` (other frameworks'
keys), ``rules.py`` (settings against each other), ``data_files.py`` (the data files a command reads). The cross-checks against the
model, the algorithm and the world size (``validate``) are trainer/checks.py: they need torch, and this package
imports nothing that does (.importlinter), so a bad config is refused before torch loads.
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
    resolve_sft_mode,
    resolve_sft_t_per,
)

from megadare.config.loading import (
    choice_fields,
    CHOICES,
    check_choices,
    POSITIVE,
    canonical_keys,
    check_model_path,
    config_from_dict,
    load_config,
    to_yaml,
)

from megadare.config.rules import check_rules, optimizer_updates
from megadare.config.data_files import check_data_files

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
    "check_model_path",
    "config_from_dict",
    "load_config",
    "to_yaml",
    "resolve_sft_mode",
    "resolve_sft_t_per",
    "check_rules",
    "optimizer_updates",
    "check_data_files",
]
