"""Token-editing traces (LLaDA2.1, ``rollout.algorithm=editing``): the Trajectory contract with superseded commits,
their replay by TraceRL / CJ-GRPO, partial rollouts, and the SGLang plugin path.

(a) ``Trajectory.validate`` accepts an edited trace and refuses each way of breaking it;
(b) replay of a hand-written edited trace: every round's input state, targets and slots, against the rule
    written out by hand (the state holds each position's latest commit before the step; every commit is scored
    once, as its own slot; CJ-GRPO's per-step weights count edits); shrinkage over an edit is refused;
(c) on a tiny LLaDA2 decoding with edits at temperature 1: the log-prob of every commit read from TraceRL's and
    CJ-GRPO's packed training rows (x_t ++ x_0, block-diffusion mask) equals the sampler log-prob the engine
    recorded, superseded commits included, and the engine behaviour table (``rl.behaviour_logp=engine``) is
    indexed the same way; the same rollouts train through the real Megatron update;
(d) partial rollouts stitch superseded commits onto the whole response;
(e) the SGLang plugin (through tests/sglang_fake.py's sglang boundary, synchronous and FDFO loops) reproduces the
    built-in engine with token editing and with Dream's confidence rules: tokens, steps, log-probs, edits.
"""

from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from megadare.algos import REGISTRY
from megadare.algos.base import RLSample, gather_slots
from megadare.diffusion.trace_replay import replay_views
from megadare.data.rows import pack_rows
from megadare.rollout import sglang_engine as se
from megadare.rollout import sglang_plugin as sp
from megadare.rollout.engine import SamplingParams, Superseded, Trajectory
from megadare.rollout.native import NativeEngine, NativeSettings
from megadare.trainer.offpolicy.queue import PartialRollout
from megadare.trainer.offpolicy.correction import store_engine_behaviour

from block_toy import MASK, EOS, B, PROMPTS, ToyBlockLM, toy_arch, block_logits
from sglang_fake import fake_sglang  # noqa: F401  (fixture)
from test_decoders import LLADA2_SMALL, _engine

EDIT = SamplingParams(max_new_tokens=6, block_size=4, algorithm="editing", max_post_steps=3, stop_at_eos=False)


# ---------------------------------------------------------------------------------------------- (a) the contract
def _edited(**over) -> Trajectory:
    """Prompt [1, 2]; response positions 0-1 in block 0 and 2-5 in block 1 (block size 4). Position 0: 10 at
    step 0, edited to 11 at step 2; position 4: 22 at step 4, 23 at step 5, 24 at step 6."""
    kw = dict(
        prompt_ids=[1, 2],
        response_ids=[11, 12, 20, 21, 24, 25],
        commit_step=[2, 1, 3, 3, 6, 4],
        block_step=[2, 1, 0, 0, 3, 1],
        logprobs=[-0.5, -0.2, -0.3, -0.4, -0.6, -0.7],
        finish_reason="length",
        num_forwards=7,
        params=EDIT,
        superseded=[Superseded(0, 10, 0, 0, -0.1), Superseded(4, 22, 4, 1, -0.8), Superseded(4, 23, 5, 2, -0.9)],
    )
    kw.update(over)
    return Trajectory(**kw)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"params": SamplingParams(max_new_tokens=6, block_size=4)}, "only algorithm='editing' edits tokens"),
        ({"superseded": [Superseded(9, 10, 0, 0, -0.1)]}, "outside the response"),
        ({"superseded": [Superseded(4, 23, 5, 2, -0.9), Superseded(4, 22, 4, 1, -0.8)]}, "not strictly ordered"),
        ({"superseded": [Superseded(0, 10, 2, 2, -0.1)]}, "not strictly ordered"),
        ({"superseded": [Superseded(0, 11, 0, 0, -0.1)]}, "an edit changes the token"),
        ({"superseded": [Superseded(0, 10, 7, 0, -0.1)]}, "step out of range"),
        ({"superseded": [Superseded(0, 10, 0, 0, 0.5)]}, "positive log-prob"),
        ({"block_step": [2, 1, 0, 0, 7, 1]}, "outside \\[0, 7\\)"),
    ],
)
def test_trajectory_contract_with_edits(change, message):
    _edited().validate()
    with pytest.raises(ValueError, match=message):
        _edited(**change).validate()


# ---------------------------------------------------------------------------------------------- (b) replay rule
def _sample(t: Trajectory) -> RLSample:
    return RLSample(
        prompt_ids=t.prompt_ids,
        response_ids=t.response_ids,
        reward=1.0,
        advantage=1.0,
        commit_step=t.commit_step,
        block_step=t.block_step,
        superseded=t.superseded,
    )


def test_replay_of_an_edited_trace_by_hand():
    s = _sample(_edited())
    M = 99
    rounds = replay_views(s, M, 4, 1, block_family=True)
    # per round: (input at response positions, {position: (slot, target)}, global steps scored)
    want = [
        ([M, M, M, M, M, M], {0: (6, 10), 2: (2, 20), 3: (3, 21)}, [0, 3]),
        ([10, M, 20, 21, M, M], {1: (1, 12), 4: (7, 22), 5: (5, 25)}, [1, 4]),
        ([10, 12, 20, 21, 22, 25], {0: (0, 11), 4: (8, 23)}, [2, 5]),
        ([11, 12, 20, 21, 23, 25], {4: (4, 24)}, [6]),
    ]
    assert len(rounds) == len(want)
    for (view, steps), (inp, scored, st) in zip(rounds, want):
        assert view.tokens[2:].tolist() == inp and view.tokens[:2].tolist() == [1, 2]
        assert {
            k: (int(view.slot[2 + k]), int(view.labels[2 + k])) for k in range(6) if view.slot[2 + k] >= 0
        } == scored
        assert steps == st and view.coef.sum() == len(scored)
    # full attention: one round per global step, the same state rule on global steps
    full = replay_views(s, M, 4, 1, block_family=False)
    assert [st for _, st in full] == [[g] for g in range(7)]
    assert full[4][0].tokens[2:].tolist() == [11, 12, 20, 21, M, M]  # before step 4
    assert full[5][0].tokens[2:].tolist() == [11, 12, 20, 21, 22, 25]  # before step 5: k4 holds 22, edited to 23
    assert int(full[5][0].labels[2 + 4]) == 23 and int(full[5][0].slot[2 + 4]) == 8
    # CJ-GRPO: 1/K over the 7 (block, block step) keys, split among each key's commits, edits included
    weights = {}
    for row in REGISTRY["cj_grpo"]().rows(s, toy_arch(), 4, torch.Generator()):
        slot, head = row.slot, row.head
        weights.update({int(slot[i]): float(head[i]) for i in (head != 0).nonzero().flatten().tolist()})
    assert weights == pytest.approx(
        {6: 1 / 7, 0: 1 / 7, 1: 1 / 7, 8: 1 / 7, 4: 1 / 7, 2: 1 / 14, 3: 1 / 14, 7: 1 / 14, 5: 1 / 14}
    )
    with pytest.raises(ValueError, match="shrink=1"):  # position 4 is committed twice in block 1's 2nd fragment
        replay_views(s, M, 4, shrink=2)
    with pytest.raises(ValueError, match="mdpo cannot replay a trace with token edits"):
        REGISTRY["mdpo"]().rows(s, toy_arch(), 4, torch.Generator())


# ---------------------------------------------------------------------------------------------- (c) replay = engine
def test_replayed_logprobs_of_every_commit_equal_the_engine():
    eng = _engine("llada2", **LLADA2_SMALL)
    params = SamplingParams(
        max_new_tokens=6,
        block_size=4,
        algorithm="editing",
        threshold=0.9,
        editing_threshold=0.3,
        max_post_steps=2,
        temperature=1.0,
        seed=1,
        stop_at_eos=False,
    )
    prompts = [[5, 17], [11, 2, 9, 4, 8, 6]]  # prompt + response fill whole blocks
    trajs = [eng.generate([p], params)[0] for p in prompts]
    assert sum(len(t.superseded) for t in trajs) > 0
    samples = [
        RLSample(
            prompt_ids=t.prompt_ids,
            response_ids=t.response_ids,
            reward=1.0,
            advantage=1.0,
            index=i,
            commit_step=t.commit_step,
            block_step=t.block_step,
            superseded=t.superseded,
        )
        for i, t in enumerate(trajs)
    ]
    engine_lp = {i: list(t.logprobs) + [e.logprob for e in t.superseded] for i, t in enumerate(trajs)}
    for algo in (REGISTRY["tracerl"]({"shrink": 1}), REGISTRY["cj_grpo"]()):
        rows = [r for s in samples for r in algo.rows(s, eng.arch, 4, torch.Generator())]
        got: dict[tuple[int, int], float] = {}
        mbs = pack_rows(rows, seq_length=max(len(r) for r in rows) * 2, micro_batch_size=2)
        store_engine_behaviour(mbs, engine_lp)
        for mb in mbs:
            S = mb.tokens.shape[1]
            with torch.no_grad():
                logits = eng.model(
                    mb.tokens,
                    attention_mask=mb.mask("block_diffusion", 4).dense(S, S, mb.tokens.shape[0]),
                    position_ids=mb.position_ids,
                ).double()
            logits[..., eng.arch.mask_token_id] = float("-inf")
            logp = F.log_softmax(logits, -1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
            assert torch.all(torch.isfinite(gather_slots(mb, logp, on_policy=True).logp))
            sel = mb.slot >= 0
            assert torch.allclose(mb.behave[sel].double(), logp[sel], atol=1e-5)
            for smp, slot, lp in zip(mb.sample[sel].tolist(), mb.slot[sel].tolist(), logp[sel].tolist()):
                assert (smp, slot) not in got
                got[(smp, slot)] = lp
        assert sorted(got) == sorted((i, k) for i in engine_lp for k in range(len(engine_lp[i])))
        for (i, k), lp in got.items():
            assert abs(lp - engine_lp[i][k]) < 1e-5, (algo.name, i, k, lp, engine_lp[i][k])


def _megatron_worker(rank, world, hf_dir):
    from megadare.algos import build_algorithm
    from megadare.config import config_from_dict
    from megadare.trainer.checks import validate
    from megadare.models import load_hf_model
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.trainer.model_setup import resolve_model_source
    from megadare.rollout.setup import sampling_params
    from megadare.trainer.rl_rollout import build_samples
    from dist import fresh_update

    init_distributed()
    try:
        cfg = config_from_dict(
            {
                "model": {"hf_path": hf_dir},
                "data": {"max_length": 128},
                "train": {"seq_length": 512, "micro_batch_size": 2},
                "rl": {"n_samples": 4, "mini_batches": 1},
                "rollout": {
                    "algorithm": "editing",
                    "editing_threshold": 0.0,
                    "threshold": 0.9,
                    "max_post_steps": 2,
                    "max_new_tokens": 8,
                },
            }
        )
        src = resolve_model_source(cfg)
        validate(cfg, src.arch)
        engine = NativeEngine(load_hf_model(hf_dir), src.arch, eos_token_id=3)
        traj = engine.generate(
            [p for p in ([5, 6, 7], [9, 10, 11, 12, 13]) for _ in range(4)],
            replace(sampling_params(cfg, src.arch, seed=3), stop_at_eos=False),
        )
        samples, _ = build_samples(cfg, traj, [float(i % 2) for i in range(len(traj))])
        out = {"edits": sum(len(s.superseded or []) for s in samples)}
        for name in ("tracerl", "cj_grpo"):
            out[name] = fresh_update(cfg, src, build_algorithm(name), samples, 4, "block_diffusion")
        return out
    finally:
        destroy_distributed()


def test_edited_rollouts_train_through_megatron(tmp_path):
    """LLaDA2 rollouts with edits (the config's decoder keys) -> samples -> TraceRL / CJ-GRPO rows -> the real
    Megatron update: finite loss, weights move, and ratio == 1 at the first update (old log-probs from a separate
    pass over the same rows: replayed states, targets and slots line up)."""
    from megadare.parallel.launch import spawn
    from tiny import write_tiny_hf

    hf = write_tiny_hf(tmp_path, "llada2", seed=1, **LLADA2_SMALL)
    res = spawn(_megatron_worker, 1, hf, timeout_s=600)[0]
    assert res["edits"] > 0
    for name in ("tracerl", "cj_grpo"):
        m = res[name]
        assert m["grad_norm"] > 0 and m["moved"] > 0 and m["ratio_dev"] == pytest.approx(0.0, abs=1e-5), (name, m)


# ---------------------------------------------------------------------------------------------- (d) partial rollout
def test_partial_rollout_stitches_edits():
    eng = NativeEngine(
        ToyBlockLM(), toy_arch(), eos_token_id=EOS, device="cpu", settings=NativeSettings(use_cache=False)
    )
    params = SamplingParams(
        max_new_tokens=10,
        block_size=B,
        algorithm="editing",
        threshold=0.6,
        editing_threshold=0.3,
        max_post_steps=3,
        stop_at_eos=False,
    )
    segments: list[list[Trajectory]] = []

    def submit(prompts, p):
        out = eng.generate(prompts, p)
        segments.append(out)
        return types.SimpleNamespace(result=lambda: out)

    stitched = PartialRollout(submit, PROMPTS, params, blocks=1, global_grid=True).result()
    for i, t in enumerate(stitched):
        t.validate()
        parts = [
            seg[[j for j, x in enumerate(seg) if x.prompt_ids[: len(PROMPTS[i])] == PROMPTS[i]][0]]
            for seg in segments
            if any(x.prompt_ids[: len(PROMPTS[i])] == PROMPTS[i] for x in seg)
        ]
        assert len(t.superseded) == sum(len(x.superseded) for x in parts)
        for e in t.superseded:  # an overwritten commit's step precedes its position's final commit
            assert e.commit_step < t.commit_step[e.position]
    assert sum(len(t.superseded) for t in stitched) > 0


# ---------------------------------------------------------------------------------------------- (e) SGLang plugin
def _sglang_generate(model: ToyBlockLM, prompt: list[int], params: SamplingParams, fdfo: bool) -> Trajectory:
    """One request through the registered plugin and the fake sglang worker, block by block the way sglang's
    scheduler serves it; the request's parameters as SGLangEngine sends them."""
    algos = sys.modules["sglang.srt.dllm.algorithm"]
    config = types.SimpleNamespace(
        algorithm=sp.ALGORITHM_NAME,
        block_size=B,
        mask_id=MASK,
        first_done_first_out_mode=fdfo,
        algorithm_config={"block_size": B},
    )
    algo = algos.get_algorithm(config)
    sent = se.SGLangEngine.sampling_params(types.SimpleNamespace(eos=EOS), params, 0)
    req = types.SimpleNamespace(
        rid="r0",
        output_ids=[],
        customized_info=None,
        dllm_algo_state=None,
        sampling_params=types.SimpleNamespace(
            temperature=sent["temperature"],
            top_p=sent["top_p"],
            top_k=sent["top_k"],
            sampling_seed=sent["sampling_seed"],
            custom_params=sent["custom_params"],
        ),
    )
    pre = len(prompt) // B * B
    grid, head = list(prompt[:pre]), list(prompt[pre:])

    class Runner:
        def forward(self, fb):
            return types.SimpleNamespace(full_logits=block_logits(model, grid, fb.input_ids.view(1, B))[0])

    worker = sys.modules["sglang.srt.managers.tp_worker"].TpModelWorker(algo, Runner())
    while len(req.output_ids) < params.max_new_tokens:
        fb = types.SimpleNamespace(
            batch_size=1, input_ids=torch.tensor(head + [MASK] * (B - len(head))), dllm_prompt_mask=None
        )
        for _ in range(64):
            _, ids, accept, states, _ = worker._forward_batch_generation_dllm(fb, types.SimpleNamespace(reqs=[req]))
            if not fdfo:
                emitted = ids[0].tolist()
                break
            req.dllm_algo_state = states[0]
            if accept[0]:
                emitted = ids[0][len(head) :]
                break
        req.output_ids.extend(emitted)
        grid += fb.input_ids.tolist()
        head = []
        if params.stop_at_eos and EOS in emitted:
            break
    out, finish = list(req.output_ids), {"type": "length"}
    if params.stop_at_eos and EOS in out:
        out, finish = out[: out.index(EOS) + 1], {"type": "stop", "matched": EOS}
    trace = req.customized_info[sp.TRACE_KEY][: len(out)]
    return se.trajectory_from_output(
        prompt, {"output_ids": out, "meta_info": {"finish_reason": finish, sp.TRACE_KEY: trace}}, params, EOS, 0
    )


PLUGIN_PARAMS = [
    SamplingParams(
        max_new_tokens=10,
        block_size=B,
        algorithm="editing",
        threshold=0.6,
        editing_threshold=0.3,
        max_post_steps=3,
        stop_at_eos=False,
    ),
    SamplingParams(
        max_new_tokens=12,
        block_size=B,
        algorithm="editing",
        threshold=0.8,
        editing_threshold=0.2,
        max_post_steps=2,
        temperature=1.0,
        seed=5,
    ),
    SamplingParams(
        max_new_tokens=10,
        block_size=B,
        steps_per_block=3,
        schedule="linspace_first",
        confidence="entropy",
        temperature=0.9,
        seed=3,
        stop_at_eos=False,
    ),
    SamplingParams(
        max_new_tokens=10,
        block_size=B,
        steps_per_block=3,
        schedule="linspace",
        confidence="topk_margin",
        alg_temp=0.5,
        temperature=1.1,
        seed=7,
        stop_at_eos=False,
    ),
]


@pytest.mark.parametrize("fdfo", [False, True], ids=["sync", "fdfo"])
@pytest.mark.parametrize("params", PLUGIN_PARAMS, ids=["edit-greedy", "edit-sampled-eos", "dare-block", "alg-temp"])
def test_sglang_plugin_reproduces_the_native_decoders(fake_sglang, params, fdfo):  # noqa: F811
    sp.register()
    sys.modules["sglang.srt.plugins.hook_registry"].HookRegistry.apply_hooks()
    model = ToyBlockLM()
    native = NativeEngine(model, toy_arch(), eos_token_id=EOS, device="cpu", settings=NativeSettings(use_cache=False))
    edits = 0
    for prompt in PROMPTS[1:3]:  # a prompt inside the first block and one past it
        nat = native.generate([prompt], params)[0]
        t = _sglang_generate(model, prompt, params, fdfo)
        assert t.response_ids == nat.response_ids and t.finish_reason == nat.finish_reason
        assert t.commit_step == nat.commit_step and t.block_step == nat.block_step
        assert t.logprobs == pytest.approx(nat.logprobs, abs=1e-6) and t.num_forwards == nat.num_forwards
        assert [e[:4] for e in t.superseded or []] == [e[:4] for e in nat.superseded or []]
        assert [e.logprob for e in t.superseded or []] == pytest.approx([e.logprob for e in nat.superseded or []])
        edits += len(nat.superseded or [])
    assert (edits > 0) == (params.algorithm == "editing")


@pytest.mark.parametrize(
    "algo,params,arch_name,refused",
    [
        ("mdpo", {}, "llada2", "mdpo rebuilds decoding states"),
        ("d_treerpo", {}, "llada2", "d_treerpo rebuilds decoding states"),
        ("tracerl", {"shrink": 2}, "llada2", "tracerl shrink=2"),
        ("tracerl", {}, "llada", "tracerl shrink=8"),  # the full-attention default shrink
        ("tracerl", {}, "llada2", None),  # block families default to shrink 1
        ("tracerl", {"shrink": 1}, "llada", None),
        ("cj_grpo", {}, "llada2", None),
    ],
)
def test_config_refuses_an_edited_trace_the_algorithm_cannot_replay(algo, params, arch_name, refused):
    """rollout.algorithm=editing: each algorithm's own check_config refuses, before any process starts, what its
    trace replay cannot score (MDPO and d-TreeRPO rebuild states from the final tokens; TraceRL fragments of
    several steps would score two commits of one position from one state)."""
    from megadare.config import config_from_dict
    from megadare.trainer.checks import validate
    from megadare.errors import ConfigError
    from megadare.models import get_family

    fam = get_family(arch_name)
    cfg = config_from_dict(
        {
            "algo": {"name": algo, "params": params},
            "rl": {"n_samples": 4},
            "rollout": {"algorithm": "editing", "block_size": 4},
        }
    )
    if refused is None:
        validate(cfg, fam.arch(fam.tiny_config()))
        return
    with pytest.raises(ConfigError, match=f"rollout.algorithm=editing.*{refused}"):
        validate(cfg, fam.arch(fam.tiny_config()))
