"""The code inside DARE's LLaDA actor methods, run live (``DARE_SRC``, tests/dare_source.py; skipped without it)
against megadare's trainer loss on identical masks and draws: ``DLLMDataParallelPPOActor`` of
``llada_dp_actor_{d1,coupled_grpo,bgpo,spg,dtreerpo,justgrpo,vrpo}.py`` is instantiated as DARE's workers do (its
real base classes ``dp_actor.DataParallelPPOActor`` / ``base.BasePPOActor``, an OmegaConf actor config built like
DARE's recipe/llada/run_*_llada_8b_instruct.sh), on algo_toy's toy dLLM behind a packed-varlen
``forward(input_ids, cu_seqlens, max_seqlen).logits`` (what ``mdlm_sp_utils.get_packed_logits`` calls), and its
own ``compute_log_prob`` (old / reference log-probs) and ``update_policy`` (``_forward_micro_batch``, the policy
loss, the ``backward`` calls, ``_optimizer_step``) run as written. DARE's Dream actors
``dream_dp_actor_{d1,coupled_grpo,bgpo,spg,dtreerpo,vrpo}.py`` (the LLaDA ones with ``get_packed_logits(...,
shift_logits=True)``: ``cat([logits[:, :1], logits[:, :-1]])`` over the packed row, as Dream's HF model leaves the
shift to its caller) run the same way on the same toy, its raw output read as Dream's (position k-1 predicts token
k), against megadare on the Dream family's arch (``logits_shift`` 1). The gradient the actor accumulates (captured
at its optimizer's ``step``) and its loss are compared with megadare's. Each comparison prints its max
|difference|.

Stood in, by name, for what needs ray / FSDP / CUDA (nothing of the computation): ``verl.DataProto`` (a dict of
tensors with ``select`` / ``split`` / ``to``), ``verl.utils.debug.GPUMemoryLogger`` (identity decorator),
``verl.utils.fsdp_utils`` (an ``FSDPModule`` class nothing is an instance of: the plain module path of
``_optimizer_step``), ``verl.utils.seqlen_balancing`` and ``verl.utils.ulysses`` (dynamic batch size and sequence
parallelism are off here, never called: where a recipe turns the dynamic batch size on, d-TreeRPO's and
JustGRPO's, one micro-batch holding the whole batch stands in for its packing), and the optimizer (records the
gradients at ``step``). The FSDP wrapper is absent: the actor holds the plain module, which ``_optimizer_step``
handles as such. ``grad_clip`` is 1e9 so the recipes' clip does not rescale the gradient compared.
"""

from __future__ import annotations

import types

import pytest
import torch
from omegaconf import OmegaConf

from megadare.algos import REGISTRY

import test_algos_dare_formulas as formulas
from algo_toy import one_thread  # noqa: F401  (autouse fixture)
from algo_toy import MASK, Toy, sample, toy_archs, toy_dream_arch
from dare_source import dare_module, report
from dare_source import dllm, global_rng_restored  # noqa: F401  (fixtures)
from test_algos_objectives import _trainer_loss

PAD = 0  # left padding of the prompts: a real token id (DARE's d1 actor scores every position, pads included)


# ================================================================== stand-ins for what needs ray / FSDP / CUDA
class TensorBatch(dict):
    """``DataProto.batch`` (a TensorDict): tensors sharing dim 0, split along it; ``to`` is a no-op on CPU."""

    def split(self, size: int) -> list[TensorBatch]:
        n = len(next(iter(self.values())))
        return [TensorBatch({k: v[i : i + size] for k, v in self.items()}) for i in range(0, n, size)]

    def to(self, device) -> TensorBatch:
        return self


class DataProtoStandIn:
    """``verl.DataProto``: ``batch``, ``non_tensor_batch``, ``meta_info`` and ``select(batch_keys=...)``."""

    def __init__(self, tensors: dict, meta_info: dict):
        self.batch, self.non_tensor_batch, self.meta_info = TensorBatch(tensors), {}, meta_info

    def select(self, batch_keys=None, non_tensor_batch_keys=None) -> DataProtoStandIn:
        return DataProtoStandIn({k: self.batch[k] for k in batch_keys}, self.meta_info)


class GPUMemoryLoggerStandIn:
    """``verl.utils.debug.GPUMemoryLogger``: the decorated method unchanged."""

    def __init__(self, role: str, logger=None):
        pass

    def __call__(self, method):
        return method


def never_called(*args, **kwargs):
    raise AssertionError("dynamic batch size / Ulysses SP / FSDP2 are off in this harness")


STAND_INS = {
    "verl": {"DataProto": DataProtoStandIn},
    "verl.utils.debug": {"GPUMemoryLogger": GPUMemoryLoggerStandIn},
    "verl.utils.fsdp_utils": {"FSDPModule": type("FSDPModule", (), {}), "fsdp2_clip_grad_norm_": never_called},
    "verl.utils.seqlen_balancing": {"get_reverse_idx": never_called, "rearrange_micro_batches": never_called},
    "verl.utils.ulysses": dict.fromkeys(
        ("gather_outpus_and_unpad", "ulysses_pad_and_slice_inputs", "ulysses_pad"), never_called
    ),
}


class GradRecorder:
    """The actor's optimizer: ``step`` records the accumulated gradients (and changes no weight)."""

    def __init__(self, params):
        self.params, self.grads = list(params), None

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads = [p.grad.detach().clone() for p in self.params]


class PackedToy(torch.nn.Module):
    """The toy dLLM as DARE's actors call their model: ``forward(input_ids [1, T], cu_seqlens, max_seqlen)`` with
    the valid tokens of every sample packed, each segment attending to itself only (flash-attn varlen); returns
    an object with ``.logits`` [1, T, V] in fp32 (what ``cross_entropy`` computes in under DARE's bf16 autocast;
    the actors index-put it into fp32 buffers). ``config`` carries the mask / pad ids the actor reads."""

    def __init__(self, toy: Toy, pad_token_id: int = PAD):
        super().__init__()
        self.toy = toy
        self.config = types.SimpleNamespace(mask_token_id=MASK, pad_token_id=pad_token_id)

    def forward(self, input_ids, cu_seqlens=None, max_seqlen=None):
        bounds = cu_seqlens.tolist()
        parts = [self.toy(input_ids[0, a:b].unsqueeze(0))[0, : b - a] for a, b in zip(bounds, bounds[1:])]
        return types.SimpleNamespace(logits=torch.cat(parts).unsqueeze(0).float())


@pytest.fixture(scope="module")
def actor_classes():
    """{file: DARE's ``DLLMDataParallelPPOActor`` of ``verl/workers/actor/<file>.py``}, on its real base classes."""
    base = dare_module("verl.workers.actor.base", STAND_INS)
    dp = dare_module(
        "verl.workers.actor.dp_actor", STAND_INS | {"verl.workers.actor": {"BasePPOActor": base.BasePPOActor}}
    )
    parent = STAND_INS | {"verl.workers.actor": {"DataParallelPPOActor": dp.DataParallelPPOActor}}
    files = ("llada_dp_actor_d1", "llada_dp_actor_coupled_grpo", "llada_dp_actor_bgpo", "llada_dp_actor_spg")
    files += ("llada_dp_actor_dtreerpo", "llada_dp_actor_justgrpo", "llada_dp_actor_vrpo")
    files += tuple(f.replace("llada", "dream") for f in files if "justgrpo" not in f)  # DARE has no Dream JustGRPO
    return {f: dare_module(f"verl.workers.actor.{f}", parent).DLLMDataParallelPPOActor for f in files}


FAMILY_ARCHS = {"llada": lambda: toy_archs()[0], "dream": toy_dream_arch}  # DARE's actor file prefix: megadare arch


def recipe_config(mc_num: int, mini_batch: int, micro_batch: int, **extra) -> OmegaConf:
    """The actor config of DARE's LLaDA recipes (verl's ppo_trainer.yaml actor defaults + the scripts' overrides:
    token-mean, no KL, eps 0.2, dual clip 3, n_l = mc_num, cfg 0), with the toy batch's sizes."""
    return OmegaConf.create(
        {
            "strategy": "fsdp",
            "ppo_mini_batch_size": mini_batch,
            "ppo_micro_batch_size_per_gpu": micro_batch,
            "use_dynamic_bsz": False,
            "ppo_max_token_len_per_gpu": 5120,
            "grad_clip": 1e9,
            "clip_ratio": 0.2,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.2,
            "clip_ratio_c": 3.0,
            "loss_agg_mode": "token-mean",
            "entropy_coeff": 0,
            "use_kl_loss": False,
            "use_torch_compile": False,
            "kl_loss_coef": 0.001,
            "kl_loss_type": "low_var_kl",
            "ppo_epochs": 1,
            "shuffle": False,
            "ulysses_sequence_parallel_size": 1,
            "mc_num": mc_num,
            "n_l": mc_num,
            "cfg_scale": 0.0,
            **extra,
        }
    )


def make_actor(cls, toy: Toy, config, pad_token_id: int = PAD):
    model = PackedToy(toy, pad_token_id)
    return cls(config, model, GradRecorder(model.parameters()))


def left_pad(rows: list[torch.Tensor], width: int, value) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((width - len(r),), value, dtype=r.dtype), r]) for r in rows])


def actor_batch(samples, views, p_masks, adv_dtype=torch.float32) -> DataProtoStandIn:
    """DARE's rollout batch for ``samples``: prompts left-padded to one length (attention 0 there), the stored
    corruptions ``perturbed_seq`` [B, n_views, S] (megadare's / DARE's views, padded alike), ``mask_indices``
    (MASK there), ``p_mask`` (``p_masks[i]`` [n_views, P_i + R]), token-level ``advantages`` [B, R]."""
    width = max(len(s.prompt_ids) for s in samples) + len(samples[0].response_ids)
    seqs = [torch.tensor(s.prompt_ids + s.response_ids) for s in samples]
    ones = [torch.ones(len(x), dtype=torch.long) for x in seqs]
    stack = lambda rows, value: torch.stack([left_pad(list(r), width, value) for r in rows])  # noqa: E731
    perturbed = stack(views, PAD)
    R = len(samples[0].response_ids)
    tensors = {
        "input_ids": left_pad(seqs, width, PAD),
        "attention_mask": left_pad(ones, width, 0),
        "position_ids": torch.arange(width).expand(len(samples), width).contiguous(),
        "responses": torch.tensor([s.response_ids for s in samples]),
        "perturbed_seq": perturbed,
        "mask_indices": perturbed == MASK,
        "p_mask": stack([p.float() for p in p_masks], 1.0),
        "advantages": torch.tensor([[s.advantage] * R for s in samples], dtype=adv_dtype),
    }
    return DataProtoStandIn(tensors, {"micro_batch_size": 1, "temperature": 1.0, "use_dynamic_bsz": False})


def recorded_policy_losses(monkeypatch, actor_cls, name: str) -> list[torch.Tensor]:
    """Every policy loss the actor's ``update_policy`` computes (its module's ``name``, wrapped)."""
    scope, seen = actor_cls.update_policy.__globals__, []
    policy_loss = scope[name]

    def recording(*args, **kwargs):
        out = policy_loss(*args, **kwargs)
        seen.append(out[0].detach())
        return out

    monkeypatch.setitem(scope, name, recording)
    return seen


def worst_grad_difference(actor, megadare_loss, toy: Toy) -> float:
    """max |DARE's accumulated gradient - the gradient of megadare's loss|, over every parameter; and the
    gradients agree to fp32 rounding (DARE's log-prob buffers are fp32)."""
    ours = torch.autograd.grad(megadare_loss, list(toy.parameters()))
    worst = 0.0
    for dare_grad, our_grad in zip(actor.actor_optimizer.grads, ours):
        assert torch.allclose(dare_grad, our_grad, rtol=1e-4, atol=1e-6), float((dare_grad - our_grad).abs().max())
        worst = max(worst, float((dare_grad - our_grad).abs().max()))
    return worst


# ================================================================== d1 / Coupled-GRPO / BGPO: update_policy
RATIO_ALGOS = {  # name: (actor file, megadare params of the DARE preset, the actor's mc_num, its policy loss)
    "d1": ("llada_dp_actor_d1", {"eps_low": 0.2, "dual_clip": 3.0, "kl_coef": 0.0}, 1, "compute_policy_loss"),
    "coupled_grpo": ("llada_dp_actor_coupled_grpo", {"eps_low": 0.2, "dual_clip": 3.0, "kl_coef": 0.0}, 1, None),
    "bgpo": ("llada_dp_actor_bgpo", {"eps_low": 0.2, "dual_clip": 3.0, "n_mc": 4}, 4, "compute_policy_loss_bgpo"),
}


def dare_p_masks(name: str, s, views, t: float) -> torch.Tensor:
    """The p_mask DARE's forward process stores with each view: d1 1 on the response, 0.15 on the prompt
    (``_forward_process_d1``); Coupled-GRPO the masks times 1, t, 1 - t (``_forward_process_coupled_grpo``);
    BGPO |masked| / R on the response (``_forward_process_bgpo``)."""
    P, R = len(s.prompt_ids), len(s.response_ids)
    masks = torch.stack([v.tokens == MASK for v in views]).float()
    if name == "d1":
        return torch.cat([torch.full((len(views), P), 0.15), torch.ones(len(views), R)], 1)
    if name == "coupled_grpo":
        return masks * torch.tensor([1.0, t, 1.0 - t]).unsqueeze(1)
    return (masks[:, P:].sum(1, keepdim=True) / R).expand(-1, P + R)


@pytest.mark.parametrize("family", list(FAMILY_ARCHS))
@pytest.mark.parametrize("name", list(RATIO_ALGOS))
def test_ratio_actor_update_policy_is_megadares_loss(actor_classes, monkeypatch, name, family):
    """DARE's actor ``compute_log_prob`` (old weights) then ``update_policy`` (current weights; recipe micro-batch
    1, mini-batch = the batch) on megadare's views of a 4-sample batch, off-policy as
    test_dare_preset_loss_is_dares_actor_loss_on_the_same_masks: its accumulated gradient and loss equal
    megadare's trainer loss (the DARE preset's params)."""
    file, params, mc_num, loss_name = RATIO_ALGOS[name]
    actor_cls = actor_classes[file.replace("llada", family)]
    pg_losses = recorded_policy_losses(monkeypatch, actor_cls, loss_name or "compute_policy_loss")
    full = FAMILY_ARCHS[family]()
    algo = REGISTRY[name](params)
    worst_loss = worst_grad = 0.0
    for seed in range(3):
        toy = Toy(seed)
        old = formulas.perturbed(toy, seed + 99, 0.03 if name == "bgpo" else 0.15)
        samples, views, p_masks, rows = [], [], [], []
        for i, (c, y, a) in enumerate(formulas.TRACE_BATCH + [([1], [0, 0, 1, 2], 0.75)]):
            s = sample(c, y, adv=a, index=i)
            rows += algo.rows(s, full, 0, torch.Generator().manual_seed(10 * seed + i))
            vs = algo.views(s, full, 0, torch.Generator().manual_seed(10 * seed + i))
            t_gen = torch.Generator().manual_seed(10 * seed + i)  # coupled's t: the first draw (0.2 + 0.6 u)
            t = 0.2 + 0.6 * float(torch.rand((), generator=t_gen, dtype=torch.float64))
            samples.append(s)
            views.append([v.tokens for v in vs])
            p_masks.append(dare_p_masks(name, s, vs, t))
        got, _, _ = _trainer_loss(algo, toy, rows, 0, old_toy=old, ref=False)
        data = actor_batch(samples, views, p_masks)
        config = recipe_config(mc_num, len(samples), 1)
        _, data.batch["old_log_probs"], data.batch["old_loss_per_sample"] = make_actor(
            actor_cls, old, config
        ).compute_log_prob(data)
        actor = make_actor(actor_cls, toy, config)
        pg_losses.clear()
        actor.update_policy(data)
        want = sum(float(v) for v in pg_losses) / len(samples) / mc_num  # loss / gradient_accumulation / mc_num
        worst_loss = max(worst_loss, abs(float(got) - want))
        worst_grad = max(worst_grad, worst_grad_difference(actor, got, toy))
    assert worst_loss < 1e-5, worst_loss
    report(f"{name} ({family}): megadare trainer loss vs DARE live actor update_policy loss", worst_loss)
    report(f"{name} ({family}): megadare gradient vs DARE live actor update_policy gradient", worst_grad)


# ================================================================== SPG: _forward_micro_batch's per-sequence value
@pytest.mark.parametrize("family", list(FAMILY_ARCHS))
@pytest.mark.parametrize("n_mc", [1, 2])
def test_spg_actor_update_policy_is_megadares_loss(actor_classes, dllm, monkeypatch, n_mc, family):
    """DARE's SPG actor ``update_policy`` (``logp_estimation=mix``, its ``eubo_beta`` / mix weight defaults 1.5 /
    0.5, recipe micro-batch 1) on the corruptions of DARE's live ``_forward_process_spg`` (block 2, num_t = n_mc,
    seeded per sample) == megadare's SPG (``estimator=dare``) trainer loss and gradient on the same seeds,
    over test_algos_dare_formulas' SPG batches (advantages of both signs: the ELBO and the EUBO mix branch)."""
    actor_cls = actor_classes[f"{family}_dp_actor_spg"]
    pg_losses = recorded_policy_losses(monkeypatch, actor_cls, "compute_policy_loss_spg")
    full = FAMILY_ARCHS[family]()
    algo = REGISTRY["spg"]({"estimator": "dare", "block": 2, "n_mc": n_mc})
    worst_loss = worst_grad = 0.0
    for seed in range(4):
        toy = Toy(seed)
        for batch in formulas.SPG_BATCHES:
            samples = [sample(c, y, adv=a, index=i) for i, (c, y, a) in enumerate(batch)]
            seed_of = lambda index: 1000 * seed + 17 * index + n_mc  # noqa: E731
            views, p_masks, rows = [], [], []
            for s in samples:
                x0 = torch.tensor(s.prompt_ids + s.response_ids)
                noisy, _, p_mask = dllm._forward_process_spg(
                    x0.unsqueeze(0), torch.ones(len(x0), dtype=torch.long), len(s.prompt_ids),
                    seed=seed_of(s.index), block_length=2, num_t=n_mc, MASK_TOKEN_ID=MASK,
                )  # fmt: skip
                views.append(noisy)
                p_masks.append(p_mask)
                rows += algo.rows(s, full, 0, torch.Generator().manual_seed(seed_of(s.index)))
            got, _, _ = _trainer_loss(algo, toy, rows, 0, ref=False)
            data = actor_batch(samples, views, p_masks)
            for key in ("perturbed_seq", "mask_indices", "p_mask"):  # [B, num_iterations = 1, mc_num, S]
                data.batch[key] = data.batch[key].unsqueeze(1)
            actor = make_actor(actor_cls, toy, recipe_config(n_mc, len(samples), 1, logp_estimation="mix"))
            pg_losses.clear()
            actor.update_policy(data)
            want = sum(float(v) for v in pg_losses) / len(samples)  # loss / gradient_accumulation
            worst_loss = max(worst_loss, abs(float(got) - want))
            worst_grad = max(worst_grad, worst_grad_difference(actor, got, toy))
    assert worst_loss < 1e-5, worst_loss
    report(f"spg (n_mc={n_mc}, {family}): megadare trainer loss vs DARE live actor update_policy loss", worst_loss)
    report(f"spg (n_mc={n_mc}, {family}): megadare gradient vs DARE live actor update_policy gradient", worst_grad)


# ================================================================== d-TreeRPO: update_policy
TREE_NODES = [  # (prompt, parent's decoded state, segment, local advantage, parent id): siblings share a parent
    ([1, 2], [], [0, 2], 0.5, 0),
    ([1, 2], [], [1, 1], -0.25, 0),
    ([1, 2], [], [2, 1], 0.25, 0),
    ([1, 2], [0, 2], [1, 1], 0.75, 1),
    ([1, 2], [0, 2], [1, 0], 0.5, 1),
    ([0], [], [2, 2, 0, 1], -1.0, 2),
    ([0], [], [2, 1, 0, 1], 1.0, 2),
]
NO_EOS = 4  # DARE's EOS (LLaDA's pad_token_id) for this test: an id no sequence holds (no cut)


def tree_batch(nodes, step: int) -> DataProtoStandIn:
    """DARE's d-TreeRPO segment batch: ``parent_ids`` (prompt left-padded, then the parent's state and the
    segment masked, right-padded; attention 0 on the padding), ``child_ids`` (the segment decoded), one
    ``prompt_length``, ``local_advantages``, ``group_ids`` (the parent)."""
    P = max(len(c) for c, *_ in nodes)
    width = P + max(len(st) + len(seg) for _, st, seg, *_ in nodes)
    at = torch.arange(width)

    def row(c, tail):
        out = torch.full((width,), PAD, dtype=torch.long)
        out[P - len(c) : P + len(tail)] = torch.tensor(c + tail)
        return out

    tensors = {
        "parent_ids": torch.stack([row(c, st + [MASK] * len(seg)) for c, st, seg, *_ in nodes]),
        "child_ids": torch.stack([row(c, st + seg) for c, st, seg, *_ in nodes]),
        "attention_mask": torch.stack(
            [((at >= P - len(c)) & (at < P + len(st) + len(seg))).long() for c, st, seg, *_ in nodes]
        ),
        "prompt_length": torch.full((len(nodes),), P),
        "local_advantages": torch.tensor([a for *_, a, _ in nodes]),
        "group_ids": torch.tensor([g for *_, g in nodes]),
    }
    return DataProtoStandIn(tensors, {"micro_batch_size": 1, "global_step": step})


@pytest.mark.parametrize("family", list(FAMILY_ARCHS))
@pytest.mark.parametrize("step", [0, 24000])
def test_d_treerpo_actor_update_policy_is_megadares_loss(actor_classes, step, family):
    """DARE's d-TreeRPO actor (recipe: eps 0.4, k3 KL 0.01 to the reference, self-distillation on with its
    defaults; one micro-batch holding the whole batch, as its dynamic batch size packs a small one) on the
    segments megadare scores (the parent state up to the segment: megadare's stated canvas deviation): its
    ``compute_log_prob`` (old and reference weights) then ``update_policy`` give megadare's gradient; at step 0
    (self-distillation's lambda 0) also its loss. Step 24000 of 30000: lambda_t 1.1e-3, siblings of 2 and 3
    with 1 or 2 positive advantages."""
    actor_cls = actor_classes[f"{family}_dp_actor_dtreerpo"]
    full = FAMILY_ARCHS[family]()
    algo = REGISTRY["d_treerpo"]({"eps_low": 0.4, "branch": 4, "depth": 2, "root_fanout": 4, "kl_coef": 0.01})
    toy = Toy(0)
    old, ref = formulas.perturbed(toy, 99, 0.15), formulas.perturbed(toy, 199, 0.3)
    samples = [
        sample(c + st, seg, adv=a, index=i, extra={"parent": (0, 0, g), "rollout_step": step})
        for i, (c, st, seg, a, g) in enumerate(TREE_NODES)
    ]
    rows = algo.batch_rows(samples, full, 0, lambda index: torch.Generator().manual_seed(index))
    got, _, _ = _trainer_loss(algo, toy, rows, 0, old_toy=old, ref=True, ref_toy=ref)
    data = tree_batch(TREE_NODES, step)
    config = recipe_config(1, len(TREE_NODES), len(TREE_NODES), clip_ratio=0.4, use_kl_loss=True, kl_loss_coef=0.01)
    config.enable_self_distillation = True  # sd_lambda_max 3e-3, gamma 2, tau_max 2, beta 0.7: the defaults
    for key, weights in (("old_local_logps", old), ("ref_local_logps", ref)):
        _, data.batch[key], _ = make_actor(actor_cls, weights, config).compute_log_prob(data)
    actor = make_actor(actor_cls, toy, config, pad_token_id=NO_EOS)
    metrics = actor.update_policy(data)
    worst_grad = worst_grad_difference(actor, got, toy)
    want = metrics["actor/pg_loss"][0] + metrics["actor/kl_loss"] + metrics["actor/sd_loss"][0]
    if step == 0:
        assert metrics["actor/sd_loss"] == [0.0]
        assert abs(float(got) - want) < 1e-5, (float(got), want)
    else:  # the term is on; megadare's value of it omits KL(q || p)'s constant sum q log q (the gradient is exact)
        assert metrics["actor/sd_loss"][0] > 1e-3
    tag = f"d_treerpo (step {step}, {family})"
    report(f"{tag}: megadare trainer loss vs DARE live actor pg + kl + sd", abs(float(got) - want))
    report(f"{tag}: megadare gradient vs DARE live actor update_policy gradient", worst_grad)


# ================================================================== VRPO: update_policy
VRPO_PAIRS = [  # (prompt, chosen, rejected): one response canvas R = 4
    ([1, 2], [0, 2, 1, 1], [2, 2, 0, 1]),
    ([0], [1, 0, 2, 0], [0, 0, 1, 2]),
    ([2, 1], [1, 1, 2, 2], [0, 1, 1, 0]),
]


@pytest.mark.parametrize("family", list(FAMILY_ARCHS))
def test_vrpo_actor_update_policy_is_megadares_loss(actor_classes, family):
    """DARE's VRPO actor (recipe: beta 0.2, n = 4; pairs interleaved chosen / rejected, micro-batch 2 = one pair)
    ``compute_log_prob`` (reference weights) then ``update_policy`` on megadare's stored masks (p_mask m / R) ==
    megadare's VRPO (``margin_norm=canvas``: DARE's B / R) trainer loss and gradient, one pair per row."""
    actor_cls = actor_classes[f"{family}_dp_actor_vrpo"]
    full = FAMILY_ARCHS[family]()
    algo = REGISTRY["vrpo"]({"n_mc": 4, "margin_norm": "canvas", "canvas_length": 4})
    worst_loss = worst_grad = 0.0
    for seed in range(3):
        toy = Toy(seed)
        ref = formulas.perturbed(toy, seed + 99, 0.15)
        samples, views, p_masks, rows = [], [], [], []
        for i, (c, y_w, y_l) in enumerate(VRPO_PAIRS):
            pair = [sample(c, y, index=2 * i + k) for k, y in enumerate((y_w, y_l))]
            gens = [torch.Generator().manual_seed(10 * seed + s.index) for s in pair]
            rows.append(algo.pair_row(*pair, full, *gens))
            for s in pair:
                vs = algo.views(s, full, 0, torch.Generator().manual_seed(10 * seed + s.index))
                samples.append(s)
                views.append([v.tokens for v in vs])
                p_masks.append(dare_p_masks("bgpo", s, vs, 0.0))  # _forward_process_vrpo's: m / R
        got, _, _ = _trainer_loss(algo, toy, rows, 0, ref=True, ref_toy=ref)
        data = actor_batch(samples, views, p_masks)
        config = recipe_config(4, len(samples), 2, beta=0.2)
        _, data.batch["ref_log_probs"], _ = make_actor(actor_cls, ref, config).compute_log_prob(data)
        actor = make_actor(actor_cls, toy, config)
        actor.update_policy(data)  # its metrics' pg_loss is the last micro-batch's only
        worst_grad = max(worst_grad, worst_grad_difference(actor, got, toy))
        want = sum(float(actor._compute_loss(data.batch.split(2)[i])) for i in range(len(VRPO_PAIRS)))
        worst_loss = max(worst_loss, abs(float(got) - want / len(VRPO_PAIRS)))
    assert worst_loss < 1e-5, worst_loss
    report(f"vrpo ({family}): megadare trainer loss vs DARE live actor _compute_loss", worst_loss)
    report(f"vrpo ({family}): megadare gradient vs DARE live actor update_policy gradient", worst_grad)


# ================================================================== Dream's shift across packed samples
def test_dream_shift_reads_the_previous_samples_last_logits_at_each_first_token(actor_classes):
    """DARE's Dream actors shift the packed row as one (``get_packed_logits(shift_logits=True)``): a sample's first
    position gets the last logits of the sample packed before it (the first sample's, its own). megadare scores
    nothing at a first token (``base._shifted``). The two agree on every loss above because no loss of these
    actors reads a first token: d1 / Coupled-GRPO / SPG score response positions (their ``loss_per_sample``, which
    does read a masked first prompt token, is printed or dropped), BGPO's ELBO masks the response only, d-TreeRPO
    scores the segment; SPG's ``use_mask_prompt`` masked a first prompt token in 12 of the draws of
    test_spg_actor_update_policy_is_megadares_loss, which agree to 1e-7."""
    actor = make_actor(actor_classes["dream_dp_actor_d1"], Toy(0), recipe_config(1, 2, 2))
    rows = [torch.tensor([1, 2, MASK, 0]), torch.tensor([MASK, 1, MASK])]
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    shifted = actor._get_logits(actor.actor_module, torch.cat(rows).unsqueeze(0), cu, 4, torch.tensor([2, 1]))[0]
    raw = [actor.actor_module.toy(r.unsqueeze(0))[0, : len(r)].float() for r in rows]
    assert torch.equal(shifted[1:4], raw[0][:3]) and torch.equal(shifted[5:], raw[1][:2])  # k-1 predicts k
    assert torch.equal(shifted[0], raw[0][0]) and torch.equal(shifted[4], raw[0][3])  # the first tokens
    report(
        "Dream shift: DARE's logits at sample 2's first token vs sample 1's last",
        float((shifted[4] - raw[0][3]).abs().max()),
    )


# ================================================================== JustGRPO: update_policy
JUSTGRPO_BATCH = [([1, 2], [0, 2, 1, 1], 1.25), ([0], [2, 2, 0], -0.5), ([2, 1], [1, 0], -1.5), ([1], [0], 0.75)]


def justgrpo_batch(batch) -> DataProtoStandIn:
    """JustGRPO's batch: prompts left-padded, responses right-padded (attention 0 on both paddings)."""
    P, R = max(len(c) for c, _, _ in batch), max(len(y) for _, y, _ in batch)
    ids = torch.full((len(batch), P + R), PAD)
    attention = torch.zeros(len(batch), P + R, dtype=torch.long)
    for b, (c, y, _) in enumerate(batch):
        ids[b, P - len(c) : P + len(y)] = torch.tensor(c + y)
        attention[b, P - len(c) : P + len(y)] = 1
    tensors = {
        "input_ids": ids,
        "attention_mask": attention,
        "position_ids": torch.arange(P + R).expand(len(batch), P + R).contiguous(),
        "responses": ids[:, P:],
        "advantages": torch.tensor([[a] * R for _, _, a in batch], dtype=torch.float32),
    }
    return DataProtoStandIn(tensors, {"micro_batch_size": 1, "temperature": 0.6, "use_dynamic_bsz": False})


def test_justgrpo_actor_update_policy_is_megadares_loss(actor_classes):
    """DARE's JustGRPO actor (recipe: temperature 0.6, position chunks of 1, token-mean, eps 0.2, dual clip 3; one
    micro-batch holding the batch, as its dynamic batch size packs a small one) ``compute_log_prob`` (old
    weights) then ``update_policy`` on responses of 1 to 4 tokens == megadare's JustGRPO trainer gradient and loss
    (rows scored at 1/T). The toy has no logit for the mask token, so megadare's leaving it out of the
    normaliser (DARE keeps it) is not exercised here."""
    actor_cls = actor_classes["llada_dp_actor_justgrpo"]
    full, _ = toy_archs()
    algo = REGISTRY["justgrpo"]({"eps_low": 0.2, "dual_clip": 3.0})
    worst_loss = worst_grad = 0.0
    for seed in range(3):
        toy = Toy(seed)
        old = formulas.perturbed(toy, seed + 99, 0.15)
        rows = []
        for i, (c, y, a) in enumerate(JUSTGRPO_BATCH):
            s = sample(c, y, adv=a, index=i, extra={"sampling_temperature": 0.6})
            rows += algo.rows(s, full, 0, torch.Generator())
        got, _, _ = _trainer_loss(algo, toy, rows, 0, old_toy=old, ref=False)
        data = justgrpo_batch(JUSTGRPO_BATCH)
        config = recipe_config(1, len(JUSTGRPO_BATCH), len(JUSTGRPO_BATCH), justgrpo_position_chunk_size=1)
        _, data.batch["old_log_probs"], _ = make_actor(actor_cls, old, config).compute_log_prob(data)
        actor = make_actor(actor_cls, toy, config)
        metrics = actor.update_policy(data)
        worst_loss = max(worst_loss, abs(float(got) - sum(metrics["actor/pg_loss"])))
        worst_grad = max(worst_grad, worst_grad_difference(actor, got, toy))
    assert worst_loss < 1e-5, worst_loss
    report("justgrpo: megadare trainer loss vs DARE live actor update_policy loss", worst_loss)
    report("justgrpo: megadare gradient vs DARE live actor update_policy gradient", worst_grad)


# ================================================================== DARE's KL with use_kl_loss (off in its recipes)
def d1_with_kl(actor_classes, batch, kl_coef: float = 0.04):
    """(megadare's d1 trainer loss with k3 KL to the reference, DARE's d1 actor after ``update_policy`` with
    ``use_kl_loss`` and ``kl_loss_type=low_var_kl``, its metrics, the toy) on ``batch``."""
    actor_cls = actor_classes["llada_dp_actor_d1"]
    full, _ = toy_archs()
    algo = REGISTRY["d1"]({"eps_low": 0.2, "dual_clip": 3.0, "kl_coef": kl_coef})
    toy = Toy(1)
    old, ref = formulas.perturbed(toy, 7, 0.1), formulas.perturbed(toy, 8, 0.1)
    samples, views, p_masks, rows = [], [], [], []
    for i, (c, y, a) in enumerate(batch):
        s = sample(c, y, adv=a, index=i)
        rows += algo.rows(s, full, 0, torch.Generator().manual_seed(i))
        vs = algo.views(s, full, 0, torch.Generator().manual_seed(i))
        samples.append(s)
        views.append([v.tokens for v in vs])
        p_masks.append(dare_p_masks("d1", s, vs, 0.0))
    got, _, _ = _trainer_loss(algo, toy, rows, 0, old_toy=old, ref=True, ref_toy=ref)
    data = actor_batch(samples, views, p_masks)
    config = recipe_config(1, len(samples), 1, use_kl_loss=True, kl_loss_coef=kl_coef)
    _, data.batch["old_log_probs"], data.batch["old_loss_per_sample"] = make_actor(
        actor_cls, old, config
    ).compute_log_prob(data)
    _, data.batch["ref_log_probs"], _ = make_actor(actor_cls, ref, config).compute_log_prob(data)
    actor = make_actor(actor_cls, toy, config)
    metrics = actor.update_policy(data)
    return got, actor, metrics, toy


def test_d1_kl_is_dares_live_kl_where_advantages_are_not_positive(actor_classes):
    """With the KL on (``use_kl_loss``, low_var_kl, 0.04: DARE's recipes leave it off), DARE's d1 actor gives
    megadare's d1 gradient (k3 of l_ref - l, capped at 10) on samples with A <= 0."""
    got, actor, _, toy = d1_with_kl(actor_classes, [(c, y, -abs(a)) for c, y, a in formulas.TRACE_BATCH])
    report("d1 + KL (A <= 0): megadare gradient vs DARE live actor", worst_grad_difference(actor, got, toy))


def test_d1_kl_where_advantages_are_positive_is_not_dares_log1p_form(actor_classes, dllm, monkeypatch):
    """For A > 0, DARE's ``dllm_core_algos.kl_penalty`` puts log(1 + l - l_ref) in place of the log-ratio
    (BGPO's linearised ratio, "# kl = diff  # TODO" beside it) in every actor that imports it, d1's and
    Coupled-GRPO's too, whose policy ratio is the plain exp(l - l_old); it is NaN once l - l_ref <= -1 at any
    response position (unscored ones too: NaN x 0 in the masked mean), and the actor then skips the update
    (``_optimizer_step``: grad norm not finite). megadare keeps the k3 of the papers: finite, the value differs
    (l - l_ref = -0.5: DARE 0.307, k3 0.149). ``torch.distributed.get_rank`` (the actor's warning) stood in: 0."""
    from megadare.algos.policy_loss import kl_penalty

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args, **kwargs: 0)
    got, actor, metrics, toy = d1_with_kl(actor_classes, [(c, y, abs(a)) for c, y, a in formulas.TRACE_BATCH])
    assert torch.isfinite(got) and all(torch.isfinite(g).all() for g in torch.autograd.grad(got, [*toy.parameters()]))
    assert not any(torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))) and actor.actor_optimizer.grads is None
    lp, ref, adv = torch.tensor([-2.0, -2.0]), torch.tensor([-1.5, -0.5]), torch.ones(2)
    dare = dllm.kl_penalty(lp, ref, "low_var_kl", advantages=adv)
    assert abs(float(dare[0]) - 0.30685) < 1e-4 and torch.isnan(dare[1])
    assert torch.allclose(kl_penalty(lp, ref, "k3"), torch.tensor([0.14872, 1.98169]), atol=1e-4)
    gap = abs(float(dare[0]) - float(kl_penalty(lp, ref, "k3")[0]))
    report("d1 + KL (A > 0): DARE's log(1 + d) form vs k3 at l - l_ref = -0.5 (its live actor: update skipped)", gap)
