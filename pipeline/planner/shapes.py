"""Every tensor of a model's checkpoint from config.json alone (no weights): the parameter shapes of
each layer written out per family, under the names and shapes the published files hold, and the KV
cache values each layer keeps per token."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ..models.config import ModelConfig
from ..models.deepseek_v4_config import compress_rate, deepseek_v4_config, layer_types, mlp_layer_types
from ..util.errors import UserError

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
DEEPSEEK_FAMILY = ("deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v32")
KNOWN_TYPES = (*LLAMA_FAMILY, "qwen3_moe", *DEEPSEEK_FAMILY, "deepseek_v4")


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


class LayerCache(NamedTuple):
    """One layer's KV cache, in values (DeepSeek V4, whose caches differ by layer)."""
    per_token: float  # cached per token of the sequence
    per_sequence: int  # cached per sequence whatever its length (windows, unfinished compressions)
    kind: str  # the layer's attention: sliding, compressed sparse or heavily compressed


@dataclass
class Architecture:
    config: ModelConfig
    layers: list[list[Param]]  # per decoder layer, in order
    ends: list[Param]  # embedding, final norm, LM head: rank 0's extra share
    unused: list[Param]  # in the checkpoint, never run (DeepSeek's multi-token-prediction module)
    top_k: int  # routed experts chosen per token (0: dense)
    kv_values: float  # cached values per token per layer (DeepSeek V4: the mean over its layers)
    kv_note: str
    kv_layers: list[LayerCache] | None = None  # per layer (DeepSeek V4); None: kv_values per token in each
    hidden_values: int = 0  # values per token between ranks (V4: its residual streams); 0: hidden_size

    @property
    def name(self) -> str:
        return self.config.model_type

    def kv_cached(self, start: int, end: int, context: int) -> float:
        """Values one sequence of `context` tokens caches in layers [start, end)."""
        if self.kv_layers is None:
            return self.kv_values * context * (end - start)
        return sum(cache.per_token * context + cache.per_sequence for cache in self.kv_layers[start:end])

    def kv_read(self, layer: int, context: int) -> float:
        """Values a decode step of one sequence reads from layer `layer`'s cache at `context` tokens:
        all of it, but for V4's compressed sparse layers the indexer's keys and the top-k entries
        (plus the window)."""
        if self.kv_layers is None:
            return self.kv_values * context
        cache = self.kv_layers[layer]
        if cache.kind != "compressed_sparse_attention":
            return cache.per_token * context + cache.per_sequence
        v4 = deepseek_v4_config(self.config)
        entries = context // compress_rate(self.config, cache.kind)
        return cache.per_sequence + entries * v4.index_head_dim + min(entries, v4.index_topk) * self.config.head_dim


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


def _deepseek_v4_architecture(config: ModelConfig) -> Architecture:
    """DeepSeek V4 (see models/deepseek_v4.py), under transformers' names: hyper-connections
    around each sub-block, shared-KV attention with its compressor (and CSA's indexer), grouped
    output projection, hash-routed or top-k MoE with one shared expert; the MTP module under mtp.*."""
    v4, d = deepseek_v4_config(config), config.hidden_size
    n = v4.hc_mult
    kinds, mlps = layer_types(config), mlp_layer_types(config)
    window, hd = v4.sliding_window, config.head_dim
    layers, kv_layers = [], []
    for i in range(config.num_hidden_layers):
        layers.append(_deepseek_v4_layer(config, f"model.layers.{i}", kinds[i], mlps[i]))
        per_token, fixed = 0.0, (window - 1) * hd
        if kinds[i] != "sliding_attention":
            rate, width = compress_rate(config, kinds[i]), 2 * hd if kinds[i] == "compressed_sparse_attention" else hd
            per_token += hd / rate
            fixed += 2 * (rate - 1) * width  # the unfinished window's projections (kv and gate)
            if kinds[i] == "compressed_sparse_attention":
                di = v4.index_head_dim
                per_token += di / rate
                fixed += 2 * (rate - 1) * 2 * di + 2 * rate * (hd + di)  # + the overlapping halves
        kv_layers.append(LayerCache(per_token, fixed, kinds[i]))
    unused: list[Param] = []
    for k in range(v4.num_nextn_predict_layers):
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
    mean = sum(cache.per_token for cache in kv_layers) / len(kv_layers)
    note = (f"compressed per layer type ({hd}-value entries per {compress_rate(config, 'compressed_sparse_attention')} "
            f"tokens + indexer keys / per {compress_rate(config, 'heavily_compressed_attention')} tokens) plus a "
            f"{window}-token window per layer and sequence")
    return Architecture(config, layers, ends, unused, v4.num_experts_per_tok, mean, note,
                        kv_layers, n * d)


def _deepseek_v4_layer(c: ModelConfig, p: str, kind: str, mlp: str) -> list[Param]:
    v4, d = deepseek_v4_config(c), c.hidden_size
    n = v4.hc_mult
    heads, hd, q_lora = c.num_attention_heads, c.head_dim, v4.q_lora_rank
    groups, o_rank = v4.o_groups, v4.o_lora_rank
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
        rate, width = compress_rate(c, kind), (2 if kind == "compressed_sparse_attention" else 1) * hd
        x = f"{a}.compressor"
        params += (_linear(f"{x}.kv_proj", width, d) + _linear(f"{x}.gate_proj", width, d)
                   + [Param(f"{x}.position_bias", (rate, width))] + _norm(f"{x}.kv_norm", hd))
        if kind == "compressed_sparse_attention":
            di, ih = v4.index_head_dim, v4.index_n_heads
            x = f"{a}.compressor.indexer"
            params += (_linear(f"{x}.kv_proj", 2 * di, d) + _linear(f"{x}.gate_proj", 2 * di, d)
                       + [Param(f"{x}.position_bias", (rate, 2 * di))] + _norm(f"{x}.kv_norm", di)
                       + _linear(f"{x}.q_b_proj", ih * di, q_lora) + _linear(f"{x}.scorer.weights_proj", ih, d))
    experts, inter = v4.n_routed_experts, v4.moe_intermediate_size
    params += [Param(f"{p}.mlp.gate.weight", (experts, d))]
    if mlp == "hash_moe":
        params += [Param(f"{p}.mlp.gate.tid2eid", (c.vocab_size, v4.num_experts_per_tok))]
    else:
        params += [Param(f"{p}.mlp.gate.e_score_correction_bias", (experts,))]
    params += _mlp(f"{p}.mlp.experts.0", d, inter, experts=experts)
    params += _mlp(f"{p}.mlp.shared_experts", d, inter * v4.n_shared_experts)
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
