"""The engine API under batch and serve, in process on one rank (MPI_COMM_SELF): requests in,
events out; a crash in one request's own code path fails that request alone; cancelling frees
its place; a queue fed from another thread; greedy texts equal to `generate`'s."""

from __future__ import annotations

import threading

import pytest

from conftest import greedy_ours, load_stages
from pipeline.runtime.requests import Failed, Finished, ListSource, QueueSource, Request, SamplingParams, Tokens
from pipeline.runtime.sampling import Sampler
from pipeline.runtime.scheduler import Scheduler
from pipeline.checkpoints.tokenizer import Tokenizer
from pipeline.runtime.trace import Timeline

PROMPTS = ["The capital of France", "hello there", "def hello(world):", "The quick brown fox"]
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def llama(tiny_models):
    (stage,) = load_stages(tiny_models["llama"], [(0, 4)])
    return stage, Tokenizer.from_folder(tiny_models["llama"]), tiny_models["llama"]


def scheduler(stage, tokenizer, source, max_batch=8) -> Scheduler:
    from mpi4py import MPI

    from pipeline.runtime.scheduler import exact_group_rows
    from pipeline.cluster.transport import MpiTransport

    return Scheduler(stage, MpiTransport(MPI.COMM_SELF), tokenizer, source, max_batch=max_batch, microbatches=1,
                     group_rows=exact_group_rows(False), timeline=Timeline(0))


class Collect:
    """A front-end's handler: every event of one request, in order."""

    def __init__(self):
        self.events = []

    def __call__(self, event) -> None:
        self.events.append(event)

    @property
    def last(self):
        return self.events[-1]

    @property
    def streamed(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Tokens)) + \
            (self.last.tail if isinstance(self.last, Finished) else "")


def request(tokenizer, prompt: str, on_event, max_tokens=12, sampling=GREEDY, **kw) -> Request:
    return Request(tokenizer.prompt_ids(prompt, use_chat_template=False), sampling, max_tokens, on_event, **kw)


def test_greedy_texts_equal_generate_and_stream_in_order(llama):
    stage, tokenizer, folder = llama
    handlers = [Collect() for _ in PROMPTS]
    stats = scheduler(stage, tokenizer, ListSource(
        request(tokenizer, p, h, stop=["zz"]) for p, h in zip(PROMPTS, handlers))).run()
    assert stats.done == len(PROMPTS) and stats.errors == 0
    for prompt, h in zip(PROMPTS, handlers):
        alone = greedy_ours(stage, folder, tokenizer.prompt_ids(prompt, use_chat_template=False), 12)
        stage.release([0])
        finished = h.last
        assert isinstance(finished, Finished) and finished.reason in ("stop", "length")
        assert finished.text == alone.text == h.streamed
        assert finished.completion_tokens == len(alone.tokens) == sum(isinstance(e, Tokens) for e in h.events)
        assert [e.token_id for e in h.events if isinstance(e, Tokens)] == alone.tokens


def test_a_crash_in_one_requests_code_fails_it_alone(llama, monkeypatch):
    """Planted: one request's sampler raises, another's event handler raises on its third token.
    Both get Failed with the reason; the others finish with the texts they have alone."""
    stage, tokenizer, folder = llama
    real_call = Sampler.__call__

    def sampler_with_a_bug(self, logits, history):
        if self.params.seed == 666:
            raise ZeroDivisionError("planted sampler bug")
        return real_call(self, logits, history)

    monkeypatch.setattr(Sampler, "__call__", sampler_with_a_bug)

    class BrokenHandler(Collect):
        def __call__(self, event):
            super().__call__(event)
            if isinstance(event, Tokens) and sum(isinstance(e, Tokens) for e in self.events) == 3:
                raise KeyError("planted handler bug")

    good = [Collect(), Collect()]
    bad_sampler, bad_handler = Collect(), BrokenHandler()
    requests = [request(tokenizer, PROMPTS[0], good[0]),
                request(tokenizer, PROMPTS[1], bad_sampler, sampling=SamplingParams(temperature=1.0, seed=666)),
                request(tokenizer, PROMPTS[2], bad_handler),
                request(tokenizer, PROMPTS[3], good[1])]
    stats = scheduler(stage, tokenizer, ListSource(requests)).run()
    assert stats.errors == 2 and stats.done == 2
    assert isinstance(bad_sampler.last, Failed) and "planted sampler bug" in bad_sampler.last.message
    assert isinstance(bad_handler.last, Failed) and "planted handler bug" in bad_handler.last.message
    for prompt, h in zip((PROMPTS[0], PROMPTS[3]), good):
        alone = greedy_ours(stage, folder, tokenizer.prompt_ids(prompt, use_chat_template=False), 12)
        stage.release([0])
        assert isinstance(h.last, Finished) and h.last.text == alone.text
    assert not stage.caches  # every sequence's caches freed, the failed ones' too


def test_a_queue_from_another_thread_with_a_cancelled_request(llama):
    stage, tokenizer, folder = llama
    source = QueueSource()
    cancelled, waiting_cancelled, normal = Collect(), Collect(), Collect()
    first_token = threading.Event()

    def on_cancelled(event):
        cancelled(event)
        first_token.set()

    long = request(tokenizer, PROMPTS[0], on_cancelled, max_tokens=10_000)
    never = request(tokenizer, PROMPTS[1], waiting_cancelled)
    never.cancel()  # cancelled before it was admitted

    def client():
        source.put(long)
        first_token.wait(timeout=30)
        long.cancel()
        source.put(never)
        source.put(request(tokenizer, PROMPTS[2], normal))
        source.close()

    thread = threading.Thread(target=client)
    thread.start()
    stats = scheduler(stage, tokenizer, source).run()
    thread.join()
    assert isinstance(cancelled.last, Finished) and cancelled.last.reason == "cancelled"
    assert 1 <= cancelled.last.completion_tokens < 1000
    assert isinstance(waiting_cancelled.last, Finished) and waiting_cancelled.last.completion_tokens == 0
    assert isinstance(normal.last, Finished) and normal.last.reason in ("stop", "length")
    assert stats.done == 3 and not stage.caches


def test_logprobs_are_the_models_distribution(llama):
    import mlx.core as mx

    stage, tokenizer, folder = llama
    h = Collect()
    scheduler(stage, tokenizer, ListSource([request(tokenizer, PROMPTS[0], h, max_tokens=4, logprobs=3)])).run()
    tokens = [e for e in h.events if isinstance(e, Tokens)]
    assert tokens and all(e.logprob is not None for e in tokens)
    first = tokens[0].logprob
    assert first.token_id == tokens[0].token_id
    assert len(first.top) == 3 and first.top[0][0] == first.token_id  # greedy: the most likely one
    assert first.top[0][1] >= first.top[1][1] >= first.top[2][1]
    # Against the logits of the prompt computed directly.
    ids = tokenizer.prompt_ids(PROMPTS[0], use_chat_template=False)
    hidden = stage.run_layers(stage.model.embed(mx.array([ids])), [99])
    stage.release([99])
    logits = stage.model.logits(hidden[:, -1, :])[0]
    expected = (logits - mx.logsumexp(logits))[first.token_id].item()
    assert abs(first.logprob - expected) < 1e-5


def test_prefix_cache_reuses_a_finished_turn(llama):
    """A second turn that re-sends the first turn's prompt and answer starts from the kept caches:
    cached_tokens says how many positions, and its greedy text equals a cold run's with every
    chosen token's logprob within float rounding (REUSE_TOLERANCE, measured ~1e-6)."""
    from pipeline.runtime.prefix_cache import PrefixCache

    stage, tokenizer, folder = llama
    first = tokenizer.prompt_ids(" ".join(PROMPTS * 3), use_chat_template=False)
    answer = greedy_ours(stage, folder, first, 20).tokens
    stage.release([0])
    assert len(set(answer)) >= 5, answer
    second = first + answer + tokenizer.prompt_ids(" and then the quick brown fox", use_chat_template=False)

    cold = Collect()
    scheduler(stage, tokenizer, ListSource([Request(second, GREEDY, 16, cold, logprobs=0)])).run()
    turns = [Collect(), Collect()]
    cache = PrefixCache(capacity_tokens=4096)
    warm = scheduler(stage, tokenizer, ListSource([Request(first, GREEDY, 20, turns[0]),
                                                   Request(second, GREEDY, 16, turns[1], logprobs=0)]), max_batch=1)
    warm.prefix_cache = cache
    warm.run()
    assert turns[0].last.text == tokenizer.decode(answer)
    hit = turns[1].last
    # The first turn's prompt and its answer went through the model, but for a last token that
    # ended it by length (one that ended at the end-of-sequence token was fed to sample that).
    fed = len(answer) if turns[0].last.reason == "stop" else len(answer) - 1
    assert hit.cached_tokens == len(first) + fed, (hit.cached_tokens, len(first), len(answer))
    assert cold.last.cached_tokens == 0
    assert hit.text == cold.last.text and hit.completion_tokens == cold.last.completion_tokens >= 8
    ours = [e.logprob.logprob for e in turns[1].events if isinstance(e, Tokens)]
    theirs = [e.logprob.logprob for e in cold.events if isinstance(e, Tokens)]
    print(f"max logprob difference after a hit: {max(abs(a - b) for a, b in zip(ours, theirs)):.2e}")
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= REUSE_TOLERANCE
    assert cache.hits == 1 and set(cache.entries) == {1}  # turn 2 extends turn 1: only it is kept
    assert set(stage.caches) == {1}
    stage.release([1])


REUSE_TOLERANCE = 2e-5  # measured 6.7e-6 on the tiny Llama


def test_a_request_reaching_past_the_context_gets_exactly_the_room_left(llama):
    """generate's end-of-context test (test_models.py), in a batch: asked for 100 tokens with room
    for 12 in the 512-token context, a request gets generate's 12 greedy tokens and ends by
    `length`; a short request beside it is not cut."""
    stage, tokenizer, folder = llama
    context = stage.model.config.max_position_embeddings
    prompt = tokenizer.prompt_ids(" ".join(PROMPTS * 40), use_chat_template=False)[:context - 12]
    alone = greedy_ours(stage, folder, prompt, 100)
    stage.release([0])
    assert alone.finish_reason == "length" and len(alone.tokens) == 12
    at_the_end, beside = Collect(), Collect()
    stats = scheduler(stage, tokenizer, ListSource([Request(prompt, GREEDY, 100, at_the_end),
                                                    request(tokenizer, PROMPTS[0], beside, max_tokens=4)])).run()
    assert stats.done == 2 and not stage.caches
    finished = at_the_end.last
    assert isinstance(finished, Finished) and finished.reason == "length"
    assert finished.completion_tokens == context - len(prompt) == 12
    assert [e.token_id for e in at_the_end.events if isinstance(e, Tokens)] == alone.tokens
    assert beside.last.completion_tokens == 4
