#!/usr/bin/env python
"""Quantized export of a trained checkpoint for serving (megadare.convert.quantize).

    python tools/checkpoint_convert/quantize.py --hf /ckpt/sdar-rl-hf --out /ckpt/sdar-rl-fp8 --format fp8
    python tools/checkpoint_convert/quantize.py --ckpt runs/x/ckpt --out /ckpt/sdar-rl-nvfp4 --format nvfp4 \\
        --calib-prompts prompts.txt
    python tools/checkpoint_convert/quantize.py --hf /ckpt/sdar-rl-hf --out /ckpt/sdar-rl-fp8b --format fp8-block

fp8 / nvfp4 need NVIDIA ModelOpt (pip install nvidia-modelopt); nvfp4 also needs a CUDA GPU. fp8-block (128x128
block fp8 + weight_scale_inv, the checkpoint an SGLang rollout engine starts from for fp8 weight sync) needs only
torch. --calib-prompts: a text file, one prompt per line (blank lines skipped); a line holding a JSON list of
integers is taken as token ids. Without it a few built-in prompts are used.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence, Union

from megadare import stopping
from megadare.errors import StoppedBeforeTheLoop
from megadare.files import inode_of


def read_calib_prompts(path: str) -> list[Union[str, list[int]]]:
    """Prompts of a --calib-prompts file: one per line; a JSON list of ints is a token-id prompt."""
    out: list[Union[str, list[int]]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("["):
                try:
                    ids = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}:{n}: starts with '[' but is not a JSON list of token ids ({e})")
                if not all(isinstance(i, int) for i in ids):
                    raise SystemExit(f"{path}:{n}: a token-id line must hold integers only")
                out.append(ids)
            else:
                out.append(line)
    if not out:
        raise SystemExit(f"{path}: no calibration prompts (one per line)")
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="HF checkpoint dir (config.json + safetensors + tokenizer files)")
    src.add_argument(
        "--ckpt", help="megadare Megatron checkpoint (iter dir or the run's checkpoint root); converted to HF first"
    )
    p.add_argument("--out", required=True, help="output HF checkpoint dir (written atomically)")
    p.add_argument(
        "--format",
        default="fp8",
        choices=("fp8", "nvfp4", "fp8-block"),
        help="fp8 / nvfp4: NVIDIA ModelOpt (calibrated); fp8-block: 128x128-block e4m3, torch only",
    )
    p.add_argument("--calib-prompts", default=None, help="prompt file (format below); default: built-in prompts")
    p.add_argument("--gen-tokens", type=int, default=32, help="mask tokens appended to each calibration prompt")
    p.add_argument("--max-len", type=int, default=512, help="longest calibration sequence in tokens")
    p.add_argument("--device", default=None, help="calibration device (default: cuda if available, else cpu)")
    p.add_argument(
        "--block",
        type=int,
        nargs=2,
        default=(128, 128),
        metavar=("BN", "BK"),
        help="fp8-block tile (default 128 128, what SGLang's block-fp8 kernels expect)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The export; a SIGTERM (Slurm's time limit, ``scancel``) stops it in one line, exit 0, as ``megadare
    convert``: the export's staging (and the HF copy of a --ckpt source) removed, --out as it was."""
    args = parse_args(argv)
    before = inode_of(args.out)
    try:
        with stopping.watching():  # before torch loads (seconds): a SIGTERM meanwhile is the same stop
            return _export(args)
    except StoppedBeforeTheLoop:  # what the export wrote aside was removed on its way out
        if inode_of(args.out) not in (None, before):  # put in place (``publish``) before the stop was acted on
            print(f"wrote {args.format} checkpoint {args.out}; SIGTERM received after it was in place: nothing lost")
            return 0
        print(
            f"quantize stopped by SIGTERM: nothing of this export was kept and {args.out} is as it was; run the same "
            "command again",
            flush=True,
        )
        return 0


def _export(args: argparse.Namespace) -> int:
    """The export ``args`` ask for: 0, or 2 after its one-line error."""
    # here, not at the top: torch and megatron load (seconds) once the SIGTERM handling is in (``main``)
    from megadare.convert.quantize import Calibration, ModelOptMissing, NeedsCuda, quantize_export

    prompts = read_calib_prompts(args.calib_prompts) if args.calib_prompts else None
    try:
        out = quantize_export(
            args.hf or args.ckpt,
            args.out,
            fmt=args.format,
            calib=Calibration(prompts, gen_tokens=args.gen_tokens, max_len=args.max_len, device=args.device),
            block=tuple(args.block),
            progress=not args.quiet,
        )
    # megadare's one-line errors (OutputError, CheckpointError, ...)
    except (ModelOptMissing, NeedsCuda, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk: the export was assembled aside and removed
        print(
            f"error: writing {args.out} failed: {e.strerror or e}; nothing of this export was kept and {args.out} "
            "is as it was",
            file=sys.stderr,
        )
        return 2
    print(f"wrote {args.format} checkpoint {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
