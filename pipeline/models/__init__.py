"""The model families, one module each (llama.py, qwen3_moe.py, deepseek_v3.py, deepseek_v32.py,
deepseek_v4.py), over small topic modules (RoPE, the KV cache, attention / MLP / block layers, the
stage slice a rank holds, MoE experts, the MTP drafter); the model config read from config.json
(config.py, and a family's own typed values: deepseek_v4_config.py); and the family registry by
`model_type` with each family's capabilities (registry.py), which imports a family's module only
on first use. Nothing here imports MLX at package import: OpenBLAS must be bound before mlx.core
loads (kernels/blas.py), and the configs and the registry serve the planner without MLX."""
