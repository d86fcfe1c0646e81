"""Decoding overlaps building the next step's graph with computing this one (engine.py: on one
rank the whole step, on several rank 0's layers): the tokens must be exactly those of the
step-by-step path (which repetition penalties take), greedy and seeded sampling alike, through
max-tokens and end-of-sequence stops, on any number of ranks."""

from __future__ import annotations

import pytest

from conftest import load_stages, mpiexec


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 3}])
def test_overlapped_decode_equals_a_plain_loop(tiny_models, sampling):
    """engine.generate on one in-process rank against the plainest loop: one forward per token,
    each token sampled before the next step is built."""
    import mlx.core as mx
    from mpi4py import MPI

    from pipeline.runtime.engine import generate
    from pipeline.runtime.requests import SamplingParams
    from pipeline.runtime.sampling import Sampler
    from pipeline.checkpoints.tokenizer import Tokenizer
    from pipeline.cluster.transport import MpiTransport

    folder, prompt, max_tokens = tiny_models["qwen3"], [1, 5, 77, 23, 299, 3], 20
    params = SamplingParams(**sampling)
    stage = load_stages(folder, [(0, 4)])[0]
    tokenizer = Tokenizer.from_folder(folder)
    ours = generate(stage, MpiTransport(MPI.COMM_SELF), tokenizer, prompt, params, max_tokens)
    stage.release([0])
    sampler, history, want = Sampler(params), list(prompt), []
    hidden = stage.run_layers(stage.model.embed(mx.array([prompt])), last_only=True)
    while len(want) < max_tokens:
        token = sampler(stage.model.logits(hidden[:, -1, :])[0], history)
        if token in tokenizer.eos_token_ids:
            break
        want.append(token)
        history.append(token)
        hidden = stage.run_layers(stage.model.embed(mx.array([[token]])), last_only=True)
    assert ours.tokens == want and len(want) > 5


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
