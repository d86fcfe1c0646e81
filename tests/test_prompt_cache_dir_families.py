"""`serve --prompt-cache-dir` for the families whose caches are not only KV caches: Qwen3.5-MoE's
linear-attention states and DeepSeek V4's compressed caches. Each cache names its whole state as
arrays (`state_arrays`), each with its own dtype, fixed-size or growing; the store's format 2 records
each array's name, dtype, shape and positions axis, and an entry holding a state that cannot be cut
resumes only at the length it was saved at.

The store alone: mixed dtypes (bfloat16 among them) round-trip bit for bit; a fixed state is not
cut to a shorter prefix; a format-1 file is skipped with one warning. Through the scheduler, on the
families' tiny random models: a conversation's first turn is saved, the scheduler and its caches
go (a restart), and the next turn resumes from the disk with a cold run's tokens and logprobs and
its cached tokens said; a planted bug in what is stored (a convolution window shifted one step, the
recurrent memory stored in float16, a V4 compressor's pending tokens one position short) fails.
Then on 2 ranks, through `mpiexec -n 2 serve`, both kinds of layer on each rank."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest

from conftest import load_stages, long_prompt
from pipeline.checkpoints.tokenizer import Tokenizer
from pipeline.models import deepseek_v4 as V
from pipeline.models.cache import LinearAttentionState
from pipeline.runtime.prefix_cache import PrefixCache, StoredIndex
from pipeline.runtime.prompt_cache_store import MAGIC, PromptCacheStore, StateArray, entry_key
from pipeline.runtime.requests import ListSource, Request, SamplingParams, Tokens
from test_deepseek_v4 import make_deepseek_v4
from test_qwen3_5_moe import make_qwen3_5_moe
from test_scheduler import Collect, scheduler

# Measured (load 15-20, 2 cores): Qwen3.5 0 (the BLAS shim's batch-invariant products), V4 below 1e-5; a
# prefix-cache hit's bound elsewhere (test_scheduler.py, test_deepseek_v4_features.py: a fork's logits 1.9e-5).
# The cold turn's 70-token prefill goes to OpenBLAS (over the shim's 64 rows), whose kernel is the CPU's: on a
# Sapphire Rapids Xeon (AMX, AVX-512 FP16; 2026-12-06) Qwen3.5 measured 2.48e-5.
REUSE_TOLERANCE = 3e-5
# Through a 2-rank server the answer's logprobs and the top alternatives' (test_prompt_cache_dir's check):
# measured 2.0e-5 for Qwen3.5 (the cold prompt's 96 positions in one chunk, the warm one's last 6 alone).
SERVER_TOLERANCE = 4e-5
MODEL = "0123456789abcdef0123456789abcdef"
GREEDY = SamplingParams()


# -- the store alone -------------------------------------------------------------------------------------------

def test_named_arrays_of_any_dtype_round_trip_and_a_fixed_state_is_not_cut(tmp_path):
    store = PromptCacheStore(tmp_path / "c", MODEL, (0, 2))
    rng = np.random.default_rng(0)
    bf16 = np.asarray(mx.array(rng.standard_normal((3, 5)).astype(np.float32)).astype(mx.bfloat16).view(mx.uint16))
    held = [StateArray("0.keys", rng.standard_normal((1, 2, 300, 8)).astype(np.float16), "float16", 2),
            StateArray("1.conv", bf16, "bfloat16", None),
            StateArray("1.recurrent", rng.standard_normal((4, 16, 16)).astype(np.float32), "float32", None),
            StateArray("1.count", np.array([7], np.int64), "int64", None),
            StateArray("1.empty", np.zeros((0, 8), np.float32), "float32", None)]
    tokens = list(range(3, 103))
    key = entry_key(tokens)
    store.save(key, 100, held, tokens=tokens)
    store.flush()
    found = store.scan()
    assert found[key].whole and found[key].points == (100,)
    loaded = store.load(key, 100)
    assert [(a.name, a.dtype, a.axis) for a in loaded] == [(a.name, a.dtype, a.axis) for a in held]
    assert np.array_equal(loaded[0].data, held[0].data[:, :, :100])  # the growing array cut at the entry's length
    assert all(np.array_equal(a.data, b.data) and a.data.dtype == b.data.dtype for a, b in zip(loaded[1:], held[1:]))
    # a state that cannot be cut: no shorter prefix, one warning
    assert store.load(key, 60) is None and "resume only all its 100 positions" in store.warnings[-1]
    # a header whose layout changed but still adds up is not misread: a shape permuted, a dtype of the same size
    for old, new in ((b'"shape": [4, 16, 16]', b'"shape": [16, 4, 16]'), (b'"dtype": "bfloat16"', b'"dtype": "float16"')):
        path = store.path(key)
        original = path.read_bytes()
        changed = original.replace(old, new + b" " * (len(old) - len(new)), 1)
        assert changed != original and len(changed) == len(original)
        path.write_bytes(changed)
        fresh = PromptCacheStore(tmp_path / "c", MODEL, (0, 2))
        assert key in fresh.scan() and fresh.load(key, 100) is None and "checksum" in fresh.warnings[-1]
        path.write_bytes(original)


def test_a_format_1_file_is_skipped_not_misread(tmp_path):
    store = PromptCacheStore(tmp_path / "c", MODEL, (0, 2))
    tokens = list(range(3, 103))
    key = entry_key(tokens)
    store.save(key, 100, [np.zeros((1, 2, 100, 8), np.float32)] * 2, "float32", tokens=tokens)
    store.flush()
    data = bytearray(store.path(key).read_bytes())
    data[:8] = b"PLKV\x00\x01\r\n"  # an older version's file under this name
    store.path(key).write_bytes(bytes(data))
    assert MAGIC[5] == 2
    assert store.scan() == {} and "written in format 1" in store.warnings[-1]


def test_the_index_counts_a_whole_entrys_states_and_resumes_it_at_its_end_only():
    """A stored entry with fixed-size states: matched only where the prompt extends all its tokens, and
    budgeted its positions plus its states (two, as the memory's: job.prompt_cache sizes them)."""
    index = StoredIndex(capacity_tokens=1000, key=entry_key, min_positions=16, point_positions=200)
    first = list(range(3, 203))
    key, gone = index.add(first, [len(first)])
    assert key is not None and gone == [] and index.index.held == 200 + 2 * 200
    assert index.lookup(first + [7, 8], beyond=0) == (key, 200)
    assert index.lookup(first[:150] + [7, 8], beyond=0) == (None, 0)  # within it: not resumable there
    second = list(range(300, 500))
    _, gone = index.add(second, [len(second)])
    assert gone == [key]  # 1200 positions over 1000: the older goes


# -- through the scheduler ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pcd_qwen3_5")
    make_qwen3_5_moe(folder)
    return folder, (0, 6)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pcd_v4")
    make_deepseek_v4(folder)
    return folder, (0, 5)


def _logprobs(collect) -> list[float]:
    return [e.logprob.logprob for e in collect.events if isinstance(e, Tokens)]


def _difference(hit, cold) -> float:
    """The largest chosen-token logprob difference; infinite where the texts differ."""
    if hit.last.text != cold.last.text:
        return float("inf")
    return max(abs(a - b) for a, b in zip(_logprobs(hit), _logprobs(cold)))


def restart_turn(model, tmp_path, seed=0, dtype=None):
    """Turn 1 saved to disk, a restart (new scheduler, store and index; no caches left in memory), turn 2
    (turn 1's prompt and answer and more) from the disk: (turn 2 after the restart, turn 2 cold, tokens
    turn 1 left on disk, the restarted index)."""
    folder, layers = model
    (stage,) = load_stages(folder, [layers], dtype=dtype)
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.eos_token_ids = set()  # a random model ends early otherwise: decode the full length
    first = long_prompt(70, seed=seed)

    def run(prompt, stored=None, store=None):
        collect = Collect()
        s = scheduler(stage, tokenizer, ListSource([Request(prompt, GREEDY, 6, collect, logprobs=0)]), max_batch=1)
        if stored is not None:
            s.prefix_cache, s.stored, s.store = PrefixCache(capacity_tokens=4096), stored, store
        s.run()
        for seq_id in list(stage.caches):  # what a stopped server loses
            stage.release([seq_id])
        return collect

    store = PromptCacheStore(tmp_path / "cache", MODEL, layers)
    turn1 = run(first, StoredIndex(10 ** 6, entry_key, min_positions=16), store)
    store.flush()
    answer = [e.token_id for e in turn1.events if isinstance(e, Tokens)]
    second = first + answer + long_prompt(5, seed=seed + 1)
    cold = run(second)
    restarted = PromptCacheStore(tmp_path / "cache", MODEL, layers)
    index = StoredIndex(10 ** 6, entry_key, min_positions=16)
    assert index.restore([(s.key, s.tokens, s.points) for s in restarted.scan().values()]) == []
    hit = run(second, index, restarted)
    assert not restarted.warnings, restarted.warnings
    return hit, cold, len(first) + len(answer) - 1, index


@pytest.mark.parametrize("family, dtype", [("qwen", None), ("v4", None), ("qwen", mx.bfloat16)])
def test_a_restart_resumes_the_next_turn_from_disk_as_a_cold_run(family, dtype, request, tmp_path):
    """(--dtype bfloat16: the convolution window stored as bfloat16's bits, the memory as float32.)"""
    hit, cold, stored, index = restart_turn(request.getfixturevalue(family), tmp_path, dtype=dtype)
    assert hit.last.cached_tokens == stored and cold.last.cached_tokens == 0
    assert index.loads == 1 and index.loaded_tokens == stored
    assert hit.last.completion_tokens == cold.last.completion_tokens == 6
    assert _difference(hit, cold) <= REUSE_TOLERANCE
    if dtype is not None:  # each array in its own dtype, as the header says
        path = sorted((tmp_path / "cache").iterdir())[0]  # (turn 2 was stored too)
        data = path.read_bytes()
        arrays = json.loads(data[16:16 + int.from_bytes(data[8:16], "little")])["arrays"]
        kinds = {(a["name"].split(".", 1)[1], a["dtype"]) for a in arrays}
        assert kinds == {("conv", "bfloat16"), ("recurrent", "float32"), ("keys", "bfloat16"), ("values", "bfloat16")}


def _conv_shifted(original):
    def state_arrays(self):
        named = original(self)
        return [(n, mx.concatenate([a[:1], a[:-1]]) if n == "conv" else a, axis) for n, a, axis in named]
    return state_arrays


def _recurrent_in_float16(original):
    def state_arrays(self):
        return [(n, a.astype(mx.float16) if n == "recurrent" else a, axis) for n, a, axis in original(self)]
    return state_arrays


def _pending_one_short(original):
    def state_arrays(self):
        return [(n, a[1:] if n.endswith("pending_kv") and a.shape[0] else a, axis) for n, a, axis in original(self)]
    return state_arrays


@pytest.mark.parametrize("family, target, plant", [("qwen", LinearAttentionState, _conv_shifted),
                                                   ("qwen", LinearAttentionState, _recurrent_in_float16),
                                                   ("v4", V.CompressedCache, _pending_one_short)])
def test_a_state_stored_wrong_is_caught(family, target, plant, request, monkeypatch, tmp_path):
    monkeypatch.setattr(target, "state_arrays", plant(target.state_arrays))
    hit, cold, stored, _ = restart_turn(request.getfixturevalue(family), tmp_path)
    assert hit.last.cached_tokens == stored  # loaded: only its tokens tell
    assert _difference(hit, cold) > REUSE_TOLERANCE


# -- 2 ranks, a real server -------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, split", [("qwen", "3,3"), ("v4", "2,3")])
def test_a_restarted_two_rank_server_resumes_from_disk(family, split, request, tmp_path):
    from test_prompt_cache_dir import completion, logprobs  # the KV families' test's helpers
    from test_serve import ENV, Server
    from conftest import REPO
    import os

    folder, _ = request.getfixturevalue(family)
    env = {**os.environ, **ENV, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}
    rng = random.Random(1)
    first = [rng.randrange(3, 200) for _ in range(90)]
    cached = ["--model", str(folder), "--split", split, "--prompt-cache-dir", str(tmp_path / "cache")]

    def first_run():
        server = Server(2, *cached, env=env)
        status, body, _ = server.post("/v1/completions", {"model": "default", "prompt": first, "max_tokens": 1})
        assert status == 200, body
        assert server.stop() == 0, server.stderr
        assert "1 entries stored" in server.stderr, server.stderr[-2000:]

    # One token asked for: the entry holds the prompt alone (the answer's last token is never fed), which
    # the next turn extends (an entry resumes only at its length).
    second = first + [rng.randrange(3, 200) for _ in range(6)]

    def cold_run():
        server = Server(2, "--model", str(folder), "--split", split, "--prefix-cache-gb", "0", env=env)
        body = completion(server, second)
        assert server.stop() == 0
        return body

    with ThreadPoolExecutor(2) as pool:
        cold = pool.submit(cold_run)
        first_run()
        cold = cold.result()
    restarted = Server(2, *cached, env=env)
    warm = completion(restarted, second)
    assert restarted.stop() == 0
    assert "from disk: 1 requests" in restarted.stderr and "warning: prompt cache" not in restarted.stderr
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == len(first)
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    difference = max(abs(a - b) for a, b in zip(logprobs(warm), logprobs(cold)))
    print(f"{family}: 2-rank server, restart's hit vs cold: {difference:.2g}")
    assert difference <= SERVER_TOLERANCE, difference


def test_a_turn_ending_within_a_verify_trip_is_stored_at_its_end(qwen, tmp_path, monkeypatch):
    """Turn 1 decoded with drafts ends at end-of-text inside a verify trip: its linear states sit past its
    tokens, so the entry is stored from the trip's replay at its length (the cache's prefix); after a
    restart, turn 2 resumes from disk with a cold run's tokens."""
    import copy

    from pipeline.runtime import scheduler as scheduler_module
    from test_qwen3_5_features import CHUNK, Known, _drafting  # the in-memory test's set-up

    folder, layers = qwen
    (stage,) = load_stages(folder, [layers])
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.eos_token_ids = set()
    monkeypatch.setattr(scheduler_module, "PREFILL_CHUNK", CHUNK)
    first = long_prompt(20, seed=4)
    probe = Collect()
    scheduler(stage, tokenizer, ListSource([Request(first, GREEDY, 16, probe)])).run()
    answer = [e.token_id for e in probe.events if isinstance(e, Tokens)]
    assert answer[9] not in answer[:9]
    tokenizer = copy.copy(tokenizer)
    tokenizer.eos_token_ids = {answer[9]}  # the turn ends there, on the 10th token
    second = first + answer[:9] + long_prompt(6, seed=5)
    cold = Collect()
    scheduler(stage, tokenizer, ListSource([Request(second, GREEDY, 10, cold)])).run()
    store = PromptCacheStore(tmp_path / "cache", MODEL, layers)
    turn1 = _drafting(stage, tokenizer, ListSource([Request(first, GREEDY, 16, Collect())]),
                      Known({tuple(first): answer}, right=4))
    turn1.prefix_cache, turn1.stored, turn1.store = (PrefixCache(capacity_tokens=4096), StoredIndex(10 ** 6, entry_key, 16),
                                                     store)
    turn1.run()
    (kept,) = turn1.prefix_cache.entries
    linear = next(c for c in stage.caches[kept] if isinstance(c, LinearAttentionState))
    assert linear.offset > len(first) + 9 and linear.trail is not None  # past the entry's end
    store.flush()
    for seq_id in list(stage.caches):
        stage.release([seq_id])
    restarted = PromptCacheStore(tmp_path / "cache", MODEL, layers)
    index = StoredIndex(10 ** 6, entry_key, 16)
    index.restore([(s.key, s.tokens, s.points) for s in restarted.scan().values()])
    hit = Collect()
    turn2 = scheduler(stage, tokenizer, ListSource([Request(second, GREEDY, 10, hit)]), max_batch=1)
    turn2.prefix_cache, turn2.stored, turn2.store = PrefixCache(capacity_tokens=4096), index, restarted
    turn2.run()
    for seq_id in list(stage.caches):
        stage.release([seq_id])
    assert hit.last.cached_tokens == len(first) + 9 and index.loads == 1
    assert [e.token_id for e in hit.events if isinstance(e, Tokens)] == \
        [e.token_id for e in cold.events if isinstance(e, Tokens)]
