"""DeepSeek's MTP module (models/mtp.py) read from a checkpoint, for `--draft mtp` on rank 0."""

from __future__ import annotations

import mlx.core as mx

from .loading import load_tensors
from .weights import dequantize_slice, fill_module
from ..models.config import ModelConfig
from ..models.mtp import MTPModule, make_module, mtp_prefix, mtp_tensor_names, own_names
from ..models.registry import family_for


def load_mtp(config: ModelConfig, checkpoint, dtype: mx.Dtype, requantize=None, dense: bool = False,
             progress: bool = False) -> MTPModule:
    """The MTP module from the checkpoint, through the same format adapters as the layers (FP8
    blocks, expert stacking, --quantize, MLX-quantized tensors; dense: dequantized as the rank's
    other weights are under --weights-in-memory)."""
    module = make_module(config, family_for(config).module().DecoderLayer)
    prefix, own = mtp_prefix(config), own_names(config)
    names = mtp_tensor_names(checkpoint, config)

    def local(name: str) -> str:
        rest = name[len(prefix):]
        return rest if rest.startswith(own) else "block." + rest

    keep_float32 = getattr(module, "keeps_float32", None)  # DeepSeek V4's norms and mixing maps
    weights = {local(name): array for name, array in
               load_tensors(checkpoint, names, dtype, requantize, keep_float32, progress=progress,
                            desc="loading MTP").items()}
    fill_module(module, weights, f"the MTP module's weights in {checkpoint.folder}")
    if dense:
        dequantize_slice(module, dtype)
    mx.eval(module.parameters())
    return module
