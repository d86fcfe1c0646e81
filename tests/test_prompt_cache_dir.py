"""`serve --prompt-cache-dir`: the prefix cache's entries on disk, each rank its own files.

Without a server: the store's files round-trip bit for bit; a truncated file, another model's file
under our name, a payload that fails its checksum and a file another user could write are each
skipped with one warning, never loaded; a folder others may write to is refused; the index keeps
the folder within its bound, least recently used out. Then `mpiexec -n 2 serve` on a tiny model: a
restarted server starts a long prompt's next turn from disk (cached_tokens > 0) with the logprobs of
a cold server within float rounding; a rank whose file is corrupt or truncated makes its request
run cold, and right; a folder writable by others stops the server in one line."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, make_tiny_model
from pipeline.runtime.prefix_cache import StoredIndex
from pipeline.runtime.prompt_cache_store import PromptCacheStore, entry_key
from pipeline.util.errors import UserError
from test_serve import ENV, Server

REUSE_TOLERANCE = 2e-5  # as the memory prefix cache's tests (test_scheduler.py): logprobs within float rounding
MODEL = "0123456789abcdef0123456789abcdef"


def arrays(positions: int, capacity: int = 300, layers: int = 2, seed: int = 0) -> list[np.ndarray]:
    """Keys and values of `layers` layers as a live cache holds them: room for `capacity` positions."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 2, capacity, 8)).astype(np.float32) for _ in range(2 * layers)]


def store_in(folder: Path, layers=(0, 2), model=MODEL) -> PromptCacheStore:
    return PromptCacheStore(folder, model, layers)


def test_an_entry_round_trips_and_is_found_by_its_tokens(tmp_path):
    store = store_in(tmp_path / "cache")
    tokens = list(range(5, 205))
    key, held = entry_key(tokens), arrays(200)
    store.save(key, len(tokens), held, "float32", tokens=tokens)
    store.flush()
    found = store.scan()
    assert list(found) == [key] and found[key].tokens == tuple(tokens) and found[key].positions == 200
    loaded = store.load(key, 150)
    assert all(a.dtype == "float32" and np.array_equal(a.data, b[:, :, :150]) for a, b in zip(loaded, held))
    assert not store.warnings
    assert (tmp_path / "cache").stat().st_mode & 0o022 == 0 and store.path(key).stat().st_mode & 0o077 == 0
    # another rank's layers, another model: other names, not this store's
    assert not store_in(tmp_path / "cache", layers=(2, 4)).scan()
    assert not store_in(tmp_path / "cache", model="f" * 32).scan()


def test_bad_files_are_skipped_with_one_warning_each(tmp_path):
    folder = tmp_path / "cache"
    store = store_in(folder)
    keys = [entry_key([k] * 100) for k in range(4)]
    for k, key in enumerate(keys):
        store.save(key, 100, arrays(100, seed=k), "float32", tokens=[k] * 100)
    store.flush()
    # 0: truncated; 1: another model's header under our name; 2: its payload changed (same size)
    truncated = store.path(keys[0])
    truncated.write_bytes(truncated.read_bytes()[:-10])
    foreign = store_in(tmp_path / "other", model="f" * 32)
    foreign.save(keys[1], 100, arrays(100, seed=9), "float32", tokens=[1] * 100)
    foreign.flush()
    os.replace(foreign.path(keys[1]), store.path(keys[1]))
    data = bytearray(store.path(keys[2]).read_bytes())
    data[-5] ^= 0xFF
    store.path(keys[2]).write_bytes(bytes(data))
    fresh = store_in(folder)
    found = fresh.scan()
    assert sorted(found) == sorted(keys[2:])
    assert len(fresh.warnings) == 2
    assert "truncated" in fresh.warnings[0] + fresh.warnings[1]
    assert any("another model" in w for w in fresh.warnings)
    assert fresh.load(keys[2], 100) is None and "checksum" in fresh.warnings[-1]
    assert fresh.load(keys[3], 100) is not None and len(fresh.warnings) == 3
    # a file that another user could have written is never read
    store.path(keys[3]).chmod(0o666)
    assert fresh.load(keys[3], 100) is None and "another user" in fresh.warnings[-1]


def test_a_folder_others_may_write_to_is_refused(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(UserError, match=r"--prompt-cache-dir is refused: .*shared: every user may write to it"):
        store_in(folder)


def test_the_index_keeps_the_folder_within_its_bound():
    index = StoredIndex(capacity_tokens=500, key=entry_key, min_positions=64)
    first, second, third = [1] * 200, [2] * 200, [3] * 200
    assert index.add([9] * 10) == (None, [])  # too short to be worth a file
    k1, gone = index.add(first)
    k2, _ = index.add(second)
    assert gone == [] and index.lookup(first + [5], beyond=0) == (k1, 200)  # first is now the most recent
    k3, gone = index.add(third)
    assert gone == [k2] and len(index) == 2  # over 500 positions: the least recently used goes
    assert index.lookup(first + [5], beyond=150) == (None, 0)  # the memory offers almost as much
    k4, gone = index.add(first + [7] * 100)  # holds every position of `first`: it replaces it
    assert k4 is not None and gone == [k1]
    assert index.add(first) == (None, [])  # already held by k4
    # at start-up: found over the bound (a smaller --prompt-cache-dir-gb), the oldest go
    restored = StoredIndex(capacity_tokens=400, key=entry_key, min_positions=64)
    assert restored.restore([(k1, tuple(first)), (k2, tuple(second)), (k3, tuple(third))]) == [k1]


FRAMING = r"""
from mpi4py import MPI
from pipeline.cluster.transport import Kind, MpiTransport
from pipeline.runtime.prompt_cache_store import entry_key
t = MpiTransport(MPI.COMM_WORLD)
keys = [entry_key([k] * 9) for k in range(60)]  # 63-bit keys; 60 of them: a DROP's layout apart from its header
if t.rank == 0:
    t.send_message(1, Kind.SAVE, [4, 5], entries=keys[:2], prefix=[700, 300])
    t.send_message(1, Kind.LOAD, [6], entries=keys[2:3], prefix=[-699])
    for n in (3, 60):
        t.send_message(1, Kind.DROP, entries=keys[:n])
else:
    m = t.recv_message(0)
    assert m.kind == Kind.SAVE and m.seq_ids == [4, 5] and m.entries == keys[:2] and m.prefix == [700, 300], m
    m = t.recv_message(0)
    assert m.kind == Kind.LOAD and m.seq_ids == [6] and m.entries == keys[2:3] and m.prefix == [-699], m
    for n in (3, 60):
        m = t.recv_message(0)
        assert m.kind == Kind.DROP and m.seq_ids == [] and m.entries == keys[:n], m
    print("ok")
"""


def test_save_load_and_drop_round_trip_the_ring(env):
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", FRAMING], capture_output=True, text=True,
                            timeout=120, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# -- a real server ------------------------------------------------------------------------------------------------

PROMPT_TOKENS = 700


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("pcd") / "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def env() -> dict:
    """The user's cache, as test_chat_serve: the kernels' extension built once, not per module."""
    return {**os.environ, **ENV, "PYTHONPATH": str(REPO)}


def completion(server: Server, prompt: list[int]) -> dict:
    status, body, _ = server.post("/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 4,
                                                      "temperature": 0, "logprobs": 3})
    assert status == 200, body
    return body


def logprobs(body: dict) -> list[float]:
    """The chosen tokens' logprobs and their alternatives', in order."""
    lp = body["choices"][0]["logprobs"]
    return lp["token_logprobs"] + [v for top in lp["top_logprobs"] for v in top.values()]


def assert_close(ours: dict, cold: dict) -> None:
    assert ours["choices"][0]["text"] == cold["choices"][0]["text"]
    difference = max(abs(a - b) for a, b in zip(logprobs(ours), logprobs(cold)))
    assert difference <= REUSE_TOLERANCE, difference


def test_a_restarted_server_starts_from_disk_and_a_bad_file_runs_cold(model, env, tmp_path):
    folder = tmp_path / "prompt-cache"
    rng = random.Random(0)
    long = [rng.randrange(3, 384) for _ in range(PROMPT_TOKENS)]  # a long system prompt, as agents send
    turn = long + [rng.randrange(3, 384) for _ in range(20)]  # ... and the next turn
    other = [rng.randrange(3, 384) for _ in range(300)]
    fourth = [rng.randrange(3, 384) for _ in range(400)]
    cached = ["--model", str(model), "--prompt-cache-dir", str(folder)]

    def cold_answers() -> dict:
        cold = Server(2, "--model", str(model), "--prefix-cache-gb", "0", env=env)
        answers = {name: completion(cold, prompt) for name, prompt in (("turn", turn), ("other", other),
                                                                       ("fourth", fourth))}
        assert cold.stop() == 0
        return answers

    def first_run() -> None:
        server = Server(2, *cached, env=env)
        completion(server, long)
        completion(server, other)
        completion(server, fourth)
        assert server.stop() == 0, server.stderr
        assert "3 entries stored" in server.stderr

    with ThreadPoolExecutor(2) as pool:
        cold, _ = pool.submit(cold_answers), pool.submit(first_run).result()
        cold = cold.result()
    files = sorted(folder.iterdir())
    assert len(files) == 6  # three entries, a file per rank each

    restarted = Server(2, *cached, env=env)
    warm = completion(restarted, turn)  # the first request after the restart
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= PROMPT_TOKENS
    assert_close(warm, cold["turn"])
    assert restarted.stop() == 0
    assert "from disk: 1 requests" in restarted.stderr and "warning: prompt cache" not in restarted.stderr

    # Files by size: other < fourth < long < turn. Rank 1's (layers 2-4) of `turn` fails its checksum when
    # loaded (the ring's answer), rank 1's of `other` is truncated (its start-up scan), rank 0's of `fourth`
    # fails its checksum (rank 0's own load)
    rank0, rank1 = ([f for f in sorted(folder.iterdir(), key=lambda f: f.stat().st_size) if layers in f.name]
                    for layers in ("-L0-2-", "-L2-4-"))
    turn_file, other_file, fourth_file = rank1[-1], rank1[0], rank0[1]
    for corrupt in (turn_file, fourth_file):
        data = bytearray(corrupt.read_bytes())
        data[-7] ^= 0x40
        corrupt.write_bytes(bytes(data))
    other_file.write_bytes(other_file.read_bytes()[:-100])
    broken = Server(2, *cached, env=env)
    for name, prompt in (("turn", turn), ("other", other), ("fourth", fourth)):
        answer = completion(broken, prompt)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, name
        assert_close(answer, cold[name])
    assert broken.stop() == 0
    warnings = [line for line in broken.stderr.splitlines() if line.startswith("warning: prompt cache")]
    assert len(warnings) == 3, broken.stderr
    assert "truncated" in warnings[0] and other_file.name in warnings[0]
    assert "checksum" in warnings[1] and turn_file.name in warnings[1]
    assert "checksum" in warnings[2] and fourth_file.name in warnings[2]
    assert "from disk: 0 requests, 0 prompt tokens, 2 failed" in broken.stderr


def test_a_folder_others_may_write_to_stops_the_server(model, env, tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "pipeline", "serve", "--port", "0",
                             "--model", str(model), "--prompt-cache-dir", str(folder)],
                            capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "prompt-cache-dir" in line]
    assert len(lines) == 1 and "every user may write to it" in lines[0] and "Traceback" not in result.stderr
