"""megadare: Megatron-core post-training (SFT and RL) for diffusion language models."""

import warnings as _warnings

__version__ = "0.1.0"

# Known, harmless noise from optional extras and megatron internals; real warnings still show.
for _msg in (
    r".*Transformer Engine and Apex are not installed.*",
    r".*Apex is not installed.*",
    r".*\.grad attribute of a Tensor that is not a leaf Tensor.*",
    r".*`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated.*",
    r".*full scope is deprecated.*",
):
    _warnings.filterwarnings("ignore", message=_msg)
