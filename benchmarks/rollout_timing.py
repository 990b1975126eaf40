"""The timing harness of benchmarks/rollout_throughput.py: the benchmark model shapes, the clock (wall time on CUDA,
process CPU time on a CPU), the per-engine forward clock, and the alternated rounds with their report lines (each
starts with ``rollout ``)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megadare.models import get_family
from megadare.rollout.engine import SamplingParams

SDAR_1_7B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    block_size=4,
    mask_token_id=151669,
    max_position_embeddings=32768,
)
CPU_SHAPES = {  # small models: the loop around the forward is what differs between engines
    "sdar": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        block_size=4,
        max_position_embeddings=4096,
    ),
    "llada": dict(d_model=256, n_heads=8, n_kv_heads=8, n_layers=4, mlp_hidden_size=768, max_sequence_length=4096),
    "dream": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
}
GPU_SHAPES = {
    "sdar": SDAR_1_7B,
    "llada": dict(
        d_model=4096,
        n_heads=32,
        n_kv_heads=32,
        n_layers=32,
        mlp_hidden_size=12288,
        vocab_size=126464,
        embedding_size=126464,
        mask_token_id=126336,
        max_sequence_length=4096,
    ),
    "dream": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        mask_token_id=151666,
        max_position_embeddings=4096,
    ),
}


# ---------------------------------------------------------------------------------------------- models
def build(family: str, gpu: bool, vocab: Optional[int] = None, layers: Optional[int] = None):
    """The family's hf/ model in a benchmark shape (random weights) and its arch."""
    fam = get_family(family)
    over = dict((GPU_SHAPES if gpu else CPU_SHAPES)[family])
    if vocab:
        over.update(vocab_size=vocab, mask_token_id=vocab - 1)
        if family == "llada":
            over["embedding_size"] = vocab
    if layers:
        over["n_layers" if family == "llada" else "num_hidden_layers"] = layers
    cfg = fam.tiny_config(**over)
    if gpu:
        with torch.device("cuda"):
            model = fam.hf_model(cfg).to(torch.bfloat16)
    else:
        model = fam.hf_model(cfg)
    return model.eval(), fam.arch(cfg)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def now() -> float:
    """The benchmark's clock: wall time on CUDA; on CPU the process's CPU time, so that a machine shared with other
    jobs (time spent descheduled) does not count against whichever engine happened to be running."""
    return time.perf_counter() if torch.cuda.is_available() else time.process_time()


class ForwardClock:
    """Times the model forwards of one engine (synchronising on CUDA) by wrapping the callable through which it
    runs them (``obj.attr``: the engine's forward method, a peer adapter's model); per-run counters."""

    def __init__(self, obj: Any, attr: str):
        self.calls, self.seconds = 0, 0.0
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            sync()
            t0 = now()
            out = inner(*args, **kwargs)
            sync()
            self.seconds += now() - t0
            self.calls += 1
            return out

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


# ---------------------------------------------------------------------------------------------- runs
@dataclass
class Runner:
    name: str
    run: Callable[[], int]  # decodes the workload, returns generated tokens
    clock: Optional[ForwardClock]
    results: list[dict] = field(default_factory=list)


def measure(runners: list[Runner], rounds: int) -> None:
    """Warm every runner once (one that fails is reported in a line and left out), then ``rounds`` alternated
    rounds; per round tokens/s and the forward split."""
    for r in list(runners):
        try:
            r.run()
        except Exception as e:  # noqa: BLE001 -- a broken runner must not hide the others' numbers
            print(f"rollout {r.name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); left out")
            runners.remove(r)
    for _ in range(rounds):
        for r in runners:
            if r.clock:
                r.clock.reset()
            sync()
            t0 = now()
            tokens = r.run()
            sync()
            dt = now() - t0
            fw = (r.clock.calls, r.clock.seconds) if r.clock else (0, 0.0)
            r.results.append({"tok_s": tokens / dt, "s": dt, "tokens": tokens, "forwards": fw[0], "forward_s": fw[1]})


def report(title: str, runners: list[Runner], ref: str, batch: int) -> None:
    print(f"rollout {title}; ratio: tok/s over {ref}'s")
    print(f"  {'engine':52s} {'tok/s':>10s} {'ms/forward':>11s} {'fwd/token':>10s} {'outside fwd':>12s} {'ratio':>7s}")
    med = {r.name: statistics.median(x["tok_s"] for x in r.results) for r in runners if r.results}
    for r in runners:
        if not r.results:
            continue
        ms = 1e3 * statistics.median(x["forward_s"] / max(x["forwards"], 1) for x in r.results)
        fpt = statistics.median(x["forwards"] / (x["tokens"] / batch) for x in r.results)
        outside = statistics.median(1 - x["forward_s"] / x["s"] for x in r.results)
        rel = med[r.name] / med[ref] if ref in med else float("nan")
        print(f"rollout {r.name:46s} {med[r.name]:10.1f} {ms:11.2f} {fpt:10.2f} {100 * outside:11.1f}% {rel:6.2f}x")


def engine_runner(
    name: str, engine: Any, clock: ForwardClock, prompts: list[list[int]], params: SamplingParams, chunk: int = 0
) -> Runner:
    """An engine's generate over the prompts (``chunk``: in calls of that many prompts, static batching)."""

    def run() -> int:
        parts = [prompts[i : i + chunk] for i in range(0, len(prompts), chunk)] if chunk else [prompts]
        return sum(len(t.response_ids) for part in parts for t in engine.generate(part, params))

    return Runner(name, run, clock)
