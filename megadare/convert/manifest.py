"""A checkpoint directory's manifest: every file with its size, and a sha256 of the small ones (the JSON / pickled
metadata, train state, RNG states, tokenizer files), written last, just before the directory is renamed into place.

``check_checkpoint(path)`` says whether a checkpoint is intact without reading its tensors: every listed file is
there with its size, the small files hash to their sums. A checkpoint written before manifests existed is
checked against its own ``.metadata`` instead (torch DCP's index: every storage file it names must exist and be
long enough for the byte ranges it lists), which catches the common damage -- a truncated or missing shard.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Optional

from torch.distributed.checkpoint import FileSystemReader

from megadare.files import write_text_atomic

MANIFEST = "manifest.json"
SMALL_FILE = 4 << 20  # files up to this size get a checksum
FORMAT = 1


def _files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(ckpt_dir: str) -> None:
    """List every file of ``ckpt_dir`` (size; sha256 below SMALL_FILE) in ``manifest.json``, written atomically."""
    files = {}
    for rel in _files(ckpt_dir):
        p = os.path.join(ckpt_dir, rel)
        size = os.path.getsize(p)
        files[rel] = {"size": size, **({"sha256": _sha256(p)} if size <= SMALL_FILE else {})}
    write_text_atomic(os.path.join(ckpt_dir, MANIFEST), json.dumps({"format": FORMAT, "files": files}, indent=1))


@dataclass
class Verdict:
    intact: bool
    problem: str = ""  # what is wrong (naming the file), when not intact
    legacy: bool = False  # no manifest: checked against .metadata only


def check_checkpoint(ckpt_dir: str) -> Verdict:
    """Is ``ckpt_dir`` intact? Reads the manifest (or, for an older checkpoint, DCP's .metadata), never tensors."""
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.exists(path):
        problem = _check_storage(ckpt_dir)
        return Verdict(intact=problem is None, problem=problem or "", legacy=True)
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Verdict(False, f"{path} is unreadable ({e})")
    for rel, want in files.items():
        p = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(p):
            return Verdict(False, f"{p} is missing")
        size = os.path.getsize(p)
        if size != want["size"]:
            return Verdict(False, f"{p} has {size} bytes, the manifest says {want['size']}")
        if "sha256" in want and _sha256(p) != want["sha256"]:
            return Verdict(False, f"{p} does not match its checksum in the manifest")
    return Verdict(True)


def _check_storage(ckpt_dir: str) -> Optional[str]:
    """A checkpoint without a manifest: .metadata readable, and every storage file it names long enough."""
    if not os.path.exists(os.path.join(ckpt_dir, ".metadata")):
        return f"{ckpt_dir} has no .metadata (not a complete distributed checkpoint)"
    try:
        md = FileSystemReader(ckpt_dir).read_metadata()
    except Exception as e:  # a damaged pickle raises anything
        return f"{os.path.join(ckpt_dir, '.metadata')} is unreadable ({type(e).__name__}: {e})"
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(need.items()):
        p = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(p):
            return f"{p} is missing"
        if os.path.getsize(p) < end:
            return f"{p} has {os.path.getsize(p)} bytes, .metadata needs at least {end}"
    return None
