"""A huge request neither stalls nor sinks `serve`: a body over --max-request-mb is refused (413) as
soon as its Content-Length, or the bytes of a chunked body, pass the cap, without the rest being
read; a prompt under the cap that cannot fit the context is refused (400) before it is all
tokenized; and a small request sent meanwhile answers in its usual time.

First the prompt checks alone (prompts.py, on a small BPE tokenizer), then a real 1-rank server on
a tiny Llama."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO, make_tiny_model, write_tokenizer
from pipeline.serve import prompts
from pipeline.serve.protocol import APIError
from test_serve import ENV, Server

TEXT = ("The capital of France is Paris. The quick brown fox jumps over the lazy dog. Pipeline parallel "
        "inference splits layers across ranks; hidden states travel between them.\n")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from pipeline.checkpoints.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return Tokenizer.from_folder(folder)


def refusal(tokenizer, text: str, context: int) -> str:
    with pytest.raises(APIError) as caught:
        prompts.text_prompt_ids(tokenizer, text, context, "prompt", add_special_tokens=True)
    error = caught.value
    assert error.status == 400 and error.code == "context_length_exceeded" and error.param == "prompt"
    assert f"context is {context}" in error.message
    return error.message


def test_a_token_never_covers_more_characters_than_the_bound(tokenizer):
    """The refusal by characters alone is sound: a text of the longest tokens, one after another,
    and texts of every kind have at least len(text) / max_token_chars tokens."""
    bound = prompts.max_token_chars(tokenizer)
    longest = max(range(tokenizer.vocab_size), key=lambda i: len(tokenizer.decode([i])))
    texts = [tokenizer.decode([longest] * 50), TEXT * 5, "déjà vu, 東京, 🙂 " * 20, " " * 300, "x" * 500]
    for text in texts:
        assert len(tokenizer.encode(text, add_special_tokens=False)) * bound >= len(text), text[:40]
    assert bound >= len(tokenizer.decode([longest])) + 1


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(tokenizer):
    """By its characters alone where they prove it; else by its pieces, once they pass the context;
    a prompt that fits gets exactly the ids of tokenizing it whole."""
    bound = prompts.max_token_chars(tokenizer)
    context = 5000
    huge = (TEXT * (context * bound // len(TEXT) + 1))[:context * bound]
    assert f"at least {context} tokens (from its {len(huge)} characters)" in refusal(tokenizer, huge, context)
    # Under the characters' bound but well past the context: counted piece by piece
    middle = huge[:context * bound - 1]
    assert len(middle) > 2 * prompts.PIECE_CHARS
    assert f"more than {context - 1} tokens" in refusal(tokenizer, middle, context)
    # Fits (in a larger context) after the pieces were counted: the ids are the whole text's
    long = (TEXT * 300)[:3 * prompts.PIECE_CHARS + 17]
    exact = tokenizer.encode(long, add_special_tokens=True)
    assert prompts.text_prompt_ids(tokenizer, long, len(exact) + 1, "prompt", add_special_tokens=True) == exact
    assert f"has {len(exact)} tokens" in refusal(tokenizer, long, len(exact))  # one short: the exact count
    pieces = list(prompts.pieces(long, prompts.PIECE_CHARS))
    assert "".join(pieces) == long and len(pieces) > 3
    assert all(prompts.PIECE_CHARS // 2 <= len(p) <= prompts.PIECE_CHARS for p in pieces[:-1])
    # The pieces' count is the whole text's (cut between words), so no prompt that fits is refused
    assert sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in pieces) == len(exact)


def test_a_long_text_that_is_not_utf8_is_refused_naming_the_place_in_the_whole_text(tokenizer):
    text = TEXT * 400
    bad = text[:40_000] + "\ud800" + text[40_000:]
    with pytest.raises(APIError) as caught:
        prompts.completion_prompt_ids(tokenizer, bad, 10 ** 6, tokenizer.vocab_size)
    assert caught.value.param == "prompt" and "lone surrogate \\ud800 at character 40000" in caught.value.message


def test_a_long_list_of_token_ids_is_refused_by_its_length():
    with pytest.raises(APIError) as caught:
        prompts.completion_prompt_ids(None, [10 ** 9] * 5000, 4096, 384)
    assert caught.value.code == "context_length_exceeded" and "5000 tokens" in caught.value.message


# -- a real server --------------------------------------------------------------------------------------------

CAP_MB = 8
CONTEXT = 4096
REFUSED_WITHIN_S = 3.0  # measured ~0.05 s; tokenizing the whole 7.5 MB prompt took ~4 s
SMALL = {"model": "default", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("limits") / "llama", max_position_embeddings=CONTEXT)
    env = {**os.environ, **ENV, "PYTHONPATH": str(REPO)}
    server = Server(1, "--model", str(folder), "--max-request-mb", str(CAP_MB), "--prefix-cache-gb", "0", env=env)
    yield server
    assert server.stop() == 0, server.stderr


def raw_request(server: Server, headers: dict, body: bytes) -> socket.socket:
    """A POST to /v1/chat/completions whose headers, and only `body` of its body, are sent."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=REFUSED_WITHIN_S)
    head = "".join(f"{k}: {v}\r\n" for k, v in {"host": "127.0.0.1", "content-type": "application/json",
                                                  **headers}.items())
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\n{head}\r\n".encode() + body)
    return sock


def response_of(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the response (it must come within REFUSED_WITHIN_S)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(headers[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    sock.close()
    return int(head.split()[1]), json.loads(body)


def assert_too_large(status: int, payload: dict) -> None:
    assert status == 413, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "request_too_large"
    assert f"limit of {CAP_MB} MB (--max-request-mb)" in error["message"], error


def test_a_body_over_the_cap_is_refused_before_the_rest_of_it_arrives(server):
    """Its Content-Length says so: refused with only 64 KB of it sent. A chunked body that declares
    no length: refused once what arrived passes the cap, the rest never sent. Then the server goes on."""
    start = time.monotonic()
    declared = raw_request(server, {"content-length": str((CAP_MB + 50) << 20)}, b"{" + b" " * 65535)
    assert_too_large(*response_of(declared))
    chunk = b" " * (1 << 20)
    chunked = raw_request(server, {"transfer-encoding": "chunked"}, b"")
    for _ in range(CAP_MB + 1):
        chunked.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    assert_too_large(*response_of(chunked))
    assert time.monotonic() - start < 2 * REFUSED_WITHIN_S
    status, payload, _ = server.post("/v1/chat/completions", SMALL)
    assert status == 200 and payload["choices"][0]["finish_reason"] in ("stop", "length")


def test_huge_prompts_are_refused_at_once_while_a_small_request_answers(server, tokenizer):
    """Sent together: a body over the cap (all of it, as an ordinary client sends it), a 7.5 MB
    prompt under the cap (refused by its characters), one just under the characters' bound
    (refused by its pieces), and a stream of small requests, each answered in its usual time."""
    def timed(body) -> tuple[float, int, dict]:
        start = time.monotonic()
        status, payload, _ = server.post("/v1/chat/completions", body)
        return time.monotonic() - start, status, payload

    usual = max(timed(SMALL)[0] for _ in range(3))
    word_gap = TEXT * ((CAP_MB << 20) // len(TEXT))
    over_cap = json.dumps({**SMALL, "messages": [{"role": "user", "content": word_gap + TEXT * 1000}]}).encode()
    under_cap = {**SMALL, "messages": [{"role": "user", "content": word_gap[:15 * (1 << 19)]}]}
    below_bound = CONTEXT * prompts.max_token_chars(tokenizer) - 100  # the template adds a few characters
    assert below_bound > 2 * prompts.PIECE_CHARS
    pieces = {**SMALL, "messages": [{"role": "user", "content": word_gap[:below_bound]}]}
    small_times, done = [], threading.Event()

    def small_requests():
        while not done.is_set():
            seconds, status, _ = timed(SMALL)
            assert status == 200
            small_times.append(seconds)

    with ThreadPoolExecutor(4) as pool:
        smalls = pool.submit(small_requests)
        time.sleep(usual)
        huge = [pool.submit(timed, body) for body in (over_cap, under_cap, pieces)]
        results = [future.result() for future in huge]
        done.set()
        smalls.result()
    (over_s, over_status, over_payload), (under_s, under_status, under), (pieces_s, pieces_status, counted) = results
    print(f"usual {usual:.3f} s; over the cap refused in {over_s:.3f} s, 7.5 MB prompt in {under_s:.3f} s, "
          f"pieces in {pieces_s:.3f} s; small requests meanwhile {min(small_times):.3f}-{max(small_times):.3f} s")
    assert_too_large(over_status, over_payload)
    assert under_status == pieces_status == 400 and under["error"]["code"] == "context_length_exceeded"
    assert "at least" in under["error"]["message"] and "more than" in counted["error"]["message"], (under, counted)
    assert "from its messages'" in under["error"]["message"]  # refused before the template made a text of it
    assert max(over_s, under_s, pieces_s) < REFUSED_WITHIN_S
    assert len(small_times) >= 2 and max(small_times) < 3 * usual + 1.5, (usual, small_times)  # stalled: 4-30 s
