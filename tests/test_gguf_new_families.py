"""GGUF files of issue 36's new families read in place (llama.cpp's `minimax-m2` and `glm-dsa`): each tiny
transformers model of test_minimax_glm.py written to a GGUF the way llama.cpp's convert_hf_to_gguf.py
writes it (gguf's TensorNameMap, its metadata keys, its changes to tensors), then its logits on 1 and 2
ranks against transformers; a Q8_0 copy (held as MLX 8-bit) against a float32 GGUF of the blocks' values;
and a planted misreading per family that the comparison catches."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest

from conftest import forward, reference_logits
from test_gguf_inplace import gguf_vocab
from test_minimax_glm import LONG_PROMPT, make_minimax_m2

Q8_0_TOLERANCE = 1e-4  # a Q8_0 file vs a float32 file of its blocks' values: float rounding only


def _write(path, arch: str, tensors: dict, metadata, vocab, quantized: str) -> None:
    """A GGUF of `tensors` (gguf name -> float32 array) with `metadata(writer)`; quantized "q8_0": its matrices
    (rows a multiple of 32, no norms) in Q8_0 blocks; "dequantized": those blocks' values as float32."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    metadata(writer)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    writer.add_eos_token_id(vocab["eos"])
    for name, array in tensors.items():
        if quantized and array.ndim >= 2 and array.shape[-1] % 32 == 0 and "norm" not in name:
            blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            if quantized == "q8_0":
                writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                continue
            array = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).reshape(array.shape)
        writer.add_tensor(name, np.ascontiguousarray(array, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _common_metadata(writer, c, head_dim: int, context: int = 0, blocks: int = 0, kv_heads: int = 0,
                     value_length: int = 0) -> None:
    """What convert_hf_to_gguf.py's TextModel writes for every text model."""
    writer.add_block_count(blocks or c.num_hidden_layers)
    writer.add_context_length(context or c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(kv_heads or c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(value_length or head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))


def _gguf_logits(path, ranges, prompt=LONG_PROMPT):
    from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
    from pipeline.runtime.stage import Stage

    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.model_config()
    stages = [Stage.load(config, checkpoint, r, has_ends=i == 0, dtype=mx.float32) for i, r in enumerate(ranges)]
    return forward(stages, prompt), config, checkpoint


# ------------------------------------------------------------------------------------------ MiniMax-M2

def minimax_m2_tensors(model) -> dict:
    """MiniMaxM2Model.modify_tensors on the published names: the experts stacked per projection (w1 gate,
    w3 up, w2 down), the correction bias as `e_score_correction.bias`, everything else by TensorNameMap,
    no value changed."""
    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MINIMAXM2, c.num_hidden_layers)
    tensors = {}
    for name, value in model.state_dict().items():
        w = value.detach().float().numpy()
        name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj"):  # transformers 5's fused [E, 2I, H]: w1 then w3
            prefix, half = name.removesuffix("gate_up_proj"), w.shape[1] // 2
            pieces = {prefix + "w1.weight": w[:, :half], prefix + "w3.weight": w[:, half:]}
        elif name.endswith("experts.down_proj"):
            pieces = {name.replace("down_proj", "w2.weight"): w}
        elif name.endswith("e_score_correction_bias"):
            pieces = {name.replace("e_score_correction_bias", "e_score_correction.bias"): w}
        else:
            pieces = {name: w}
        for hf, array in pieces.items():
            target = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert target is not None, hf
            tensors[target] = np.ascontiguousarray(array, np.float32)
    return tensors


def write_minimax_m2_gguf(path, model, vocab, quantized: str = "", gating=gguf.ExpertGatingFuncType.SIGMOID) -> None:
    c = model.config

    def metadata(writer):
        _common_metadata(writer, c, c.head_dim)
        writer.add_expert_count(c.num_local_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.intermediate_size)
        writer.add_rope_dimension_count(c.rotary_dim)  # the published legacy field, as MiniMaxM2Model writes
        writer.add_expert_gating_func(gating)  # TextModel's, from scoring_func

    _write(path, "minimax-m2", minimax_m2_tensors(model), metadata, vocab, quantized)


@pytest.fixture(scope="module")
def minimax_gguf(tmp_path_factory):
    folder, model, expected = reference_logits(make_minimax_m2, tmp_path_factory.mktemp("minimax_gguf"), LONG_PROMPT)
    vocab = gguf_vocab(folder)
    path = folder / "tiny-minimax-m2.gguf"
    write_minimax_m2_gguf(path, model, vocab)
    for kind in ("q8_0", "dequantized"):
        write_minimax_m2_gguf(folder / f"tiny-minimax-m2-{kind}.gguf", model, vocab, kind)
    return path, expected


def test_a_minimax_m2_gguf_gives_transformers_logits(minimax_gguf):
    """Its config read back (partial rotary from rope.dimension_count, the norms over all heads, the
    correction bias under the block), and its logits on 1 and 2 ranks within test_minimax_glm's bound."""
    from test_minimax_glm import MINIMAX_TOLERANCE

    path, expected = minimax_gguf
    one, config, checkpoint = _gguf_logits(path, [(0, 4)])
    assert config.model_type == "minimax_m2" and config.raw["rotary_dim"] == 8
    assert checkpoint.tensors["model.layers.1.self_attn.q_norm.weight"].shape == (64,)
    assert "model.layers.3.mlp.e_score_correction_bias" in checkpoint.tensors
    print(f"minimax-m2 GGUF: max logit error vs transformers {np.abs(one - expected).max():.3g}")
    assert np.abs(one - expected).max() <= MINIMAX_TOLERANCE
    two, _, _ = _gguf_logits(path, [(0, 2), (2, 4)])
    assert np.abs(two - expected).max() <= MINIMAX_TOLERANCE


@pytest.mark.parametrize("bug", ["full_rotary", "no_routing_bias"])
def test_a_misread_minimax_m2_gguf_is_caught(bug, minimax_gguf, monkeypatch):
    """Planted: RoPE over the whole head (rope.dimension_count ignored); the correction bias not read (it
    changes which experts win): both leave transformers' logits far past the bound. (The bias named as
    DeepSeek's, under the router, is refused while loading: a name the model does not hold.)"""
    from pipeline.checkpoints import gguf_minimax
    from test_minimax_glm import MINIMAX_TOLERANCE

    path, expected = minimax_gguf
    fields = gguf_minimax.config_fields
    wrong_field = {"full_rotary": {"rotary_dim": 16}, "no_routing_bias": {"use_routing_bias": False}}[bug]
    monkeypatch.setattr(gguf_minimax, "config_fields", lambda *a: {**fields(*a), **wrong_field})
    if bug == "no_routing_bias":  # the file's bias then has no place in the model: leave it out of the index
        our_name = gguf_minimax.our_name
        monkeypatch.setattr(gguf_minimax, "our_name", lambda layer, kind, name: "" if kind == "exp_probs_b"
                            else our_name(layer, kind, name))
    wrong, _, _ = _gguf_logits(path, [(0, 4)])
    print(f"{bug}: max logit error {np.abs(wrong - expected).max():.3g}")
    assert np.abs(wrong - expected).max() > 100 * MINIMAX_TOLERANCE


def test_a_minimax_m2_gguf_with_softmax_gating_is_refused(minimax_gguf):
    from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
    from pipeline.util.errors import UserError
    from test_minimax_glm import make_minimax_m2 as make

    path = minimax_gguf[0].with_name("tiny-minimax-m2-softmax.gguf")
    write_minimax_m2_gguf(path, make(path.parent / "softmax"), gguf_vocab(path.parent), "",
                          gguf.ExpertGatingFuncType.SOFTMAX)
    with pytest.raises(UserError, match="expert_gating_func is 1; MiniMax-M2 routes by sigmoid"):
        GGUFCheckpoint(path)


def test_a_quantized_minimax_m2_gguf_holds_its_blocks(minimax_gguf):
    """Q8_0 matrices (experts' stacks included) held as MLX 8-bit exactly; logits those of a float32 GGUF
    of the blocks' values within float rounding."""
    from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint

    path = minimax_gguf[0]
    q8 = path.with_name("tiny-minimax-m2-q8_0.gguf")
    held = GGUFCheckpoint(q8).tensors
    assert held["model.layers.0.mlp.switch_mlp.down_proj.scales"].how in ("exact", "native")
    assert held["model.layers.0.self_attn.q_proj.scales"].how in ("exact", "native")
    blocks, _, _ = _gguf_logits(q8, [(0, 4)])
    values, _, _ = _gguf_logits(path.with_name("tiny-minimax-m2-dequantized.gguf"), [(0, 4)])
    print(f"minimax-m2 Q8_0 GGUF vs its values in float32: max logit difference {np.abs(blocks - values).max():.3g}")
    assert np.abs(blocks - values).max() <= Q8_0_TOLERANCE


# --------------------------------------------------------------------------------------------- GLM-5

def glm_dsa_tensors(model, mtp_layer: bool) -> dict:
    """GlmMoeDsaModel (DeepseekV2Model's modify_tensors): names by TensorNameMap for glm-dsa, experts stacked,
    the correction bias as `e_score_correction.bias`, kv_b split into k_b [heads, latent, nope] and v_b
    [heads, v, latent]. mtp_layer: an MTP block appended past the model's (its attention and experts as
    layer 4's, plus nextn's own tensors), as the converter writes a published GLM-5."""
    c = model.config
    layers = c.num_hidden_layers + int(mtp_layer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA, layers)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if mtp_layer:
        last = c.num_hidden_layers - 1
        rng = np.random.default_rng(7)
        for k, v in list(state.items()):
            if k.startswith(f"model.layers.{last}."):
                state[k.replace(f"layers.{last}.", f"layers.{layers - 1}.")] = v
        for extra, shape in (("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
                             ("shared_head.norm.weight", (64,))):
            state[f"model.layers.{layers - 1}.{extra}"] = rng.standard_normal(shape).astype(np.float32)
    tensors = {}
    for name, w in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name.removesuffix("gate_up_proj"), w.shape[1] // 2
            pieces = {prefix + "gate_proj.weight": w[:, :half], prefix + "up_proj.weight": w[:, half:]}
        elif name.endswith("mlp.experts.down_proj"):
            pieces = {name + ".weight": w}
        elif name.endswith("e_score_correction_bias"):
            pieces = {name.replace("gate.e_score_correction_bias", "gate.e_score_correction.bias"): w}
        elif name.endswith("kv_b_proj.weight"):
            nope, v = c.qk_nope_head_dim, c.v_head_dim
            kv_b = w.reshape(c.num_attention_heads, nope + v, -1)
            pieces = {name.replace("kv_b_proj", "k_b_proj"): kv_b[:, :nope].transpose(0, 2, 1),
                      name.replace("kv_b_proj", "v_b_proj"): kv_b[:, nope:]}
        else:
            pieces = {name: w}
        for hf, array in pieces.items():
            target = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert target is not None, hf
            tensors[target] = np.ascontiguousarray(array, np.float32)
    return tensors


def write_glm_dsa_gguf(path, model, vocab, quantized: str = "", types_key: bool = True, context: int = 0,
                       indexers_everywhere: bool = False) -> None:
    """types_key: write attention.indexer.types (llama.cpp since GLM-5.2); else leave the shared layers to be
    known by their missing indexer tensors. indexers_everywhere: every layer holds indexer tensors (layer 0's
    copied), and no expert_gating_func key is written. context: the context_length written (else the config's)."""
    c = model.config
    latent, rope, nope, v = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim

    def metadata(writer):
        # the MTP layer appended; MLA as MQA (one KV head of the latent), as DeepseekV2Model writes since the split
        _common_metadata(writer, c, latent + rope, context, blocks=c.num_hidden_layers + 1, kv_heads=1,
                         value_length=latent)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
        writer.add_q_lora_rank(c.q_lora_rank)
        writer.add_kv_lora_rank(latent)
        writer.add_rope_dimension_count(rope)
        writer.add_leading_dense_block_count(c.first_k_dense_replace)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_count(c.n_routed_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_shared_count(c.n_shared_experts)
        writer.add_expert_weights_scale(c.routed_scaling_factor)
        writer.add_expert_weights_norm(bool(c.norm_topk_prob))
        if not indexers_everywhere:
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(c.n_group)
        writer.add_expert_group_used_count(c.topk_group)
        writer.add_nextn_predict_layers(1)
        writer.add_indexer_head_count(c.index_n_heads)
        writer.add_indexer_key_length(c.index_head_dim)
        writer.add_indexer_top_k(c.index_topk)
        if types_key:
            writer.add_array("glm-dsa.attention.indexer.types", [t == "full" for t in c.indexer_types])

    tensors = glm_dsa_tensors(model, mtp_layer=True)
    if indexers_everywhere:
        for name, array in list(tensors.items()):
            if name.startswith("blk.0.indexer."):
                for layer in range(1, c.num_hidden_layers):
                    tensors.setdefault(name.replace("blk.0.", f"blk.{layer}."), array)
    _write(path, "glm-dsa", tensors, metadata, vocab, quantized)


@pytest.fixture(scope="module")
def glm_gguf(tmp_path_factory):
    from test_minimax_glm import make_glm_moe_dsa

    folder, model, expected = reference_logits(make_glm_moe_dsa, tmp_path_factory.mktemp("glm_gguf"), LONG_PROMPT)
    vocab = gguf_vocab(folder)
    path = folder / "tiny-glm-dsa.gguf"
    write_glm_dsa_gguf(path, model, vocab)
    write_glm_dsa_gguf(folder / "tiny-glm-dsa-no-types.gguf", model, vocab, types_key=False)
    for context in (512, 1 << 20):
        write_glm_dsa_gguf(folder / f"tiny-glm-dsa-everywhere-{context}.gguf", model, vocab, types_key=False,
                           context=context, indexers_everywhere=True)
    for kind in ("q8_0", "dequantized"):
        write_glm_dsa_gguf(folder / f"tiny-glm-dsa-{kind}.gguf", model, vocab, kind)
    return path, expected


def test_a_glm_dsa_gguf_gives_transformers_logits(glm_gguf):
    """Its config read back (the indexer's sizes, shared-top-k layers from attention.indexer.types or from
    the missing indexer tensors, dense and MoE layers from the routers, the MTP layer left out) and its
    logits on 1 and 2 ranks (the second beginning at a shared layer, so the top-k crosses) within
    test_minimax_glm's bound."""
    from test_minimax_glm import GLM_INDEXERS, GLM_TOLERANCE

    path, expected = glm_gguf
    one, config, checkpoint = _gguf_logits(path, [(0, 5)])
    assert config.model_type == "glm_moe_dsa" and config.num_hidden_layers == 5
    assert config.raw["indexer_types"] == GLM_INDEXERS
    assert config.raw["mlp_layer_types"] == ["dense", "sparse", "sparse", "dense", "sparse"]
    # the MTP block (5) under a published checkpoint's names, for --draft mtp (test_glm_mtp.py); not its copies
    assert "model.layers.5.eh_proj.weight" in checkpoint.tensors and config.raw["num_nextn_predict_layers"] == 1
    assert not any(".layers.5.embed_tokens" in name or ".layers.5.shared_head.head" in name
                   for name in checkpoint.tensors)
    print(f"glm-dsa GGUF: max logit error vs transformers {np.abs(one - expected).max():.3g}")
    assert np.abs(one - expected).max() <= GLM_TOLERANCE
    two, _, _ = _gguf_logits(path, [(0, 1), (1, 5)])
    assert np.abs(two - expected).max() <= GLM_TOLERANCE
    untyped, config, _ = _gguf_logits(path.with_name("tiny-glm-dsa-no-types.gguf"), [(0, 5)])
    assert config.raw["indexer_types"] == GLM_INDEXERS and np.array_equal(untyped, one)


def test_glm_dsa_indexer_types_where_every_layer_holds_an_indexer(glm_gguf):
    """No types key and indexer tensors in every layer: as llama.cpp's loader, all full below a 1M context
    (GLM-5, 5.1), else GLM-5.2's pattern (full at 0, 1, 2, 6, ...; the shared layers' indexer tensors not
    read); no expert_gating_func key: sigmoid (glm-dsa's default, not deepseek2's softmax)."""
    from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
    from pipeline.runtime.stage import Stage

    path = glm_gguf[0]
    short = GGUFCheckpoint(path.with_name("tiny-glm-dsa-everywhere-512.gguf"))
    assert short.config_dict["indexer_types"] == ["full"] * 5 and short.config_dict["scoring_func"] == "sigmoid"
    long = GGUFCheckpoint(path.with_name("tiny-glm-dsa-everywhere-1048576.gguf"))
    assert long.config_dict["indexer_types"] == ["full", "full", "full", "shared", "shared"]
    assert "model.layers.2.self_attn.indexer.wk.weight" in long.tensors
    assert not any(n.startswith(("model.layers.3.self_attn.indexer", "model.layers.4.self_attn.indexer"))
                   for n in long.tensors)
    for checkpoint, ranges in ((short, [(0, 5)]), (long, [(0, 3), (3, 5)])):
        config = checkpoint.model_config()
        stages = [Stage.load(config, checkpoint, r, has_ends=i == 0, dtype=mx.float32) for i, r in enumerate(ranges)]
        assert np.isfinite(forward(stages, LONG_PROMPT[:20])).all()


def test_a_quantized_glm_dsa_gguf_holds_its_blocks(glm_gguf):
    from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint

    path = glm_gguf[0]
    q8 = path.with_name("tiny-glm-dsa-q8_0.gguf")
    held = GGUFCheckpoint(q8).tensors
    assert held["model.layers.0.self_attn.indexer.wq_b.scales"].how in ("exact", "native")
    assert held["model.layers.1.mlp.switch_mlp.up_proj.scales"].how in ("exact", "native")
    blocks, _, _ = _gguf_logits(q8, [(0, 5)])
    values, _, _ = _gguf_logits(path.with_name("tiny-glm-dsa-dequantized.gguf"), [(0, 5)])
    print(f"glm-dsa Q8_0 GGUF vs its values in float32: max logit difference {np.abs(blocks - values).max():.3g}")
    assert np.abs(blocks - values).max() <= Q8_0_TOLERANCE


@pytest.mark.parametrize("bug", ["indexer_rope_halves", "top_k_off_by_one"])
def test_a_misread_glm_dsa_gguf_is_caught(bug, glm_gguf, monkeypatch):
    """Planted: the indexer's RoPE read as rotating halves (as if the converter had permuted its rows);
    attention.indexer.top_k read one short: each leaves transformers' logits far past the bound."""
    from pipeline.checkpoints import gguf_glm
    from test_minimax_glm import GLM_TOLERANCE

    path, expected = glm_gguf
    fields = gguf_glm.config_fields
    if bug == "indexer_rope_halves":
        monkeypatch.setattr(gguf_glm, "config_fields", lambda *a: {**fields(*a), "indexer_rope_interleave": False})
    else:
        monkeypatch.setattr(gguf_glm, "config_fields",
                            lambda *a: {**fields(*a), "index_topk": fields(*a)["index_topk"] - 1})
    wrong, _, _ = _gguf_logits(path, [(0, 5)])
    print(f"{bug}: max logit error {np.abs(wrong - expected).max():.3g}")
    assert np.abs(wrong - expected).max() > 100 * GLM_TOLERANCE


@pytest.mark.parametrize("family", ["minimax", "glm"])
def test_convert_writes_a_folder_of_the_new_families(family, minimax_gguf, glm_gguf, tmp_path):
    """`convert` of each GGUF: a folder (config.json's architectures as transformers names them) whose
    logits are transformers' as the GGUF's are."""
    from conftest import load_stages
    from pipeline.checkpoints.gguf_convert import convert_gguf
    from test_minimax_glm import GLM_TOLERANCE, MINIMAX_TOLERANCE

    (path, expected), layers, bound = {"minimax": (minimax_gguf, 4, MINIMAX_TOLERANCE),
                                       "glm": (glm_gguf, 5, GLM_TOLERANCE)}[family]
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    (stage,) = load_stages(out, [(0, layers)])
    assert np.abs(forward([stage], LONG_PROMPT) - expected).max() <= bound
