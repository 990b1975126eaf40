"""megadare switches megatron's fallback torch AdamW to torch's fused kernel (trainer/optim.py): the same update,
and only where every parameter is on the CPU or every one on CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megadare.trainer.optim import fuse_torch_adam


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((7, 5), (5,), (3, 4, 2))]


def test_the_fused_update_is_the_single_tensor_update():
    plain, fused = _params(0), _params(0)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW(plain, foreach=False, **kw)
    opt = torch.optim.AdamW(fused, **kw)
    fuse_torch_adam(SimpleNamespace(optimizer=opt))
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in plain]
        for a, b, gr in zip(plain, fused, grads):
            a.grad, b.grad = gr.clone(), gr.clone()
        ref.step()
        opt.step()
    for a, b in zip(plain, fused):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()
    assert all(not torch.equal(a, b) for a, b in zip(fused, _params(0)))  # five steps moved every parameter


def _wrapped(device_types: list[str]) -> torch.optim.AdamW:
    opt = torch.optim.AdamW(_params(0), lr=1e-3)
    opt.param_groups[0]["params"] = [SimpleNamespace(device=torch.device(t)) for t in device_types]
    return opt


def test_fused_only_where_every_parameter_is_on_one_cpu_or_cuda_device_type():
    chained = SimpleNamespace(
        chained_optimizers=[
            SimpleNamespace(optimizer=_wrapped(kinds))
            for kinds in (["cuda", "cuda"], ["cpu"], ["cpu", "cuda"], ["meta"])
        ]
    )
    fuse_torch_adam(chained)
    fused = [bool(o.optimizer.param_groups[0].get("fused")) for o in chained.chained_optimizers]
    assert fused == [True, True, False, False]


def test_an_optimizer_with_state_is_left_as_it_is():
    params = _params(0)
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    fuse_torch_adam(SimpleNamespace(optimizer=opt))
    assert not opt.param_groups[0].get("fused")


def test_the_optimizer_settings_take_the_optim_sections_fields_and_defaults():
    """One source of truth: OptimSettings' fields are the ``optim`` section's own (before, a copy of each with its
    default repeated, free to drift), and ``optim_settings`` carries every section field, whatever it is set to."""
    from dataclasses import fields

    from megadare.config import Config
    from megadare.config.sections import ModelSection, OptimSection
    from megadare.trainer.optim import OptimSettings, optim_settings

    section, settings = OptimSection.__dataclass_fields__, OptimSettings.__dataclass_fields__
    assert all(settings[name] is f for name, f in section.items())
    assert OptimSettings().dtype == ModelSection().dtype
    cfg = Config()
    for f in fields(OptimSection):  # a value unlike the default for every field
        v = getattr(cfg.optim, f.name)
        setattr(cfg.optim, f.name, not v if isinstance(v, bool) else "linear" if isinstance(v, str) else v + 3)
    cfg.model.dtype = "bf16"
    s = optim_settings(cfg, total_steps=7, lr=0.5)
    assert {f.name: getattr(s, f.name) for f in fields(OptimSection)} == {**vars(cfg.optim), "lr": 0.5}
    assert (s.total_steps, s.dtype) == (7, "bf16")
