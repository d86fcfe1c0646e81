"""The model families, one module each (llama.py, qwen3_moe.py, deepseek_v3.py, deepseek_v32.py,
deepseek_v4.py), over small topic modules (rope.py, cache.py: the KV cache, packing.py: sequences
packed in one batch, layers.py: norm / attention / MLP / block, stage_slice.py: the slice a rank
holds, experts.py: MoE experts, mtp.py: the MTP drafter); the model config read from config.json
(config.py, and a family's own typed values: deepseek_v4_config.py), a family's own checkpoint
tensor names mapped to transformers' (deepseek_v4_names.py); and the family registry by
`model_type` with each family's capabilities (registry.py), which imports a family's module only
on first use. Nothing here imports MLX at package import: OpenBLAS must be bound before mlx.core
loads (kernels/blas.py), and the configs and the registry serve the planner without MLX."""
