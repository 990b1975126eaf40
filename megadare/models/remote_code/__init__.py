"""Remote-code files megadare writes beside config.json, for model types transformers does not know.

A config.json's ``auto_map`` (``{"AutoConfig": "configuration_x.XConfig", ...}``) names Python modules that
transformers loads from the checkpoint directory with ``trust_remote_code=True`` (SGLang does so for every
checkpoint it serves). This folder holds the ones megadare ships (``configuration_llada2_moe.py``);
:func:`write_remote_code` copies those a config names into a checkpoint being written. Modules a config names that
megadare does not ship are the publisher's: exports copy them from the source checkpoint
(``models.safetensors_io.copy_passthrough_files``).
"""

from __future__ import annotations

import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))


def auto_map_modules(config: dict) -> list[str]:
    """Module names (``configuration_x``) referenced by config.json's ``auto_map`` (``repo--module.Class`` too)."""
    refs: list[str] = []
    for v in (config.get("auto_map") or {}).values():
        refs.extend([v] if isinstance(v, str) else [x for x in v if isinstance(x, str)])
    return sorted({r.split("--")[-1].rsplit(".", 1)[0] for r in refs})


def write_remote_code(config: dict, out_dir: str) -> list[str]:
    """Copy the modules ``config``'s auto_map names that megadare ships into ``out_dir``; returns their files."""
    written = []
    for module in auto_map_modules(config):
        src = os.path.join(HERE, f"{module}.py")
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(out_dir, f"{module}.py"))
            written.append(f"{module}.py")
    return written
