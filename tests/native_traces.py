"""Recorded outputs of the built-in engine as main had it before issue 27 (per-row CPU generators, host sampling,
a growing KV cache), for every family and every deterministic decoder, and the recorder that wrote them.

    .venv/bin/python tests/native_traces.py --record     # rewrites tests/fixtures/native_traces.json

The cases decode greedily with non-random commit rules, so their trajectories do not depend on how the engine
draws random numbers: a faster engine must reproduce them token for token and step for step (log-probs are 0 when
greedy; per-step confidences, kept for MDPO, within float rounding). The weights are the tiny random models of
tests/test_rollout_native.py; ``weights_sum`` pins them, so a change in how models are built cannot pass for an
engine change. Used by tests/test_rollout_batched.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from megadare.models import build_hf_model, get_family
from megadare.rollout.engine import SamplingParams
from megadare.rollout.native import NativeEngine, NativeSettings

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "native_traces.json")
EOS = 253
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 2], [8, 8, 8, 8, 21, 60, 61, 62, 63], [4, 5, 6, 7], [200, 9, 31, 77, 13]]
LLADA2_SMALL = dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1)


def build(family: str, seed: int = 0, **over: Any) -> tuple[torch.nn.Module, Any]:
    """The tiny model of a family, seeded and perturbed (peaked predictions: confidences differ clearly)."""
    torch.manual_seed(seed)
    fam = get_family(family)
    if fam.arch(fam.tiny_config()).attention == "block_causal":
        over.setdefault("block_size", 4)
    cfg = fam.tiny_config(**over)
    model = build_hf_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model, fam.arch(cfg)


def _p(**kw: Any) -> dict[str, Any]:
    return kw


# (case id, family, model overrides, engine options, sampling params)
CASES: list[tuple[str, str, dict, dict, dict]] = [
    ("sdar-static", "sdar", {}, {}, _p(max_new_tokens=14, block_size=4, steps_per_block=4)),
    ("sdar-static-2steps-eos", "sdar", {}, {"eos": 41}, _p(max_new_tokens=16, block_size=4, steps_per_block=2)),
    (
        "sdar-dynamic",
        "sdar",
        {},
        {},
        _p(
            max_new_tokens=12,
            block_size=4,
            steps_per_block=4,
            algorithm="low_confidence_dynamic",
            threshold=0.3,
            stop_at_eos=False,
        ),
    ),
    (
        "sdar-nocache-mdpo",
        "sdar",
        {},
        {"use_cache": False},
        _p(max_new_tokens=10, block_size=4, steps_per_block=2, record_steps=True, stop_at_eos=False),
    ),
    (
        "sdar-entropy-linspace",
        "sdar",
        {},
        {},
        _p(
            max_new_tokens=12,
            block_size=4,
            steps_per_block=3,
            schedule="linspace",
            confidence="entropy",
            stop_at_eos=False,
        ),
    ),
    (
        "llada2-dynamic",
        "llada2",
        LLADA2_SMALL,
        {},
        _p(
            max_new_tokens=8,
            block_size=4,
            steps_per_block=4,
            algorithm="low_confidence_dynamic",
            threshold=0.4,
            stop_at_eos=False,
        ),
    ),
    (
        "llada2-editing",
        "llada2",
        LLADA2_SMALL,
        {},
        _p(
            max_new_tokens=8,
            block_size=4,
            algorithm="editing",
            threshold=0.6,
            editing_threshold=0.3,
            max_post_steps=3,
            stop_at_eos=False,
        ),
    ),
    ("llada-none-eos", "llada", {}, {"eos": 225}, _p(max_new_tokens=12, block_size=4, steps_per_block=4)),
    (
        "llada-none-mdpo",
        "llada",
        {},
        {},
        _p(max_new_tokens=8, block_size=4, steps_per_block=2, record_steps=True, stop_at_eos=False),
    ),
    (
        "llada-prefix",
        "llada",
        {},
        {"full_attention_cache": "prefix"},
        _p(max_new_tokens=12, block_size=4, steps_per_block=4, stop_at_eos=False),
    ),
    (
        "llada-dual",
        "llada",
        {},
        {"full_attention_cache": "dual"},
        _p(max_new_tokens=12, block_size=4, steps_per_block=4, stop_at_eos=False),
    ),
    (
        "llada-dual-dynamic-eos",
        "llada",
        {},
        {"full_attention_cache": "dual", "eos": 37},
        _p(max_new_tokens=12, block_size=4, steps_per_block=4, algorithm="low_confidence_dynamic", threshold=0.3),
    ),
    (
        "dream-entropy",
        "dream",
        {},
        {},
        _p(
            max_new_tokens=8,
            block_size=8,
            steps_per_block=4,
            schedule="linspace",
            confidence="entropy",
            stop_at_eos=False,
        ),
    ),
    (
        "dream-margin",
        "dream",
        {},
        {},
        _p(
            max_new_tokens=8,
            block_size=8,
            steps_per_block=5,
            schedule="linspace",
            confidence="topk_margin",
            stop_at_eos=False,
        ),
    ),
    (
        "dream-maskgit-topk",
        "dream",
        {},
        {},
        _p(
            max_new_tokens=8,
            block_size=8,
            steps_per_block=4,
            schedule="linspace",
            confidence="maskgit_plus",
            top_k=5,
            stop_at_eos=False,
        ),
    ),
    (
        "dream-dare-block",
        "dream",
        {},
        {},
        _p(max_new_tokens=12, block_size=4, steps_per_block=3, schedule="linspace_first", confidence="entropy"),
    ),
    (
        "dream-prefix-static",
        "dream",
        {},
        {"full_attention_cache": "prefix"},
        _p(max_new_tokens=8, block_size=4, steps_per_block=2, stop_at_eos=False),
    ),
]


def run_case(case: tuple[str, str, dict, dict, dict], **engine_over: Any) -> list[dict[str, Any]]:
    """The case's trajectories as plain data (``engine_over``: more NativeEngine options, e.g. max_batch)."""
    _, family, model_over, engine_opts, params = case
    model, arch = build(family, **model_over)
    opts = {**engine_opts, **engine_over}
    eos = opts.pop("eos", EOS)
    eng = NativeEngine(model, arch, eos_token_id=eos, device="cpu", settings=NativeSettings(**opts))
    out = []
    for t in eng.generate(PROMPTS, SamplingParams(**params)):
        out.append(
            {
                "response_ids": t.response_ids,
                "commit_step": t.commit_step,
                "block_step": t.block_step,
                "logprobs": t.logprobs,
                "finish_reason": t.finish_reason,
                "num_forwards": t.num_forwards,
                "superseded": [list(s) for s in t.superseded] if t.superseded is not None else None,
                "step_predictions": t.step_predictions,
                "step_confidences": t.step_confidences,
            }
        )
    return out


def weights_sum(case: tuple[str, str, dict, dict, dict]) -> float:
    model, _ = build(case[1], **case[2])
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def record() -> None:
    data = {"cases": {}}
    for case in CASES:
        data["cases"][case[0]] = {"weights_sum": weights_sum(case), "trajectories": run_case(case)}
        print(case[0], [len(t["response_ids"]) for t in data["cases"][case[0]]["trajectories"]], file=sys.stderr)
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    with open(FIXTURE, "w") as f:
        json.dump(data, f, indent=None, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help="rewrite the fixture with this checkout's engine")
    if ap.parse_args().record:
        record()
