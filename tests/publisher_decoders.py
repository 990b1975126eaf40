"""The publishers' decoding logic, transcribed for tests (not imported: the publishers' files are not vendored).

* Dream (Dream-org ``generation_utils.py`` of Dream-v0-Instruct-7B, as DARE ships it under
  ``models/Dream-v0-Instruct-7B/``): ``top_p_logits``, ``top_k_logits``, ``sample_tokens`` and the loop of
  ``DreamGenerationMixin._sample`` for ``alg`` in maskgit_plus / topk_margin / entropy with ``alg_temp`` 0;
* DARE's block sampler for Dream (``generation_utils_block.py``, ``dual_cache=False``): per block the first
  position alone from a full forward, then ``steps_per_block - 1`` entropy-ranked steps on the linspace
  schedule;
* LLaDA2.1 (inclusionAI ``modeling_llada2_moe.py`` of LLaDA2.1-mini, as DARE ships it): ``_top_k_logits``,
  ``_top_p_logits``, ``_sample_with_temperature_topk_topp`` and ``generate()`` with token editing.

Changes to the publishers' loops, each stated where it is made: the model forward is an exact full forward
(no KV cache), the mask token's logit is -inf (megadare never predicts the mask token), Dream's proposals are drawn
over the whole block instead of over its masked positions only (the draw layout of megadare's engines; greedy
decoding draws nothing, so there the loop is the publisher's), and LLaDA2.1 attends through a strict block-causal
mask (its ``generate()`` omits the ``.log()``, models/llada2.py). Each loop also returns the trace it went
through: per response position, the (forward index, token) of every commit.

The random draw: the publishers draw a categorical with torch's global RNG (Dream ``dists.Categorical(probs)
.sample()``, LLaDA2.1 ``torch.multinomial(probs, 1)``); megadare's engines draw from a counter-based stream per
prompt (``sampling.stream_uniforms``). Every draw here goes through :data:`DRAW` ``(probs [R, V], step) -> [R]``
(change: the loop passes its step index, the forward count of its trace), the global RNG by default; a test sets
it to megadare's stream (:func:`stream_draw`) so both sides use the same random numbers and everything else -- the
filters, the distributions, the rules and schedules -- is the publisher's.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributions as dists
import torch.nn.functional as F


def global_rng_draw(probs: torch.Tensor, step: int) -> torch.Tensor:
    """What the publishers do: one categorical draw per row from torch's global RNG."""
    return dists.Categorical(probs=probs).sample()


def stream_draw(key: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """megadare's draw for the prompt whose stream key is ``key``: row r of a step's block takes the uniform number
    of block position r at the step (``sampling.stream_uniforms``) and inverts the CDF (``sampling.categorical``)."""
    from megadare.rollout.sampling import SAMPLE, categorical, stream_uniforms

    def draw(probs: torch.Tensor, step: int) -> torch.Tensor:
        u = stream_uniforms(torch.tensor([key]), torch.tensor([step]), SAMPLE, probs.shape[0])[0]
        return categorical(probs.float(), u)[0]

    return draw


DRAW: Callable[[torch.Tensor, int], torch.Tensor] = global_rng_draw


# ---------------------------------------------------------------------------------------------- Dream
def dream_top_p_logits(logits, top_p=None):
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    sorted_indices_to_remove = cumulative_probs > top_p
    sorted_indices_to_remove[..., 1:] = sorted_indices_to_remove[..., :-1].clone()
    sorted_indices_to_remove[..., 0] = 0
    mask = torch.zeros_like(logits, dtype=torch.bool, device=logits.device)
    mask = mask.scatter_(-1, sorted_indices, sorted_indices_to_remove)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def dream_top_k_logits(logits, top_k=None):
    top_k = min(top_k, logits.size(-1))
    indices_to_remove = logits < torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(indices_to_remove, torch.finfo(logits.dtype).min)


def dream_sample_tokens(
    logits, temperature=0.0, top_p=None, top_k=None, margin_confidence=False, neg_entropy=False, step=0
):
    """Dream's ``sample_tokens`` (its bare ``except`` fallback dropped: it never fires on finite logits)."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = dream_top_p_logits(logits, top_p)
    if top_k is not None:
        logits = dream_top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        x0 = DRAW(probs, step)  # change: the DRAW hook
        confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
        confidence = sorted_probs[:, 0] - sorted_probs[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


DREAM_ALG = {"maskgit_plus": {}, "topk_margin": {"margin_confidence": True}, "entropy": {"neg_entropy": True}}


def _dream_logits(model, x, mask_id):
    logits = model(x).float()
    logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # Dream: position i-1 predicts token i
    logits[..., mask_id] = float("-inf")  # change: never the mask token
    return logits


def _block_draw(logits, lo, hi, mask_index, temperature, top_p, top_k, alg_kw, step):
    """Dream's sample_tokens over the block rows (change: the publisher draws over the masked rows only), read
    at the masked positions."""
    conf, x0 = dream_sample_tokens(logits[0, lo:hi], temperature, top_p=top_p, top_k=top_k, step=step, **alg_kw)
    sel = mask_index[0, lo:hi]
    return conf[sel], x0[sel]


def dream_generate(model, prompt, gen_length, steps, alg, mask_id, eps=1e-3, temperature=0.0, top_p=None, top_k=None):
    """Dream's ``_sample`` (one sequence, alg_temp 0): x = prompt ++ masks; every step ranks the masked
    positions by ``alg``'s confidence and commits int(n * (1 - s/t)) of them (all at the last step)."""
    P = len(prompt)
    x = torch.full((1, P + gen_length), mask_id)
    x[0, :P] = torch.tensor(prompt)
    trace: dict[int, list[tuple[int, int]]] = {}
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == mask_id
        logits = _dream_logits(model, x, mask_id)
        t, s = timesteps[i], timesteps[i + 1]
        confidence, x0 = _block_draw(
            logits, P, P + gen_length, mask_index, temperature, top_p, top_k, DREAM_ALG[alg], i
        )
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        number_transfer_tokens = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        full_confidence = torch.full_like(x, -torch.inf, dtype=logits.dtype)
        full_confidence[mask_index] = confidence
        if number_transfer_tokens > 0:
            _, transfer_index = torch.topk(full_confidence, number_transfer_tokens)
            x_ = torch.zeros_like(x) + mask_id
            x_[mask_index] = x0.clone()
            row_indices = torch.arange(x.size(0)).unsqueeze(1).expand_as(transfer_index)
            x[row_indices, transfer_index] = x_[row_indices, transfer_index]
            for p in transfer_index[0].tolist():
                trace.setdefault(p - P, []).append((i, int(x[0, p])))
    return x[0, P:].tolist(), trace


def dare_dream_block_generate(
    model, prompt, gen_length, block_length, steps, mask_id, eps=1e-3, temperature=0.0, top_p=None, top_k=None
):
    """DARE's ``generation_utils_block._sample`` (``dual_cache=False``, non-threshold alg: the entropy rule is
    hard-coded there), with full forwards (change: the publisher reuses the prefix keys of the block's first
    forward, megadare's ``full_attention_cache='prefix'``)."""
    P = len(prompt)
    x = torch.full((1, P + gen_length), mask_id)
    x[0, :P] = torch.tensor(prompt)
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    timesteps = torch.linspace(1, eps, steps_per_block + 1)
    trace: dict[int, list[tuple[int, int]]] = {}
    forward = 0
    for num_block in range(num_blocks):
        start, end = P + num_block * block_length, P + (num_block + 1) * block_length
        logits = _dream_logits(model, x, mask_id)
        _, x0 = _block_draw(logits, start, end, x == mask_id, temperature, top_p, top_k, {}, forward)
        x[:, start] = x0[0]  # change: x0 drawn over the block (the publisher: over the whole sequence)
        trace.setdefault(start - P, []).append((forward, int(x[0, start])))
        forward += 1
        i = 1
        while True:
            if i == steps_per_block:
                break
            mask_index = x[:, start:] == mask_id
            full_logits = _dream_logits(model, x, mask_id)
            logits = full_logits[:, start:]
            t, s = timesteps[i], timesteps[i + 1]
            mask_index[:, block_length:] = False
            full_mask = torch.zeros_like(x, dtype=torch.bool)
            full_mask[:, start:] = mask_index
            confidence, x0 = _block_draw(
                full_logits, start, end, full_mask, temperature, top_p, top_k, {"neg_entropy": True}, forward
            )
            num_mask_token = mask_index.sum() / mask_index.shape[0]
            number_transfer_tokens = (
                int(num_mask_token * (1 - s / t)) if i < steps_per_block - 1 else int(num_mask_token)
            )
            full_confidence = torch.full_like(x[:, start:], -torch.inf, dtype=logits.dtype)
            full_confidence[mask_index] = confidence
            full_confidence[:, block_length:] = -torch.inf
            if number_transfer_tokens > 0:
                _, transfer_index = torch.topk(full_confidence, number_transfer_tokens)
                x_ = torch.zeros_like(x[:, start:]) + mask_id
                x_[mask_index] = x0.clone()
                row_indices = torch.arange(x.size(0)).unsqueeze(1).expand_as(transfer_index)
                x[:, start:][row_indices, transfer_index] = x_[row_indices, transfer_index]
                for p in transfer_index[0].tolist():
                    trace.setdefault(start + p - P, []).append((forward, int(x[0, start + p])))
            forward += 1
            i += 1
            if (x[:, start:end] == mask_id).sum() == 0:
                break
    return x[0, P:].tolist(), trace


# ---------------------------------------------------------------------------------------------- LLaDA2.1
def llada21_top_k_logits(logits, k):
    if k is None or k <= 0:
        return logits
    values, _ = torch.topk(logits, k)
    min_values = values[..., -1, None]
    return torch.where(logits < min_values, torch.full_like(logits, float("-inf")), logits)


def llada21_top_p_logits(logits, p):
    if p is None or p >= 1.0:
        return logits
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    sorted_mask = cumulative_probs > p
    sorted_mask[..., 1:] = sorted_mask[..., :-1].clone()
    sorted_mask[..., 0] = False
    mask_indices = torch.scatter(torch.full_like(logits, False, dtype=torch.bool), -1, sorted_indices, sorted_mask)
    return logits.masked_fill(mask_indices, float("-inf"))


def llada21_sample(logits, temperature=1.0, top_k=0, top_p=1.0, step=0):
    """LLaDA2.1's ``_sample_with_temperature_topk_topp`` (the draw through :data:`DRAW`)."""
    orig_shape = logits.shape[:-1]
    vocab_size = logits.shape[-1]
    logits = logits.reshape(-1, vocab_size)
    if temperature == 0.0:
        token = torch.argmax(logits, dim=-1, keepdim=True)
        probs = F.softmax(logits, dim=-1)
        token_prob = torch.gather(probs, -1, token)
        return token.view(*orig_shape), token_prob.view(*orig_shape)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logits = llada21_top_k_logits(logits, top_k)
    logits = llada21_top_p_logits(logits, top_p)
    probs = F.softmax(logits, dim=-1)
    token = DRAW(probs, step)[:, None]  # change: the DRAW hook
    token_prob = torch.gather(probs, -1, token)
    return token.view(*orig_shape), token_prob.view(*orig_shape)


def llada21_generate(
    model,
    prompt,
    gen_length,
    block_length,
    mask_id,
    temperature=0.0,
    top_k=None,
    top_p=None,
    threshold=0.95,
    editing_threshold=0.9,
    max_post_steps=16,
    num_to_transfer=1,
):
    """LLaDA2.1's ``generate()`` (eos_early_stop off), one sequence. Changes: a strict block-causal bool mask
    (the publisher's 0/1 mask without ``.log()``), the mask token's logit -inf. The trace counts a forward as a
    step when its block had a masked position or it made an edit (the last, quiet forward of a block is not)."""
    prompt_length = len(prompt)
    num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
    total_length = num_blocks * block_length
    blocks = torch.arange(total_length) // block_length
    block_mask = (blocks[None, :] <= blocks[:, None])[None, None]  # change: strict block-causal
    position_ids = torch.arange(total_length).unsqueeze(0)
    x = torch.full((1, total_length), mask_id, dtype=torch.long)
    x[:, :prompt_length] = torch.tensor(prompt)
    trace: dict[int, list[tuple[int, int]]] = {}
    step = 0
    for num_block in range(prompt_length // block_length, num_blocks):
        end = (num_block + 1) * block_length
        cur_x = x[:, :end]
        block_start_pos = num_block * block_length
        post_steps = 0
        while True:
            old_block_tokens = cur_x[:, -block_length:].clone()
            active_block_mask = cur_x[:, -block_length:] == mask_id
            if not torch.any(active_block_mask):
                post_steps += 1
            if post_steps > max_post_steps:
                break
            prompt_mask_in_block = torch.zeros(block_length, dtype=torch.bool)
            if block_start_pos < prompt_length:
                prompt_mask_in_block[: min(prompt_length - block_start_pos, block_length)] = True
            logits = model(cur_x, attention_mask=block_mask[:, :, :end, :end], position_ids=position_ids[:, :end])
            active_logits = logits[:, -block_length:, :].float()
            active_logits[..., mask_id] = float("-inf")  # change: never the mask token
            x0, x0_p = llada21_sample(active_logits, temperature=temperature, top_k=top_k, top_p=top_p, step=step)
            mask_transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            if active_block_mask.sum() > 0:
                mask_confidence = torch.where(active_block_mask, x0_p, -torch.inf)
                high_conf_mask = (mask_confidence[0] > threshold) & active_block_mask[0]
                if high_conf_mask.sum().item() >= num_to_transfer:
                    mask_transfer_index[0] = high_conf_mask
                else:
                    num_available = active_block_mask.sum().item()
                    _, idx = torch.topk(mask_confidence[0], k=min(num_to_transfer, num_available))
                    mask_transfer_index[0, idx] = True
            editable_positions = ~active_block_mask & ~prompt_mask_in_block[None, :]
            editing_confidence = torch.where(editable_positions, x0_p, -torch.inf)
            high_conf_editing = (editing_confidence[0] > editing_threshold) & editable_positions[0]
            editing_transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            editing_transfer_index[0] = high_conf_editing & (x0[0] != old_block_tokens[0])
            final_transfer_index = mask_transfer_index | editing_transfer_index
            if final_transfer_index.any():
                cur_x[:, -block_length:][final_transfer_index] = x0[final_transfer_index]
                for c in final_transfer_index[0].nonzero().flatten().tolist():
                    trace.setdefault(block_start_pos + c - prompt_length, []).append((step, int(x0[0, c])))
                step += 1
            if active_block_mask.sum() == 0 and not editing_transfer_index.any():
                break
        x[:, :end] = cur_x
    return x[0, prompt_length : prompt_length + gen_length].tolist(), trace
