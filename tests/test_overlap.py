"""One rank overlaps building the next step's graph with computing this one (engine.py): the
tokens must be exactly those of the step-by-step path (which 2+ ranks and repetition penalties
take), greedy and seeded sampling alike, through max-tokens and end-of-sequence stops."""

from __future__ import annotations

import pytest

from conftest import mpiexec


@pytest.mark.parametrize("sampling", [(), ("--temp", "0.9", "--top-p", "0.95", "--top-k", "40", "--seed", "3"),
                                      ("--temp", "1.3", "--min-p", "0.02", "--seed", "11")])
def test_overlapped_decode_equals_step_by_step(tiny_models, sampling):
    base = ("generate", "--model", str(tiny_models["qwen3"]), "--prompt", "The capital of France", "--no-chat-template")
    args = (*base, "--max-tokens", "24", *sampling)
    one, two = mpiexec(1, *args), mpiexec(2, *args)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert one.stdout == two.stdout and one.stdout.strip()
    for max_tokens in ("1", "2"):
        short = mpiexec(1, *base, "--max-tokens", max_tokens, *sampling)
        assert short.returncode == 0, short.stderr
        assert f"({max_tokens} tokens" in short.stderr or "stop)" in short.stderr, short.stderr
