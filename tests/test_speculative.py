"""Speculative decoding: greedy output with drafts is the same as without, on 1, 2 and 3 ranks;
rejected drafts leave every cache as if they had never been seen; rejection sampling keeps the
model's distribution; prompt-lookup drafts and their back-off."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from conftest import load_stages, mpiexec
from pipeline.runtime.engine import generate
from pipeline.runtime.requests import SamplingParams
from pipeline.runtime.sampling import Sampler
from pipeline.runtime.speculative import NgramDrafter, verify
from pipeline.checkpoints.tokenizer import Tokenizer

REPEAT = ("Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank. "
          "The quick brown fox")


def run(stage, folder, prompt_ids, max_tokens, drafter=None, sampling=SamplingParams()):
    from mpi4py import MPI

    from pipeline.cluster.transport import MpiTransport

    stage.release([0])
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.eos_token_ids = set()  # a random model says end-of-text early; decode the full length
    result = generate(stage, MpiTransport(MPI.COMM_SELF), tokenizer, prompt_ids, sampling, max_tokens, drafter=drafter)
    caches = [(np.array(c.keys[..., :c.offset, :]), np.array(c.values[..., :c.offset, :])) for c in stage.caches[0]]
    return result, caches


class Oracle:
    """Drafts from a known continuation: right for the first `right` tokens of each draft, then wrong."""

    def __init__(self, continuation: list[int], prompt_len: int, k: int, right: int):
        self.continuation, self.prompt_len, self.k, self.right = continuation, prompt_len, k, right

    def propose(self, history, limit):
        done = len(history) - self.prompt_len
        drafts = self.continuation[done:done + min(self.k, limit)]
        return [t if i < self.right else (t + 1) % 384 for i, t in enumerate(drafts)]

    def observe(self, drafted, accepted):
        pass


@pytest.mark.parametrize("right", [4, 2, 0])
def test_drafts_right_or_wrong_give_the_same_tokens_and_caches(tiny_models, right):
    """All drafts right (every trip accepts 4 + 1), half right, all wrong: the tokens are plain
    greedy decoding's, and the caches hold exactly the positions plain decoding computed, bit for bit."""
    folder = tiny_models["llama"]
    (stage,) = load_stages(folder, [(0, 4)])
    prompt = Tokenizer.from_folder(folder).prompt_ids(REPEAT, use_chat_template=False)
    plain, plain_caches = run(stage, folder, prompt, 40)
    assert len(plain.tokens) == 40 and len(set(plain.tokens)) >= 8
    drafted, caches = run(stage, folder, prompt, 40, Oracle(plain.tokens, len(prompt), 4, right))
    assert drafted.tokens == plain.tokens
    stats = drafted.draft
    if right == 4:
        assert stats.accepted == stats.drafted > 0 and stats.trips <= 40 // 5 + 1
    elif right == 2:
        assert 0 < stats.accepted < stats.drafted
    else:
        assert stats.accepted == 0 and stats.drafted > 0
    assert len(caches) == len(plain_caches)
    for (k, v), (pk, pv) in zip(caches, plain_caches):
        assert k.shape == pk.shape and np.array_equal(k, pk) and np.array_equal(v, pv)


class Pausing(Oracle):
    """Wrong drafts for three tokens, then nothing to propose for three (as when the n-gram drafter
    finds no match or backs off)."""

    def propose(self, history, limit):
        return [] if (len(history) - self.prompt_len) // 3 % 2 else super().propose(history, limit)


def test_a_pause_in_drafting_decodes_the_same_tokens_and_caches(tiny_models, monkeypatch):
    """The stretches without drafts are decoded as plain decoding does, each step started before
    the token it follows is read (engine._overlapped), and leave the same tokens and caches."""
    import pipeline.runtime.engine as engine

    started_early = []  # tokens whose step was started before the token before them was read
    plain_overlapped = engine._overlapped

    def counting(stage, transport, sampler, logits, take, more):
        return plain_overlapped(stage, transport, sampler, logits, take,
                                lambda: more() and (started_early.append(1) or True))

    folder = tiny_models["llama"]
    (stage,) = load_stages(folder, [(0, 4)])
    prompt = Tokenizer.from_folder(folder).prompt_ids(REPEAT, use_chat_template=False)
    plain, plain_caches = run(stage, folder, prompt, 40)
    monkeypatch.setattr(engine, "_overlapped", counting)
    drafter = Pausing(plain.tokens, len(prompt), 4, 0)
    drafted, caches = run(stage, folder, prompt, 40, drafter)
    assert drafted.tokens == plain.tokens
    stats = drafted.draft  # every token but the prefill's came from a trip (overlapped ones included)
    assert len(started_early) >= 10 and stats.drafted > 0 and stats.tokens == stats.trips == 39
    assert len(caches) == len(plain_caches)
    for (k, v), (pk, pv) in zip(caches, plain_caches):
        assert k.shape == pk.shape and np.array_equal(k, pk) and np.array_equal(v, pv)


def test_ngram_drafts_accept_on_a_repeating_prompt(tiny_models):
    folder = tiny_models["llama"]
    (stage,) = load_stages(folder, [(0, 4)])
    tokenizer = Tokenizer.from_folder(folder)
    prompt = tokenizer.prompt_ids(" ".join([REPEAT] * 3), use_chat_template=False)
    plain, _ = run(stage, folder, prompt, 48)
    drafted, _ = run(stage, folder, prompt, 48, NgramDrafter(4, 3, ngram_min=1))  # a random model repeats little
    assert drafted.tokens == plain.tokens
    assert drafted.draft.drafted > 0


def test_ngram_drafter_looks_up_the_longest_suffix_and_backs_off():
    d = NgramDrafter(draft_tokens=3, ngram_max=3)
    history = [1, 2, 3, 4, 5, 9, 2, 3]
    assert d.propose(history, 10) == [4, 5, 9]  # "2 3" seen before, followed by 4 5 9
    history = [1, 2, 3, 4, 5, 9, 7, 2, 3, 4, 8, 2, 3, 4]
    assert d.propose(history, 10) == [8, 2, 3]  # the most recent "2 3 4" wins
    assert d.propose(history, 1) == [8]
    assert d.propose([5, 6, 7], 10) == []  # nothing seen twice
    # One token seen before is too weak a match to draft from (on open questions 10% of such drafts
    # landed), unless ngram_min says otherwise.
    assert NgramDrafter(draft_tokens=3, ngram_max=3).propose([1, 2, 9, 1], 5) == []
    assert NgramDrafter(draft_tokens=3, ngram_max=3, ngram_min=1).propose([1, 2, 9, 1], 5) == [2, 9, 1]


def test_ngram_min_defaults_to_2_or_ngram_max():
    """--ngram-min unset: 2, or 1 with --ngram-max 1 (which then still works); a bound above --ngram-max
    is one error line."""
    from pipeline import cli
    from pipeline.util.errors import UserError

    def parsed(*flags):
        return cli._validated(cli.build_parser().parse_args(["generate", "--prompt", "x", "--draft", "ngram", *flags]))

    assert parsed().ngram_min == 2
    assert parsed("--ngram-max", "1").ngram_min == 1
    with pytest.raises(UserError, match="--ngram-min must be from 1 to --ngram-max"):
        parsed("--ngram-max", "2", "--ngram-min", "3")
    d = NgramDrafter(draft_tokens=3, ngram_max=2, ngram_min=1)
    for _ in range(NgramDrafter.MISSES_BEFORE_BACKOFF):
        d.observe(3, 0)
    assert d.propose([1, 2, 1], 5) == []  # backing off
    d.skip = 0
    assert d.propose([1, 2, 1], 5) == [2, 1]
    d.observe(3, 1)
    assert d.misses == 0
    # A rare hit among many misses (recent acceptance under MIN_ACCEPTANCE) does not end the back-off.
    d = NgramDrafter(draft_tokens=4, ngram_max=2)
    for _ in range(6):
        d.observe(4, 0)
    backing_off = d.skip
    d.skip = 0
    d.observe(4, 1)
    assert d.recent < NgramDrafter.MIN_ACCEPTANCE and d.misses == 6 and d.skip == backing_off > 0
    # Acceptance that pays off again does.
    for _ in range(8):
        d.observe(4, 4)
    assert d.recent >= NgramDrafter.MIN_ACCEPTANCE and d.misses == 0


def test_ngram_drafts_shorten_as_they_miss_and_lengthen_as_they_land():
    """A stream whose drafts miss checks fewer positions a round (each verified position costs), down
    to one; landing drafts bring the full K back."""
    history = [7, 1, 2, 3, 4, 5, 6, 8, 9, 7]  # "7" seen before: followed by 1 2 3 4 5 6 ...
    d = NgramDrafter(draft_tokens=5, ngram_max=1)
    lengths = []
    for _ in range(6):
        lengths.append(len(d.propose(history, 10)))
        d.observe(lengths[-1], 0)
        d.skip = 0
    assert lengths[0] == 5 and lengths[-1] == 1 and lengths == sorted(lengths, reverse=True), lengths
    for _ in range(10):
        drafted = len(d.propose(history, 10))
        d.observe(drafted, drafted)
    assert len(d.propose(history, 10)) == 5


def test_rejection_sampling_keeps_the_models_distribution():
    """The first token out of a verify step is distributed as the model's p, whatever the draft
    (chi-square over 4000 seeded draws, a wrong-looking draft and the most likely one)."""
    logits = mx.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    p = np.array(mx.softmax(logits))
    for draft in (4, 0):
        counts = np.zeros(len(p))
        for seed in range(4000):
            sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
            accepted, following = verify(sampler, mx.stack([logits, logits]), [draft], [])
            counts[draft if accepted else following] += 1
        expected = p * counts.sum()
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert chi2 < 20.5, (draft, counts, expected)  # 5 degrees of freedom: p = 0.001


def test_seeded_sampling_with_drafts_is_reproducible(tiny_models):
    folder = tiny_models["llama"]
    (stage,) = load_stages(folder, [(0, 4)])
    prompt = Tokenizer.from_folder(folder).prompt_ids(" ".join([REPEAT] * 2), use_chat_template=False)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    a, _ = run(stage, folder, prompt, 32, NgramDrafter(4, 3, ngram_min=1), sampling)
    b, _ = run(stage, folder, prompt, 32, NgramDrafter(4, 3, ngram_min=1), sampling)
    assert a.tokens == b.tokens and a.draft.drafted > 0


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_generate_with_ngram_drafts_equals_plain_on_every_rank_count(tiny_models, ranks):
    folder = str(tiny_models["llama"])
    args = ("generate", "--model", folder, "--no-chat-template", "--prompt", " ".join([REPEAT] * 3),
            "--max-tokens", "48")
    plain = mpiexec(ranks, *args, "--draft", "none")
    # (--ngram-min 1: the tiny random model seldom repeats two tokens of the prompt in a row)
    drafted = mpiexec(ranks, *args, "--draft", "ngram", "--draft-tokens", "5", "--ngram-min", "1")
    assert plain.returncode == 0 and drafted.returncode == 0, plain.stderr + drafted.stderr
    assert drafted.stdout == plain.stdout
    stats = re.search(r"speculative: drafted (\d+), accepted (\d+) .*tokens per trip, exact", drafted.stderr)
    assert stats and int(stats.group(1)) > 0, drafted.stderr


def test_batch_with_drafts_equals_batch_without(tiny_models, tmp_path):
    """Each sequence drafts for itself inside the micro-batches (REWIND round the ring for the
    rejected): the texts are those without drafts, on 1, 2 and 3 ranks, with the head shared or not."""
    from test_batch import batch, read_records, write_jsonl

    rows = [{"id": i, "prompt": p, "max_tokens": 40} for i, p in enumerate(
        [" ".join([REPEAT] * 3), "The capital of France is Paris. The capital of France is",
         "def hello(world):\n    return 42\ndef hello(world):\n", "hidden states travel"])]
    rows.append({"id": "sampled", "prompt": " ".join([REPEAT] * 2), "max_tokens": 24, "temperature": 0.7, "seed": 3})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    plain = batch(2, tiny_models["llama"], inp, tmp_path / "plain.jsonl", "--no-chat-template")
    assert plain.returncode == 0, plain.stderr
    expected = {r["id"]: r["text"] for r in read_records(tmp_path / "plain.jsonl") if r["id"] != "sampled"}
    for n, extra in ((1, ()), (2, ()), (3, ("--head-share", "0.5"))):
        out = tmp_path / f"drafted{n}.jsonl"
        result = batch(n, tiny_models["llama"], inp, out, "--no-chat-template", "--draft", "ngram", "--ngram-min", "1",
                       *extra)
        assert result.returncode == 0, result.stderr
        records = {r["id"]: r for r in read_records(out)}
        assert {i: r["text"] for i, r in records.items() if i != "sampled"} == expected, n
        assert "text" in records["sampled"]
        stats = re.search(r"speculative: drafted (\d+), accepted (\d+)", result.stderr)
        assert stats and int(stats.group(2)) > 0, result.stderr
