"""The front door for `--model`: what it names, a Hugging Face-layout folder or a GGUF file (any
part of a split set), is told here, once, and the checkpoint that reads it opened to match.

Within one checkpoint the encoding may still differ tensor by tensor (DeepSeek V4's FP4 experts beside
FP8 and float tensors): that dispatch stays with the format adapters (format_adapters.py).

Importing this module, and opening either checkpoint, loads no MLX (`pipeline plan` and the flag checks
tell a GGUF from a folder too, and the planner reads a checkpoint's index): the readers load it where they
make arrays.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .gguf_checkpoint import GGUFCheckpoint
from .safetensors_checkpoint import Checkpoint

if TYPE_CHECKING:  # annotations only: format_adapters.py loads MLX
    from .format_adapters import Requantize

GGUF_SUFFIX = ".gguf"


def is_gguf(model: Path | str) -> bool:
    """Whether `model` names a GGUF file (by its name, for flags; the magic is checked on opening),
    rather than a model folder."""
    path = Path(model)
    return path.suffix.lower() == GGUF_SUFFIX and not path.is_dir()


def open_checkpoint(model: Path | str, requantize: Requantize | None = None) -> Checkpoint:
    """The checkpoint `--model` names: a Hugging Face-layout folder (safetensors_checkpoint.Checkpoint),
    or a GGUF file (the first of a split set) read in place (gguf_checkpoint.GGUFCheckpoint). `requantize`
    (--quantize, --group-size) also chooses the MLX layout of GGUF tensor types that MLX cannot hold
    exactly."""
    if is_gguf(model):
        return GGUFCheckpoint(model, requantize and requantize.bits, requantize.group_size if requantize else 64)
    return Checkpoint(model)
