"""Error types shared by every layer (the ground floor of the import layers: it imports nothing of megadare)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad config: the message names the dotted key and how to fix it."""
