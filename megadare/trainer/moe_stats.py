"""MoE load balance for the logs: tokens routed to each expert, per layer, over one optimizer step.

``moe_max_load`` (the logged metric) = max_e n_e / mean_e n_e averaged over MoE layers (1.0 = perfectly
balanced; top-k routing of T tokens over E experts puts T*k/E tokens on an expert on average). Counts exclude
packing padding and are summed over the TP x DP x CP ranks that share a layer (as megatron does for the
expert-bias update).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class MoELoadStats:
    def __init__(self, chunks: list[torch.nn.Module]):
        from megatron.core.transformer.moe.router import TopKRouter  # heavy: megatron

        self.counts: dict[int, torch.Tensor] = {}
        self.handles = []
        for c in chunks:
            for m in c.modules():
                if isinstance(m, TopKRouter):
                    self.handles.append(m.register_forward_hook(self._hook, with_kwargs=True))

    @property
    def active(self) -> bool:
        return bool(self.handles)

    def _hook(self, module, args, kwargs, output) -> None:
        routing_map = output[1]
        pad = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
        with torch.no_grad():
            if pad is not None:
                routing_map = routing_map & ~pad.reshape(-1, 1)
            counts = routing_map.sum(dim=0).double()
            key = id(module)
            self.counts[key] = self.counts.get(key, 0) + counts

    def collect(self) -> dict[str, float]:
        """max_load over this step (same on every rank); resets the counts. Collective when distributed."""
        if not self.active:
            return {}
        from megatron.core import parallel_state as ps  # heavy: megatron

        ratios = []
        for key in sorted(self.counts):
            c = self.counts[key]
            if dist.is_initialized():
                dist.all_reduce(c, group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
            if c.sum() > 0:
                ratios.append(float(c.max() / c.mean()))
        self.counts.clear()
        agg = torch.tensor([sum(ratios), float(len(ratios))], dtype=torch.float64)
        if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            agg = agg.cuda()
        if dist.is_initialized():
            dist.all_reduce(agg)
        return {"moe_max_load": float(agg[0] / agg[1])} if agg[1] > 0 else {}
