"""MDPO rollouts against DARE's: ``mdpo_diffusion_generate_llada`` (verl/workers/rollout/mdpo_llada_rollout.py)
and ``mdpo_diffusion_generate_dream`` (mdpo_dream_rollout.py), transcribed below on the same tiny models.

DARE samples x0 with ``torch.distributions.Categorical``, megadare from its per-prompt streams, so the
transcriptions *replay* megadare's recorded proposals as their x0 (``x0_at``) and recompute everything else
themselves: the tempered distribution, the confidence they record, the remasking ranking, the schedule and the
commits. The final tokens, every step's input state, which positions each step predicts (all masked positions of
the canvas: later blocks too) and the recorded confidences must then agree with megadare's trajectory.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megadare.rollout.engine import SamplingParams
from megadare.rollout.native import NativeEngine, NativeSettings

from native_traces import build

EOS = 253
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 2, 9, 4, 60, 61]]  # equal lengths: DARE's rollout pads nothing here


def get_num_transfer_tokens(mask_index, steps):  # DARE verl/workers/rollout/generate.py:31
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    num_transfer_tokens = base.expand(-1, steps).clone()
    if remainder.sum() > 0:
        indices = torch.arange(steps, device=mask_index.device)
        mask = indices.unsqueeze(0) < remainder
        num_transfer_tokens[mask] += 1
    return num_transfer_tokens.to(torch.int64)


def dare_llada(model, prompt, mask_id, steps, gen_length, block_length, temperature, x0_at):
    """mdpo_llada_rollout.py:61-213, conf_alg 'llada', rcr False, no top-k / top-p; x0_at(i, p) replays x0."""
    batch_size, prompt_length = prompt.shape
    x = torch.full((batch_size, prompt_length + gen_length), mask_id, dtype=torch.long)
    x[:, :prompt_length] = prompt.clone()
    num_blocks = gen_length // block_length
    inputs, results, confidences = [], [], []
    steps_per_block = max(1, steps // num_blocks)
    step = 0
    for num_block in range(num_blocks):
        start_idx = prompt_length + num_block * block_length
        end_idx = prompt_length + (num_block + 1) * block_length
        block_mask_index = x[:, start_idx:end_idx] == mask_id
        num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps_per_block)
        for i in range(steps_per_block):
            mask_index = x == mask_id
            inputs.append(x[:, -gen_length:].clone())
            logits = model(x).float()
            if temperature > 0:
                logits = logits / temperature
            p = F.softmax(logits, dim=-1)
            x0 = x0_at(step, mask_index, p)
            confidence = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
            confidences.append(confidence[:, -gen_length:].clone())
            remasking_confidence = confidence.clone()
            remasking_confidence[:, end_idx:] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            results.append(x0[:, -gen_length:].clone())
            remasking_confidence = torch.where(mask_index, remasking_confidence, torch.tensor(-np.inf))
            for j in range(batch_size):
                num_tokens = num_transfer_tokens[j, i].item()
                if num_tokens > 0:
                    _, select_indices = torch.topk(remasking_confidence[j], k=num_tokens)
                    x[j, select_indices] = x0[j, select_indices]
            step += 1
    return x[:, -gen_length:], results, confidences, inputs


def dare_dream(model, prompt, mask_id, steps, gen_length, temperature, x0_at):
    """mdpo_dream_rollout.py:61-197, conf_alg 'entropy', no top-k / top-p; x0_at(i, p) replays x0."""
    batch_size = prompt.shape[0]
    eps = 1e-3
    x = F.pad(prompt, (0, gen_length), value=mask_id)
    timesteps = torch.linspace(1, eps, steps + 1)
    inputs, results, confidences = [], [], []
    for i in range(steps):
        mask_index = x == mask_id
        inputs.append(x[:, -gen_length:].clone())
        logits = model(x).float()
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        if temperature > 0:
            logits = logits / temperature
        p = F.softmax(logits, dim=-1)
        x0 = x0_at(i, mask_index, p)
        confidence = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
        confidences.append(confidence[:, -gen_length:].clone())
        remasking_confidence = torch.sum(p * torch.log(p + 1e-10), dim=-1)
        x0 = torch.where(mask_index, x0, x)
        results.append(x0[:, -gen_length:].clone())
        remasking_confidence = torch.where(mask_index, remasking_confidence, torch.tensor(-np.inf))
        t, s = timesteps[i], timesteps[i + 1]
        target_mask_count = (mask_index.sum(dim=-1).float() * (s / t)).long()
        for b in range(batch_size):
            current_mask = mask_index[b]
            n_masked = current_mask.sum().item()
            n_to_unmask = max(0, min(n_masked - target_mask_count[b].item(), n_masked))
            if n_to_unmask > 0:
                masked_conf = remasking_confidence[b].clone()
                masked_conf[~current_mask] = -np.inf
                _, select_indices = torch.topk(masked_conf, k=n_to_unmask)
                x[b, select_indices] = x0[b, select_indices]
    return x[:, -gen_length:], results, confidences, inputs


CASES = {
    # DARE's recipes: LLaDA blocks of 32 over 512 tokens, 256 steps, T 0.6, conf_alg llada (megadare:
    # maskgit_plus); Dream one block over the response, T 0.2, entropy, its MDPO schedule. Scaled down.
    "llada": dict(block_size=4, steps_per_block=2, temperature=0.6, confidence="maskgit_plus"),
    "dream": dict(
        block_size=12, steps_per_block=6, temperature=0.2, confidence="entropy", schedule="linspace_remaining"
    ),
}


@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("greedy", [False, True])
def test_mdpo_rollout_is_dares(family, greedy):
    model, arch = build(family)
    eng = NativeEngine(model, arch, eos_token_id=EOS, device="cpu", settings=NativeSettings())
    opts = dict(CASES[family], temperature=0.0) if greedy else CASES[family]
    R = 12
    params = SamplingParams(max_new_tokens=R, record_steps=True, stop_at_eos=False, seed=3, **opts)
    trajs = eng.generate(PROMPTS, params)
    preds = torch.tensor([t.step_predictions for t in trajs])  # [rows, steps, R]
    confs = torch.tensor([t.step_confidences for t in trajs], dtype=torch.float64)

    def x0_at(i, mask_index, p):
        x0 = p.argmax(-1)  # DARE's greedy x0 (p.max); at unmasked positions it is overwritten by x
        if greedy:
            return x0
        resp = mask_index[:, -R:]
        assert (preds[:, i] >= 0)[resp].all(), "a masked response position without a prediction"
        x0[:, -R:] = torch.where(resp, preds[:, i], x0[:, -R:])
        return x0

    def forward(x):  # as a trained model: no mass on the mask token (megadare never predicts it; DARE could)
        with torch.no_grad():
            return model(x).index_fill(-1, torch.tensor([arch.mask_token_id]), float("-inf"))

    prompt = torch.tensor(PROMPTS)
    steps = params.steps_per_block * (R // params.block_size)
    if family == "llada":
        out = dare_llada(forward, prompt, arch.mask_token_id, steps, R, params.block_size, params.temperature, x0_at)
    else:
        out = dare_dream(forward, prompt, arch.mask_token_id, steps, R, params.temperature, x0_at)
    tokens, results, confidences, inputs = out
    assert tokens.tolist() == [t.response_ids for t in trajs]
    assert len(results) == preds.shape[1] == steps
    for i, (x_in, x0, conf) in enumerate(zip(inputs, results, confidences)):
        masked = x_in == arch.mask_token_id
        assert ((preds[:, i] >= 0) | ~masked).all(), i  # every masked position, later blocks included
        assert torch.equal(preds[:, i][masked], x0[masked]), i
        torch.testing.assert_close(confs[:, i][masked], conf.double()[masked], rtol=1e-5, atol=1e-6)
        for r, t in enumerate(trajs):  # the state before step i follows from the commit steps
            state = [tok if s < i else arch.mask_token_id for tok, s in zip(t.response_ids, t.commit_step)]
            assert state == x_in[r].tolist(), (i, r)
