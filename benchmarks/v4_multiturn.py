"""DeepSeek V4 multi-turn chat through `pipeline serve` (2 ranks): each turn's time to first token
with the prefix cache (the default) and with `--prefix-cache-gb 0`, and the cached tokens `usage`
reports, on a small random V4 built here with transformers (8 layers: sliding, CSA and HCA
attention, hash-routed and top-k MoE; hidden 256; window 64, rates 4 and 32, so the cache keeps a
resume point every 256 positions besides its last 64 positions). A random model's answers are
nonsense; what is measured is how much of each turn's prompt is computed again.

    python benchmarks/v4_multiturn.py [--runs 3] [--warmup 0] [--history-tokens 1500] [--max-tokens 16]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from serve_load import conversation_run, pipeline_server  # noqa: E402

LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
          "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention",
          "heavily_compressed_attention", "sliding_attention"]


def small_v4() -> Path:
    """The model folder (built once into the benchmarks' cache): weights std 0.2, so logits are far
    from uniform, and the tests' byte-level tokenizer with our V4 chat template."""
    folder = common.cache_dir() / "deepseek_v4_small"
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    import transformers

    sys.path.insert(0, str(common.REPO / "tests"))
    from conftest import VOCAB_SIZE, save_reference  # the tests' tokenizer and saving (one place)

    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(
        vocab_size=VOCAB_SIZE, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=len(LAYERS),
        num_attention_heads=8, head_dim=64, q_lora_rank=128, num_experts_per_tok=2, n_routed_experts=8,
        n_shared_experts=1, max_position_embeddings=8192, layer_types=LAYERS,
        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * (len(LAYERS) - 2),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
        sliding_window=64, o_groups=2, o_lora_rank=64, index_n_heads=8, index_head_dim=32, index_topk=64,
        partial_rotary_factor=0.25, initializer_range=0.2, eos_token_id=2, bos_token_id=None)
    save_reference(transformers.DeepseekV4ForCausalLM(config), folder)
    return folder


def main() -> None:
    parser = common.arguments(__doc__)
    parser.add_argument("--history-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    model = small_v4()
    print(f"{model}: a chat growing past {args.history_tokens} tokens, {args.max_tokens} new tokens a turn; "
          f"load {common.load_average()}", flush=True)
    contenders = {
        "prefix cache": lambda: conversation_run(lambda: pipeline_server(model, args.max_tokens),
                                                 args.history_tokens, args.max_tokens),
        "--prefix-cache-gb 0": lambda: conversation_run(
            lambda: pipeline_server(model, args.max_tokens, "--prefix-cache-gb", "0"), args.history_tokens,
            args.max_tokens),
    }
    runs = common.interleave(contenders, args.runs, args.warmup, log=lambda line: print(line[:300], flush=True))
    stats = {c: common.summarize_runs(rs, ["ttft_last"]) for c, rs in runs.items()}
    for name, rs in runs.items():
        for r in rs:
            turns = r.get("turns") or []
            print(f"{name}: " + ", ".join(f"{t['prompt_tokens']} tok ({t['cached_tokens']} cached) "
                                          f"{t['ttft_s'] * 1000:.0f} ms" for t in turns))
    print(f"load after: {common.load_average()}")
    path = common.write_json("v4_multiturn", common.record("v4_multiturn", __doc__.splitlines()[0], stats=stats,
                                                           runs=runs, load_after=common.load_average()))
    print(path)


if __name__ == "__main__":
    main()
