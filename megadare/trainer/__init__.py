"""Training: the SFT, DPO and RL loops on Megatron model chunks, their checkpoints, steps and run bookkeeping."""
