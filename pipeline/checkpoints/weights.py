"""Loading a rank's tensors into its slice of the model: the names it owns (tensor_names.py) read
through the format adapters (loading.py), its layers quantized as the loaded arrays are (MLX-quantized
`.scales` beside a packed `.weight`), the last rank's share of the LM head kept, every parameter required;
and, where --weights-in-memory chose it (weights_in_memory.py), the quantized layers dequantized.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..kernels import qmm
from ..kernels.int8_layout import packed_layout
from ..models.experts import GGUFBlocksSwitchLinear, SwitchLinear
from ..util.errors import UserError
from .format_adapters import Requantize
from .int8_repack import Int8WhileLoading
from .loading import load_tensors
from .safetensors_checkpoint import Checkpoint
from .tensor_names import head_prefix, head_tensor_names, local_name, owned_tensor_names


def load_slice(model: nn.Module, checkpoint: Checkpoint, dtype: mx.Dtype,
               requantize: Requantize | None = None, progress: bool = False, int8_in_place: bool | None = None,
               cut: Callable[[dict[str, mx.array]], None] | None = None) -> list[str]:
    """Load this rank's tensors into `model` (a TransformerSlice), floats cast to `dtype`,
    through the format adapters (expert stacking, FP8, INT4, re-quantization).
    int8_in_place: not None, the layers' quantized matrices take the int8 layout as they are read
    (int8_repack.Int8WhileLoading; True: in the buffers they were read into).
    cut: given, cut(weights, names) cuts each group of loaded arrays (checkpoint names) to this rank's
    share as it is read (--tensor-parallel: models/tensor_parallel.py shard_weights; int8_in_place must
    then be None).
    Returns the checkpoint names read, so callers (and tests) can see exactly what was loaded."""
    after_group = int8 = None
    if int8_in_place is not None:
        int8 = Int8WhileLoading(model, lambda name: int8_in_place or checkpoint.in_huge_pages(name))

        def after_group(weights: dict, names: list[str]) -> None:
            int8(weights, {name: local_name(name, model.start) for name in names})

    if cut is not None:  # each group of tensors cut as soon as it is read: never more than a share and a group
        after_group = cut
    names = owned_tensor_names(checkpoint, model.start, model.end, model.has_ends)
    if model.head_rows:  # the last rank's share of the LM head (head_share.py), and the final norm
        # (and DeepSeek V4's collapse of its residual streams, which the norm reads)
        norm = [name for name in checkpoint.tensors if name.startswith(("model.norm.", "model.hc_head."))]
        names = sorted(set(names) | set(head_tensor_names(checkpoint, model.config)) | set(norm))
    weights = {local_name(name, model.start): array
               for name, array in load_tensors(checkpoint, names, dtype, requantize,
                                               getattr(model, "keeps_float32", None), progress,
                                               after_group=after_group).items()}
    checkpoint.loaded(names)
    if model.head_rows:
        _keep_head_rows(weights, model.head_rows, head_prefix(model.config).removeprefix("model."),
                        getattr(model, "head_begin", None))
    head = model.get("lm_head") if model.has_ends else None
    if head is not None and head.weight.shape[0] < model.config.vocab_size:  # rank 0's slice (models/vocab_split.py)
        _keep_head_rows(weights, head.weight.shape[0], "lm_head.", 0, rename="lm_head.")
    fill_module(model, weights, f"weights in {checkpoint.folder}")
    if int8 is not None:
        int8.mark(model)
    return names


def fill_module(module: nn.Module, weights: dict[str, mx.array], what: str) -> None:
    """Put loaded arrays (module-local names) into `module`: its layers quantized as the arrays are,
    every parameter required, then each submodule's `after_load`. `what` names the source in the
    one-line error when the arrays do not fit the module config.json describes."""
    try:
        _quantize_like(module, weights)
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise UserError(f"{what} do not match config.json: {e}") from None
    weights.clear()
    for sub in module.modules():
        if hasattr(sub, "after_load"):
            sub.after_load()
    mx.eval(module.parameters())


def _quantize_like(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Swap Linear/Embedding/SwitchLinear modules for quantized ones where the loaded tensors
    are MLX-quantized (a `.scales` beside a packed uint32 `.weight`). Group size and bits
    follow from the shapes: the module knows its input width."""
    modules = dict(model.named_modules())
    for name in [n for n in weights if n.endswith(".ggml_type")]:  # a GGUF tensor held as the file's row bytes
        path = name.removesuffix(".ggml_type")
        if isinstance(modules.get(path), nn.Linear):
            qmm.GGUFBlocksLinear.become(modules[path], weights[path + ".weight"], weights[name])
        elif isinstance(modules.get(path), nn.Embedding):  # the token embedding (rows looked up, or the tied head)
            qmm.GGUFBlocksEmbedding.become(modules[path], weights[path + ".weight"], weights[name])
        elif isinstance(modules.get(path), SwitchLinear):  # an expert stack (its tokens' experts gathered)
            GGUFBlocksSwitchLinear.become(modules[path], weights[path + ".weight"], weights[name])
    settings = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        path = name[: -len(".scales")]
        module = modules.get(path)
        if module is None or not hasattr(module, "to_quantized"):
            continue
        in_features = module.weight.shape[-1]
        packed = weights[path + ".weight"].shape[-1]
        layout = packed_layout(in_features, packed, scales.shape[-1])
        if layout is None:
            # The module's input width comes from config.json; the packed shapes fit no MLX layout of it.
            raise ValueError(f"{path}.weight is packed as {packed} uint32 with {scales.shape[-1]} scales per row, "
                             f"which no MLX quantization of {in_features} inputs (from config.json) gives")
        group_size, bits = layout
        # e8m0 byte scales, no biases: MLX's mxfp4 / mxfp8 (a GGUF's MXFP4, DeepSeek V4's FP4 and FP8)
        mode = "affine" if path + ".biases" in weights else {4: "mxfp4", 8: "mxfp8"}.get(bits, "affine")
        settings[path] = {"group_size": group_size, "bits": bits, "mode": mode}
    if settings:
        nn.quantize(model, class_predicate=lambda path, _: settings.get(path, False))
        qmm.use_in(model)  # their products through pipeline's kernels where built (qmm.py)


def _keep_head_rows(weights: dict[str, mx.array], rows: int, prefix: str, begin: int | None = None,
                    rename: str = "head_share.") -> None:
    """The LM head's tensors (weight, and scales/biases if quantized: one row per vocabulary
    entry) cut to their last `rows` rows, or with `begin` rows [begin, begin + rows) (a tensor-parallel
    member's slice, models/vocab_split.py), renamed to the `head_share` module (or `rename`)."""
    for name in [n for n in weights if n.startswith(prefix)]:
        array = weights.pop(name)
        if name.endswith(".ggml_type"):  # a GGUF type held as row bytes: its one-element type id
            weights[rename + name[len(prefix):]] = array
            continue
        kept = array[-rows:] if begin is None else array[begin:begin + rows]
        weights[rename + name[len(prefix):]] = mx.array(kept)  # a copy: the rest is freed


def dequantize_slice(model: nn.Module, dtype: mx.Dtype) -> int:
    """Replace each MLX-quantized module of `model` by its dense equivalent, weights
    dequantized to `dtype`, one module at a time (the packed copy is freed as it goes).
    Returns the number of modules replaced."""
    paths = [path for path, module in model.named_modules() if _is_quantized_module(module)]
    for path in paths:  # by path, so no list keeps the packed modules alive
        module = model
        for part in path.split("."):
            module = module[int(part)] if isinstance(module, list) else module[part]
        dense = _dense_module(module, dtype)
        mx.eval(dense.parameters())
        model.update_modules(tree_unflatten([(path, dense)]))
        del module, dense
        mx.clear_cache()  # give the packed copy back now, not after the whole slice is dense
    return len(paths)


def _is_quantized_module(module: nn.Module) -> bool:
    return isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or \
        type(module).__name__ == "QuantizedSwitchLinear"


def _dense_module(module: nn.Module, dtype: mx.Dtype) -> nn.Module:
    scales, mode = module.scales, getattr(module, "mode", "affine")
    biases = qmm.full_biases(scales, module.get("biases"), module.bits) if mode == "affine" else module.get("biases")
    if scales.dtype == mx.float16 and biases is not None and dtype == mx.float32:  # a symmetric matrix's (qmm.hold_symmetric)
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)  # float16 values: s q + b rounded once, in float32
    weight = mx.dequantize(module.weight, scales, biases, group_size=module.group_size,
                           bits=module.bits, mode=getattr(module, "mode", "affine")).astype(dtype)
    if isinstance(module, nn.QuantizedLinear):
        out_features, in_features = weight.shape
        dense = nn.Linear(in_features, out_features, bias="bias" in module)
        if "bias" in module:
            dense.bias = module.bias.astype(dtype)
    elif isinstance(module, nn.QuantizedEmbedding):
        dense = nn.Embedding(*weight.shape)
    else:
        experts, out_features, in_features = weight.shape
        dense = SwitchLinear(in_features, out_features, experts)
    dense.weight = weight  # the random init above is lazy and never computed
    return dense
