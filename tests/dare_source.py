"""DARE's own code, loaded live from a checkout named by ``DARE_SRC`` (github.com/yjyddq/DARE; never vendored here).

Without ``DARE_SRC`` every caller skips, saying so in one line. ``dare_file`` loads one self-contained file (the
reward battery's ``math_reward.py``); ``dare_module`` imports a module of DARE's ``verl`` package without running
the package ``__init__`` files (they pull ray, pandas and the tokenizers in) and with the few imports a CPU box lacks
stubbed, each by name below: ``tensordict.TensorDict`` and ``transformers.PreTrainedTokenizer`` (only imported for
type hints by ``verl/utils/torch_functional.py``) and ``accelerate.utils.set_seed`` (seeds python, numpy and torch,
as accelerate's does). A stub is installed only where the real package does not import, and the stubs and DARE's
``verl`` modules are taken out of ``sys.modules`` again after loading: the rest of the session never sees them.
A caller may add named stand-ins of its own (``stand_ins``: d-TreeRPO's ``DataProto`` / ``compute_reward``).
``dare_functions`` runs chosen top-level functions of a file whose imports cannot load here (the actors'
module-level helpers). The fixtures at the end serve tests/test_dare_live*.py.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import os
import random
import sys
import types

import numpy as np
import pytest
import torch

DARE_COMMIT = "83ae8a305a53a914cce563aedceeac88566891cb"  # the commit the transcriptions in tests/ cite
SKIP_REASON = "DARE's source is not here: set DARE_SRC to a DARE checkout (github.com/yjyddq/DARE) to run it"


def dare_src() -> str:
    """The DARE checkout ``DARE_SRC`` names, or a skip of the calling test."""
    src = os.environ.get("DARE_SRC", "")
    if not src or not os.path.isdir(os.path.join(src, "verl")):
        pytest.skip(SKIP_REASON)
    return src


def dare_file(relpath: str, name: str) -> types.ModuleType:
    """One file of the checkout, executed as module ``name`` (no package context)."""
    path = os.path.join(dare_src(), relpath)
    if not os.path.isfile(path):
        pytest.skip(f"{path} is not in the DARE checkout DARE_SRC names")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dare_functions(relpath: str, names: tuple[str, ...], scope: dict | None = None) -> types.SimpleNamespace:
    """The named top-level functions of one file of the checkout, executed alone with ``torch`` (and ``scope``: the
    other names they use; the functions' globals are that very dict) in scope: for module-level helpers of files
    that import verl's FSDP / ray stack (their code runs as written)."""
    path = os.path.join(dare_src(), relpath)
    if not os.path.isfile(path):
        pytest.skip(f"{path} is not in the DARE checkout DARE_SRC names")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    picked = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in picked}
    if missing:
        pytest.fail(f"{relpath} of DARE_SRC has no function {sorted(missing)}: its code moved, update this test")
    namespace = scope if scope is not None else {}  # the caller's dict: it may rebind a name later
    namespace.setdefault("torch", torch)
    exec(compile(ast.Module(body=picked, type_ignores=[]), path, "exec"), namespace)  # DARE's own lines, from DARE_SRC
    return types.SimpleNamespace(**{n: namespace[n] for n in names})


def dare_methods(relpath: str, cls: str, names: tuple[str, ...], scope: dict | None = None) -> types.SimpleNamespace:
    """The named methods of class ``cls`` of one file of the checkout, as plain functions (decorators dropped; the
    first argument is the instance: a stand-in of the caller's), executed as ``dare_functions`` runs functions: for
    a trainer's or a model's loss code whose class cannot be built here (FSDP, flash-attn)."""
    path = os.path.join(dare_src(), relpath)
    if not os.path.isfile(path):
        pytest.skip(f"{path} is not in the DARE checkout DARE_SRC names")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), [])
    picked = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in picked}
    if missing:
        pytest.fail(f"{relpath} of DARE_SRC has no method {cls}.{sorted(missing)}: its code moved, update this test")
    for node in picked:
        node.decorator_list = []
    namespace = scope if scope is not None else {}
    namespace.setdefault("torch", torch)
    exec(compile(ast.Module(body=picked, type_ignores=[]), path, "exec"), namespace)  # DARE's own lines, from DARE_SRC
    return types.SimpleNamespace(**{n: namespace[n] for n in names})


def _accelerate_set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Stub of ``accelerate.utils.set_seed``: the same three seeds (CPU)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _stub_modules() -> dict[str, types.ModuleType]:
    """The stand-ins for what does not import here, keyed by module name."""
    stubs: dict[str, types.ModuleType] = {}
    if importlib.util.find_spec("tensordict") is None:
        stubs["tensordict"] = types.ModuleType("tensordict")
        stubs["tensordict"].TensorDict = type("TensorDict", (dict,), {})
    if importlib.util.find_spec("transformers") is None:
        stubs["transformers"] = types.ModuleType("transformers")
        stubs["transformers"].PreTrainedTokenizer = type("PreTrainedTokenizer", (), {})
    if importlib.util.find_spec("accelerate") is None:
        stubs["accelerate"] = types.ModuleType("accelerate")
        stubs["accelerate.utils"] = types.ModuleType("accelerate.utils")
        stubs["accelerate.utils"].set_seed = _accelerate_set_seed
        stubs["accelerate"].utils = stubs["accelerate.utils"]
    for name, stub in stubs.items():  # a spec, so that importlib.util.find_spec (transformers asks) still answers
        stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return stubs


def _bare_package(name: str, path: str) -> types.ModuleType:
    """A package whose ``__init__`` is not run: its submodules import from ``path``."""
    package = types.ModuleType(name)
    package.__path__ = [path]
    return package


def dare_module(dotted: str, stand_ins: dict[str, dict[str, object]] | None = None) -> types.ModuleType:
    """``verl.<...>`` of the checkout, imported with bare ``verl`` packages and the stubs above; ``stand_ins``
    ({module: {name: object}}) adds the caller's named stand-ins (to a bare package, or as a module of its own)."""
    src = dare_src()
    before = set(sys.modules)
    if any(n == "verl" or n.startswith("verl.") for n in before):
        pytest.skip("a verl package is already imported in this process: DARE's would clash with it")
    parts = dotted.split(".")
    installed = _stub_modules()
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        installed[name] = _bare_package(name, os.path.join(src, *parts[:i]))
    for util in ("verl.utils",):  # verl/utils/__init__.py imports the tokenizers
        installed.setdefault(util, _bare_package(util, os.path.join(src, "verl", "utils")))
    for name, attrs in (stand_ins or {}).items():
        module = installed.setdefault(name, types.ModuleType(name))
        for attr, value in attrs.items():
            setattr(module, attr, value)
    sys.modules.update(installed)
    try:
        return importlib.import_module(dotted)
    finally:
        for name in set(sys.modules) - before:  # only ours: a torch submodule loaded meanwhile stays
            if name in installed or name == "verl" or name.startswith("verl."):
                del sys.modules[name]


# ------------------------------------------------------------------ fixtures of tests/test_dare_live*.py
@pytest.fixture(autouse=True)
def global_rng_restored():
    """DARE's forward processes draw from (and ``set_seed`` reseeds) the global RNGs: put them back afterwards."""
    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(states[0])
    np.random.set_state(states[1])


@pytest.fixture(scope="module")
def dllm():
    """DARE's ``verl/trainer/ppo/dllm_core_algos.py`` (which re-exports its ``core_algos``)."""
    return dare_module("verl.trainer.ppo.dllm_core_algos")


@pytest.fixture(scope="module")
def verl_core():
    """DARE's ``verl/trainer/ppo/core_algos.py`` (verl's, as DARE ships it)."""
    return dare_module("verl.trainer.ppo.core_algos")


@pytest.fixture(scope="module")
def mdpo_algos():
    return dare_module("verl.trainer.ppo.mdpo_algos")


def report(name: str, worst: float | None = None) -> None:
    """One line per comparison (``pytest -s``): its max |difference|, or ``exact`` (compared with equality)."""
    print(f"\nDARE live | {name}: " + ("exact" if worst is None else f"max |diff| {worst:.3g}"))
