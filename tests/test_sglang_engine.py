"""The SGLang rollout engine without sglang: the translation to and from sglang's API.

(c) ``SGLangEngine`` against ``FakeSGLang`` (tests/sglang_fake.py), a fake of the sglang boundary;
(d) without sglang, constructing the engine raises ImportError with the install hint;
(e) ``register()`` makes ``MegadareBlockDiffusion`` resolvable through sglang's lookup and its worker hook lets the
    algorithm deliver the per-token trace onto the requests.
(The block step and the plugin's core loop: tests/test_dllm_step.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from megadare.rollout import sglang_engine as se
from megadare.rollout import sglang_plugin as sp
from megadare.rollout.engine import SamplingParams

from block_toy import V, MASK, EOS, B, ToyBlockLM, block_logits
from sglang_fake import fake_sglang, ckpt  # noqa: F401  (fixtures)
from sglang_fake import FakeDllmAlgorithm, unpack


# ---------------------------------------------------------------------------------------------- (c) the engine
def test_engine_launch_arguments(fake_sglang, ckpt):
    eng = se.SGLangEngine(
        se.SGLangEngineSpec(
            ckpt(),
            EOS,
            steps_per_block=2,
            algorithm="low_confidence_dynamic",
            threshold=0.8,
            max_running_requests=64,
            tp_size=2,
            engine_kwargs={"dllm_fdfo": False},
        ),
        check_plugin=False,
    )
    (kw,) = fake_sglang.named("Engine")
    assert kw["dllm_algorithm"] == "MegadareBlockDiffusion" and kw["max_running_requests"] == 64
    assert kw["tp_size"] == 2 and kw["enable_memory_saver"] is True and kw["skip_tokenizer_init"] is True
    assert kw["dllm_fdfo"] is False
    import yaml

    with open(kw["dllm_algorithm_config"]) as f:
        assert yaml.safe_load(f) == {
            "block_size": 4,
            "steps_per_block": 2,
            "algorithm": "low_confidence_dynamic",
            "threshold": 0.8,
        }
    eng.shutdown()
    assert fake_sglang.named("shutdown")
    se.SGLangEngine(se.SGLangEngineSpec(ckpt("LLaDA2MoeModelLM"), EOS), check_plugin=False)
    assert fake_sglang.named("Engine")[-1]["max_running_requests"] == 128  # explicit even by default
    assert se.SGLangEngine(se.SGLangEngineSpec(ckpt("LLaDA2MoeModelLM"), EOS), check_plugin=False).block_size == 32
    assert (
        se.SGLangEngine(
            se.SGLangEngineSpec(ckpt("SDARMoeForCausalLM", block_size=8), EOS), check_plugin=False
        ).block_size
        == 8
    )
    with pytest.raises(ValueError, match="supports .*SDARForCausalLM.*'LLaDAModelLM'"):
        se.SGLangEngine(se.SGLangEngineSpec(ckpt("LLaDAModelLM"), EOS), check_plugin=False)
    with pytest.raises(ValueError, match="engine_kwargs may not set"):
        se.SGLangEngine(
            se.SGLangEngineSpec(ckpt(), EOS, engine_kwargs={"dllm_algorithm": "LowConfidence"}), check_plugin=False
        )
    with pytest.raises(ValueError, match="max_running_requests"):
        se.SGLangEngine(se.SGLangEngineSpec(ckpt(), EOS, max_running_requests=0), check_plugin=False)


def test_an_engine_removes_the_temp_dir_a_killed_engine_left(fake_sglang, ckpt, tmp_path, monkeypatch):
    """Each SGLang engine keeps its algorithm config in a temp dir removed at exit; an engine SIGKILLed (ray.kill,
    an OOM kill) left it in /tmp, one per killed engine. Its name now carries pid@host; a new engine removes
    those of gone processes on this host, and keeps a live one's, another host's and names without an owner."""
    import socket
    import tempfile

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host, tmp = socket.gethostname(), tmp_path / "tmp"
    names = {
        "dead": f"megadare_sglang_{gone.pid}@{host}-abcd1234",
        "live": f"megadare_sglang_{os.getpid()}@{host}-efgh5678",
        "elsewhere": f"megadare_sglang_{gone.pid}@not-{host}-ijkl9012",
        "unnamed": "megadare_sglang_mnop3456",
    }
    for name in names.values():
        (tmp / name).mkdir(parents=True)
        (tmp / name / "dllm_algorithm.yaml").write_text("block_size: 4\n")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    eng = se.SGLangEngine(se.SGLangEngineSpec(ckpt(), EOS), check_plugin=False)
    mine = os.path.basename(eng._tmpdir)
    assert mine.startswith(f"megadare_sglang_{os.getpid()}@{host}-")
    assert set(os.listdir(tmp)) == {mine} | {names[k] for k in ("live", "elsewhere", "unnamed")}


def test_engine_refuses_a_mask_id_sglang_does_not_use(fake_sglang, ckpt):
    """sglang decodes SDAR with mask id 151669 and LLaDA2 with 156895 whatever config.json says: another mask id
    is refused, naming both ids, before sglang.Engine is built."""
    with pytest.raises(
        ValueError,
        match=r"mask token id 255, but sglang hard-codes mask id 151669 for "
        r"SDARForCausalLM",
    ):
        se.SGLangEngine(se.SGLangEngineSpec(ckpt(mask_token_id=255), EOS), check_plugin=False)
    with pytest.raises(ValueError, match=r"mask token id 151669, but sglang hard-codes mask id 156895"):
        se.SGLangEngine(se.SGLangEngineSpec(ckpt("LLaDA2MoeModelLM", mask_token_id=151669), EOS), check_plugin=False)
    with pytest.raises(ValueError, match=r"vocab_size=256, which does not hold sglang's mask id 151669"):
        se.SGLangEngine(se.SGLangEngineSpec(ckpt("SDARMoeForCausalLM", vocab_size=256), EOS), check_plugin=False)
    assert not fake_sglang.named("Engine")  # refused before the engine started
    se.SGLangEngine(se.SGLangEngineSpec(ckpt("SDARMoeForCausalLM"), EOS), check_plugin=False)
    assert len(fake_sglang.named("Engine")) == 1


def test_tied_sdar_checkpoints_load_through_the_plugin_hook(fake_sglang):
    """sglang's SDAR loader raises KeyError('lm_head.weight') for a tied checkpoint (its head is the embedding);
    through megadare's hook the embedding loads into the one shared tensor, and untied models are untouched."""
    model_cls = sys.modules["sglang.srt.models.sdar"].SDARForCausalLM
    emb, head = torch.randn(8, 4), torch.randn(8, 4)
    tied = model_cls(tie=True)
    with pytest.raises(KeyError, match="lm_head.weight"):
        tied.load_weights([("model.embed_tokens.weight", emb)])  # the bug, without the hook
    sp.register()
    sys.modules["sglang.srt.plugins.hook_registry"].HookRegistry.apply_hooks()
    tied.load_weights([("model.embed_tokens.weight", emb), ("lm_head.weight", head)])
    assert torch.equal(tied.lm_head.weight, emb) and tied.config.tie_word_embeddings is True
    assert tied.skipped == ["lm_head.weight"]  # sglang skips a tied checkpoint's copy of the head
    untied = model_cls(tie=False)
    untied.load_weights([("model.embed_tokens.weight", emb), ("lm_head.weight", head)])
    assert torch.equal(untied.model.embed_tokens.weight, emb) and torch.equal(untied.lm_head.weight, head)


def test_engine_requires_the_plugin_entry_point(fake_sglang, ckpt, monkeypatch):
    import importlib.metadata as md

    ours = md.EntryPoint(name="megadare", value=se.PLUGIN_ENTRY_POINT, group=se.PLUGIN_GROUP)
    monkeypatch.setattr(md, "entry_points", lambda group=None: [ours] if group == se.PLUGIN_GROUP else [])
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    se.SGLangEngine(se.SGLangEngineSpec(ckpt(), EOS))  # found
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    with pytest.raises(RuntimeError, match="plugin is not registered"):
        se.SGLangEngine(se.SGLangEngineSpec(ckpt(), EOS))
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else, megadare")
    se.SGLangEngine(se.SGLangEngineSpec(ckpt(), EOS))
    monkeypatch.setattr(md, "entry_points", lambda group=None: [])
    with pytest.raises(RuntimeError, match="plugin is not registered"):
        se.SGLangEngine(se.SGLangEngineSpec(ckpt(), EOS))


def test_engine_generate_translates_params_and_outputs(fake_sglang, ckpt):
    eng = se.SGLangEngine(se.SGLangEngineSpec(ckpt(), EOS), check_plugin=False)
    eng.version = 7
    prompts = [[1, 2, 3], [4, 5]]
    fake_sglang.outputs = [
        {
            "output_ids": [6, 7, EOS],
            "meta_info": {
                "finish_reason": {"type": "stop", "matched": EOS},
                "weight_version": "7",
                sp.TRACE_KEY: [[0, 0, -0.5, 2], [1, 1, -0.25, 2], [1, 1, -1.0, 2]],
            },
        },
        {
            "output_ids": [3, 3, 3, 3, 2],
            "meta_info": {
                "finish_reason": {"type": "length"},
                sp.TRACE_KEY: [[0, 0, -0.1, 2], [1, 1, -0.2, 2], [2, 0, -0.3, 4], [3, 1, -0.4, 4], [4, 0, -0.5, 6]],
            },
        },
    ]
    params = SamplingParams(max_new_tokens=5, block_size=4, steps_per_block=2, temperature=0.7, top_p=0.9, seed=3)
    t1, t2 = eng.generate(prompts, params)
    (call,) = fake_sglang.named("generate")
    assert call["input_ids"] == prompts
    s0, s1 = call["sampling_params"]
    assert s0["temperature"] == 0.7 and s0["top_p"] == 0.9 and s0["top_k"] == -1 and s0["max_new_tokens"] == 5
    assert s0["sampling_seed"] == 3 and s1["sampling_seed"] == se.prompt_seed(3, 1) != 3
    assert s0["ignore_eos"] is False and s0["stop_token_ids"] == [EOS]
    assert s1["custom_params"] == {
        "megadare": {
            "algorithm": "low_confidence_static",
            "steps_per_block": 2,
            "threshold": 0.9,
            "seed": se.prompt_seed(3, 1),
            "confidence": "model_prob",
            "schedule": "even",
            "eps": 1e-3,
            "alg_temp": 0.0,
            "editing_threshold": 0.9,
            "max_post_steps": 16,
            "num_to_transfer": 1,
        }
    }
    assert t1.response_ids == [6, 7, EOS] and t1.finish_reason == "eos" and t1.commit_step == [0, 1, 1]
    assert t1.block_step == [0, 1, 1] and t1.logprobs == [-0.5, -0.25, -1.0] and t1.num_forwards == 2
    assert t1.policy_version == 7 and t1.extra["sglang_weight_version"] == "7"
    assert t2.finish_reason == "length" and t2.num_forwards == 6 and t2.commit_step == [0, 1, 2, 3, 4]
    greedy = SamplingParams(max_new_tokens=5, block_size=4, top_k=20, stop_at_eos=False)
    eng.generate(prompts, greedy)
    g0 = fake_sglang.named("generate")[-1]["sampling_params"][0]
    assert g0["temperature"] == 0.0 and g0["top_k"] == 20 and g0["ignore_eos"] is True and "stop_token_ids" not in g0
    with pytest.raises(ValueError, match="block_size=8 differs"):
        eng.generate(prompts, SamplingParams(block_size=8, steps_per_block=4))
    with pytest.raises(ValueError, match="record_steps"):
        eng.generate(prompts, SamplingParams(block_size=4, record_steps=True))
    fake_sglang.outputs[0]["meta_info"].pop(sp.TRACE_KEY)
    with pytest.raises(RuntimeError, match="dLLM algorithm did not run"):
        eng.generate(prompts, params)
    fake_sglang.outputs[0] = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}
    with pytest.raises(RuntimeError, match="aborted"):
        eng.generate(prompts, params)


def test_engine_update_weights_chunks_and_flushes(fake_sglang, ckpt):
    eng = se.SGLangEngine(
        se.SGLangEngineSpec(ckpt(), EOS, tp_size=2, chunk_bytes=64, flush_interval_s=0.0), check_plugin=False
    )
    named = [
        ("a", torch.randn(4, 4)),
        ("b", torch.randn(3, dtype=torch.bfloat16)),
        ("c", torch.randn(30)),
        ("d", torch.randn(5, dtype=torch.bfloat16)),
        ("e", torch.randn(2)),
    ]
    fake_sglang.flush_results = [False, False, True]  # requests still in flight twice
    info = eng.update_weights(named, version=3)
    names = [n for n, _ in fake_sglang.calls]
    loads = fake_sglang.named("update_weights_from_tensor")
    assert names[1] == "begin_weight_update" and names.index("end_weight_update") > names.index(
        "update_weights_from_tensor"
    )
    assert names.count("flush_cache") == 3 and names[-1] == "flush_cache"
    got: dict[str, torch.Tensor] = {}
    for call in loads:
        assert call["load_format"] == "flattened_bucket" and call["flush_cache"] is False
        assert len(call["named_tensors"]) == 2  # one payload per TP rank
        chunk = unpack(call["named_tensors"][0])
        assert len({t.dtype for t in chunk.values()}) == 1  # a flattened bucket holds one dtype
        size = sum(t.numel() * t.element_size() for t in chunk.values())
        assert size <= 64 or len(chunk) == 1
        got.update(chunk)
    assert len(loads) == info["chunks"] >= 3 and set(got) == {n for n, _ in named}
    assert all(torch.equal(got[n], t) for n, t in named)
    assert eng.version == 3 and eng.health()["version"] == 3
    # inside pause()/resume() (what sync_weights does): one session and one flush for all buckets
    fake_sglang.calls.clear()
    eng.pause()
    eng.update_weights(named[:2], version=4)
    eng.update_weights(named[2:], version=4)
    eng.resume()
    names = [n for n, _ in fake_sglang.calls]
    assert names.count("begin_weight_update") == 1 and names.count("end_weight_update") == 1
    assert names.count("flush_cache") == 1 and names[-1] == "flush_cache"
    fake_sglang.flush_results = [False] * 5
    eng.flush_retries = 5
    with pytest.raises(RuntimeError, match="flush_cache still failing after 5"):
        eng.update_weights(named[:1], version=5)


def test_engine_sleep_wake_health(fake_sglang, ckpt):
    eng = se.SGLangEngine(se.SGLangEngineSpec(ckpt(), EOS), check_plugin=False)
    eng.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate([[1]], SamplingParams(block_size=4))
    eng.wake()
    assert fake_sglang.named("release_memory_occupation") and fake_sglang.named("resume_memory_occupation")
    h = eng.health()
    assert h["alive"] and h["weight_version"] == "default" and h["dllm_algorithm"] == sp.ALGORITHM_NAME
    assert h["asleep"] is False and h["max_running_requests"] == 128
    no_saver = se.SGLangEngine(se.SGLangEngineSpec(ckpt(), EOS, enable_memory_saver=False), check_plugin=False)
    with pytest.raises(RuntimeError, match="enable_memory_saver"):
        no_saver.sleep()


def test_engine_joins_weight_groups_and_receives_flattened_buckets(fake_sglang, ckpt):
    """A ``distributed`` weight push into an SGLang engine: it joins one group per trainer pipeline stage and
    receives every flattened buffer with ``update_weights_from_distributed(load_format="flattened_bucket")``,
    inside one update session with one cache flush."""
    from megadare.rollout.weight_sync.groups import GroupSpec
    from megadare.rollout.weight_sync.plan import Flat

    eng = se.SGLangEngine(se.SGLangEngineSpec(ckpt(), EOS, tp_size=2, flush_interval_s=0.0), check_plugin=False)
    eng.join_weight_groups(
        [GroupSpec("w_s0", "10.0.0.1", 29600, 5, 1, "nccl"), GroupSpec("w_s1", "10.0.0.2", 29601, 5, 1, "nccl")]
    )
    inits = fake_sglang.named("init_weights_update_group")
    assert [
        (i["group_name"], i["master_address"], i["master_port"], i["rank_offset"], i["world_size"], i["backend"])
        for i in inits
    ] == [("w_s0", "10.0.0.1", 29600, 1, 5, "nccl"), ("w_s1", "10.0.0.2", 29601, 1, 5, "nccl")]
    f32 = Flat(torch.float32, ("x", "z"), ((2, 5), (30,)))
    bf16 = Flat(torch.bfloat16, ("y",), ((20,),))
    out = eng.receive_weights([("w_s0", [[f32, bf16]]), ("w_s1", [[Flat(torch.float32, ("h",), ((4,),))]])], 9)
    assert eng.version == 9 and out["bytes"] == f32.nbytes + bf16.nbytes + 16
    recv = fake_sglang.named("update_weights_from_distributed")
    assert [(c["group_name"], c["names"], c["dtypes"], c["shapes"]) for c in recv] == [
        ("w_s0", ["x", "z"], ["float32", "float32"], [[2, 5], [30]]),
        ("w_s0", ["y"], ["bfloat16"], [[20]]),
        ("w_s1", ["h"], ["float32"], [[4]]),
    ]
    assert all(c["load_format"] == "flattened_bucket" and c["flush_cache"] is False for c in recv)
    assert len(fake_sglang.named("flush_cache")) == 1


_RECEIVER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    default_pg_timeout, rendezvous)
    addr, port, group_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    # sglang/srt/utils/common.py::init_custom_process_group, as init_weights_update_group runs it (rank_offset 1)
    store, rank, world = next(rendezvous(f"tcp://{addr}:{port}", 1, 2, timeout=default_pg_timeout))
    pg, _ = _new_process_group_helper(world, rank, [], Backend("gloo"), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=default_pg_timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    for line in sys.stdin:                       # one flat's (names, dtypes, shapes) per line
        names, dtypes, shapes = json.loads(line)
        # sglang's _receive_bucketed_weights_from_distributed: a FlattenedTensorBucket of empty tensors (uint8
        # views concatenated in list order), one broadcast from rank 0, then the tensors sliced back out
        named = [(n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in zip(names, dtypes, shapes)]
        flat = torch.cat([t.flatten().view(torch.uint8) for _, t in named])
        dist.broadcast(flat, src=0, group=pg)
        out, at = [], 0
        for n, t in named:
            k = t.numel() * t.element_size()
            out.append([n, float(flat[at:at + k].view(t.dtype).float().sum())])
            at += k
        print(json.dumps(out), flush=True)
""")


def test_a_sender_group_reaches_a_receiver_built_like_sglangs():
    """The trainer's end of a weight group (weight_sync.groups.join_group, rank 0) and a flattened buffer broadcast
    over gloo, against a receiver process that joins and receives the way sglang's ``init_weights_update_group`` /
    ``update_weights_from_distributed(load_format="flattened_bucket")`` do: same rendezvous, same bytes."""
    from megadare.rollout.weight_sync.groups import (
        GroupSpec,
        broadcast_from_sender,
        host_ip,
        host_store,
        join_group,
        leave_group,
    )
    from megadare.rollout.weight_sync.plan import Flat

    store = host_store()
    proc = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER, host_ip(), str(store.port), "mg_weights"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pg = None
    try:
        pg = join_group(GroupSpec("mg_weights", host_ip(), store.port, 2, 0, "gloo"), store=store)
        results = []
        for flat, tensors in (
            (
                Flat(torch.float32, ("w1", "w3"), ((2, 3), (5,))),
                [torch.arange(6.0).reshape(2, 3), torch.full((5,), 2.0)],
            ),
            (Flat(torch.bfloat16, ("w2",), ((4,),)), [torch.ones(4, dtype=torch.bfloat16)]),
        ):
            proc.stdin.write(
                json.dumps(
                    [list(flat.names), [se.dtype_name(flat.dtype)] * len(flat.names), [list(s) for s in flat.shapes]]
                )
                + "\n"
            )
            proc.stdin.flush()
            buf = torch.cat([t.flatten() for t in tensors]).view(torch.uint8)
            assert buf.numel() == flat.nbytes
            broadcast_from_sender(buf, pg)
            results += json.loads(proc.stdout.readline())
        assert results == [["w1", 15.0], ["w3", 10.0], ["w2", 4.0]]
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        if pg is not None:
            leave_group(pg)
    assert proc.returncode == 0


# ---------------------------------------------------------------------------------------------- (d) no sglang
def test_without_sglang_the_engine_says_how_to_install(monkeypatch, ckpt):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    with pytest.raises(ImportError, match=r'pip install "megadare\[sglang\]".*sglang>=0\.5\.20,<0\.5\.24'):
        se.SGLangEngine(se.SGLangEngineSpec(ckpt(), EOS))
    with pytest.raises(ImportError):
        sp.register()


# ---------------------------------------------------------------------------------------------- (e) register()
def _fake_reqs(specs):
    return [
        types.SimpleNamespace(
            rid=f"r{i}",
            output_ids=[],
            customized_info=None,
            dllm_algo_state=None,
            sampling_params=types.SimpleNamespace(
                temperature=t, top_p=1.0, top_k=k, sampling_seed=seed, custom_params=cp
            ),
        )
        for i, (t, k, seed, cp) in enumerate(specs)
    ]


@pytest.mark.parametrize("fdfo", [False, True], ids=["sync", "fdfo"])
def test_register_resolves_the_algorithm_and_delivers_traces(fake_sglang, fdfo):
    algos = sys.modules["sglang.srt.dllm.algorithm"]
    with pytest.raises(RuntimeError, match="Unknown diffusion LLM algorithm"):
        algos.get_algorithm_cls(sp.ALGORITHM_NAME)
    sp.register()
    cls = algos.get_algorithm_cls(sp.ALGORITHM_NAME)  # the lookup --dllm-algorithm goes through
    assert cls.__name__ == sp.ALGORITHM_NAME and issubclass(cls, FakeDllmAlgorithm)
    assert set(cls.supported_architectures) == {"SDARForCausalLM", "SDARMoeForCausalLM", "LLaDA2MoeModelLM"}
    registry = sys.modules["sglang.srt.plugins.hook_registry"].HookRegistry
    assert [(t, h.name) for t, _, h in registry.hooks] == [
        (sp.WORKER_HOOK_TARGET, "AROUND"),
        (sp.SDAR_LOAD_HOOK_TARGET, "AROUND"),
    ]
    sp.register()  # idempotent
    assert len(registry.hooks) == 2
    registry.apply_hooks()  # what load_plugins() does after the plugins ran

    config = types.SimpleNamespace(
        algorithm=sp.ALGORITHM_NAME,
        block_size=B,
        mask_id=MASK,
        first_done_first_out_mode=fdfo,
        algorithm_config={
            "block_size": B,
            "steps_per_block": 2,
            "algorithm": "low_confidence_dynamic",
            "threshold": 0.5,
        },
    )
    algo = algos.get_algorithm(config)
    model = ToyBlockLM(1)
    specs = [
        (1.0, 1, None, None),  # greedy, sglang style (top_k=1)
        (0.9, 5, None, {"megadare": {"seed": 3, "algorithm": "random", "steps_per_block": 4}}),
    ]
    reqs = _fake_reqs(specs)
    grids = [[5, 1, 9, 3], [2, 8, 8, 1]]  # committed context of each request (sglang's KV)
    heads = [[4, 7], []]  # the prompt's remainder in the first block

    class Runner:
        def forward(self, fb):
            ids = fb.input_ids.view(2, B)
            logits = torch.cat([block_logits(model, g, ids[i : i + 1]) for i, g in enumerate(grids)])
            return types.SimpleNamespace(full_logits=logits.reshape(2 * B, V))

    worker = sys.modules["sglang.srt.managers.tp_worker"].TpModelWorker(algo, Runner())
    batch = types.SimpleNamespace(reqs=reqs)
    core = sp.BlockDenoiser(B, MASK, config.algorithm_config)  # the reference: the core run directly
    ref = []
    for r, grid in zip(reqs, grids):
        params = core.params_for(
            r.sampling_params.temperature, 1.0, r.sampling_params.top_k, r.sampling_params.custom_params, None, r.rid
        )
        ref.append(
            {"params": params, "rng": sp.RequestStream(params.seed), "forwards": 0, "trace": [], "grid": list(grid)}
        )
    for blk in range(2):  # two blocks: global steps continue across them
        hd = heads if blk == 0 else [[], []]
        start = torch.tensor([h + [MASK] * (B - len(h)) for h in hd])
        fb = types.SimpleNamespace(batch_size=2, input_ids=start.flatten().clone(), dllm_prompt_mask=None)
        emitted: list = [None, None]
        for _ in range(10):  # the scheduler: run, append emitted tokens
            _, next_ids, accept, states, _ = worker._forward_batch_generation_dllm(fb, batch)
            for i, r in enumerate(reqs):
                if fdfo:
                    r.dllm_algo_state = states[i]
                    if accept[i] and emitted[i] is None:
                        emitted[i] = next_ids[i][len(hd[i]) :]
                        r.output_ids.extend(emitted[i])
                elif emitted[i] is None:
                    emitted[i] = next_ids[i].tolist()
                    r.output_ids.extend(emitted[i])
            if all(e is not None for e in emitted):
                break
        assert algo._reqs is None  # unbound after the call
        for i, r in enumerate(reqs):
            R = ref[i]
            state = core.new_state(R["params"], R["rng"])
            block = core.denoise_block(lambda t: block_logits(model, R["grid"], t), start[i : i + 1].clone(), [state])
            entries, R["forwards"] = core.trace_entries(state, R["forwards"])
            R["trace"] += entries
            R["grid"] += block[0].tolist()
            assert emitted[i] == block[0, len(hd[i]) :].tolist()
            grids[i] += fb.input_ids.view(2, B)[i].tolist()
    for r, R in zip(reqs, ref):
        trace = r.customized_info[sp.TRACE_KEY]
        assert trace == R["trace"] and len(trace) == len(r.output_ids) == 2 + 4 + (0 if r.rid == "r0" else 2)
        assert r._megadare_forwards == R["forwards"] == max(e[3] for e in trace)
        assert min(e[0] for e in trace[-4:]) > max(e[0] for e in trace[:-4])  # the 2nd block's steps follow
    trace0, trace1 = (r.customized_info[sp.TRACE_KEY] for r in reqs)
    assert all(e[2] == 0.0 for e in trace0)  # greedy: point-mass log-probs
    assert any(e[2] < 0 for e in trace1) and sorted(e[1] for e in trace1[-4:]) == [0, 1, 2, 3]  # 1 per step


def test_a_requests_sampling_settings_are_built_once(fake_sglang, monkeypatch):
    """sglang asks for a request's parameters at every run (FDFO: every forward) in ``init_step_state`` and again in
    ``max_steps``; they are built at its first block and kept on the request, the YAML's once at the start."""
    config = types.SimpleNamespace(
        block_size=B, mask_id=MASK, first_done_first_out_mode=True, algorithm_config={"steps_per_block": 2}
    )
    reqs = _fake_reqs([(0.9, 5, None, None), (1.0, 1, 7, {"megadare": {"steps_per_block": 4, "seed": 3}})])
    core = sp.BlockDenoiser(B, MASK, config.algorithm_config)  # the reference
    want = [
        core.params_for(0.9, 1.0, 5, None, None, "r0"),
        core.params_for(1.0, 1.0, 1, reqs[1].sampling_params.custom_params, 7, "r1"),
    ]
    built = []
    real_request_params = sp.request_params

    def counted(block_size, defaults, request=sp.RequestSampling()):
        built.append(request.rid or "defaults")
        return real_request_params(block_size, defaults, request)

    monkeypatch.setattr(sp, "request_params", counted)
    algo = sp.algorithm_class()(config)
    for _ in range(3):  # three runs: sglang's calls in each
        algo.bind_requests(reqs)
        assert algo.max_steps(B) == B + 1
        states = algo.init_step_state(types.SimpleNamespace(batch_size=2))
        assert [st.params for st in states] == want
        algo.bind_requests(None)
    assert built == ["defaults", "r0", "r1"]


def test_engine_spec_tensor_parallel_engines(monkeypatch):
    """rollout.engine_tp reaches sglang's tp_size; a built-in engine or too few GPUs per actor are config errors."""
    from megadare.config import load_config
    from megadare.errors import ConfigError
    from megadare.rollout.setup import engine_spec

    monkeypatch.setattr(se, "_import_sglang", lambda: types.SimpleNamespace())
    src, tok = types.SimpleNamespace(hf_dir="/ckpt/x"), types.SimpleNamespace(eos_token_id=1)
    spec = engine_spec(
        load_config(None, ["rollout.engine=sglang", "rollout.engine_tp=4", "rollout.engine_resources={num_gpus: 4}"]),
        src,
        tok,
    )
    assert spec.factory is se.build_sglang_engine and spec.kwargs["tp_size"] == 4
    with pytest.raises(ConfigError, match="num_gpus >= 4"):
        engine_spec(
            load_config(
                None, ["rollout.engine=sglang", "rollout.engine_tp=4", "rollout.engine_resources={num_gpus: 1}"]
            ),
            src,
            tok,
        )
    with pytest.raises(ConfigError, match="rollout.engine_tp=2"):
        engine_spec(load_config(None, ["rollout.engine_tp=2"]), src, tok)


def test_fp8_engines_start_from_a_block_fp8_export(monkeypatch, tmp_path):
    """rollout.fp8_weights: the engines' model_path is a block-fp8 export of the trainer's model (made once, reused),
    so the fp8 weights the sync sends match what the engine serves."""
    import json as _json

    from megadare.config import load_config
    from megadare.rollout.setup import engine_spec
    from tiny import write_tiny_hf

    monkeypatch.setattr(se, "_import_sglang", lambda: types.SimpleNamespace())
    hf = write_tiny_hf(tmp_path, "sdar", 0, num_hidden_layers=2)
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.fp8_weights=true", f"logging.run_dir={tmp_path}/run"])
    src, tok = types.SimpleNamespace(hf_dir=hf), types.SimpleNamespace(eos_token_id=1)
    path = engine_spec(cfg, src, tok).kwargs["model_path"]
    assert path == str(tmp_path / "run" / "engine_fp8")
    with open(f"{path}/config.json") as f:
        q = _json.load(f)["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128]
    stamp = (tmp_path / "run" / "engine_fp8" / "config.json").stat().st_mtime_ns
    assert engine_spec(cfg, src, tok).kwargs["model_path"] == path  # reused, not re-exported
    assert (tmp_path / "run" / "engine_fp8" / "config.json").stat().st_mtime_ns == stamp
