"""DeepSeek V3 / R1 / V3.1 and Kimi K2 (`model_type` deepseek_v3 or kimi_k2).

Two ideas beyond a Llama block (DeepSeek-V2/V3 technical reports):

Multi-head Latent Attention (MLA). Keys and values are generated from a small latent
    c_kv = RMSNorm(W_dkv x)                       [kv_lora_rank]
plus one shared rotary key k_rope = RoPE(W_kr x)  [qk_rope_head_dim]. Per head,
    k_h = [W_uk_h c_kv ; k_rope],  v_h = W_uv_h c_kv,  q_h = [q_nope_h ; RoPE(q_rope_h)].
Since q_nope_h . (W_uk_h c) = (W_uk_h^T q_nope_h) . c, we fold W_uk into the query and W_uv
into the output ("absorption"), so attention runs directly against the cached latents: the
cache holds kv_lora_rank + qk_rope_head_dim values per token per layer, not full keys/values.

DeepSeekMoE. A sigmoid router with a learned correction bias picks experts: the bias only
affects which experts are chosen, never their weights. Experts are split into n_group groups;
only the topk_group groups with the best (top-2 biased score sum) are eligible, and experts of
other groups can never be chosen (as in DeepSeek's inference/model.py). Chosen weights are
renormalised (norm_topk_prob) and scaled by routed_scaling_factor; shared experts always run.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .cache import KVCache
from .layers import MLP, PreNormBlock, attend
from .packing import kept_rows, positions, segments
from .rope import RoPE, yarn_mscale
from .experts import SwitchGLU


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        r = config.raw
        hidden = config.hidden_size
        bias = bool(r.get("attention_bias", False))
        self.n_heads = config.num_attention_heads
        self.q_lora_rank = r.get("q_lora_rank")
        self.kv_lora_rank = int(r["kv_lora_rank"])
        self.qk_nope_head_dim = int(r["qk_nope_head_dim"])
        self.qk_rope_head_dim = int(r["qk_rope_head_dim"])
        self.v_head_dim = int(r["v_head_dim"])
        q_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim

        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = nn.RMSNorm(self.q_lora_rank, eps=1e-6)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.n_heads * q_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, self.n_heads * q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_head_dim, hidden, bias=bias)

        self.scale = q_head_dim ** -0.5
        scaling = config.rope_scaling or {}
        if scaling and scaling.get("mscale_all_dim"):
            # YaRN's softmax temperature correction for the longer context.
            self.scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
        self.rope = RoPE(self.qk_rope_head_dim, config.rope_theta, config.rope_scaling,
                         traditional=bool(r.get("rope_interleave", True)),
                         max_position_embeddings=config.max_position_embeddings)

    def after_load(self) -> None:
        """Split kv_b_proj into the per-head up-projections absorbed into query and output."""
        proj = self.kv_b_proj
        if isinstance(proj, nn.QuantizedLinear):
            w = mx.dequantize(proj.weight, proj.scales, proj.biases, group_size=proj.group_size, bits=proj.bits)
        else:
            w = proj.weight
        w = w.reshape(self.n_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        # [heads, latent, nope]: the query takes it as q_nope @ w_uk.T, the x @ w.T form that the BLAS
        # shim computes batch-invariantly (see blas_shim.c), like w_uv on the output side.
        self.w_uk = mx.contiguous(w[:, : self.qk_nope_head_dim, :].swapaxes(1, 2))
        self.w_uv = mx.contiguous(w[:, self.qk_nope_head_dim:, :])  # [heads, v, latent]
        del self["kv_b_proj"]

    def make_cache(self) -> KVCache:
        # "keys" hold the normalised latents c_kv, "values" the rotated shared keys k_rope.
        return KVCache()

    def __call__(self, x: mx.array, caches: list[KVCache], lengths: list[int], last_only: bool = False,
                 full: list[bool] | None = None) -> mx.array:
        """As layers.Attention: packed sequences, each against its own cache; last_only: the
        output of each sequence's last token only (all of a `full` one's; every token's latent
        is cached all the same)."""
        _, T, _ = x.shape
        offsets = positions(lengths, caches)
        if last_only:  # queries at each sequence's last token only (all of a full one's)
            last, kept = kept_rows(lengths, full)
            xq, q_offsets = x[:, last], offsets[last]
        else:
            xq, q_offsets = x, offsets
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(xq)))
        else:
            q = self.q_proj(xq)
        q = q.reshape(xq.shape[1], self.n_heads, -1).transpose(1, 0, 2)  # [heads, queries, q_head_dim]
        q_nope, q_rope = q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim:]
        q_latent = q_nope @ self.w_uk.swapaxes(-1, -2)  # [heads, queries, latent]: W_uk absorbed into the query

        compressed = self.kv_a_proj_with_mqa(x)[0]  # [T, latent + rope]
        latent = self.kv_a_layernorm(compressed[:, : self.kv_lora_rank])
        k_rope = compressed[:, self.kv_lora_rank:]

        # Every token's rotary parts rotated in one call each, at its own position.
        q_rope = self.rope(q_rope.transpose(1, 0, 2)[:, :, None], offset=q_offsets)[:, :, 0].transpose(1, 0, 2)
        k_rope = self.rope(k_rope[:, None, None], offset=offsets)[:, 0, 0]
        outputs = []
        for i, ((begin, end), cache) in enumerate(zip(segments(lengths), caches)):
            qb, qe = kept[i] if last_only else (begin, end)
            cached_latent, cached_rope = cache.update_and_fetch(latent[None, None, begin:end], k_rope[None, None, begin:end])
            queries = mx.concatenate([q_latent[None, :, qb:qe], q_rope[None, :, qb:qe]], axis=-1)
            keys = mx.concatenate([cached_latent, cached_rope], axis=-1)  # one "head" shared by all
            out = attend(queries, keys, cached_latent, self.scale, cache.offset - (qe - qb))
            outputs.append(out[0])  # [heads, t, latent]
        out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=1)
        out = out @ self.w_uv.swapaxes(-1, -2)  # [heads, queries, v]: W_uv absorbed into the output
        return self.o_proj(out.transpose(1, 0, 2).reshape(1, out.shape[1], -1))


class MoEGate(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        r = config.raw
        self.num_experts = int(r["n_routed_experts"])
        self.top_k = int(r["num_experts_per_tok"])
        self.n_group = int(r.get("n_group") or 1)
        self.topk_group = int(r.get("topk_group") or 1)
        self.norm_topk_prob = bool(r.get("norm_topk_prob", True))
        self.routed_scaling_factor = float(r.get("routed_scaling_factor", 1.0))
        self.scoring_func = r.get("scoring_func", "sigmoid")
        self.weight = mx.zeros((self.num_experts, config.hidden_size))
        self.e_score_correction_bias = mx.zeros((self.num_experts,))

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x: [tokens, hidden] -> (expert indices [tokens, k], weights [tokens, k])."""
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        scores = mx.sigmoid(logits) if self.scoring_func == "sigmoid" else mx.softmax(logits, axis=-1)
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        if self.n_group > 1:
            grouped = choice.reshape(x.shape[0], self.n_group, -1)
            group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1)  # [tokens, groups]
            dropped = mx.argpartition(-group_scores, kth=self.topk_group - 1, axis=-1)[:, self.topk_group:]
            grouped = mx.put_along_axis(grouped, dropped[..., None], mx.array(-mx.inf), axis=1)
            choice = grouped.reshape(x.shape[0], -1)
        indices = mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        weights = mx.take_along_axis(scores, indices, axis=-1)
        if self.top_k > 1 and self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return indices, weights * self.routed_scaling_factor


class DeepseekMoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        r = config.raw
        intermediate = int(r["moe_intermediate_size"])
        self.switch_mlp = SwitchGLU(config.hidden_size, intermediate, int(r["n_routed_experts"]))
        self.gate = MoEGate(config)
        if r.get("n_shared_experts"):
            self.shared_experts = MLP(config.hidden_size, intermediate * int(r["n_shared_experts"]))

    def __call__(self, x: mx.array) -> mx.array:
        tokens = x.reshape(-1, x.shape[-1])
        indices, weights = self.gate(tokens)
        routed = self.switch_mlp(tokens, indices)  # [tokens, k, hidden]
        y = (routed * weights[..., None].astype(routed.dtype)).sum(axis=1)
        if "shared_experts" in self:
            y = y + self.shared_experts(tokens)
        return y.reshape(x.shape)


def is_moe_layer(config: ModelConfig, layer_index: int) -> bool:
    r = config.raw
    return (bool(r.get("n_routed_experts")) and layer_index >= int(r.get("first_k_dense_replace", 0))
            and layer_index % int(r.get("moe_layer_freq", 1)) == 0)


def DecoderLayer(config: ModelConfig, layer_index: int) -> PreNormBlock:
    if is_moe_layer(config, layer_index):
        mlp = DeepseekMoE(config)
    else:
        mlp = MLP(config.hidden_size, config.intermediate_size)
    return PreNormBlock(config, MultiHeadLatentAttention(config), mlp)
