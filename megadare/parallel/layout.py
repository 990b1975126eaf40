"""The parallel layout: how the trainer's processes split a model, checked when it is made.

    Layout(world=16, tp=2, pp=2, ep=4)            # raises ConfigError naming parallel.<key> and the fix
    Layout(world=16, tp=2, pp=2).check_model(arch)  # megatron-core's divisibility rules for this model

One frozen value for every place that needs the layout: ``init_distributed`` (megatron's groups), the config's
checks, ``megadare plan`` and checkpoint conversion. It validates itself like torchtitan's ``ParallelDims``
(``torchtitan/distributed/parallel_dims.py``); ``world=None`` is a layout not yet placed on processes (a
checkpoint's shards, a config before launch): the world-size rules then wait until it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megadare.errors import ConfigError

P = "parallel."


def _divisors(n: int) -> str:
    return "{" + ",".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


@dataclass(frozen=True)
class Layout:
    """Megatron's parallel sizes over ``world`` processes. ``etp=None`` splits experts like the dense layers (the
    default of megatron); ``vpp`` of 1 is stored as None (no virtual stages)."""

    world: Optional[int] = None
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    ep: int = 1
    etp: Optional[int] = None
    cp: int = 1
    sp: bool = False

    @classmethod
    def of(cls, parallel, world: Optional[int] = None) -> "Layout":
        """The layout of a config's ``parallel`` section on ``world`` processes."""
        sizes = dict(tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp, ep=parallel.ep, etp=parallel.etp)
        return cls(world=world, cp=parallel.cp, sp=parallel.sp, **sizes)

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if self.vpp == 1:
            object.__setattr__(self, "vpp", None)
        for name in ("tp", "pp", "ep", "etp", "cp") + (("vpp",) if self.vpp is not None else ()):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{P}{name}={v!r} must be a positive integer")
        if self.vpp is not None and self.pp == 1:
            raise ConfigError(f"{P}vpp={self.vpp} needs {P}pp > 1 (virtual stages interleave pipeline stages)")
        if self.sp and self.tp == 1:
            raise ConfigError(f"{P}sp=true needs {P}tp > 1 (sequence parallelism splits activations over TP)")
        if self.world is not None:
            self._check_world()

    def _check_world(self) -> None:
        world, tp, pp, cp, ep, etp = self.world, self.tp, self.pp, self.cp, self.ep, self.etp
        if world % (tp * pp * cp):
            raise ConfigError(
                f"{P}world_size={world} is not divisible by tp*pp*cp={tp * pp * cp}; launch a multiple of "
                f"{tp * pp * cp} processes"
            )
        if world % (etp * ep * pp):
            raise ConfigError(
                f"{P}world_size={world} is not divisible by etp*ep*pp={etp * ep * pp}; lower {P}ep or launch more "
                "processes"
            )

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense layers."""
        return self._placed() // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert layers."""
        return self._placed() // (self.etp * self.ep * self.pp)

    @property
    def stages(self) -> int:
        """Model chunks along the pipeline: pp times the virtual stages."""
        return self.pp * (self.vpp or 1)

    @property
    def micro_batch_multiple(self) -> int:
        """Interleaved pipelines need a multiple of pp micro-batches per step."""
        return self.pp if self.vpp else 1

    def _placed(self) -> int:
        if self.world is None:
            raise ValueError("this Layout has no world size yet (Layout(world=...))")
        return self.world

    def check_model(self, arch) -> "Layout":
        """Fail before any process starts when this layout cannot hold the model ``arch`` (a ``ModelArch``;
        megatron-core's own rules). Returns the layout."""
        tp, cp, ep = self.tp, self.cp, self.ep
        for what, n in (
            ("attention heads", arch.num_attention_heads),
            ("key/value heads (query groups)", arch.num_kv_heads),
        ):
            if n % tp:
                raise ConfigError(f"{P}tp={tp}: model has {n} {what}, not divisible by {tp}; use tp in {_divisors(n)}")
        heads = arch.num_attention_heads // tp
        if cp > 1 and heads % cp:
            raise ConfigError(
                f"{P}cp={cp}: context parallelism splits the {heads} attention heads per TP rank over {cp} ranks "
                f"(all-to-all); use cp in {_divisors(heads)}"
            )
        if arch.ffn_hidden_size % tp:
            raise ConfigError(f"{P}tp={tp}: MLP width {arch.ffn_hidden_size} is not divisible by {tp}")
        if arch.is_moe:
            self._check_experts(arch)
        elif ep > 1:
            raise ConfigError(f"{P}ep={ep}: the model has no experts; set parallel.ep=1")
        if arch.num_layers % self.stages:
            raise ConfigError(
                f"{P}pp={self.pp}"
                + (f", {P}vpp={self.vpp}" if self.vpp else "")
                + f": {arch.num_layers} layers do not split evenly into {self.stages} stages; "
                f"use pp*vpp in {_divisors(arch.num_layers)}"
            )
        return self

    def _check_experts(self, arch) -> None:
        tp, ep, etp = self.tp, self.ep, self.etp
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
