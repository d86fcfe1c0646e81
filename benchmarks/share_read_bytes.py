"""Bytes each --tensor-parallel rank reads from a GGUF file or a safetensors folder against its share
(checkpoints/share_reads.py).

For each member of one stage's group of T (all layers; member 0 also the embedding, as generate loads them): the
bytes its checkpoint read (the reader's count: its shares' bytes, row runs and strided column runs), its share of
the file's tensor bytes (each tensor's rows, columns or experts it holds, from the header), the whole file's tensor
bytes, and the distinct pages those reads touch at 4 KiB (Linux) and 16 KiB (macOS): a column share shorter than a
page still touches the pages of the other members' columns of the same rows. Per kind of tensor cut by columns
(o_proj, down_proj, expert down stacks) too, where pages cost the most. In process (one member at a time),
nothing timed.

    python benchmarks/share_read_bytes.py --model FILE.gguf [--tensor-parallel 2]
    python benchmarks/share_read_bytes.py --model FOLDER [--tensor-parallel 2] [--expert-parallel]
    python benchmarks/share_read_bytes.py --make-deepseek-fp8 FOLDER   # then --model FOLDER

A folder's share is what the cut keeps (an FP8 weight's rows or columns, not the 128 x 128 blocks they lie in),
so FP8's bytes read exceed it where a share's edge falls inside a block. `--make-deepseek-fp8` writes a folder
of DeepSeek V3's row widths in FP8 as DeepSeek publishes it (hidden 7168, 128 heads, q/kv latents 1536/512,
experts of 2048 features, e4m3 with a float32 scale per 128 x 128 block), with few layers and experts (2 MoE
layers of 8 routed + 1 shared expert, a 2048-token vocabulary; random bytes): the page figures depend on the row
widths, not on the counts.

The last line is the deciding figure: the worst member's bytes read, its share, and its 4 / 16 KiB pages, each as a
fraction of the file's tensor bytes.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

import numpy as np

import pipeline  # noqa: F401 -- first (BLAS binding)

import mlx.core as mx

from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
from pipeline.checkpoints.model_files import locate
from pipeline.checkpoints.safetensors_checkpoint import Checkpoint
from pipeline.checkpoints.share_reads import Runs, narrowed, pages_read, read_shares, safetensors_reads
from pipeline.models.tensor_parallel import Shard
from pipeline.models.vocab_split import vocab_share
from pipeline.runtime.stage import Stage

MiB = 1 << 20
KIND = re.compile(r"^model\.layers\.\d+\.(.+)\.[^.]+$")


def member_figures(path: str, t: int, member: int) -> dict:
    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.model_config()
    vocab = vocab_share(config.vocab_size, t, member)
    stage = Stage.load(config, checkpoint, (0, config.num_hidden_layers), has_ends=member == 0, dtype=mx.float32,
                       shard=Shard(member, t), vocab_slice=vocab)
    names = stage.loaded_tensors
    shares = read_shares(names, config, Shard(member, t), vocab, member == 0)
    fresh = GGUFCheckpoint(path)
    read, kinds = {}, defaultdict(lambda: [0, 0, 0])  # kind -> [share bytes, 4 KiB pages, 16 KiB pages]
    with narrowed(fresh, shares):
        for name in names:
            for tensor in fresh.tensors[name].source:
                read[tensor.name] = tensor
                kind = KIND.match(name)
                if name in shares and shares[name][0] == -1 and kind:
                    figures = kinds[kind.group(1)]
                    if tensor.name not in figures:
                        figures.append(tensor.name)
                        figures[0] += tensor.nbytes
                        figures[1] += pages_read([tensor], 4096)
                        figures[2] += pages_read([tensor], 16384)
    return dict(bytes_read=checkpoint.bytes_read, share=sum(t.nbytes for t in read.values()),
                pages4=pages_read(read.values(), 4096), pages16=pages_read(read.values(), 16384),
                file=sum(t.nbytes for t in checkpoint.gguf.tensors.values()), kinds=kinds)


def folder_figures(path: str, t: int, member: int, experts: bool) -> dict:
    """member_figures of a safetensors folder: the reader's count of bytes read, the shares the cut keeps (from the
    header: each tensor's bytes times the fraction of its rows, columns or experts kept), the pages of the runs read."""
    checkpoint = locate(path).open(None)
    config = checkpoint.model_config()
    vocab, shard = vocab_share(config.vocab_size, t, member), Shard(member, t, experts)
    stage = Stage.load(config, checkpoint, (0, config.num_hidden_layers), has_ends=member == 0, dtype=mx.float32,
                       shard=shard, vocab_slice=vocab)
    index = Checkpoint(path).tensors  # as read (the loaded checkpoint's index is the same; read afresh, untouched)
    kept = read_shares(index, config, shard, vocab, member == 0, whole_blocks=False)
    plan = safetensors_reads(index, read_shares(index, config, shard, vocab, member == 0))
    share, runs, kinds = 0, [], defaultdict(lambda: [0, 0, 0])
    for name in stage.loaded_tensors:
        info = index[name]
        if name in plan.absent:
            continue  # another member's expert: not read, none of it kept
        fraction = 1.0
        if name in kept and not (kept[name][0] == -3 and len(info.shape) == 2):
            _, begin, end, of = kept[name]
            fraction = (end - begin) / of
        share += info.nbytes * fraction
        read = plan.runs[name][1] if name in plan.runs else Runs(info.file, info.begin, info.nbytes, 1, 0)
        runs.append(read)
        kind = KIND.match(name)
        if name in plan.runs and name in kept and kept[name][0] == -1 and kind:
            figures = kinds[re.sub(r"experts\.\d+\.", "experts.", kind.group(1))]
            figures[0] += info.nbytes * fraction
            figures[1] += pages_read([read], 4096)
            figures[2] += pages_read([read], 16384)
    return dict(bytes_read=checkpoint.bytes_read, share=share, pages4=pages_read(runs, 4096),
                pages16=pages_read(runs, 16384), file=sum(i.nbytes for i in index.values()), kinds=kinds)


def make_deepseek_fp8(folder: str) -> None:
    """A DeepSeek V3-shaped FP8 folder (see the module docstring): random e4m3 bytes (finite: no NaN codes) and
    block scales, float32 norms, router and embedding."""
    from pathlib import Path

    config = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
                  num_hidden_layers=2, num_attention_heads=128, num_key_value_heads=128, intermediate_size=18432,
                  moe_intermediate_size=2048, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                  n_group=1, topk_group=1, first_k_dense_replace=0, q_lora_rank=1536, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=2048,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
                  quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                       "activation_scheme": "dynamic"})
    rng = np.random.default_rng(0)
    h, heads, moe = config["hidden_size"], config["num_attention_heads"], config["moe_intermediate_size"]
    tensors: dict[str, np.ndarray] = {}

    def fp8(name: str, rows: int, cols: int) -> None:
        tensors[name] = (rng.integers(0, 0x7E, (rows, cols), dtype=np.uint8) | (rng.integers(0, 2, (rows, cols),
                         dtype=np.uint8) << 7))  # sign, exponent and mantissa below 0x7F: finite e4m3
        tensors[name + "_scale_inv"] = rng.uniform(1e-4, 1e-3, (-(-rows // 128), -(-cols // 128))).astype(np.float32)

    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        fp8(p + "self_attn.q_a_proj.weight", 1536, h)
        fp8(p + "self_attn.q_b_proj.weight", heads * 192, 1536)
        fp8(p + "self_attn.kv_a_proj_with_mqa.weight", 512 + 64, h)
        fp8(p + "self_attn.kv_b_proj.weight", heads * 256, 512)
        fp8(p + "self_attn.o_proj.weight", h, heads * 128)
        for norm, size in (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_a_layernorm", 1536),
                           ("self_attn.kv_a_layernorm", 512)):
            tensors[p + norm + ".weight"] = np.ones(size, np.float32)
        tensors[p + "mlp.gate.weight"] = rng.standard_normal((8, h)).astype(np.float32) * 0.02
        tensors[p + "mlp.gate.e_score_correction_bias"] = np.zeros(8, np.float32)
        for expert in [f"experts.{e}" for e in range(8)] + ["shared_experts"]:
            fp8(p + f"mlp.{expert}.gate_proj.weight", moe, h)
            fp8(p + f"mlp.{expert}.up_proj.weight", moe, h)
            fp8(p + f"mlp.{expert}.down_proj.weight", h, moe)
    tensors["model.embed_tokens.weight"] = rng.standard_normal((2048, h)).astype(np.float32) * 0.02
    tensors["model.norm.weight"] = np.ones(h, np.float32)
    tensors["lm_head.weight"] = rng.standard_normal((2048, h)).astype(np.float32) * 0.02
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors, fp8={n for n in tensors if n + "_scale_inv" in tensors})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    print(f"wrote {out} ({sum(a.nbytes for a in tensors.values()) / MiB:.0f} MiB)")


def write_safetensors(path, tensors: dict, fp8: set) -> None:
    """A safetensors file (its published layout: an 8-byte header length, the JSON header, the bytes), the uint8
    arrays named in `fp8` as F8_E4M3 (numpy has no such dtype to hand the safetensors package)."""
    names = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": "F8_E4M3" if name in fp8 else names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--expert-parallel", action="store_true", help="a folder's experts whole (MoE)")
    parser.add_argument("--make-deepseek-fp8", metavar="FOLDER")
    args = parser.parse_args()
    if args.make_deepseek_fp8:
        make_deepseek_fp8(args.make_deepseek_fp8)
        return
    if not args.model:
        parser.error("--model FILE.gguf or FOLDER is required")
    t, worst = args.tensor_parallel, None
    gguf = args.model.endswith(".gguf")
    for member in range(t):
        f = member_figures(args.model, t, member) if gguf else folder_figures(args.model, t, member,
                                                                               args.expert_parallel)
        pct = {k: 100 * f[k] / f["file"] for k in ("bytes_read", "share", "pages4", "pages16")}
        print(f"member {member}/{t}: read {f['bytes_read'] / MiB:.1f} MiB ({pct['bytes_read']:.1f}% of the file's "
              f"{f['file'] / MiB:.1f} MiB of tensors; its share {f['share'] / MiB:.1f} MiB, {pct['share']:.1f}%); "
              f"pages touched: 4 KiB {f['pages4'] / MiB:.1f} MiB ({pct['pages4']:.1f}%), 16 KiB "
              f"{f['pages16'] / MiB:.1f} MiB ({pct['pages16']:.1f}%)")
        for kind, (share, p4, p16, *_) in sorted(f["kinds"].items()):
            print(f"  {kind} (columns): share {share / MiB:.2f} MiB, pages 4 KiB {p4 / MiB:.2f} MiB "
                  f"({p4 / share:.2f}x), 16 KiB {p16 / MiB:.2f} MiB ({p16 / share:.2f}x)")
        if worst is None or pct["bytes_read"] > worst[0]:
            worst = (pct["bytes_read"], pct["share"], pct["pages4"], pct["pages16"])
    print(f"T={t} worst member: reads {worst[0]:.1f}% of the file's tensor bytes (share {worst[1]:.1f}%; "
          f"4 KiB pages {worst[2]:.1f}%, 16 KiB pages {worst[3]:.1f}%)")


if __name__ == "__main__":
    main()
