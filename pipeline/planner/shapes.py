"""Every tensor of a model's checkpoint from config.json alone (no weights): the parameter shapes of
each layer written out per family, under the names and shapes the published files hold, and the KV
cache values each layer keeps per token (and, for Qwen3.5's linear-attention layers, the fixed state
it keeps per sequence instead)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ..models.config import ModelConfig
from ..models.deepseek_v4_config import compress_rate, deepseek_v4_config, layer_types, mlp_layer_types
from ..util.errors import UserError

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
DEEPSEEK_FAMILY = ("deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v32")
# Sized by the planner before the runtime runs them (issue 36): Qwen3.5-MoE (its wrapper's type, or its
# text_config's, which ModelConfig takes from a published config.json), GLM-5, MiniMax-M2.
QWEN3_5_MOE = ("qwen3_5_moe", "qwen3_5_moe_text")
PLANNED_TYPES = (*QWEN3_5_MOE, "glm_moe_dsa", "minimax_m2")
KNOWN_TYPES = (*LLAMA_FAMILY, "qwen3_moe", *DEEPSEEK_FAMILY, "deepseek_v4", *PLANNED_TYPES)


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
        """An MoE router (and Qwen3.5's one-row shared-expert gate): kept in float by --quantize."""
        return self.name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight"))

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
    """One layer's KV cache, in values, where caches differ by layer (DeepSeek V4, Qwen3.5, GLM-5)."""
    per_token: float  # cached per token of the sequence
    per_sequence: int  # cached per sequence whatever its length (windows, unfinished compressions,
    # a linear-attention layer's recurrent and convolution state)
    kind: str  # the layer's attention: V4's sliding, compressed sparse or heavily compressed; Qwen3.5's
    # linear_attention or full_attention; GLM's indexed_attention (its own indexer) or shared_indexed_attention
    float32: int = 0  # of per_sequence, the values held in float32 whatever --dtype (a linear layer's recurrent
    # memory: gated_deltanet.GatedDeltaNet.sequence keeps it so)
    # Held but not read by a decode step (memory, not the roofline's reads): DeepSeek V4's state every
    # `reuse_stride` positions (per token) and its logs of the last calls (per sequence, at most: `_v4_kept`)
    kept_per_token: float = 0.0
    kept_per_sequence: int = 0


@dataclass
class Architecture:
    config: ModelConfig
    layers: list[list[Param]]  # per decoder layer, in order
    ends: list[Param]  # embedding, final norm, LM head: rank 0's extra share
    unused: list[Param]  # in the checkpoint, never run (DeepSeek's multi-token-prediction module)
    top_k: int  # routed experts chosen per token (0: dense)
    kv_values: float  # cached values per token per layer (DeepSeek V4: the mean over its layers)
    kv_note: str
    kv_layers: list[LayerCache] | None = None  # per layer (V4, Qwen3.5, GLM-5); None: kv_values per token in each
    hidden_values: int = 0  # values per token between ranks (V4: its residual streams); 0: hidden_size
    not_loaded: list[tuple[str, int]] = field(default_factory=list)  # (what, parameters) in the checkpoint that
    # no rank loads and no option runs (Qwen3.5's vision tower)

    @property
    def name(self) -> str:
        return self.config.model_type

    def kv_cached(self, start: int, end: int, context: int) -> float:
        """Values one sequence of `context` tokens caches in layers [start, end)."""
        if self.kv_layers is None:
            return self.kv_values * context * (end - start)
        return sum((cache.per_token + cache.kept_per_token) * context + cache.per_sequence + cache.kept_per_sequence
                   for cache in self.kv_layers[start:end])

    def kv_bytes(self, start: int, end: int, context: int, dtype_bytes: int) -> float:
        """Bytes one sequence of `context` tokens caches in layers [start, end): values in --dtype
        (`dtype_bytes`), but those a layer holds in float32 at 4 bytes."""
        if self.kv_layers is None:
            return self.kv_cached(start, end, context) * dtype_bytes
        return sum(((cache.per_token + cache.kept_per_token) * context + cache.per_sequence + cache.kept_per_sequence
                    - cache.float32) * dtype_bytes + 4 * cache.float32 for cache in self.kv_layers[start:end])

    def linear_state_bytes(self, start: int, end: int, dtype_bytes: int) -> int:
        """Bytes of one sequence's linear-attention states in layers [start, end) (Qwen3.5): what a
        resume point of the prefix cache holds there; 0 for families without them."""
        return round(sum((c.per_sequence - c.float32) * dtype_bytes + 4 * c.float32
                         for c in (self.kv_layers or [])[start:end] if c.kind == "linear_attention"))

    def kv_read_bytes(self, layer: int, context: int, dtype_bytes: int) -> float:
        """kv_read in bytes: in --dtype, but a linear layer's recurrent memory in float32."""
        if self.kv_layers is None:
            return self.kv_read(layer, context) * dtype_bytes
        return self.kv_read(layer, context) * dtype_bytes + (4 - dtype_bytes) * self.kv_layers[layer].float32

    def kv_read(self, layer: int, context: int) -> float:
        """Values a decode step of one sequence reads from layer `layer`'s cache at `context` tokens:
        all of it, but for V4's compressed sparse layers the indexer's keys and the top-k entries
        (plus the window)."""
        if self.kv_layers is None:
            return self.kv_values * context
        cache = self.kv_layers[layer]
        if cache.kind in ("indexed_attention", "shared_indexed_attention"):
            # GLM's DSA: the indexer scores every cached key of its own, attention reads the top-k latents
            r = self.config.raw
            latent = int(r["kv_lora_rank"]) + int(r["qk_rope_head_dim"])
            keys = int(r["index_head_dim"]) * context if cache.kind == "indexed_attention" else 0
            return keys + min(context, int(r["index_topk"])) * latent
        if cache.kind != "compressed_sparse_attention":
            return cache.per_token * context + cache.per_sequence  # a linear layer: its whole state
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
    elif t in QWEN3_5_MOE:
        return _qwen3_5_moe_architecture(config)
    elif t == "glm_moe_dsa":
        return _glm_moe_dsa_architecture(config)
    elif t == "minimax_m2":
        return _minimax_m2_architecture(config)
    else:
        raise UserError(f"the planner does not know model_type {t!r} (known: {', '.join(KNOWN_TYPES)})")
    ends = _ends(config)
    return Architecture(config, layers, ends, unused, top_k, kv, note)


def _ends(config: ModelConfig, *more: Param) -> list[Param]:
    """The model's ends: the embedding, the final norm, `more` (DeepSeek V4's head mixing), and the
    LM head unless it is the embedding's (tie_word_embeddings)."""
    v, d = config.vocab_size, config.hidden_size
    ends = [Param("model.embed_tokens.weight", (v, d)), Param("model.norm.weight", (d,)), *more]
    if not config.tie_word_embeddings:
        ends.append(Param("lm_head.weight", (v, d)))
    return ends


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


def _deepseek_layer(c: ModelConfig, i: int, indexer: bool | None = None, moe: bool | None = None) -> list[Param]:
    """DeepSeek V3 / Kimi K2: multi-head latent attention, then a dense MLP (the first
    first_k_dense_replace layers) or routed + shared experts. indexer, moe: whether the layer has
    DSA's lightning indexer and routed experts (GLM-5 says so per layer; default: as DeepSeek's config)."""
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
    if c.model_type == "deepseek_v32" if indexer is None else indexer:  # DSA's lightning indexer
        ih, idim = int(r["index_n_heads"]), int(r["index_head_dim"])
        x = f"{a}.indexer"
        params += (_linear(f"{x}.wq_b", ih * idim, int(q_lora)) + _linear(f"{x}.wk", idim, d)
                   + [Param(f"{x}.k_norm.weight", (idim,)), Param(f"{x}.k_norm.bias", (idim,))]
                   + _linear(f"{x}.weights_proj", ih, d))
    experts = int(r.get("n_routed_experts") or 0)
    if moe is None:
        moe = i >= int(r.get("first_k_dense_replace", 0)) and i % int(r.get("moe_layer_freq", 1)) == 0
    if experts and moe:
        inter = int(r["moe_intermediate_size"])
        params += [Param(f"{p}.mlp.gate.weight", (experts, d)), Param(f"{p}.mlp.gate.e_score_correction_bias", (experts,))]
        params += _mlp(f"{p}.mlp.experts.0", d, inter, experts=experts)
        if r.get("n_shared_experts"):
            params += _mlp(f"{p}.mlp.shared_experts", d, inter * int(r["n_shared_experts"]))
    else:
        params += _mlp(f"{p}.mlp", d, c.intermediate_size)
    return params


V4_LOG_LIMIT = 64  # models/deepseek_v4.py LOG_LIMIT (that module loads MLX; tests/test_plan_v4_held.py checks both)


def v4_reuse_stride(config: ModelConfig) -> int:
    """models/deepseek_v4.py reuse_stride, without MLX: positions between a V4 cache's kept points."""
    kinds = set(layer_types(config)) - {"sliding_attention"}
    lcm = math.lcm(*(compress_rate(config, k) for k in kinds)) if kinds else 1
    return lcm * max(1, -(-4 * deepseek_v4_config(config).sliding_window // lcm))


def _v4_kept(config: ModelConfig, kind: str) -> tuple[float, int]:
    """What one V4 layer's cache (models/deepseek_v4.py CompressedCache) holds for a sequence besides what a
    decode step reads, in values: (per position, its kept points: the window of keys and a CSA layer's overlap
    halves every `v4_reuse_stride` positions; per sequence, the logs of the last calls spanning at most
    V4_LOG_LIMIT positions, at their largest, single-token calls: each its window and key, each series' raw
    projections (kv and gate of its pending tokens and the new one) and overlap halves before it)."""
    v4, hd = deepseek_v4_config(config), config.head_dim
    window, calls = v4.sliding_window, V4_LOG_LIMIT
    series = []  # (rate, dim, width) per compressed series of the layer
    if kind != "sliding_attention":
        rate = compress_rate(config, kind)
        overlap = kind == "compressed_sparse_attention"
        series.append((rate, hd, 2 * hd if overlap else hd))
        if overlap:
            series.append((rate, v4.index_head_dim, 2 * v4.index_head_dim))
    overlaps = [(rate, dim) for rate, dim, width in series if width == 2 * dim]
    point = (window - 1) * hd + sum(2 * rate * dim for rate, dim in overlaps)
    logs = calls * window * hd
    for rate, dim, width in series:
        rows = max(sum((start + i) % rate + 1 for i in range(calls)) for start in range(rate))
        logs += 2 * width * rows
    logs += sum((calls // rate + 1) * 2 * rate * dim for rate, dim in overlaps)
    return point / v4_reuse_stride(config), logs


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
        kv_layers.append(LayerCache(per_token, fixed, kinds[i], 0, *_v4_kept(config, kinds[i])))
    unused: list[Param] = []
    for k in range(v4.num_nextn_predict_layers):
        p = f"mtp.{k}"
        unused += (_deepseek_v4_layer(config, p, "sliding_attention", "moe")
                   + _linear(f"{p}.e_proj", d, d) + _linear(f"{p}.h_proj", d, d)
                   + _norm(f"{p}.enorm", d) + _norm(f"{p}.hnorm", d) + _norm(f"{p}.norm", d)
                   + [Param(f"{p}.hc_head.hc_fn", (n, n * d)), Param(f"{p}.hc_head.hc_base", (n,)),
                      Param(f"{p}.hc_head.hc_scale", (1,))])
    ends = _ends(config, Param("model.hc_head.hc_fn", (n, n * d)), Param("model.hc_head.hc_base", (n,)),
                 Param("model.hc_head.hc_scale", (1,)))
    mean = sum(cache.per_token for cache in kv_layers) / len(kv_layers)
    note = (f"compressed per layer type ({hd}-value entries per {compress_rate(config, 'compressed_sparse_attention')} "
            f"tokens + indexer keys / per {compress_rate(config, 'heavily_compressed_attention')} tokens) plus a "
            f"{window}-token window per layer and sequence; held besides (not read): a window of keys every "
            f"{v4_reuse_stride(config)} positions and the logs of the last {V4_LOG_LIMIT} positions' calls")
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


def qwen3_5_layer_types(c: ModelConfig) -> list[str]:
    """Qwen3.5's `layer_types` as published, else transformers' default: full attention every
    full_attention_interval-th layer (4), linear attention (Gated DeltaNet) in the others."""
    r = c.raw
    kinds = r.get("layer_types")
    if kinds is None:
        interval = int(r.get("full_attention_interval", 4))
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(c.num_hidden_layers)]
    if len(kinds) != c.num_hidden_layers or set(kinds) - {"full_attention", "linear_attention"}:
        raise UserError(f"config.json's layer_types must give full_attention or linear_attention for each of the "
                        f"{c.num_hidden_layers} layers, got {kinds}")
    return list(kinds)


def _qwen3_5_moe_architecture(config: ModelConfig) -> Architecture:
    """Qwen3.5-MoE's language model (models published as Qwen3_5MoeForConditionalGeneration, under
    model.language_model.*; named model.* here): Gated DeltaNet layers and gated full-attention
    layers per layer_types, each with routed experts plus one gated shared expert. A full-attention
    layer caches keys and values per token; a linear layer keeps, per sequence whatever its length,
    its recurrent state (num_v_heads x head_k_dim x head_v_dim) and its convolution's last
    conv_kernel - 1 inputs (conv_dim = 2 x key heads x head_k_dim + value heads x head_v_dim).
    mtp.* (one more full-attention layer behind a projection) is the MTP module; model.visual.* the
    vision tower, which no rank loads."""
    r, d, hd = config.raw, config.hidden_size, config.head_dim
    kinds = qwen3_5_layer_types(config)
    layers = [_qwen3_5_layer(config, f"model.layers.{i}", kind) for i, kind in enumerate(kinds)]
    kv_full = 2 * config.num_key_value_heads * hd
    state, conv = _qwen3_5_linear_state(config)
    kv_layers = [LayerCache(kv_full, 0, kind) if kind == "full_attention" else LayerCache(0, state + conv, kind, state)
                 for kind in kinds]
    unused: list[Param] = []
    for k in range(int(r.get("mtp_num_hidden_layers") or 0)):
        unused += _qwen3_5_layer(config, f"mtp.layers.{k}", "full_attention")
    if unused:
        unused += (_linear("mtp.fc", d, 2 * d) + _norm("mtp.pre_fc_norm_embedding", d)
                   + _norm("mtp.pre_fc_norm_hidden", d) + _norm("mtp.norm", d))
    ends = _ends(config)
    linear = kinds.count("linear_attention")
    note = (f"keys+values in the {len(kinds) - linear} full-attention layers ({config.num_key_value_heads} KV heads x "
            f"{hd}); each of the {linear} linear-attention layers keeps a fixed state per sequence instead "
            f"({r['linear_num_value_heads']} x {r['linear_key_head_dim']} x {r['linear_value_head_dim']} recurrent in "
            f"float32 + {conv} convolution values)")
    not_loaded = [("vision tower (model.visual.*)", qwen3_5_vision_params(r["vision_config"]))] \
        if r.get("vision_config") else []
    return Architecture(config, layers, ends, unused, int(r["num_experts_per_tok"]),
                        kv_full * (len(kinds) - linear) / len(kinds), note, kv_layers, not_loaded=not_loaded)


def _qwen3_5_linear_state(c: ModelConfig) -> tuple[int, int]:
    """Values one sequence keeps in one Gated DeltaNet layer: (recurrent state, convolution state)."""
    r = c.raw
    key_dim = int(r["linear_num_key_heads"]) * int(r["linear_key_head_dim"])
    value_dim = int(r["linear_num_value_heads"]) * int(r["linear_value_head_dim"])
    state = int(r["linear_num_value_heads"]) * int(r["linear_key_head_dim"]) * int(r["linear_value_head_dim"])
    return state, (int(r.get("linear_conv_kernel_dim", 4)) - 1) * (2 * key_dim + value_dim)


def _qwen3_5_layer(c: ModelConfig, p: str, kind: str) -> list[Param]:
    r, d, hd = c.raw, c.hidden_size, c.head_dim
    params = _norm(f"{p}.input_layernorm", d) + _norm(f"{p}.post_attention_layernorm", d)
    if kind == "full_attention":  # q_proj also yields the output gate: twice the query width
        a, heads, kv = f"{p}.self_attn", c.num_attention_heads, c.num_key_value_heads
        bias = c.attention_bias
        params += (_linear(f"{a}.q_proj", 2 * heads * hd, d, bias) + _linear(f"{a}.k_proj", kv * hd, d, bias)
                   + _linear(f"{a}.v_proj", kv * hd, d, bias) + _linear(f"{a}.o_proj", d, heads * hd, bias)
                   + _norm(f"{a}.q_norm", hd) + _norm(f"{a}.k_norm", hd))
    else:
        a = f"{p}.linear_attn"
        v_heads = int(r["linear_num_value_heads"])
        key_dim = int(r["linear_num_key_heads"]) * int(r["linear_key_head_dim"])
        value_dim = v_heads * int(r["linear_value_head_dim"])
        conv_dim = 2 * key_dim + value_dim
        params += (_linear(f"{a}.in_proj_qkv", conv_dim, d) + _linear(f"{a}.in_proj_z", value_dim, d)
                   + _linear(f"{a}.in_proj_b", v_heads, d) + _linear(f"{a}.in_proj_a", v_heads, d)
                   + [Param(f"{a}.conv1d.weight", (conv_dim, 1, int(r.get("linear_conv_kernel_dim", 4)))),
                      Param(f"{a}.dt_bias", (v_heads,)), Param(f"{a}.A_log", (v_heads,))]
                   + _norm(f"{a}.norm", int(r["linear_value_head_dim"])) + _linear(f"{a}.out_proj", d, value_dim))
    experts = int(r["num_experts"])
    params += [Param(f"{p}.mlp.gate.weight", (experts, d))]
    params += _mlp(f"{p}.mlp.experts.0", d, int(r["moe_intermediate_size"]), experts=experts)
    params += _mlp(f"{p}.mlp.shared_expert", d, int(r["shared_expert_intermediate_size"]))
    return params + _linear(f"{p}.mlp.shared_expert_gate", 1, d)


def qwen3_5_vision_params(vision: dict) -> int:
    """Parameters of Qwen3.5's vision tower (transformers' Qwen3_5MoeVisionModel, its defaults where
    the config is silent): a patch embedding, learned positions, ViT blocks, a patch merger."""
    h, inter = int(vision.get("hidden_size", 1152)), int(vision.get("intermediate_size", 4304))
    patch, frames = int(vision.get("patch_size", 16)), int(vision.get("temporal_patch_size", 2))
    merged = h * int(vision.get("spatial_merge_size", 2)) ** 2
    out = int(vision.get("out_hidden_size", 3584))
    embed = h * int(vision.get("in_channels", 3)) * frames * patch * patch + h
    positions = int(vision.get("num_position_embeddings", 2304)) * h
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (inter * h + inter) + (h * inter + h)
    merger = 2 * h + (merged * merged + merged) + (out * merged + out)
    return embed + positions + int(vision.get("depth", 27)) * block + merger


def glm_indexer_types(c: ModelConfig) -> list[str]:
    """GLM's per-layer indexer: "full" runs its own lightning indexer, "shared" reuses the previous
    full layer's top-k. As transformers derives it: indexer_types, else index_topk_pattern, else
    every index_topk_freq-th layer from index_skip_topk_offset (GLM-5: every layer)."""
    r, n = c.raw, c.num_hidden_layers
    kinds = r.get("indexer_types")
    if kinds is None and r.get("index_topk_pattern") is not None:
        pattern = r["index_topk_pattern"]
        kinds = [{"F": "full", "S": "shared"}[ch] for ch in pattern] if isinstance(pattern, str) else list(pattern)
    if kinds is None:
        freq, offset = max(int(r.get("index_topk_freq", 1)), 1), int(r.get("index_skip_topk_offset", 2))
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(kinds) != n or set(kinds) - {"full", "shared"}:
        raise UserError(f"config.json's indexer_types must give full or shared for each of the {n} layers, got {kinds}")
    return list(kinds)


def glm_mlp_layer_types(c: ModelConfig) -> list[str]:
    """GLM's mlp_layer_types ("dense" or "sparse" per layer), else first_k_dense_replace dense layers."""
    r, n = c.raw, c.num_hidden_layers
    kinds = r.get("mlp_layer_types")
    if kinds is None:
        dense = min(int(r.get("first_k_dense_replace", 3)), n)
        kinds = ["dense"] * dense + ["sparse"] * (n - dense)
    if len(kinds) != n or set(kinds) - {"dense", "sparse"}:
        raise UserError(f"config.json's mlp_layer_types must give dense or sparse for each of the {n} layers, "
                        f"got {kinds}")
    return list(kinds)


def _glm_moe_dsa_architecture(config: ModelConfig) -> Architecture:
    """GLM-5 (glm_moe_dsa): DeepSeek V3.2's layer (MLA + DSA's lightning indexer, then a dense MLP or
    routed + shared experts) under the same names, dense or MoE per mlp_layer_types; layers whose
    indexer is "shared" have none and cache no indexer keys. The MTP layer follows the last layer,
    DeepSeek's way (model.layers.{n}: enorm, hnorm, eh_proj, a decoder layer, shared_head)."""
    r, d, n = config.raw, config.hidden_size, config.num_hidden_layers
    indexers, mlps = glm_indexer_types(config), glm_mlp_layer_types(config)
    layers = [_deepseek_layer(config, i, indexer=indexers[i] == "full", moe=mlps[i] == "sparse") for i in range(n)]
    latent, index_key = int(r["kv_lora_rank"]) + int(r["qk_rope_head_dim"]), int(r["index_head_dim"])
    kv_layers = [LayerCache(latent + index_key, 0, "indexed_attention") if kind == "full"
                 else LayerCache(latent, 0, "shared_indexed_attention") for kind in indexers]
    unused: list[Param] = []
    for k in range(int(r.get("num_nextn_predict_layers") or 0)):
        p = f"model.layers.{n + k}"
        unused += [Param(f"{p}.enorm.weight", (d,)), Param(f"{p}.hnorm.weight", (d,)),
                   Param(f"{p}.eh_proj.weight", (d, 2 * d)), *_deepseek_layer(config, n + k, indexer=True, moe=True),
                   Param(f"{p}.shared_head.norm.weight", (d,)),
                   # The checkpoint stores its own copies of the embedding and the LM head.
                   Param(f"{p}.embed_tokens.weight", (config.vocab_size, d)),
                   Param(f"{p}.shared_head.head.weight", (config.vocab_size, d))]
    ends = _ends(config)
    shared = indexers.count("shared")
    note = (f"MLA latent, kv_lora_rank {r['kv_lora_rank']} + rope {r['qk_rope_head_dim']}, + indexer key "
            f"{index_key} in the {n - shared} layers with their own indexer (a decode step reads the indexer keys "
            f"and the top {r['index_topk']} latents)")
    mean = sum(cache.per_token for cache in kv_layers) / n
    return Architecture(config, layers, ends, unused, int(r["num_experts_per_tok"]), mean, note, kv_layers)


def _minimax_m2_architecture(config: ModelConfig) -> Architecture:
    """MiniMax-M2 (transformers' names; the published files call the MoE block_sparse_moe and its
    experts' projections w1/w3/w2): full attention with an RMSNorm over all heads' queries (and all
    KV heads' keys) together, partial rotary (rotary_dim, no parameters), sigmoid-routed experts with
    a correction bias, no shared expert. The config's MTP modules are not in the published weights."""
    r, d, hd = config.raw, config.hidden_size, config.head_dim
    if int(r.get("shared_intermediate_size") or 0):
        raise UserError("MiniMax-M2 with a shared expert (shared_intermediate_size > 0) is not a published "
                        "model: the planner does not know its shapes")
    heads, kv, experts = config.num_attention_heads, config.num_key_value_heads, int(r["num_local_experts"])
    layers = []
    for i in range(config.num_hidden_layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        params = (_norm(f"{p}.input_layernorm", d) + _norm(f"{p}.post_attention_layernorm", d)
                  + _linear(f"{a}.q_proj", heads * hd, d) + _linear(f"{a}.k_proj", kv * hd, d)
                  + _linear(f"{a}.v_proj", kv * hd, d) + _linear(f"{a}.o_proj", d, heads * hd))
        if r.get("use_qk_norm", True):
            params += _norm(f"{a}.q_norm", heads * hd) + _norm(f"{a}.k_norm", kv * hd)
        params += [Param(f"{p}.mlp.gate.weight", (experts, d))]
        if r.get("use_routing_bias", True):
            params += [Param(f"{p}.mlp.e_score_correction_bias", (experts,))]
        params += _mlp(f"{p}.mlp.experts.0", d, config.intermediate_size, experts=experts)
        layers.append(params)
    ends = _ends(config)
    note = f"keys+values, {kv} KV heads x {hd}"
    return Architecture(config, layers, ends, [], int(r["num_experts_per_tok"]), 2 * kv * hd, note)


@dataclass(frozen=True)
class Counts:
    total: int  # parameters the model runs (layers + embedding + final norm + head)
    active: int  # read per token: all but the embedding table and the experts not chosen
    unused: int  # in the checkpoint, never run (MTP), excluding its copies of embedding/head
    unused_with_copies: int
    not_loaded: int = 0  # in the checkpoint, loaded by no rank (Qwen3.5's vision tower)


def count_params(arch: Architecture) -> Counts:
    params = [p for layer in arch.layers for p in layer] + arch.ends
    total = sum(p.numel for p in params)
    skipped = sum(p.size * (p.experts - arch.top_k) for p in params if p.experts)
    tied = arch.config.tie_word_embeddings  # then the embedding is the head and is read
    embedding = 0 if tied else sum(p.numel for p in arch.ends if p.is_embedding)
    copies = ("embed_tokens.weight", "shared_head.head.weight")
    unused = sum(p.numel for p in arch.unused if not p.name.endswith(copies))
    return Counts(total, total - skipped - embedding, unused, sum(p.numel for p in arch.unused),
                  sum(n for _, n in arch.not_loaded))
