"""A bad config is refused before torch loads (README "Config"): the config layer and the CLI's refusal path import
none of torch, megatron, ray or transformers, so a newcomer's typo costs about a second, not the ~9 CPU-seconds of
the full stack (benchmarks/cli_startup.py). Each case runs in a fresh interpreter: this test process has torch."""

import contextlib
import importlib
import io
import os
import pkgutil
import subprocess
import sys

import pytest
import yaml

from megadare.config import check_data_files, check_rules, load_config
from megadare.errors import ConfigError
from megadare.names import ALGORITHMS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_RL = os.path.join(REPO, "megadare", "configs", "demo_rl.yaml")
HEAVY = ("torch", "megatron", "ray", "transformers")

# runs ``code`` (which leaves ``rc``), then prints the exit status and the heavy modules loaded, last line
_REPORT = "\nprint(rc, ','.join(m for m in {heavy!r} if m in sys.modules) or '-')"


def _run(code: str) -> tuple[int, str, str]:
    """(exit status of ``code``, the heavy modules it loaded, its stderr) in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", code + _REPORT.format(heavy=HEAVY)], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    rc, heavy = out.stdout.splitlines()[-1].split()
    return int(rc), heavy, out.stderr


def _demo_rl_with(tmp_path, section: str, **kv) -> str:
    """demo_rl.yaml with ``section``'s ``kv`` set, as a new file."""
    with open(DEMO_RL) as f:
        cfg = yaml.safe_load(f)
    cfg.setdefault(section, {}).update(kv)
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_the_config_layer_loads_no_torch():
    rc, heavy, _ = _run("import sys\nimport megadare.config\nrc = 0")
    assert heavy == "-", f"importing megadare.config loaded {heavy}"


@pytest.mark.parametrize(
    "section, kv, named",
    [
        ("rollout", {"temprature": 1.0}, "unknown config key 'rollout.temprature'"),  # a typo in a key
        ("model", {"dtype": "fp17"}, "model.dtype"),  # a value outside the key's choices
        ("optim", {"adam_beta2": 1.0}, "optim.adam_beta2=1.0 must be within [0, 1)"),  # a value out of its range
        ("model", {"hf_path": "no_such_dir"}, "model.hf_path='no_such_dir' is not a directory"),  # no checkpoint
        ("optim", {"lr": -1.0}, "optim.lr=-1.0, optim.min_lr=0.0: need 0 <= min_lr <= lr"),  # settings that clash
        ("rl", {"mini_batches": 32}, "rl.mini_batches=32 > rl.prompts_per_step=16"),
        ("algo", {"name": "tracrl"}, "algo.name='tracrl' unknown; did you mean algo.name=tracerl?"),  # a name typo
        ("lora", {"rank": 8, "targets": ["linear_qkvv"]}, "lora.targets=['linear_qkvv'] names no linear"),
        ("data", {"synthetic": None, "path": "no_such.jsonl"}, "no_such.jsonl: data file not found (data.path)"),
        ("data", {"synthetic": None, "path": "README.md"}, "README.md: unsupported data file extension '.md'"),
        ("data", {"synthetic": None, "path": "tests"}, "tests: unsupported data file extension"),
    ],
)
def test_a_bad_config_is_refused_before_torch_loads(tmp_path, section, kv, named):
    path = _demo_rl_with(tmp_path, section, **kv)
    code = f"import sys\nfrom megadare.cli import main\nrc = main(['rl', '--config', {path!r}])"
    rc, heavy, err = _run(code)
    lines = [ln for ln in err.splitlines() if ln.startswith("megadare: error:")]
    assert rc == 2 and len(lines) == 1 and named in lines[0], err
    assert heavy == "-", f"refusing {section}.{kv} loaded {heavy}"


@pytest.mark.parametrize("argv", [["--help"], ["sft", "--help"]])
def test_help_loads_no_torch(argv):
    code = (
        f"import sys\nfrom megadare.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as e:\n    rc = e.code"
    )
    rc, heavy, _ = _run(code)
    assert rc == 0 and heavy == "-", (rc, heavy)


def test_missing_prompt_and_eval_files_are_refused_before_torch_loads(tmp_path):
    """RL's held-out prompts and eval's task files: each missing one named with its key, before torch loads."""
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    held = tmp_path / "held.jsonl"
    cases = [
        (
            ["rl", "--config", DEMO_RL, "data.synthetic=null", f"data.path={train}", f"data.eval_path={held}"],
            f"{held}: data file not found (data.eval_path)",
        ),
        (["eval", "--tasks", f"gsm8k,{held}"], f"{held}: data file not found (--tasks)"),
        (["eval", "--tasks", "gsm8k", f"eval.paths.gsm8k={tmp_path}"], f"{tmp_path}: unsupported data file ext"),
        (["eval", "--tasks", "gsm8k", f"eval.paths.gsm8k={tmp_path / 'dir.jsonl'}"], "data file not found"),
    ]
    (tmp_path / "d.jsonl").mkdir()
    cases.append((["eval", "--tasks", "gsm8k", f"eval.paths.gsm8k={tmp_path / 'd.jsonl'}"], "is a directory"))
    for argv, named in cases:
        rc, heavy, err = _run(f"import sys\nfrom megadare.cli import main\nrc = main({argv!r})")
        lines = [ln for ln in err.splitlines() if ln.startswith("megadare: error:")]
        assert rc == 2 and len(lines) == 1 and named in lines[0], (argv, err)
        assert heavy == "-", f"refusing {argv} loaded {heavy}"


def test_config_only_dry_run_needs_no_data_file(tmp_path):
    """``--dry-run --config-only`` checks a config written for another machine: its data files need not exist."""
    from megadare.cli import main

    path = _demo_rl_with(tmp_path, "data", synthetic=None, path=str(tmp_path / "elsewhere.jsonl"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["rl", "--dry-run", "--config-only", "--config", path])
    assert rc == 0 and "pre-flight: the config and the memory plan passed" in err.getvalue(), err.getvalue()


def test_an_unreadable_data_file_is_refused(tmp_path, monkeypatch):
    """A file that exists but cannot be read (its permissions; root reads any, so os.access is stood in for)."""
    data = tmp_path / "p.jsonl"
    data.write_text("{}\n")
    cfg = load_config(DEMO_RL, ["data.synthetic=null", f"data.path={data}"])
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match=r"p\.jsonl: data file cannot be read \(permission denied\) \(data\.path\)"):
        check_data_files(cfg, "rl")


def test_the_algorithm_table_is_the_registry():
    """megadare.names.ALGORITHMS (torch-free, read by the config layer) and megadare.algos.REGISTRY hold the same
    algorithms: every Algorithm subclass with a name in megadare/algos/ is in the table, under its own name."""
    import megadare.algos as algos
    from megadare.algos.algorithm import Algorithm

    assert list(algos.REGISTRY) == list(ALGORITHMS)
    assert all(cls.name == name for name, cls in algos.REGISTRY.items())
    named = set()
    for info in pkgutil.iter_modules(algos.__path__):
        module = importlib.import_module(f"megadare.algos.{info.name}")
        named |= {c.name for c in vars(module).values() if isinstance(c, type) and issubclass(c, Algorithm)}
    assert named - {Algorithm.name} == set(ALGORITHMS)


def test_the_rules_run_once_on_the_cli_path_and_for_library_callers(tmp_path, monkeypatch):
    """The CLI checks the rules before torch loads; validate (in resolve) ran them again on the same config. A
    library caller that skips the CLI still gets them from validate, also on a config it checked and then changed."""
    import megadare.config.rules as rules
    import megadare.trainer.checks as checks
    from megadare.cli import main

    calls = []
    real = rules.check_schedule
    for module in (rules, checks):  # the old validate imported the rules into trainer/checks.py by name

        def counted(cfg, job=None, real=real):
            calls.append(1)
            real(cfg, job)

        monkeypatch.setattr(module, "check_schedule", counted, raising=False)
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["plan", "--config", DEMO_RL, f"logging.run_dir={tmp_path / 'run'}"])
    assert rc == 0 and len(calls) == 1, (rc, calls)
    cfg = load_config(DEMO_RL)
    cfg.optim.lr = -1.0
    with pytest.raises(ConfigError, match="optim.lr=-1.0"):
        checks.validate(cfg, None)
    cfg = load_config(DEMO_RL)
    check_rules(cfg)
    cfg.optim.lr = -1.0  # changed after a check of its own: validate checks it again
    with pytest.raises(ConfigError, match="optim.lr=-1.0"):
        checks.validate(cfg, None)
