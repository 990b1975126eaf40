"""d-TreeRPO (Pan et al., arXiv:2512.09675; DARE ``trainer/ppo/dtreerpo_algos.py``,
``workers/rollout/dtreerpo_llada_rollout.py``, ``workers/actor/llada_dp_actor_dtreerpo.py``).

Rollout contract (tree search): every prompt is the root; a node decodes the next segment of
``segment_tokens`` response tokens and spawns ``branch`` children that continue from its state, ``depth``
levels deep, so a prompt has branch^depth leaves (``rl.n_samples`` must equal it). Leaves get the verifiable
reward; a node's value is the mean of its children's values; a node's *local advantage* is its value minus
the mean value of its siblings (children of the same parent):

    V(leaf) = r,    V(node) = mean_{c in children} V(c),    A(node) = V(node) - mean_{s in siblings} V(s)

Loss: every node is a training sample whose prompt is its parent's state and whose response is the segment
it decoded; the segment's tokens are scored from one forward on the parent state with the segment masked
(x_t ++ x_0 with the block-diffusion mask for block families), PPO-clipped (eps 0.4 in DARE's recipe),
averaged over the segment's tokens.

Deviations (stated): the time-scheduled self-distillation term (softmax(A/tau) over siblings, lambda_max 3e-3)
is not included; branching happens at segment boundaries on the response (not at arbitrary denoising steps);
DARE's contraction (fewer children deeper in the tree) is not modelled. Defaults: branch 4 (contraction off ->
``rl.n_samples = branch^depth``), eps 0.4, lr 3e-5 (LoRA), temperature 0.9.

Canvas (``rl.canvas``): DARE's d-TreeRPO scores transitions of the full LLaDA/Dream canvas states, tokens up to
the first EOS.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from megadare.algos.algorithm import Algorithm
from megadare.algos.base import RLSample
from megadare.algos.corruption import one_step


def local_advantages(leaf_rewards: list[float], branch: int, depth: int) -> list[list[float]]:
    """Per level (1..depth), per node in breadth-first order: V(node) - mean V(siblings). Leaves are the last
    level; ``leaf_rewards`` has branch^depth entries (one prompt's tree)."""
    values = [list(map(float, leaf_rewards))]
    for _ in range(depth - 1):
        below = values[0]
        values.insert(0, [sum(below[i:i + branch]) / branch for i in range(0, len(below), branch)])
    out = []
    for level in values:
        adv = []
        for i in range(0, len(level), branch):
            sib = level[i:i + branch]
            m = sum(sib) / len(sib)
            adv.extend(v - m for v in sib)
        out.append(adv)
    return out


class DTreeRPO(Algorithm):
    name = "d_treerpo"
    paper = "arXiv:2512.09675"
    defaults = {"eps_low": 0.4, "branch": 4, "depth": 2, "segment_tokens": None, "loss_agg": "seq_mean_token_mean"}

    def rollout(self, generate: Callable, prompts: list[list[int]], params, n_samples: int):
        """Leaf trajectories (n_samples per prompt, grouped by prompt), the tree recorded in ``extra['tree']``."""
        b, d = self.p["branch"], self.p["depth"]
        if params.algorithm == "editing":
            raise ValueError("d_treerpo: its tree stitches segments' traces without token edits; "
                             "rollout.algorithm=editing is not supported")
        if b ** d != n_samples:
            raise ValueError(f"d_treerpo: rl.n_samples={n_samples} must equal branch^depth = {b}^{d} = {b ** d}")
        seg = self.p["segment_tokens"] or -(-params.max_new_tokens // d)
        # one state per tree node: (prompt of the tree, tokens so far, trace so far, finished)
        states = [{"root": i, "prompt": p, "resp": [], "commit": [], "block": [], "logp": [], "fwd": 0,
                   "done": False, "finish": "length", "nodes": []} for i, p in enumerate(prompts)]
        for level in range(d):
            children = []
            for st in states:
                for _ in range(b):
                    children.append({**st, "nodes": list(st["nodes"])})
            todo = [c for c in children if not c["done"]]
            if todo:
                p = dataclasses.replace(params, max_new_tokens=min(seg, params.max_new_tokens - len(todo[0]["resp"]))
                                        if level < d - 1 else params.max_new_tokens - len(todo[0]["resp"]),
                                        seed=params.seed * 7919 + level)
                outs = generate([c["prompt"] + c["resp"] for c in todo], p)
                for c, t in zip(todo, outs):
                    c["nodes"].append((len(c["resp"]), len(t.response_ids)))  # (start, length) of this segment
                    c["commit"] = c["commit"] + [s + c["fwd"] for s in t.commit_step]
                    c["block"] = c["block"] + list(t.block_step)
                    c["logp"] = c["logp"] + list(t.logprobs)
                    c["resp"] = c["resp"] + list(t.response_ids)
                    c["fwd"] += t.num_forwards
                    c["done"] = t.finish_reason == "eos" or len(c["resp"]) >= params.max_new_tokens
                    c["finish"] = t.finish_reason
            for c in children:
                if len(c["nodes"]) <= level:
                    c["nodes"].append((len(c["resp"]), 0))  # a finished branch: empty segment
            states = children
        from megadare.rollout.engine import Trajectory

        leaves = []
        for st in states:
            leaves.append(Trajectory(prompt_ids=list(prompts[st["root"]]), response_ids=st["resp"],
                                     commit_step=st["commit"], block_step=st["block"], logprobs=st["logp"],
                                     finish_reason=st["finish"] if st["resp"] else "length",
                                     num_forwards=max(st["fwd"], 1), params=params,
                                     extra={"tree_segments": st["nodes"]}))
        return leaves

    def samples_from(self, trajectories, rewards: list[float], n_samples: int) -> list[RLSample]:
        """One sample per tree node (parent state -> segment), advantage = local advantage."""
        b, d = self.p["branch"], self.p["depth"]
        out = []
        for g in range(len(trajectories) // n_samples):
            leaves = trajectories[g * n_samples:(g + 1) * n_samples]
            adv = local_advantages(rewards[g * n_samples:(g + 1) * n_samples], b, d)
            for level in range(d):
                span = b ** (d - 1 - level)  # leaves under one node of this level
                for node in range(len(adv[level])):
                    leaf = leaves[node * span]
                    start, length = leaf.extra["tree_segments"][level]
                    if length == 0:
                        continue
                    out.append(RLSample(prompt_ids=list(leaf.prompt_ids) + leaf.response_ids[:start],
                                        response_ids=leaf.response_ids[start:start + length],
                                        reward=sum(rewards[g * n_samples + node * span:
                                                           g * n_samples + (node + 1) * span]) / span,
                                        advantage=adv[level][node], index=len(out), group=g))
        return out

    def views(self, s, arch, block_size, g):
        """The segment scored from one forward on the parent state: d1's one-step view without prompt masking."""
        return one_step(s.prompt_ids, s.response_ids, arch.mask_token_id, g, p_prompt=0.0)
