"""`--draft mtp` on GLM-5 (`glm_moe_dsa`): its MTP layer as published (layer num_hidden_layers: enorm,
hnorm, eh_proj, shared_head.norm, and a full decoder layer with its DSA attention, indexer and experts).

GLM's module is DeepSeek V3.2's (vLLM maps glm_moe_dsa to its DeepseekV32MTPModel), so the equations are
models/mtp.py's; transformers does not read the layer (`_keys_to_ignore_on_load_unexpected`). The truth
here is written independently: for position j, with h_j the main model's final normed state (transformers'
`last_hidden_state`),

    x_j = eh_proj([enorm(embed(t_{j+1})) ; hnorm(h_j)])     (torch, by hand)
    o_j = shared_head.norm(layer(x_j))                      (a one-layer transformers GLM model over x:
                                                             its layer is the MTP block, its final norm
                                                             shared_head.norm)
    logits(t_{j+2}) = lm_head(o_j)                          (the main model's head)

and K drafts repeat the step on the module's own o and draft. Checked: the module's logits at every prompt
position, from safetensors and from a glm-dsa GGUF (llama.cpp's `blk.N.nextn.*` names); the drafts of
every round (the module's cache rewound and refilled), all accepted where drafts are forced right; greedy
output with and without drafts on 1 and 2 ranks; and planted bugs (enorm and hnorm swapped; the main
model's final norm instead of shared_head.norm) that the logit comparison catches."""

from __future__ import annotations

import json
import re
import types

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import INIT_STD, assert_far_from_uniform, load_stages, long_prompt, mpiexec
from test_minimax_glm import _perturb, make_glm_moe_dsa
from test_mtp import Recording, generate_with

from pipeline.checkpoints.mtp import load_mtp
from pipeline.checkpoints.safetensors_checkpoint import Checkpoint
from pipeline.models import mtp as mtp_module
from pipeline.models.config import ModelConfig

PROMPT = long_prompt(40, seed=3)  # past the indexer's top-k (16): the module's attention is sparse
LAYERS = 5
# Measured 2.3e-5 (float32, 40 positions; logits up to |9.7|; the main model alone: 1.6e-5, test_minimax_glm).
TOLERANCE = 4e-5
TEXT = ("Pipeline parallel inference splits layers across ranks; hidden states travel between them. "
        "The quick brown fox jumps over the lazy dog.")


class Reference:
    """GLM's main model and its MTP module in torch (see the module docstring)."""

    def __init__(self, main, block_model, own: dict):
        self.main, self.block_model, self.own = main, block_model, own
        self.eps = main.config.rms_norm_eps

    def norm(self, x, weight):
        x = x.double()
        return (weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).float()

    def combine(self, tokens, states):
        """eh_proj([enorm(embed(t_{j+1})); hnorm(h_j)]): the embedding first."""
        embedded = self.main.model.embed_tokens(torch.tensor(tokens))
        both = torch.cat([self.norm(embedded, self.own["enorm.weight"]),
                          self.norm(states, self.own["hnorm.weight"])], dim=-1)
        return both @ self.own["eh_proj.weight"].T

    def run_block(self, x):
        """shared_head.norm(layer(x)) over positions 0..T-1, causal, from scratch."""
        return self.block_model.model(inputs_embeds=x[None]).last_hidden_state[0]

    def states(self, history):
        return self.main.model(torch.tensor([history])).last_hidden_state[0]

    def mtp_logits(self, history):
        """The module's logits at each j < len(history) - 1 (predicting t_{j+2})."""
        with torch.no_grad():
            states = self.states(history[:-1])
            return self.main.lm_head(self.run_block(self.combine(history[1:], states)))

    def drafts(self, history, k):
        with torch.no_grad():
            x = self.combine(history[1:], self.states(history[:-1]))
            out = []
            for _ in range(k):
                state = self.run_block(x)[-1]
                out.append(int(self.main.lm_head(state).argmax()))
                x = torch.cat([x, self.combine([out[-1]], state[None])])
            return out


def add_glm_mtp_layer(folder, main, seed=5) -> Reference:
    """Write GLM's MTP layer into `folder` as published (model.layers.{L}.*, with copies of the embedding
    and head); its decoder layer is that of a one-layer GLM model transformers built (a full indexer, MoE),
    whose final norm is the module's shared_head.norm."""
    c = main.config
    torch.manual_seed(seed)
    donor_config = transformers.GlmMoeDsaConfig(**{
        **{k: getattr(c, k) for k in (
            "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
            "n_routed_experts", "num_experts_per_tok", "vocab_size", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk", "index_n_heads", "index_head_dim",
            "max_position_embeddings", "initializer_range")},
        "num_hidden_layers": 1, "mlp_layer_types": ["sparse"], "indexer_types": ["full"],
        "bos_token_id": None, "eos_token_id": 2})
    donor = transformers.GlmMoeDsaForCausalLM(donor_config).eval()
    _perturb(donor)
    d, L = c.hidden_size, c.num_hidden_layers
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in donor.named_parameters():  # the indexer's LayerNorm bias, as make_glm_moe_dsa
            if name.endswith("bias") and "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        donor.model.norm.weight.copy_(0.2 + 1.8 * torch.rand(d, generator=g))  # shared_head.norm, far from 1
        main.model.norm.weight.copy_(0.2 + 1.8 * torch.rand(d, generator=g))  # so reading states before it shows
    own = {"enorm.weight": 0.2 + 1.8 * torch.rand(d, generator=g), "hnorm.weight": 0.2 + 1.8 * torch.rand(d, generator=g),
           "eh_proj.weight": INIT_STD * torch.randn(d, 2 * d, generator=g),
           "shared_head.norm.weight": donor.model.norm.weight.detach().clone()}
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = main.model.norm.weight.detach().clone()
    for name, t in donor.state_dict().items():
        if name.startswith("model.layers.0."):
            tensors[name.replace("model.layers.0.", f"model.layers.{L}.")] = t.detach().clone().contiguous()
    for name, t in own.items():
        tensors[f"model.layers.{L}.{name}"] = t.contiguous()
    tensors[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    return Reference(main, donor, own)


@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm_mtp") / "model"
    main = make_glm_moe_dsa(folder)
    reference = add_glm_mtp_layer(folder, main)
    return folder, reference


def load_with_mtp(folder, checkpoint=None):
    (stage,) = load_stages(folder, [(0, LAYERS)])
    config = ModelConfig.from_folder(folder)
    stage.mtp = load_mtp(config, checkpoint or Checkpoint(folder), mx.float32)
    return stage


def module_logits(stage, history) -> np.ndarray:
    model, mtp = stage.model, stage.mtp
    states = model.norm(stage.run_layers(model.embed(mx.array([history[:-1]]))))
    stage.release([0])
    return np.array(model.lm_head(mtp(model.embed(mx.array([history[1:]])), states, mtp.make_cache()))[0])


def test_module_logits_match_the_reference(glm_mtp):
    """At every prompt position, the module's logits from the main model's states are the reference's;
    its block is a full layer (its own indexer) with experts, and it reads only its own tensors."""
    folder, reference = glm_mtp
    stage = load_with_mtp(folder)
    assert not stage.mtp.block.self_attn.shared and hasattr(stage.mtp.block.self_attn, "indexer")
    assert type(stage.mtp.block.mlp).__name__ == "DeepseekMoE"
    names = mtp_module.mtp_tensor_names(Checkpoint(folder), ModelConfig.from_folder(folder))
    assert f"model.layers.{LAYERS}.eh_proj.weight" in names
    assert not any(n.endswith(("embed_tokens.weight", "shared_head.head.weight")) for n in names)
    history = PROMPT + [7]
    truth = reference.mtp_logits(history).numpy()
    assert_far_from_uniform(truth)
    error = np.abs(module_logits(stage, history) - truth).max()
    print(f"GLM MTP module: max logit error {error:.3g} (logits up to {np.abs(truth).max():.2g})")
    assert error < TOLERANCE


@pytest.mark.parametrize("bug", ["enorm and hnorm swapped", "the main model's norm for shared_head.norm"])
def test_planted_bugs_are_caught(glm_mtp, bug, monkeypatch):
    folder, reference = glm_mtp
    stage = load_with_mtp(folder)
    mtp, model = stage.mtp, stage.model
    if bug == "enorm and hnorm swapped":
        mtp.enorm, mtp.hnorm = mtp.hnorm, mtp.enorm
    else:
        mtp.shared_head.norm = model.norm
    history = PROMPT + [7]
    error = np.abs(module_logits(stage, history) - reference.mtp_logits(history).numpy()).max()
    print(f"{bug}: max logit error {error:.3g}")
    assert error > 1000 * TOLERANCE


@pytest.mark.parametrize("right", [0, 3])
def test_drafts_of_every_round_match_the_reference(glm_mtp, right):
    """Through a generation with K = 3, each round's drafts are the reference's for the tokens so far, and
    the output is plain greedy decoding's. right = 3: the ring gets the known continuation as drafts
    (while the module still drafts and keeps its cache as with its own): every draft is accepted."""
    from pipeline.runtime.speculative import MtpDrafter

    folder, reference = glm_mtp
    stage = load_with_mtp(folder)
    plain = generate_with(stage, folder, None)
    recording = Recording(MtpDrafter(stage.mtp, stage.model, 3), plain.tokens, len(PROMPT), right)
    drafted = generate_with(stage, folder, recording)
    assert drafted.tokens == plain.tokens
    stats = drafted.draft
    print(f"right={right}: drafted {stats.drafted}, accepted {stats.accepted}")
    if right:
        assert stats.drafted > 0 and stats.accepted == stats.drafted
    rounds = recording.rounds
    assert len(rounds) >= 5
    for history, drafts in rounds[:6]:
        assert drafts == reference.drafts(history, len(drafts)), len(history)


def test_generate_with_mtp_equals_plain_on_1_and_2_ranks(glm_mtp):
    """`generate --draft mtp` prints `--draft none`'s text on 1 and 2 ranks (--split 1,4: rank 1 begins at
    a shared layer, so the top-k crosses the boundary as well)."""
    folder, _ = glm_mtp
    args = ("generate", "--model", str(folder), "--no-chat-template", "--prompt", TEXT, "--max-tokens", "20")
    plain = mpiexec(1, *args, "--draft", "none")
    assert plain.returncode == 0, plain.stderr
    for ranks, extra in ((1, ()), (2, ("--split", "1,4"))):
        drafted = mpiexec(ranks, *args, *extra, "--draft", "mtp", "--draft-tokens", "2")
        assert drafted.returncode == 0, drafted.stderr
        assert drafted.stdout == plain.stdout, ranks
        stats = re.search(r"speculative: drafted (\d+), accepted (\d+)", drafted.stderr)
        assert stats and int(stats.group(1)) > 0, drafted.stderr


def test_the_module_loads_from_a_glm_dsa_gguf(glm_mtp, tmp_path, monkeypatch):
    """A glm-dsa GGUF written as llama.cpp's converter writes GLM-5 (the MTP layer as block 5:
    `blk.5.nextn.eh_proj` / `enorm` / `hnorm` / `shared_head_norm` / `embed_tokens` / `shared_head_head`,
    its attention, indexer and experts as any block's): the module's tensors under the published names,
    its copies of the embedding and head not read, and its logits the reference's; a Q8_0 copy (held as MLX 8-bit) those
    of a float32 file of its blocks' values."""
    import test_gguf_new_families as writer
    from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
    from pipeline.runtime.stage import Stage
    from test_gguf_inplace import gguf_vocab

    folder, reference = glm_mtp
    main = reference.main
    stored = dict(main.state_dict())  # transformers' in-memory names (experts fused), as the writer reads them
    for name, t in reference.block_model.state_dict().items():
        if name.startswith("model.layers.0."):
            stored[name.replace("model.layers.0.", f"model.layers.{LAYERS}.")] = t
    for name, t in reference.own.items():
        stored[f"model.layers.{LAYERS}.{name}"] = t
    stored[f"model.layers.{LAYERS}.embed_tokens.weight"] = stored["model.embed_tokens.weight"]
    stored[f"model.layers.{LAYERS}.shared_head.head.weight"] = stored["lm_head.weight"]
    holder = types.SimpleNamespace(config=types.SimpleNamespace(**{**main.config.to_dict(),
                                                                   "num_hidden_layers": LAYERS + 1}),
                                   state_dict=lambda: stored)
    tensors = writer.glm_dsa_tensors(holder, mtp_layer=False)
    assert {f"blk.{LAYERS}.nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm",
                                                        "embed_tokens", "shared_head_head")} <= set(tensors)
    monkeypatch.setattr(writer, "glm_dsa_tensors", lambda model, mtp_layer: tensors)
    history = PROMPT + [7]
    truth = reference.mtp_logits(history).numpy()
    logits = {}
    for kind in ("", "q8_0", "dequantized"):
        path = tmp_path / f"glm-mtp{kind}.gguf"
        writer.write_glm_dsa_gguf(path, main, gguf_vocab(folder), kind)
        checkpoint = GGUFCheckpoint(path)
        config = checkpoint.model_config()
        assert config.num_hidden_layers == LAYERS and config.raw["num_nextn_predict_layers"] == 1
        assert mtp_module.has_mtp(checkpoint, config)
        names = mtp_module.mtp_tensor_names(checkpoint, config)
        assert {f"model.layers.{LAYERS}.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head.norm")} \
            <= set(names)
        assert f"model.layers.{LAYERS}.self_attn.indexer.wk.weight" in names
        assert not any("embed_tokens" in n or "shared_head.head" in n for n in names)
        stage = Stage.load(config, checkpoint, (0, LAYERS), has_ends=True, dtype=mx.float32)
        stage.mtp = load_mtp(config, checkpoint, mx.float32)
        logits[kind] = module_logits(stage, history)
    error = np.abs(logits[""] - truth).max()
    blocks = np.abs(logits["q8_0"] - logits["dequantized"]).max()
    print(f"GLM MTP from a glm-dsa GGUF: max logit error {error:.3g} (F32), Q8_0 vs its blocks' values {blocks:.3g}")
    assert error < TOLERANCE and blocks <= writer.Q8_0_TOLERANCE

    # the command line on the file: drafts on 2 ranks give the text of none
    args = ("generate", "--model", str(tmp_path / "glm-mtp.gguf"), "--no-chat-template", "--prompt", TEXT,
            "--max-tokens", "12")
    plain = mpiexec(1, *args, "--draft", "none")
    drafted = mpiexec(2, *args, "--split", "1,4", "--draft", "mtp", "--draft-tokens", "2")
    assert plain.returncode == 0 and drafted.returncode == 0, plain.stderr + drafted.stderr
    assert drafted.stdout == plain.stdout and re.search(r"speculative: drafted [1-9]", drafted.stderr)


def test_the_module_loads_from_an_fp8_folder(glm_mtp, tmp_path):
    """GLM-5-FP8's layout (e4m3 with a float32 scale per 128x128 block; routers, the indexer's
    weights_proj, norms, embedding and head left in bf16/float) in the MTP layer too: the module held in
    float32 from it gives the logits of the module loaded from a float folder of the values the blocks
    stand for (that folder's module is checked against the reference above)."""
    from test_new_family_formats import FP8_CONFIG, GLM_NOT_FP8, fp8_pair

    folder, reference = glm_mtp
    published, dequantized = {}, {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        if name.startswith("model.layers.") and t.ndim == 2 and not name.endswith(GLM_NOT_FP8) \
                and "embed_tokens" not in name and "shared_head.head" not in name:
            published[name], published[name + "_scale_inv"], dequantized[name] = fp8_pair(t)
        else:
            published[name] = dequantized[name] = t
    assert f"model.layers.{LAYERS}.eh_proj.weight_scale_inv" in published
    cfg = json.loads((folder / "config.json").read_text())
    for sub, tensors, extra in (("fp8", published, {"quantization_config": FP8_CONFIG}), ("dq", dequantized, {})):
        (tmp_path / sub).mkdir()
        save_file(tensors, str(tmp_path / sub / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / sub / "config.json").write_text(json.dumps({**cfg, **extra}))
        for tokenizer_file in folder.glob("tokenizer*"):
            (tmp_path / sub / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    history = PROMPT + [7]
    fp8 = module_logits(load_with_mtp(tmp_path / "fp8"), history)
    dq = module_logits(load_with_mtp(tmp_path / "dq"), history)
    error = np.abs(fp8 - dq).max()
    print(f"GLM MTP from FP8: max logit difference to its blocks' values {error:.3g}; "
          f"to the float model {np.abs(fp8 - reference.mtp_logits(history).numpy()).max():.3g}")
    assert error < TOLERANCE


def test_batch_with_mtp_equals_batch_without(glm_mtp, tmp_path):
    """Each sequence drafts with its own module cache inside the micro-batches: on 2 ranks (--split 1,4)
    the texts equal those without drafts, with the LM head shared and with the prefix cache (one at a
    time, so the later requests resume from the first one's caches and their module from the first new
    position)."""
    from test_batch import batch, read_records, write_jsonl

    folder, _ = glm_mtp
    rows = [{"id": i, "prompt": TEXT + p, "max_tokens": 12} for i, p in enumerate(
        [" The capital of France is", " def hello(world):\n    return 42\n", " hidden states"])]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    plain = batch(2, folder, inp, tmp_path / "plain.jsonl", "--no-chat-template", "--split", "1,4")
    assert plain.returncode == 0, plain.stderr
    expected = {r["id"]: r["text"] for r in read_records(tmp_path / "plain.jsonl")}
    for extra in (("--head-share", "0.5"), ("--max-batch", "1", "--prefix-cache-gb", "0.01")):
        out = tmp_path / f"mtp{len(extra)}.jsonl"
        result = batch(2, folder, inp, out, "--no-chat-template", "--split", "1,4", "--draft", "mtp",
                       "--draft-tokens", "2", *extra)
        assert result.returncode == 0, result.stderr
        records = {r["id"]: r for r in read_records(out)}
        assert {i: r["text"] for i, r in records.items()} == expected, extra
        assert re.search(r"speculative: drafted [1-9]", result.stderr), result.stderr
        if "--prefix-cache-gb" in extra:
            cached = [records[i]["usage"]["prompt_tokens_details"]["cached_tokens"] for i in range(3)]
            assert cached[0] == 0 and all(c > 20 for c in cached[1:]), cached
