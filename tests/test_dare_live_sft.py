"""megadare's SFT objectives against the publishers' SFT code as DARE ships it, run live (``DARE_SRC``: a checkout
of yjyddq/DARE, loaded by tests/dare_source.py; @83ae8a3 when this was written). Without ``DARE_SRC`` every test
here is skipped, saying so in one line. Each comparison prints its max |difference| (``pytest -s``).

The same tiny megadare model (identical weights) scores both sides; the corruption (x_t, the mask, t) is megadare's
draw, fed into DARE's loss code through the inputs that code takes, so that only the objective is compared:

* SDAR (block diffusion): ``SDARForCausalLM.forward``'s training branch as written (models/SDAR-1dot7B-Chat/
  modeling_sdar.py; its ``return_block_diffusion_token_loss`` path, the unfused form of
  ``FusedLinearDiffusionCrossEntropyLoss``), fed megadare's draw through ``bd_noisy_input_ids`` / ``bd_target_mask``
  / ``bd_p_mask`` (``prepare_for_bd_training_from_artifacts``); its x_t ++ x_0 mask (``block_attn_mask``) against
  megadare's; its own noise draw (``forward_add_noise_packed``) against megadare's block rows in distribution.
* LLaDA (random masking), Dream (random masking, shifted logits), LLaDA2 (block diffusion): the trainers'
  ``_compute_loss_and_backward`` as written (verl/trainer/{llada,dream,llada2}_fsdp_sft_trainer.py).

DARE's trainers run a step as micro-batches of ``micro_batch_size_per_gpu`` samples, each divided by its own token
count, averaged (``training_step``); SDAR divides by the micro-batch's answer tokens (pads included: DARE pads every
sample to ``data.max_length`` and keeps the pads in the answer), the others by its masked tokens. megadare divides
the global batch by one denominator; ``sft.normalize`` picks it: ``answer_length`` is SDAR's at DARE's
``micro_batch_size_per_gpu=1`` (its recipes' setting), ``masked_tokens_per_sample`` the others' at 1,
``masked_tokens`` theirs with one micro-batch a step. The tests check exactly those equalities.

The datasets' padding (every sample padded to ``data.max_length``, the pads scored as answer tokens: LLaDA with
eos, SDAR with the pad id) is compared with ``sft.pad_response`` on DARE's ``__getitem__`` as written.

Stand-ins (named, minimal): ``create_block_mask`` (flex-attention's, CUDA) -> the dense bool mask of its mask_mod;
the FSDP model -> megadare's tiny model with autocast off (DARE's bf16 autocast is a GPU precision setting, not the
objective); the trainers' ``self`` -> the attributes the loss code reads.
"""

from __future__ import annotations

import types
import typing

import pytest
import torch
import torch.nn.functional as F

import megadare.algos.sft as sft
from dare_source import DARE_COMMIT, dare_functions, dare_methods, report
from dare_source import global_rng_restored  # noqa: F401  (fixture)
from megadare.algos.sft import SFTRecipe, example_rows
from megadare.config import Config
from megadare.data.sft_data import SFTExample
from megadare.diffusion.schedule import NoiseSchedule
from megadare.models import build_hf_model, get_family
from megadare.models.attention import MaskSpec
from megadare.trainer.sft_loop import sft_recipe

SDAR_MODELING = "models/SDAR-1dot7B-Chat/modeling_sdar.py"  # extract it from the DARE repository into DARE_SRC
TOL = 1e-5
assert DARE_COMMIT  # the commit the module docstring cites


@pytest.fixture(autouse=True)
def few_threads():
    """Two shared cores: one thread each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny(family: str, **over):
    fam = get_family(family)
    cfg = fam.tiny_config(**over)
    torch.manual_seed(0)
    model = build_hf_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model, fam.arch(cfg)


def _examples(shapes: list[tuple[int, int]], seed: int = 0) -> list[SFTExample]:
    g = torch.Generator().manual_seed(seed)
    return [
        SFTExample(torch.randint(0, 240, (P,), generator=g).tolist(), torch.randint(0, 240, (L,), generator=g).tolist())
        for P, L in shapes
    ]


def _rows_and_t(examples, arch, recipe, seed=0):
    """megadare's rows of each example and the masking probability t of each of its positions (x_t half)."""
    seen: list[torch.Tensor] = []
    real = sft.iid_mask

    def recording(eligible, p, generator, force_one=False):
        seen.append(torch.as_tensor(p, dtype=torch.float32).expand(eligible.shape).clone())
        return real(eligible, p, generator, force_one)

    rows, ts = [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sft, "iid_mask", recording)
        for i, ex in enumerate(examples):
            seen.clear()
            (row,) = example_rows(ex, arch, recipe, torch.Generator().manual_seed(seed * 1000 + i))
            rows.append(row)
            ts.append(seen[-1])
    return rows, ts


def _megadare_loss(model, arch, rows, block_size=1) -> torch.Tensor:
    """sum(w * CE) / sum(denom) over the rows, each forwarded alone with its training mask (trainer/step.py)."""
    total = torch.zeros(())
    for r in rows:
        if r.stream_ids is not None:
            spec = MaskSpec(
                "block_diffusion", block_size, position_ids=r.position_ids[None], stream_ids=r.stream_ids[None]
            )
        else:
            spec = MaskSpec("bidirectional", position_ids=r.position_ids[None])
        logits = model(r.tokens[None], attention_mask=spec.dense(len(r), len(r)), position_ids=r.position_ids[None])[0]
        total = total + (r.weight * F.cross_entropy(logits.float(), r.labels, reduction="none")).sum()
    return total / sum(r.denom for r in rows)


def _grads(loss, model) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()), allow_unused=False)])


def _same(name: str, got: torch.Tensor, want: torch.Tensor, model=None) -> None:
    assert float(want) > 0.1, (name, float(want))  # something was scored
    worst = float((got.detach() - want.detach()).abs().max())
    if model is not None:
        worst = max(worst, float((_grads(got, model) - _grads(want, model)).abs().max()))
    report(name, worst)
    assert worst < TOL, (name, float(got), float(want))


class _Anything:
    """Stand-in for the typing-only names of modeling_sdar.py's signatures (``Unpack[KwargsForCausalLM]``, Cache)."""

    def __class_getitem__(cls, item):
        return cls


def _dense_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, **_):
    """Stand-in of flex-attention's ``create_block_mask`` (CUDA): the [B, 1, Q, KV] bool mask its mask_mod gives."""
    b = torch.arange(B).view(-1, 1, 1)
    return mask_mod(b, None, torch.arange(Q_LEN).view(1, -1, 1), torch.arange(KV_LEN).view(1, 1, -1))[:, None]


def _sdar():
    scope = {
        "F": F,
        "nn": torch.nn,
        "List": typing.List,
        "Tuple": typing.Tuple,
        "Optional": typing.Optional,
        "Union": typing.Union,
        "Cache": _Anything,
        "Unpack": _Anything,
        "KwargsForCausalLM": _Anything,
        "CausalLMOutputWithPast": types.SimpleNamespace,
        "BaseModelOutputWithPast": types.SimpleNamespace,
        "create_block_mask": _dense_create_block_mask,
    }
    top = (
        "modify_padded_position_ids_2d",
        "calculate_token_nums",
        "forward_add_noise_packed",
        "block_diff_mask",
        "block_attn_mask",
        "build_bd_inputs_and_mask",
    )
    fns = dare_functions(SDAR_MODELING, top, scope)
    methods = ("prepare_for_bd_training", "prepare_for_bd_training_from_artifacts", "forward")
    return fns, dare_methods(SDAR_MODELING, "SDARForCausalLM", methods, scope)


def _sdar_stand_in(methods, model, block_size: int):
    """``self`` of SDARForCausalLM: the backbone is megadare's whole tiny model (its logits as the hidden states,
    an identity lm_head), attending with the mask DARE built."""

    def backbone(input_ids, attention_mask, position_ids, **_):
        return types.SimpleNamespace(
            last_hidden_state=model(input_ids, attention_mask=attention_mask, position_ids=position_ids).float(),
            past_key_values=None,
            hidden_states=None,
            attentions=None,
        )

    cls = type("SDARStandIn", (), {k: getattr(methods, k) for k in vars(methods)})
    me = cls()
    me.training, me.model, me.lm_head = True, backbone, torch.nn.Identity()
    me.config = types.SimpleNamespace(block_size=block_size, output_attentions=False, output_hidden_states=False)
    return me


def test_sdar_block_diffusion_loss_is_dares():
    """SDAR's training loss (sum_k CE_k / p_mask_k / answer_len, x_t ++ x_0 under its block mask) on megadare's
    draw equals megadare's ``block`` rows under ``sft.normalize=answer_length``, ``sft.t_per=sample``, one sample a
    micro-batch as DARE's SDAR recipes run (``micro_batch_size_per_gpu=1``); loss and gradient."""
    bs = 4
    model, arch = _tiny("sdar", block_size=bs)
    fns, methods = _sdar()
    me = _sdar_stand_in(methods, model, bs)
    recipe = SFTRecipe("block", block_size=bs, schedule=NoiseSchedule(1e-3, 1.0), t_per="sample")
    examples = _examples([(5, 11), (3, 2), (8, 9)])
    rows, ts = _rows_and_t(examples, arch, recipe)
    dare = torch.zeros(())
    for ex, row, t in zip(examples, rows, ts):
        n = len(row) // 2
        x0 = row.tokens[n:][None]
        masked = (row.tokens[:n] == arch.mask_token_id)[None]
        labels = x0.clone()
        labels[:, : len(ex.prompt_ids)] = -100
        dense = fns.block_attn_mask([torch.tensor([n])], bs, "cpu")[0]
        spec = MaskSpec(
            "block_diffusion", block_size=bs, position_ids=row.position_ids[None], stream_ids=row.stream_ids[None]
        )
        assert torch.equal(dense, spec.dense(2 * n, 2 * n)[0, 0])  # the x_t ++ x_0 mask
        out = methods.forward(
            me,
            input_ids=x0,
            position_ids=torch.arange(n)[None],
            labels=labels,
            bd_noisy_input_ids=row.tokens[:n][None],
            bd_target_mask=masked,
            bd_p_mask=t[None],
            return_block_diffusion_token_loss=True,
        )
        dare = dare + out.loss / len(examples)  # training_step: each micro-batch's loss / n_micro_batches
    _same(
        "SDAR forward (block_diffusion_token_loss) vs megadare block, answer_length",
        _megadare_loss(model, arch, rows, bs),
        dare,
        model,
    )


def test_sdar_noise_draw_is_dares_in_distribution():
    """SDAR's draw (``forward_add_noise_packed``: t per sample, p = (1 - 1e-3) t + 1e-3, at least one token masked
    by drawing t again) and megadare's block rows give the same E[sum_masked 1/p] / L on a 2-token answer, where the
    at-least-one rule weighs most: 1 / P(>= 1 masked) = 1.4985. Forcing a token at the first empty draw (megadare
    before) gave ~3.7: a forced token kept its tiny t and a 1/t weight."""
    fns, _ = _sdar()
    P, L, n_draws = 3, 2, 6000
    torch.manual_seed(0)
    prompt = torch.zeros(n_draws, P + L, dtype=torch.bool)
    prompt[:, :P] = True
    _, masked, p_masks = fns.forward_add_noise_packed(
        torch.zeros(n_draws, P + L, dtype=torch.long), [torch.tensor([P + L])] * n_draws, prompt, mask_id=1
    )
    assert masked.any(dim=1).all()
    dare = float((1.0 / p_masks).sum()) / n_draws / L
    _, arch = _tiny("sdar", block_size=4)
    recipe = SFTRecipe("block", block_size=4, schedule=NoiseSchedule(1e-3, 1.0), t_per="sample")
    (ex,) = _examples([(P, L)])
    ours = sum(
        float(example_rows(ex, arch, recipe, torch.Generator().manual_seed(s))[0].weight.sum()) for s in range(n_draws)
    )
    ours = ours / n_draws  # the weights already hold 1/(t L)
    want = 1.0 / (1.0 - (1 - 1e-3) ** 2 / 3)
    report(f"SDAR noise draw E[sum 1/p]/L: DARE {dare:.4f}, megadare {ours:.4f}, exact {want:.4f}", abs(dare - ours))
    assert abs(dare - want) < 0.12 and abs(ours - want) < 0.12


def _masked_count_variance(masked: torch.Tensor) -> float:
    """Var of the masked answer tokens of a draw (rows: draws): one t per sample spreads the count far wider than
    one t per block, whose blocks are masked independently."""
    return float(masked.sum(dim=1).double().var())


@pytest.mark.parametrize("family", ["sdar", "sdar_moe"])
def test_default_sft_draws_t_per_sample_as_the_publishers(family):
    """With no sft.t_per set (the default, and what importing DARE's SFT recipes gives), megadare's block rows draw
    the masking probability as SDAR's own code (``forward_add_noise_packed``) does: one t per sample, shared by all
    its blocks (LLaDA2: test_llada2_draw_is_dares_dataset). An 8-token answer over two blocks of 4, at least one token masked: the count is
    uniform on 1..8 per sample, Var = 63/12 = 5.25; per block (megadare's default before) two uniform counts on
    0..4 summed, Var = 3.47."""
    fns, _ = _sdar()
    P, L, bs, n_draws = 4, 8, 4, 4000
    torch.manual_seed(0)
    prompt = torch.zeros(n_draws, P + L, dtype=torch.bool)
    prompt[:, :P] = True
    _, dare_masked, _ = fns.forward_add_noise_packed(
        torch.zeros(n_draws, P + L, dtype=torch.long), [torch.tensor([P + L])] * n_draws, prompt, mask_id=1
    )
    _, arch = _tiny(family, block_size=bs)
    recipe = sft_recipe(Config(), arch)
    (ex,) = _examples([(P, L)])
    rows = [example_rows(ex, arch, recipe, torch.Generator().manual_seed(s))[0] for s in range(n_draws)]
    ours = torch.stack([r.tokens[: P + L] == arch.mask_token_id for r in rows])
    dare_var, our_var = _masked_count_variance(dare_masked), _masked_count_variance(ours)
    report(
        f"{family} default t_per={recipe.t_per}: Var(masked count) DARE {dare_var:.3f}, megadare {our_var:.3f}",
        abs(dare_var - our_var),
    )
    assert abs(dare_var - our_var) < 0.7, (dare_var, our_var)


def _llada2_draws(P: int, L: int, n_draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n_draws, L] masked answer positions of DARE's LLaDA2 dataset (``_forward_process``) and of megadare's LLaDA2
    rows (block size 4) under the imported recipe (sft.noise_low=0.3 sft.noise_high=0.8 sft.weighting=none)."""
    methods = dare_methods("verl/utils/dataset/llada2_sft_dataset.py", "dLLMSFTDataset", ("_forward_process",), {})
    me = types.SimpleNamespace(eval=False, noise_range_low=0.3, noise_range_high=0.8, mask_token_id=255)
    torch.manual_seed(0)
    ids, attention = torch.zeros(P + L, dtype=torch.long), torch.ones(P + L, dtype=torch.long)
    dare = torch.stack([methods._forward_process(me, ids, attention, P, 0)[2][P:] for _ in range(n_draws)])
    _, arch = _tiny("llada2", block_size=4)
    cfg = Config()
    cfg.sft.noise_low, cfg.sft.noise_high, cfg.sft.weighting = 0.3, 0.8, "none"
    recipe = sft_recipe(cfg, arch)
    (ex,) = _examples([(P, L)])
    rows = [example_rows(ex, arch, recipe, torch.Generator().manual_seed(s))[0] for s in range(n_draws)]
    return dare, torch.stack([r.tokens[P : P + L] == arch.mask_token_id for r in rows])


def test_llada2_draw_is_dares_dataset():
    """DARE's LLaDA2 dataset draws one t ~ U(0.3, 0.8) per sample and keeps a draw that masks nothing (the sample
    scores nothing); megadare's LLaDA2 rows under the imported recipe draw the same: on a 2-token answer
    P(nothing masked) = E[(1 - t)^2] = 0.223 (SDAR's redraw rule, megadare's before for every block family, gave
    0); on 8 tokens over two blocks Var(masked count) = 8 E[t(1-t)] + 64 Var(t) = 3.15 (one t per block: 2.48)."""
    dare, ours = _llada2_draws(3, 2, 4000)
    dare_empty, our_empty = float((~dare.any(1)).double().mean()), float((~ours.any(1)).double().mean())
    want = (0.7**3 - 0.2**3) / 3 / 0.5
    report(
        f"LLaDA2 P(nothing masked): DARE {dare_empty:.3f}, megadare {our_empty:.3f}, exact {want:.3f}",
        abs(dare_empty - our_empty),
    )
    assert abs(dare_empty - want) < 0.03 and abs(our_empty - want) < 0.03, (dare_empty, our_empty, want)
    dare, ours = _llada2_draws(4, 8, 4000)
    dare_var, our_var = _masked_count_variance(dare), _masked_count_variance(ours)
    want = 8 * (0.55 - (0.8**3 - 0.3**3) / 1.5) + 64 * 0.5**2 / 12
    report(
        f"LLaDA2 Var(masked count): DARE {dare_var:.3f}, megadare {our_var:.3f}, exact {want:.3f}",
        abs(dare_var - our_var),
    )
    assert abs(dare_var - want) < 0.3 and abs(our_var - want) < 0.3, (dare_var, our_var, want)


# ------------------------------------------------------------------ the trainers' _compute_loss_and_backward
def _trainer_loss(relpath: str, model, config: dict, extra: dict | None = None, cls: str = "FSDPdLLMSFTTrainer"):
    """DARE's ``_compute_loss_and_backward`` of one trainer file (and the helper methods ``config['methods']`` names,
    bound to the stand-in ``self``), as a function of (batch) on megadare's model."""
    from contextlib import nullcontext

    scope = {"nn": torch.nn, "nullcontext": nullcontext, **(extra or {})}
    helpers = config.get("methods", ())
    method = dare_methods(relpath, cls, ("_compute_loss_and_backward",) + helpers, scope)
    vocab_size = model(torch.zeros(1, 1, dtype=torch.long)).shape[-1]

    def fsdp_model(input_ids, attention_mask, use_cache=False, **kw):
        mask = attention_mask
        if mask.dtype != torch.bool:  # LLaDA2's additive mask
            mask = mask == 0
        if mask.dim() == 2:  # a padding mask of ones: bidirectional
            mask = mask[:, None, None, :].expand(-1, 1, mask.shape[1], -1)
        with torch.autocast("cpu", enabled=False):
            return types.SimpleNamespace(
                logits=model(input_ids, attention_mask=mask, position_ids=kw.get("position_ids")).float()
            )

    data = types.SimpleNamespace(balance_dp_token=False, pad_token_id=None, get=lambda k, d=None: d)
    trainer = types.SimpleNamespace(get=lambda k, d=None: config.get(k, d))
    me = types.SimpleNamespace(
        device_name="cpu",
        use_remove_padding=False,
        fsdp_model=fsdp_model,
        model=types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=vocab_size)),
        config=types.SimpleNamespace(ulysses_sequence_parallel_size=1, data=data, trainer=trainer),
        tokenizer=types.SimpleNamespace(mask_token_id=config.get("mask_token_id"), pad_token_id=0),
        _debug_forward_calls=0,
        _debug_print=lambda *a, **k: None,
        _debug_tensor_summary=lambda *a, **k: "",
        _debug_cuda_memory=lambda *a, **k: "",
        _attention_mask_cache={},
        **config.get("self", {}),
    )
    for name in helpers:
        setattr(me, name, types.MethodType(getattr(method, name), me))
    return lambda batch: method._compute_loss_and_backward(me, dict(batch), do_backward=False)


def _llada_batch(rows, ts, arch):
    noisy = torch.stack([r.tokens for r in rows])
    masked = noisy == arch.mask_token_id
    labels = torch.stack([r.labels for r in rows]).masked_fill(~masked, -100)
    return {
        "input_ids": noisy,
        "attention_mask": torch.ones_like(noisy),
        "position_ids": torch.arange(noisy.shape[1]).expand_as(noisy),
        "loss_mask": masked,
        "t": torch.stack([t[0] for t in ts]),
        "labels": labels,
    }


def _split(batch: dict, size: int) -> list[dict]:
    n = batch["input_ids"].shape[0]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, n, size)]


@pytest.mark.parametrize("normalize,micro", [("masked_tokens", 3), ("masked_tokens_per_sample", 1)])
def test_llada_random_masking_loss_is_dares(normalize, micro):
    """LLaDA's SFT loss (sum CE / t over masked tokens / masked tokens of the micro-batch, micro-batches averaged)
    equals megadare's ``random`` rows: ``masked_tokens`` with one micro-batch a step, ``masked_tokens_per_sample``
    at ``micro_batch_size_per_gpu=1``. Same-length samples (DARE pads every response with EOS to max_length)."""
    model, arch = _tiny("llada")
    dare = _trainer_loss("verl/trainer/llada_fsdp_sft_trainer.py", model, {})
    recipe = SFTRecipe("random", normalize=normalize)
    examples = _examples([(4, 12), (7, 9), (2, 14)], seed=1)
    rows, ts = _rows_and_t(examples, arch, recipe)
    batches = _split(_llada_batch(rows, ts, arch), micro)
    want = sum(dare(b) for b in batches) / len(batches)
    _same(
        f"LLaDA trainer vs megadare random, {normalize}, micro-batch {micro}",
        _megadare_loss(model, arch, rows),
        want,
        model,
    )


@pytest.mark.parametrize("normalize,micro", [("masked_tokens", 2), ("masked_tokens_per_sample", 1)])
def test_dream_shifted_loss_is_dares(normalize, micro):
    """Dream's SFT loss (logits shifted right by one: position k-1 scores token k; / t; / masked tokens) on
    megadare's mask and t (DARE's own ``q_sample`` given them) equals megadare's shifted ``random`` rows."""
    model, arch = _tiny("dream")
    rel = "verl/trainer/dream_fsdp_sft_trainer.py"
    q_sample = dare_functions(rel, ("q_sample",)).q_sample
    given: dict = {}

    def q_sample_given(*args, **kwargs):  # DARE's q_sample, with the t and mask of megadare's draw
        return q_sample(*args, t=given["t"], t_mask=given["mask"], **kwargs)

    dare = _trainer_loss(rel, model, {"mask_token_id": arch.mask_token_id}, {"q_sample": q_sample_given})
    recipe = SFTRecipe("random", normalize=normalize)
    examples = _examples([(4, 10), (6, 8)], seed=2)
    rows, ts = _rows_and_t(examples, arch, recipe)
    x0 = torch.stack([torch.tensor(ex.prompt_ids + ex.response_ids) for ex in examples])
    masked = torch.stack([r.tokens for r in rows]) == arch.mask_token_id
    loss_mask = torch.ones_like(x0)
    for i, ex in enumerate(examples):
        loss_mask[i, : len(ex.prompt_ids)] = 0
    batch = {
        "input_ids": x0,
        "attention_mask": torch.ones_like(x0),
        "position_ids": torch.arange(x0.shape[1]).expand_as(x0),
        "loss_mask": loss_mask,
        "mask": masked,
        "t": torch.stack([t[0] for t in ts]),
    }
    want = torch.zeros(())
    for b in _split(batch, micro):
        given.update(t=b.pop("t"), mask=b.pop("mask"))
        want = want + dare(b) / (x0.shape[0] // micro)
    _same(
        f"Dream trainer vs megadare random (shifted), {normalize}, micro-batch {micro}",
        _megadare_loss(model, arch, rows),
        want,
        model,
    )


def test_llada2_block_loss_is_dares():
    """LLaDA2's SFT loss (x_t ++ x_0 under its block-diffusion mask, logits of x_t, no 1/t weight, / masked tokens;
    t ~ U(0.3, 0.8) per sample) equals megadare's ``block`` rows with ``sft.weighting=none``, ``sft.t_per=sample``,
    ``sft.normalize=masked_tokens_per_sample`` at DARE's ``micro_batch_size_per_gpu=1`` (its recipe's)."""
    bs = 4
    model, arch = _tiny("llada2", block_size=bs)
    dare = _trainer_loss(
        "verl/trainer/llada2_fsdp_sft_trainer.py",
        model,
        {"block_size": bs, "methods": ("_build_llada2_block_diffusion_attention_mask",)},
        cls="FSDPLLada2SFTTrainer",
    )
    recipe = SFTRecipe(
        "block",
        block_size=bs,
        schedule=NoiseSchedule(0.3, 0.8, "none"),
        normalize="masked_tokens_per_sample",
        t_per="sample",
    )
    examples = _examples([(5, 11), (3, 6)], seed=3)
    rows, ts = _rows_and_t(examples, arch, recipe)
    want = torch.zeros(())
    for ex, row in zip(examples, rows):
        n = len(row) // 2
        noisy, clean = row.tokens[:n][None], row.tokens[n:][None]
        masked = noisy == arch.mask_token_id
        batch = {
            "input_ids": noisy,
            "noisy_input_ids": noisy,
            "clean_input_ids": clean,
            "attention_mask": torch.ones_like(noisy),
            "position_ids": torch.arange(n)[None],
            "loss_mask": masked,
            "labels": clean.masked_fill(~masked, -100),
        }
        want = want + dare(batch) / len(examples)
    _same(
        "LLaDA2 trainer vs megadare block, weighting none, masked_tokens_per_sample",
        _megadare_loss(model, arch, rows, bs),
        want,
        model,
    )


# ------------------------------------------------------------------ the datasets' padding (sft.pad_response)
class _CharTokenizer:
    """Stand-in of a HF tokenizer for DARE's ``__getitem__``: one id per character (megadare's ByteTokenizer ids:
    eos 253, pad 254), no chat template."""

    eos_token, eos_token_id, pad_token_id = "\x00", 253, 254

    def encode(self, text: str) -> list[int]:
        return [self.eos_token_id if c == self.eos_token else ord(c) % 200 for c in text]

    def apply_chat_template(self, chat, add_generation_prompt=True, tokenize=False):
        return chat[0]["content"]

    def __call__(self, text, return_tensors="pt", add_special_tokens=False):
        ids = torch.tensor([self.encode(text)])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("family,pad", [("sdar", "pad"), ("llada", "eos"), ("dream", "pad"), ("llada2", "none")])
def test_dare_sft_datasets_pad_as_sft_pad_response(family, pad):
    """DARE's SFT datasets (``__getitem__`` as written) pad every sample to data.max_length and score the pads as
    answer tokens (SDAR, LLaDA, Dream; LLaDA2 never masks them): megadare's ``sft.pad_response`` gives the same
    tokens, the same answer positions and (SDAR) the same answer length. One difference stays: SDAR's pads all take
    the last answer token's position id (verl's ``compute_position_id_with_mask`` over an attention mask of 0
    there), megadare numbers them on."""
    from megadare.data.sft_data import SFTExample, pad_responses

    tok, max_len = _CharTokenizer(), 24
    utils = dare_functions("verl/utils/model.py", ("compute_position_id_with_mask",))
    rel = f"verl/utils/dataset/{family}_sft_dataset.py"
    names = ("__getitem__",) + (("_forward_process",) if family in ("llada", "llada2") else ())
    methods = dare_methods(
        rel, "dLLMSFTDataset", names, {"compute_position_id_with_mask": utils.compute_position_id_with_mask}
    )
    me = types.SimpleNamespace(
        tokenizer=tok, max_length=max_len, truncation="error", eval=False, mask_token_id=255, prompts=[], responses=[]
    )
    me.noise_range_low, me.noise_range_high = 0.3, 0.8  # LLaDA2's dataset defaults
    if family in ("llada", "llada2"):
        me._forward_process = types.MethodType(methods._forward_process, me)
    for prompt, response in [("what is 2+3?", "5"), ("reverse abc", "cba, done")]:
        me.prompts, me.responses = [prompt], [response]
        item = methods.__getitem__(me, 0)
        ex = SFTExample(tok.encode(prompt), tok.encode(response) + [tok.eos_token_id])
        (padded,) = pad_responses([ex], pad, tok, max_len)
        ours = torch.tensor(padded.prompt_ids + padded.response_ids)
        P = len(padded.prompt_ids)
        if family == "sdar":
            assert torch.equal(item["input_ids"], ours)
            assert torch.equal(item["labels"] != -100, torch.arange(max_len) >= P)  # the answer: every position >= P
            assert int((item["labels"] != -100).sum()) == len(padded.response_ids)  # SDAR's answer_len
            last = len(ex) - 1
            assert item["position_ids"][len(ex) :].tolist() == [last] * (max_len - len(ex))  # the difference kept
        elif family == "dream":  # q_sample masks in the trainer: every loss_mask position may be masked and scored
            assert torch.equal(item["input_ids"], ours)
            assert torch.equal(item["loss_mask"].bool(), torch.arange(max_len) >= P)
        elif family == "llada2":  # pads carry attention 0: never masked, never scored, as megadare's unpadded rows
            assert torch.equal(item["clean_input_ids"][: len(ours)], ours)
            assert not item["loss_mask"][len(ours) :].any() and not item["loss_mask"][:P].any()
        else:
            masked = item["loss_mask"]
            assert torch.equal(torch.where(masked, item["labels"], item["input_ids"]), ours)
            assert not masked[:P].any()  # any position >= P, pads included, may be masked:
            pads = torch.arange(max_len) >= len(ex)
            assert any(bool((methods.__getitem__(me, 0)["loss_mask"] & pads).any()) for _ in range(20))
    report(f"{family} SFT dataset padding vs sft.pad_response={pad}")
