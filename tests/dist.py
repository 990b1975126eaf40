"""Multi-process test runs (gloo): a thin name for megadare.parallel.launch.spawn."""
from megadare.parallel.launch import spawn as run_distributed  # noqa: F401
