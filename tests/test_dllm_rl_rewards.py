"""megadare's advantages, accuracy band, math reward, TraDo / SDAR prompt and config keys against dLLM-RL's own code
(Gen-Verse/dLLM-RL @10b4fd1) on the same inputs: ``reward/rl_reward.py`` run as a script, its math reward
(``sample/trado_rl_rollout.py::extract_final_boxed_answer`` + ``reward/math_utils.py::is_equiv``), its rollout's
prompt and its ``configs/rl_*.yaml``. Expected values were produced by that code (tests/dllm_rl_source.py); with
``DLLM_RL_SRC`` pointing at a checkout the ``test_live_*`` tests rerun it, else they are skipped, saying so.

Findings: advantages and the band equal (population std without eps since this change); dLLM-RL's "length >=
max_gen_length - 5 is wrong" differs from ``truncated_as_wrong`` (kept: algos/advantages.py); the math reward
accepts all dLLM-RL accepts but ``\\boxed{1,00}`` for 100; the SDAR boxed prompt is dLLM-RL's plus the chat
template's final newline, which jinja2 strips from dLLM-RL's (kept: eval/tasks.py); dLLM-RL's post_num / KL /
value / length keys now name their megadare setting.
"""

from __future__ import annotations

import pytest
import torch

import dllm_rl_source as D
from megadare.algos.advantages import filter_groups, group_advantages, truncated_as_wrong
from megadare.config.foreign import DLLM_RL, foreign_fix
from megadare.data.tokenizer import HFTokenizer
from megadare.eval.tasks import _math_prompt as math_prompt
from megadare.rewards import score_batch

from qwen_files import qwen_dir
from test_dare_reward_battery import _rows as dare_battery_rows

# ------------------------------------------------------------------ advantages and the accuracy band
# (group size, correct answers): accuracies on both sides of and exactly at the band's edges 0.2 and 0.8
GROUPS = [(5, 1), (5, 4), (5, 0), (5, 5), (10, 2), (10, 8), (10, 1), (10, 9), (4, 2), (6, 3), (7, 2), (7, 1)]
MAX_GEN = 100
# rl_reward.py's training rows: (prompt, reward) in order (correctness by math_utils.is_equal of "5" / "6" to "5")
REWARD_ROWS = [
    ("p0", 1.9999999999999998),
    ("p0", -0.49999999999999994),
    ("p0", -0.49999999999999994),
    ("p0", -0.49999999999999994),
    ("p0", -0.49999999999999994),
    ("p1", 0.4999999999999999),
    ("p1", 0.4999999999999999),
    ("p1", 0.4999999999999999),
    ("p1", 0.4999999999999999),
    ("p1", -2.0),
    ("p4", 1.9999999999999998),
    ("p4", 1.9999999999999998),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", -2.0),
    ("p5", -2.0),
    ("p8", 1.0),
    ("p8", 1.0),
    ("p8", -1.0),
    ("p8", -1.0),
    ("p9", 1.0),
    ("p9", 1.0),
    ("p9", 1.0),
    ("p9", -1.0),
    ("p9", -1.0),
    ("p9", -1.0),
    ("p10", 1.5811388300841893),
    ("p10", 1.5811388300841893),
    ("p10", -0.6324555320336757),
    ("p10", -0.6324555320336757),
    ("p10", -0.6324555320336757),
    ("p10", -0.6324555320336757),
    ("p10", -0.6324555320336757),
]


def reward_groups(lengths=None) -> list[dict]:
    return [
        dict(
            extracted_output=["5"] * c + ["6"] * (G - c),
            ground_truth_answer="5",
            response_length=(lengths or {}).get(i, [40] * G),
            step_map=[[0]] * G,
        )
        for i, (G, c) in enumerate(GROUPS)
    ]


def megadare_reward_rows() -> list[tuple[str, float]]:
    """megadare's advantage pipeline (``advantage.std=population``, ``advantage.accuracy_band=[0.2, 0.8]``) on the
    same correctness, group by group (the groups differ in size)."""
    out = []
    for i, (G, c) in enumerate(GROUPS):
        r = torch.tensor([1.0] * c + [0.0] * (G - c))
        if bool(filter_groups(r, G, accuracy_band=(0.2, 0.8)).all()):
            out += [(f"p{i}", float(a)) for a in group_advantages(r, G, "grpo", "population")]
    return out


def test_advantages_and_accuracy_band_are_dllm_rls():
    """The kept groups (accuracy in [0.2, 0.8], edges included) and their z-scores = rl_reward.py's, to float32.
    Fails before: megadare divided by the population std + 1e-6 (2.5e-6 relative at accuracy 0.2)."""
    ours = megadare_reward_rows()
    assert [p for p, _ in ours] == [p for p, _ in REWARD_ROWS]
    assert [a for _, a in ours] == pytest.approx([a for _, a in REWARD_ROWS], rel=2e-7, abs=1e-7)


def test_live_advantages_and_accuracy_band_are_dllm_rls(tmp_path):
    rows = D.rl_reward(reward_groups(), tmp_path, MAX_GEN)
    assert [r["prompt"] for r in rows] == [p for p, _ in REWARD_ROWS] == [p for p, _ in megadare_reward_rows()]
    assert [r["reward"] for r in rows] == pytest.approx([a for _, a in REWARD_ROWS], rel=1e-12)


def test_live_dllm_rl_counts_near_limit_responses_wrong(tmp_path):
    """dLLM-RL counts a correct response of length >= max_gen_length - 5 wrong (rl_reward.py:100-101), finished or
    not; megadare's ``rewards.truncated_as_wrong`` only those the engine cut (finish_reason "length"): a
    difference kept on purpose (algos/advantages.py ``truncated_as_wrong``)."""
    G = GROUPS[1][0]
    rows = D.rl_reward(reward_groups({1: [MAX_GEN - 5] + [40] * (G - 1)}), tmp_path, MAX_GEN)
    base = D.rl_reward(reward_groups(), tmp_path / "base", MAX_GEN)
    assert [r["reward"] for r in rows if r["prompt"] == "p1"] != [r["reward"] for r in base if r["prompt"] == "p1"]
    assert truncated_as_wrong(torch.tensor([1.0, 1.0]), torch.tensor([False, True])).tolist() == [1.0, 0.0]


# ------------------------------------------------------------------ math reward
# indices into tests/test_dare_reward_battery.py MATH of the cases dLLM-RL's math reward accepts (its string stage:
# dllm_rl_source.math_verdicts), recorded from its code
DLLM_MATH_ACCEPTS = [
    0,
    1,
    3,
    4,
    5,
    6,
    7,
    11,
    12,
    13,
    15,
    16,
    19,
    20,
    21,
    31,
    32,
    34,
    36,
    37,
    39,
    41,
    42,
    43,
    44,
    45,
    46,
    47,
    48,
    49,
    50,
    57,
    60,
    61,
    65,
    68,
    70,
    71,
    73,
    79,
    81,
    85,
    91,
    94,
    97,
    98,
    99,
    100,
    101,
    102,
    103,
    104,
    107,
    108,
    109,
    113,
    119,
    121,
    123,
    125,
    129,
    130,
    131,
    135,
    137,
    144,
    145,
    146,
]
# accepted by dLLM-RL, not by megadare's ``auto`` (DARE's math_rm): ``\boxed{1,00}`` for 100 (dLLM-RL drops every
# comma; DARE, the reference megadare's math rewards follow, reads "1,00" as no number)
DLLM_MATH_ONLY = {44}


def test_math_reward_accepts_what_dllm_rl_accepts():
    """On the DARE battery megadare's ``auto`` rule accepts every answer dLLM-RL's reward accepts but the listed
    one; it also accepts many dLLM-RL's string stage rejects (``\\boxed{5 cm}`` for 5, ``\\boxed{\\text{5}}``,
    a trailing-box-less "The answer is 5" ...), where dLLM-RL's sympy stage may or may not (not run here)."""
    responses, records, _ = _battery()
    got, stats = score_batch("auto", responses, records, workers=2, timeout_s=120)
    assert stats.failures == 0, stats.failed
    accepted = {i for i, g in enumerate(got) if g == 1.0}
    assert set(DLLM_MATH_ACCEPTS) - accepted == DLLM_MATH_ONLY


def test_live_math_reward_battery_is_dllm_rls():
    responses, records, _ = _battery()
    verdicts = D.math_verdicts([(r, rec["answer"]) for r, rec in zip(responses, records)])
    assert [i for i, v in enumerate(verdicts) if v] == DLLM_MATH_ACCEPTS


def _battery():
    return dare_battery_rows("math")


# ------------------------------------------------------------------ TraDo / SDAR prompt
PROBLEMS = ["What is 2+3?", "Let $f(x)=\\frac{x}{2}$. Find {f(4)} — in ℝ."]
# dLLM-RL's rollout prompt (sample/trado_rl_rollout.py get_prompt) for PROBLEMS: jinja2 drops the template's
# trailing newline, so it ends with "<|im_start|>assistant", not "assistant\n" as its own string literal reads
DLLM_PROMPTS = [
    "<|im_start|>user\nWhat is 2+3?\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant",
    "<|im_start|>user\nLet $f(x)=\\frac{x}{2}$. Find {f(4)} — in ℝ.\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant",
]


def test_sdar_boxed_prompt_is_dllm_rls_plus_the_templates_newline():
    """megadare's ``boxed`` math prompt through SDAR's chat template = dLLM-RL's TraDo / SDAR prompt token for
    token, plus one final "\\n" token: the chat template's (and dLLM-RL's literal's), which jinja2 strips from
    dLLM-RL's rendering (eval/tasks.py ``MATH_BOXED_INSTRUCTION`` says why megadare keeps it)."""
    tok = HFTokenizer(qwen_dir("sdar"))
    for problem, theirs in zip(PROBLEMS, DLLM_PROMPTS, strict=True):
        ours = tok.chat_prompt([{"role": "user", "content": math_prompt(problem, "boxed")}])
        assert ours == tok.encode(theirs) + tok.encode("\n")


def test_live_sdar_prompt_is_dllm_rls():
    assert [D.trado_prompt(p) for p in PROBLEMS] == DLLM_PROMPTS
    assert [D.trado_prompt(p, "sample/sdar_rl_rollout.py") for p in PROBLEMS] == DLLM_PROMPTS


# ------------------------------------------------------------------ config keys users bring
# dLLM-RL training keys megadare has a setting for (configs/rl_*.yaml), with a value and the fix it must suggest
DLLM_RL_KEYS = {
    "training.post_num": (0, "algo.params.post_num=0"),
    "training.mask_times_per_sample": (35, "algo.params.n_views=35"),
    "training.use_kl_estimator_k3": (True, "algo.params.kl_estimator=k3_exp10"),
    "training.gam": (1.0, "algo.params.gamma=1.0"),
    "training.lam": (1.0, "algo.params.lam=1.0"),
    "optimizer.params.value_learning_rate": (5e-6, "algo.params.value_lr=5e-06"),
    "rollout.max_gen_length": (512, "rollout.max_new_tokens=512"),
}
# dLLM-RL training keys without a megadare setting of that meaning (the batch is megadare's own: rl.mini_batches,
# train.micro_batch_size, packing; the model family sets the block; tf32 is not a choice)
DLLM_RL_TRAINING_UNMAPPED = {
    "training.batch_size_lm",
    "training.block_size",
    "training.enable_tf32",
    "training.gradient_accumulation_steps",
    "training.max_gen_length",
    "training.max_prompt_len",
    "training.num_train_epochs",
}


@pytest.mark.parametrize("key", list(DLLM_RL_KEYS))
def test_dllm_rl_training_keys_name_their_megadare_setting(key):
    """Fails before: the loader called these unknown keys without saying what megadare calls them."""
    value, fix = DLLM_RL_KEYS[key]
    origin, text = foreign_fix(key, value)
    assert origin == "dLLM-RL" and text.split(" (")[0] == fix


def test_live_every_dllm_rl_training_key_is_mapped_or_listed():
    keys = {k for k in D.config_keys() if k.startswith("training.")}
    assert keys - set(DLLM_RL) == DLLM_RL_TRAINING_UNMAPPED and set(DLLM_RL_KEYS) & D.config_keys() == set(DLLM_RL_KEYS)
