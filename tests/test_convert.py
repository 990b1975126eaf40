"""Converter pieces in one process: transforms, tables, streaming, atomic writes and error messages."""

from __future__ import annotations

import gc
import json
import os
import weakref

import pytest
import torch

from megadare.models.mapping import ParamMap, interleave_qkv, split_qkv

FAMILIES = ["sdar", "sdar_moe", "llada2", "llada", "dream"]


def test_interleave_qkv_layout_is_megatrons():
    """Rows of group g are [q heads of g, k_g, v_g], written out by hand for 4 heads, 2 groups, d=1."""
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = interleave_qkv(q, k, v, heads=4, groups=2, head_dim=1)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    back = split_qkv(fused, heads=4, groups=2, head_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_fused_qkv_and_bias_roundtrip():
    heads, groups, d, h = 8, 2, 4, 6
    w = torch.randn((heads + 2 * groups) * d, h)
    row = ParamMap("x", ("qkv",), "fused_qkv", heads=heads, groups=groups, head_dim=d)
    assert torch.equal(row.to_hf(row.to_mcore([w]))[0], w)
    b = [torch.randn(heads * d), torch.randn(groups * d), torch.randn(groups * d)]
    rb = ParamMap("y", ("q", "k", "v"), "qkv", heads=heads, groups=groups, head_dim=d)
    assert all(torch.equal(x, y) for x, y in zip(rb.to_hf(rb.to_mcore(b)), b))


def test_vocab_padding():
    row = ParamMap("e", ("emb",), "vocab", vocab=250, padded_vocab=256)
    t = torch.randn(250, 8)
    m = row.to_mcore([t])
    assert m.shape == (256, 8) and torch.equal(m[250:], torch.zeros(6, 8))
    assert torch.equal(row.to_hf(m)[0], t)
    with pytest.raises(ValueError, match="rows, config says vocab 250"):
        row.to_mcore([torch.randn(251, 8)])


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from megadare.models import build_hf_model, get_family, save_hf_model

    out = {}
    for i, name in enumerate(FAMILIES):
        torch.manual_seed(i)
        cfg = get_family(name).tiny_config()
        model = build_hf_model(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        d = str(tmp_path_factory.mktemp("hf") / name)
        save_hf_model(model, cfg, d, max_shard_bytes=32 << 10)
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "Test"}, f)
        out[name] = d
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_convert_roundtrip_bitwise(name, hf_dirs, tmp_path):
    from megadare.convert.hf_megatron import hf_to_megatron, megatron_to_hf
    from megadare.models.safetensors_io import SafetensorsReader

    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    hf_to_megatron(hf_dirs[name], ck, progress=False)
    megatron_to_hf(ck, out, max_shard_bytes=16 << 10, progress=False)
    a, b = SafetensorsReader(hf_dirs[name]), SafetensorsReader(out)
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        assert torch.equal(a.get(k), b.get(k)), k
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))  # sharded like the publisher
    for fn in ("config.json", "tokenizer_config.json"):
        with open(os.path.join(hf_dirs[name], fn)) as f1, open(os.path.join(out, fn)) as f2:
            assert f1.read() == f2.read()


@pytest.mark.parametrize("name", ["sdar", "sdar_moe", "llada2"])
def test_exports_load_in_transformers(name, hf_dirs, tmp_path):
    """megatron_to_hf exports of the families SGLang serves load in transformers the way SGLang reads them
    (AutoConfig, trust_remote_code): SDAR / SDAR-MoE configs megadare writes are Qwen3 / Qwen3-MoE configs, and
    AutoModelForCausalLM builds the same network (same logits under the block-causal mask); LLaDA2's carries
    megadare's configuration_llada2_moe.py."""
    transformers = pytest.importorskip("transformers")
    from megadare.convert.hf_megatron import hf_to_megatron, megatron_to_hf
    from megadare.models import load_hf_model
    from megadare.models.attention import block_causal

    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    hf_to_megatron(hf_dirs[name], ck, progress=False)
    megatron_to_hf(ck, out, progress=False)
    conf = transformers.AutoConfig.from_pretrained(out, trust_remote_code=True)
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert conf.architectures == written["architectures"] and conf.model_type == written["model_type"]
    assert conf.mask_token_id == written["mask_token_id"] and conf.vocab_size == written["vocab_size"]
    if name == "llada2":
        assert os.path.exists(os.path.join(out, "configuration_llada2_moe.py")) and conf.embedding_dropout == 0.0
        return
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ours = load_hf_model(out)
    ids = torch.randint(0, 250, (1, 8), generator=torch.Generator().manual_seed(0))
    allowed = block_causal(4).dense(8, 8)
    with torch.no_grad():
        ref = theirs(input_ids=ids, attention_mask=torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")))
        assert torch.allclose(ref.logits, ours(ids, attention_mask=allowed), atol=1e-4)


def test_exports_carry_the_publishers_remote_code(hf_dirs, tmp_path):
    """A source checkpoint with model_type 'sdar' and its remote code (auto_map + configuration_sdar.py, as the
    publishers ship it): the converted checkpoint and its export carry the code, and the export loads in
    transformers through it."""
    pytest.importorskip("transformers")
    import shutil

    from transformers import AutoConfig

    from megadare.convert.hf_megatron import hf_to_megatron, megatron_to_hf

    src = str(tmp_path / "publisher")
    shutil.copytree(hf_dirs["sdar"], src)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(model_type="sdar", auto_map={"AutoConfig": "configuration_sdar.SDARConfig"})
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(src, "configuration_sdar.py"), "w") as f:
        f.write("from transformers import Qwen3Config\n\n\nclass SDARConfig(Qwen3Config):\n    model_type = 'sdar'\n")
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    hf_to_megatron(src, ck, progress=False)
    megatron_to_hf(ck, out, progress=False)
    assert os.path.exists(os.path.join(ck, "hf", "configuration_sdar.py"))
    conf = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert type(conf).__name__ == "SDARConfig" and conf.model_type == "sdar" and conf.block_size == 4
    os.remove(os.path.join(out, "configuration_sdar.py"))  # what exports did before: no remote code
    with pytest.raises((ValueError, OSError)):
        AutoConfig.from_pretrained(out, trust_remote_code=True)


class _Buf(bytearray):
    """A buffer that can be weakly referenced: tensors made with frombuffer keep it alive."""


@pytest.mark.parametrize("file_bytes", [1, 16 << 10])
def test_converter_streams_with_bounded_memory(hf_dirs, tmp_path, file_bytes):
    """The writer asks for tensors one by one and frees each file's tensors once the file is written."""
    from megadare.convert.hf_megatron import HFSource
    from megadare.convert.mcore_ckpt import write_tensors

    src = HFSource(hf_dirs["sdar_moe"])
    alive: list[tuple[weakref.ref, int]] = []
    worst = 0

    def produce(key):
        nonlocal worst
        gc.collect()
        worst = max(worst, sum(n for r, n in alive if r() is not None))
        t = src(key)
        buf = _Buf(t.numel() * t.element_size())
        out = torch.frombuffer(buf, dtype=t.dtype).reshape(t.shape)
        out.copy_(t)
        alive.append((weakref.ref(buf), len(buf)))
        return out

    write_tensors(str(tmp_path / "ck"), src.shapes(), produce, file_bytes=file_bytes)
    largest = max(n for _, n in alive)
    assert len(alive) == len(src.table)
    assert worst <= file_bytes + largest, f"{worst} bytes of produced tensors alive at once"
    assert worst < sum(n for _, n in alive) / 4  # far from holding the model


def test_failed_write_leaves_previous_checkpoint_intact(hf_dirs, tmp_path):
    from megadare.convert.hf_megatron import HFSource, hf_to_megatron
    from megadare.convert.mcore_ckpt import checkpoint_keys, write_tensors

    ck = str(tmp_path / "ck")
    hf_to_megatron(hf_dirs["sdar"], ck, progress=False)
    before = checkpoint_keys(ck)
    src = HFSource(hf_dirs["sdar"])
    calls = {"n": 0}

    def failing(key):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("disk full")
        return src(key)

    with pytest.raises(RuntimeError, match="disk full"):
        write_tensors(ck, src.shapes(), failing)
    assert checkpoint_keys(ck) == before


def test_missing_and_unexpected_tensors_are_named(hf_dirs, tmp_path):
    from megadare.convert.hf_megatron import hf_to_megatron
    from megadare.models.safetensors_io import SafetensorsReader, save_hf_checkpoint

    src = hf_dirs["sdar"]
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    state = dict(SafetensorsReader(src).items())
    dropped = sorted(state)[3]
    del state[dropped]
    state["model.layers.0.mystery.weight"] = torch.zeros(2)
    bad = str(tmp_path / "bad")
    save_hf_checkpoint(state, cfg, bad)
    with pytest.raises(ValueError) as e:
        hf_to_megatron(bad, str(tmp_path / "ck"), progress=False)
    assert dropped in str(e.value) and "model.layers.0.mystery.weight" in str(e.value)


def test_bad_layout_fails_before_writing(hf_dirs, tmp_path):
    from megadare.convert.hf_megatron import hf_to_megatron
    from megadare.parallel.layout import Layout

    with pytest.raises(ValueError, match="tp"):
        hf_to_megatron(hf_dirs["sdar"], str(tmp_path / "ck"), Layout(tp=3), progress=False)
    assert not os.path.exists(tmp_path / "ck")


def test_not_a_checkpoint(tmp_path):
    from megadare.convert.hf_megatron import megatron_to_hf
    from megadare.convert.mcore_ckpt import MegatronCheckpointError

    with pytest.raises(MegatronCheckpointError, match="not a Megatron distributed checkpoint"):
        megatron_to_hf(str(tmp_path), str(tmp_path / "out"))


def test_a_run_directory_or_hf_dir_given_as_checkpoint_names_what_to_give(tmp_path):
    # `checkpoint.load=runs/demo/sft` (the run, not its ckpt/) or an HF export: the error says what to give
    from megadare.convert.mcore_ckpt import MegatronCheckpointError, resolve_checkpoint_dir

    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    (run / "ckpt" / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(MegatronCheckpointError, match=f"run directory: give its checkpoints, {run / 'ckpt'}$"):
        resolve_checkpoint_dir(str(run))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(MegatronCheckpointError, match="an HF checkpoint \\(model.hf_path takes it"):
        resolve_checkpoint_dir(str(tmp_path / "hf"))


def test_cli_tools_convert(hf_dirs, tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": root}
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "tools/checkpoint_convert/hf_to_megatron.py"),
            "--hf",
            hf_dirs["llada2"],
            "--out",
            ck,
            "--tp",
            "2",
            "--ep",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [sys.executable, os.path.join(root, "tools/checkpoint_convert/megatron_to_hf.py"), "--ckpt", ck, "--out", out],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert os.path.exists(os.path.join(out, "config.json"))
    # quiet: torch's single-process DCP notice is not shown for the conversions megadare runs in one process
    assert "assuming the intent" not in r.stderr, r.stderr
    # the weights are as readable as config.json (safetensors >= 0.8 alone writes 0600: nobody else could serve them)
    shards = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    mode = os.stat(os.path.join(out, "config.json")).st_mode & 0o777
    assert shards and {os.stat(os.path.join(out, f)).st_mode & 0o777 for f in shards} == {mode}
