"""Building a ``Config``: a YAML file, then dotted ``key=value`` overrides, users' old keys moved to their sections
(``CONFIG_ALIASES``), types, typed choices and positive sizes checked field by field, each failure one
``ConfigError`` line naming the key as the user wrote it."""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
from dataclasses import fields, is_dataclass
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from megadare.data.files import DataError, as_paths
from megadare.errors import ConfigError
from megadare.names import check_algorithm_name
from megadare.config.foreign import foreign_fix
from megadare.config.sections import CONFIG_ALIASES, Config
from megadare.ranges import in_range


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


def float_fields(section: type = Config, prefix: str = "") -> list[str]:
    """The dotted keys of every number field (annotated ``float`` or ``Optional[float]``) in ``section``."""
    out: list[str] = []
    hints = get_type_hints(section)
    for f in fields(section):
        hint = hints[f.name]
        if is_dataclass(hint):
            out.extend(float_fields(hint, f"{prefix}{f.name}."))
        elif hint is float or (get_origin(hint) is Union and float in get_args(hint)):
            out.append(f"{prefix}{f.name}")
    return out


FLOATS = float_fields()


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


# {key: (range, what the key is)}: single-field bounds beyond POSITIVE; a value outside is one line naming both
RANGES: dict[str, tuple[str, str]] = {
    "checkpoint.save_interval": ("[0, inf)", "steps between checkpoints; 0 = only at the end"),
    "checkpoint.keep_last": ("[0, inf)", "checkpoints kept; 0 = all"),
    "rl.eval_interval": ("[0, inf)", "steps between evaluations; 0 = only before and after training"),
    "offpolicy.max_staleness": ("[0, inf)", "policy versions a rollout may lag"),
    "offpolicy.partial_rollout": ("[0, inf)", "blocks per segment; 0 = whole responses"),
    "rollout.max_post_steps": ("[0, inf)", "refinement forwards after a block"),
    "replay.warmup": ("[0, inf)", "policy versions before replay starts"),
    "optim.weight_decay": ("[0, inf)", "a negative decay pushes weights away from 0"),
    "optim.adam_beta1": ("[0, 1)", "Adam's first-moment decay"),
    "optim.adam_beta2": ("[0, 1)", "Adam's second-moment decay; 1 never updates it (division by 0)"),
    "optim.adam_eps": ("(0, inf)", "Adam's epsilon; 0 divides by 0 where a gradient's second moment is 0 (NaN)"),
    "optim.clip_grad": ("[0, inf)", "the gradient-norm clip; 0 = none"),
    "train.moe_aux_loss_coeff": ("[0, inf)", "a negative load-balancing loss unbalances the experts"),
    "train.moe_bias_update_rate": ("[0, inf)", "expert-bias balancing rate"),
    "data.synthetic_correct": ("[0, 1]", "a fraction of the demonstrations"),
    "offpolicy.rollout_is_threshold": ("(0, inf)", "the importance-weight cap; 0 zeroes every weight"),
    "offpolicy.rollout_is_threshold_low": ("(0, inf)", "the lower importance-weight bound"),
    "offpolicy.rollout_is_veto": ("(0, inf)", "a token ratio below which a sequence is dropped"),
    "replay.fraction": ("[0, inf)", "replayed samples per fresh sample"),
    "dpo.beta": ("(0, inf)", "DPO's temperature; 0 makes the loss constant (log 2) and nothing learns"),
    "plan.gpu_memory_gb": ("(0, inf)", "usable memory per GPU"),
    "plan.reserve_gb": ("[0, inf)", "memory held back per GPU"),
}


def _check_ranges(cfg: Config) -> None:
    """Every ``RANGES`` key holds a value within its range (None: unset), else one line: key, value, range, why."""
    for key, (bounds, what) in RANGES.items():
        if (v := _get(cfg, key)) is not None and not in_range(v, bounds):
            raise ConfigError(f"{cfg.as_written(key)}={v} must be within {bounds} ({what})")


def _all_keys(dc: Any, prefix: str = "") -> list[str]:
    out = []
    for f in fields(dc):
        v = getattr(dc, f.name)
        key = f"{prefix}{f.name}"
        out.append(key)
        if is_dataclass(v):
            out.extend(_all_keys(v, key + "."))
    return out


def _leaf_keys() -> dict[str, list[str]]:
    """{last part of a key: the canonical keys ending in it} (``tp``: [``parallel.tp``])."""
    out: dict[str, list[str]] = {}
    for key in _all_keys(Config()):
        out.setdefault(key.rpartition(".")[2], []).append(key)
    return out


def _section_of(key: str) -> Optional[str]:
    head = key.partition(".")[0]
    return head if is_dataclass(getattr(Config(), head, None)) else None


def suggestion(key: str, value: Optional[str]) -> str:
    """What to write instead of the unknown ``key`` (given ``value``): the megadare key another project's key means
    (config/foreign.py), the keys whose last part is ``key``'s, the closest keys, else the keys of its section."""
    shown = "<value>" if value is None else value
    if (hit := foreign_fix(key.replace("-", "_"), value)) is not None:
        return f"that is {hit[0]}'s; megadare: {hit[1]}"
    leaf = key.rpartition(".")[2].replace("-", "_")
    if leaf in (leaves := _leaf_keys()):
        return "did you mean " + " or ".join(f"{k}={shown}" for k in leaves[leaf]) + "?"
    settable = [k for k in _all_keys(Config()) if not is_dataclass(_get(Config(), k))]  # no section: optim=1e-3
    close = difflib.get_close_matches(key, settable + list(CONFIG_ALIASES), n=3, cutoff=0.75)
    if close:
        return "did you mean " + " or ".join(f"{k}={shown}" for k in close) + "?"
    section = _section_of(key)
    if section is not None:
        keys = [k for k in _all_keys(Config()) if k.startswith(section + ".")]
        return f"the keys of {section}: {', '.join(k.partition('.')[2] for k in keys)}"
    return (
        f"the sections: {', '.join(f.name for f in fields(Config))}; every key and its value: "
        "megadare <command> --dry-run --config-only"
    )


def _section_hint(section: str, value: Any) -> str:
    """What to write for a value given to a whole section (another project's key of that name, else its keys)."""
    if (hit := foreign_fix(section, value)) is not None:
        return f"that is {hit[0]}'s; megadare: {hit[1]}"
    keys = [k for k in _all_keys(Config()) if k.startswith(section + ".")]
    return f"set one of its keys: {', '.join(keys)}"


def _unknown(key: str, value: Optional[str] = None, where: str = "") -> ConfigError:
    """One line: the unknown key as written (``where``: ``in FILE`` or the override itself) and what to write."""
    return ConfigError(f"unknown config key {key!r} {where}: {suggestion(key, value)}".replace(" :", ":"))


_TYPE_NAMES = {"Integer": "an integer", "Float": "a number", "bool": "true or false"}


def _translate(e: OmegaConfBaseException, source: str, written: dict[str, str]) -> ConfigError:
    key = getattr(e, "full_key", None) or ""
    if isinstance(e, ConfigKeyError):
        return _unknown(key, where=f"in {source}")
    shown = written.get(key, key)  # the key as the user wrote it
    if isinstance(e, ValidationError) and key in CHOICES:  # OmegaConf refused a typed choice: our one line
        return _not_one_of(shown, e.value, CHOICES[key])
    if isinstance(e, ValidationError) and (kind := re.search(r"converted to (\w+)|not a valid (bool)", str(e))):
        what = _TYPE_NAMES.get(kind[1] or kind[2], f"a {kind[1]}")
        return ConfigError(f"{shown}={e.value!r} is not {what} (in {source})")
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


def _dict_field_of(key: str) -> Optional[str]:
    """The free-form mapping field (``algo.params``, ``model.tiny_config``, ``eval.paths``,
    ``rollout.engine_resources``) that ``key`` sets one entry of (``algo.params.n_mc``), else None: its entries are
    checked by their owner (an algorithm refuses a parameter it does not have)."""
    head, _, entry = key.rpartition(".")
    while head and entry:
        if head in _all_keys(Config()) and isinstance(_get(Config(), head), dict):
            return head
        head, _, _ = head.rpartition(".")
    return None


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
    bare = key.lstrip("+~")  # Hydra's +key (add), ++key (force), ~key (delete): verl / DARE command lines
    canonical = CONFIG_ALIASES.get(bare, bare)
    if canonical not in _all_keys(Config()) and _dict_field_of(canonical) is None:
        raise _unknown(bare, value, f"({ov})")
    if bare != key:
        raise ConfigError(
            f"override {ov!r}: megadare's keys take no Hydra prefix (every key exists); write {bare}={value}"
        )
    try:
        _parsed(value)
    except yaml.YAMLError as e:
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(
            f"override {ov!r}: the value is not valid YAML ({what}); close its brackets or quote it "
            "(e.g. advantage.accuracy_band=[0.2,0.8])"
        ) from None
    if _dict_field_of(canonical) is None and is_dataclass(_get(Config(), canonical)):
        raise ConfigError(f"override {ov!r}: {key} is a section, not a key; {_section_hint(canonical, value)}")
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
    _check_file_keys(data, source)
    try:
        merged = OmegaConf.merge(base, OmegaConf.create(data))
    except OmegaConfBaseException as e:
        raise _translate(e, source, written) from None
    return _finish(merged, written)


def load_config(
    path: Optional[str] = None, overrides: Optional[list[str]] = None, flags: Optional[dict[str, str]] = None
) -> Config:
    """YAML file (optional) then dotted ``key=value`` overrides; users' old keys (CONFIG_ALIASES) moved to their
    canonical keys first; checked field by field. ``flags``: {config key: the command's option that set it
    (``model.hf_path``: ``--model``)}, so that a message about its value names the option the user typed."""
    conf = OmegaConf.structured(Config)
    written: dict[str, str] = {}
    seen: dict[str, tuple[str, str]] = {}
    if path:
        file_data, written = canonical_keys(OmegaConf.to_container(_load_yaml(path)), path)
        _check_file_keys(file_data, path)
        try:
            conf = OmegaConf.merge(conf, OmegaConf.create(file_data))
        except OmegaConfBaseException as e:
            raise _translate(e, path, written) from None
    for ov in overrides or []:
        key, canonical, value = _canonical_override(ov, seen)
        written.pop(canonical, None)
        if key != canonical:
            written[canonical] = key
        try:
            conf = OmegaConf.merge(conf, OmegaConf.from_dotlist([f"{canonical}={value}"]))
        except OmegaConfBaseException as e:
            raise _translate(e, f"override {ov}", written) from None
    written.update(flags or {})
    return _finish(conf, written)


def check_model_path(cfg: Config) -> None:
    """``model.hf_path``, when set, is a directory (an HF checkpoint). Every config command needs it there (its
    config.json names the model the config is checked against); the CLI checks it before torch loads."""
    path = cfg.model.hf_path
    if path and not os.path.isdir(path):
        named = cfg.as_written("model.hf_path")
        how = f"{named} {path!r}" if named.startswith("-") else f"{named}={path!r}"  # an option, or a key
        where = "" if os.path.isabs(path) else f" (relative to the current directory {os.getcwd()})"
        raise ConfigError(f"{how} is not a directory{where}; point it at an HF checkpoint (its config.json)")


def _unknown_in(data: dict, schema: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of ``data`` that ``schema`` (a section) has no key for, in file order; a
    section written as a value (``parallel: 2``, or ``parallel:`` with its keys not indented) raises ConfigError."""
    out: list[tuple[str, Any]] = []
    for name, value in data.items():
        key = f"{prefix}{name}"
        field_value = getattr(schema, str(name), _MISSING) if is_dataclass(schema) else _MISSING
        if field_value is _MISSING and isinstance(value, dict) and value:
            out.extend(_unknown_in(value, None, key + "."))
        elif field_value is _MISSING:
            out.append((key, value))
        elif is_dataclass(field_value) and isinstance(value, dict):
            out.extend(_unknown_in(value, field_value, key + "."))
        elif is_dataclass(field_value):
            got = "nothing (are its keys indented under it?)" if value is None else repr(value)
            raise ConfigError(f"section {key!r} holds {got}; {_section_hint(key, value)}")
    return out


def _check_file_keys(data: dict, path: str) -> None:
    """A config file holds only megadare's keys: else one line naming the first unknown one (another project's
    first, with megadare's key for it) and how many more there are."""
    try:
        unknown = _unknown_in(data, Config())
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if not unknown:
        return
    key, value = next(((k, v) for k, v in unknown if foreign_fix(k, v) is not None), unknown[0])
    more = f" ({len(unknown) - 1} more unknown keys)" if len(unknown) > 1 else ""
    raise ConfigError(f"unknown config key {key!r} in {path}{more}: {suggestion(key, str(value))}")


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
        raise ConfigError(f"config file {path!r} is not valid YAML: {_yaml_problem(e, path)}") from None
    if not OmegaConf.is_dict(conf):
        raise ConfigError(
            f"config file {path!r} must hold a mapping of sections (model:, train:, ...), "
            f"not a {type(OmegaConf.to_object(conf)).__name__}"
        )
    if len(conf) == 0:
        raise ConfigError(
            f"config file {path!r} holds no settings (empty or comments only): the run would use every default; "
            "pass the config you meant, or leave --config out to run on the defaults"
        )
    return conf


def _yaml_problem(e: yaml.YAMLError, path: str) -> str:
    """The YAML error's problem, line and column, the line itself, and the fix where the cause is a layout one."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    if mark is None:
        return what
    with open(path, encoding="utf-8") as f:  # it was just read whole
        lines = f.read().split("\n")
    line = lines[mark.line] if mark.line < len(lines) else ""
    where = f" at line {mark.line + 1}, column {mark.column + 1}" + (f" ({line.strip()!r})" if line.strip() else "")
    if "\t" in line[: mark.column + 1]:
        return f"a tab{where}: YAML indents with spaces; replace the tab with spaces"
    if "mapping values are not allowed" in what or "expected <block end>" in what or "expected key" in what:
        return f"{what}{where}: the keys of one section must be indented by the same number of spaces"
    return f"{what}{where}"


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
    check_algorithm_name(cfg.algo.name, cfg.as_written("algo.name"))  # from the name table: no algorithm imports
    for key in POSITIVE:
        v = _get(cfg, key)
        if v is not None and v < 1:
            raise ConfigError(f"{key}={v} must be a positive integer")
    for key in FLOATS:  # OmegaConf reads nan / inf as numbers: lr=nan trains nothing, quietly
        if (v := _get(cfg, key)) is not None and not math.isfinite(v):
            raise ConfigError(f"{cfg.as_written(key)}={v} must be a finite number")
    _check_ranges(cfg)
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
