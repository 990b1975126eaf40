#!/usr/bin/env python
"""Megatron distributed checkpoint -> HF safetensors (publisher's names, config.json and tokenizer files).

    python tools/checkpoint_convert/megatron_to_hf.py --ckpt runs/x/ckpt/iter_0000500 --out /ckpt/sdar30b-rl

Same as `megadare convert megatron-to-hf ...`; see `--help`.
"""

import sys

from megadare.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "megatron-to-hf", *sys.argv[1:]]))
