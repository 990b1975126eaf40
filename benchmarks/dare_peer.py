"""The peer of benchmarks/train_throughput.py: the publisher's HF SDAR model (``modeling_sdar.py`` of a user's DARE
checkout, never copied into this repo) trained on DARE's loss path, in its own process.

DARE's block-diffusion SFT step (verl/trainer/sdar_fsdp_sft_trainer.py ``_compute_loss_and_backward`` +
``training_step``): ``model(input_ids, position_ids, labels, bd_noisy_input_ids, bd_target_mask, bd_p_mask)`` builds
x_t ++ x_0 and the flex-attention block mask, runs the trunk, keeps the hidden states of the masked x_t positions
(``logits_to_keep``), and scores them -- on a GPU with its Triton fused linear cross entropy, on CPU with
``return_block_diffusion_token_loss=True`` (its own unfused branch: ``lm_head`` on the kept positions,
``F.cross_entropy / p_mask``); then backward, ``clip_grad_norm_``, ``AdamW.step``.

The publisher's file uses CUDA-only pieces. Stand-ins, named as such and only for those:
``flash_attn.ops.triton.layer_norm.rms_norm_fn`` (Triton) is the publisher's own commented-out eager RMSNorm;
``fused_linear_diffusion_cross_entropy`` (Triton) is a module whose loss raises if called (the CPU path never calls
it); ``fused_flex_attention`` (FlexAttention has no backward on CPU) is SDPA under the same mask, the block mask's
own ``mask_mod`` evaluated densely -- what megadare's CPU attention does too. The file targets transformers 4.52
(``config.json``): run this with the DARE environment's python (``--peer-python``).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import sys
import time
import types

import torch

MODEL_DIR = os.path.join("models", "SDAR-1dot7B-Chat")
PKG = "dare_sdar_peer"


def _rms_norm_fn(x, weight, bias=None, eps=1e-6, **_):
    """CPU stand-in for flash_attn's Triton rms_norm_fn: the eager code the publisher left commented out."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _install_standins() -> None:
    for name in ("flash_attn", "flash_attn.ops", "flash_attn.ops.triton", "flash_attn.ops.triton.layer_norm"):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers probes it; no distribution
            sys.modules[name] = mod
    sys.modules["flash_attn.ops.triton.layer_norm"].rms_norm_fn = _rms_norm_fn
    fused = types.ModuleType(f"{PKG}.fused_linear_diffusion_cross_entropy")

    class FusedLinearDiffusionCrossEntropyLoss(torch.nn.Module):  # Triton-only in the publisher's file
        def __init__(self, *a, **k):
            super().__init__()

        def forward(self, *a, **k):
            raise RuntimeError(
                "the publisher's fused linear cross entropy is Triton/CUDA only; on CPU DARE's path "
                "is return_block_diffusion_token_loss=True"
            )

    fused.FusedLinearDiffusionCrossEntropyLoss = FusedLinearDiffusionCrossEntropyLoss
    sys.modules[fused.__name__] = fused


_DENSE: dict = {}


def _sdpa_flex_standin(query, key, value, attention_mask, enable_gqa=True, scale=None, return_lse=False, **_):
    """CPU stand-in for the publisher's ``fused_flex_attention``: SDPA with the BlockMask's mask_mod made dense
    (once per forward: every layer passes the same BlockMask)."""
    from torch.nn.attention.flex_attention import create_mask

    if _DENSE.get("of") is not attention_mask:
        B, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
        _DENSE.update(
            of=attention_mask, mask=create_mask(attention_mask.mask_mod, B, None, q_len, kv_len, device=query.device)
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=_DENSE["mask"], scale=scale, enable_gqa=enable_gqa
    )
    return (out, None) if return_lse else out


def load_modeling(repo: str):
    """The publisher's ``modeling_sdar`` and ``configuration_sdar`` modules from the checkout ``repo``."""
    d = os.path.join(os.path.abspath(repo), MODEL_DIR)
    if not os.path.isfile(os.path.join(d, "modeling_sdar.py")):
        raise SystemExit(f"--peer-repo {repo}: no {MODEL_DIR}/modeling_sdar.py (a DARE checkout: yjyddq/DARE)")
    _install_standins()
    pkg = types.ModuleType(PKG)
    pkg.__path__ = [d]
    sys.modules[PKG] = pkg
    modeling = importlib.import_module(f"{PKG}.modeling_sdar")
    modeling.fused_flex_attention = _sdpa_flex_standin
    return modeling, importlib.import_module(f"{PKG}.configuration_sdar"), d


def build(repo: str, ckpt: str):
    """The publisher's SDARForCausalLM: its own config.json with the checkpoint's shape, the checkpoint's weights."""
    from safetensors.torch import load_file

    modeling, configuration, d = load_modeling(repo)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(ckpt, "config.json")) as f:
        shape = json.load(f)
    keys = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "mask_token_id",
        "block_size",
        "tie_word_embeddings",
        "rope_theta",
        "rms_norm_eps",
        "max_position_embeddings",
    )
    cfg.update({k: shape[k] for k in keys}, torch_dtype="float32", use_cache=False)
    cfg.pop("auto_map", None)
    config = configuration.SDARConfig(**cfg)
    config._attn_implementation = "flex_attention"
    model = modeling.SDARForCausalLM(config).float()
    state = {}
    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(ckpt, name)))
    model.load_state_dict(state, strict=True)
    return model.train()


def dare_batch(rows: list[dict]) -> dict:
    """DARE's step inputs from megadare's block rows (x_t ++ x_0 of one sample each): input_ids x_0, labels
    (-100 on the prompt), position ids, and the stored corruption (noisy ids, target mask, p_mask = t)."""
    x0 = torch.stack([r["x0"] for r in rows])
    return {
        "input_ids": x0,
        "labels": torch.stack([r["labels"] for r in rows]),
        "position_ids": torch.arange(x0.shape[1]).expand_as(x0).contiguous(),
        "bd_noisy_input_ids": torch.stack([r["xt"] for r in rows]),
        "bd_target_mask": torch.stack([r["target"] for r in rows]),
        "bd_p_mask": torch.stack([r["p_mask"] for r in rows]),
    }


def main() -> None:
    """``python dare_peer.py REPO CKPT BATCH_FILE STEPS THREADS``: timed steps as one ``RESULT <json>`` line."""
    repo, ckpt, batch_file, steps, threads = sys.argv[1:6]
    torch.set_num_threads(int(threads))
    model = build(repo, ckpt)
    print("RESULT " + json.dumps(timed_steps(model, torch.load(batch_file), int(steps))), flush=True)


def timed_steps(model, batch: dict, steps: int, warmup: int = 1, lr: float = 1e-5, clip: float = 1.0) -> list[dict]:
    """Per step: forward (trunk), head (lm_head + loss), head backward, backward (trunk), optimizer seconds."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    marks: dict[str, float] = {}

    def trunk_done(module, inputs, output):
        marks["trunk"] = time.perf_counter()
        if torch.is_grad_enabled():
            output.last_hidden_state.register_hook(lambda g: marks.__setitem__("head_bwd", time.perf_counter()))

    model.model.register_forward_hook(trunk_done)
    out, first = [], 0.0
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(**batch, use_cache=False, return_block_diffusion_token_loss=True).loss
        t_loss = time.perf_counter()
        loss.backward()
        t_bwd = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t_end = time.perf_counter()
        first = first if i else float(loss.detach())
        if i >= warmup:
            out.append(
                {
                    "forward": marks["trunk"] - t0,
                    "head": t_loss - marks["trunk"],
                    "head_bwd": marks["head_bwd"] - t_loss,
                    "backward": t_bwd - marks["head_bwd"],
                    "optimizer": t_end - t_bwd,
                    "step": t_end - t0,
                    "loss0": first,
                }
            )
    return out


if __name__ == "__main__":
    main()
