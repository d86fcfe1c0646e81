"""Capacity planner: does a model fit on these hosts, how are its layers split, how fast can it go.

Everything comes from config.json alone (no weights): the parameter shapes of each layer are
written out per family, the same shapes and checkpoint names the published files hold.

Bytes per parameter, resident (in memory at run time, as `formats.adapt_tensors` loads them):
- float tensors are held in the activation dtype (`--dtype`: 4 B for float32, 2 B for
  bfloat16/float16), whatever they were on disk; DeepSeek's FP8 weights are dequantized into it
  (MLX has no FP8 matmul);
- MLX affine b-bit, group g (`--quantize b --group-size g`, or an MLX-quantized folder): b/8 B
  packed plus one scale and one bias per g values, each in the dtype: b/8 + 2*dtype/g B
  (4-bit, group 64, bfloat16: 0.5 + 4/64 = 0.5625 B). `--quantize` takes every matrix whose
  rows divide into groups (embedding and LM head included) except MoE routers;
- compressed-tensors INT4 (Kimi K2 Thinking's routed experts, symmetric, group 32) maps exactly
  onto MLX affine 4-bit group 32 (scale s, bias -8s): 0.5 + 2*dtype/32 B.
On disk (the checkpoint's own format, reported for comparison with download sizes): bf16 2 B;
FP8 e4m3 1 B plus one fp32 scale_inv per 128x128 block (1 + 4/16384 B); pack-quantized INT4
0.5 B plus one bf16 scale per 32 values (0.5625 B) and an int64[2] shape per tensor.

Decode roofline (`predict`): decoding is memory-bound, so a stage's time for a step is the bytes
it reads divided by its host's memory bandwidth: its non-expert weights (always), for MoE layers
the distinct experts its tokens chose (m tokens choosing k of E experts uniformly and
independently touch E*(1-(1-k/E)^m) experts), and each sequence's KV cache at the full context.
Each hop moves m hidden states (m*hidden*dtype bytes) over a link of --link-gbs plus
--link-latency-us. One stream visits the stages in turn: tok/s = 1 / (sum of stage times + hops).
A batch of B sequences decoded as k = min(B, stages) micro-batches keeps the stages busy at once:
tok/s = B / max(one micro-batch's round trip, k * the slowest stage or link).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ..models.config import ModelConfig
from ..util.errors import UserError
from .memory import RankBytes, rank_bytes, size
from .partition import LAYER_OVERHEAD_BYTES, balanced_counts, check_ranks, layer_ranges

GIB = 1024**3
CONFIG_DIR = Path(__file__).with_name("configs")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
DEEPSEEK_FAMILY = ("deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v32")
KNOWN_TYPES = (*LLAMA_FAMILY, "qwen3_moe", *DEEPSEEK_FAMILY, "deepseek_v4")


# ------------------------------------------------------------------------------------- configs

def bundled_configs() -> dict[str, Path]:
    """The real configurations shipped in pipeline/planner/configs, by lower-case name."""
    return {p.stem.lower(): p for p in sorted(CONFIG_DIR.glob("*.json"))}


def load_config(spec: str | Path) -> ModelConfig:
    """A model folder, a GGUF file (its metadata), a config.json file, or the name of a bundled config
    (e.g. DeepSeek-V3.1)."""
    path = Path(spec)
    from ..checkpoints.model_files import is_gguf, open_checkpoint

    if is_gguf(path):
        return open_checkpoint(path).model_config()
    if path.is_dir():
        return ModelConfig.from_folder(path)
    if not path.is_file():
        path = bundled_configs().get(str(spec).lower().removesuffix(".json"))
        if path is None:
            names = ", ".join(p.stem for p in bundled_configs().values())
            raise UserError(f"--model {spec}: not a model folder, a config.json file or a bundled config "
                            f"({names})")
    try:
        return ModelConfig.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None


# ------------------------------------------------------------------------ parameter shapes

@dataclass(frozen=True)
class Param:
    """One tensor of the checkpoint; routed experts: one entry stands for all `experts` copies
    (named as expert 0)."""
    name: str
    shape: tuple[int, ...]
    experts: int = 0

    @property
    def copies(self) -> int:
        return self.experts or 1

    @property
    def size(self) -> int:  # elements of one copy
        return math.prod(self.shape)

    @property
    def numel(self) -> int:
        return self.size * self.copies

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def is_matrix(self) -> bool:
        return self.name.endswith(".weight") and len(self.shape) == 2

    @property
    def is_router(self) -> bool:
        return self.name.endswith("mlp.gate.weight")

    @property
    def is_embedding(self) -> bool:
        return self.name.endswith("embed_tokens.weight")

    @property
    def is_linear(self) -> bool:
        """A weight of an nn.Linear (what FP8 and compressed-tensors quantize); routers are
        plain parameters in DeepSeek's code and kept out everywhere."""
        return self.is_matrix and not self.is_router and not self.is_embedding

    @property
    def is_index_table(self) -> bool:
        """DeepSeek V4's token -> experts table of a hash-routed layer: int64, never cast."""
        return self.name.endswith("tid2eid")


@dataclass
class Architecture:
    config: ModelConfig
    layers: list[list[Param]]  # per decoder layer, in order
    ends: list[Param]  # embedding, final norm, LM head: rank 0's extra share
    unused: list[Param]  # in the checkpoint, never run (DeepSeek's multi-token-prediction module)
    top_k: int  # routed experts chosen per token (0: dense)
    kv_values: float  # cached values per token per layer (DeepSeek V4: the mean over its layers)
    kv_note: str
    # DeepSeek V4, whose caches differ by layer: per layer (values per token, values per sequence
    # whatever its length, kind); None: kv_values per token in every layer.
    kv_layers: list[tuple[float, int, str]] | None = None
    hidden_values: int = 0  # values per token between ranks (V4: its residual streams); 0: hidden_size

    @property
    def name(self) -> str:
        return self.config.model_type

    def kv_cached(self, start: int, end: int, context: int) -> float:
        """Values one sequence of `context` tokens caches in layers [start, end)."""
        if self.kv_layers is None:
            return self.kv_values * context * (end - start)
        return sum(per_token * context + fixed for per_token, fixed, _ in self.kv_layers[start:end])

    def kv_read(self, layer: int, context: int) -> float:
        """Values a decode step of one sequence reads from layer `layer`'s cache at `context` tokens:
        all of it, but for V4's compressed sparse layers the indexer's keys and the top-k entries
        (plus the window)."""
        if self.kv_layers is None:
            return self.kv_values * context
        per_token, fixed, kind = self.kv_layers[layer]
        if kind != "compressed_sparse_attention":
            return per_token * context + fixed
        r = self.config.raw
        rate, top_k = _v4_rate(self.config, kind), int(r.get("index_topk", 512))
        entries = context // rate
        return fixed + entries * int(r.get("index_head_dim", 128)) + min(entries, top_k) * self.config.head_dim


def architecture(config: ModelConfig) -> Architecture:
    t = config.model_type
    if t in LLAMA_FAMILY or t == "qwen3_moe":
        layers = [_gqa_layer(config, i) for i in range(config.num_hidden_layers)]
        top_k = int(config.raw.get("num_experts_per_tok", 0)) if t == "qwen3_moe" else 0
        kv = 2 * config.num_key_value_heads * config.head_dim
        note = f"keys+values, {config.num_key_value_heads} KV heads x {config.head_dim}"
        unused: list[Param] = []
    elif t in DEEPSEEK_FAMILY:
        r = config.raw
        layers = [_deepseek_layer(config, i) for i in range(config.num_hidden_layers)]
        top_k = int(r.get("num_experts_per_tok", 0))
        kv = int(r["kv_lora_rank"]) + int(r["qk_rope_head_dim"])
        note = f"MLA latent, kv_lora_rank {r['kv_lora_rank']} + rope {r['qk_rope_head_dim']}"
        if t == "deepseek_v32":  # the lightning indexer's key of each position is cached too
            kv += int(r["index_head_dim"])
            note += f" + indexer key {r['index_head_dim']}"
        unused = []
        for k in range(int(r.get("num_nextn_predict_layers") or 0)):
            i = config.num_hidden_layers + k
            p, d = f"model.layers.{i}", config.hidden_size
            unused += [Param(f"{p}.enorm.weight", (d,)), Param(f"{p}.hnorm.weight", (d,)),
                       Param(f"{p}.eh_proj.weight", (d, 2 * d)), *_deepseek_layer(config, i),
                       Param(f"{p}.shared_head.norm.weight", (d,)),
                       # The checkpoint stores its own copies of the embedding and the LM head.
                       Param(f"{p}.embed_tokens.weight", (config.vocab_size, d)),
                       Param(f"{p}.shared_head.head.weight", (config.vocab_size, d))]
    elif t == "deepseek_v4":
        return _deepseek_v4_architecture(config)
    else:
        raise UserError(f"the planner does not know model_type {t!r} (known: {', '.join(KNOWN_TYPES)})")
    v, d = config.vocab_size, config.hidden_size
    ends = [Param("model.embed_tokens.weight", (v, d)), Param("model.norm.weight", (d,))]
    if not config.tie_word_embeddings:
        ends.append(Param("lm_head.weight", (v, d)))
    return Architecture(config, layers, ends, unused, top_k, kv, note)


def _linear(name: str, out: int, inp: int, bias: bool = False, experts: int = 0) -> list[Param]:
    params = [Param(f"{name}.weight", (out, inp), experts)]
    if bias:
        params.append(Param(f"{name}.bias", (out,), experts))
    return params


def _norm(name: str, dim: int) -> list[Param]:
    return [Param(f"{name}.weight", (dim,))]


def _mlp(prefix: str, hidden: int, inter: int, bias: bool = False, experts: int = 0) -> list[Param]:
    return (_linear(f"{prefix}.gate_proj", inter, hidden, bias, experts)
            + _linear(f"{prefix}.up_proj", inter, hidden, bias, experts)
            + _linear(f"{prefix}.down_proj", hidden, inter, bias, experts))


def _gqa_layer(c: ModelConfig, i: int) -> list[Param]:
    """Llama/Mistral/Qwen2/Qwen3 (q/k norm) and Qwen3-MoE layers."""
    p, d, hd = f"model.layers.{i}", c.hidden_size, c.head_dim
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    qkv_bias = c.attention_bias
    out_bias = qkv_bias and c.model_type != "qwen2"  # Qwen2: bias on q/k/v only
    a = f"{p}.self_attn"
    params = (_norm(f"{p}.input_layernorm", d) + _norm(f"{p}.post_attention_layernorm", d)
              + _linear(f"{a}.q_proj", heads * hd, d, qkv_bias) + _linear(f"{a}.k_proj", kv * hd, d, qkv_bias)
              + _linear(f"{a}.v_proj", kv * hd, d, qkv_bias) + _linear(f"{a}.o_proj", d, heads * hd, out_bias))
    if c.qk_norm:
        params += _norm(f"{a}.q_norm", hd) + _norm(f"{a}.k_norm", hd)
    r = c.raw
    experts = int(r.get("num_experts") or r.get("num_local_experts") or 0) if c.model_type == "qwen3_moe" else 0
    step = int(r.get("decoder_sparse_step", 1) or 1)
    if experts and i not in (r.get("mlp_only_layers") or []) and (i + 1) % step == 0:
        params += [Param(f"{p}.mlp.gate.weight", (experts, d))]
        params += _mlp(f"{p}.mlp.experts.0", d, int(r["moe_intermediate_size"]), experts=experts)
    else:
        params += _mlp(f"{p}.mlp", d, c.intermediate_size, c.mlp_bias)
    return params


def _deepseek_layer(c: ModelConfig, i: int) -> list[Param]:
    """DeepSeek V3 / Kimi K2: multi-head latent attention, then a dense MLP (the first
    first_k_dense_replace layers) or routed + shared experts."""
    r, p, d = c.raw, f"model.layers.{i}", c.hidden_size
    heads = c.num_attention_heads
    nope, rope, v = int(r["qk_nope_head_dim"]), int(r["qk_rope_head_dim"]), int(r["v_head_dim"])
    kv_lora, q_lora = int(r["kv_lora_rank"]), r.get("q_lora_rank")
    bias = bool(r.get("attention_bias", False))
    a = f"{p}.self_attn"
    params = _norm(f"{p}.input_layernorm", d) + _norm(f"{p}.post_attention_layernorm", d)
    if q_lora:
        params += (_linear(f"{a}.q_a_proj", int(q_lora), d, bias) + _norm(f"{a}.q_a_layernorm", int(q_lora))
                   + _linear(f"{a}.q_b_proj", heads * (nope + rope), int(q_lora)))
    else:
        params += _linear(f"{a}.q_proj", heads * (nope + rope), d)
    params += (_linear(f"{a}.kv_a_proj_with_mqa", kv_lora + rope, d, bias) + _norm(f"{a}.kv_a_layernorm", kv_lora)
               + _linear(f"{a}.kv_b_proj", heads * (nope + v), kv_lora) + _linear(f"{a}.o_proj", d, heads * v, bias))
    if c.model_type == "deepseek_v32":  # DSA's lightning indexer
        ih, idim = int(r["index_n_heads"]), int(r["index_head_dim"])
        x = f"{a}.indexer"
        params += (_linear(f"{x}.wq_b", ih * idim, int(q_lora)) + _linear(f"{x}.wk", idim, d)
                   + [Param(f"{x}.k_norm.weight", (idim,)), Param(f"{x}.k_norm.bias", (idim,))]
                   + _linear(f"{x}.weights_proj", ih, d))
    experts = int(r.get("n_routed_experts") or 0)
    if experts and i >= int(r.get("first_k_dense_replace", 0)) and i % int(r.get("moe_layer_freq", 1)) == 0:
        inter = int(r["moe_intermediate_size"])
        params += [Param(f"{p}.mlp.gate.weight", (experts, d)), Param(f"{p}.mlp.gate.e_score_correction_bias", (experts,))]
        params += _mlp(f"{p}.mlp.experts.0", d, inter, experts=experts)
        if r.get("n_shared_experts"):
            params += _mlp(f"{p}.mlp.shared_experts", d, inter * int(r["n_shared_experts"]))
    else:
        params += _mlp(f"{p}.mlp", d, c.intermediate_size)
    return params


def _v4_rate(config: ModelConfig, kind: str) -> int:
    from ..models.deepseek_v4_config import compress_rate

    return compress_rate(config, kind)


def _deepseek_v4_architecture(config: ModelConfig) -> Architecture:
    """DeepSeek V4 (see models/deepseek_v4.py), under transformers' names: hyper-connections
    around each sub-block, shared-KV attention with its compressor (and CSA's indexer), grouped
    output projection, hash-routed or top-k MoE with one shared expert; the MTP module under mtp.*."""
    from ..models.deepseek_v4_config import layer_types, mlp_layer_types

    r, d, n = config.raw, config.hidden_size, int(config.raw.get("hc_mult", 4))
    kinds, mlps = layer_types(config), mlp_layer_types(config)
    window, hd = int(r.get("sliding_window", 128)), config.head_dim
    layers, kv_layers = [], []
    for i in range(config.num_hidden_layers):
        layers.append(_deepseek_v4_layer(config, f"model.layers.{i}", kinds[i], mlps[i]))
        per_token, fixed = 0.0, (window - 1) * hd
        if kinds[i] != "sliding_attention":
            rate, width = _v4_rate(config, kinds[i]), 2 * hd if kinds[i] == "compressed_sparse_attention" else hd
            per_token += hd / rate
            fixed += 2 * (rate - 1) * width  # the unfinished window's projections (kv and gate)
            if kinds[i] == "compressed_sparse_attention":
                di = int(r.get("index_head_dim", 128))
                per_token += di / rate
                fixed += 2 * (rate - 1) * 2 * di + 2 * rate * (hd + di)  # + the overlapping halves
        kv_layers.append((per_token, fixed, kinds[i]))
    unused: list[Param] = []
    for k in range(int(r.get("num_nextn_predict_layers") or 0)):
        p = f"mtp.{k}"
        unused += (_deepseek_v4_layer(config, p, "sliding_attention", "moe")
                   + _linear(f"{p}.e_proj", d, d) + _linear(f"{p}.h_proj", d, d)
                   + _norm(f"{p}.enorm", d) + _norm(f"{p}.hnorm", d) + _norm(f"{p}.norm", d)
                   + [Param(f"{p}.hc_head.hc_fn", (n, n * d)), Param(f"{p}.hc_head.hc_base", (n,)),
                      Param(f"{p}.hc_head.hc_scale", (1,))])
    v = config.vocab_size
    ends = [Param("model.embed_tokens.weight", (v, d)), Param("model.norm.weight", (d,)),
            Param("model.hc_head.hc_fn", (n, n * d)), Param("model.hc_head.hc_base", (n,)),
            Param("model.hc_head.hc_scale", (1,))]
    if not config.tie_word_embeddings:
        ends.append(Param("lm_head.weight", (v, d)))
    mean = sum(per_token for per_token, _, _ in kv_layers) / len(kv_layers)
    note = (f"compressed per layer type ({hd}-value entries per {_v4_rate(config, 'compressed_sparse_attention')} "
            f"tokens + indexer keys / per {_v4_rate(config, 'heavily_compressed_attention')} tokens) plus a "
            f"{window}-token window per layer and sequence")
    return Architecture(config, layers, ends, unused, int(r.get("num_experts_per_tok", 0)), mean, note,
                        kv_layers, n * d)


def _deepseek_v4_layer(c: ModelConfig, p: str, kind: str, mlp: str) -> list[Param]:
    r, d, n = c.raw, c.hidden_size, int(c.raw.get("hc_mult", 4))
    heads, hd, q_lora = c.num_attention_heads, c.head_dim, int(r["q_lora_rank"])
    groups, o_rank = int(r.get("o_groups", 8)), int(r.get("o_lora_rank", 1024))
    a = f"{p}.self_attn"
    params = _norm(f"{p}.input_layernorm", d) + _norm(f"{p}.post_attention_layernorm", d)
    for hc in ("attn_hc", "ffn_hc"):
        params += [Param(f"{p}.{hc}.fn", ((2 + n) * n, n * d)), Param(f"{p}.{hc}.base", ((2 + n) * n,)),
                   Param(f"{p}.{hc}.scale", (3,))]
    params += (_linear(f"{a}.q_a_proj", q_lora, d) + _norm(f"{a}.q_a_norm", q_lora)
               + _linear(f"{a}.q_b_proj", heads * hd, q_lora) + _linear(f"{a}.kv_proj", hd, d)
               + _norm(f"{a}.kv_norm", hd) + _linear(f"{a}.o_a_proj", groups * o_rank, heads * hd // groups)
               + _linear(f"{a}.o_b_proj", d, groups * o_rank)
               + [Param(f"{a}.sinks", (heads,))])
    if kind != "sliding_attention":
        rate, width = _v4_rate(c, kind), (2 if kind == "compressed_sparse_attention" else 1) * hd
        x = f"{a}.compressor"
        params += (_linear(f"{x}.kv_proj", width, d) + _linear(f"{x}.gate_proj", width, d)
                   + [Param(f"{x}.position_bias", (rate, width))] + _norm(f"{x}.kv_norm", hd))
        if kind == "compressed_sparse_attention":
            di, ih = int(r.get("index_head_dim", 128)), int(r.get("index_n_heads", 64))
            x = f"{a}.compressor.indexer"
            params += (_linear(f"{x}.kv_proj", 2 * di, d) + _linear(f"{x}.gate_proj", 2 * di, d)
                       + [Param(f"{x}.position_bias", (rate, 2 * di))] + _norm(f"{x}.kv_norm", di)
                       + _linear(f"{x}.q_b_proj", ih * di, q_lora) + _linear(f"{x}.scorer.weights_proj", ih, d))
    experts, inter = int(r["n_routed_experts"]), int(r["moe_intermediate_size"])
    params += [Param(f"{p}.mlp.gate.weight", (experts, d))]
    if mlp == "hash_moe":
        params += [Param(f"{p}.mlp.gate.tid2eid", (c.vocab_size, int(r["num_experts_per_tok"])))]
    else:
        params += [Param(f"{p}.mlp.gate.e_score_correction_bias", (experts,))]
    params += _mlp(f"{p}.mlp.experts.0", d, inter, experts=experts)
    params += _mlp(f"{p}.mlp.shared_experts", d, inter * int(r.get("n_shared_experts", 1)))
    return params


@dataclass(frozen=True)
class Counts:
    total: int  # parameters the model runs (layers + embedding + final norm + head)
    active: int  # read per token: all but the embedding table and the experts not chosen
    unused: int  # in the checkpoint, never run (MTP), excluding its copies of embedding/head
    unused_with_copies: int


def count_params(arch: Architecture) -> Counts:
    params = [p for layer in arch.layers for p in layer] + arch.ends
    total = sum(p.numel for p in params)
    skipped = sum(p.size * (p.experts - arch.top_k) for p in params if p.experts)
    tied = arch.config.tie_word_embeddings  # then the embedding is the head and is read
    embedding = 0 if tied else sum(p.numel for p in arch.ends if p.is_embedding)
    copies = ("embed_tokens.weight", "shared_head.head.weight")
    unused = sum(p.numel for p in arch.unused if not p.name.endswith(copies))
    return Counts(total, total - skipped - embedding, unused, sum(p.numel for p in arch.unused))


# ------------------------------------------------------------------------------ bytes

@dataclass(frozen=True)
class CheckpointFormat:
    """How the published checkpoint stores its tensors, read from config.json."""
    kind: str  # "float", "mlx", "fp8", "int4"
    float_bytes: int  # bytes of its float tensors on disk
    config: ModelConfig
    block: tuple[int, int] = (128, 128)  # fp8 scale blocks
    group_size: int = 32  # int4
    ignore: tuple[str, ...] = ()  # int4: modules left in float
    # DeepSeek V4's fp8: ue8m0 block scales (one byte each), routed experts in FP4 (fp4_experts), both
    # held as they are stored, as MLX's mxfp8 and mxfp4 (formats.py)
    mx: bool = False
    fp4_experts: bool = False
    half_scales_stored: bool = False  # MLX folder: its scales and biases are float16 in the files

    def half_scales(self, p: Param) -> bool:
        """Whether the scales and biases of a tensor held MLX-quantized as the checkpoint stores it are
        float16 values (the int8 repack then holds them as float16: qmm.use_int8)."""
        return self.kind == "mlx" and self.half_scales_stored

    def symmetric(self, p: Param) -> bool:
        """Whether every bias of a tensor held MLX-quantized as stored is -2^(bits - 1) times its scale
        (the int8 repack then holds no biases: qmm.use_int8): in an MLX folder, the modules `convert`
        listed so (a GGUF's Q4_0 and Q8_0); other folders are not assumed to be."""
        from ..checkpoints.quants import SYMMETRIC_KEY

        return self.kind == "mlx" and p.module in self.config.raw.get(SYMMETRIC_KEY, ())

    def mx_bits(self, p: Param) -> int | None:
        """4 or 8: a tensor held in MLX's mxfp4 / mxfp8 mode as stored (DeepSeek V4); else None."""
        if not self.mx or not p.is_matrix:
            return None
        if p.experts:
            return 4 if self.fp4_experts else 8
        return 8 if self.is_fp8(p) else None

    def native(self, p: Param) -> tuple[int, int] | None:
        """(bits, group) of a tensor the checkpoint stores quantized in a form MLX runs as it is."""
        if self.kind == "mlx" and p.is_matrix:
            q = self.config.quantization
            if p.is_router and p.module not in q:
                return None  # routers stay in float unless listed
            settings = self.config.quantization_for(p.module)
            return (settings["bits"], settings["group_size"]) if settings else None
        if self.kind == "int4" and p.is_linear and not self._ignored(p.module):
            return 4, self.group_size
        return None

    def _ignored(self, module: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif pattern == module:
                return True
        return False

    def is_fp8(self, p: Param) -> bool:
        # DeepSeek ships a few small projections in bf16: V3.2's and V4's indexer weights_proj, V4's
        # compressors (the indexer's too); V4's routed experts are FP4
        if self.kind != "fp8" or not p.is_linear or p.module == "lm_head" or p.module.endswith("weights_proj"):
            return False
        if self.mx and (p.module.endswith(("compressor.kv_proj", "compressor.gate_proj", "indexer.kv_proj",
                                          "indexer.gate_proj")) or (p.experts and self.fp4_experts)):
            return False
        return True

    def _stored_fp32(self, p: Param) -> bool:
        """V4's tensors DeepSeek keeps in float32: hyper-connections, compressors' position biases,
        attention sinks, router correction biases."""
        return self.mx and p.name.endswith((".fn", ".base", ".scale", "hc_fn", "hc_base", "hc_scale",
                                            "position_bias", "sinks", "e_score_correction_bias"))

    def disk_bytes(self, p: Param) -> int:
        if p.is_index_table:
            return p.numel * 8  # int64
        bits = self.mx_bits(p)
        if bits == 4:  # e2m1 nibbles, one ue8m0 byte per 32
            return p.copies * (p.size // 2 + p.size // 32)
        if bits == 8:  # e4m3 bytes, one ue8m0 byte per block
            rows, cols = p.shape
            return p.copies * (p.size + math.ceil(rows / self.block[0]) * math.ceil(cols / self.block[1]))
        if self._stored_fp32(p):
            return p.numel * 4
        native = self.native(p)
        if native and self.kind == "int4":  # int32-packed nibbles, bf16 scale per group, int64[2] shape
            rows, cols = p.shape
            return p.copies * (rows * cols // 2 + rows * (cols // self.group_size) * 2 + 16)
        if native:  # MLX affine: uint32-packed, scales and biases in the float dtype
            return p.copies * _affine_bytes(p.shape, *native, self.float_bytes)
        if self.is_fp8(p):
            rows, cols = p.shape
            blocks = math.ceil(rows / self.block[0]) * math.ceil(cols / self.block[1])
            return p.copies * (p.size + 4 * blocks)
        if self.kind == "fp8" and p.name.endswith("e_score_correction_bias"):
            return p.numel * 4  # stored in fp32
        return p.numel * self.float_bytes

    def describe(self) -> str:
        floats = {2: "bf16", 4: "fp32"}.get(self.float_bytes, f"{self.float_bytes}-byte floats")
        if self.kind == "fp8" and self.mx:
            b = self.block
            experts = "routed experts FP4 e2m1 with a ue8m0 scale per 32 (0.5 + 1/32 B/param), " if self.fp4_experts else ""
            return (f"{experts}FP8 e4m3 with a ue8m0 scale per {b[0]}x{b[1]} block (1 + 1/{b[0] * b[1]} B/param), "
                    f"hyper-connections and biases fp32, rest {floats}")
        if self.kind == "fp8":
            b = self.block
            return f"FP8 e4m3 with one fp32 scale per {b[0]}x{b[1]} block (1 + 4/{b[0] * b[1]} B/param), rest {floats}"
        if self.kind == "int4":
            return (f"compressed-tensors INT4, group {self.group_size}, for routed experts "
                    f"(0.5 + 2/{self.group_size} B/param), rest {floats}")
        if self.kind == "mlx":
            q = self.config.quantization
            return f"MLX affine {q['bits']}-bit, group {q.get('group_size', 64)}, rest {floats}"
        return floats


def checkpoint_format(config: ModelConfig, model: str | Path | None = None, quantize: int | None = None,
                      group_size: int = 64) -> CheckpointFormat:
    """model: where config came from; a GGUF file's tensor table (header only) gives each tensor's
    type, bytes and MLX layout, quantize/group_size the layout of types MLX cannot hold exactly."""
    from ..checkpoints.model_files import is_gguf

    if model is not None and is_gguf(model):
        from ..checkpoints.gguf_checkpoint import GGUFFormat

        return GGUFFormat.of(Path(model), config, quantize, group_size)
    raw = config.raw
    float_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(raw.get("torch_dtype") or raw.get("dtype"), 2)
    if config.quantization and "bits" in config.quantization:
        return CheckpointFormat("mlx", float_bytes, config, half_scales_stored=_scales_dtype(model) == "F16")
    q = raw.get("quantization_config") or {}
    method = q.get("quant_method")
    if not method:
        return CheckpointFormat("float", float_bytes, config)
    if method == "fp8":
        block = tuple(q.get("weight_block_size") or (128, 128))
        if config.model_type == "deepseek_v4":  # FP4 experts unless the config says fp8 (DeepSeek's own switch)
            experts = raw.get("expert_dtype") or q.get("expert_dtype") or "fp4"
            return CheckpointFormat("fp8", float_bytes, config, block=block, mx=True, fp4_experts=experts == "fp4")
        return CheckpointFormat("fp8", float_bytes, config, block=block)
    if method == "compressed-tensors":
        groups = list((q.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        if (q.get("format") != "pack-quantized" or len(weights) != 1 or weights[0].get("num_bits") != 4
                or weights[0].get("type") != "int" or not weights[0].get("symmetric")
                or weights[0].get("strategy") != "group"):
            raise UserError("compressed-tensors checkpoints are supported as symmetric INT4 pack-quantized "
                            "with group strategy (as Kimi K2 Thinking ships), not this quantization_config")
        return CheckpointFormat("int4", float_bytes, config, group_size=int(weights[0]["group_size"]),
                                ignore=tuple(q.get("ignore") or ()))
    raise UserError(f"unknown quantization method {method!r} in config.json (known: fp8, compressed-tensors, "
                    f"MLX 'quantization')")


def _int8(args: argparse.Namespace) -> bool:
    """--int8-activations as the job resolves it (on this machine, where the flag is not given)."""
    from ..kernels.qmm import int8_by_default

    return int8_by_default(getattr(args, "int8_activations", False), getattr(args, "dtype", "float32"))


def _scales_dtype(model: str | Path | None) -> str | None:
    """The safetensors dtype of an MLX folder's first `.scales` tensor (from one file's header), or None."""
    from ..checkpoints.weights import read_header

    if model is None or not Path(model).is_dir():
        return None
    for path in sorted(Path(model).glob("*.safetensors")):
        try:
            tensors = read_header(path)
        except (OSError, UserError):  # the loader reports a bad file; the planner only counts
            return None
        scales = next((info for name, info in tensors.items() if name.endswith(".scales")), None)
        if scales is not None:
            return scales.dtype
    return None


def _mx_bytes(shape: tuple[int, ...], bits: int) -> int:
    """MLX mxfp4 / mxfp8 of one tensor: uint32-packed values and one uint8 scale per 32, no biases."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    return rows * math.ceil(cols * bits / 32) * 4 + rows * math.ceil(cols / 32)


def _affine_bytes(shape: tuple[int, ...], bits: int, group: int, scale_bytes: int, biases: bool = True) -> int:
    """MLX affine quantization of one tensor: rows of uint32-packed values plus a scale and a bias
    per group (no biases: a symmetric matrix repacked for the int8 products)."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    return rows * math.ceil(cols * bits / 32) * 4 + rows * math.ceil(cols / group) * (1 + biases) * scale_bytes


@dataclass(frozen=True)
class Precision:
    """What the weights become in memory: the checkpoint's format, the activation dtype floats
    are cast to, and an optional re-quantization (`--quantize`)."""
    checkpoint: CheckpointFormat
    dtype: str = "float32"
    quantize: int | None = None
    group_size: int = 64
    dense: bool = False  # MLX-quantized weights dequantized to the dtype (generate --weights-in-memory)
    int8: bool = False  # --int8-activations: 4- and 8-bit matrices repacked for the int8 products (qmm.use_int8)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def resident_bytes(self, p: Param) -> int:
        if p.is_index_table:
            return p.numel * 8  # int64, never cast
        bits = self.checkpoint.mx_bits(p)
        if bits:
            return p.copies * _mx_bytes(p.shape, bits)
        if self.checkpoint.config.model_type == "deepseek_v4":
            from ..models.deepseek_v4_config import FLOAT32

            if p.name.endswith(FLOAT32):  # held in float32 whatever the dtype, as the loader does
                return p.numel * 4
        native = self.checkpoint.native(p)
        if native and self.dense and self.checkpoint.kind in ("mlx", "gguf"):
            return p.numel * self.dtype_bytes
        if native:
            repacked = not p.is_embedding and self.int8_repacked(p, native[0])
            half = repacked and self.checkpoint.half_scales(p)
            return p.copies * _affine_bytes(p.shape, *native, 2 if half else self.dtype_bytes,
                                            biases=not (repacked and self.checkpoint.symmetric(p)))
        if self.requantized(p):
            return p.copies * _affine_bytes(p.shape, self.quantize, self.group_size, self.dtype_bytes)
        return p.numel * self.dtype_bytes

    def int8_repacked(self, p: Param, bits: int) -> bool:
        """Whether --int8-activations repacks this MLX-quantized matrix (qmm.int8_covers): 4 or 8 bits
        in whole blocks of 16 rows. Its scales and biases become float16 where they are all float16
        values, which the planner counts where the checkpoint stores them so (half_scales)."""
        from ..kernels.qmm import INT8_BITS, INT8_BLOCK

        return self.int8 and self.dtype == "float32" and bits in INT8_BITS and p.shape[-2] % INT8_BLOCK == 0

    def int8_head_copy(self, embedding: Param) -> int:
        """The bytes of the int8 copy a tied, MLX-quantized embedding gains as the LM head (qmm.use_int8); 0 if none."""
        native = self.checkpoint.native(embedding)
        if self.dense or not native or not self.int8_repacked(embedding, native[0]):
            return 0
        return _affine_bytes(embedding.shape, *native, 2 if self.checkpoint.half_scales(embedding) else self.dtype_bytes,
                             biases=not self.checkpoint.symmetric(embedding))

    def requantized(self, p: Param) -> bool:
        return (bool(self.quantize) and p.is_matrix and not p.is_router and p.shape[-1] % self.group_size == 0
                and not self.checkpoint.mx_bits(p))

    def describe(self) -> str:
        d, name = self.dtype_bytes, self.dtype
        parts = []
        if self.checkpoint.kind == "int4":
            g = self.checkpoint.group_size
            parts.append(f"routed experts INT4 -> MLX affine 4-bit, group {g} (0.5 + 2x{d}/{g} = "
                         f"{0.5 + 2 * d / g:.4g} B/param)")
        if self.checkpoint.kind == "mlx":
            q = self.checkpoint.config.quantization
            b, g = q["bits"], q.get("group_size", 64)
            if self.dense:
                parts.append(f"MLX affine {b}-bit, group {g} dequantized to {name} at load (--weights-in-memory fp32)")
            else:
                parts.append(f"MLX affine {b}-bit, group {g} as stored ({b}/8 + 2x{d}/{g} = {b / 8 + 2 * d / g:.4g} B/param)")
        if self.checkpoint.kind == "gguf":
            parts.append(self.checkpoint.resident(self.dense, name))
        if self.quantize:
            b, g = self.quantize, self.group_size
            parts.append(f"MLX affine {b}-bit, group {g} from --quantize {b} ({b}/8 + 2x{d}/{g} = "
                         f"{b / 8 + 2 * d / g:.4g} B/param) for the other matrices but routers")
        if self.checkpoint.kind == "fp8" and self.checkpoint.mx:
            if self.checkpoint.fp4_experts:
                parts.append("routed experts FP4 held as stored, MLX mxfp4 (0.5 + 1/32 B/param)")
            parts.append("FP8 held as stored, MLX mxfp8 (1 + 1/32 B/param: the 128x128 block's scale repeated "
                         "per 32 values)")
        elif self.checkpoint.kind == "fp8" and not self.quantize:
            parts.append(f"FP8 weights dequantized to {name} at load (MLX has no FP8 matmul)")
        if self.int8:
            parts.append("--int8-activations: 4- and 8-bit matrices repacked (scales and biases float16 where "
                         "stored so, no biases for GGUF's Q4_0 and Q8_0), a tied embedding held twice on rank 0 "
                         "(its int8 copy is the head)")
        parts.append(f"other tensors {name} ({d} B)")
        return "; ".join(parts)


@dataclass
class ModelBytes:
    """Resident bytes per layer and of rank 0's extras, plus what each layer reads per token."""
    layers: list[int]
    ends: int
    fixed_read: list[int]  # per layer: bytes read every step (everything but routed experts)
    expert_bytes: list[int]  # per layer: bytes of one routed expert (0: dense layer)
    experts: list[int]  # per layer: routed experts (0: dense layer)
    head_read: int  # rank 0 per token: final norm + LM head + one embedding row
    active_params: list[int]  # per layer, for compute
    head_params: int
    head: int = 0  # the LM head's matrix as held (the tied embedding where there is no lm_head)
    mtp: int = 0  # DeepSeek's MTP module as held (without its copies of the embedding and head): rank 0's with --draft mtp


def with_mtp(mb: ModelBytes) -> ModelBytes:
    """The bytes of a job drafting with the MTP module (--draft mtp): rank 0 holds it beside its
    other extras, so the split gives rank 0 that much less of the rest."""
    return replace(mb, ends=mb.ends + mb.mtp)


def model_bytes(arch: Architecture, precision: Precision) -> ModelBytes:
    b = precision.resident_bytes
    layers, fixed, expert_bytes, experts, active = [], [], [], [], []
    for params in arch.layers:
        layers.append(sum(b(p) for p in params))
        fixed.append(sum(b(p) for p in params if not p.experts))
        routed = [p for p in params if p.experts]
        expert_bytes.append(sum(b(p) // p.copies for p in routed))
        experts.append(routed[0].experts if routed else 0)
        active.append(sum(p.numel for p in params if not p.experts) + arch.top_k * sum(p.size for p in routed))
    ends = sum(b(p) for p in arch.ends)
    embedding = next(p for p in arch.ends if p.is_embedding)
    tied = arch.config.tie_word_embeddings
    head = [p for p in arch.ends if not p.is_embedding] + ([embedding] if tied else [])
    head_read = sum(b(p) for p in head) + (0 if tied else b(embedding) // embedding.shape[0])
    matrix = next((p for p in arch.ends if p.name.startswith("lm_head.")), embedding)
    head_bytes = b(matrix)
    copy = precision.int8_head_copy(embedding) if tied else 0
    if copy:  # rank 0 holds the tied embedding twice: MLX's layout for lookups, int8's as the head
        ends += copy
        head_read += copy - b(embedding)
        head_bytes = copy  # the last rank's share of the head (head_share.py) is cut from the int8 copy's layout
    mtp = sum(b(p) for p in arch.unused if not p.name.endswith(("embed_tokens.weight", "shared_head.head.weight")))
    return ModelBytes(layers, ends, fixed, expert_bytes, experts, head_read, active, sum(p.numel for p in head), head_bytes,
                      mtp)


def model_bytes_of(config: ModelConfig, model: str | Path, dtype: str = "float32", quantize: int | None = None,
                   group_size: int = 64, dense: bool = False) -> ModelBytes:
    """The bytes of the model in folder (or GGUF file) `model` as a rank holds them: floats in `dtype`,
    `--quantize` applied, MLX-quantized weights packed or (dense) dequantized. The one count behind
    `plan`, `preflight`, `--weights-in-memory auto` and `--host-memory` (memory.py)."""
    return held_and_dense(config, model, dtype, quantize, group_size)[dense]


def held_and_dense(config: ModelConfig, model: str | Path, dtype: str = "float32", quantize: int | None = None,
                   group_size: int = 64, int8: bool = False) -> tuple[ModelBytes, ModelBytes]:
    """model_bytes_of packed and dequantized, the checkpoint's format read once (a GGUF's header
    is parsed to learn it). int8: --int8-activations (its repack and head copy counted)."""
    checkpoint, arch = checkpoint_format(config, model, quantize, group_size), architecture(config)
    return tuple(model_bytes(arch, Precision(checkpoint, dtype, quantize, group_size, dense, int8))
                 for dense in (False, True))


def layer_counts(mb: ModelBytes, ranks: int, memory_gib: list[float] | None = None) -> list[int]:
    """Contiguous layer counts per rank. With host memory, each rank's share of the resident
    weight bytes is proportional to its memory (rank 0's share includes embedding + head);
    without, the largest share is as small as possible. `generate --host-memory` uses this too."""
    check_ranks(len(mb.layers), ranks)
    return balanced_counts(mb.layers, ranks, rank0_extra_bytes=mb.ends, capacities=memory_gib,
                           layer_overhead_bytes=0 if memory_gib else LAYER_OVERHEAD_BYTES)


def parse_per_host(text: str, flag: str, count: int | None, unit: str = "hosts",
                   allow_one: bool = False) -> list[float]:
    """`512,512,256,256` -> floats, one per host/rank (or one for all, where `allow_one`)."""
    try:
        values = [float(part) for part in str(text).split(",")]
    except ValueError:
        raise UserError(f"{flag} {text!r} must be comma-separated numbers, e.g. 512,512,256,256") from None
    if any(not v > 0 or math.isinf(v) for v in values):
        raise UserError(f"{flag} {text!r}: every value must be a positive number")
    if count is not None and len(values) != count and not (allow_one and len(values) == 1):
        raise UserError(f"{flag} {text!r} has {len(values)} value{'s' * (len(values) != 1)} but there are "
                        f"{count} {unit}: give one per {unit.removesuffix('s')}")
    if count is not None and len(values) == 1 and count > 1:
        values = values * count
    return values


# ----------------------------------------------------------------------- the plan itself

@dataclass
class Hardware:
    memory_gib: list[float] | None  # None: unknown, fit not checked
    bandwidth_gbs: list[float]
    link_gbs: float = 5.0
    link_latency_us: float = 100.0
    tflops: list[float] | None = None
    reserve_gib: float = 0.0


@dataclass
class RankPlan:
    rank: int
    start: int
    end: int
    bytes: RankBytes  # weights as held + KV cache (memory.py: the same count preflight and the stats line use)
    memory_gib: float | None
    reserve_gib: float = 0.0

    @property
    def weight_bytes(self) -> int:
        return self.bytes.weights

    @property
    def kv_bytes(self) -> int:
        return self.bytes.kv_cache

    @property
    def needed(self) -> int:
        return self.bytes.total

    @property
    def headroom(self) -> float | None:
        return None if self.memory_gib is None else self.memory_gib * GIB - self.needed

    @property
    def fits(self) -> bool | None:
        return None if self.memory_gib is None else self.headroom >= self.reserve_gib * GIB


@dataclass
class ClusterPlan:
    arch: Architecture
    precision: Precision
    hardware: Hardware
    counts: Counts
    mb: ModelBytes
    ranks: list[RankPlan]
    context: int
    batch: int
    stage_ms: list[float]  # per rank, one token (batch 1)
    single_tps: float
    batch_tps: float
    one_host_tps: float  # the whole model read at one host's bandwidth
    even_split: tuple[list[int], float] | None = None  # (counts, batch tok/s) if an even split also fits
    speculative: list[tuple[int, str, float]] | None = None  # (drafts K, how drafted, single-stream tok/s)
    draft_acceptance: float = 0.0

    @property
    def fits(self) -> bool | None:
        verdicts = [r.fits for r in self.ranks]
        return None if None in verdicts else all(verdicts)


def plan_cluster(config: ModelConfig, hosts: int, precision: Precision, hardware: Hardware,
                 context: int | None = None, batch: int | None = None, draft_tokens: list[int] = (),
                 draft_acceptance: float = 0.0) -> ClusterPlan:
    """context: tokens per sequence for the KV cache (default: 8192, or the model's context if shorter).
    draft_tokens, draft_acceptance: also predict single-stream speculative decoding with K drafts
    for each K (prompt lookup, drafting free; and the model's MTP module where it has one)."""
    arch = architecture(config)
    mb = model_bytes(arch, precision)
    context = min(8192, config.max_position_embeddings) if context is None else context
    if context < 1:
        raise UserError(f"--context must be >= 1, got {context}")
    if context > config.max_position_embeddings:
        raise UserError(f"--context {context} is longer than the model's context "
                        f"({config.max_position_embeddings} tokens)")
    batch = hosts if batch is None else batch
    if batch < 1:
        raise UserError(f"--batch must be >= 1, got {batch}")
    counts = layer_counts(mb, hosts, hardware.memory_gib)
    ranks = _rank_plans(arch, mb, precision, hardware, counts, context, batch)
    times = _Timing(arch, mb, precision, hardware, layer_ranges(counts), context)
    one_host = _Timing(arch, mb, precision, Hardware(None, [max(hardware.bandwidth_gbs)],
                                                     tflops=hardware.tflops and [max(hardware.tflops)]),
                       [(0, len(mb.layers))], context)
    plan = ClusterPlan(arch, precision, hardware, count_params(arch), mb, ranks, context, batch,
                       [1e3 * times.stage(r, 1) for r in range(hosts)], times.single_stream(),
                       times.batch(batch), one_host.single_stream())
    if draft_tokens:
        plan.draft_acceptance = draft_acceptance
        plan.speculative = [(k, "ngram", times.speculative(k, draft_acceptance)) for k in draft_tokens]
        if arch.unused:  # an MTP module: drafting costs its reads
            plan.speculative += [(k, "mtp", times.speculative(k, draft_acceptance, times.mtp_seconds(k)))
                                 for k in draft_tokens]
    if hardware.memory_gib and len(set(hardware.memory_gib)) > 1:
        even = layer_counts(mb, hosts)
        even_ranks = _rank_plans(arch, mb, precision, hardware, even, context, batch)
        even_tps = _Timing(arch, mb, precision, hardware, layer_ranges(even), context).batch(batch)
        if all(r.fits for r in even_ranks) and even_tps > plan.batch_tps * 1.01:
            plan.even_split = (even, even_tps)
    return plan


def kv_layer_bytes(arch: Architecture, dtype_bytes: int, tokens: int, sequences: int = 1) -> list[int]:
    """Per layer: the KV cache bytes of `sequences` sequences of `tokens` tokens."""
    return [round(arch.kv_cached(i, i + 1, tokens) * dtype_bytes * sequences) for i in range(len(arch.layers))]


def _rank_plans(arch, mb, precision, hardware, counts, context, batch) -> list[RankPlan]:
    kv = kv_layer_bytes(arch, precision.dtype_bytes, context, batch)
    ranges = layer_ranges(counts)
    return [RankPlan(r, start, end, rank_bytes(mb.layers, mb.ends, kv, (start, end), r, len(ranges)),
                     hardware.memory_gib[r] if hardware.memory_gib else None, hardware.reserve_gib)
            for r, (start, end) in enumerate(ranges)]


class _Timing:
    """The decode roofline of the module docstring, for one layer split."""

    def __init__(self, arch, mb, precision, hardware, ranges, context):
        self.arch, self.mb, self.hw, self.ranges = arch, mb, hardware, ranges
        self.kv_read = [arch.kv_read(i, context) * precision.dtype_bytes for i in range(len(arch.layers))]
        self.hidden_bytes = (arch.hidden_values or arch.config.hidden_size) * precision.dtype_bytes
        n = len(ranges)
        self.bandwidth = hardware.bandwidth_gbs if len(hardware.bandwidth_gbs) == n else hardware.bandwidth_gbs[:1] * n

    def stage(self, r: int, m: int, sequences: int | None = None) -> float:
        """Seconds for rank r to run one decode step of m tokens of `sequences` sequences (default:
        one token each; a speculative chunk is m tokens of one sequence, which reads its cache once)."""
        start, end = self.ranges[r]
        sequences = m if sequences is None else sequences
        read = 0.0
        for i in range(start, end):
            read += self.mb.fixed_read[i] + sequences * self.kv_read[i]
            e = self.mb.experts[i]
            if e:
                k = min(self.arch.top_k, e)
                read += e * (1 - (1 - k / e) ** m) * self.mb.expert_bytes[i]
        params = sum(self.mb.active_params[start:end])
        if r == 0:
            read += self.mb.head_read
            params += self.mb.head_params
        seconds = read / (self.bandwidth[r] * 1e9)
        if self.hw.tflops:
            flops = self.hw.tflops[r] if len(self.hw.tflops) == len(self.ranges) else self.hw.tflops[0]
            seconds = max(seconds, 2 * params * m / (flops * 1e12))
        return seconds

    def hop(self, m: int) -> float:
        return m * self.hidden_bytes / (self.hw.link_gbs * 1e9) + self.hw.link_latency_us * 1e-6

    @property
    def hops(self) -> int:
        return len(self.ranges) if len(self.ranges) > 1 else 0  # the ring returns to rank 0

    def single_stream(self) -> float:
        return 1 / (sum(self.stage(r, 1) for r in range(len(self.ranges))) + self.hops * self.hop(1))

    def speculative(self, drafts: int, acceptance: float, draft_seconds: float = 0.0) -> float:
        """Single-stream tok/s when each trip checks `drafts` drafted tokens, each accepted with
        probability `acceptance` once the ones before it were: (1 - a^(K+1)) / (1 - a) tokens per
        trip, the trip reading the experts its K+1 positions choose; draft_seconds: the drafting
        itself (the MTP module, on rank 0), per trip."""
        a, k = acceptance, drafts
        tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
        trip = sum(self.stage(r, k + 1, sequences=1) for r in range(len(self.ranges))) + self.hops * self.hop(k + 1)
        return tokens / (trip + draft_seconds)

    def mtp_seconds(self, drafts: int) -> float:
        """Rank 0 running the MTP module (one more decoder layer shaped like the last, plus the
        head) once per drafted token."""
        last = len(self.mb.layers) - 1
        e = self.mb.experts[last]
        read = self.mb.fixed_read[last] + self.mb.head_read + (min(self.arch.top_k, e) * self.mb.expert_bytes[last] if e else 0)
        return drafts * read / (self.bandwidth[0] * 1e9)

    def batch(self, b: int) -> float:
        n = len(self.ranges)
        k = min(b, n)
        m = math.ceil(b / k)
        stages = [self.stage(r, m) for r in range(n)]
        link = self.hop(m) if self.hops else 0.0
        round_trip = sum(stages) + self.hops * link
        return b / max(round_trip, k * max(max(stages), link))


# --------------------------------------------------------------------------- memory check

@dataclass
class MemoryPlan:
    """`generate --host-memory`: the planner's split and its fit verdict, before loading."""
    memory_gib: list[float]
    mb: ModelBytes  # weights as loaded
    dense_mb: ModelBytes  # with MLX-quantized weights dequantized (ranks --weights-in-memory makes dense)
    arch: Architecture
    dtype_bytes: int  # of the KV cache

    @classmethod
    def for_job(cls, config: ModelConfig, args: argparse.Namespace, ranks: int,
                folder: Path | None = None) -> "MemoryPlan":
        """folder: the model's, resolved (args.model is None for the default model)."""
        memory = parse_per_host(args.host_memory, "--host-memory", ranks, unit="ranks")
        precision = Precision(checkpoint_format(config, folder or args.model, getattr(args, "quantize", None),
                                                getattr(args, "group_size", None) or 64),
                              dtype=getattr(args, "dtype", "float32"),
                              quantize=getattr(args, "quantize", None),
                              group_size=getattr(args, "group_size", None) or 64,
                              int8=_int8(args))
        arch = architecture(config)
        mb, dense_mb = model_bytes(arch, precision), model_bytes(arch, replace(precision, dense=True))
        if getattr(args, "draft", "none") == "mtp":
            mb, dense_mb = with_mtp(mb), with_mtp(dense_mb)
        return cls(memory, mb, dense_mb, arch, precision.dtype_bytes)

    def counts(self) -> list[int]:
        return layer_counts(self.mb, len(self.memory_gib), self.memory_gib)

    def check(self, ranges: list[tuple[int, int]], tokens: int, dense: list[bool] | None = None) -> None:
        """UserError (one line) unless every rank's weights + KV cache for `tokens` fit its memory."""
        short = []
        kv = kv_layer_bytes(self.arch, self.dtype_bytes, tokens)
        for r, span in enumerate(ranges):
            mb = self.dense_mb if dense and dense[r] else self.mb
            held = rank_bytes(mb.layers, mb.ends, kv, span, r, len(ranges))
            if held.total > self.memory_gib[r] * GIB:
                short.append(f"rank {r} needs {size(held.total)} ({held.describe()}) "
                             f"but has {self.memory_gib[r]:g} GiB")
        if short:
            raise UserError(f"the model does not fit in --host-memory: {'; '.join(short)}; add hosts or memory, "
                            f"or hold the weights in fewer bytes (--dtype bfloat16, --quantize 4)")


# -------------------------------------------------------------------------------- output

def _b(n: float) -> str:
    return f"{n / 1e9:.1f}B"


def format_plan(plan: ClusterPlan, title: str) -> str:
    arch, c, p, hw = plan.arch, plan.counts, plan.precision, plan.hardware
    cp = p.checkpoint
    lines = [f"{title} ({arch.name}): {len(arch.layers)} layers, {_b(c.total)} parameters, "
             f"{_b(c.active)} read per token (embedding table excluded)"
             + (f"; MTP module {_b(c.unused)} in the checkpoint, run only with --draft mtp" if c.unused else "")]
    resident = sum(plan.mb.layers) + plan.mb.ends
    disk = sum(cp.disk_bytes(q) for layer in arch.layers for q in layer) + sum(cp.disk_bytes(q) for q in arch.ends)
    disk_unused = sum(cp.disk_bytes(q) for q in arch.unused)
    lines.append(f"weights in memory: {size(resident)}; {p.describe()}")
    lines.append(f"checkpoint on disk: {disk / 1e9:.1f} GB" + (f" (+{disk_unused / 1e9:.1f} GB MTP module)" if disk_unused else "")
                 + f", {cp.describe()}")
    kv_token = arch.kv_values * p.dtype_bytes * len(arch.layers)
    if arch.kv_layers is None:
        lines.append(f"KV cache: {arch.kv_note} = {arch.kv_values} values/token/layer, {kv_token / 1024:.1f} KiB per "
                     f"token ({p.dtype}); context {plan.context} x batch {plan.batch}")
    else:
        window = arch.kv_cached(0, len(arch.layers), 0) * p.dtype_bytes
        lines.append(f"KV cache: {arch.kv_note} = {arch.kv_values:.1f} values/token/layer on average, "
                     f"{kv_token / 1024:.2f} KiB per token + {window / 2**20:.1f} MiB per sequence ({p.dtype}); "
                     f"context {plan.context} x batch {plan.batch}")
    lines.append("")
    lines.append(f"{'rank':>4}  {'memory':>9}  {'layers':<14}  {'weights':>10}  {'KV cache':>9}  {'headroom':>10}  "
                 f"{'fits':>4}  {'bandwidth':>10}  {'ms/token':>8}")
    bandwidth = hw.bandwidth_gbs if len(hw.bandwidth_gbs) == len(plan.ranks) else hw.bandwidth_gbs[:1] * len(plan.ranks)
    for r, ms, bw in zip(plan.ranks, plan.stage_ms, bandwidth):
        memory = f"{r.memory_gib:g} GiB" if r.memory_gib is not None else "-"
        headroom = size(r.headroom) if r.headroom is not None else "-"
        fits = "-" if r.fits is None else ("yes" if r.fits else "NO")
        span = f"{r.start}-{r.end - 1} ({r.end - r.start})"
        lines.append(f"{r.rank:>4}  {memory:>9}  {span:<14}  {size(r.weight_bytes):>10}  {size(r.kv_bytes):>9}  "
                     f"{headroom:>10}  {fits:>4}  {bw:>6g} GB/s  {ms:>8.2f}")
    lines.append("")
    hops = len(plan.ranks) if len(plan.ranks) > 1 else 0
    link = (f" + {hops} hops of {hw.link_latency_us:g} us + {arch.hidden_values or arch.config.hidden_size} x "
            f"{p.dtype_bytes} B at "
            f"{hw.link_gbs:g} GB/s" if hops else "")
    lines.append(f"decode roofline: single stream {plan.single_tps:.1f} tok/s (stage times in turn{link}); "
                 f"batch {plan.batch}: {plan.batch_tps:.1f} tok/s (stages overlap; slowest stage bounds it)")
    for k, how, tps in plan.speculative or ():
        drafting = f"MTP module, {size(plan.mb.mtp)} more on rank 0" if how == "mtp" else "prompt lookup, drafting free"
        lines.append(f"  speculative, {k} draft{'s' if k > 1 else ''} ({drafting}), acceptance "
                     f"{100 * plan.draft_acceptance:.0f}%: single stream {tps:.1f} tok/s "
                     f"({tps / plan.single_tps:.2f}x; the {k + 1} verified positions read more experts)")
    lines.append(f"  for scale: one host holding the whole model at {max(hw.bandwidth_gbs):g} GB/s would reach "
                 f"{plan.one_host_tps:.1f} tok/s single stream; a pipeline's single stream cannot beat that")
    if plan.even_split:
        counts, tps = plan.even_split
        lines.append(f"  note: an even split also fits ({','.join(map(str, counts))}); it gives batch {plan.batch} "
                     f"{tps:.1f} tok/s, since the larger hosts are the slowest stages: generate --split "
                     f"{','.join(map(str, counts))}")
    lines.append("  model: stage time = bytes read / bandwidth (non-expert weights, distinct routed experts "
                 "E*(1-(1-k/E)^m) for m tokens, KV cache at the full context)"
                 + ("; compute-bound at 2 x params x tokens / --tflops" if hw.tflops else "; compute not modelled")
                 + "; peak numbers, no efficiency factor: real runs land below")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    config = load_config(args.model)
    hosts = args.hosts
    memory = None
    if args.host_memory is not None:
        memory = parse_per_host(args.host_memory, "--host-memory", hosts)
        hosts = hosts or len(memory)
    if hosts is None:
        raise UserError("plan: give --hosts N or --host-memory with one value per host")
    if hosts < 1:
        raise UserError(f"--hosts must be >= 1, got {hosts}")
    hardware = Hardware(
        memory_gib=memory,
        bandwidth_gbs=parse_per_host(args.bandwidth_gbs, "--bandwidth-gbs", hosts, allow_one=True),
        link_gbs=parse_per_host(args.link_gbs, "--link-gbs", 1)[0],
        link_latency_us=_non_negative(args.link_latency_us, "--link-latency-us"),
        tflops=parse_per_host(args.tflops, "--tflops", hosts, allow_one=True) if args.tflops else None,
        reserve_gib=_non_negative(args.reserve_gb, "--reserve-gb"),
    )
    precision = Precision(checkpoint_format(config, args.model, args.quantize, args.group_size), args.dtype,
                          args.quantize, args.group_size,
                          dense=getattr(args, "weights_in_memory", "quantized") == "fp32",
                          int8=_int8(args))
    acceptance = getattr(args, "draft_acceptance", None)
    if acceptance is not None and not 0 <= acceptance <= 1:
        raise UserError(f"--draft-acceptance must be in [0, 1], got {acceptance}")
    drafts = getattr(args, "draft_tokens", None) or ([1, 2] if acceptance is not None else [])
    if any(not 1 <= k <= 15 for k in drafts):
        raise UserError(f"--draft-tokens must be from 1 to 15, got {drafts}")
    plan = plan_cluster(config, hosts, precision, hardware, args.context, args.batch, drafts,
                        0.0 if acceptance is None else acceptance)
    title = Path(str(args.model)).name.removesuffix(".json") or str(args.model)
    print(format_plan(plan, title), flush=True)
    if plan.fits is False:
        short = [f"rank {r.rank} needs {size(r.needed)} of {r.memory_gib:g} GiB" for r in plan.ranks if not r.fits]
        raise UserError(f"the model does not fit: {'; '.join(short)}"
                        + (f" (with --reserve-gb {hardware.reserve_gib:g})" if hardware.reserve_gib else "")
                        + "; add hosts or memory, or hold the weights in fewer bytes (--dtype bfloat16, --quantize 4)")
    return 0


def _non_negative(value: float, flag: str) -> float:
    if not (value >= 0 and math.isfinite(value)):
        raise UserError(f"{flag} must be a finite number >= 0, got {value}")
    return value
