"""The numeric steps of benchmarks/gpu_steps.py: ``parity`` (Megatron models against a float64 hf/ reference),
``attention`` (the attention kernels and their compiled forms against SDPA) and ``engine`` (the built-in rollout
engine on the device against the CPU)."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from gpu_step_report import Report, one_line_error, rel

BLOCK = 4
# head_dim 64 shapes (the GPU attention kernels' own path) for the parity and attention checks on a GPU
QWEN_MEDIUM = dict(  # the Qwen3-layout families (SDAR, SDAR-MoE, LLaDA2) share it
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    mask_token_id=4095,
)
MEDIUM = {
    "sdar": QWEN_MEDIUM,
    "sdar_moe": {**QWEN_MEDIUM, "moe_intermediate_size": 256},
    "llada": dict(
        d_model=512,
        n_heads=8,
        n_kv_heads=8,
        n_layers=2,
        mlp_hidden_size=1024,
        vocab_size=4090,
        embedding_size=4096,
        mask_token_id=4095,
    ),
    "llada2": {**QWEN_MEDIUM, "num_hidden_layers": 3, "moe_intermediate_size": 256},
    "dream": dict(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        mask_token_id=4095,
        pad_token_id=4094,
    ),
}
# bf16 verdict: the Megatron model's distance to the float64 reference may be at most BF16_FACTOR times the
# distance of the plain hf/ model run in bf16 on the CPU (what bf16 rounding alone does to this model on these
# inputs), plus BF16_FLOOR. A different but correct kernel rounds in another order: errors of the same size, not
# the same values (factor 2 leaves room for that); a real bug (mask, RoPE, routing) is O(1) relative.
BF16_FACTOR, BF16_FLOOR = 2.0, 1e-3
FP32_REL = 1e-4


# ============================================================================================== parity
def make_case(name: str, root: str, seed: int, medium: bool) -> dict:
    """A perturbed random HF checkpoint of the family, inputs holding mask tokens, the float64 CPU reference logits
    of its hf/ model, and what bf16 alone does to that model (the hf/ model in bf16 on the CPU)."""
    from megadare.models import build_hf_model, get_family, perturb_, save_hf_model
    from megadare.models.attention import family_mask

    torch.manual_seed(seed)
    fam = get_family(name)
    over = dict(MEDIUM[name]) if medium else {}
    if "block_size" in fam.tiny_config():
        over["block_size"] = BLOCK
    cfg = fam.tiny_config(**over)
    model = perturb_(build_hf_model(cfg).eval())
    hf_dir = os.path.join(root, name)
    save_hf_model(model, cfg, hf_dir)
    arch = fam.arch(cfg)
    S = 128 if medium else 16
    ids = torch.randint(0, arch.vocab_size, (2, S))
    if arch.mask_token_id < arch.vocab_size:
        ids[:, S // 2 : S // 2 + 3] = arch.mask_token_id
    mask = family_mask(arch)
    with torch.no_grad():
        ref = model.double()(ids, attention_mask=mask.dense(S, S)).double()
        cpu_bf16 = model.to(torch.bfloat16)(ids, attention_mask=mask.dense(S, S))
    return {
        "name": name,
        "hf_dir": hf_dir,
        "arch": arch,
        "ids": ids,
        "mask": mask,
        "ref": ref,
        "hf_bf16_cpu_rel": rel(cpu_bf16, ref),
    }


def verdict(dtype: str, r: float, case: dict) -> dict:
    if dtype == "fp32":
        return {"ok": r < FP32_REL, "value": r, "tol": FP32_REL}
    tol = BF16_FACTOR * case["hf_bf16_cpu_rel"] + BF16_FLOOR
    return {"ok": r <= tol, "value": r, "tol": tol, "hf_bf16_cpu_rel": case["hf_bf16_cpu_rel"]}


def megatron_logits(case: dict, dtype: str, backend: str, mask=None, position_ids=None, ids=None) -> torch.Tensor:
    from megadare.convert.hf_megatron import load_hf_into_model
    from megadare.models import gpt
    from megadare.trainer.forward import forward_logits

    arch = case["arch"]
    chunks = gpt.build_model_chunks(arch, gpt.transformer_config(arch, dtype), attention_backend=backend)
    load_hf_into_model(chunks, case["hf_dir"])
    ids = case["ids"] if ids is None else ids
    return forward_logits(chunks, ids, arch.vocab_size, case["mask"] if mask is None else mask, position_ids)


def step_parity(rep: Report, args) -> None:
    """Per family: the Megatron model (world size 1; NCCL on a GPU) and the hf/ model on the device, fp32 and bf16,
    against the float64 hf/ reference on the CPU."""
    from megadare.models import load_hf_model
    from megadare.parallel import destroy_distributed, init_distributed

    dev = args.device
    init_distributed()
    root = tempfile.mkdtemp(prefix="gpu_check_parity_")
    try:
        for i, name in enumerate(args.families):
            try:
                case = make_case(name, root, 100 + i, medium=not args.tiny)
            except Exception as e:  # noqa: BLE001
                rep.add(f"{name} checkpoint", False, error=one_line_error(e))
                continue
            S = case["ids"].shape[1]
            for dtype, tdt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):

                def hf(tdt=tdt, dtype=dtype):
                    model = load_hf_model(case["hf_dir"], dtype=tdt, device=dev)
                    with torch.no_grad():
                        out = model(case["ids"].to(dev), attention_mask=case["mask"].dense(S, S, device=dev))
                    return verdict(dtype, rel(out, case["ref"]), case)

                rep.attempt(f"{name} hf/ {dtype} on {dev}", hf)
                rep.attempt(
                    f"{name} megatron sdpa {dtype} on {dev}",
                    lambda dtype=dtype: verdict(dtype, rel(megatron_logits(case, dtype, "sdpa"), case["ref"]), case),
                )
    finally:
        destroy_distributed()
        shutil.rmtree(root, ignore_errors=True)


# ============================================================================================== attention
def packed_block_diffusion(arch, rows: int, n: int, seed: int):
    """Two samples x_t ++ x_0 packed per row (the block-diffusion training mask): ids, positions, the MaskSpec."""
    from megadare.models.attention import MaskSpec

    g = torch.Generator().manual_seed(seed)
    half = [n // 2 - 4, n // 2 + 4]
    ids, pos, seg, stream = [], [], [], []
    for _ in range(rows):
        i, p, s, t = [], [], [], []
        for k, L in enumerate(half):
            x0 = torch.randint(0, arch.vocab_size - 1, (L // 2,), generator=g)
            xt = x0.clone()
            xt[torch.rand(L // 2, generator=g) < 0.5] = arch.mask_token_id % arch.vocab_size
            i += [xt, x0]
            p += [torch.arange(L // 2)] * 2
            s += [torch.full((L,), k)]
            t += [torch.zeros(L // 2, dtype=torch.long), torch.ones(L // 2, dtype=torch.long)]
        ids.append(torch.cat(i))
        pos.append(torch.cat(p))
        seg.append(torch.cat(s))
        stream.append(torch.cat(t))
    ids, pos, seg, stream = (torch.stack(x) for x in (ids, pos, seg, stream))
    spec = MaskSpec("block_diffusion", block_size=BLOCK, segment_ids=seg, position_ids=pos, stream_ids=stream)
    return ids, pos, spec


def exact_attention(q, k, v, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T scale, masked) v in float64 (GQA: each kv head serves H/G query heads)."""
    H, G = q.shape[1], k.shape[1]
    k, v = (t.double().repeat_interleave(H // G, dim=1) for t in (k, v))
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale
    return torch.einsum("bhqk,bhkd->bhqd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def _kernels(rep: Report, dev: str) -> None:
    """flex == sdpa == the float64 reference on the training mask (packed x_t ++ x_0) and the inference mask
    (block-causal, queries of one block after a KV-cached prefix)."""
    from megadare.models.attention import MaskSpec, flex_attention, sdpa_attention

    g = torch.Generator().manual_seed(0)
    seg = torch.cat([torch.zeros(2, 96, dtype=torch.long), torch.ones(2, 160, dtype=torch.long)], dim=1)
    pos = torch.cat([torch.arange(48).repeat(2), torch.arange(80).repeat(2)]).repeat(2, 1)
    stream = torch.cat([torch.zeros(48), torch.ones(48), torch.zeros(80), torch.ones(80)]).long().repeat(2, 1)
    cases = {
        "train: packed block diffusion": (
            MaskSpec("block_diffusion", block_size=BLOCK, segment_ids=seg, position_ids=pos, stream_ids=stream),
            256,
            256,
        ),
        "infer: block-causal after a 124-token cache": (
            MaskSpec("block_causal", block_size=BLOCK, q_offset=124),
            4,
            128,
        ),
    }
    for name, (spec, Q, K) in cases.items():
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            q = torch.randn(2, 8, Q, 64, generator=g).to(dev, dtype)
            k, v = (torch.randn(2, 4, K, 64, generator=g).to(dev, dtype) for _ in range(2))
            allowed = spec.dense(Q, K, 2).to(dev)
            ref = exact_attention(q, k, v, allowed, 0.125)
            backends = [("sdpa", lambda: sdpa_attention(q, k, v, allowed, 0.125))]
            if dtype == torch.bfloat16 or dev != "cuda":  # on a GPU each dtype is a compile (~20 s): bf16
                backends.append(("flex", lambda: flex_attention(q, k, v, spec.to(dev), 0.125)))
            for backend, fn in backends:
                rep.attempt(
                    f"kernel {backend} {name} {str(dtype)[6:]}",
                    lambda fn=fn, tol=tol: (lambda d: {"ok": d < tol, "value": d, "tol": tol})(
                        float((fn().double() - ref).abs().max())
                    ),
                )


def _compiles(rep: Report, dev: str) -> None:
    """Compiled FlexAttention over 10 micro-batches of each mask structure with fresh MaskSpecs: one graph per
    structure (a recompile per micro-batch would reach dynamo's limit and fall back to the unfused kernel)."""
    from torch._dynamo.utils import counters

    from megadare.models.attention import MaskSpec, flex_attention

    if dev != "cuda":
        rep.add("flex compiled graphs over 30 micro-batches", None, "eager on CPU (compiled only on CUDA)")
        return
    unique0 = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(1)
    for i in range(10):
        seg = torch.cumsum(torch.rand(2, 256, generator=g) < 0.02, dim=1)
        for spec in (
            MaskSpec("block_causal", block_size=BLOCK, segment_ids=seg, position_ids=torch.arange(256).repeat(2, 1)),
            MaskSpec("block_causal", block_size=BLOCK, q_offset=4 * i),
            MaskSpec("bidirectional", segment_ids=seg),
        ):
            q = torch.randn(2, 8, 256, 64, device=dev, dtype=torch.bfloat16)
            flex_attention(q, q, q, spec.to(dev), 0.125)
    graphs = counters["stats"]["unique_graphs"] - unique0
    rep.add("flex compiled graphs over 30 micro-batches (3 structures)", graphs <= 3, graphs)


def step_attention(rep: Report, args) -> None:
    """Kernels (flex, sdpa vs float64), flex's compile count, and a Megatron model (SDAR) with megatron's local
    attention vs sdpa vs flex on the training and the inference mask (fp32 logits; flex's in bf16 on a GPU, where
    each compile costs time, against sdpa in bf16)."""
    from megadare.parallel import destroy_distributed, init_distributed

    dev = args.device
    _kernels(rep, dev)
    _compiles(rep, dev)
    init_distributed()
    root = tempfile.mkdtemp(prefix="gpu_check_attn_")
    try:
        case = make_case("sdar", root, 7, medium=not args.tiny)
        ids, pos, spec = packed_block_diffusion(case["arch"], 2, 96 if args.tiny else 256, 3)
        S = ids.shape[1]
        masks = {"train (packed x_t ++ x_0)": (spec, pos, ids), "infer (block-causal)": (case["mask"], None, None)}
        runs = [("local", "fp32"), ("sdpa", "fp32")] + ([("flex", "bf16"), ("sdpa", "bf16")] if dev == "cuda" else [])
        for mname, (m, p, x) in masks.items():
            outs = {}
            for b, dtype in runs:
                n = (x if x is not None else case["ids"]).shape[1]
                mm = ~m.dense(n, n, 2) if b == "local" else m  # megatron's own convention
                try:
                    outs[b, dtype] = megatron_logits(case, dtype, b, mask=mm, position_ids=p, ids=x)
                except Exception as e:  # noqa: BLE001
                    rep.add(f"megatron {b} {dtype} {mname}", False, error=one_line_error(e))
            for b, dtype in [r for r in runs if r[0] != "sdpa" and r in outs and ("sdpa", r[1]) in outs]:
                r, tol = rel(outs[b, dtype], outs["sdpa", dtype]), FP32_REL if dtype == "fp32" else 2e-2
                rep.add(f"megatron {b} == sdpa, {mname}, {dtype} logits", r < tol, r, tol=tol, seq=S)
    finally:
        destroy_distributed()
        shutil.rmtree(root, ignore_errors=True)


# ============================================================================================== engine
def step_engine(rep: Report, args) -> None:
    """The built-in engine on the device vs on the CPU (greedy tokens), and cached vs uncached on the device."""
    from megadare.models import build_hf_model, get_family
    from megadare.rollout.engine import SamplingParams
    from megadare.rollout.native import NativeEngine, NativeSettings

    dev = args.device
    prompts = [[5, 17, 99, 3, 42, 7], [11, 2], [8, 8, 8, 8, 21, 60, 61, 62, 63]]
    params = SamplingParams(max_new_tokens=12, block_size=BLOCK, steps_per_block=4, stop_at_eos=False)

    def model_of(family):
        torch.manual_seed(0)
        fam = get_family(family)
        cfg = fam.tiny_config(**({"block_size": BLOCK} if "block_size" in fam.tiny_config() else {}))
        m = build_hf_model(cfg)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        return m, fam.arch(cfg)

    for family in args.families:

        def run(family=family):
            # float32 on both devices: a greedy token is an argmax, and the engine's default on CUDA (bfloat16)
            # flips near-ties of a random tiny model; its bfloat16 agreement is the measured row below
            m, arch = model_of(family)
            ref = NativeEngine(m, arch, eos_token_id=253, device="cpu").generate(prompts, params)
            fp32 = {"device": dev, "dtype": torch.float32}
            got = NativeEngine(model_of(family)[0], arch, eos_token_id=253, **fp32).generate(prompts, params)
            plain = NativeEngine(
                model_of(family)[0], arch, eos_token_id=253, settings=NativeSettings(use_cache=False), **fp32
            ).generate(prompts, params)
            same = sum(a.response_ids == b.response_ids for a, b in zip(ref, got))
            same_nc = sum(a.response_ids == b.response_ids for a, b in zip(got, plain))
            return {
                "ok": same == same_nc == len(prompts),
                "value": f"{same}/{len(prompts)} == CPU",
                "cached_eq_uncached": f"{same_nc}/{len(prompts)}",
            }

        def run_bf16(family=family):
            m, arch = model_of(family)
            ref = NativeEngine(m, arch, eos_token_id=253, device="cpu").generate(prompts, params)
            got = NativeEngine(model_of(family)[0], arch, eos_token_id=253, device=dev, dtype=torch.bfloat16).generate(
                prompts, params
            )
            agree = sum(x == y for a, b in zip(ref, got) for x, y in zip(a.response_ids, b.response_ids))
            return {"ok": None, "value": f"{agree}/{sum(len(a.response_ids) for a in ref)} tokens == CPU float32"}

        def run_grouped(family=family):
            # MoE experts as grouped GEMMs (no host read per layer) against the expert-by-expert loop, bf16
            m, arch = model_of(family)
            grouped = NativeEngine(m, arch, eos_token_id=253, device=dev, dtype=torch.bfloat16)
            loop = NativeEngine(model_of(family)[0], arch, eos_token_id=253, device=dev, dtype=torch.bfloat16)
            loop.model.unstack_experts()
            a, b = grouped.generate(prompts, params), loop.generate(prompts, params)
            agree = sum(x == y for s, t in zip(a, b) for x, y in zip(s.response_ids, t.response_ids))
            ran = "grouped GEMMs ran" if grouped.grouped_experts else "grouped GEMMs do not run here: loop only"
            return {"ok": None, "value": f"{agree}/{sum(len(t.response_ids) for t in b)} tokens == loop; {ran}"}

        rep.attempt(f"engine {family} greedy float32 on {dev}", run)
        rep.attempt(f"engine {family} greedy bfloat16 on {dev} (measured)", run_bf16)
        if get_family(family).arch(get_family(family).tiny_config()).is_moe:
            rep.attempt(f"engine {family} grouped MoE experts bfloat16 on {dev} (measured)", run_grouped)
