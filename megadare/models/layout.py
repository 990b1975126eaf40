"""Can a parallel layout hold a model? megatron-core's own divisibility rules, checked before any process starts.

validate_layout(arch, tp=2, pp=2, ep=4, world_size=16)   # raises ConfigError naming parallel.<key> and the fix
"""

from __future__ import annotations

from typing import Optional

from megadare.errors import ConfigError
from megadare.models.family import ModelArch


def _divisors(n: int) -> str:
    return "{" + ",".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


def validate_layout(
    arch: ModelArch,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    vpp: Optional[int] = None,
    etp: Optional[int] = None,
    cp: int = 1,
    sp: bool = False,
    world_size: Optional[int] = None,
) -> None:
    """Fail before any process starts when a layout cannot hold the model (megatron's own rules)."""
    P = "parallel."
    etp = tp if etp is None else etp
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp), ("cp", cp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{P}{name}={v!r} must be a positive integer")
    if arch.num_attention_heads % tp:
        raise ConfigError(
            f"{P}tp={tp}: model has {arch.num_attention_heads} attention heads, not divisible by "
            f"{tp}; use tp in {_divisors(arch.num_attention_heads)}"
        )
    if arch.num_kv_heads % tp:
        raise ConfigError(
            f"{P}tp={tp}: model has {arch.num_kv_heads} key/value heads (query groups), not "
            f"divisible by {tp}; use tp in {_divisors(arch.num_kv_heads)}"
        )
    if cp > 1 and (arch.num_attention_heads // tp) % cp:
        raise ConfigError(
            f"{P}cp={cp}: context parallelism splits the {arch.num_attention_heads // tp} attention "
            f"heads per TP rank over {cp} ranks (all-to-all); use cp in "
            f"{_divisors(arch.num_attention_heads // tp)}"
        )
    if arch.ffn_hidden_size % tp:
        raise ConfigError(f"{P}tp={tp}: MLP width {arch.ffn_hidden_size} is not divisible by {tp}")
    if arch.is_moe:
        if arch.num_experts % ep:
            raise ConfigError(
                f"{P}ep={ep}: model has {arch.num_experts} experts, not divisible by {ep}; "
                f"use ep in {_divisors(arch.num_experts)}"
            )
        if arch.moe_ffn_hidden_size % etp:
            raise ConfigError(f"{P}etp={etp}: expert width {arch.moe_ffn_hidden_size} is not divisible by {etp}")
        if ep == 1 and etp != tp:
            raise ConfigError(
                f"{P}etp={etp} with {P}ep=1 must equal {P}tp={tp}: without expert parallelism megatron "
                "reduces expert gradients over the dense data-parallel group, so experts replicated "
                "over TP ranks would drift apart; leave etp unset or use ep > 1"
            )
    elif ep > 1:
        raise ConfigError(f"{P}ep={ep}: the model has no experts; set parallel.ep=1")
    stages = pp * (vpp or 1)
    if vpp is not None and vpp > 1 and pp == 1:
        raise ConfigError(f"{P}vpp={vpp} needs parallel.pp > 1 (virtual stages interleave pipeline stages)")
    if arch.num_layers % stages:
        raise ConfigError(
            f"{P}pp={pp}"
            + (f", {P}vpp={vpp}" if vpp else "")
            + f": {arch.num_layers} layers do not split evenly into {stages} stages; "
            f"use pp*vpp in {_divisors(arch.num_layers)}"
        )
    if sp and tp == 1:
        raise ConfigError(f"{P}sp=true needs {P}tp > 1 (sequence parallelism splits activations over TP)")
    if world_size is not None:
        if world_size % (tp * pp * cp):
            raise ConfigError(f"{P}world_size={world_size} is not divisible by tp*pp*cp={tp * pp * cp}")
        if world_size % (etp * ep * pp):
            raise ConfigError(
                f"{P}world_size={world_size} is not divisible by etp*ep*pp={etp * ep * pp}; "
                f"lower {P}ep or launch more processes"
            )
