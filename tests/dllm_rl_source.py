"""dLLM-RL's own functions (Gen-Verse/dLLM-RL, pinned @10b4fd1), loaded from the checkout ``DLLM_RL_SRC`` names,
for the live comparisons of tests/test_dllm_rl_source.py. Nothing of dLLM-RL is copied here.

Its training functions are nested in each script's ``main()`` (``train/rl_trado.py``, ``rl_llada.py``,
``train_trado_value.py``) and its reward scripts run their logic under ``if __name__ == "__main__"``: a function is
taken by name from the file's syntax tree, compiled at module level, and the enclosing variables it reads
(``config``, ``start_pos``, ``mask_id``, ``model``, ...) are given as its globals. The scripts' heavy imports
(accelerate, deepspeed, wandb, the model classes) are never executed: the functions compared do not use them.
"""

from __future__ import annotations

import ast
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

ENV = "DLLM_RL_SRC"
PIN = "10b4fd1"


def checkout() -> str:
    """The dLLM-RL checkout named by ``DLLM_RL_SRC``; the test is skipped, saying so, when there is none."""
    root = os.environ.get(ENV)
    if not root:
        pytest.skip(f"{ENV} is not set: point it at a Gen-Verse/dLLM-RL checkout (@{PIN}) to run its own code")
    if not os.path.isfile(os.path.join(root, "train", "rl_trado.py")):
        pytest.fail(f"{ENV}={root}: no train/rl_trado.py there; point it at a Gen-Verse/dLLM-RL checkout (@{PIN})")
    return root


def load(relpath: str, names: list[str], **env) -> dict:
    """Namespace holding dLLM-RL's functions (or classes) ``names`` of ``relpath`` (the first definition of each name, at any
    depth), with ``env`` (and torch, F) as their globals."""
    path = os.path.join(checkout(), relpath)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    defs: dict[str, ast.stmt] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            defs.setdefault(node.name, node)
    missing = sorted(set(names) - set(defs))
    if missing:
        pytest.fail(f"{path}: no function {missing} (is the checkout dLLM-RL @{PIN}?)")
    ns = {"torch": torch, "F": F, "__name__": "dllm_rl_" + relpath.replace("/", "_"), **env}
    exec(compile(ast.Module(body=[defs[n] for n in names], type_ignores=[]), path, "exec"), ns)
    return ns


def ns(**kw) -> SimpleNamespace:
    return SimpleNamespace(**kw)


class PositionModel:
    """A stand-in for dLLM-RL's model call, ``model(input_ids=..., attention_mask=..., position_ids=...)``: logits
    E[token] + W[position] (no attention), so the same parameters score megadare's rows identically."""

    def __init__(self, E: torch.Tensor, W: torch.Tensor):
        self.E, self.W = E, W

    def __call__(self, input_ids, attention_mask=None, position_ids=None, **_):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1]).expand_as(input_ids)
        return ns(logits=self.E[input_ids] + self.W[position_ids])

    def eval(self):
        return self

    def train(self):
        return self


# ------------------------------------------------------------------ drivers: dLLM-RL's pipeline on given inputs
def lm_prompt(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """dLLM-RL's ``UniversalPrompting.lm_prompt`` (``train/prompting_utils.py``) on token lists: prompts left-padded,
    responses right-padded with ``pad_id`` to the step's longest (as its tokenizer call does); (ids, start_pos)."""
    up = load("train/prompting_utils.py", ["UniversalPrompting"])["UniversalPrompting"](ns(pad_token_id=pad_id))
    P, L1 = max(map(len, prompts)), max(map(len, responses))
    p = torch.tensor([[pad_id] * (P - len(c)) + c for c in prompts])
    r = torch.tensor([y + [pad_id] * (L1 - len(y)) for y in responses])
    ids, _, start = up.lm_prompt((p, r))
    return ids, start


def trado_training(cfg: dict, ids, start: int, step_maps, rewards, mask_id: int, pad_id: int) -> dict:
    """``train/rl_trado.py``'s step map padding (280-287), ``collect_training_data`` (429-628) and the namespace its
    ``forward_process`` / ``compute_logp_old_tok_parallel`` run in (``model`` set by the caller)."""
    L1 = ids.shape[1] - start
    config = ns(training=ns(lower_p=0.1, upper_p=0.9, eps=0.2, use_kl_estimator_k3=True, **cfg))
    names = ["collapse_k_unique", "make_basic_block_attention", "process_pad", "one_round_vectorized"]
    names += ["collect_training_data", "simple_collate", "compute_logp_old_tok_parallel", "forward_process"]
    env = dict(
        config=config, start_pos=start, L0=start, L1=L1, mask_id=mask_id, pad_id=pad_id, post_num=cfg["post_num"]
    )
    g = load("train/rl_trado.py", names, **env)
    g["basic_block_attention"] = g["make_basic_block_attention"](start + 2 * L1, start, cfg["block_size"])
    maps = [m[:L1] if len(m) > L1 else m + [max(m) + 1] * (L1 - len(m)) for m in step_maps]  # rl_trado.py:280-287
    ext, p_mask, tok, labels, rew = g["collect_training_data"](ids, maps, rewards)
    g["rows"] = ns(ext=ext, p_mask=p_mask, tok=tok, labels=labels, rewards=rew, L0=start, L1=L1)
    return g


def trado_loss(g: dict, new, old) -> torch.Tensor:
    """dLLM-RL's TraceRL / random-masking step on ``g``'s rows: old log-probs by its ``compute_logp_old_tok_parallel``
    under ``old``, then its training loop (batch_size_lm 1, one accumulation window over every row) of
    ``forward_process`` under ``new``: the mean of the rows' losses."""
    r = g["rows"]
    n = r.ext.shape[0]
    items = [(i, r.ext[i], r.p_mask[i], r.tok[i], r.labels[i], r.rewards[i]) for i in range(n)]
    batches = [g["simple_collate"]([it]) for it in items]
    data = ns(logp_old_tok=torch.zeros(n, r.L0 + r.L1))
    g["model"] = old
    g["compute_logp_old_tok_parallel"](ns(device="cpu", wait_for_everyone=lambda: None), data, batches, r.L0, 0, 1)
    g["model"] = new
    total = 0.0
    for b in batches:
        i = b["ids"]
        total = total + g["forward_process"](
            b["extended_input_ids"], b["p_mask"], b["tok_idx_ext"], b["labels"], b["reward"], data.logp_old_tok[i]
        )
    return total / n


def llada_training(
    cfg: dict, prompts, responses, step_maps, rewards, mask_id: int, pad_id: int, script="llada"
) -> dict:
    """``train/rl_llada.py``'s ``prepare_inputs_and_labels_for_text`` (229-415) through its ``UniversalPrompting``
    (a tokenizer stand-in giving the token lists) and the namespace of its ``forward_process`` (576-603);
    ``script="dream"``: ``train/rl_dream.py``'s (the same rows; its loss shifts the logits one left, 605-634)."""
    up = load("train/prompting_utils.py", ["UniversalPrompting"])["UniversalPrompting"](ns(pad_token_id=pad_id))

    def uni_prompting(pair):
        ids, start = lm_prompt(*pair, pad_id)
        return ids, ids.clone(), start, 0

    config = ns(training=ns(lower_p=0.1, upper_p=0.9, eps=0.2, use_kl_estimator_k3=True, max_gen_length=10**6, **cfg))
    names = ["collapse_k_unique", "prepare_inputs_and_labels_for_text", "compute_logp_old_tok_parallel"]
    names += ["simple_collate", "forward_process"] + (["make_attention_mask"] if script == "dream" else [])
    env = dict(config=config, mask_id=mask_id, pad_id=pad_id, uni_prompting=uni_prompting, script=script)
    g = load(f"train/rl_{script}.py", names, **env)
    assert up.max_gen_length > max(map(len, responses))  # lm_prompt keeps the whole response
    noisy, labels, p_mask, rew, start, _ = g["prepare_inputs_and_labels_for_text"](
        prompts, responses, step_maps, rewards
    )
    g["rows"] = ns(noisy=noisy, labels=labels, p_mask=p_mask, rewards=rew, start=start)
    return g


def llada_loss(g: dict, new, old) -> torch.Tensor:
    """rl_llada.py's (rl_dream.py's) step on ``g``'s rows (old log-probs by its ``compute_logp_old_tok_parallel``, then its loop of
    ``forward_process`` with ``batch_size_lm`` rows a micro-batch, one accumulation window over all of them)."""
    r = g["rows"]
    n, bsz = r.noisy.shape[0], g["config"].training.batch_size_lm
    items = [(i, r.noisy[i], r.labels[i], r.p_mask[i], r.rewards[i]) for i in range(n)]
    batches = [g["simple_collate"](items[i : i + bsz]) for i in range(0, n, bsz)]
    dream = g["script"] == "dream"
    data = ns(logp_old_tok=torch.zeros(n, r.noisy.shape[1] - dream))  # Dream's: one per shifted logit
    g["model"] = old
    g["compute_logp_old_tok_parallel"](
        ns(device="cpu", wait_for_everyone=lambda: None), data, batches, r.start, g["pad_id"], 1
    )
    g["model"] = new
    total = 0.0
    for b in batches:
        lp, rows = data.logp_old_tok[b["ids"]], (b["input_ids"], b["labels"], b["p_mask_lm"])
        total = total + (
            g["forward_process"](*rows, r.start, b["reward"], lp)
            if dream
            else g["forward_process"](*rows, b["reward"], lp)
        )
    return total / len(batches)


def trado_value_returns(cfg: dict, ids, start: int, step_maps, rewards, values, mask_id: int, pad_id: int):
    """``train/train_trado_value.py``: ``collect_training_data`` (485-572) on the step maps, old values ``values(b, k)``
    at every row's targets, then ``compute_returns_and_advantages_from_fragments`` (716-904); per sample and
    response position: (A_j, R_j) where trainable, else None."""
    L1 = ids.shape[1] - start
    config = ns(training=ns(**cfg))
    names = ["collapse_k_unique", "one_round_vectorized", "collect_training_data", "TrainDataset"]
    names += ["compute_returns_and_advantages_from_fragments"]
    env = dict(config=config, start_pos=start, mask_id=mask_id, pad_id=pad_id, post_num=cfg["post_num"])
    g = load("train/train_trado_value.py", names, Dataset=torch.utils.data.Dataset, **env)
    maps = [m[:L1] if len(m) > L1 else m + [max(m) + 1] * (L1 - len(m)) for m in step_maps]
    ext, p_mask, tok, labels, rmat, seq_ids, _, step_all, resp_all = g["collect_training_data"](ids, maps, rewards)
    data = g["TrainDataset"](
        ext, p_mask, tok, labels, rmat, seq_ids=seq_ids, L0=start, L1=L1, step_map_all=step_all,
        resp_input_ids_all=resp_all, per_seq_reward=torch.as_tensor(rewards, dtype=torch.float32),
        per_token_reward_all=torch.as_tensor(rewards, dtype=torch.float32), use_vector_reward=False,
        pad_id=pad_id, post_num=cfg["post_num"],
    )  # fmt: skip
    for row in range(p_mask.shape[0]):
        for k in p_mask[row, start:].nonzero().flatten().tolist():
            data.old_values[row, start + k] = values(int(seq_ids[row]), k)
    g["compute_returns_and_advantages_from_fragments"](data, cfg["gam"], cfg["lam"])
    out = [[None] * L1 for _ in rewards]
    for row in range(p_mask.shape[0]):
        for k in p_mask[row, start:].nonzero().flatten().tolist():
            out[int(seq_ids[row])][k] = (float(data.adv[row, start + k]), float(data.Return[row, start + k]))
    return out


def trado_value_loss(v, v_old, ret, p_mask, L1: int, clip: float = 0.2) -> torch.Tensor:
    """``train_trado_value.py``'s ``forward_process`` (983-1013) with its value model returning ``v`` [B, L0+2*L1]."""
    config = ns(training=ns(eps=clip))
    L0 = p_mask.shape[1] - L1
    g = load(
        "train/train_trado_value.py", ["forward_process", "process_pad"], config=config, start_pos=L0, L0=L0, L1=L1
    )
    g["basic_block_attention"] = torch.ones(1, 1, L0 + 2 * L1, L0 + 2 * L1)
    g["pad_id"] = -1
    g["value_model"] = lambda input_ids, attention_mask=None, position_ids=None: v
    ext = torch.zeros(v.shape, dtype=torch.long)
    return g["forward_process"](ext, p_mask, None, ret, v_old)


def rl_reward(groups: list[dict], tmp_path, max_gen_length: int) -> list[dict]:
    """Runs ``reward/rl_reward.py`` itself (``__main__``: correctness by ``math_utils.is_equal``, responses within 5
    tokens of ``max_gen_length`` wrong, population z-score, groups outside accuracy [0.2, 0.8] dropped) on
    ``groups`` (each: ``extracted_output``, ``ground_truth_answer``, ``response_length``, ``step_map``) in a scratch
    project under ``tmp_path``; its training rows (prompt, reward, ...). nest_asyncio / termcolor are stubbed."""
    import json
    import runpy
    import sys

    root = checkout()
    proj, work = tmp_path / "proj", tmp_path / "run"
    (proj / "temp_data").mkdir(parents=True)
    work.mkdir()
    (tmp_path / "stubs").mkdir()
    (tmp_path / "stubs" / "nest_asyncio.py").write_text("def apply():\n    pass\n")
    (tmp_path / "stubs" / "termcolor.py").write_text("def cprint(*a, **k):\n    pass\n")
    data = [
        {"prompt": f"p{i}", "full_output": [f"o{j}" for j in range(len(g["extracted_output"]))], **g}
        for i, g in enumerate(groups)
    ]
    name = "rl-m-d"  # outputs_name for pretrained_model "m", train_dataset "d"
    (proj / "temp_data" / f"outputs-{name}.json").write_text(json.dumps(data))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "experiment: {project: proj, current_epoch: 1, function: train}\nmodel: {pretrained_model: m, model_base: trado}\n"
        f"training: {{shrink: 1}}\ndataset: {{train_dataset: d, optimization_data: opt}}\n"
        f"rollout: {{max_gen_length: {max_gen_length}, top_k: 0, remasking_strategy: x}}\n"
    )
    saved = (list(sys.argv), list(sys.path), os.getcwd())
    sys.argv = ["rl_reward.py", f"config={cfg}"]
    sys.path[:0] = [str(tmp_path / "stubs"), os.path.join(root, "reward")]
    os.chdir(work)
    try:
        runpy.run_path(os.path.join(root, "reward", "rl_reward.py"), run_name="__main__")
    finally:
        sys.argv, sys.path[:], _ = saved[0], saved[1], os.chdir(saved[2])
        sys.modules.pop("math_utils", None)
    return json.loads((proj / "temp_data" / "opt.json").read_text())


def trado_kl(d: torch.Tensor, beta: float) -> torch.Tensor:
    """dLLM-RL's block ``forward_process`` (``rl_trado.py:711-760``) with advantage 0 (only the KL term) on one row
    per entry of ``d`` = log p_old - log p_new, one target each, L1 = 1: beta * its KL estimate per row."""
    n = d.numel()
    config = ns(training=ns(eps=0.2, beta=beta, use_kl_estimator_k3=True))
    g = load("train/rl_trado.py", ["process_pad", "forward_process"], config=config, start_pos=1, L0=1, L1=1)
    g["pad_id"], g["basic_block_attention"] = -1, torch.ones(1, 1, 3, 3)
    new = torch.zeros(n, 3, 2, dtype=torch.float64)  # vocab of 2: label 0's log-prob is -log 2 at every position
    g["model"] = lambda input_ids, attention_mask=None, position_ids=None: ns(logits=new[: input_ids.shape[0]])
    lp_new = -torch.log(torch.tensor(2.0, dtype=torch.float64))
    out = []
    for i in range(n):
        p_mask = torch.tensor([[False, True]])
        old = torch.stack([lp_new, lp_new + d[i]])[None]
        ext, lab = torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long)
        out.append(g["forward_process"](ext, p_mask, None, lab, [0.0], old))
    return torch.stack(out)


def math_verdicts(cases: list[tuple[str, str]]) -> list[bool]:
    """dLLM-RL's math reward on (response, gold) pairs, its string stage: the last ``\\boxed{}`` as its rollout
    extracts it (``sample/trado_rl_rollout.py::extract_final_boxed_answer``), then ``reward/math_utils.py::is_equiv``
    (``is_equal``'s first test; its sympy fallback needs antlr4 4.11, which the venv does not have)."""
    import importlib.util

    root = checkout()
    extract = load("sample/trado_rl_rollout.py", ["extract_final_boxed_answer"])["extract_final_boxed_answer"]
    spec = importlib.util.spec_from_file_location("dllm_rl_math_utils", os.path.join(root, "reward", "math_utils.py"))
    mu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mu)
    return [bool(mu.is_equiv(extract(r), str(g))) for r, g in cases]


def trado_prompt(problem: str, rollout: str = "sample/trado_rl_rollout.py") -> str:
    """The prompt dLLM-RL's TraDo / SDAR rollout gives the model for ``problem``: its ``get_prompt`` rendering its
    ``system_prompts`` (the first assigned in the file: ``start_with_think`` false) with jinja2."""
    from jinja2 import Template

    path = os.path.join(checkout(), rollout)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    literal = next(
        ast.literal_eval(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "system_prompts" for t in n.targets)
    )
    return load(rollout, ["get_prompt"], system_prompts=literal, Template=Template)["get_prompt"]({"question": problem})


def config_keys(pattern: str = "configs/rl_*.yaml") -> set[str]:
    """Every dotted key of dLLM-RL's RL configs."""
    import glob

    import yaml

    keys: set[str] = set()

    def walk(d: dict, pre: str) -> None:
        for k, v in d.items():
            walk(v, f"{pre}{k}.") if isinstance(v, dict) else keys.add(pre + k)

    for path in glob.glob(os.path.join(checkout(), pattern)):
        with open(path, encoding="utf-8") as f:
            walk(yaml.safe_load(f), "")
    return keys


def trado_rows_of(g: dict, fragments: list[tuple[list[int], list[int], set, float]]) -> None:
    """Replace ``g``'s rows (``trado_training``) by given fragments (prompt, response, masked response positions,
    advantage) in rl_trado.py's layout: prompt ++ response ++ its noisy copy (padded to L1), p_mask on the masked
    response positions, labels the clean sequence (its ``collect_training_data`` tail, 605-613)."""
    r, pad, mask = g["rows"], g["pad_id"], g["mask_id"]
    ext, p_mask = [], []
    for c, y, masked, _ in fragments:
        y = y + [pad] * (r.L1 - len(y))
        ext.append(c + y + [mask if k in masked else t for k, t in enumerate(y)])
        p_mask.append([False] * len(c) + [k in masked for k in range(r.L1)])
    ext, p_mask = torch.tensor(ext), torch.tensor(p_mask)
    pos = torch.arange(r.L0 + r.L1).expand(len(fragments), -1)
    r.ext, r.p_mask, r.labels = ext, p_mask, ext[:, : r.L0 + r.L1].clone()
    r.tok, r.rewards = torch.cat([pos, pos[:, r.L0 :]], 1), [a for *_, a in fragments]


def llada_rows_of(g: dict, fragments: list[tuple[list[int], list[int], set, float]]) -> None:
    """The same in rl_llada.py's layout: the noisy sequence, the clean labels, p_mask (its 323-337)."""
    r, mask = g["rows"], g["mask_id"]
    noisy = [c + [mask if k in m else t for k, t in enumerate(y)] for c, y, m, _ in fragments]
    r.noisy, r.labels = torch.tensor(noisy), torch.tensor([c + y for c, y, _, _ in fragments])
    r.p_mask = torch.tensor([[False] * len(c) + [k in m for k in range(len(y))] for c, y, m, _ in fragments])
    r.rewards = [a for *_, a in fragments]


def math_utils():
    """dLLM-RL's ``reward/math_utils.py`` as a module (its "math_verify is not installed" print silenced)."""
    import contextlib
    import importlib.util
    import io

    path = os.path.join(checkout(), "reward", "math_utils.py")
    spec = importlib.util.spec_from_file_location("dllm_rl_math_utils", path)
    mu = importlib.util.module_from_spec(spec)
    with contextlib.redirect_stdout(io.StringIO()):
        spec.loader.exec_module(mu)
    return mu


def sympy_latex_runs() -> bool:
    """Does sympy's ``parse_latex`` run here (antlr4 4.11)? If not, dLLM-RL's sympy stage falls back to Minerva's
    normalised strings."""
    from sympy.parsing.latex import parse_latex

    try:
        parse_latex("1")
    except ImportError:
        return False
    return True


def math_is_equal(cases: list[tuple[str, str]]) -> list[bool]:
    """dLLM-RL's whole math reward on (response, gold) pairs: its rollout's ``extract_final_boxed_answer``, then
    ``math_utils.is_equal``'s stages in its legacy mode (``is_equiv``, then the ``repeatness`` guard and
    ``_is_latex_equal``), called directly: ``is_latex_equal`` runs them under a 1 s ``asyncio.wait_for`` counted from
    when rl_reward.py queued every comparison of the step, which on a cold sympy import decides by the clock."""
    mu = math_utils()
    extract = load("sample/trado_rl_rollout.py", ["extract_final_boxed_answer"])["extract_final_boxed_answer"]
    out = []
    for response, gold in cases:
        pred = extract(response)
        long_loop = any(len(x) > 128 and mu.repeatness(x) for x in (pred, gold))
        out.append(bool(mu.is_equiv(pred, gold) or (not long_loop and mu._is_latex_equal(pred, gold))))
    return out


def code_shares(rows: list[tuple[str, dict]]) -> list[float]:
    """dLLM-RL's code reward on (response, row) pairs: its rollout's ``extract_code``, then ``reward/rl_execute.py``'s
    ``evaluate_function_dataset`` (spawned processes, as its main sets) or ``evaluate_stdio_dataset`` (forked here:
    a spawned worker re-imports rl_execute.py's numpy / omegaconf / tqdm inside its 1 s limit, which on a loaded
    machine times every case out); the share of the row's tests passed (rl_code_reward.py sums them). termcolor is
    stubbed."""
    import multiprocessing as mp
    import sys
    import tempfile

    root = checkout()
    stubs = tempfile.mkdtemp()
    with open(os.path.join(stubs, "termcolor.py"), "w") as f:
        f.write("def cprint(*a, **k):\n    pass\n")
    sys.path[:0] = [stubs, os.path.join(root, "reward")]
    try:
        import rl_execute as X

        extract = load("sample/trado_rl_rollout.py", ["extract_code"], re=__import__("re"))["extract_code"]
        out = []
        for response, row in rows:
            item = dict(row, extracted_output=[extract(response)])
            if row["test_method"] == "function":
                X.evaluate_function_dataset([item], n_workers=1)
            else:
                method = mp.get_start_method(allow_none=True)
                mp.set_start_method("fork", force=True)
                try:
                    X.evaluate_stdio_dataset([item], num_chunks=1)
                finally:
                    mp.set_start_method(method, force=True)
            passed = item["correctness"][0]
            out.append(sum(passed) / len(passed))
        return out
    finally:
        sys.path[:] = [p for p in sys.path if p not in (stubs, os.path.join(root, "reward"))]
        sys.modules.pop("rl_execute", None)
