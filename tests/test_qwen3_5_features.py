"""Qwen3.5-MoE in the pipeline's features (issue 36 item 2), on test_qwen3_5_moe's tiny model: the prefix
cache resumes a linear layer's state only from a point it kept (a prompt chunk's end, a sequence's end)
and a hit equals a cold run; speculative decoding rolls a rejected draft back to the state the verify
trip kept after the last accepted position, so drafting gives --draft none's tokens and states."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import load_stages, long_prompt
from pipeline.checkpoints.tokenizer import Tokenizer
from pipeline.models.cache import LinearAttentionState
from pipeline.runtime.requests import Finished, ListSource, Request, SamplingParams, Tokens
from test_qwen3_5_moe import make_qwen3_5_moe
from test_scheduler import Collect, scheduler
from test_speculative import Oracle

GREEDY = SamplingParams()
CHUNK = 16  # the prefill chunk here: a 40-token prompt is fed as 16 + 16 + 8
# Measured: 0 between a hit's chosen-token logprobs and a cold run's, with the BLAS shim's batch-invariant
# products (kernels/blas.py); without it the resumed prompt's rest, prefilled in other chunks than cold,
# rounds differently (test_scheduler's Llama: 6.7e-6).
REUSE_TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_features")
    make_qwen3_5_moe(folder)
    (stage,) = load_stages(folder, [(0, 6)])
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.eos_token_ids = set()  # a random model says end-of-text early; decode the full length
    return stage, tokenizer, folder


def _events(collect):
    return [e for e in collect.events if isinstance(e, Tokens)]


def _turns(stage, tokenizer, monkeypatch, prompts, max_tokens):
    """Each prompt cold (a scheduler of its own), then all in one scheduler with a prefix cache, one
    at a time: (cold results, warm results, the cache)."""
    from pipeline.runtime import scheduler as scheduler_module
    from pipeline.runtime.prefix_cache import PrefixCache

    monkeypatch.setattr(scheduler_module, "PREFILL_CHUNK", CHUNK)
    cold = []
    for prompt in prompts:
        cold.append(Collect())
        scheduler(stage, tokenizer, ListSource([Request(prompt, GREEDY, max_tokens, cold[-1], logprobs=0)])).run()
    assert not stage.caches
    stage.model.keep_points = True
    try:
        warm = [Collect() for _ in prompts]
        cache = PrefixCache(capacity_tokens=4096, point_positions=1)
        run_warm = scheduler(stage, tokenizer, ListSource([Request(p, GREEDY, max_tokens, w, logprobs=0)
                                                           for p, w in zip(prompts, warm)]), max_batch=1)
        run_warm.prefix_cache = cache
        run_warm.run()
    finally:
        stage.model.keep_points = False
    for seq_id in list(stage.caches):
        stage.release([seq_id])
    return cold, warm, cache


def _chat(tokenizer, stage, monkeypatch):
    """Turn 1 (40 tokens: resume points at 16, 32, 40 and its end); turn 2 extends turn 1's prompt and
    answer; turn 3 shares turn 1's first 37 tokens only (resumes from 32)."""
    first = long_prompt(40, seed=11)
    answer_probe = Collect()
    scheduler(stage, tokenizer, ListSource([Request(first, GREEDY, 10, answer_probe)])).run()
    answer = [e.token_id for e in _events(answer_probe)]
    second = first + answer + long_prompt(8, seed=12)
    third = first[:37] + long_prompt(9, seed=13)
    return [first, second, third], answer, _turns(stage, tokenizer, monkeypatch, [first, second, third], 10)


def test_a_hit_resumes_from_the_longest_kept_point_as_a_cold_run(qwen, monkeypatch):
    """Turn 2 starts from turn 1's end (its prompt and the 9 answer tokens fed), turn 3 from the chunk
    end at 32 (the longest kept point within its 37 shared tokens): each one's tokens equal a cold run's,
    chosen-token logprobs within REUSE_TOLERANCE; each point's states are counted in the cache."""
    stage, tokenizer, _ = qwen
    (first, second, third), answer, (cold, warm, cache) = _chat(tokenizer, stage, monkeypatch)
    assert len(set(answer)) >= 4, answer
    assert [w.last.cached_tokens for w in warm] == [0, len(first) + len(answer) - 1, 32]
    worst = 0.0
    for c, w in zip(cold, warm):
        assert isinstance(w.last, Finished) and w.last.text == c.last.text
        assert [e.token_id for e in _events(w)] == [e.token_id for e in _events(c)]
        worst = max(worst, max(abs(a.logprob.logprob - b.logprob.logprob) for a, b in zip(_events(w), _events(c))))
    print(f"max logprob difference after a hit: {worst:.2e}")
    assert worst <= REUSE_TOLERANCE
    assert cache.hits == 2
    # Turn 2 extends turn 1, whose points it inherited: turn 1 goes. Turn 3 shares only a prefix: both kept.
    assert list(cache.entries) == [1, 2]
    second_points = cache.points[1]
    assert second_points[:4] == (16, 32, 40, len(first) + len(answer) - 1) and second_points[-1] == len(cache.entries[1])
    assert cache.held == sum(-(-len(t) // cache.step) * cache.step + len(cache.points[i]) + 1 for i, t in cache.entries.items())


def _point_one_early(self):
    """The planted bug: a resume point filed one position early (the state after 32 positions under 31)."""
    if self.recurrent is not None:
        self.points[self.offset - 1] = (self.conv, self.recurrent)


def test_a_point_filed_one_position_early_is_caught(qwen, monkeypatch):
    """The comparison can fail: with each point's state filed under the length before it, turn 3 resumes
    from "31" with the state after 32 and its tokens or logprobs leave the cold run's."""
    stage, tokenizer, _ = qwen
    monkeypatch.setattr(LinearAttentionState, "keep_point", _point_one_early)
    _, _, (cold, warm, _) = _chat(tokenizer, stage, monkeypatch)
    assert warm[2].last.cached_tokens == 31
    theirs, ours = _events(cold[2]), _events(warm[2])
    assert [e.token_id for e in ours] != [e.token_id for e in theirs] or \
        max(abs(a.logprob.logprob - b.logprob.logprob) for a, b in zip(ours, theirs)) > 100 * REUSE_TOLERANCE


def _linear_states(stage):
    return [(np.array(c.conv), np.array(c.recurrent)) for c in stage.caches[0] if isinstance(c, LinearAttentionState)]


@pytest.mark.parametrize("right", [2, 0])
def test_drafts_give_plain_decodings_tokens_and_states(qwen, right):
    """generate with drafts half right, or all wrong: the tokens are plain greedy decoding's, and every
    linear layer's convolution window and memory after the last token are plain decoding's, bit for bit
    (the verify trip runs the same token-by-token recurrence; a rejected draft goes back to the state the
    trip kept after the last accepted position)."""
    stage, _, folder = qwen
    prompt = long_prompt(24, seed=7)
    plain, _ = _run(stage, folder, prompt)
    plain_states = _linear_states(stage)
    drafted, _ = _run(stage, folder, prompt, Oracle(plain.tokens, len(prompt), 4, right))
    assert drafted.tokens == plain.tokens and len(set(plain.tokens)) >= 6
    stats = drafted.draft
    assert stats.drafted > stats.accepted and (stats.accepted > 0) == (right > 0)
    for (conv, memory), (plain_conv, plain_memory) in zip(_linear_states(stage), plain_states):
        assert np.array_equal(conv, plain_conv) and np.array_equal(memory, plain_memory)
    stage.release([0])


def _run(stage, folder, prompt, drafter=None):
    """generate (engine.py) on one rank, 30 tokens, end-of-text ignored: (its result, None)."""
    from mpi4py import MPI

    from pipeline.cluster.transport import MpiTransport
    from pipeline.runtime.engine import generate

    stage.release([0])
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.eos_token_ids = set()
    return generate(stage, MpiTransport(MPI.COMM_SELF), tokenizer, prompt, GREEDY, 30, drafter=drafter), None


def _trail_one_late(self, length):
    """The planted bug: a rewind takes the state one position after the last accepted one."""
    start, window, n, replay = self.trail
    done = length - start + 1
    return window[done:done + window.shape[0] - n], replay(done)


def test_a_rewind_one_position_late_is_caught(qwen, monkeypatch):
    """The comparison can fail: rolled back to the state one position past the last accepted draft,
    the drafted run's tokens leave plain decoding's."""
    stage, _, folder = qwen
    prompt = long_prompt(24, seed=7)
    plain, _ = _run(stage, folder, prompt)
    original = LinearAttentionState._state_at
    monkeypatch.setattr(LinearAttentionState, "_state_at",
                        lambda self, n: _trail_one_late(self, n) if self.trail and n < self.offset else original(self, n))
    drafted, _ = _run(stage, folder, prompt, Oracle(plain.tokens, len(prompt), 4, 2))
    assert drafted.tokens != plain.tokens
    stage.release([0])


class Known:
    """A batch's drafter (DraftSettings' part): per sequence, drafts from each prompt's known greedy
    continuation, the first `right` of each draft right, the rest wrong."""

    kind = "known"

    def __init__(self, continuations: dict[tuple, list[int]], right: int):
        self.continuations, self.right = continuations, right

    def drafter(self, stage=None):
        known = self

        class Drafts:
            def propose(self, history, limit):
                for prompt, continuation in known.continuations.items():
                    if tuple(history[:len(prompt)]) == prompt:
                        return Oracle(continuation, len(prompt), 4, known.right).propose(history, limit)
                return []

            def observe(self, drafted, accepted):
                pass
        return Drafts()


def test_drafts_in_a_batch_are_plain_greedy(qwen):
    """The scheduler's path (batch / serve: rejected drafts leave by REWIND after sampling) with three
    sequences in one micro-batch: drafts half right, accepted and rejected (both counted), every token
    --draft none's; then --draft ngram on the same prompts, --draft none's tokens too."""
    from pipeline.runtime.settings import DraftSettings

    stage, tokenizer, _ = qwen
    prompts = [long_prompt(12 + 5 * s, seed=s) for s in (1, 2, 3)]
    plain = [Collect() for _ in prompts]
    scheduler(stage, tokenizer, ListSource([Request(p, GREEDY, 30, c) for p, c in zip(prompts, plain)])).run()
    expected = [[e.token_id for e in _events(c)] for c in plain]
    known = Known({tuple(p): tokens for p, tokens in zip(prompts, expected)}, right=2)
    for draft in (known, DraftSettings(kind="ngram", tokens=4, ngram_min=1)):
        drafted = [Collect() for _ in prompts]
        stats = _drafting(stage, tokenizer, ListSource([Request(p, GREEDY, 30, c) for p, c in zip(prompts, drafted)]),
                          draft).run()
        assert [[e.token_id for e in _events(c)] for c in drafted] == expected
        print(f"{draft.kind} drafts: {stats.draft.drafted} drafted, {stats.draft.accepted} accepted")
        if draft is known:
            assert 0 < stats.draft.accepted < stats.draft.drafted
        assert stats.draft.drafted > 0 and not stage.caches


def _drafting(stage, tokenizer, source, draft):
    """test_scheduler.scheduler with drafts."""
    from mpi4py import MPI

    from pipeline.cluster.transport import MpiTransport
    from pipeline.runtime.scheduler import Scheduler, exact_group_rows
    from pipeline.runtime.trace import Timeline

    return Scheduler(stage, MpiTransport(MPI.COMM_SELF), tokenizer, source, max_batch=8, microbatches=1,
                     group_rows=exact_group_rows(False), timeline=Timeline(0), draft=draft)


def test_three_ranks_batch_with_prefix_cache_and_ngram_drafts(qwen, tmp_path):
    """`mpiexec -n 3 ... batch --prefix-cache-gb 1 --draft ngram`, one request at a time, both kinds of
    layer on each rank: the second prompt extends the first, whose prompt-end state every rank kept
    (FORK on each rank), and its drafts are checked round the ring (REWIND): the texts of one rank
    without either, and the second reports the first's 31 prompt tokens cached."""
    import json

    from conftest import mpiexec

    _, _, folder = qwen
    first = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
    prompts = [first, first + " Madrid, and the capital of Germany is"]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": 12}) + "\n" for i, p in enumerate(prompts)))
    results = {}
    for name, ranks, flags in [("plain", 1, []), ("cached", 3, ["--split", "2,2,2", "--max-batch", "1",
                                                                "--prefix-cache-gb", "1", "--draft", "ngram",
                                                                "--ngram-min", "1"])]:
        out = tmp_path / f"{name}.jsonl"
        result = mpiexec(ranks, "batch", "--model", str(folder), "--input", str(inp), "--output", str(out),
                         "--no-chat-template", "--quiet", *flags, env={"OPENBLAS_NUM_THREADS": "1"}, timeout=180)
        assert result.returncode == 0, result.stderr
        results[name] = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert [results["cached"][i]["text"] for i in (0, 1)] == [results["plain"][i]["text"] for i in (0, 1)]
    assert results["cached"][1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 31
    assert results["cached"][0]["usage"]["prompt_tokens"] == 31


def test_the_index_resumes_from_points_and_keeps_what_only_one_entry_offers():
    """PrefixCache with resume points (no model): a match resumes from the longest point within it; an
    entry whose tokens are a prefix of a new one stays where the new one lacks its points; each entry is
    budgeted its positions plus its points' states (and one for a verify trip's replay). A state keeps at
    most points_max points, the newest replaced."""
    from pipeline.runtime.prefix_cache import PrefixCache

    cache = PrefixCache(capacity_tokens=10_000, step=1, point_positions=100)
    tokens = list(range(1, 61))
    assert cache.add(0, tokens[:40], [16, 32, 40]) == []
    assert cache.best(tokens[:37] + [999, 998]) == (0, 32)
    assert cache.best(tokens[:15] + [999]) == (None, 0)  # no point within 15
    assert cache.held == 40 + 4 * 100
    # A cold run of 60 tokens, its own points (20, 60): entry 0's 16/32/40 are not among them: both stay.
    assert cache.add(1, tokens, [20, 60]) == []
    assert cache.best(tokens + [7]) == (1, 60) and cache.best(tokens[:39] + [7]) == (0, 32)
    # A fork of entry 0 at 40 that went on to 60 holds 16, 32 and 40 too: entry 0 goes; entry 1 stays
    # (its point 20 is not the fork's).
    assert cache.add(2, tokens, [16, 32, 40, 60]) == [0]
    assert set(cache.entries) == {1, 2}
    state = LinearAttentionState()
    state.conv, state.recurrent = mx.zeros((3, 4)), mx.zeros((2, 4, 4))
    for offset in range(1, 12):
        state._offset = offset
        state.keep_point()
    assert sorted(state.points) == [1, 2, 3, 4, 5, 6, 7, 11]


def _grouped_to_tiled(a: np.ndarray, axis: int, key_heads: int, per_key: int, head_dim: int) -> np.ndarray:
    """llama.cpp's converter's value-head order (its _reorder_v_heads, as facts): heads grouped by key head
    [G0v0, G0v1, G1v0, G1v1] become tiled [G0v0, G1v0, G0v1, G1v1] along `axis`."""
    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    a = a.reshape(key_heads, per_key, head_dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def write_qwen35moe_gguf(path, model, vocab, quantized: str = "") -> None:
    """A transformers Qwen3.5-MoE as llama.cpp's convert_hf_to_gguf.py writes it (float32 tensors): names from
    gguf's TensorNameMap for qwen35moe, experts split per projection, A_log as -exp(A_log), dt_bias as
    ssm_dt.bias, the convolution squeezed, the (1 + weight) norms stored as 1 + weight, value heads tiled.
    quantized "q8_0": its matrices (rows of a multiple of 32) in Q8_0 blocks; "dequantized": those blocks'
    values (gguf's dequantization) as float32, the same numbers unquantized."""
    import gguf

    c = model.config.text_config
    kh, vh, kd, vd = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    per_key = vh // kh
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE, c.num_hidden_layers)
    tensors = {}
    for name, value in model.state_dict().items():
        if not name.startswith(("model.language_model.", "lm_head.")):
            continue  # the vision tower
        name, w = name.replace("model.language_model.", "model."), value.detach().float().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name.removesuffix("gate_up_proj"), w.shape[1] // 2
            pieces = {prefix + "gate_proj.weight": w[:, :half], prefix + "up_proj.weight": w[:, half:]}
        elif name.endswith("mlp.experts.down_proj"):
            pieces = {name + ".weight": w}
        elif name.endswith(".A_log"):
            pieces = {name: _grouped_to_tiled(-np.exp(w), 0, kh, per_key, 1)}
        elif name.endswith(".dt_bias"):
            pieces = {name.replace("dt_bias", "dt_proj.bias"): _grouped_to_tiled(w, 0, kh, per_key, 1)}
        elif name.endswith("conv1d.weight"):
            w = w[:, 0, :]
            pieces = {name: np.concatenate([w[:2 * kh * kd], _grouped_to_tiled(w[2 * kh * kd:], 0, kh, per_key, vd)])}
        elif name.endswith("in_proj_qkv.weight"):
            pieces = {name: np.concatenate([w[:2 * kh * kd], _grouped_to_tiled(w[2 * kh * kd:], 0, kh, per_key, vd)])}
        elif name.endswith("in_proj_z.weight"):
            pieces = {name: _grouped_to_tiled(w, 0, kh, per_key, vd)}
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
            pieces = {name: _grouped_to_tiled(w, 0, kh, per_key, 1)}
        elif name.endswith("out_proj.weight"):
            pieces = {name: _grouped_to_tiled(w, 1, kh, per_key, vd)}
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            pieces = {name: w + 1}
        else:
            pieces = {name: w}
        for hf, array in pieces.items():
            target = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert target is not None, hf
            tensors[target] = np.ascontiguousarray(array, np.float32)
    writer = gguf.GGUFWriter(str(path), "qwen35moe")
    writer.add_name("tiny")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 0.25)))
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(kd)
    writer.add_ssm_group_count(kh)
    writer.add_ssm_time_step_rank(vh)
    writer.add_ssm_inner_size(vd * vh)
    writer.add_full_attention_interval(4)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    writer.add_eos_token_id(vocab["eos"])
    for name, array in tensors.items():
        if quantized and array.ndim >= 2 and array.shape[-1] % 32 == 0 and "norm" not in name and "conv" not in name:
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


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory):
    from conftest import reference_logits
    from test_gguf_inplace import gguf_vocab
    from test_qwen3_5_moe import LONG_PROMPT

    folder, model, expected = reference_logits(make_qwen3_5_moe, tmp_path_factory.mktemp("qwen35_gguf"), LONG_PROMPT)
    path = folder / "tiny-qwen35moe.gguf"
    write_qwen35moe_gguf(path, model, gguf_vocab(folder))
    for kind in ("q8_0", "dequantized"):
        write_qwen35moe_gguf(folder / f"tiny-qwen35moe-{kind}.gguf", model, gguf_vocab(folder), kind)
    return path, expected


def _gguf_logits(path, ranges, prompt):
    from conftest import forward
    from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
    from pipeline.runtime.stage import Stage

    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.model_config()
    stages = [Stage.load(config, checkpoint, r, has_ends=i == 0, dtype=mx.float32) for i, r in enumerate(ranges)]
    return forward(stages, prompt), config


def test_a_qwen35moe_gguf_gives_transformers_logits(qwen_gguf):
    """A qwen35moe GGUF as llama.cpp writes it (value heads tiled, norms as 1 + weight, -exp(A_log), the
    convolution squeezed): its config read back, and its logits on 1 and 3 ranks those of transformers on
    the checkpoint it came from (float32 tensors: within test_qwen3_5_moe's TOLERANCE, measured as there)."""
    from test_qwen3_5_moe import LAYER_TYPES, LONG_PROMPT, THREE_RANKS, TOLERANCE

    path, expected = qwen_gguf
    one, config = _gguf_logits(path, [(0, 6)], LONG_PROMPT)
    assert config.model_type == "qwen3_5_moe_text" and config.raw["layer_types"] == LAYER_TYPES
    print(f"qwen35moe GGUF: max logit error vs transformers {np.abs(one - expected).max():.3g}")
    assert np.abs(one - expected).max() <= TOLERANCE
    three, _ = _gguf_logits(path, THREE_RANKS, LONG_PROMPT)
    assert np.array_equal(three, one)


def test_a_gguf_read_with_grouped_value_heads_is_caught(qwen_gguf, monkeypatch):
    """The planted bug: the GGUF's tiled value heads paired with key heads as a Hugging Face checkpoint's
    (grouped): the logits leave transformers' far past the tolerance."""
    from pipeline.checkpoints import gguf_qwen35
    from test_qwen3_5_moe import LONG_PROMPT, TOLERANCE

    path, expected = qwen_gguf
    fields = gguf_qwen35.config_fields
    monkeypatch.setattr(gguf_qwen35, "config_fields", lambda *a: {**fields(*a), "linear_value_heads_tiled": False})
    wrong, _ = _gguf_logits(path, [(0, 6)], LONG_PROMPT)
    assert np.abs(wrong - expected).max() > 100 * TOLERANCE


def test_a_turn_ending_on_a_verify_trip_resumes_within_its_trail(qwen, monkeypatch):
    """A first turn decoded with drafts ends at an end-of-text token inside a verify trip, the drafts after it
    computed but not taken: its linear states sit past its tokens, and the second turn resumes from its end
    through the trip's replay (LinearAttentionState.prefix within the trail); tokens equal a cold run's."""
    import copy

    from pipeline.runtime import scheduler as scheduler_module
    from pipeline.runtime.prefix_cache import PrefixCache

    stage, tokenizer, _ = qwen
    monkeypatch.setattr(scheduler_module, "PREFILL_CHUNK", CHUNK)
    first = long_prompt(20, seed=4)
    probe = Collect()
    scheduler(stage, tokenizer, ListSource([Request(first, GREEDY, 16, probe)])).run()
    answer = [e.token_id for e in _events(probe)]
    assert answer[9] not in answer[:9]
    tokenizer = copy.copy(tokenizer)
    tokenizer.eos_token_ids = {answer[9]}  # the turn ends there, on the 10th token
    second = first + answer[:9] + long_prompt(6, seed=5)
    cold = Collect()
    scheduler(stage, tokenizer, ListSource([Request(second, GREEDY, 10, cold)])).run()
    stage.model.keep_points = True
    try:
        turns = [Collect(), Collect()]
        warm = _drafting(stage, tokenizer, ListSource([Request(first, GREEDY, 16, turns[0])]),
                         Known({tuple(first): answer}, right=4))
        warm.prefix_cache = cache = PrefixCache(capacity_tokens=4096, point_positions=1)
        warm.run()
        (kept,) = cache.entries
        kept_len = len(cache.entries[kept])
        linear = next(c for c in stage.caches[kept] if isinstance(c, LinearAttentionState))
        print(f"kept entry: {kept_len} tokens, its linear states at {linear.offset}")
        assert linear.offset > kept_len and linear.trail is not None
        warm.source = ListSource([Request(second, GREEDY, 10, turns[1])])
        warm.draft = None
        warm.run()
    finally:
        stage.model.keep_points = False
        for seq_id in list(stage.caches):
            stage.release([seq_id])
    assert [e.token_id for e in _events(turns[0])] == answer[:9] and turns[0].last.reason == "stop"
    assert turns[1].last.cached_tokens == kept_len == len(first) + 9
    assert [e.token_id for e in _events(turns[1])] == [e.token_id for e in _events(cold)]


def test_a_quantized_qwen35moe_gguf_loads_its_blocks_in_the_stored_order(qwen_gguf):
    """The same GGUF with its matrices in Q8_0 (the linear layers' projections with their tiled value-head
    rows and columns included, which the loader keeps as stored): logits equal those of a float32 GGUF
    holding the blocks' values within float rounding (measured 1.75e-5 on logits up to |7|; bound 1e-4)."""
    from test_qwen3_5_moe import LONG_PROMPT

    from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint

    path, _ = qwen_gguf
    held = GGUFCheckpoint(path.with_name("tiny-qwen35moe-q8_0.gguf")).tensors
    assert all(held[f"model.layers.0.linear_attn.{m}.scales"].how == "exact" for m in ("in_proj_qkv", "out_proj"))
    blocks, _ = _gguf_logits(path.with_name("tiny-qwen35moe-q8_0.gguf"), [(0, 6)], LONG_PROMPT)
    values, _ = _gguf_logits(path.with_name("tiny-qwen35moe-dequantized.gguf"), [(0, 6)], LONG_PROMPT)
    print(f"Q8_0 GGUF vs its values in float32: max logit difference {np.abs(blocks - values).max():.3g}")
    assert np.abs(blocks - values).max() <= 1e-4
