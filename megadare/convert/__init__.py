"""HF <-> Megatron conversion and exports.

hf_megatron.py    ``hf_to_megatron`` / ``megatron_to_hf`` / ``load_hf_into_model`` over the families' mapping tables
mcore_ckpt.py     the Megatron distributed checkpoint's I/O (torch.distributed.checkpoint)
sharded_load.py   an HF checkpoint straight into a sharded live model
outputs.py        where an export may write, and its export mark
fp8.py, quantize.py, manifest.py, ckpt_writers.py: the quantized exports

This file imports nothing: a module that needs only the export mark (rollout/setup.py, which every command's
config check reaches, ``megadare plan`` included) must not load torch.distributed.checkpoint through it.
"""
