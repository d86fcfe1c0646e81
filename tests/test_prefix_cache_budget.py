"""--prefix-cache-gb as an honest bound (issue 36): serve's and batch's prefix cache (prefix_cache.for_job)
counts each kept sequence at the bytes its caches hold, and evicts to stay within them. The truth here is
an independent walk of the kept caches' objects (every mx.array reachable through attributes, containers
and a function's defaults or closure, each once): DeepSeek V4's window and compressed series, its state
every `reuse_stride` positions (512 in the published models, 32 in the tiny one) and the logs of its last
calls (the series before each call among them); Qwen3.5's linear states at each resume point and a verify
trip's trail (the replay's first memory and inputs)."""

from __future__ import annotations

import copy
import types

import mlx.core as mx
import pytest

from conftest import load_stages, long_prompt
from pipeline.checkpoints.tokenizer import Tokenizer
from pipeline.models import deepseek_v4 as V
from pipeline.models.cache import LinearAttentionState
from pipeline.models.config import ModelConfig
from pipeline.planner.shapes import architecture
from pipeline.runtime.prefix_cache import EntryBytes, for_job
from pipeline.runtime.requests import ListSource, Request, SamplingParams, Tokens
from test_deepseek_v4 import make_deepseek_v4
from test_scheduler import Collect, scheduler

GREEDY = SamplingParams()


def walk_bytes(root) -> int:
    """The bytes of every distinct mx.array reachable from `root`."""
    seen, arrays, todo = set(), {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (int, float, str, bool, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            arrays[id(obj)] = obj
        elif isinstance(obj, dict):
            todo += list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif isinstance(obj, types.FunctionType):
            todo += list(obj.__defaults__ or ()) + [c.cell_contents for c in obj.__closure__ or ()]
        elif hasattr(obj, "__dict__"):
            todo.append(vars(obj))
    return sum(a.nbytes for a in arrays.values())


def kept_bytes(stage, cache) -> dict[int, int]:
    """Each kept entry's bytes as the walk finds them in the stage's caches."""
    return {seq_id: walk_bytes(stage.caches[seq_id]) for seq_id in cache.entries}


def run_kept(stage, tokenizer, cache, requests, run=None):
    """Run the requests one at a time (each finished before the next may reuse it), keeping them in `cache`."""
    s = run(stage, tokenizer, ListSource(requests)) if run else scheduler(stage, tokenizer, ListSource(requests), 1)
    s.prefix_cache = cache
    s.run()
    return s


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prefix_cache_budget_v4")
    make_deepseek_v4(folder)
    (stage,) = load_stages(folder, [(0, 5)])
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.eos_token_ids = set()
    return stage, tokenizer, architecture(ModelConfig.from_folder(folder)), folder


def test_v4_entries_are_counted_at_every_array_they_hold_and_evicted_within_the_budget(v4):
    """Six sequences of 70-140 tokens (kept points every 32 positions, logs of their last calls), the
    fourth extending the first's prompt (a hit: a forked entry): with room for all, each entry's counted bytes are
    the walk's; with room for about two and a half, the total counted equals the walk's sum over the kept
    entries, stays within the budget, and the evicted ones' caches are gone."""
    stage, tokenizer, arch, _ = v4
    stride = V.reuse_stride(stage.model.config)
    prompts = [long_prompt(n, seed=20 + i) for i, n in enumerate((100, 140, 70, 0, 120, 90))]
    prompts[3] = prompts[0] + long_prompt(30, seed=30)
    requests = lambda: [Request(p, GREEDY, 4, Collect()) for p in prompts]  # noqa: E731

    roomy = for_job(1.0, arch, [(0, 5)], 4)
    run_kept(stage, tokenizer, roomy, requests())
    walked = kept_bytes(stage, roomy)
    assert walked == roomy.sizes and roomy.held == sum(walked.values())
    points = {len(c.points) for seq_id in roomy.entries for c in stage.caches[seq_id]}
    assert min(points) >= 2 and stride == 32  # every kept sequence holds two points or more
    print(f"entries {sorted(walked.values())} bytes; held {roomy.held}")
    assert len(roomy.entries) == 6 and roomy.hits == 1  # the fourth forked from the first
    stage.release(list(stage.caches))

    budget = int(2.5 * sorted(walked.values())[2])
    tight = for_job(budget / 1e9, arch, [(0, 5)], 4)
    run_kept(stage, tokenizer, tight, requests())
    walked = kept_bytes(stage, tight)
    print(f"budget {budget}: kept {sorted(walked.values())}, held {tight.held}")
    assert tight.held == sum(walked.values()) <= tight.capacity == budget
    assert 1 <= len(tight.entries) < 6 and set(stage.caches) == set(tight.entries)
    stage.release(list(stage.caches))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from test_qwen3_5_moe import make_qwen3_5_moe

    folder = tmp_path_factory.mktemp("prefix_cache_budget_qwen")
    make_qwen3_5_moe(folder)
    (stage,) = load_stages(folder, [(0, 6)])
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.eos_token_ids = set()
    return stage, tokenizer, architecture(ModelConfig.from_folder(folder))


def test_qwen3_5_entries_count_their_resume_points_and_a_verify_trips_trail(qwen, monkeypatch):
    """Prompts in chunks of 16 keep a linear state at each chunk's end (resume points), and a turn that
    ends on an end-of-text token inside a verify trip keeps the trip's trail: each entry's counted bytes
    are the walk's (the trail's replay holds its first memory and the trip's inputs)."""
    from pipeline.runtime import scheduler as scheduler_module
    from test_qwen3_5_features import CHUNK, Known, _drafting

    stage, tokenizer, arch = qwen
    monkeypatch.setattr(scheduler_module, "PREFILL_CHUNK", CHUNK)
    first = long_prompt(20, seed=4)
    probe = Collect()
    scheduler(stage, tokenizer, ListSource([Request(first, GREEDY, 16, probe)])).run()
    answer = [e.token_id for e in probe.events if isinstance(e, Tokens)]
    assert answer[9] not in answer[:9]
    ending = copy.copy(tokenizer)
    ending.eos_token_ids = {answer[9]}  # the turn ends there, inside a verify trip
    stage.model.keep_points = True
    try:
        cache = for_job(1.0, arch, [(0, 6)], 4)
        warm = run_kept(stage, ending, cache, [Request(first, GREEDY, 16, Collect())],
                        run=lambda st, tok, src: _drafting(st, tok, src, Known({tuple(first): answer}, right=4)))
        (trailed,) = cache.entries
        linear = [c for c in stage.caches[trailed] if isinstance(c, LinearAttentionState)]
        assert all(c.trail is not None for c in linear)
        # the same scheduler (its sequence ids go on), one request at a time, no drafts
        warm.source, warm.draft, warm.max_batch = ListSource([Request(long_prompt(n, seed=40 + n), GREEDY, 3, Collect())
                                                              for n in (40, 57)]), None, 1
        warm.run()
    finally:
        stage.model.keep_points = False
    walked = kept_bytes(stage, cache)
    print(f"entries {walked}")
    assert len(walked) == 3 and walked == cache.sizes and cache.held == sum(walked.values())
    assert min(len(c.points) for seq_id in cache.entries for c in stage.caches[seq_id]
               if isinstance(c, LinearAttentionState)) >= 2
    stage.release(list(stage.caches))


class Held:
    def __init__(self, nbytes):
        self.nbytes = nbytes


def test_other_ranks_are_counted_by_kind_as_rank_0_measured_them():
    """Rank 0 holds layers 0-1 (kinds a, b), rank 1 layers 2-4 (a, c, c): rank 1's a at what rank 0
    measured for its a, its c at the planner's estimate scaled as rank 0's measured bytes are to theirs
    (600 / 400); the entry counts the rank holding the most."""
    kinds, ranges = ["a", "b", "a", "c", "c"], [(0, 2), (2, 5)]
    for c, expected in ((1000, 150 + 2 * 1000 * 1.5), (10, 600)):
        estimate = {0: 100, 1: 300, 2: 100, 3: c, 4: c}
        measure = EntryBytes(kinds, ranges, lambda layer, positions: estimate[layer])
        assert measure([Held(150), Held(450)], 10) == expected



def test_v4_batch_on_two_ranks_keeps_and_reuses_within_its_bytes(v4, tmp_path):
    """`batch --prefix-cache-gb` on 2 ranks (--split 2,3: rank 1 holds the heavily compressed layers rank 0
    has none of, counted at the planner's estimate scaled by rank 0's measure): prompts sharing a long start
    reuse the first one's caches, texts as without the cache; a budget too small for one entry keeps none."""
    import json

    from conftest import mpiexec
    from test_deepseek_v4 import TEXT

    stage, tokenizer, _, folder = v4
    shared = TEXT * 3
    rows = [{"id": f"r{i}", "prompt": shared + tail, "max_tokens": 6}
            for i, tail in enumerate((" The end.", " A second ending here", " And a third one"))]
    assert len(tokenizer.encode(shared, add_special_tokens=False)) > 64
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts, cached = {}, {}
    for gb in ("0", "0.01", "0.00001"):
        out = tmp_path / f"out{gb}.jsonl"
        result = mpiexec(2, "batch", "--model", str(folder), "--input", str(inp), "--output", str(out),
                         "--no-chat-template", "--split", "2,3", "--max-batch", "1", "--prefix-cache-gb", gb,
                         env={"OPENBLAS_NUM_THREADS": "1"}, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
        texts[gb] = {i: r["text"] for i, r in records.items()}
        cached[gb] = [records[f"r{i}"]["usage"]["prompt_tokens_details"]["cached_tokens"] for i in range(3)]
    print(cached)
    assert texts["0.01"] == texts["0"] == texts["0.00001"]
    assert cached["0"] == cached["0.00001"] == [0, 0, 0]
    assert cached["0.01"][0] == 0 and all(c >= 32 for c in cached["0.01"][1:])  # at least the kept point at 32
