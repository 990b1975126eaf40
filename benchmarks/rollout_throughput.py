"""Built-in engine throughput: today's engine (a git ref, run from its source) against the current one, and
DARE's generate loops on the same model, in one process, rounds alternated.

    python benchmarks/rollout_throughput.py                       # GPU: SDAR-1.7B shape, bf16; CPU: small shapes
    python benchmarks/rollout_throughput.py --batch 32 --prompt 128 --new 256 --steps 4
    python benchmarks/rollout_throughput.py --family sdar llada dream --cache none prefix dual
    python benchmarks/rollout_throughput.py --peer-repo ~/DARE   # also DARE's generate functions (batched)
    python benchmarks/rollout_throughput.py --varied             # half the prompts end early: continuous batching
    python benchmarks/rollout_throughput.py --sampling-check     # one step's sampling at batch 32, vocab 151,936

Every result line starts with ``rollout `` (benchmarks/gpu_check.py keeps those). Per engine: tokens/s, ms per
model forward, forwards per generated token (batch-wide), the share of the time spent outside the model forward,
and the speed relative to the current engine. Time is wall time on CUDA and the process's CPU time on a CPU (a
shared machine's descheduled time does not count; with several torch threads it is their sum). Every engine
decodes the same prompts with the same model weights and decoder (temperature 1; SDAR: blocks of 4, static
low-confidence remasking; LLaDA: blocks of ``--full-block``, the same; Dream: DARE's rollout, one block over the
response with the linspace schedule and entropy ranking); ratios are medians over ``--rounds`` alternated rounds.

* today's engine: ``--baseline-ref`` (default: main before issue 27) is read with ``git show`` from this checkout
  and imported as a private copy (its hf/ model, sampling, step, editing, decoder and engine files: rollout_peers.py
  ``BASELINE_FILES``; the rest, ``engine.py``'s ``SamplingParams`` among them, is this checkout's), so any ref whose
  copy imports only what this checkout still has runs, HEAD included; another is refused in one line naming the
  file and the name. Nothing of it is kept in the package. ``--baseline-ref none`` skips it.
* DARE (``--peer-repo``: a checkout of yjyddq/DARE; never vendored): SDAR ``block_diffusion_generate``
  (opencompass/opencompass/models/sdar_generate.py) per prompt as shipped, and on the whole batch (it allocates its
  canvas for one prompt: that one line is patched); LLaDA
  ``generate_with_prefix_cache`` / ``generate_with_dual_cache`` (verl/workers/rollout/generate.py; the dual one
  without its ``torch.compile`` decorator, which needs the Fast-dLLM model class); Dream
  ``DreamGenerationMixin._sample`` (verl/workers/rollout/generation_utils.py, entropy). They call the same hf/
  model through a thin adapter that gives it the publishers' calling conventions and cache behaviour (HF
  ``DynamicCache`` concatenation; Fast-dLLM's per-row replacement for the dual cache). Modules of the peer files
  that their generate functions do not use (pandas, tqdm) are stubbed when absent.
* ``--varied``: 2 x batch prompts, half of which end in their first two blocks (EOS chosen from a greedy run),
  through the current engine as chunks of ``--batch`` prompts (static batching: a chunk waits for its longest
  row; its finished rows leave the batch), as chunks whose rows keep their slots to the end (no continuous
  batching: what the engine did before issue 27), as one call with ``max_batch=--batch`` (continuous batching: a
  finished row's slot takes the next prompt), and through today's engine in chunks.
* ``--sampling-check``: one ``dllm_step`` (temperature 1) on [32, 4, 151936] logits against the SDAR-1.7B LM head
  on the same 128 positions and an estimated SDAR-1.7B forward of them (one layer measured, x28), today's step on
  the same logits for reference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from megadare.models import get_family
from megadare.rollout.dllm_step import BlockState, Streams, dllm_step
from megadare.rollout.engine import SamplingParams
from megadare.rollout.native import NativeEngine, NativeSettings

from rollout_peers import BASELINE_REF, baseline_model, load_baseline, peer_runners
from rollout_timing import SDAR_1_7B, ForwardClock, Runner, build, engine_runner, measure, now, report, sync


# ---------------------------------------------------------------------------------------------- workloads
def timed_engines(args, cache: str, model, arch, base, **over) -> dict[str, tuple[Any, ForwardClock]]:
    """The current engine (``compiled`` too with ``--compile``; today's from ``base``) on ``model``, each with the
    clock of its forwards."""
    dev = "cuda" if args.gpu else "cpu"
    out = {}
    for name, comp in (("new", False), ("compiled", True)) if args.compile else (("new", False),):
        eng = NativeEngine(
            model,
            arch,
            eos_token_id=args.eos,
            device=dev,
            settings=NativeSettings(full_attention_cache=cache, compile=comp, **over),
        )
        out[name] = (eng, ForwardClock(eng, "forward"))
    if base is not None:
        kw = {"full_attention_cache": cache} if arch.attention != "block_causal" else {}
        old = base.native.NativeEngine(baseline_model(base, model), arch, eos_token_id=args.eos, device=dev, **kw)
        out["old"] = (old, ForwardClock(old, "_forward" if hasattr(old, "_forward") else "forward"))  # renamed later
    return out


def decoder(family: str, args) -> SamplingParams:
    """SDAR: blocks of 4; LLaDA: blocks of ``--full-block``, as many tokens per step; Dream: DARE's Dream rollout
    (``_sample``: one block over the response, linspace schedule, entropy ranking) at that rate."""
    if family == "dream":
        steps = args.new * min(args.steps, args.full_block) // args.full_block
        return SamplingParams(
            max_new_tokens=args.new,
            block_size=args.new,
            steps_per_block=steps,
            schedule="linspace",
            confidence="entropy",
            temperature=1.0,
            stop_at_eos=False,
            seed=1,
        )
    block = 4 if family == "sdar" else args.full_block
    return SamplingParams(
        max_new_tokens=args.new,
        block_size=block,
        steps_per_block=min(args.steps, block),
        algorithm=args.algorithm,
        temperature=1.0,
        stop_at_eos=False,
        seed=1,
    )


def fixed_workload(args, family: str, cache: str, base) -> None:
    """Equal-length prompts, every response max_new_tokens long: today's engine, the current one, DARE's loop."""
    model, arch = build(family, args.gpu, args.vocab, args.layers)
    params = decoder(family, args)
    block = params.block_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, arch.vocab_size - 3, (args.batch, args.prompt), generator=g).tolist()
    eng = timed_engines(args, cache, model, arch, base)
    runners = [engine_runner("megadare (this checkout)", *eng["new"], prompts, params)]
    if "compiled" in eng:
        runners.append(engine_runner("megadare (this checkout, compile=True)", *eng["compiled"], prompts, params))
    if "old" in eng:
        runners.insert(0, engine_runner(f"megadare today ({args.baseline_ref})", *eng["old"], prompts, params))
    if args.peer_repo:
        peers = peer_runners(args.peer_repo, family, cache, model, arch, prompts, params)
        runners += [r for r in peers if not (args.peer_batched_only and "per prompt" in r.name)]
    measure(runners, args.rounds)
    mode = f", {cache} cache" if arch.attention != "block_causal" else ""
    rule = params.confidence if family == "dream" else params.algorithm
    report(
        f"{family}{mode}: batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, block {block}, "
        f"{params.steps_per_block} steps/block, {params.schedule}, {rule}, T=1, vocab {arch.vocab_size}",
        runners,
        "megadare (this checkout)",
        args.batch,
    )


def varied_prompts(engine: NativeEngine, arch, args, params: SamplingParams) -> tuple[list[list[int]], int]:
    """2 x batch prompts, half of whose greedy responses hold the returned EOS id in their first two blocks and
    half never: a workload where half the prompts end early."""
    g = torch.Generator().manual_seed(1)
    pool = torch.randint(0, arch.vocab_size - 3, (32 * args.batch, args.prompt), generator=g).tolist()
    free = engine.generate(pool, replace(params, stop_at_eos=False))
    early = 2 * params.block_size
    counts = torch.bincount(
        torch.tensor([t for tr in free for t in tr.response_ids[:early]]), minlength=arch.vocab_size
    )
    for eos in counts.argsort(descending=True).tolist():
        short = [p for p, tr in zip(pool, free) if eos in tr.response_ids[:early]]
        long = [p for p, tr in zip(pool, free) if eos not in tr.response_ids]
        if len(short) >= args.batch and len(long) >= args.batch:
            mixed = [x for pair in zip(short[: args.batch], long[: args.batch]) for x in pair]
            return mixed, eos
    raise SystemExit("varied workload: no EOS id splits the prompts; try another --prompt / --new")


def varied_workload(args, base) -> None:
    """Continuous batching on a workload where half the prompts end early (SDAR)."""
    model, arch = build("sdar", args.gpu, args.vocab, args.layers)
    greedy = SamplingParams(
        max_new_tokens=args.new, block_size=4, steps_per_block=min(args.steps, 4), algorithm=args.algorithm
    )
    probe = NativeEngine(model, arch, eos_token_id=-1, device="cuda" if args.gpu else "cpu")
    prompts, args.eos = varied_prompts(probe, arch, args, greedy)
    eng = timed_engines(args, "none", model, arch, base)
    eng["keep"] = timed_engines(args, "none", model, arch, None)["new"]
    cont = timed_engines(args, "none", model, arch, None, max_batch=args.batch)["new"]
    runners = [
        engine_runner(f"continuous (max_batch {args.batch}, one call)", *cont, prompts, greedy),
        engine_runner(f"static (calls of {args.batch})", *eng["new"], prompts, greedy, chunk=args.batch),
        slot_keeping_runner(f"static, rows keep slots (calls of {args.batch})", eng["keep"], prompts, greedy, args),
    ]
    if "old" in eng:
        runners.append(
            engine_runner(
                f"today ({args.baseline_ref}), calls of {args.batch}", *eng["old"], prompts, greedy, chunk=args.batch
            )
        )
    measure(runners, args.rounds)
    report(
        f"sdar varied lengths: {len(prompts)} prompts (half end in their first 2 blocks, EOS {args.eos}), "
        f"prompt {args.prompt}, up to {args.new} new tokens, greedy",
        runners,
        runners[0].name,
        args.batch,
    )


def slot_keeping_runner(name: str, timed: tuple, prompts: list[list[int]], params: SamplingParams, args) -> Runner:
    """Static batching without continuous batching, as before issue 27: every row of a call of ``--batch``
    prompts keeps its slot until the call's longest row ends. Each call holds a row that never ends early, so
    that is decoding every row to ``max_new_tokens`` (``stop_at_eos`` off); the tokens counted are the ones up
    to each response's end (checked once: the same tokens as the call that stops at EOS)."""
    engine, clock = timed
    chunks = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    ends = [t.response_ids for c in chunks for t in engine.generate(c, params)]
    useful = sum(len(r) for r in ends)

    def run() -> int:
        full = [t.response_ids for c in chunks for t in engine.generate(c, replace(params, stop_at_eos=False))]
        if any(f[: len(e)] != e for f, e in zip(full, ends)):
            raise RuntimeError("rows decoded to max_new_tokens differ from the same rows stopped at EOS")
        return useful

    return Runner(name, run, clock)


def forward_estimate(args, n: int, B: int) -> float:
    """Seconds of one SDAR-1.7B-shape block forward of [n, B] queries over 128 cached positions: embedding, LM
    head and one layer measured, the other 27 layers counted as that one (a 28-layer fp32 copy would not fit)."""
    times = {}
    for layers in (1, 2):
        model, arch = build("sdar", args.gpu, layers=layers) if args.gpu else build_shape(SDAR_1_7B, layers)
        eng = NativeEngine(model, arch, eos_token_id=-1, device="cuda" if args.gpu else "cpu")
        cache = eng.kv_cache(n, 256)
        cols = 128 + torch.arange(B, device=eng.device).expand(n, B)
        cache.bind(0, cols, 128 + B)
        ids = torch.randint(0, 1000, (n, B), device=eng.device)
        allowed = torch.ones(n, 1, 1, 128 + B, dtype=torch.bool, device=eng.device)
        runs = []
        for _ in range(args.rounds + 1):
            sync()
            t0 = now()
            with torch.no_grad():
                eng.forward(ids, allowed, cols, cache)
            sync()
            runs.append(now() - t0)
        times[layers] = statistics.median(runs[1:])
        del model, eng, cache
    return times[1] + 27 * (times[2] - times[1])


def build_shape(shape: dict, layers: int):
    fam = get_family("sdar")
    cfg = fam.tiny_config(**{**shape, "num_hidden_layers": layers})
    return fam.hf_model(cfg).eval(), fam.arch(cfg)


def sampling_check(args, base) -> None:
    """One step's sampling and commit selection at batch 32, vocab 151,936 against the LM head alone and an
    SDAR-1.7B forward."""
    dev = "cuda" if args.gpu else "cpu"
    n, B, V, H = 32, 4, 151936, 2048
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(n, B, V, generator=g, device=dev) * 3
    tokens = torch.full((n, B), V - 1, device=dev)
    params = SamplingParams(block_size=B, steps_per_block=4, temperature=1.0)
    streams = Streams.of(range(n), device=dev)
    hidden = torch.randn(n * B, H, device=dev, dtype=logits.dtype)
    head = torch.randn(V, H, device=dev, dtype=logits.dtype) * 0.02
    fns = {
        "dllm_step (this checkout)": lambda: dllm_step(
            logits, BlockState(tokens, tokens == V - 1), 0, params, streams, V - 1
        ),
        "LM head [128 x 2048] x [2048 x 151936]": lambda: torch.nn.functional.linear(hidden, head),
    }
    if base is not None:
        gens = [torch.Generator().manual_seed(i) for i in range(n)]
        fns[f"dllm_step today ({args.baseline_ref}, host)"] = lambda: base.dllm_step.dllm_step(
            logits.float().cpu(), tokens.cpu(), (tokens == V - 1).cpu(), 0, params, gens, mask_token_id=V - 1
        )
    times = {k: [] for k in fns}
    for _ in range(args.rounds + 1):
        for k, fn in fns.items():
            sync()
            t0 = now()
            fn()
            sync()
            times[k].append(now() - t0)
    logits = hidden = head = None  # free the device memory before the forward estimate
    fwd_ms = 1e3 * forward_estimate(args, n, B)
    print(
        f"rollout sampling check: batch {n} x block {B}, vocab {V}, temperature 1, {dev}; an SDAR-1.7B forward "
        f"of these {n * B} queries: {fwd_ms:.0f} ms (1 layer measured, x28)"
    )
    head_ms = 1e3 * statistics.median(times["LM head [128 x 2048] x [2048 x 151936]"][1:])
    for k, ts in times.items():
        ms = 1e3 * statistics.median(ts[1:])
        print(
            f"rollout sampling {k:44s} {ms:10.1f} ms  {100 * ms / head_ms:6.1f}% of the LM head  "
            f"{100 * ms / fwd_ms:6.1f}% of the forward"
        )


def main() -> None:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", nargs="+", default=["sdar"], choices=["sdar", "llada", "dream"])
    ap.add_argument(
        "--cache",
        nargs="+",
        default=["none"],
        choices=["none", "prefix", "dual"],
        help="full-attention families: Fast-dLLM cache modes to run",
    )
    ap.add_argument("--batch", type=int, default=32 if gpu else 4)
    ap.add_argument("--prompt", type=int, default=128 if gpu else 32)
    ap.add_argument("--new", type=int, default=256 if gpu else 32)
    ap.add_argument("--steps", type=int, default=4, help="denoising steps per block (at most the block size)")
    ap.add_argument("--full-block", type=int, default=8, help="block size of the full-attention families")
    ap.add_argument("--algorithm", default="low_confidence_static")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the shape's)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    ap.add_argument("--rounds", type=int, default=3, help="alternated measured rounds after one warm-up")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also the current engine with compile=True (its first calls compile: the warm-up round)",
    )
    ap.add_argument("--baseline-ref", default=BASELINE_REF, help="git ref of today's engine ('none': skip it)")
    ap.add_argument("--peer-repo", default=None, help="a DARE checkout: also time its generate functions")
    ap.add_argument(
        "--peer-batched-only", action="store_true", help="leave out DARE's per-prompt loop (slow on a large shape)"
    )
    ap.add_argument("--varied", action="store_true", help="continuous batching on a varied-length workload")
    ap.add_argument("--sampling-check", action="store_true", help="one step's sampling at vocab 151,936, batch 32")
    args = ap.parse_args()
    args.gpu, args.eos = gpu, -1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.cuda.get_device_name() if gpu else f"CPU ({torch.get_num_threads()} threads)"
    clock = "wall time" if gpu else "process CPU time"
    print(f"device: {device}; torch {torch.__version__}; {args.rounds} rounds alternated, medians of {clock}")
    base = load_baseline(args.baseline_ref) if args.baseline_ref != "none" else None
    if args.sampling_check:
        sampling_check(args, base)
    if args.varied:
        varied_workload(args, base)
    if not (args.sampling_check or args.varied):
        for family in args.family:
            for cache in args.cache if family != "sdar" else ["none"]:
                fixed_workload(args, family, cache, base)
        weight_update(args)


def weight_update(args) -> None:
    """The engine's weight-update bandwidth for a full state dict pushed through ``update_weights``."""
    model, arch = build("sdar", args.gpu, args.vocab, args.layers)
    eng = NativeEngine(model, arch, eos_token_id=-1, device="cuda" if args.gpu else "cpu")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    sync()
    t0 = time.perf_counter()
    eng.update_weights(sd.items(), version=1)
    sync()
    print(f"weight update (in-process, {nbytes / 2**20:.0f} MiB): {nbytes / (time.perf_counter() - t0) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
