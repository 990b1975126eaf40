"""megadare: Megatron-core post-training (SFT and RL) for diffusion language models."""
__version__ = "0.1.0"
