"""`perplexity`: llama.cpp's protocol (chunks of --context, a BOS first in each where the tokenizer
adds one, second halves scored) against the same protocol computed independently with
transformers' model and the `tokenizers` library on a tiny random Llama, its tokenizer adding a
BOS or not; the same figure on 1 and 2 ranks with chunks sharing micro-batches; bad input as one line."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from conftest import make_tiny_model, mpiexec
from test_mpi_generate import assert_fails_cleanly

CONTEXT = 32  # 15 scored positions a chunk; three chunks (96 tokens) fit one micro-batch's prompt budget
ENV = {"OPENBLAS_NUM_THREADS": "1"}
# Measured: ours vs transformers' float32 forward (tiny Llama, 11 chunks, perplexity ~1200 printed
# to 4 decimals): running values within 9e-7 relative, the final one 2e-7, its ± 3e-7. Float
# rounding of the logits, far under what a protocol error moves (planted: targets shifted by one
# -2.4%, no BOS replacement -6.2%; every position scored ends the run). Products of 96 rows in one
# OpenBLAS call instead of the batch-invariant groups move the 2-rank printout's 4th decimal.
RELATIVE_TOLERANCE = 3e-6

WORDS = ("the capital of France is Paris quick brown fox jumps over lazy dog pipeline parallel inference splits "
         "layers across ranks hidden states travel between them def hello world return").split()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama twice: its tokenizer adding no BOS (as SmolLM2's), and putting <|im_start|> first
    (add_bos_token, as Llama's tokenizers do)."""
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("ppl") / "llama")
    with_bos = folder.parent / "llama-bos"
    with_bos.mkdir()
    for file in folder.iterdir():
        (with_bos / file.name).symlink_to(file)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(bos_token="<|im_start|>", add_bos_token=True)
    (with_bos / "tokenizer_config.json").unlink()
    (with_bos / "tokenizer_config.json").write_text(json.dumps(config))
    return {False: folder, True: with_bos}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """Words in a random order (seeded): about 12 chunks of CONTEXT tokens, and a trailing newline
    (dropped, as llama-perplexity's -f drops it)."""
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(" ".join(rng.choice(WORDS, 300).tolist()) + ".\n")
    return path


def reference(folder, text: str, context: int, bos: bool) -> tuple[float, float, list[float]]:
    """llama-perplexity's figures computed apart from pipeline: the `tokenizers` library's ids (with
    the BOS put first by hand, and first in each chunk, if `bos`), transformers' logits of each chunk,
    float64 log-softmax at positions context // 2 .. context - 2 against the next token. (PPL, ±, running)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    first_token = [tokenizer.token_to_id("<|im_start|>")] if bos else []
    ids = first_token + tokenizer.encode(text, add_special_tokens=False).ids
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    first = context // 2
    nll, running = [], []
    for start in range(0, len(ids) - context + 1, context):
        chunk = (first_token or ids[start:start + 1]) + ids[start + 1:start + context]
        with torch.no_grad():
            logits = model(torch.tensor([chunk])).logits[0].double()
        logprobs = torch.log_softmax(logits, dim=-1)
        nll += [-logprobs[j, chunk[j + 1]].item() for j in range(first, context - 1)]
        running.append(math.exp(np.mean(nll)))
    nll = np.array(nll)
    ppl = math.exp(nll.mean())
    return ppl, nll.std(ddof=0) / math.sqrt(len(nll) - 1) * ppl, running


def parse(stdout: str) -> tuple[float, float, list[float]]:
    final = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", stdout)
    assert final, stdout
    running = [float(v) for v in re.findall(r"\[\d+\]([\d.]+),", stdout)]
    return float(final.group(1)), float(final.group(2)), running


def perplexity(n: int, folder, text, *extra: str):
    result = mpiexec(n, "perplexity", "--model", str(folder), "--text", str(text), "--context", str(CONTEXT),
                     *extra, env=ENV, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result


@pytest.mark.parametrize("bos", [True, False], ids=["bos", "no-bos"])
def test_perplexity_is_llamacpps_protocol_on_any_rank_count(models, text_file, bos):
    """1 rank, one chunk at a time, against the independent computation; then 2 ranks with six
    chunks in progress, three in each micro-batch (96 rows, whose products must round each chunk's
    rows as alone: scheduler.row_groups): the same printout."""
    expected_ppl, expected_error, expected_running = reference(models[bos], text_file.read_text()[:-1], CONTEXT, bos)
    assert len(expected_running) >= 10  # enough chunks for the running values to mean something

    one = perplexity(1, models[bos], text_file)
    ppl, error, running = parse(one.stdout)
    assert ppl == pytest.approx(expected_ppl, rel=RELATIVE_TOLERANCE)
    assert error == pytest.approx(expected_error, rel=RELATIVE_TOLERANCE)
    assert running == pytest.approx(expected_running, rel=RELATIVE_TOLERANCE)
    assert f"{len(running)} chunks of {CONTEXT} tokens" in one.stderr

    two = perplexity(2, models[bos], text_file, "--batch", "6")
    assert two.stdout == one.stdout  # every printed digit: batch-invariant products, chunks summed in order


def test_a_chunk_longer_than_a_prompt_piece(tmp_path):
    """--context 600 on a model with room for it: each chunk runs as two prompt pieces (512 + 88,
    engine.PREFILL_CHUNK), the scored positions straddling them; the same figure as whole chunks."""
    folder = make_tiny_model("llama", tmp_path / "llama", max_position_embeddings=1024)
    text = tmp_path / "long.txt"
    text.write_text(" ".join(np.random.default_rng(8).choice(WORDS, 1000).tolist()))
    expected_ppl, expected_error, expected_running = reference(folder, text.read_text(), 600, bos=False)
    result = mpiexec(1, "perplexity", "--model", str(folder), "--text", str(text), "--context", "600", env=ENV,
                     timeout=120)
    assert result.returncode == 0, result.stderr
    ppl, error, running = parse(result.stdout)
    assert len(running) == 2
    assert running == pytest.approx(expected_running, rel=RELATIVE_TOLERANCE)
    assert (ppl, error) == pytest.approx((expected_ppl, expected_error), rel=RELATIVE_TOLERANCE)


def test_protocol_parts():
    from pipeline.runtime.perplexity import Estimate, chunks, first_scored, scored_per_chunk
    from pipeline.util.errors import UserError

    assert chunks(list(range(10)), 4, bos=99) == [[99, 1, 2, 3], [99, 5, 6, 7]]  # the rest left out
    assert chunks(list(range(8)), 4, bos=None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(UserError, match="7 tokens.*at least 8"):
        chunks(list(range(7)), 4, bos=None)
    assert (first_scored(512), scored_per_chunk(512)) == (256, 255)  # llama-perplexity -c 512: 255 a chunk
    assert (first_scored(7), scored_per_chunk(7)) == (3, 3)

    logprobs = np.random.default_rng(0).normal(-2.5, 1.0, 300)
    estimate = Estimate()
    estimate.add(list(logprobs[:200]))
    estimate.add(list(logprobs[200:]))
    nll = -logprobs
    assert estimate.perplexity == pytest.approx(math.exp(nll.mean()), rel=1e-12)
    assert estimate.error == pytest.approx(nll.std() / math.sqrt(len(nll) - 1) * estimate.perplexity, rel=1e-9)
    assert estimate.chunks == pytest.approx([math.exp(nll[:200].mean()), math.exp(nll.mean())], rel=1e-12)
    assert estimate.running().startswith("[1]") and estimate.final().startswith("Final estimate: PPL = ")


def test_bad_text_is_one_line(tmp_path):
    from pipeline import cli
    from pipeline.runtime.perplexity import read_text
    from pipeline.util.errors import UserError

    with pytest.raises(UserError, match="does not exist"):
        read_text(tmp_path / "missing.txt")
    with pytest.raises(UserError, match="is a folder"):
        read_text(tmp_path)
    (tmp_path / "empty.txt").write_text("\n")  # the one trailing newline dropped: nothing left
    with pytest.raises(UserError, match="is empty"):
        read_text(tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(UserError, match="not UTF-8"):
        read_text(tmp_path / "latin1.txt")
    parser = cli.build_parser()
    for flag, value, message in (("--context", "2", "--context must be at least 3"),
                                 ("--batch", "0", "--batch must be >= 1")):
        with pytest.raises(UserError, match=message):
            cli._validated(parser.parse_args(["perplexity", "--text", "x", flag, value]))


def test_short_text_fails_with_one_line_on_every_rank(models, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("the capital of France is Paris")
    assert_fails_cleanly(mpiexec(2, "perplexity", "--model", str(models[False]), "--text", str(short), "--context", "64", env=ENV,
                                 timeout=60), "tokens", "--context 64 needs at least 128")
