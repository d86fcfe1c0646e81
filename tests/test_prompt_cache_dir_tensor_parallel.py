"""`serve --prompt-cache-dir` with --tensor-parallel T > 1: each member of a stage's group stores and loads
its own share of every entry (runtime/tensor_group.py SAVE, LOAD, DROP; job.prompt_cache).

On a tiny Llama whose 9 query / 3 KV heads T = 2 splits unevenly (member 0 reads KV heads 0-1, member 1
KV heads 1-2): the two members' files hold those heads (KV head 1 in both, bit for bit: the independent
truth that each holds its own share, not its leader's), their payloads add up to what the bound counts
per position (every member's files: a bound they exceed only so counted empties the folder at start-up);
a restarted T = 2 server starts the next turn from disk with the logprobs of a cold T = 2 server; a hybrid of 2 stages x 2 on 4 ranks restarts from its own files alike,
and a restart of the same layer ranges at T = 1 finds no entry of its own (a cold start, the T = 2 files
left alone)."""

from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, make_tiny_model
from pipeline.models.config import ModelConfig
from pipeline.runtime.job import kv_held_share
from pipeline.runtime.prompt_cache_store import MAGIC
from test_serve import ENV, Server

NINE_HEADS = dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, intermediate_size=256)
# A restored entry's keys and values were computed in other products than a cold run's (its prompt in
# other chunks), so logprobs agree within float rounding (as tests/test_prompt_cache_dir.py), measured
# here: 6.2e-6 (one stage of 2) and 6.2e-6 (2 x 2) at most over the chosen tokens' and their alternatives'
REUSE_TOLERANCE = 1e-5
PROMPT_TOKENS = 700
rng = random.Random(0)
LONG = [rng.randrange(3, 384) for _ in range(PROMPT_TOKENS)]  # a long system prompt, as agents send
TURN = LONG + [rng.randrange(3, 384) for _ in range(20)]  # ... and the next turn


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("pcdtp") / "llama", max_position_embeddings=2048,
                           **NINE_HEADS)


@pytest.fixture(scope="module")
def env() -> dict:
    return {**os.environ, **ENV, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def cold(model, env) -> dict:
    """The next turn's answer from a cold T = 2 server (no prefix cache at all)."""
    server = Server(2, "--model", str(model), "--prefix-cache-gb", "0", "--tensor-parallel", "2", env=env)
    answer = completion(server, TURN)
    assert server.stop() == 0
    return answer


def completion(server: Server, prompt: list[int]) -> dict:
    status, body, _ = server.post("/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 4,
                                                      "temperature": 0, "logprobs": 3})
    assert status == 200, body
    return body


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def assert_close(ours: dict, cold: dict) -> None:
    def logprobs(body):
        lp = body["choices"][0]["logprobs"]
        return lp["token_logprobs"] + [v for top in lp["top_logprobs"] for v in top.values()]

    assert ours["choices"][0]["text"] == cold["choices"][0]["text"]
    difference = max(abs(a - b) for a, b in zip(logprobs(ours), logprobs(cold)))
    print(f"max |logprob difference| restored vs cold: {difference:.3g}")
    assert difference <= REUSE_TOLERANCE, difference


def read_entry(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """A file's header and arrays, read here from the format (prompt_cache_store.py's module docstring)."""
    data = path.read_bytes()
    assert data[:8] == MAGIC
    (length,) = struct.unpack("<Q", data[8:16])
    header = json.loads(data[16:16 + length])
    arrays, at = {}, 16 + length
    for a in header["arrays"]:
        count = int(np.prod(a["shape"]))
        arrays[a["name"]] = np.frombuffer(data, np.float32, count, at).reshape(a["shape"])
        at += 4 * count
    return header, arrays


def test_each_member_stores_and_restores_its_own_share(model, env, cold, tmp_path):
    folder = tmp_path / "prompt-cache"
    cached = ["--model", str(model), "--prompt-cache-dir", str(folder)]
    first = Server(2, *cached, "--tensor-parallel", "2", env=env)
    completion(first, LONG)
    assert first.stop() == 0, first.stderr
    assert "1 entries stored" in first.stderr

    files = sorted(folder.iterdir(), key=lambda f: f.name[-15:])  # (each member's identity names its files)
    assert [f.name[-15:] for f in files] == ["-L0-4-tp0of2.kv", "-L0-4-tp1of2.kv"], [f.name for f in files]
    assert all(f.stat().st_mode & 0o077 == 0 for f in files)
    (leader, mine), (mate, theirs) = (read_entry(f) for f in files)
    assert leader["tokens"][:PROMPT_TOKENS] == LONG and mate["tokens"] is None  # (and 3 of the 4 tokens generated)
    assert leader["shard"] == [0, 2] and mate["shard"] == [1, 2]
    positions = leader["positions"]
    assert mate["positions"] == positions >= PROMPT_TOKENS
    for layer in range(4):
        for name in ("keys", "values"):
            a, b = mine[f"{layer}.{name}"], theirs[f"{layer}.{name}"]
            assert a.shape == b.shape == (1, 2, positions, 16)
            assert np.array_equal(a[:, 1], b[:, 0])  # KV head 1, held by both members
            assert not np.allclose(a[:, 0], b[:, 1])  # KV heads 0 and 2: each member's own
    # the bound counts every member's files: 4/3 of the whole model's KV cache per position here
    config = ModelConfig.from_folder(model)
    held = kv_held_share(config, 2)
    assert held == pytest.approx(4 / 3)
    whole = 2 * 3 * 16 * 4 * 4  # keys and values, 3 KV heads of 16, float32, 4 layers
    assert leader["payload_bytes"] + mate["payload_bytes"] == pytest.approx(positions * whole * held)

    restarted = Server(2, *cached, "--tensor-parallel", "2", env=env)
    warm = completion(restarted, TURN)
    assert cached_tokens(warm) >= PROMPT_TOKENS
    assert_close(warm, cold)
    assert restarted.stop() == 0
    assert "from disk: 1 requests" in restarted.stderr and "warning: prompt cache" not in restarted.stderr

    # --prompt-cache-dir-gb counts every member's files: the next turn's entry (723 positions) takes 1.48 MB
    # here, over a 1.3 MB bound (counted as the model's whole KV cache, 1.11 MB, it would fit), the first
    # one's (703) too: both go at start-up, on both members, and the request runs cold
    assert sorted(f.name[-15:] for f in folder.iterdir()) == ["-L0-4-tp0of2.kv"] * 2 + ["-L0-4-tp1of2.kv"] * 2
    bounded = Server(2, *cached, "--tensor-parallel", "2", "--prompt-cache-dir-gb", "0.0013", env=env)
    assert cached_tokens(completion(bounded, TURN)) == 0
    assert bounded.stop() == 0
    assert not list(folder.iterdir())


def test_a_hybrid_of_two_stages_of_two_restarts_from_disk_and_another_t_starts_cold(model, env, cold, tmp_path):
    folder = tmp_path / "prompt-cache"
    cached = ["--model", str(model), "--prompt-cache-dir", str(folder), "--tensor-parallel", "2"]
    first = Server(4, *cached, env=env)
    completion(first, LONG)
    assert first.stop() == 0, first.stderr
    names = sorted(f.name[-15:] for f in folder.iterdir())
    assert names == ["-L0-2-tp0of2.kv", "-L0-2-tp1of2.kv", "-L2-4-tp0of2.kv", "-L2-4-tp1of2.kv"], names

    restarted = Server(4, *cached, env=env)
    warm = completion(restarted, TURN)
    assert cached_tokens(warm) >= PROMPT_TOKENS
    assert_close(warm, cold)  # the same T: the same bits for any number of stages
    assert restarted.stop() == 0
    assert "from disk: 1 requests" in restarted.stderr and "warning: prompt cache" not in restarted.stderr

    # T = 1 on 2 ranks (stages of the same layers, L0-2 and L2-4): no entry of its own, a cold start, the
    # T = 2 shares left alone
    files = sorted(folder.iterdir())
    other_t = Server(2, "--model", str(model), "--prompt-cache-dir", str(folder), env=env)
    answer = completion(other_t, TURN)
    assert cached_tokens(answer) == 0
    assert other_t.stop() == 0
    assert "from disk: 0 requests" in other_t.stderr and "warning" not in other_t.stderr
    assert all(f.exists() for f in files)
