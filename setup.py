from setuptools import find_packages, setup

setup(
    name="megadare",
    version="0.1.0",
    description="Megatron-core post-training (SFT and RL) for diffusion language models",
    packages=find_packages(include=["megadare", "megadare.*"]),
    python_requires=">=3.10",
    install_requires=[
        # CPU machines: `pip install torch==2.13.0` first (a plain `torch` pulls a multi-GB CUDA build).
        "torch>=2.5",
        "megatron-core>=0.16.1,<0.17",
        "omegaconf>=2.3",
        "safetensors>=0.4",
        "pyyaml",
        "numpy",
        "tqdm",
        "psutil",  # megatron's checkpoint writer needs it (and hangs without it)
        "tensorboard",
        "pyarrow",  # parquet datasets (the format verl/DARE data comes in)
        "ray>=2.40",  # rollout engines as actors (local cluster on a laptop, the allocation on Slurm)
    ],
    extras_require={
        # transformers: parity tests against implementations we did not write (Qwen2/Qwen3/Qwen3-MoE)
        "dev": ["pytest>=8", "pytest-timeout", "transformers>=4.51"],
        "gpu": ["transformer-engine[pytorch]", "sglang>=0.5.6,<0.6", "nvidia-modelopt"],
    },
    entry_points={"console_scripts": ["megadare = megadare.cli:main"]},
)
