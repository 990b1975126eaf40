"""Offline VRPO / DPO (``megadare dpo``): the loss on the exact toy against an independent computation, the
preference loader (DARE's ultrafeedback layout and strings), the config check, and a tiny run through the real
Megatron path whose chosen-vs-rejected margin grows (exactly 0 at the first step: policy == reference on the
same stored masks), then exported to HF safetensors like an SFT checkpoint."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from megadare.algos.base import RLSample
from megadare.algos.vrpo import VRPO
from megadare.data.preference_data import build_preference_examples
from megadare.data.rows import pack_rows
from megadare.data.sft_data import DataError
from megadare.data.tokenizer import ByteTokenizer

from algo_toy import one_thread  # noqa: F401  (autouse fixture)
from algo_toy import MASK, Toy, mb_logps, toy_archs, view_logps

PAIRS = [([1, 2], [0, 2, 1, 1], [2, 2, 0]), ([1], [2, 0, 1], [0, 0, 1, 2]), ([0, 2], [1], [2, 1])]


def _elbo(toy, c, y, views) -> torch.Tensor:
    """B(y) = (1/n) sum_j (L / m_j) sum_{k masked in j} log p(y_k | x_j), with m_j counted from the view's masks."""
    x0 = torch.tensor(c + y)
    lp = view_logps(toy, x0, [v.tokens for v in views])
    terms = []
    for j, v in enumerate(views):
        masked = v.tokens == MASK
        terms.append(len(y) / int(masked.sum()) * lp[j][masked].sum())
    return torch.stack(terms).mean()


@pytest.mark.parametrize("norm", ["none", "canvas"])
def test_vrpo_pair_loss_equals_independent_computation(norm):
    full, _ = toy_archs()
    params = {"beta": 0.7, "n_mc": 3, "margin_norm": norm, "canvas_length": 8 if norm == "canvas" else None}
    algo, pol, ref = VRPO(params), Toy(0), Toy(5)
    rows, want = [], []
    for i, (c, yw, yl) in enumerate(PAIRS):
        w = RLSample(c, yw, reward=1.0, advantage=1.0, index=2 * i)
        lo = RLSample(c, yl, reward=0.0, advantage=-1.0, index=2 * i + 1)
        g = lambda k: torch.Generator().manual_seed(100 + k)  # noqa: E731
        rows.append(algo.pair_row(w, lo, full, g(2 * i), g(2 * i + 1)))
        vw, vl = algo.views(w, full, 0, g(2 * i)), algo.views(lo, full, 0, g(2 * i + 1))
        margin = 0.7 * (
            (_elbo(pol, c, yw, vw) - _elbo(ref, c, yw, vw)) - (_elbo(pol, c, yl, vl) - _elbo(ref, c, yl, vl))
        )
        want.append(-F.logsigmoid(margin / (8 if norm == "canvas" else 1)))
    objective = algo.objective(on_policy=True)
    mbs = pack_rows(rows, seq_length=max(len(r) for r in rows) + 4, micro_batch_size=2)
    D = sum(mb.denom for mb in mbs)
    total = 0.0
    for mb in mbs:
        with torch.no_grad():
            mb.ref = mb_logps(ref, mb)
        total = total + objective(mb, mb_logps(pol, mb))[0]
    assert D == len(PAIRS)
    expected = torch.stack(want).mean()  # DARE's compute_dpo_loss: mean over pairs
    assert float(total / D) == pytest.approx(float(expected), rel=1e-6)
    g_got = torch.autograd.grad(total / D, list(pol.parameters()))
    g_want = torch.autograd.grad(expected, list(pol.parameters()))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(g_got, g_want))


def test_preference_loader_dare_layout_strings_and_errors(tmp_path):
    tok = ByteTokenizer()
    dare = {
        "prompt": [{"role": "user", "content": "abc>"}],
        "chosen": [{"role": "assistant", "content": "cba"}],
        "rejected": [{"role": "assistant", "content": "abc"}],
        "data_source": "x",
        "extra_info": {"index": 0},
    }
    plain = {"prompt": "abd>", "chosen": "dba", "rejected": "abd"}
    ex, stats = build_preference_examples([dare, plain], tok, max_len=32, source="f")
    assert stats == {"records": 2, "kept": 2, "dropped": 0}
    assert ex[0].prompt_ids == tok.chat_prompt([{"role": "user", "content": "abc>"}]) == ex[0].prompt_ids
    assert ex[0].chosen_ids == tok.encode("cba") + [tok.eos_token_id] and ex[1].rejected_ids[-1] == tok.eos_token_id
    bad = [
        ({"prompt": "a", "chosen": "b"}, "missing field 'rejected'"),
        ({**dare, "chosen": [{"role": "assistant", "content": "x"}] * 2}, "exactly one assistant message"),
        ({**dare, "chosen": [{"role": "user", "content": "x"}]}, "exactly one assistant message"),
        ({**plain, "rejected": "dba"}, "identical"),
        (
            {**plain, "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "prompt must end before the assistant",
        ),
    ]
    for rec, msg in bad:
        with pytest.raises(DataError, match=msg) as e:
            build_preference_examples([plain, rec], tok, max_len=32, source="f.jsonl")
        assert "f.jsonl:2" in str(e.value)
    long = {"prompt": "abc>", "chosen": "x" * 20, "rejected": "y"}
    assert len(build_preference_examples([long], tok, 12, "truncate")[0][0].chosen_ids) == 12 - len(
        tok.chat_prompt([{"role": "user", "content": "abc>"}])
    )
    assert build_preference_examples([long], tok, 12, "drop")[1]["dropped"] == 1
    with pytest.raises(DataError, match="longer than max_len"):
        build_preference_examples([long], tok, 12, "error")


def _pref_file(path) -> str:
    from megadare.data.synthetic import reverse_task

    with open(path, "w") as f:
        for r in reverse_task(48, 3):
            f.write(
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": r["prompt"]}],
                        "chosen": [{"role": "assistant", "content": "yes"}],
                        "rejected": [{"role": "assistant", "content": "no"}],
                    }
                )
                + "\n"
            )
    return str(path)


def _over(tmp_path):
    return [
        "model.family=llada",
        "model.tiny=true",
        f"data.path={_pref_file(tmp_path / 'pref.jsonl')}",
        "data.max_length=16",
        "train.seq_length=160",
        "train.steps=8",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.lr=1e-3",
        "train.lr_decay_style=constant",
        "dpo.beta=1.0",
        f"logging.run_dir={tmp_path}/run",
        "logging.tensorboard=false",
    ]


def test_dpo_dry_run_and_row_check(tmp_path, capsys):
    from megadare.cli import main

    over = _over(tmp_path)
    assert main(["dpo", "--dry-run", *over]) == 0
    assert "margin_norm: none" in capsys.readouterr().out
    assert main(["dpo", "--dry-run", *over, "train.seq_length=100"]) == 2
    assert "train.seq_length=100" in capsys.readouterr().err
    assert main(["dpo", "--dry-run", *over, "dpo.margin_norm=canvas", "dpo.canvas_length=0"]) == 2


def test_dpo_refuses_a_lora_it_would_ignore(tmp_path, capsys):
    """The one lora section serves SFT and RL; DPO has no LoRA path, so a set lora.rank (or an old sft.lora_rank)
    is refused rather than silently unused."""
    from megadare.cli import main

    for key in ("lora.rank=4", "sft.lora_rank=4"):
        assert main(["dpo", "--dry-run", *_over(tmp_path), key]) == 2
        assert "megadare dpo trains the full model (no LoRA path)" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_dpo_run_margin_grows_and_exports(tmp_path):
    from megadare.config import load_config
    from megadare.convert.hf_megatron import megatron_to_hf
    from megadare.models import load_hf_model
    from megadare.parallel.launch import spawn
    from megadare.trainer.dpo_loop import dpo_worker

    cfg = load_config(None, _over(tmp_path))
    out = spawn(dpo_worker, 1, cfg, timeout_s=600)[0]
    h = out["history"]
    assert out["step"] == 8 and len(h) == 8
    assert h[0]["margin"] == 0.0 and h[0]["loss"] == pytest.approx(math.log(2))  # reference == policy, same masks
    margins = [m["margin"] for m in h]
    assert 0 < margins[1] < sum(margins[1:4]) / 3 < sum(margins[-3:]) / 3, margins  # grows
    assert margins[-1] > 1.0 and h[-1]["pair_accuracy"] == 1.0 and h[-1]["loss"] < 0.3
    hf = megatron_to_hf(out["checkpoint_root"], str(tmp_path / "hf"), progress=False)
    assert os.path.exists(os.path.join(hf, "config.json")) and load_hf_model(hf) is not None
