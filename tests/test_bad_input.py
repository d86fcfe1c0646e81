"""Bad input never kills a job: each bad value is one `error:` line before anything is loaded
(generate) or that request's error record while the others run (batch), and a crash in one
request's own code path fails that request alone. Real mpiexec, 2 ranks, a tiny Llama."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, mpiexec
from test_batch import ENV, batch, read_records, write_jsonl
from test_mpi_generate import assert_fails_cleanly


@pytest.mark.parametrize("args, fragments", [
    (["--seed", "-1"], ["--seed", "2**64-1", "-1"]),
    (["--seed", str(2**64)], ["--seed", str(2**64)]),
    (["--temp", "inf"], ["--temp", "finite"]),
    (["--top-p", "nan"], ["--top-p", "finite"]),
    (["--repetition-penalty", "inf"], ["--repetition-penalty", "finite"]),
    (["--watchdog", "inf"], ["--watchdog", "finite"]),
    (["--prompt", "", "--no-chat-template"], ["prompt is empty"]),
    (["--prompt", "caf\udce9 \udcff"], ["not UTF-8", "0xe9"]),  # the bytes b"caf\xe9 \xff" as argv
    (["--prompt", "caf\udce9", "--no-chat-template"], ["not UTF-8"]),
])
def test_generate_refuses_bad_values_with_one_line(tiny_models, args, fragments):
    prompt = [] if "--prompt" in args else ["--prompt", "hi"]
    result = mpiexec(2, "generate", "--model", str(tiny_models["llama"]), *prompt, *args, timeout=60)
    assert_fails_cleanly(result, *fragments)


def test_batch_turns_bad_values_into_error_records(tiny_models, tmp_path):
    rows = [
        {"id": "ok", "prompt": "hello", "max_tokens": 4},
        {"id": "negative-seed", "prompt": "hello", "seed": -1},
        {"id": "huge-seed", "prompt": "hello", "seed": 2**64},
        {"id": "inf-temperature", "prompt": "hello", "temperature": math.inf},
        {"id": "nan-top-p", "prompt": "hello", "top_p": math.nan},
        {"id": "surrogate", "prompt": "x \ud800"},
        {"id": "surrogate-message", "messages": [{"role": "user", "content": "\udfff y"}]},
        {"id": "id-\ud800", "prompt": "hello", "max_tokens": 3},  # runs: its record must still be written
        {"id": "ok2", "prompt": "The capital of France", "max_tokens": 4},
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json.dumps writes Infinity, NaN, \ud800
    out = tmp_path / "out.jsonl"
    result = batch(2, tiny_models["llama"], inp, out, "--no-chat-template")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    records = {r["id"]: r for r in read_records(out)}
    assert set(records) == {r["id"] for r in rows}
    assert {i for i, r in records.items() if "text" in r} == {"ok", "ok2", "id-\ud800"}
    assert "seed must be an integer from 0 to 2**64-1" in records["negative-seed"]["error"]
    assert "seed" in records["huge-seed"]["error"]
    assert "temperature must be a finite number" in records["inf-temperature"]["error"]
    assert "top_p must be a finite number" in records["nan-top-p"]["error"]
    assert "lone surrogate \\ud800" in records["surrogate"]["error"]
    assert "lone surrogate \\udfff" in records["surrogate-message"]["error"]

    again = batch(2, tiny_models["llama"], inp, out, "--no-chat-template")  # resumes: nothing left to run
    assert again.returncode == 0 and "nothing to run" in again.stderr, again.stderr
    assert len(read_records(out)) == len(rows)


def test_batch_input_that_is_empty_or_a_folder_is_named(tiny_models, tmp_path):
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    result = batch(2, tiny_models["llama"], empty, tmp_path / "out.jsonl")
    assert_fails_cleanly(result, "has no requests")
    result = batch(2, tiny_models["llama"], tmp_path, tmp_path / "out2.jsonl")
    assert_fails_cleanly(result, "is a folder")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    result = batch(2, tiny_models["llama"], inp, tmp_path)
    assert_fails_cleanly(result, "is a folder")


def test_sigint_during_a_batch_job_says_how_to_resume(tiny_models, tmp_path):
    rows = [{"id": i, "prompt": "The quick brown fox", "max_tokens": 200} for i in range(40)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    import os

    proc = subprocess.Popen(["mpiexec", "-n", "2", sys.executable, "-m", "pipeline", "batch", "--model",
                             str(tiny_models["llama"]), "--input", str(inp), "--output", str(out),
                             "--no-chat-template", "--max-batch", "2", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), **ENV})
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n") >= 2):
        time.sleep(0.2)
    assert out.exists(), "no records before the deadline"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert lines and "rerun the same command to resume" in lines[0], err
    done = len(read_records(out))
    assert 2 <= done < len(rows)
    resumed = batch(2, tiny_models["llama"], inp, out, "--no-chat-template", "--quiet", timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(r["id"] for r in read_records(out)) == list(range(len(rows)))


def test_quantized_weights_that_do_not_match_config_are_one_line(tiny_models, tmp_path):
    """MLX-quantized weights whose shapes fit no quantization of config.json's widths."""
    import mlx.core as mx
    from safetensors.numpy import load_file, save_file
    import numpy as np

    folder = tmp_path / "quantized"
    folder.mkdir()
    source = tiny_models["llama"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((source / name).read_bytes())
    config = json.loads((source / "config.json").read_text())
    tensors = {}
    for name, value in load_file(source / "model.safetensors").items():
        if value.ndim == 2 and name.endswith(".weight") and "norm" not in name:
            w, scales, biases = mx.quantize(mx.array(value), group_size=32, bits=4)
            tensors[name] = np.array(w)
            tensors[name[:-len("weight")] + "scales"] = np.array(scales)
            tensors[name[:-len("weight")] + "biases"] = np.array(biases)
        else:
            tensors[name] = value
    save_file(tensors, str(folder / "model.safetensors"))
    config["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    ok = mpiexec(2, "generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "2", timeout=60)
    assert ok.returncode == 0, ok.stderr  # the folder as written loads

    for key, value in (("hidden_size", 80), ("intermediate_size", 140)):
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        result = mpiexec(2, "generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "2", timeout=60)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert 1 <= len(errors) <= 2, result.stderr  # one line per rank at most (each names its own tensor)
        assert all("do not match config.json" in e and "from config.json" in e for e in errors), errors
