"""Our compiled parts and their Python wrappers, each beside its C/C++ source: OpenBLAS bound
before MLX loads and the batch-invariant BLAS shim (blas.py), the quantized products and int8
kernels (qmm.py), attention (attention.py), fused layer kernels (layer_kernels.py), GGUF/FP8
re-quantization (requantize.py) and weights over mapped file pages (mapped_files.py); the int8
layout's numbers for the planner (int8_layout.py); kernels_common.h is shared by the C++ sources.
build.py compiles, caches and loads them all. Nothing here imports MLX at package import:
blas.load() must run before mlx.core loads."""
