#!/usr/bin/env python
"""HF safetensors -> Megatron distributed checkpoint.

    python tools/checkpoint_convert/hf_to_megatron.py --hf /ckpt/SDAR-30B-A3B-Chat --out /ckpt/sdar30b-mcore --tp 4 --ep 8 --pp 2

Same as `megadare convert hf-to-megatron ...`; see `--help`.
"""

import sys

from megadare.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-megatron", *sys.argv[1:]]))
