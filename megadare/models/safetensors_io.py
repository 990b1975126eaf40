"""Streaming safetensors IO in the HF layout: one tensor in memory at a time on read, one shard on write.

Reader: a directory with ``model.safetensors`` or ``model.safetensors.index.json`` + shards. Tensors are read
one by one with plain reads (no mmap), so peak memory stays near the largest tensor.
Writer: buffers tensors until a shard reaches ``max_shard_bytes``, then writes it; at close it names the shards
``model-0000i-of-0000n.safetensors`` and writes the index, exactly as ``transformers`` ``save_pretrained``
does. Output goes to a fresh sibling ``.<out>.tmp-XXXX`` and is renamed into place at close, so a crash never leaves a
half-written checkpoint under the final name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megadare import stopping
from megadare.errors import CheckpointError
from megadare.files import OWNER, owned_name, sweep_dead
from megadare.models.remote_code import write_remote_code

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files a converter copies from the source checkpoint so the output loads in the published layout.
PASSTHROUGH_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


# Our own header reading (``_header``) and dtype table, not safetensors' ``safe_open``: safe_open maps the whole file
# (mmap) and exposes no data offsets, and the reader wants plain reads of one tensor's bytes (module doc);
# safetensors' own table (safetensors.torch._TYPES) is private.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _tensor_names(path: str) -> list[str]:
    """The tensor names of one safetensors file; a damaged file raises CheckpointError naming it."""
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) on a damaged file
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _fix(path: str) -> str:
    """What to do about a directory with a config.json and no weights: the shipped recipes' model.hf_path
    (examples/configs/hf/) holds config.json only, for the planner and --config-only."""
    if not os.path.exists(os.path.join(path, "config.json")):
        return ""
    return (
        " (a config.json alone, like the recipes' placeholders under examples/configs/hf/); point model.hf_path "
        "(--hf, --model) at the HF checkpoint directory that holds the weights"
    )


class SafetensorsReader:
    """Lazy reader over an HF checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        index = os.path.join(self.path, INDEX_NAME)
        single = os.path.join(self.path, SINGLE_NAME)
        if os.path.exists(index):
            with open(index) as f:
                try:
                    self.weight_map: dict[str, str] = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError) as e:
                    raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map'): {e}") from e
            for fn in sorted(set(self.weight_map.values())):
                if not os.path.exists(os.path.join(self.path, fn)):
                    raise CheckpointError(f"{index} names shard {fn!r}, which is missing from {self.path}")
        elif os.path.exists(single):
            self.weight_map = {k: SINGLE_NAME for k in _tensor_names(single)}
        else:
            files = (
                sorted(x for x in os.listdir(self.path) if x.endswith(".safetensors"))
                if os.path.isdir(self.path)
                else []
            )
            if not files:
                raise CheckpointError(
                    f"{self.path}: no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors files{_fix(self.path)}"
                )
            self.weight_map = {}
            for fn in files:
                for k in _tensor_names(os.path.join(self.path, fn)):
                    self.weight_map[k] = fn
        self._handles: dict[str, tuple[int, dict]] = {}

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _header(self, fn: str) -> tuple[int, dict]:
        """(data start offset, header) of one safetensors file: 8-byte little-endian length + JSON."""
        h = self._handles.get(fn)
        if h is None:
            path = os.path.join(self.path, fn)
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n > os.path.getsize(path) - 8:
                    raise CheckpointError(f"{path}: not a complete safetensors file (its header claims {n} bytes)")
                try:
                    h = (8 + n, json.loads(f.read(n)))
                except (ValueError, UnicodeDecodeError) as e:
                    raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from None
            self._handles[fn] = h
        return h

    def _entry(self, name: str) -> tuple[str, int, dict]:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found in the checkpoint")
        fn = self.weight_map[name]
        start, header = self._header(fn)
        return fn, start, header[name]

    def _dtype(self, fn: str, name: str, entry: dict) -> torch.dtype:
        """The torch dtype of one header entry; a dtype outside ``_DTYPES`` raises CheckpointError naming it."""
        code = entry.get("dtype")
        if not isinstance(code, str) or code not in _DTYPES:
            raise CheckpointError(
                f"{os.path.join(self.path, fn)}: tensor {name!r} has dtype {code!r}, which megadare does not read "
                f"(supported: {', '.join(_DTYPES)}); convert the checkpoint to one of these"
            )
        return _DTYPES[code]

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read with plain file reads into fresh memory (no mmap: file pages never pile up)."""
        fn, start, e = self._entry(name)
        begin, end = e["data_offsets"]
        buf = bytearray(end - begin)
        with open(os.path.join(self.path, fn), "rb") as f:
            f.seek(start + begin)
            got = f.readinto(memoryview(buf))
        if got != len(buf):
            raise CheckpointError(
                f"{os.path.join(self.path, fn)}: truncated: tensor {name!r} needs bytes "
                f"{start + begin}..{start + end}, the file ends at {start + begin + got}"
            )
        dtype = self._dtype(fn, name, e)
        if not buf:
            return torch.empty(e["shape"], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(e["shape"])

    def shape(self, name: str) -> list[int]:
        return list(self._entry(name)[2]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        fn, _, e = self._entry(name)
        return self._dtype(fn, name, e)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.keys():
            yield name, self.get(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fresh_sibling(path: str, tag: str, create: bool) -> str:
    """A fresh, unique name beside ``path`` (``.<name>.<tag>.<pid>@<host>-XXXXXXXX``: whose it is, so that
    ``sweep_dead_siblings`` can tell a killed writer's; the directory is made when ``create``)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    prefix = owned_name(f".{os.path.basename(path)}.{tag}.", "")
    d = tempfile.mkdtemp(prefix=prefix, dir=parent)
    if not create:
        os.rmdir(d)
    else:  # mkdtemp makes it private (0700); the output gets the usual permissions
        os.chmod(d, 0o777 & ~_umask())
    return d


def sweep_dead_siblings(path: str) -> list[str]:
    """Remove what writers of ``path`` that were killed (SIGKILL, an OOM kill) left beside it: ``fresh_sibling``
    names of this host whose process is gone (a whole export each, hidden). Anything else is kept: another
    host's (its process cannot be checked), a live process's, names without an owner. Returns those removed."""
    parent, base = os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.abspath(path))
    return sweep_dead(parent, re.escape(f".{base}.") + r"[a-z]+\." + OWNER + r"-[a-z0-9_]{8}")


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


class ShardedSafetensorsWriter:
    """Writes HF-layout sharded safetensors atomically (temp dir, renamed at close)."""

    def __init__(
        self, out_dir: str | os.PathLike, max_shard_bytes: int = 2 << 30, metadata: Optional[dict[str, str]] = None
    ):
        self.out_dir = os.fspath(out_dir).rstrip(os.sep)
        self.tmp_dir = fresh_sibling(self.out_dir, "tmp", create=True)
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0
        self._closed = False

    @property
    def staging_dir(self) -> str:
        """Where extra files (config.json, tokenizer) go before the atomic rename."""
        return self.tmp_dir

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("writer already closed")
        if name in self._buf or any(name in s for s in self._shards):
            raise CheckpointError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buf[name] = tensor.detach().contiguous().cpu()
        self._buf_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        if not self._buf:
            return
        i = len(self._shards)
        path = os.path.join(self.tmp_dir, f"shard-{i:05d}.part")
        try:
            save_file(self._buf, path, metadata=self.metadata)
        except SafetensorError as e:  # an OS error in safetensors' words ("I/O error: ... (os error 28)")
            code = re.search(r"\(os error ([0-9]+)\)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from None
        os.chmod(path, 0o666 & ~_umask())  # safetensors >= 0.8 writes 0600 (safetensors#782): others could not serve it
        self._shards.append(list(self._buf))
        self._buf = {}
        self._buf_bytes = 0

    def close(self) -> str:
        """Finish: name the shards, write the index, rename into place. Returns the output directory."""
        self._flush()
        n = len(self._shards)
        if n == 0:
            raise CheckpointError("no tensors were written")
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self._shards):
            final = SINGLE_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.tmp_dir, f"shard-{i:05d}.part"), os.path.join(self.tmp_dir, final))
            weight_map.update({k: final for k in names})
        if n > 1:
            with open(os.path.join(self.tmp_dir, INDEX_NAME), "w") as f:
                json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        with stopping.held():  # a SIGTERM (megadare convert stops on it at once) waits until out_dir is in place
            if os.path.exists(self.out_dir):  # callers decide whether out_dir may be replaced (convert.outputs)
                old = fresh_sibling(self.out_dir, "old", create=False)
                os.replace(self.out_dir, old)
                os.replace(self.tmp_dir, self.out_dir)
                shutil.rmtree(old)
            else:
                os.replace(self.tmp_dir, self.out_dir)
            self._closed = True
        return self.out_dir

    def abort(self) -> None:
        self._closed = True
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> "ShardedSafetensorsWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            try:
                self.close()
            except BaseException:  # e.g. a full disk writing the last shard: nothing half-written stays
                self.abort()
                raise


def copy_passthrough_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copy config.json, generation config, tokenizer files and the remote code (every ``*.py`` beside config.json:
    the ``configuration_*.py`` / ``modeling_*.py`` its ``auto_map`` names and what they import) from src to dst;
    returns what was copied. Without the remote code an export of a checkpoint whose ``model_type`` transformers
    does not know (``sdar``, ``llada2_moe``) would load neither in transformers nor in SGLang."""
    copied = []
    remote_code = sorted(
        f for f in os.listdir(src_dir) if f.endswith(".py") and os.path.isfile(os.path.join(src_dir, f))
    )
    for fn in PASSTHROUGH_FILES + tuple(remote_code):
        s = os.path.join(src_dir, fn)
        if os.path.exists(s):
            shutil.copy2(s, os.path.join(dst_dir, fn))
            copied.append(fn)
    return copied


def save_hf_checkpoint(
    state: dict[str, torch.Tensor], config: dict, out_dir: str | os.PathLike, max_shard_bytes: int = 2 << 30
) -> str:
    """Write a state dict + config.json as an HF checkpoint directory (tests, tiny models, exports), with the
    remote code megadare ships for the modules config.json's ``auto_map`` names (models/remote_code)."""
    with ShardedSafetensorsWriter(out_dir, max_shard_bytes=max_shard_bytes) as w:
        for k, v in state.items():
            w.add(k, v)
        with open(os.path.join(w.staging_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        write_remote_code(config, w.staging_dir)
    return os.fspath(out_dir)
