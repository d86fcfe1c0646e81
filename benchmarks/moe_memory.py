"""Peak resident memory per rank against the bytes each rank owns, on a DeepSeek-V3-shaped
random checkpoint stored like DeepSeek's published weights (FP8 e4m3, 128x128 block scales).

    python benchmarks/moe_memory.py [--ranks 2] [--layers 8] [--hidden 1024] [--experts 64]

Runs `pipeline generate` three ways: FP8 dequantized to fp32, and re-quantized to 8 and 4 bits
while loading. Prints, per rank, peak RSS, the bytes it owns (weights + KV cache) and the ratio.
The Python + MLX + MPI runtime itself costs a fixed ~150-250 MiB per process, so the ratio is
only meaningful once the slices are large; the figure to watch is RSS - baseline vs owned.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_checkpoint(folder: Path, layers: int, hidden: int, experts: int) -> int:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    moe_inter, heads, vocab = hidden // 2, 8, 4096
    config = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                  intermediate_size=hidden * 2, moe_intermediate_size=moe_inter, n_routed_experts=experts,
                  num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=1,
                  q_lora_rank=hidden // 2, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                  v_head_dim=64, vocab_size=vocab, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_theta=10000.0, routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
                  eos_token_id=1, bos_token_id=0,
                  quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    total = 0

    def fp8(rows: int, cols: int) -> dict:
        w = (torch.randn(rows, cols) * 0.02)
        scale_inv = torch.full(((rows + 127) // 128, (cols + 127) // 128), 0.02 * 4 / 448.0)
        return {"weight": (w / scale_inv[0, 0]).to(torch.float8_e4m3fn), "weight_scale_inv": scale_inv}

    def add(tensors: dict, name: str, parts: dict) -> None:
        nonlocal total
        for suffix, t in parts.items():
            tensors[f"{name}.{suffix}"] = t.contiguous()
            total += t.numel() * t.element_size()

    shard = {}
    add(shard, "model.embed_tokens", {"weight": torch.randn(vocab, hidden, dtype=torch.bfloat16) * 0.02})
    add(shard, "model.norm", {"weight": torch.ones(hidden, dtype=torch.bfloat16)})
    add(shard, "lm_head", {"weight": torch.randn(vocab, hidden, dtype=torch.bfloat16) * 0.02})
    files = {"model-ends.safetensors": shard}
    q_head = 96
    for i in range(layers):
        t, p = {}, f"model.layers.{i}"
        add(t, f"{p}.input_layernorm", {"weight": torch.ones(hidden, dtype=torch.bfloat16)})
        add(t, f"{p}.post_attention_layernorm", {"weight": torch.ones(hidden, dtype=torch.bfloat16)})
        a = f"{p}.self_attn"
        add(t, f"{a}.q_a_proj", fp8(hidden // 2, hidden))
        add(t, f"{a}.q_a_layernorm", {"weight": torch.ones(hidden // 2, dtype=torch.bfloat16)})
        add(t, f"{a}.q_b_proj", fp8(heads * q_head, hidden // 2))
        add(t, f"{a}.kv_a_proj_with_mqa", fp8(256 + 32, hidden))
        add(t, f"{a}.kv_a_layernorm", {"weight": torch.ones(256, dtype=torch.bfloat16)})
        add(t, f"{a}.kv_b_proj", fp8(heads * 128, 256))
        add(t, f"{a}.o_proj", fp8(hidden, heads * 64))
        m = f"{p}.mlp"
        if i == 0:
            for proj, shape in (("gate_proj", (hidden * 2, hidden)), ("up_proj", (hidden * 2, hidden)),
                                ("down_proj", (hidden, hidden * 2))):
                add(t, f"{m}.{proj}", fp8(*shape))
        else:
            add(t, f"{m}.gate", {"weight": torch.randn(experts, hidden, dtype=torch.bfloat16) * 0.02,
                                 "e_score_correction_bias": torch.zeros(experts)})
            for e in range(experts):
                for proj, shape in (("gate_proj", (moe_inter, hidden)), ("up_proj", (moe_inter, hidden)),
                                    ("down_proj", (hidden, moe_inter))):
                    add(t, f"{m}.experts.{e}.{proj}", fp8(*shape))
            for proj, shape in (("gate_proj", (moe_inter, hidden)), ("up_proj", (moe_inter, hidden)),
                                ("down_proj", (hidden, moe_inter))):
                add(t, f"{m}.shared_experts.{proj}", fp8(*shape))
        files[f"model-{i:05d}.safetensors"] = t
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, str(folder / name))
        weight_map.update({k: name for k in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    _write_tokenizer(folder)
    return total


def _write_tokenizer(folder: Path) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import write_tokenizer

    write_tokenizer(folder)


def run(folder: Path, ranks: int, extra: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "pipeline", "generate", "--model", str(folder),
           "--prompt", "hello", "--max-tokens", "4", "--no-chat-template", "--weights-in-memory", "quantized", *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode:
        raise SystemExit(result.stderr)
    return [line for line in result.stderr.splitlines() if line.startswith("[pipeline]")][-1]


def baseline_rss_mib() -> float:
    """Peak RSS of a process that has imported the runtime and MPI but loaded no weights."""
    code = ("import mpi4py.MPI, mlx.core as mx, pipeline.runtime.job, pipeline.runtime.rank_figures, "
            "pipeline.checkpoints.tokenizer; "
            "mx.eval(mx.zeros(1)); print(pipeline.runtime.rank_figures.peak_rss_bytes() / 2**20)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return float(out.stdout.strip())


def mib(size: str) -> float:
    value, unit = size.split()
    return float(value) * {"KiB": 2**-10, "MiB": 1.0, "GiB": 2**10}[unit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "deepseek-fp8"
        size = make_checkpoint(folder, args.layers, args.hidden, args.experts)
        print(f"checkpoint: {size / 2**20:.0f} MiB on disk (FP8 + bf16), {args.layers} layers, "
              f"{args.experts} experts, hidden {args.hidden}, {args.ranks} ranks")
        base = baseline_rss_mib()
        print(f"baseline RSS of a rank before loading weights: {base:.0f} MiB")
        for label, extra in (("fp8 -> fp32", []), ("--quantize 8", ["--quantize", "8"]),
                             ("--quantize 4", ["--quantize", "4"])):
            line = run(folder, args.ranks, extra)
            # the stats line: "peak RSS r0 172 MiB (weights 69.3 MiB + KV cache 5.2 MiB), r1 ..."
            ranks = re.findall(r"r(\d+) ([\d.]+ [KMG]iB) \(weights ([\d.]+ [KMG]iB)(?: \+ KV cache ([\d.]+ [KMG]iB))?",
                               line)
            if not ranks:
                raise SystemExit(f"no per-rank peak RSS in the stats line: {line}")
            cells = []
            for r, rss, weights, kv in ranks:
                rss, own = mib(rss), mib(weights) + (mib(kv) if kv else 0.0)
                cells.append(f"r{r}: RSS {rss:.0f} MiB / owns {own:.0f} MiB = {rss / max(own, 1):.2f}x "
                             f"({(rss - base) / max(own, 1):.2f}x above baseline)")
            cells = ", ".join(cells)
            print(f"{label:>14}: {cells}")


if __name__ == "__main__":
    main()
