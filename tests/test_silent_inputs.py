"""Inputs real users bring that used to turn an error into a result (red team of data, rewards and RL groups):
a reward that returns text, a gold answer that is NaN / null / a list, a JSONL file that starts with a byte order
mark, and RL steps whose every group has equal rewards (zero advantage, reported)."""

from __future__ import annotations

import json
import math

import pytest

from megadare.config import config_from_dict
from megadare.data import load_rows
from megadare.data.files import DataError
from megadare.data.prompt_data import PromptRules, build_prompts
from megadare.data.tokenizer import ByteTokenizer
from megadare.eval.tasks import task_spec
from megadare.rewards import score_batch
from megadare.rewards.registry import BUILTIN_REWARDS
from megadare.rollout.engine import SamplingParams, Trajectory
from megadare.trainer.rl_rollout import Rollouts, build_samples


def test_a_reward_returning_text_is_a_failure_not_a_score():
    """float("1.0") would make the string a reward of 1.0 (and "1" for a wrong answer too): refused, counted."""
    scores, stats = score_batch(lambda r, rec: "1.0", ["a", "b"], [{}, {}], workers=1)
    assert scores == [0.0, 0.0] and stats.errors == 2
    assert "reward returned a str ('1.0'), not a number" in stats.first_error
    ok, ok_stats = score_batch(lambda r, rec: r == "a", ["a", "b"], [{}, {}], workers=1)  # a bool is a 0/1 verdict
    assert ok == [1.0, 0.0] and ok_stats.errors == 0


@pytest.mark.parametrize("reward", ["math", "gsm8k", "dllm_rl_math", "exact_match"])
@pytest.mark.parametrize("gold", [None, float("nan"), "", "  ", ["5"], {"value": 5}])
def test_a_missing_or_container_gold_is_a_reward_error_not_a_zero(reward, gold):
    """str(None) / str(nan) / str(['5']) was compared as the gold: every response scored 0 (or, for ['5'], 1 by
    luck of the parser) with no error."""
    response = "The answer is \\boxed{5}."
    scores, stats = score_batch(BUILTIN_REWARDS[reward], [response], [{"answer": gold}], workers=1)
    assert stats.errors == 1 and scores == [0.0]
    assert "gold answer 'answer' is" in stats.first_error


def test_numeric_golds_still_score():
    scores, stats = score_batch(
        BUILTIN_REWARDS["exact_match"], ["5", "2.5"], [{"answer": 5}, {"answer": 2.5}], workers=1
    )
    assert scores == [1.0, 1.0] and stats.errors == 0


def test_a_nan_gold_in_rl_data_is_named_or_skipped(tmp_path):
    """A numeric answer column with a missing value (pandas writes NaN; Python's json reads NaN) passed the
    null / empty check and became the gold 'nan'."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2=", "answer": NaN}\n')
    rows = load_rows(str(path))
    tok = ByteTokenizer()
    with pytest.raises(DataError, match=r"p\.jsonl:2: field 'answer' \(the reference answer\) is NaN; drop the row"):
        build_prompts([r for _, r in rows], tok, [w for w, _ in rows], PromptRules())
    skipped: list = []
    kept = build_prompts([r for _, r in rows], tok, [w for w, _ in rows], PromptRules(), skipped=skipped)
    assert [p.where for p in kept] == [f"{path}:1"] and skipped == [f"{path}:2"]


def test_a_nan_answer_in_an_eval_file_is_named():
    """AIME answers are numbers; a missing one (NaN) became the gold 'nan' and every sample scored wrong."""
    spec = task_spec("aime24")
    assert spec.record({"problem": "p", "answer": 7.0}, "aime.parquet:row 1", "boxed")["answer"] == "7.0"
    with pytest.raises(DataError, match=r"aime\.parquet:row 2: field 'answer' .* is NaN"):
        spec.record({"problem": "p", "answer": math.nan}, "aime.parquet:row 2", "boxed")


def test_a_jsonl_file_with_a_byte_order_mark_loads(tmp_path):
    """Windows tools write UTF-8 with a BOM; the first line was refused as invalid JSON."""
    path = tmp_path / "bom.jsonl"
    body = "\r\n".join(json.dumps({"prompt": p, "answer": a}) for p, a in [("1+1=", "2"), ("café", "x")])
    path.write_bytes(b"\xef\xbb\xbf" + body.encode() + b"\r\n\r\n")
    rows = load_rows(str(path))
    assert [r for _, r in rows] == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "café", "answer": "x"}]
    mid = tmp_path / "mid.jsonl"  # a BOM anywhere else is still an error, named by line
    mid.write_bytes(body.encode() + b"\n\xef\xbb\xbf{}\n")
    with pytest.raises(DataError, match=r"mid\.jsonl:3: invalid JSON"):
        load_rows(str(mid))


def _traj() -> Trajectory:
    return Trajectory([1, 2], [3, 4], [0, 1], [0, 1], [0.0, 0.0], "eos", 2, SamplingParams(max_new_tokens=2))


def test_all_equal_groups_are_counted_and_an_all_flat_step_is_reported(capsys):
    """A group whose rewards are all equal has zero advantage; nothing said how many there were, nor that a step
    (a binary reward on a task too hard for the policy) could learn nothing."""
    cfg = config_from_dict({"rl": {"n_samples": 2}})
    samples, metrics = build_samples(cfg, [_traj() for _ in range(6)], [1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert metrics["all_equal_groups"] == pytest.approx(2 / 3)
    assert [s.advantage for s in samples][:2] == [0.0, 0.0]
    _, flat = build_samples(cfg, [_traj() for _ in range(4)], [0.0] * 4)
    assert flat["all_equal_groups"] == 1.0
    roll = Rollouts.__new__(Rollouts)
    roll.spec, roll.flat_steps = type("S", (), {"cfg": cfg})(), 0
    roll._warn_if_flat(0, metrics)
    assert capsys.readouterr().err == ""
    roll._warn_if_flat(4, flat)
    roll._warn_if_flat(5, flat)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RL step 5: every group's 2 rewards are equal" in err[0]
    assert roll.flat_steps == 2


def test_a_step_whose_every_group_the_band_drops_is_reported(capsys):
    """advantage.accuracy_band dropping every group left a step with no sample and no word."""
    cfg = config_from_dict({"rl": {"n_samples": 2}, "advantage": {"accuracy_band": [0.2, 0.4]}})
    samples, metrics = build_samples(cfg, [_traj() for _ in range(4)], [1.0, 0.0, 0.0, 1.0])
    assert samples == [] and metrics["kept_fraction"] == 0.0 and metrics["all_equal_groups"] == 0.0
    roll = Rollouts.__new__(Rollouts)
    roll.spec, roll.flat_steps = type("S", (), {"cfg": cfg})(), 0
    roll._warn_if_flat(0, metrics)
    assert "RL step 1: advantage.accuracy_band=[0.2, 0.4] dropped every group" in capsys.readouterr().err


@pytest.mark.parametrize("gold", ["", "  ", math.nan, "\\boxed{5", "\\boxed{}", "so \\boxed 5"])
def test_a_dare_math_gold_no_response_can_match_is_an_error(gold):
    """DARE's math_rm scores 0 for every response to such a row (agreeing with it made the row silently
    unlearnable); here it is an error naming the gold."""
    _, stats = score_batch("dare_math", ["\\boxed{5}"], [{"answer": gold}], workers=1)
    assert stats.errors == 1 and "DARE math gold is" in stats.first_error


def test_a_chat_turn_with_a_role_the_template_drops_is_refused(tmp_path):
    """SDAR's and Dream's chat templates render only system / user / assistant / tool turns: a ShareGPT-style
    'human' turn vanished, so the model saw an empty question and nothing said so."""
    import jinja2

    from megadare.data import fields

    template = open(fields.__file__.replace("fields.py", "chat_templates/sdar.jinja")).read()
    msgs = [{"role": "human", "content": "What is 2+2?"}]
    rendered = jinja2.Environment().from_string(template).render(messages=msgs, add_generation_prompt=True)
    assert "2+2" not in rendered  # the turn really is dropped by the template
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": msgs, "answer": "4"}) + "\n")
    rows = load_rows(str(path))
    with pytest.raises(DataError, match=r"chat\.jsonl:1: field 'messages'\[0\]\.role is 'human'.*user / assistant"):
        build_prompts([r for _, r in rows], ByteTokenizer(), [w for w, _ in rows], PromptRules())


def test_a_combined_reward_refuses_text_and_a_dict_is_named():
    """combine() parsed a component's "1.0" as 1.0; a verl compute_score dict got float()'s bare TypeError."""
    from megadare.rewards import combine

    both = combine([(lambda r, rec: "1.0", 1.0), ("boxed_format", 0.5)])
    _, stats = score_batch(both, ["\\boxed{1}"], [{}], workers=1)
    assert stats.errors == 1 and "reward returned a str" in stats.first_error
    _, stats = score_batch(lambda r, rec: {"score": 1.0, "acc": True}, ["x"], [{}], workers=1)
    assert stats.errors == 1 and "keys ['acc', 'score']" in stats.first_error and "result['score']" in stats.first_error


def test_data_inspect_names_golds_their_own_reward_cannot_match(tmp_path):
    """A gold like '\\boxed{2' (unclosed) scores 0 under 'math' for every response; inspect only printed the mean."""
    from megadare.eval.data_inspect import inspect_command

    path = tmp_path / "golds.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "\\\\boxed{4"}\n')
    lines: list[str] = []
    assert inspect_command([str(path)], reward="math", out=lines.append) == 0
    warn = [line for line in lines if line.startswith("warning:")]
    assert len(warn) == 1 and f"{path}:2 (gold '\\\\boxed{{4')" in warn[0] and f"{path}:1" not in warn[0]


def test_a_jsonl_object_with_a_key_twice_is_named(tmp_path):
    """json keeps the last of two 'answer' keys: half-edited rows trained on whichever came last, silently."""
    path = tmp_path / "dup.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "extra": {"k": 1, "k": 2}, "answer": "2"}\n')
    with pytest.raises(DataError, match=r"dup\.jsonl:2: key 'k' appears twice in one object"):
        load_rows(str(path))


def test_a_gsm8k_gold_with_nothing_after_the_marker_is_an_error():
    """'... #### ' gave the gold '' and every response scored 0."""
    _, stats = score_batch("gsm8k", ["\\boxed{72}"], [{"answer": "She sold 72 clips.\n#### "}], workers=1)
    assert stats.errors == 1 and "has nothing after its '####'" in stats.first_error
    scores, stats = score_batch("gsm8k", ["\\boxed{1234}"], [{"answer": "so\n#### 1,234"}], workers=1)
    assert scores == [1.0] and stats.errors == 0
    with pytest.raises(DataError, match=r"gsm8k\.jsonl:3: field 'answer': GSM8K gold .* nothing after its '####'"):
        task_spec("gsm8k").record({"question": "q", "answer": "so\n#### "}, "gsm8k.jsonl:3", "boxed")


def test_preflight_tries_the_reward_once_on_a_row(tmp_path, monkeypatch):
    """A DARE/verl compute_score(data_source, solution_str, ground_truth) as rewards.name passed --dry-run and
    failed only after the first rollout; a reward returning text passed too."""
    import sys
    import types

    from megadare.preflight import try_reward
    from megadare.rewards import RewardSpecError

    mod = types.ModuleType("s35i_rewards")
    mod.compute_score = lambda data_source, solution_str, ground_truth, extra_info=None: {"score": 1.0}
    mod.fine = lambda response, record: float("4" in response)
    monkeypatch.setitem(sys.modules, "s35i_rewards", mod)
    prompt = build_prompts([{"prompt": "2+2=", "answer": "4"}], ByteTokenizer(), "rl.jsonl")[0]
    with pytest.raises(RewardSpecError, match=r"rl\.jsonl:1: rewards\.name=s35i_rewards:compute_score failed"):
        try_reward("s35i_rewards:compute_score", prompt)
    try_reward("s35i_rewards:fine", prompt)
    try_reward("math", prompt)


def test_an_empty_user_turn_is_refused(tmp_path):
    """A chat prompt whose user turn is '' rendered as the bare template: a question-less prompt, no error."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  "}]
    with pytest.raises(DataError, match=r"rl\.jsonl:1: field 'messages'\[1\]\.content: the user turn is empty"):
        build_prompts([{"messages": msgs, "answer": "4"}], ByteTokenizer(), "rl.jsonl")


def test_an_eval_sample_whose_reward_failed_says_so(tmp_path, capsys):
    """With rewards.max_error_fraction > 0 a failed reward scored 0 and its sample row read as a wrong answer."""
    import dataclasses

    from megadare.eval.runner import _print_task, load_task_prompts, score_samples

    path = tmp_path / "gsm8k.jsonl"
    path.write_text('{"question": "1+1?", "answer": "so #### 2"}\n')
    tok = ByteTokenizer()

    def picky(response: str, record: dict) -> float:
        if "boom" in response:
            raise RuntimeError("verifier crashed")
        return 1.0

    spec = dataclasses.replace(task_spec("gsm8k"), reward=picky)
    prompts = load_task_prompts(spec, str(path), None, "boxed", tok)

    def traj(text: str) -> Trajectory:
        ids = tok.encode(text)
        n = len(ids)
        return Trajectory([1], ids, [0] * n, [0] * n, [0.0] * n, "eos", n, SamplingParams(max_new_tokens=n))

    rows, stats = score_samples(spec, tok, prompts, [[traj("\\boxed{2}"), traj("boom")]], max_error_fraction=1.0)
    assert [r["reward_error"] for r in rows] == [None, "RuntimeError: verifier crashed"]
    _print_task("gsm8k", {"mean@2": 0.5, "problems": 1, "samples_per_problem": 2, **stats})
    assert "1 samples' rewards could not be computed and count as wrong" in capsys.readouterr().out


def test_extra_info_written_as_a_json_string_keeps_dares_rule():
    """A jsonl export of DARE rows with extra_info as a string: 'auto' lost extra_info.task and scored math500
    rows with math-verify instead of DARE's math_rm (a silently different reward), countdown lost its numbers."""
    from megadare.rewards import auto_rule

    row = {"data_source": "math500", "answer": "4", "extra_info": json.dumps({"task": "math", "index": 3})}
    assert auto_rule(row) == "dare_math"
    cd = {"data_source": "countdown", "answer": "12", "extra_info": '{"numbers": [4, 6, 2]}'}
    scores, stats = score_batch("auto", ["<answer>4*6/2</answer>"], [cd], workers=1)
    assert scores == [1.0] and stats.errors == 0


def test_an_rl_run_names_golds_no_response_could_match_before_it_starts():
    """A gold its reward cannot read fails its reward when scored (an error, not a 0), so a run would stop at the
    step that first draws the row: the run's prompt loading names every such row at the start instead."""
    from types import SimpleNamespace

    from megadare.data.files import DataError
    from megadare.trainer.rl_setup import check_golds

    def row(i, answer, **extra):
        return SimpleNamespace(where=f"train.jsonl:{i}", record={"answer": answer, **extra})

    dare = {"data_source": "math500", "extra_info": {"task": "math"}}
    good = [row(1, "\\boxed{5}", **dare), row(2, "7", **dare), row(3, "12", data_source="gsm8k")]
    check_golds("auto", good)  # readable golds pass
    bad = good + [row(4, "\\boxed{5", **dare), row(5, "x #### ", data_source="gsm8k"), row(6, float("nan"), **dare)]
    with pytest.raises(DataError) as e:
        check_golds("auto", bad)
    msg = str(e.value)
    assert msg.startswith("train.jsonl:4: DARE math gold is a boxed gold with no readable last box")
    assert "3 prompt row(s)" in msg and "train.jsonl:5" in msg and "train.jsonl:6" in msg and "\n" not in msg
    check_golds("pkg.module:fn", bad)  # a reward of the user's own: its golds are its business
    check_golds("boxed_format", bad)  # a reward that reads no gold
