"""Repack Ray's wheel without what a Python driver and its actors never load, so it fits a 64 MiB device carry:
the Java worker jar (ray/jars/) and the dashboard's JavaScript source maps (*.js.map). RECORD lists the kept files.

    python benchmarks/slim_ray.py ray-2.60.0-cp312-...whl OUT/ray-2.60.0-cp312-...whl      (benchmarks/gpu_carry.sh)
"""

from __future__ import annotations

import sys
import zipfile


def dropped(name: str) -> bool:
    return name.startswith("ray/jars/") or name.endswith(".js.map")


def slim(src: str, dst: str) -> tuple[int, int]:
    """Copy the wheel ``src`` to ``dst`` without the dropped files; (files kept, files dropped)."""
    kept = gone = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if dropped(info.filename):
                gone += 1
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [ln for ln in data.decode().splitlines() if ln and not dropped(ln.split(",")[0])]
                data = ("\n".join(lines) + "\n").encode()
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr = info.external_attr  # keeps the executable bits of raylet / gcs_server
            out.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(out, data, compresslevel=9)
            kept += 1
    return kept, gone


if __name__ == "__main__":
    k, g = slim(sys.argv[1], sys.argv[2])
    print(f"{sys.argv[2]}: kept {k} files, dropped {g} (Java jar, source maps)")
