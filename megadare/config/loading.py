"""Building a ``Config``: a YAML file, then dotted ``key=value`` overrides, users' old keys moved to their sections
(``CONFIG_ALIASES``), types, typed choices and positive sizes checked field by field, each failure one
``ConfigError`` line naming the key as the user wrote it."""

from __future__ import annotations

import copy
import difflib
from dataclasses import fields, is_dataclass
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from megadare.data.files import DataError, as_paths
from megadare.errors import ConfigError
from megadare.config.sections import CONFIG_ALIASES, Config


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
