"""Outputs never clobber (issue 24, item 2): ``megadare convert`` and the quantized export refuse an ``--out`` that
overlaps a source or a run's checkpoint root, or holds anything but a previous export of the same kind, in one
line, touching nothing; a previous export of the same kind is replaced only once the new one is complete."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys

import pytest

from megadare.cli import main
from tiny import write_tiny_hf


def tree(path) -> dict[str, str]:
    """Every file under ``path`` with a hash of its bytes (what "untouched" means)."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, path)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A tiny HF model and a run directory whose checkpoint root holds its conversion (as a training run's)."""
    tmp = tmp_path_factory.mktemp("export")
    hf = write_tiny_hf(tmp, "sdar", seed=3, block_size=4)
    run = tmp / "run"
    assert main(["convert", "hf-to-megatron", "--hf", hf, "--out", str(run / "ckpt" / "iter_0000002")]) == 0
    (run / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out").write_text("x")
    return hf, run


def refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err  # (a progress bar may stand before the error on its line)
    assert "Traceback" not in err and err.count("megadare: error: ") == 1 and err.endswith("\n"), err
    line = err.split("megadare: error: ")[1]
    assert line.count("\n") == 1 and "--out " in line, err
    return line


def test_megatron_to_hf_refuses_every_out_that_would_clobber(sources, tmp_path, capsys):
    hf, run = sources
    before = tree(run)
    ckpt = str(run / "ckpt")
    to_hf = ["convert", "megatron-to-hf", "--ckpt", ckpt, "--out"]
    assert "contains the source" in refused(capsys, to_hf + [str(run)])  # the run directory
    assert "is the source" in refused(capsys, to_hf + [ckpt])  # the checkpoint root
    assert "lies inside the source" in refused(capsys, to_hf + [str(run / "ckpt" / "hf")])
    assert "is a file" in refused(capsys, to_hf + [str(run / "metrics.jsonl")])
    other = tmp_path / "other_run"
    shutil.copytree(run, other)
    assert "lies inside the checkpoint root" in refused(capsys, to_hf + [str(other / "ckpt" / "export")])
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert "is not empty and is not an export megadare wrote" in refused(capsys, to_hf + [str(foreign)])
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert "is not empty and is not an export megadare wrote" in refused(capsys, to_hf + [hf])  # a published model
    assert tree(run) == before


def test_a_previous_export_of_the_same_kind_is_replaced_and_no_other(sources, tmp_path, capsys):
    hf, run = sources
    out = tmp_path / "exported"
    for _ in range(2):  # the second run replaces the first export
        assert main(["convert", "megatron-to-hf", "--ckpt", str(run / "ckpt"), "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", ".megadare-export.json"} <= set(os.listdir(out))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".exported.")]  # no staging or old copy left
    capsys.readouterr()
    # an HF export is not a Megatron export: hf-to-megatron refuses to write over it, and over its own source
    assert "is not empty and is a hf export" in refused(
        capsys, ["convert", "hf-to-megatron", "--hf", hf, "--out", str(out)]
    )
    assert "is the source" in refused(capsys, ["convert", "hf-to-megatron", "--hf", hf, "--out", hf])
    assert "contains the source" in refused(
        capsys, ["convert", "hf-to-megatron", "--hf", hf, "--out", os.path.dirname(hf)]
    )
    mcore = tmp_path / "mcore"
    for _ in range(2):
        assert main(["convert", "hf-to-megatron", "--hf", hf, "--out", str(mcore)]) == 0
    assert os.path.exists(mcore / "manifest.json") and os.path.exists(mcore / ".megadare-export.json")


def test_quantized_export_refuses_another_kind_and_its_source(sources, tmp_path, capsys):
    from megadare.convert.quantize import quantize_export
    from megadare.errors import OutputError

    hf, run = sources
    out = tmp_path / "fp8b"
    quantize_export(hf, out, fmt="fp8-block", progress=False)
    quantize_export(hf, out, fmt="fp8-block", progress=False)  # a previous fp8-block export: replaced
    plain = tmp_path / "plain"
    assert main(["convert", "megatron-to-hf", "--ckpt", str(run / "ckpt"), "--out", str(plain)]) == 0
    before = tree(plain)
    with pytest.raises(OutputError, match="is not empty and is a hf export"):
        quantize_export(hf, plain, fmt="fp8-block", progress=False)
    with pytest.raises(OutputError, match="is the source"):
        quantize_export(hf, hf, fmt="fp8-block", progress=False)
    with pytest.raises(OutputError, match="contains the source"):
        quantize_export(str(run / "ckpt"), run, fmt="fp8-block", progress=False)
    assert tree(plain) == before


def test_a_failing_export_leaves_out_untouched(sources, tmp_path, monkeypatch, capsys):
    """The writer fails half-way (a full disk): the previous export stays as it was, no staging directory stays."""
    import errno

    import megadare.models.safetensors_io as st

    hf, run = sources
    out = tmp_path / "exported"
    assert main(["convert", "megatron-to-hf", "--ckpt", str(run / "ckpt"), "--out", str(out)]) == 0
    before = tree(out)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(st, "save_file", full)
    capsys.readouterr()
    err = refused(capsys, ["convert", "megatron-to-hf", "--ckpt", str(run / "ckpt"), "--out", str(out)])
    assert f"writing --out {out} failed: No space left on device; nothing of this export was kept" in err
    assert tree(out) == before
    assert sorted(os.listdir(tmp_path)) == ["exported"]


def test_a_previous_export_that_now_holds_a_run_is_not_replaced(sources, tmp_path, capsys):
    """A previous HF export later used as a run directory (its checkpoints, metrics, a sub-run): re-exporting into
    it used to pass the check (its mark says "hf") and replace it whole, deleting the run. An export holds files
    (and the Megatron export's hf/); anything else in it is refused, by name."""
    hf, run = sources
    out = tmp_path / "exported"
    to_hf = ["convert", "megatron-to-hf", "--ckpt", str(run / "ckpt"), "--out", str(out)]
    assert main(to_hf) == 0
    (out / "ckpt" / "iter_0000003").mkdir(parents=True)
    (out / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = tree(out)
    line = refused(capsys, to_hf)
    assert f"--out {out} holds {out / 'ckpt'}, which no hf export writes" in line, line
    shutil.rmtree(out / "ckpt")
    assert f"holds {out / 'metrics.jsonl'}" in refused(capsys, to_hf)
    assert tree(out) == {k: v for k, v in before.items() if not k.startswith("ckpt")}
    os.remove(out / "metrics.jsonl")
    (out / "notes.md").write_text("mine")  # a file of a kind no export writes
    assert f"holds {out / 'notes.md'}" in refused(capsys, to_hf)
    os.remove(out / "notes.md")
    assert main(to_hf) == 0  # the export alone: replaced


def test_the_fp8_engines_model_of_another_source_is_exported_again(tmp_path):
    """rollout.fp8_weights: <run_dir>/engine_fp8 was reused whenever it held a config.json, so a run directory an
    earlier run with another model.hf_path left behind had the engines serve that other model. The export is now
    made again when its mark names another source, and reused when it names this one."""
    import json

    from megadare.rollout.setup import fp8_engine_model

    a = write_tiny_hf(tmp_path, "sdar", seed=3, block_size=4)
    b = write_tiny_hf(tmp_path / "b", "sdar", seed=4, block_size=4)
    run = tmp_path / "run"
    path = fp8_engine_model(str(run), a)
    mark = os.path.join(path, ".megadare-export.json")
    assert json.load(open(mark))["sources"] == [os.path.abspath(a)]
    first = tree(path)
    assert fp8_engine_model(str(run), a) == path and tree(path) == first  # the same source: reused
    fp8_engine_model(str(run), b)
    assert json.load(open(mark))["sources"] == [os.path.abspath(b)] and tree(path) != first


@pytest.fixture
def full_tmpfs(tmp_path):
    """A 64 KiB tmpfs (a disk that fills up at once), unmounted however the test ends; root only."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)])


def test_an_export_to_a_full_disk_is_one_line(sources, full_tmpfs, capsys):
    """A real full disk: safetensors raises its own SafetensorError ('... (os error 28)'), not an OSError, which
    came out as a traceback (the test above raises an OSError in its place). Now the one line, and nothing of
    the export is left on the disk."""
    hf, run = sources
    out = full_tmpfs / "exported"
    err = refused(capsys, ["convert", "megatron-to-hf", "--ckpt", str(run / "ckpt"), "--out", str(out)])
    assert f"writing --out {out} failed: No space left on device ({full_tmpfs}/.exported.tmp." in err, err
    assert os.listdir(full_tmpfs) == []


def test_the_sweep_line_does_not_join_the_progress_bar(sources, tmp_path, capsys):
    """hf-to-megatron draws its bar's first frame (no newline) before it sweeps what a killed export left beside
    --out; the sweep's "export: removed ..." line was glued onto that frame (``0/20 [...]export: removed ...``)
    when stderr is piped into a log. It starts a line of its own."""
    hf, _ = sources
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    out = tmp_path / "ck"
    dead = tmp_path / f".ck.tmp.{gone.pid}@{socket.gethostname()}-abcd1234"
    dead.mkdir()
    assert main(["convert", "hf-to-megatron", "--hf", hf, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "hf -> megatron" in err, err  # the bar was drawn
    swept = [line for line in err.splitlines() if "export: removed" in line]
    assert swept == [f"export: removed {dead}, left by a killed export of {out}"], err
    assert not dead.exists()
