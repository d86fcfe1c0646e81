"""`--draft mtp`: DeepSeek's multi-token-prediction module as the drafter.

A tiny random DeepSeek V3 gets an MTP layer written in the published layout (layer
num_hidden_layers: enorm, hnorm, eh_proj, a full decoder layer with its experts, shared_head.norm,
and copies of the embedding and head). The reference is torch: transformers' DeepseekV3DecoderLayer
for the module's block, our own few lines for the rest (embedding first in the concatenation, the
main model's final normed state, the main model's head). Checked: the module's logits at every
prompt position, the drafts of several rounds (the module's cache rewound and refilled with the
main model's states), greedy output with and without drafts on 1-3 ranks and in batch, the last
prompt position rounded as without drafts, and one error line where there is no module."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import INIT_STD, assert_far_from_uniform, load_stages, long_prompt, mpiexec
from test_moe import make_deepseek

from pipeline.models.config import ModelConfig
from pipeline.checkpoints.mtp import load_mtp
from pipeline.checkpoints.safetensors_checkpoint import Checkpoint

PROMPT = long_prompt(40, seed=3)
TEXT = ("Pipeline parallel inference splits layers across ranks; hidden states travel between them. "
        "The quick brown fox jumps over the lazy dog. The capital of France is Paris.")


class Reference:
    """The main model and its MTP module in torch."""

    def __init__(self, main, block, own: dict):
        self.main, self.block, self.own = main, block, own
        self.eps = main.config.rms_norm_eps

    def norm(self, x, weight):
        x = x.float()
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def combine(self, tokens, states):
        """eh_proj([enorm(embed(t_{j+1})); hnorm(h_j)]): the published order, embedding first."""
        embedded = self.main.model.embed_tokens(torch.tensor(tokens))
        both = torch.cat([self.norm(embedded, self.own["enorm.weight"]),
                          self.norm(states, self.own["hnorm.weight"])], dim=-1)
        return both @ self.own["eh_proj.weight"].T

    def run_block(self, x):
        """The module's decoder layer over positions 0..T-1 (causal), recomputed from scratch."""
        T = x.shape[0]
        positions = torch.arange(T)[None]
        cos_sin = self.main.model.rotary_emb(x[None], positions)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = self.block(x[None], attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return self.norm(out[0], self.own["shared_head.norm.weight"])

    def mtp_logits(self, history):
        """The module's logits at each position j < len(history) - 1 (predicting t_{j+2}), from the
        main model's final normed states of history[:-1]."""
        with torch.no_grad():
            states = self.main.model(torch.tensor([history[:-1]])).last_hidden_state[0]
            return self.main.lm_head(self.run_block(self.combine(history[1:], states)))

    def drafts(self, history, k, first=0):
        """K greedy drafts after `history`, the module's step repeated on its own state and draft;
        first: the module saw positions from there on only (a prefix-cache hit)."""
        with torch.no_grad():
            states = self.main.model(torch.tensor([history[:-1]])).last_hidden_state[0]
            x = self.combine(history[first + 1:], states[first:])
            out = []
            for _ in range(k):
                state = self.run_block(x)[-1]
                out.append(int(self.main.lm_head(state).argmax()))
                x = torch.cat([x, self.combine([out[-1]], state[None])])
            return out


def add_mtp_layer(folder, main, donor_folder, seed=5):
    """Write an MTP module into `folder` in DeepSeek's layout: the decoder layer is the last layer
    of a donor model of one more layer (so transformers initialised it and wrote it in its
    format), its own norms and projection are random, and the layer holds copies of the
    embedding and head, as DeepSeek's files do. Returns the reference's pieces."""
    config = main.config
    donor = make_deepseek(donor_folder, seed=seed, num_hidden_layers=config.num_hidden_layers + 1,
                          num_nextn_predict_layers=1)
    L, d = config.num_hidden_layers, config.hidden_size
    g = torch.Generator().manual_seed(seed)
    own = {"enorm.weight": 1 + 0.1 * torch.randn(d, generator=g), "hnorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
           "eh_proj.weight": INIT_STD * torch.randn(d, 2 * d, generator=g),
           "shared_head.norm.weight": 1 + 0.1 * torch.randn(d, generator=g)}
    with torch.no_grad():  # a final norm far from 1, so reading states before it would show
        main.model.norm.weight.copy_(0.2 + 1.8 * torch.rand(d, generator=g))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = main.model.norm.weight.detach().clone()
    for name, t in load_file(str(donor_folder / "model.safetensors")).items():
        if name.startswith(f"model.layers.{L}."):
            tensors[name] = t
    for name, t in own.items():
        tensors[f"model.layers.{L}.{name}"] = t.contiguous()
    tensors[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    block = donor.model.layers[L]
    donor.config._attn_implementation = "eager"  # the causal mask as given (the config is shared)
    return Reference(main, block, own)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    main = make_deepseek(root / "model", num_nextn_predict_layers=1)
    main.config._attn_implementation = "eager"
    reference = add_mtp_layer(root / "model", main, root / "donor")
    make_deepseek(root / "plain")  # the same family without the module
    return root / "model", root / "plain", reference


def load_with_mtp(folder, ranges=((0, 4),)):
    stages = load_stages(folder, ranges)
    config = ModelConfig.from_folder(folder)
    stages[0].mtp = load_mtp(config, Checkpoint(folder), mx.float32)
    return stages


def test_module_logits_match_the_reference(mtp_model):
    """At every prompt position, our module's logits (from the states the ring returns) are the
    torch reference's."""
    folder, _, reference = mtp_model
    (stage,) = load_with_mtp(folder)
    model, mtp = stage.model, stage.mtp
    history = PROMPT + [7]
    hidden = stage.run_layers(model.embed(mx.array([history[:-1]])))
    states = model.norm(hidden)
    ours = model.lm_head(mtp(model.embed(mx.array([history[1:]])), states, mtp.make_cache()))[0]
    truth = reference.mtp_logits(history).numpy()
    assert_far_from_uniform(truth)
    assert np.abs(np.array(ours) - truth).max() < 1e-4


def test_the_module_reads_only_its_own_tensors(mtp_model):
    """The layer's copies of the embedding and head are the main model's and never read; the
    main model's ranks never read the module."""
    folder, _, _ = mtp_model
    names = set(load_stages(folder, [(0, 4)])[0].loaded_tensors)
    assert not any(n.startswith("model.layers.4.") for n in names)
    from pipeline.models.mtp import mtp_tensor_names

    mtp = mtp_tensor_names(Checkpoint(folder), ModelConfig.from_folder(folder))
    assert "model.layers.4.eh_proj.weight" in mtp and "model.layers.4.shared_head.norm.weight" in mtp
    assert not any(n.endswith(("embed_tokens.weight", "shared_head.head.weight")) for n in mtp)


class Recording:
    """An MtpDrafter's proposals recorded with the history they followed; `right` > 0 sends the
    ring the known continuation instead (right for the first `right` tokens of each draft), so
    drafts are accepted while the module still runs and keeps its cache as with its own drafts."""

    def __init__(self, drafter, continuation=None, prompt_len=0, right=0):
        self.drafter, self.continuation, self.prompt_len, self.right = drafter, continuation, prompt_len, right
        self.rounds = []
        self.wants_hidden = True

    def propose(self, history, limit):
        drafts = self.drafter.propose(history, limit)
        self.rounds.append((list(history), drafts))
        if not self.right or not drafts:
            return drafts
        done = len(history) - self.prompt_len
        known = self.continuation[done:done + len(drafts)]
        return [t if i < self.right else (t + 1) % 384 for i, t in enumerate(known)]

    def observe(self, drafted, accepted):
        self.drafter.observe(drafted, accepted)

    def returned(self, rows):
        self.drafter.returned(rows)

    def starts_at(self, position):
        self.drafter.starts_at(position)


def generate_with(stage, folder, drafter, max_tokens=24):
    from mpi4py import MPI

    from pipeline.runtime.engine import generate
    from pipeline.runtime.requests import SamplingParams
    from pipeline.checkpoints.tokenizer import Tokenizer
    from pipeline.cluster.transport import MpiTransport

    stage.release([0])
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.eos_token_ids = set()  # a random model says end-of-text early; decode the full length
    return generate(stage, MpiTransport(MPI.COMM_SELF), tokenizer, PROMPT, SamplingParams(), max_tokens,
                    drafter=drafter)


@pytest.mark.parametrize("right", [0, 2, 3])
def test_drafts_of_every_round_match_the_reference(mtp_model, right):
    """Through a generation with K = 3: each round's drafts are the reference's for the tokens so far
    (so the module's cache dropped its own entries and took the main model's states of the
    accepted positions), the output is plain greedy decoding's. right = 0: the module's own drafts
    (rarely accepted on a random model); 2, 3: drafts accepted each trip (the accept path)."""
    from pipeline.runtime.speculative import MtpDrafter

    folder, _, reference = mtp_model
    (stage,) = load_with_mtp(folder)
    plain = generate_with(stage, folder, None)
    recording = Recording(MtpDrafter(stage.mtp, stage.model, 3), plain.tokens, len(PROMPT), right)
    drafted = generate_with(stage, folder, recording)
    assert drafted.tokens == plain.tokens
    stats = drafted.draft
    if right:
        assert stats.accepted > 0 and (right < 3 or stats.accepted == stats.drafted)
    rounds = recording.rounds
    assert len(rounds) >= 5
    for history, drafts in rounds[:6]:
        assert drafts == reference.drafts(history, len(drafts)), len(history)


def test_a_sequence_started_from_the_prefix_cache_drafts_from_its_first_new_position(mtp_model):
    """After a prefix-cache hit the module sees the positions from the first one computed anew
    (starts_at): its drafts are the reference's over those positions."""
    from pipeline.runtime.speculative import MtpDrafter

    folder, _, reference = mtp_model
    (stage,) = load_with_mtp(folder)
    model = stage.model
    hidden = stage.run_layers(model.embed(mx.array([PROMPT])), last_only=True, full=[True])
    history = PROMPT + [int(mx.argmax(model.logits(hidden[0, -1])).item())]
    drafter = MtpDrafter(stage.mtp, model, 3)
    drafter.starts_at(25)
    drafter.returned(model.norm(hidden[0, 25:]))
    assert drafter.propose(history, 3) == reference.drafts(history, 3, first=25)


def test_a_prompt_returning_every_position_rounds_its_last_as_without(mtp_model):
    """The MTP reads every prompt position's state; the last one, which the first token comes from,
    is computed as when only it comes back (bit for bit), and so are the caches; prompts of 100
    and 12 tokens (one masked attention call over many rows, and over a few)."""
    folder, _, _ = mtp_model
    (stage,) = load_stages(folder, [(0, 4)])
    for length in (100, 12):
        prompt = long_prompt(length, seed=length)
        h = stage.model.embed(mx.array([prompt]))
        last = stage.run_layers(h, [1], last_only=True)
        every = stage.run_layers(h, [2], last_only=True, full=[True])
        assert every.shape[1] == length
        assert np.array_equal(np.array(every[0, -1]), np.array(last[0, -1]))
        for a, b in zip(stage.caches[1], stage.caches[2]):
            assert np.array_equal(np.array(a.keys[..., :a.offset, :]), np.array(b.keys[..., :b.offset, :]))
        whole = stage.run_layers(h, [3])  # the other positions: those of a plain full pass
        assert np.abs(np.array(every[0, :-1]) - np.array(whole[0, :-1])).max() < 1e-5
        stage.release([1, 2, 3])


def test_generate_with_mtp_equals_plain_on_1_2_3_ranks(mtp_model):
    folder, _, _ = mtp_model
    args = ("generate", "--model", str(folder), "--no-chat-template", "--prompt", TEXT, "--max-tokens", "24")
    plain = mpiexec(1, *args, "--draft", "none")
    assert plain.returncode == 0, plain.stderr
    for ranks in (1, 2, 3):
        drafted = mpiexec(ranks, *args, "--draft", "mtp", "--draft-tokens", "2")
        assert drafted.returncode == 0, drafted.stderr
        assert drafted.stdout == plain.stdout, ranks
        stats = re.search(r"speculative: drafted (\d+), accepted (\d+)", drafted.stderr)
        assert stats and int(stats.group(1)) > 0, drafted.stderr


def test_mtp_with_int8_products_equals_plain(mtp_model, kernels):
    """--int8-activations (the module's own layer repacked too, the head shared with rank 0's model):
    drafts on 2 ranks give the tokens of plain decoding on 1 rank with the same products."""
    folder, _, _ = mtp_model
    args = ("generate", "--model", str(folder), "--no-chat-template", "--prompt", TEXT, "--max-tokens", "24",
            "--quantize", "8", "--group-size", "32", "--int8-activations")
    plain = mpiexec(1, *args, "--draft", "none")
    assert plain.returncode == 0, plain.stderr
    drafted = mpiexec(2, *args, "--draft", "mtp", "--draft-tokens", "2")
    assert drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout and "int8 activations" in drafted.stderr
    stats = re.search(r"speculative: drafted (\d+), accepted (\d+)", drafted.stderr)
    assert stats and int(stats.group(1)) > 0, drafted.stderr


def test_batch_with_mtp_equals_batch_without(mtp_model, tmp_path):
    """Each sequence drafts with its own module cache inside the micro-batches: texts equal those
    without drafts on 2 and 3 ranks (head shared), and with the prefix cache (one at a time, so the
    later requests start from the first one's caches and their module from the first new position)."""
    from test_batch import batch, read_records, write_jsonl

    folder, _, _ = mtp_model
    rows = [{"id": i, "prompt": TEXT + p, "max_tokens": 16} for i, p in enumerate(
        [" The capital of France is", " def hello(world):\n    return 42\n", " hidden states"])]
    rows.append({"id": "sampled", "prompt": TEXT, "max_tokens": 12, "temperature": 0.7, "seed": 3})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    plain = batch(2, folder, inp, tmp_path / "plain.jsonl", "--no-chat-template")
    assert plain.returncode == 0, plain.stderr
    expected = {r["id"]: r["text"] for r in read_records(tmp_path / "plain.jsonl") if r["id"] != "sampled"}
    runs = ((2, ()), (3, ("--head-share", "0.5")), (2, ("--max-batch", "1", "--prefix-cache-gb", "0.01")))
    for n, extra in runs:
        out = tmp_path / f"mtp{n}{len(extra)}.jsonl"
        result = batch(n, folder, inp, out, "--no-chat-template", "--draft", "mtp", "--draft-tokens", "2", *extra)
        assert result.returncode == 0, result.stderr
        records = {r["id"]: r for r in read_records(out)}
        assert {i: r["text"] for i, r in records.items() if i != "sampled"} == expected, extra
        assert "text" in records["sampled"]
        assert re.search(r"speculative: drafted [1-9]", result.stderr), result.stderr
        if "--prefix-cache-gb" in extra:
            cached = [records[i]["usage"]["prompt_tokens_details"]["cached_tokens"] for i in range(3)]
            assert cached[0] == 0 and all(c > 20 for c in cached[1:]), cached


def test_no_module_is_one_error_line(mtp_model, tiny_models):
    _, plain, _ = mtp_model
    for folder, says in ((plain, "has no MTP module"), (tiny_models["llama"], "model_type llama has none")):
        result = mpiexec(2, "generate", "--model", str(folder), "--prompt", "hi", "--draft", "mtp")
        assert result.returncode != 0
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: --draft mtp") and says in lines[0], result.stderr


class TwoRanks:
    """plan_job's view of a 2-rank communicator (it only asks the size without --weights-in-memory auto)."""

    def Get_size(self):
        return 2


def test_the_module_counts_on_rank_0(mtp_model):
    """With --draft mtp the split, --host-memory's fit check and preflight count the module on rank 0:
    here it moves a layer to rank 1."""
    from pipeline.runtime.job import plan_job
    from pipeline.runtime.settings import WeightSettings
    from pipeline.models.mtp import mtp_nbytes

    folder, plain, _ = mtp_model
    plans = {}
    for draft in ("none", "mtp"):
        args = WeightSettings(model=folder, draft=draft, split=None, host_memory="1,1", weights_in_memory="quantized",
                              int8_activations=False, quantize=None, group_size=64, dtype="float32")
        plans[draft] = plan_job(args, TwoRanks())
    module = mtp_nbytes(Checkpoint(folder), ModelConfig.from_folder(folder))  # float32 as stored and as held
    assert plans["mtp"].host_memory.mb.ends - plans["none"].host_memory.mb.ends == module > 0
    assert plans["none"].ranges == [(0, 2), (2, 4)] and plans["mtp"].ranges == [(0, 1), (1, 4)]

    weights = {}
    for draft in ("none", "mtp"):
        result = mpiexec(2, "preflight", "--model", str(folder), "--draft", draft)
        assert result.returncode == 0, result.stderr
        weights[draft] = float(re.search(r"^0 .*? ([\d.]+) MiB fp32", result.stdout, re.M).group(1))
    assert weights["mtp"] - weights["none"] == pytest.approx(module / 2**20, abs=0.06)
    result = mpiexec(2, "preflight", "--model", str(plain), "--draft", "mtp")
    assert result.returncode == 1 and "--draft mtp: " in result.stderr and "has no MTP module" in result.stderr


def module_logits(stage, mtp, history):
    model = stage.model
    states = model.norm(stage.run_layers(model.embed(mx.array([history[:-1]]))))
    stage.release([0])
    return np.array(model.lm_head(mtp(model.embed(mx.array([history[1:]])), states, mtp.make_cache()))[0])


def test_the_module_loads_from_fp8_and_mlx_quantized_folders(mtp_model, tmp_path):
    """DeepSeek's FP8 (e4m3, 128x128 block scales) with --quantize 8, and an MLX-quantized folder
    (experts stacked as switch_mlp): the module held quantized, its logits those of the weights
    it stands for."""
    from conftest import fp8_blocks

    from pipeline.checkpoints.format_adapters import Requantize, adapt_tensors

    folder, _, reference = mtp_model
    config = ModelConfig.from_folder(folder)
    (stage,) = load_stages(folder, [(0, 4)])
    history = PROMPT + [7]
    truth = reference.mtp_logits(history).numpy()

    fp8 = {}
    for name, w in load_file(str(folder / "model.safetensors")).items():
        if name.startswith("model.layers.4.") and name.endswith("proj.weight") and w.ndim == 2:
            fp8[name], fp8[name + "_scale_inv"] = fp8_blocks(w.float())
        else:
            fp8[name] = w
    (tmp_path / "fp8").mkdir()
    save_file(fp8, str(tmp_path / "fp8" / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    mtp = load_mtp(config, Checkpoint(tmp_path / "fp8"), mx.float32, Requantize(8, 32))
    assert type(mtp.eh_proj).__name__ == "QuantizedLinear"
    assert type(mtp.block.mlp.switch_mlp.gate_proj).__name__ == "QuantizedSwitchLinear"
    assert np.corrcoef(module_logits(stage, mtp, history).ravel(), truth.ravel())[0, 1] > 0.995

    checkpoint = Checkpoint(folder)
    stacked = dict(adapt_tensors(sorted(checkpoint.tensors), checkpoint.tensors, checkpoint.read, mx.float32))
    quantized, dequantized = {}, {}
    for name, w in stacked.items():
        if name.startswith("model.layers.4.") and name.endswith("proj.weight") and w.shape[-1] % 32 == 0:
            q, s, b = mx.quantize(w, group_size=32, bits=4)
            stem = name[: -len(".weight")]
            quantized.update({name: q, stem + ".scales": s, stem + ".biases": b})
            dequantized[name] = mx.dequantize(q, s, b, group_size=32, bits=4)
        else:
            quantized[name] = dequantized[name] = w
    for sub, tensors in (("mlx", quantized), ("dq", dequantized)):
        (tmp_path / sub).mkdir()
        mx.save_safetensors(str(tmp_path / sub / "model.safetensors"), tensors)
        (tmp_path / sub / "config.json").write_text(json.dumps(
            {**json.loads((folder / "config.json").read_text()),
             **({"quantization": {"group_size": 32, "bits": 4}} if sub == "mlx" else {})}))
    q = load_mtp(config, Checkpoint(tmp_path / "mlx"), mx.float32)
    dq = load_mtp(config, Checkpoint(tmp_path / "dq"), mx.float32)
    assert type(q.block.mlp.switch_mlp.up_proj).__name__ == "QuantizedSwitchLinear"
    assert np.abs(module_logits(stage, q, history) - module_logits(stage, dq, history)).max() <= 1e-4
