"""The streaming safetensors reader (models/safetensors_io) refuses what it cannot read in one line."""

from __future__ import annotations

import json
import os

import pytest

from megadare.errors import CheckpointError
from megadare.models.safetensors_io import INDEX_NAME, SINGLE_NAME, SafetensorsReader


def write_raw(path, dtype: str, shape: list[int], data: bytes) -> None:
    """A safetensors file written by hand (8-byte header length, JSON header, data), any dtype string."""
    header = json.dumps({"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, len(data)]}}).encode()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + data)


@pytest.mark.parametrize("dtype", ["U16", "NOT_A_DTYPE"])
def test_an_unknown_dtype_is_a_one_line_checkpoint_error(tmp_path, dtype):
    """Before: ``KeyError: 'U16'`` from the dtype table. U16 is valid safetensors (safe_open lists the file);
    garbage behind an index is never seen by safe_open; both reach the reader's own table."""
    if dtype == "U16":
        write_raw(tmp_path / SINGLE_NAME, dtype, [2], b"\0" * 4)
        shard = SINGLE_NAME
    else:
        shard = "model-00001-of-00001.safetensors"
        write_raw(tmp_path / shard, dtype, [2], b"\0" * 4)
        (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": shard}}))
    reader = SafetensorsReader(tmp_path)
    for read in (reader.get, reader.dtype):
        with pytest.raises(CheckpointError) as e:
            read("w")
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith(f"{os.path.join(tmp_path, shard)}: tensor 'w' has dtype {dtype!r}")
        assert "supported: F64, F32, F16, BF16" in msg
