"""--int8-activations at load: the 4- and 8-bit weights of a loaded model repacked, in place, into the
layout of pipeline's int8 products (kernels/int8_kernels.cpp, run through kernels/qmm.py), and the
modules marked so that their products take that path. `use_int8` repacks a whole model after it is
loaded; `Int8WhileLoading` repacks the decoder layers' matrices while the rest of the rank's tensors
are still being read (loading.load_tensors). Here in checkpoints/, not beside the kernels: it walks
the model's modules, experts (models/experts.py) included.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..kernels.build import load
from ..kernels.int8_layout import INT8_BITS, INT8_BLOCK, packed_layout
from ..kernels.qmm import covers, set_threads
from ..models.experts import QuantizedSwitchLinear, SwitchLinear


def int8_covers(module: nn.Module) -> bool:
    """Whether a quantized module's weights can take the int8 layout (int8_fits)."""
    w = module.get("weight")
    return (w is not None and module.get("scales") is not None
            and int8_fits(w, module["scales"], module.get("biases"), module.group_size, module.bits,
                          getattr(module, "mode", "affine")))


def int8_fits(w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
              mode: str = "affine") -> bool:
    """Whether these arrays can take the int8 layout: MLX affine 4 or 8 bits, whole blocks of 16 weight
    rows (a multiple of 32 inputs follows from the group sizes)."""
    return (covers(w, scales, biases, group_size, bits, mode) and bits in INT8_BITS
            and w.shape[-2] % INT8_BLOCK == 0)


def use_int8(model: nn.Module, tied_head: bool = False, head_share: bool = True, in_place: bool = False) -> int:
    """--int8-activations: repack the 4- and 8-bit weights of `model`'s quantized modules for the int8
    products (int8_kernels.cpp), in place, one module at a time: same shapes, another order (float32 scales
    holding float16 values, a GGUF's, become float16: fewer bytes a token, same numbers),
    and `module.int8` set so their products take the int8 path. tied_head: the embedding is also the
    LM head (tie_word_embeddings): it keeps its MLX layout for lookups; 8 bits are the head as they are
    (`module.int8_rows`: int8 products read them row by row), 4 bits gain an int8 copy for the head;
    an embedding that is not the head is left alone. head_share: the last rank's share of the head
    (head_share.py) may take the int8 path; the caller says no where rank 0's head cannot (its rows not
    whole blocks, or rank 0 dense), so that both compute the head the same way.
    in_place: rearrange a layer's weights in their own buffer, so that loading pays for no second copy
    in new memory; only for a caller that knows no graph built before still reads them (the loader).
    Returns how many were repacked (0 without the kernels: the stats line says why)."""
    state = load()
    if state.module is None:
        return 0
    set_threads()
    skip = set()
    if not head_share and "head_share" in model:
        skip.add(id(model["head_share"]))
    count = 0
    for module in model.modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            continue
        embedding = isinstance(module, nn.QuantizedEmbedding)
        if (embedding and not tied_head) or id(module) in skip or getattr(module, "int8", False) \
                or not int8_covers(module):
            continue
        if embedding and module.bits == 8 and state.module is not None and hasattr(state.module, "int8_rows_matmul"):
            # an 8-bit tied embedding is the head as it is, read row by row (qmm.rows_product: int8_rows_matmul,
            # the bits a copy in the int8 layout gave), no copy: held once
            module.int8_rows = True
            count += 1
            continue
        # a tied embedding keeps its layout for lookups: its head (4 bits) is a copy
        w, s, b = state.module.int8_repack(module["weight"], module["scales"], module["biases"], module.group_size,
                                           module.bits, in_place=in_place and not embedding)
        prefix = "int8_" if embedding else ""
        module[prefix + "weight"], module[prefix + "scales"], module[prefix + "biases"] = w, s, b
        module.int8 = True
        count += 1
    mx.clear_cache()
    return count


class Int8WhileLoading:
    """use_int8 for the decoder layers' matrices while the rest of the rank's tensors are still being read
    (loading.load_tensors calls it with each group of tensors once evaluated, while the next group
    reads): a cold load then takes about the longer of reading and repacking, not their sum. Layers
    only: the embedding, the LM head and its share (whose rows are cut from the loaded head) and
    DeepSeek's MTP module are repacked by use_int8 afterwards, which skips what was done here, as are
    the matrices of a module that reads them again after loading (`after_load`: DeepSeek's attention).
    in_place(weight's checkpoint name): as use_int8's, per matrix (nothing else holds the freshly read
    arrays; a GGUF's weights decoded into huge pages are rearranged there whatever the rank's malloc does)."""

    def __init__(self, model: nn.Module, in_place: Callable[[str], bool]):
        self.modules = dict(model.named_modules())
        self.in_place = in_place
        self.ready: set[str] = set()  # checkpoint names evaluated so far
        self.repacked: set[str] = set()  # module paths
        self.no_biases: dict[str, mx.array] = {}  # path -> the empty biases of a symmetric matrix

    def __call__(self, weights: dict, local_names: dict[str, str]) -> None:
        """weights: the loaded arrays by checkpoint name; local_names: the group just evaluated, each
        checkpoint name with its parameter path in the model."""
        state = load()
        if state.module is None:
            return
        self.ready.update(local_names)
        candidates = {}  # module path -> its weight, scales and biases (checkpoint names)
        for name, local in local_names.items():
            stem, _, part = name.rpartition(".")
            if part in ("weight", "scales", "biases") and local.startswith("layers."):
                candidates[local.rpartition(".")[0]] = tuple(f"{stem}.{p}" for p in ("weight", "scales", "biases"))
        for path, triple in candidates.items():
            if path in self.repacked or not all(n in self.ready and n in weights for n in triple):
                continue  # the rest comes in a later group
            layout = self._layout(path, *(weights[n] for n in triple))
            if layout is None:
                continue
            set_threads()
            biases = weights[triple[2]]
            repacked = state.module.int8_repack(*(weights[n] for n in triple), *layout, in_place=self.in_place(triple[0]))
            if repacked[2].shape != biases.shape:  # a symmetric matrix's biases are not held (int8_repack):
                self.no_biases[path] = repacked[2]  # loading checks their shape, so a stand-in goes in first
                repacked = (*repacked[:2], mx.broadcast_to(mx.zeros((1,) * biases.ndim, biases.dtype), biases.shape))
            for n, array in zip(triple, repacked):
                weights[n] = array
            self.repacked.add(path)

    def _layout(self, path: str, w: mx.array, scales: mx.array, biases: mx.array) -> tuple[int, int] | None:
        """(group size, bits) where this module's matrix takes the int8 layout (as int8_covers), else None."""
        module, parent = self.modules.get(path), self.modules.get(path.rpartition(".")[0])
        if not isinstance(module, (nn.Linear, SwitchLinear)) or w.dtype != mx.uint32 or w.ndim != module.weight.ndim:
            return None
        if hasattr(parent, "after_load"):  # its weights are read again after loading (DeepSeek's kv_b_proj)
            return None
        layout = packed_layout(module.weight.shape[-1], w.shape[-1], scales.shape[-1])
        return layout if layout is not None and int8_fits(w, scales, biases, *layout) else None

    def mark(self, model: nn.Module) -> None:
        """After the arrays are in `model` (its modules now quantized): the repacked ones take the int8 path."""
        modules = dict(model.named_modules())
        for path in self.repacked:
            modules[path].int8 = True
            if path in self.no_biases:
                modules[path]["biases"] = self.no_biases[path]
