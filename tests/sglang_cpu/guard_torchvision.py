"""Stand-in patch (test environment only): make the registry's torchvision 0.28.0 importable on CPU-only torch.

transformers 5.12 imports torchvision (``AutoImageProcessor``, reached from ``sglang.srt.configs``). The
torchvision 0.28.0 wheel links ``libtorch_cuda.so``, so its C++ ops never load against the CPU torch build, and
``torchvision/_meta_registrations.py`` then fails at import: ``@torch.library.register_fake("torchvision::nms")``
raises "operator torchvision::nms does not exist". torchvision already guards its other meta registrations with
``torchvision.extension._has_ops()``; this script puts the same guard on the two that lack it (nms, qnms) in the
installed file, and fails if the file does not look as expected.

    python guard_torchvision.py   # with the test venv's python
"""

import importlib.util
import sys

OPS = ("nms", "qnms")


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        print("guard_torchvision: torchvision is not installed", file=sys.stderr)
        return 1
    path = f"{spec.submodule_search_locations[0]}/_meta_registrations.py"
    src = open(path).read()
    for op in OPS:
        plain = f'@torch.library.register_fake("torchvision::{op}")'
        guarded = (
            f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() '
            f"else (lambda fn: fn))"
        )
        if guarded in src:
            continue
        if src.count(plain) != 1:
            print(
                f"guard_torchvision: {path} has {src.count(plain)} lines {plain!r}, expected 1 "
                "(another torchvision version? update requirements-nodeps.txt and this script)",
                file=sys.stderr,
            )
            return 1
        src = src.replace(plain, guarded)
    with open(path, "w") as f:
        f.write(src)
    print(f"guard_torchvision: guarded {', '.join(OPS)} in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
