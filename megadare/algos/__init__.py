"""Training objectives: SFT modes and the RL algorithm zoo."""
