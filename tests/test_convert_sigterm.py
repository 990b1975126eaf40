"""``megadare convert`` under a SIGTERM to the whole job (Slurm's time limit, ``scancel``) while it writes: it died
by the default handler (exit 143, not a word) and left its half-written export in a hidden sibling of --out (a
shard cut mid-way), which only a later export of the same --out removed. Now the export's staging is removed,
--out is as it was (a previous export there untouched), and one line says so, exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_rl_group_sigterm import run_hooked
from test_sigterm_edges import HOOK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from megadare.models import build_hf_model, get_family, save_hf_model

    cfg = get_family("sdar").tiny_config()
    d = str(tmp_path_factory.mktemp("hf") / "sdar")
    save_hf_model(build_hf_model(cfg), cfg, d, max_shard_bytes=32 << 10)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "Test"}, f)
    return d


def _tree(path) -> dict[str, int]:
    """Every file under ``path`` (hidden ones too) with its inode: what the stopped export may not touch."""
    return {
        os.path.relpath(os.path.join(d, f), path): os.stat(os.path.join(d, f)).st_ino
        for d, _, files in os.walk(path)
        for f in files
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "direction, target",
    [
        ("megatron-to-hf", "megadare.models.safetensors_io.ShardedSafetensorsWriter._flush"),  # a shard written
        ("hf-to-megatron", "megadare.convert.hf_megatron.HFSource.__call__"),  # a tensor read for the checkpoint
    ],
)
def test_a_sigterm_mid_write_keeps_nothing_of_the_export_and_says_so(tiny_hf, tmp_path, direction, target):
    from megadare.cli import main

    work = tmp_path / "work"
    work.mkdir()
    ckpt, out = str(work / "ckpt"), str(work / "out")
    assert main(["convert", "hf-to-megatron", "--hf", tiny_hf, "--out", ckpt]) == 0
    if direction == "megatron-to-hf":
        argv = ["convert", direction, "--ckpt", ckpt, "--out", out, "--max-shard-gb", "0.00002"]
    else:
        argv = ["convert", direction, "--hf", tiny_hf, "--out", out]
    assert main(argv) == 0  # a previous export at --out: the stopped one must leave it as it is
    before = _tree(work)
    proc, stdout, err = run_hooked(tmp_path, HOOK, argv, {"HOOK_TARGET": target}, 100)
    assert proc.returncode == 0, (proc.returncode, stdout, err[-3000:])
    assert stdout.strip().splitlines() == [
        f"convert stopped by SIGTERM: nothing of this export was kept and {out} is as it was; run the same "
        "command again"
    ], (stdout, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert _tree(work) == before  # no staging sibling left, the previous export's files the same files


# the hook of test_sigterm_edges (SIGTERM to the whole job once HOOK_TARGET returned) running the quantize tool
_QUANTIZE_HOOK = (
    HOOK.split('if __name__ == "__main__":')[0]
    + f"""
if __name__ == "__main__":
    import runpy

    sys.argv[0] = {os.path.join(ROOT, "tools", "checkpoint_convert", "quantize.py")!r}
    runpy.run_path(sys.argv[0], run_name="__main__")
"""
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source", ["--hf", "--ckpt"])
def test_a_sigterm_mid_quantize_keeps_nothing_of_the_export_and_says_so(tiny_hf, tmp_path, source):
    """tools/checkpoint_convert/quantize.py was not watched: the SIGTERM killed it (exit 143, not a word) and left
    its staging (and, from a --ckpt source, its HF copy) beside --out. Now both are removed, a previous export at
    --out is untouched, and one line says so, exit 0."""
    from megadare.cli import main

    work = tmp_path / "work"
    work.mkdir()
    ckpt, out = str(work / "ckpt"), str(work / "out")
    assert main(["convert", "hf-to-megatron", "--hf", tiny_hf, "--out", ckpt]) == 0
    argv = [source, tiny_hf if source == "--hf" else ckpt, "--out", out, "--format", "fp8-block", "--quiet"]
    tool = os.path.join(ROOT, "tools", "checkpoint_convert", "quantize.py")
    assert subprocess.run([sys.executable, tool, *argv], capture_output=True, timeout=100).returncode == 0
    before = _tree(work)
    target = "megadare.models.safetensors_io.ShardedSafetensorsWriter._flush"  # a shard written (staging / HF copy)
    proc, stdout, err = run_hooked(tmp_path, _QUANTIZE_HOOK, argv, {"HOOK_TARGET": target}, 100)
    assert proc.returncode == 0, (proc.returncode, stdout, err[-3000:])
    assert stdout.strip().splitlines() == [
        f"quantize stopped by SIGTERM: nothing of this export was kept and {out} is as it was; run the same "
        "command again"
    ], (stdout, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert _tree(work) == before  # no staging sibling left, the previous export's files the same files
