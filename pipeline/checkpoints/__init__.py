"""What `--model` names, opened once (model_files.py): a folder of safetensors (plain, MLX-quantized,
FP8, INT4) or a GGUF file, read tensor by tensor so a rank reads only its own (safetensors_checkpoint.py,
gguf_checkpoint.py over gguf_file.py's header, with gguf_config.py for its config; tensor_names.py, the
names a rank owns), loaded into its slice (weights.py; weights_in_memory.py chooses packed or dense),
the formats' adaptations into MLX layouts (format_adapters.py, quants.py), loading at disk speed (loading.py),
the int8 repack of loaded layers (int8_repack.py), DeepSeek's MTP module on rank 0 (mtp.py), the
default model (default_model.py), the GGUF converter (gguf_convert.py, writing aligned files with
safetensors_file.py) and the tokenizer with its chat template (tokenizer.py, gguf_tokenizer.py for a
GGUF's, split_patterns.py for the pre-tokenizer regexes both use, templates/ for templates a
checkpoint does not ship)."""
