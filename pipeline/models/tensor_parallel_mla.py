"""Tensor parallelism (--tensor-parallel T) for the DeepSeek V3 family (deepseek_v3: V3, R1, V3.1, Kimi
K2 and K2.5's language model) and DeepSeek V3.2 (deepseek_v32): what member m of a stage's group of T
holds of each layer. tensor_parallel.py dispatches here for these families (`is_mla_family`).

Per layer:
- MLA: the latent projections whole on every member (q_a_proj, kv_a_proj_with_mqa and their norms), so
  every member computes the whole query latent, the whole key/value latent and the shared rotary key,
  and keeps the whole latent KV cache (it does not shrink with T). The heads are split as evenly as
  their count allows (even_split: 5 heads over 2 ranks are 3 and 2): q_b_proj (or q_proj without a query
  latent) and kv_b_proj keep the output rows of the member's heads (q_head_dim and
  qk_nope_head_dim + v_head_dim rows a head), so the absorbed per-head up-projections (w_uk, w_uv) are
  the member's heads'; o_proj keeps the input columns of those heads (v_head_dim a head; its bias on
  member 0 only). The attention's output is the member's partial sum: one group sum.
- V3.2's lightning indexer whole on every member; its top-k positions taken from the group's first
  member (`group_choice`), so the members never attend to different positions on a near tie.
- DeepSeekMoE: the router (MoEGate: sigmoid scores, correction bias, group-limited top-k) computed whole
  on every member, its top-k experts the group's first member's; every routed expert sliced by its
  intermediate features (gate/up rows, down columns) as Qwen3-MoE's are; the shared experts split as a
  dense MLP (their moe_intermediate_size x n_shared_experts features). Routed and shared partials are
  added on the member, then one group sum.
- dense MLPs (the first_k_dense_replace layers): gate/up rows, down columns, as the Llama family's.
Every cut of intermediate features is on whole units (tensor_parallel.mlp_share: up to 256 features),
so quantization groups are never cut; the head splits cut o_proj's columns on v_head_dim (128 in the
published models: whole groups of 32/64/128).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..util.errors import UserError
from .config import ModelConfig
from .deepseek_v3 import DeepseekMoE, MoEGate, MultiHeadLatentAttention, is_moe_layer
from .deepseek_v32 import LightningIndexer, SparseLatentAttention, is_sparse_layer
from .experts import SwitchGLU
from .layers import MLP, summed
from .registry import family_for

MLA_FAMILIES = ("deepseek_v3", "deepseek_v32")  # registry module names sharded here


@dataclass(frozen=True)
class Tools:
    """What this module borrows from tensor_parallel.py (which imports this one, so not the other way):
    its share arithmetic and its cuts of loaded arrays (by output rows; by input columns on whole words
    and quantization groups)."""
    even_split: Callable[[int, int, int], tuple[int, int]]  # (count, parts, member) -> [begin, end)
    mlp_share: Callable  # (features, shard) -> [begin, end) on whole units
    cut_rows: Callable  # (array, part, (begin, end)) -> array
    cut_columns: Callable  # (module, array, part, (begin, end), in_features) -> array


def is_mla_family(config: ModelConfig) -> bool:
    """Whether the config's family is sharded here (by its registry module)."""
    return family_for(config).module_name in MLA_FAMILIES


def _dims(config: ModelConfig) -> dict[str, int]:
    r = config.raw
    return dict(nope=int(r["qk_nope_head_dim"]), rope=int(r["qk_rope_head_dim"]), v=int(r["v_head_dim"]),
                kv_lora=int(r["kv_lora_rank"]), q_lora=int(r.get("q_lora_rank") or 0),
                moe=int(r.get("moe_intermediate_size") or 0), shared=int(r.get("n_shared_experts") or 0))


def heads_of(config: ModelConfig, shard, tools: Tools) -> tuple[int, int]:
    """[begin, end) of the member's heads."""
    n = config.num_attention_heads
    if shard.size > n:  # on every member alike
        raise UserError(f"--tensor-parallel {shard.size} is more than the model's {n} attention heads: "
                        f"use at most {n}")
    return tools.even_split(n, shard.size, shard.member)


def _sparse(config: ModelConfig, layer_index: int) -> bool:
    return (is_sparse_layer(config, layer_index) if config.model_type == "deepseek_v32"
            else is_moe_layer(config, layer_index))


# ------------------------------------------------------------------------------------------ modules

class ShardedLatentAttention(MultiHeadLatentAttention):
    """MLA over the member's heads (n_heads of them), the latents whole: its output is the member's
    partial sum, which the group adds up."""

    group_sum = None  # as layers.Attention's

    def take_choices_from(self, group_choice) -> None:
        """Nothing to choose (V3.2's indexer does)."""

    def __call__(self, x: mx.array, caches: list, lengths: list[int], last_only: bool = False,
                 full: list[bool] | None = None) -> mx.array:
        return summed(self, super().__call__(x, caches, lengths, last_only, full))


class ShardedIndexer(LightningIndexer):
    """V3.2's lightning indexer, computed whole on every member; the top-k positions the group's first
    member's (`group_choice`)."""

    group_choice = None

    def selected(self, q: mx.array, w: mx.array, keys: mx.array, q_positions: mx.array) -> mx.array | None:
        n = keys.shape[0]
        if n <= self.top_k:
            return None
        scores = nn.relu(q.astype(mx.float32) @ keys.astype(mx.float32).T * self.head_dim ** -0.5)  # as LightningIndexer
        index = (w.astype(mx.float32)[:, None, :] @ scores)[:, 0]
        visible = mx.arange(n)[None, :] <= q_positions[:, None]
        index = mx.where(visible, index, -mx.inf)
        best = mx.argpartition(-index, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        if self.group_choice is not None:
            best = self.group_choice(best)
        chosen = mx.put_along_axis(mx.zeros((q.shape[0], n), dtype=mx.bool_), best, mx.array(True), axis=-1)
        return chosen & visible


class ShardedSparseLatentAttention(SparseLatentAttention):
    """V3.2's MLA with DSA over the member's heads, the indexer whole (its choice the first member's)."""

    group_sum = None

    def take_choices_from(self, group_choice) -> None:
        if self.indexed:
            self.indexer.group_choice = group_choice

    def __call__(self, x: mx.array, caches: list, lengths: list[int], last_only: bool = False,
                 full: list[bool] | None = None) -> mx.array:
        return summed(self, super().__call__(x, caches, lengths, last_only, full))


class ShardedMoEGate(MoEGate):
    """DeepSeek's router computed whole, its top-k experts the group's first member's: the weights are
    this member's scores of those experts (renormalised and scaled as MoEGate's)."""

    group_choice = None

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T  # as MoEGate
        scores = mx.sigmoid(logits) if self.scoring_func == "sigmoid" else mx.softmax(logits, axis=-1)
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        if self.n_group > 1:
            grouped = choice.reshape(x.shape[0], self.n_group, -1)
            group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1)
            dropped = mx.argpartition(-group_scores, kth=self.topk_group - 1, axis=-1)[:, self.topk_group:]
            grouped = mx.put_along_axis(grouped, dropped[..., None], mx.array(-mx.inf), axis=1)
            choice = grouped.reshape(x.shape[0], -1)
        indices = mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        if self.group_choice is not None:
            indices = self.group_choice(indices)
        weights = mx.take_along_axis(scores, indices, axis=-1)
        if self.top_k > 1 and self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return indices, weights * self.routed_scaling_factor


class ShardedDeepseekMoE(DeepseekMoE):
    """DeepSeekMoE on one member: each chosen expert's slice and the shared experts' slice; their sum is
    the member's partial output (the shared experts' MLP has no group_sum of its own: one sum a layer)."""

    group_sum = None

    def take_choices_from(self, group_choice) -> None:
        self.gate.group_choice = group_choice

    def __call__(self, x: mx.array) -> mx.array:
        return summed(self, super().__call__(x))


def shard_modules(model: nn.Module, config: ModelConfig, shard, tools: Tools) -> None:
    """As tensor_parallel.shard_modules, for the MLA families: each layer's head-split projections and
    MLP/experts of the member's shapes."""
    mlp_share = tools.mlp_share
    d, hidden = _dims(config), config.hidden_size
    h0, h1 = heads_of(config, shard, tools)
    nh = h1 - h0
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) not in (MultiHeadLatentAttention, SparseLatentAttention) or \
                type(mlp) not in (MLP, DeepseekMoE):
            raise UserError(f"--tensor-parallel is not supported for {config.model_type} yet; "
                            f"run with --tensor-parallel 1")
        attn.n_heads = nh
        if attn.q_lora_rank:
            attn.q_b_proj = nn.Linear(attn.q_lora_rank, nh * (d["nope"] + d["rope"]), bias=False)
        else:
            attn.q_proj = nn.Linear(hidden, nh * (d["nope"] + d["rope"]), bias=False)
        attn.kv_b_proj = nn.Linear(d["kv_lora"], nh * (d["nope"] + d["v"]), bias=False)
        attn.o_proj = nn.Linear(nh * d["v"], hidden, bias="bias" in attn.o_proj and shard.member == 0)
        if type(attn) is SparseLatentAttention:
            attn.__class__ = ShardedSparseLatentAttention
            if attn.indexed:
                attn.indexer.__class__ = ShardedIndexer
        else:
            attn.__class__ = ShardedLatentAttention
        if type(mlp) is DeepseekMoE:
            e0, e1 = mlp_share(d["moe"], shard)
            mlp.switch_mlp = SwitchGLU(hidden, e1 - e0, mlp.gate.num_experts)
            if "shared_experts" in mlp:
                s0, s1 = mlp_share(d["moe"] * d["shared"], shard)
                mlp.shared_experts = MLP(hidden, s1 - s0)
            mlp.gate.__class__ = ShardedMoEGate
            mlp.__class__ = ShardedDeepseekMoE
        else:
            i0, i1 = mlp_share(config.intermediate_size, shard)
            mlp.gate_proj = nn.Linear(hidden, i1 - i0, bias=False)
            mlp.up_proj = nn.Linear(hidden, i1 - i0, bias=False)
            mlp.down_proj = nn.Linear(i1 - i0, hidden, bias=False)


# ------------------------------------------------------------------------------------------ weights

def share_of(module: str, part: str, config: ModelConfig, shard, tools: Tools) -> tuple[int, int, int] | None:
    """(axis, begin, end) of the member's share of one array of `module` (a parameter `part`: -2 its
    output rows, -1 its input columns, each as a matrix [out, in] counts them, or of each expert's), or
    None: held whole. A reader that narrows what it reads to the share (checkpoints/share_reads.py) must
    take it from here for these families: their heads are not config.head_dim wide."""
    d = _dims(config)
    h0, h1 = heads_of(config, shard, tools)
    if module in ("self_attn.q_b_proj", "self_attn.q_proj"):
        per = d["nope"] + d["rope"]
        return -2, h0 * per, h1 * per
    if module == "self_attn.kv_b_proj":
        per = d["nope"] + d["v"]
        return -2, h0 * per, h1 * per
    if module == "self_attn.o_proj":
        return None if part == "bias" else (-1, h0 * d["v"], h1 * d["v"])
    features = {"mlp.": config.intermediate_size, "mlp.switch_mlp.": d["moe"],
                "mlp.shared_experts.": d["moe"] * d["shared"]}
    for prefix, count in features.items():
        if module in (prefix + "gate_proj", prefix + "up_proj"):
            return -2, *tools.mlp_share(count, shard)
        if module == prefix + "down_proj":
            return -1, *tools.mlp_share(count, shard)
    return None  # held whole: latent projections, norms, the router, the indexer


def _in_features(module: str, config: ModelConfig) -> int:
    """The input features of a matrix cut by its columns."""
    d = _dims(config)
    return {"self_attn.o_proj": config.num_attention_heads * d["v"], "mlp.down_proj": config.intermediate_size,
            "mlp.switch_mlp.down_proj": d["moe"], "mlp.shared_experts.down_proj": d["moe"] * d["shared"]}[module]


in_features_of = _in_features  # (tensor_parallel.column_cuts)


def cut(module: str, part: str, array: mx.array, config: ModelConfig, shard,
        tools: Tools) -> list[tuple[str, mx.array]]:
    """(module, array) pairs the member holds of one loaded array of `module` (a parameter `part`);
    none: a bias held by member 0 only (o_proj's)."""
    if module == "self_attn.o_proj" and part == "bias":
        return [(module, array)] if shard.member == 0 else []
    share = share_of(module, part, config, shard, tools)
    if share is None:
        return [(module, array)]
    axis, begin, end = share
    if axis == -2:
        return [(module, tools.cut_rows(array, part, (begin, end)))]
    return [(module, tools.cut_columns(module, array, part, (begin, end), _in_features(module, config)))]


# ------------------------------------------------------------------------------------------ accounting

def layer_parameters(config: ModelConfig, layer_index: int, heads: int, features: tuple[int, int, int]) -> int:
    """Parameters of layer `layer_index` holding `heads` heads and (dense MLP, routed expert, shared
    experts) intermediate features: what preflight weighs a member's share by."""
    r, d, hidden = config.raw, _dims(config), config.hidden_size
    bias = bool(r.get("attention_bias", False))
    dense, expert, shared = features
    n = 2 * hidden  # the block's two norms
    if d["q_lora"]:
        n += hidden * d["q_lora"] + d["q_lora"] * bias + d["q_lora"] + d["q_lora"] * heads * (d["nope"] + d["rope"])
    else:
        n += hidden * heads * (d["nope"] + d["rope"])
    n += (hidden + bias) * (d["kv_lora"] + d["rope"]) + d["kv_lora"] + d["kv_lora"] * heads * (d["nope"] + d["v"])
    n += heads * d["v"] * hidden
    if config.model_type == "deepseek_v32":  # the lightning indexer, whole
        ni, hd = int(r["index_n_heads"]), int(r["index_head_dim"])
        n += d["q_lora"] * ni * hd + hidden * hd + 2 * hd + hidden * ni
    if _sparse(config, layer_index):
        experts = int(r["n_routed_experts"])
        n += experts * (hidden + 1) + 3 * hidden * (experts * expert + shared)
    else:
        n += 3 * hidden * dense
    return n


def layer_fractions(config: ModelConfig, shard, tools: Tools) -> list[float]:
    """Per layer, the fraction of its weights the member holds (the latent projections, norms, router and
    indexer whole; heads, MLP and expert features its share): preflight's per-rank accounting."""
    d, n = _dims(config), config.num_attention_heads
    h0, h1 = heads_of(config, shard, tools)
    whole = (config.intermediate_size, d["moe"], d["moe"] * d["shared"])
    held = tuple(e - b for b, e in (tools.mlp_share(f, shard) if f else (0, 0) for f in whole))
    return [layer_parameters(config, i, h1 - h0, held) / layer_parameters(config, i, n, whole)
            for i in range(config.num_hidden_layers)]


def share_fractions(config: ModelConfig, shard, tools: Tools) -> tuple[float, float]:
    """As tensor_parallel.share_fractions: the member's fraction of all layers' weights (per layer:
    `layer_fractions`) and of the KV cache (whole: the latents, rotary keys and indexer keys)."""
    fractions = layer_fractions(config, shard, tools)
    n = config.num_attention_heads
    d = _dims(config)
    whole = [layer_parameters(config, i, n, (config.intermediate_size, d["moe"], d["moe"] * d["shared"]))
             for i in range(config.num_hidden_layers)]
    return sum(f * w for f, w in zip(fractions, whole)) / sum(whole), 1.0
