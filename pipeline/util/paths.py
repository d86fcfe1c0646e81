"""Where pipeline keeps what it makes once and reuses: the cache root, under which the converted
default model, the compiled kernels and the private temporary folder live."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$PIPELINE_CACHE` if set, else `~/.cache/pipeline`."""
    env = os.environ.get("PIPELINE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pipeline"
