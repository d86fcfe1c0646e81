"""The front door for `--model`: what it names, a Hugging Face-layout folder of safetensors or a GGUF
file (any part of a split set), is told here, once, into a ModelFiles record whose `format` the flags,
preflight and the planner ask, and whose `open` gives the checkpoint that reads it.

Within one checkpoint the encoding may still differ tensor by tensor (DeepSeek V4's FP4 experts beside
FP8 and float tensors): that dispatch stays with the format adapters (format_adapters.py).

Importing this module, and opening either checkpoint, loads no MLX (`pipeline plan` and the flag checks
tell a GGUF from a folder too, and the planner reads a checkpoint's index): the readers load it where they
make arrays.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..util.errors import UserError
from .gguf_checkpoint import GGUFCheckpoint
from .safetensors_checkpoint import Checkpoint

if TYPE_CHECKING:  # annotations only: format_adapters.py loads MLX
    from .format_adapters import Requantize

GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class ModelFiles:
    """A model's files and the checkpoint format they hold, decided once (find, locate)."""
    path: Path
    # "safetensors": a Hugging Face-layout folder; "gguf": a GGUF file, for a split set any part (the
    # rest sit beside it)
    format: Literal["safetensors", "gguf"]

    def open(self, requantize: Requantize | None = None) -> Checkpoint:
        """The checkpoint that reads these files: a folder's safetensors (safetensors_checkpoint.Checkpoint),
        or a GGUF set read in place (gguf_checkpoint.GGUFCheckpoint). `requantize` (--quantize, --group-size)
        also chooses the MLX layout of GGUF tensor types that MLX cannot hold exactly."""
        if self.format == "gguf":
            return GGUFCheckpoint(self.path, requantize and requantize.bits,
                                  requantize.group_size if requantize else 64)
        return Checkpoint(self.path)


def find(spec: Path | str) -> ModelFiles | None:
    """The model files `spec` names, told by its name: a folder, or a .gguf file (its magic is checked
    on opening); None where it names neither (for the planner: a config.json file, a bundled config's
    name, or nothing there)."""
    path = Path(spec)
    if path.is_dir():
        return ModelFiles(path, "safetensors")
    if path.suffix.lower() == GGUF_SUFFIX:
        return ModelFiles(path, "gguf")
    return None


def locate(model: Path | str) -> ModelFiles:
    """`--model`'s files (find), refused in one line naming this host where they are not there: a GGUF
    file that does not exist, or anything but a folder or a .gguf file."""
    path = Path(model)
    files = find(path)
    if files is None:
        what = "is not a folder or a .gguf file" if path.exists() else "does not exist"
        raise UserError(f"model folder {path} {what} on {socket.gethostname()}")
    if files.format == "gguf" and not path.is_file():
        raise UserError(f"GGUF file {path} does not exist on {socket.gethostname()}")
    return files
