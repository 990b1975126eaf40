"""CJ-GRPO: consistency-trajectory GRPO (Yang, Chen, Hu, Shao, arXiv:2509.23924; DARE
``workers/actor/llada_dp_actor_cj_grpo.py``, ``block_diffusion_utils.py::compute_cj_block_step_token_weights``).

Estimator: replay every decoding step of the recorded trajectory (shrink 1): the state x_k before step k
(tokens committed earlier clean, the rest masked), scoring the tokens committed at k. Objective: per-step
token PPO-clip averaged within each step, then over the steps of a sample ("paper-exact" weighting):

    L = -(1/G) sum_i (1/K_i) sum_k (1/|U_ik|) sum_{j in U_ik} min(rho_j A_i, clip(rho_j, 1 +- eps) A_i)

with U_ik the tokens committed at step k: for block families step k is a (block, block-local step) transition,
for full attention a global step. K_i counts the steps that commit a token: a step that commits nothing changes
no state and is no transition (as DARE's block actor and its ``tests/test_cj_grpo_paper_exact.py``; DARE's LLaDA
actor also counts such steps in its divisor, a (committing / all steps) scale not copied here;
tests/test_algos_dare_cj_blocks.py). Defaults: eps 0.2, no KL; pairs with few-step decoding (EOSER/ASS).

Canvas (``rl.canvas``): DARE replays the full LLaDA/Dream canvas (``full``, those families' default) and, for block
families, the terminal block in full (``build_cj_replay_model_inputs``: its post-EOS tokens are scored with the
sample's advantage and sit in the states); here block families replay up to the EOS (``eos``), so the terminal
block's states lack those positions and they are not scored. Elsewhere the two losses agree on the same trace.
"""

from __future__ import annotations

from collections import Counter

from megadare.algos.algorithm import Algorithm
from megadare.algos.algorithm import rows_for_views
from megadare.diffusion.trace_replay import replay_views, trace_commits


class CJGRPO(Algorithm):
    name = "cj_grpo"
    needs_trace = True
    replays_edits = True
    defaults = {"eps_low": 0.2}

    def engine_logprobs_match(self, arch) -> bool:
        return True  # one replay state per recorded step

    def views(self, s, arch, block_size, g):
        """Every decoding step replayed (no shrinkage)."""
        return [v for v, _ in replay_views(s, arch.mask_token_id, block_size, 1, block_family=arch.is_block_diffusion)]

    def rows(self, s, arch, block_size, g):
        self.check_sample(s)
        block = arch.is_block_diffusion
        views = self.views(s, arch, block_size, g)
        # one "step" = (block, block-local step) for block families, the global step otherwise; U_ik holds every
        # commit of the step, token edits included (one slot each, diffusion/trace_replay.py)
        P = len(s.prompt_ids)
        commits = trace_commits(s)
        key = [((P + c.position) // block_size, c.block_step) if block else c.step for c in commits]
        sizes = Counter(key)
        weights = {c.slot: 1.0 / (len(sizes) * sizes[kc]) for c, kc in zip(commits, key)}
        return rows_for_views(s, views, arch, "", weights, 1.0) if views else []
