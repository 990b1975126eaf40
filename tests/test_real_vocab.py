"""A tiny SDAR whose embedding covers the real vocabulary (151,936 rows; hidden 32, 2 layers), in a checkpoint
directory laid out as SDAR's are (config.json with SDAR's auto_map, safetensors, and the real tokenizer files built
offline from the dashscope wheel): SFT steps on DARE SFT rows, RL steps from that SFT checkpoint on DARE RL rows,
and ``megadare eval`` on a DARE test file, all through the Qwen tokenizer, with non-ASCII text in every row."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from dare_files import unicode_rl_rows, unicode_sft_rows, write_parquet
from qwen_files import qwen_dir
from ray_fixture import ray_cluster  # noqa: F401  (module-scoped local Ray cluster)
from tiny import write_tiny_hf

from megadare.config import load_config
from megadare.parallel.launch import spawn

pytestmark = [pytest.mark.timeout(600)]

VOCAB = 151936  # SDAR-1.7B/4B/8B and Qwen3's embedding rows (the tokenizer has 151,670 ids)
MASK = 151669


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory) -> str:
    d = write_tiny_hf(
        tmp_path_factory.mktemp("ckpt"),
        "sdar",
        3,
        vocab_size=VOCAB,
        mask_token_id=MASK,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        bos_token_id=151643,
        eos_token_id=151643,
        tie_word_embeddings=False,
        model_type="sdar",
        auto_map={
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
    )
    for name in os.listdir(qwen_dir("sdar")):
        shutil.copy(os.path.join(qwen_dir("sdar"), name), d)
    return d


def cjk_share(response: str, record: dict) -> float:
    """A dense reward that a random policy over Qwen's vocabulary earns unevenly (its CJK ids are many): non-zero
    advantages, so the RL steps move the weights."""
    return sum("\u4e00" <= c <= "\u9fff" for c in response) / max(len(response), 1)


def _sft_cfg(tmp, model: str, data: str):
    return load_config(
        None,
        [
            f"model.hf_path={model}",
            "model.attention_backend=sdpa",
            f"data.path={data}",
            "data.max_length=128",
            "train.steps=2",
            "train.global_batch_size=4",
            "train.micro_batch_size=1",
            "train.seq_length=256",
            "train.lr=1e-3",
            "sft.weighting=none",
            "sft.normalize=masked_tokens",
            f"logging.run_dir={tmp}",
            "logging.tensorboard=false",
            "seed=3",
        ],
    )


def test_sft_then_rl_steps_with_the_real_vocabulary(tmp_path, sdar_dir, ray_cluster):
    from megadare.trainer.rl import rl_worker
    from megadare.trainer.sft_loop import sft_worker

    sft_data = write_parquet(tmp_path / "sft" / "gsm8k_train.parquet", unicode_sft_rows())
    sft = spawn(sft_worker, 1, _sft_cfg(tmp_path / "sft_run", sdar_dir, sft_data), None, timeout_s=500)[0]
    losses = [h["loss"] for h in sft["history"]]
    print("sft losses", losses)
    # a near-uniform random model over 151,936 ids: the mean cross-entropy of the masked tokens is about ln V
    assert len(losses) == 2 and abs(losses[0] - math.log(VOCAB)) < 0.5, losses

    rl_data = write_parquet(tmp_path / "rl" / "gsm8k.parquet", unicode_rl_rows())
    cfg = load_config(
        None,
        [
            f"model.hf_path={sdar_dir}",
            "model.attention_backend=sdpa",
            f"checkpoint.load={sft['checkpoint_root']}",
            f"data.path={rl_data}",
            f"data.eval_path={rl_data}",
            "data.max_length=96",
            "rl.steps=2",
            "rl.prompts_per_step=2",
            "rl.n_samples=2",
            "rl.eval_size=2",
            "rl.eval_interval=0",
            "rl.reward=test_real_vocab:cjk_share",
            "algo.params={shrink: 4}",  # a row per block
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "train.seq_length=192",
            "rollout.max_new_tokens=8",
            "rollout.num_engines=1",
            f"logging.run_dir={tmp_path / 'rl_run'}",
            "logging.tensorboard=false",
            "seed=3",
        ],
    )
    rl = spawn(rl_worker, 1, cfg, None, timeout_s=500)[0]
    print("rl history", rl["history"])
    assert len(rl["history"]) == 2 and rl["step"] == 2
    assert all(h["response_length"] > 0 and h["reward_errors"] == 0 for h in rl["history"])
    assert max(h["grad_norm"] for h in rl["history"]) > 0  # the policy over the real vocabulary was trained


def test_eval_on_a_dare_test_file(tmp_path, sdar_dir, ray_cluster):
    from megadare.cli import main

    data = write_parquet(tmp_path / "gsm8k_1.parquet", unicode_rl_rows())
    out = tmp_path / "out"
    rc = main(
        [
            "eval",
            "--model",
            sdar_dir,
            "--tasks",
            "gsm8k",
            "eval.paths={gsm8k: " + data + "}",
            "eval.limit=2",
            "eval.n_samples=1",
            "rollout.max_new_tokens=8",
            "rollout.num_engines=1",
            f"eval.output_dir={out}",
            f"logging.run_dir={tmp_path}",
            "model.attention_backend=sdpa",
        ]
    )
    assert rc == 0
    rows = [json.loads(x) for x in (out / "samples_gsm8k.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["gold"]) for r in rows] == [
        (r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in unicode_rl_rows()[:2]
    ]
    assert all(r["length"] == 8 and r["response"] and r["finish_reason"] == "length" for r in rows)
    summary = json.loads((out / "summary.json").read_text())["tasks"]["gsm8k"]
    assert summary["problems"] == 2 and summary["reward_errors"] == 0
