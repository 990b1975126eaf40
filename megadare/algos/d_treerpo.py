"""d-TreeRPO (Pan et al., arXiv:2512.09675; DARE ``trainer/ppo/dtreerpo_algos.py``,
``workers/rollout/dtreerpo_llada_rollout.py``, ``workers/actor/llada_dp_actor_dtreerpo.py``).

Rollout contract (tree search over the denoising steps): the T steps of a response are cut at the branch points
[T, T - T/d, ..., 0] (DARE's ``tree_contraction_factor`` d = ``depth``). The root (the prompt, everything masked)
spawns ``root_fanout`` children (DARE's ``num_tree_samples``), every later node ``branch`` children; each child
continues its parent's partially denoised response for the next T/d steps, so a prompt has
root_fanout * branch^(depth-1) leaves = ``rl.n_samples`` (``root_fanout`` unset: rl.n_samples /
branch^(depth-1), so the tree fits the run's group size). With S steps per block a branch point falls after whole
blocks: level k decodes blocks [k nb / d, (k+1) nb / d) of the response's nb decode blocks (rounded down to a
block; the prompt's remainder counts in the first block of block families). Leaves get the verifiable reward; a
node's value is the mean of its children's; its *local advantage* is its value minus the mean value of its
siblings other than itself (0 baseline for an only child), DARE ``dtreerpo_algos.py:148``:

    V(leaf) = r,    V(node) = mean_{c in children} V(c),    A(node) = V(node) - mean_{s in siblings, s != node} V(s)

Loss: every node is a training sample whose prompt is its parent's state and whose response is the segment it
decoded (up to its first EOS); the segment's tokens are scored from one forward on the parent state with the
segment masked (x_t ++ x_0 with the block-diffusion mask for block families), PPO-clipped (eps 0.4), averaged
over the segment's tokens and then over nodes; + k3 KL to the reference (0.01, LoRA runs: the adapters off;
the plain k3 exp(d) - d - 1 as DARE's actor computes it, ``kl_estimator=k3_plain``, not verl's clamped one);
+ time-scheduled self-distillation towards the positive-advantage siblings (``self_distillation``):

    SD = lambda_t mean_{(parent, j)} KL(q_j || p_theta(. | parent state)_j),   q_j(v) = sum_{i: y_ij = v} w_i / sum w_i,
    w = softmax(A_i / tau_t) over the siblings with A_i > 0 covering position j,
    lambda_t = lambda_max (e^{gamma p} - 1) / (e^gamma - 1),   tau_t = tau_max (1 - p)^beta,   p = step / sd_max_steps,

its gradient -lambda_t (w_i / W_j) / N grad log p(y_ij | parent) is put on the sibling's token slot (the same forward
scores it); the mean runs over the (parent, position) pairs of the update's batch (DARE: of a micro-batch).
DARE's ``max_steps`` default is 30000 and its recipe leaves it, so lambda_t stays below 4e-5 over the first
1000 steps (3e-8 at step 1): the term is nearly off in DARE's runs, as here with the same defaults.

Deviations (stated): for full-attention families the parent state holds prompt + decoded prefix + the masked
segment, not the whole masked canvas of R positions after it (megadare cuts at EOS, DARE decodes the full canvas
and scores up to the child's first EOS); branch points inside a block are rounded down to the block's start.
Defaults (``recipe/llada/run_dtreerpo_llada_8b_instruct.sh``): branch 4, depth 2, root fan-out 4 (16 leaves),
eps 0.4, KL 0.01, 12 epochs, lr 3e-5, LoRA r 128 / alpha 64, temperature 0.9.

Canvas (``rl.canvas``): DARE's d-TreeRPO scores transitions of the full LLaDA/Dream canvas states, tokens up to
the first EOS.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from megadare.algos.algorithm import Algorithm
from megadare.algos.base import SLOT_CONST, RLSample, Slots
from megadare.diffusion.corruption import CleanSequence, one_step
from megadare.errors import ConfigError
from megadare.rollout.engine import Trajectory


def tree_values(leaf_rewards: list[float], fanout: int, branch: int, depth: int) -> list[list[float]]:
    """Node values per level (level 0 = the root's children ... level depth-1 = leaves), breadth-first."""
    values = [list(map(float, leaf_rewards))]
    for _ in range(depth - 1):
        below = values[0]
        values.insert(0, [sum(below[i : i + branch]) / branch for i in range(0, len(below), branch)])
    if len(values[0]) != fanout:
        raise ValueError(
            f"d_treerpo: {len(leaf_rewards)} leaves do not make a tree of fan-out {fanout}, branch "
            f"{branch}, depth {depth}"
        )
    return values


def local_advantages(
    leaf_rewards: list[float], branch: int, depth: int, fanout: Optional[int] = None
) -> list[list[float]]:
    """Per level, per node (breadth-first): V(node) - mean V(its siblings other than itself)."""
    fanout = fanout or branch
    out = []
    for level, vals in enumerate(tree_values(leaf_rewards, fanout, branch, depth)):
        size = fanout if level == 0 else branch
        adv = []
        for i in range(0, len(vals), size):
            sib = vals[i : i + size]
            total = sum(sib)
            adv.extend(v - ((total - v) / (len(sib) - 1) if len(sib) > 1 else 0.0) for v in sib)
        out.append(adv)
    return out


def level_ends(prompt_len: int, max_new_tokens: int, block: int, depth: int, global_grid: bool) -> list[int]:
    """Response length at the end of each level: the branch points at whole blocks of the decode grid."""
    rem = prompt_len % block if global_grid else 0
    nb = -(-(rem + max_new_tokens) // block)
    return [min(max_new_tokens, max(0, (k + 1) * nb // depth * block - rem)) for k in range(depth)]


def sd_schedule(step: int, p: dict) -> tuple[float, float]:
    """(lambda_t, tau_t) of the self-distillation term at RL step ``step``."""
    prog = min(1.0, max(0.0, step / max(1, p["sd_max_steps"])))
    lam = p["sd_lambda_max"] * (math.exp(p["sd_gamma"] * prog) - 1.0) / (math.exp(p["sd_gamma"]) - 1.0)
    return lam, max(p["sd_tau_max"] * (1.0 - prog) ** p["sd_beta"], 1e-6)


class DTreeRPO(Algorithm):
    name = "d_treerpo"
    own_rollout = True
    defaults = {
        "eps_low": 0.4,
        "branch": 4,
        "depth": 2,
        "root_fanout": None,
        "kl_coef": 0.01,
        "kl_anchor": "ref",
        "kl_estimator": "k3_plain",  # DARE's actor: exp(d) - d - 1 unclamped (policy_loss.py)
        "loss_agg": "seq_mean_token_mean",
        "self_distillation": True,
        "sd_lambda_max": 3e-3,
        "sd_gamma": 2.0,
        "sd_tau_max": 2.0,
        "sd_beta": 0.7,
        "sd_max_steps": 30000,
    }

    def __init__(self, overrides=None):
        super().__init__(overrides)
        if self.p["branch"] < 2 or self.p["depth"] < 1:
            raise ConfigError(
                f"algo.params.branch={self.p['branch']}, depth={self.p['depth']}: need branch >= 2 and depth >= 1"
            )

    def fanout(self, n_samples: int) -> int:
        """Root fan-out: the set one, or rl.n_samples / branch^(depth-1) (ConfigError when it does not fit)."""
        below = self.p["branch"] ** (self.p["depth"] - 1)
        f = self.p["root_fanout"] or n_samples // below
        if f < 1 or f * below != n_samples:
            raise ConfigError(
                f"rl.n_samples={n_samples} leaves per prompt must equal root_fanout x branch^(depth-1)"
                f" = {self.p['root_fanout'] or '?'} x {self.p['branch']}^{self.p['depth'] - 1}; set "
                f"rl.n_samples to a multiple of {below} or change algo.params.root_fanout / branch / "
                "depth"
            )
        return f

    def uses_group_baseline(self) -> bool:
        return False  # local advantages of its tree (samples_from)

    def check_config(self, cfg, arch) -> None:
        super().check_config(cfg, arch)
        self.fanout(cfg.rl.n_samples)
        if cfg.rollout.algorithm == "editing":  # its tree stitches segments' traces (no trace contract)
            self.refuse_edits()

    # ------------------------------------------------------------------ rollout: the tree
    def rollout(self, generate: Callable, prompts: list[list[int]], params, n_samples: int, global_grid: bool = False):
        """Leaf trajectories (n_samples per prompt, grouped by prompt), each leaf's segments in
        ``extra['tree_segments']`` ((start, length) per level); ``global_grid``: blocks of a block family sit on
        the prompt+response grid."""
        f, b, d = self.fanout(n_samples), self.p["branch"], self.p["depth"]
        if params.algorithm == "editing":
            raise ValueError(
                "d_treerpo: its tree stitches segments' traces without token edits; "
                "rollout.algorithm=editing is not supported"
            )
        states = [
            {
                "root": i,
                "prompt": p,
                "resp": [],
                "commit": [],
                "block": [],
                "logp": [],
                "fwd": 0,
                "done": False,
                "finish": "length",
                "nodes": [],
                "versions": [],
                "ends": level_ends(len(p), params.max_new_tokens, params.block_size, d, global_grid),
            }
            for i, p in enumerate(prompts)
        ]
        for level in range(d):
            children = [
                {**st, "nodes": list(st["nodes"]), "versions": list(st["versions"])}
                for st in states
                for _ in range(f if level == 0 else b)
            ]
            self._grow(generate, [c for c in children if not c["done"]], params, level)
            for c in children:
                if len(c["nodes"]) <= level:
                    c["nodes"].append((len(c["resp"]), 0))  # a finished branch (EOS) or an empty level
            states = children
        every = [v for st in states for v in st["versions"]]
        if not every:
            raise RuntimeError("d_treerpo: the tree decoded no token (every level ended before its first block)")
        # a leaf's behaviour policy: the oldest weights any of its segments were decoded with
        return [
            Trajectory(
                prompt_ids=list(prompts[st["root"]]),
                response_ids=st["resp"],
                commit_step=st["commit"],
                block_step=st["block"],
                logprobs=st["logp"],
                finish_reason=st["finish"] if st["resp"] else "length",
                num_forwards=max(st["fwd"], 1),
                params=params,
                policy_version=min(st["versions"] or every),
                extra={"tree_segments": st["nodes"]},
            )
            for st in states
        ]

    def _grow(self, generate: Callable, todo: list[dict], params, level: int) -> None:
        """Decode every open node's level: one engine call per distinct segment length."""
        by_len: dict[int, list[dict]] = {}
        for c in todo:
            n = c["ends"][level] - len(c["resp"])
            if n > 0:
                by_len.setdefault(n, []).append(c)
        for n, group in sorted(by_len.items()):
            p = dataclasses.replace(params, max_new_tokens=n, seed=params.seed * 7919 + level * 131 + n)
            for c, t in zip(group, generate([c["prompt"] + c["resp"] for c in group], p)):
                c["nodes"].append((len(c["resp"]), len(t.response_ids)))
                c["commit"] = c["commit"] + [s + c["fwd"] for s in t.commit_step]
                c["block"] = c["block"] + list(t.block_step)
                c["logp"] = c["logp"] + list(t.logprobs)
                c["resp"] = c["resp"] + list(t.response_ids)
                c["fwd"] += t.num_forwards
                c["versions"].append(t.policy_version)
                c["done"] = t.finish_reason == "eos" or len(c["resp"]) >= params.max_new_tokens
                c["finish"] = t.finish_reason

    def samples_from(self, trajectories, rewards: list[float], n_samples: int) -> list[RLSample]:
        """One sample per tree node with a non-empty segment (parent state -> segment), advantage = local
        advantage; ``extra['parent']`` names the node's parent inside the sample's prompt group (siblings share
        both; replay renumbers the group, offpolicy.correction.reindex, so trees of different steps never mix)."""
        f, b, d = self.fanout(n_samples), self.p["branch"], self.p["depth"]
        out = []
        for g in range(len(trajectories) // n_samples):
            leaves = trajectories[g * n_samples : (g + 1) * n_samples]
            r = rewards[g * n_samples : (g + 1) * n_samples]
            adv = local_advantages(r, b, d, f)
            for level in range(d):
                span = b ** (d - 1 - level)  # leaves under one node of this level
                for node in range(len(adv[level])):
                    leaf = leaves[node * span]
                    start, length = leaf.extra["tree_segments"][level]
                    if length == 0:
                        continue
                    size = f if level == 0 else b
                    out.append(
                        RLSample(
                            prompt_ids=list(leaf.prompt_ids) + leaf.response_ids[:start],
                            response_ids=leaf.response_ids[start : start + length],
                            reward=sum(r[node * span : (node + 1) * span]) / span,
                            advantage=adv[level][node],
                            index=len(out),
                            group=g,
                            extra={"parent": (g, level, node // size)},
                        )
                    )
        return out

    # ------------------------------------------------------------------ estimator and loss
    def views(self, s, arch, block_size, g):
        """The segment scored from one forward on the parent state: d1's one-step view without prompt masking."""
        return one_step(CleanSequence.of(s.prompt_ids, s.response_ids, arch.mask_token_id), g, p_prompt=0.0)

    def batch_rows(self, samples, arch, block_size, generator_for):
        """Rows per node, with each token slot's self-distillation coefficient in ``extras['per_slot_sd']``."""
        rows = super().batch_rows(samples, arch, block_size, generator_for)
        coef = self.self_distillation(samples) if self.p["self_distillation"] else {}
        D = sum(r.denom for r in rows)
        for row in rows:
            sample, slot, head = row.sample, row.slot, row.head
            head_of = {int(k): float(h) for k, h in zip(slot.tolist(), head.tolist()) if k >= 0 and h != 0}
            sd = [
                coef.get((i, k), 0.0) * D / head_of[k] if k in head_of else 0.0
                for i, k in zip(sample.tolist(), slot.tolist())
            ]
            row.extras[SLOT_CONST + "sd"] = torch.tensor(sd, dtype=torch.float32)
        return rows

    def self_distillation(self, samples: list[RLSample]) -> dict[tuple[int, int], float]:
        """{(sample index, token j): c}: SD's gradient is -sum c grad log p(y_j | parent state) over the batch."""
        by_parent: dict[tuple, list[RLSample]] = {}
        for s in samples:  # parent names a node inside its tree: a replayed tree of another step has the same names
            by_parent.setdefault((s.group, s.extra["parent"]), []).append(s)
        pairs: list[tuple[int, list[tuple[RLSample, float]], float]] = []  # (position, [(sibling, q)], lambda)
        for sibs in by_parent.values():
            pos = [s for s in sibs if float(s.advantage) > 0]
            if len(sibs) < 2 or not pos:
                continue
            lam, tau = sd_schedule(int(pos[0].extra.get("rollout_step", 0)), self.p)
            w = torch.softmax(torch.tensor([float(s.advantage) for s in pos], dtype=torch.float64) / tau, 0).tolist()
            for j in range(max(len(s.response_ids) for s in pos)):
                cover = [(s, wi) for s, wi in zip(pos, w) if j < len(s.response_ids)]
                total = sum(wi for _, wi in cover)
                pairs.append((j, [(s, wi / total) for s, wi in cover], lam))
        out: dict[tuple[int, int], float] = {}
        for j, members, lam in pairs:
            for s, q in members:
                out[(s.index, j)] = out.get((s.index, j), 0.0) + lam * q / len(pairs)
        return out

    def slot_loss(self, s: Slots):
        loss, parts = super().slot_loss(s)
        sd = s.extra.get("sd")
        if sd is not None:
            loss = loss - sd * s.logp
            parts["sd"] = (-sd * s.logp).detach()
        return loss, parts
