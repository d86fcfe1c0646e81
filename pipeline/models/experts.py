"""Mixture-of-experts building blocks: all of a layer's experts as stacked weights, run with
MLX's gather matmuls (each token multiplies only by its chosen experts' matrices), never a
Python loop over experts."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..kernels import qmm
from .layers import swiglu


class SwitchLinear(nn.Module):
    """`num_experts` linear maps stacked as weight [experts, out, in]."""

    def __init__(self, in_features: int, out_features: int, num_experts: int):
        super().__init__()
        scale = in_features ** -0.5
        # Lazily evaluated: never materialised when checkpoint weights replace it.
        self.weight = mx.random.uniform(-scale, scale, (num_experts, out_features, in_features))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if self.weight.dtype != mx.float32 and mx.default_device() == mx.cpu:
            return self._float32_on_cpu(x, indices, sorted_indices)
        return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=indices,
                            sorted_indices=sorted_indices)

    def _float32_on_cpu(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        """MLX's CPU gather_mm takes float32 only (bfloat16 raises), so with `--dtype bfloat16`
        the experts' weights are widened for the product alone: the chosen experts' matrices
        when tokens x k is under the number of experts (decode), else the whole stack (prefill).
        The widened copy is transient but not small: a prefill step holds a float32 copy of a
        projection's whole stack (for DeepSeek V3, 256 x 2048 x 7168 x 4 bytes = 15 GB)."""
        if indices.size < self.weight.shape[0]:
            w = self.weight[indices].astype(mx.float32)  # [*indices.shape, out, in]
            out = x.astype(mx.float32) @ w.swapaxes(-1, -2)
        else:
            out = mx.gather_mm(x.astype(mx.float32), self.weight.astype(mx.float32).swapaxes(-1, -2),
                               rhs_indices=indices, sorted_indices=sorted_indices)
        return out.astype(x.dtype)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_) -> "QuantizedSwitchLinear":
        return QuantizedSwitchLinear.from_dense(self, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with MLX affine-quantized weights (packed uint32 + scales + biases)."""

    def __init__(self, in_features: int, out_features: int, num_experts: int, group_size: int = 64,
                 bits: int = 4, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self._set(mx.quantize(mx.zeros((num_experts, out_features, in_features)), group_size=group_size, bits=bits,
                              mode=mode))

    def _set(self, quantized: tuple) -> None:
        """weight and scales, and biases in affine mode (MLX's mxfp4/mxfp8 have none)."""
        self.weight, self.scales = quantized[0], quantized[1]
        if self.mode == "affine":
            self.biases = quantized[2]

    @classmethod
    def from_dense(cls, dense: SwitchLinear, group_size: int, bits: int, mode: str) -> "QuantizedSwitchLinear":
        experts, out_features, in_features = dense.weight.shape
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.group_size, module.bits, module.mode = group_size, bits, mode
        module._set(mx.quantize(dense.weight, group_size=group_size, bits=bits, mode=mode))
        return module

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        # pipeline's kernels (qmm.py) group the rows per expert themselves; MLX's where they do not apply
        return qmm.gather_qmm(x, self.weight, self.scales, self.get("biases"), rhs_indices=indices, transpose=True,
                              group_size=self.group_size, bits=self.bits, mode=self.mode,
                              sorted_indices=sorted_indices, int8=getattr(self, "int8", False))

    def after_load(self) -> None:
        """Once its arrays are in: a GGUF stack held in its own blocks (kernels/qmm.py) becomes a GGUFSwitchLinear."""
        if qmm.is_gguf_native(self["scales"], self.mode):
            self.__class__ = GGUFSwitchLinear
        elif not qmm.hold_symmetric(self):  # a Q5_0 stack: no biases held (qmm.full_biases computes them per product)
            qmm.hold_half(self)  # a Q5_1 stack: its float16 d and m as float16


class GGUFSwitchLinear(nn.Module):
    """An expert stack held in a GGUF file's own blocks (weight: the codes, scales, and Q6_K's d as biases,
    [experts, out, ...]: checkpoints/quants.py native_arrays): each token times its chosen experts' matrices as
    llama.cpp computes them (qmm.gguf_gather). Not an MLX quantized module (the int8 repack and
    --weights-in-memory's dequantization leave it as it is)."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return qmm.gguf_gather(x, self["weight"], self["scales"], self.get("biases"), indices)


class GGUFBlocksSwitchLinear(qmm.GGUFBlocksLinear):
    """An expert stack held as a GGUF file's row bytes (checkpoints/quants.py BLOCKS: the K-quants, ternary and grid
    i-quant types): `weight` uint8 [experts, out, row bytes], `ggml_type` int32 [1] (the type id, also the int
    `type_id`); each token times its chosen experts' matrices as llama.cpp computes them (qmm.gguf_blocks_gather).
    A SwitchLinear becomes one where the loaded arrays say so (checkpoints/weights.py, before they go in: `become`);
    what handles MLX's layouts (the int8 repack, --weights-in-memory's dequantizing) leaves it as it is."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return qmm.gguf_blocks_gather(x, self["weight"], self.type_id, indices)


class SwitchGLU(nn.Module):
    """The routed experts of a layer, each a SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(hidden, intermediate, num_experts)
        self.up_proj = SwitchLinear(hidden, intermediate, num_experts)
        self.down_proj = SwitchLinear(intermediate, hidden, num_experts)

    def activate(self, gate: mx.array, up: mx.array) -> mx.array:
        return swiglu(gate, up)  # nn.silu(gate) * up, the same bits (models/layers.py)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x: [tokens, hidden]; indices: [tokens, k] chosen experts -> [tokens, k, hidden]."""
        x = x[:, None, None, :]  # [tokens, 1, 1, hidden]: broadcast against the k experts
        # With many tokens, grouping token-expert pairs by expert lets the kernel read each
        # expert's weights once.
        do_sort = indices.size >= 64
        order = None
        if do_sort:
            flat = indices.flatten()
            order = mx.argsort(flat)
            x = x[order // indices.shape[-1]]  # [pairs, 1, 1, hidden]
            idx = flat[order][:, None]
        else:
            idx = indices
        if type(self).activate is SwitchGLU.activate and qmm.gathers_together(self.gate_proj, self.up_proj, x):
            h = qmm.gather_swiglu(x, self.gate_proj, self.up_proj, idx)  # one int8 operation, the same bits
        else:
            h = self.activate(self.gate_proj(x, idx, do_sort), self.up_proj(x, idx, do_sort))
        out = self.down_proj(h, idx, do_sort)  # [..., 1, hidden]
        if do_sort:
            inverse = mx.argsort(order)
            out = out[inverse].reshape(*indices.shape, -1)
        else:
            out = out.squeeze(-2)
        return out
