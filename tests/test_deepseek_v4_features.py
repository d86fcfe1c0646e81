"""DeepSeek V4 in the features built for KV caches (issue 36): the prefix cache (a fork of its
compressed caches at a shorter prefix), the LM head's share on the last rank, speculative decoding's
rewind of rejected drafts, and V4's own MTP module as the drafter (against DeepSeek's MTPBlock
equations). Each against a cold run of the same tiny random model (test_deepseek_v4.py's, whose
logits are transformers'), with the mechanism's planted bug."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import load_stages, long_prompt, mpiexec, transformers_text
from test_deepseek_v4 import TEXT, make_deepseek_v4

from pipeline.checkpoints.tokenizer import Tokenizer
from pipeline.models import deepseek_v4 as V
from pipeline.runtime.requests import Request, SamplingParams

# A fork against a cold run of the same prefix then the rest: the kept state came from other products
# (a chunk of 50 positions, not one of 32; tokens decoded one at a time, not a chunk), so within float
# rounding: measured 1.9e-5 at most.
FORK_TOLERANCE = 4e-5
STRIDE = 32  # reuse_stride of the tiny model: rates 4 and 16, window 8 -> a multiple of 16, at least 4 windows


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v4_features")
    return folder, make_deepseek_v4(folder)


def run(stage, seq_id, tokens):
    """Logits of `tokens` fed to sequence `seq_id` after what its caches hold."""
    hidden = stage.run_layers(stage.model.embed(mx.array([tokens])), [seq_id])
    return np.array(stage.model.logits(hidden).astype(mx.float32))[0]


def kept_sequence(stage, tokens):
    """Sequence 1 as a server leaves it: a prompt in two chunks (50, 20), then 10 decoded tokens."""
    run(stage, 1, tokens[:50])
    run(stage, 1, tokens[50:70])
    for i in range(70, 80):
        run(stage, 1, tokens[i:i + 1])
    return stage.caches[1]


def worst_fork_error(stage, tokens):
    """Fork sequence 1 at several lengths, as the prefix cache would clip them, run the rest of the
    prompt: (each (asked, reused) length, the largest logit difference to a cold run of that prefix
    then the rest)."""
    cold = {}
    for n in (80, 79, 78, 64, 50, 32, 0):
        if n:
            run(stage, 3, tokens[:n])
        cold[n] = run(stage, 3, tokens[n:110])
        stage.release([3])
    caches = kept_sequence(stage, tokens)
    assert V.reuse_stride(stage.model.config) == STRIDE and sorted(caches[1].points) == [32, 64]
    reused, worst = [], 0.0
    for n in (80, 79, 78, 64, 50, 49, 33, 31):
        length = min(c.reusable(n) for c in caches)
        assert {max(c.resume_points(n), default=0) for c in caches} == {length}
        stage.fork([2], [1], [length])
        error = np.abs(run(stage, 2, tokens[length:110]) - cold[length]).max()
        print(f"fork at {length}: {error:.2e}")
        worst = max(worst, error)
        stage.release([2])
        reused.append((n, length))
    stage.release([1])
    return reused, worst


def test_a_fork_resumes_as_a_cold_run(v4):
    """A fork at the kept sequence's end, within its last calls (up to 64 positions back: the 10
    decode steps and the 20-token chunk, 50-80) or at a kept point (multiples of 32; a match of 49 or
    33 is clipped to one, 31 to none) continues
    with the logits of a cold run of that prefix then the rest, within float rounding."""
    folder, _ = v4
    (stage,) = load_stages(folder, [(0, 5)])
    reused, worst = worst_fork_error(stage, long_prompt(120, seed=5))
    print(f"largest logit difference after a fork: {worst:.2e}")
    assert reused == [(80, 80), (79, 79), (78, 78), (64, 64), (50, 50), (49, 32), (33, 32), (31, 0)]
    assert worst <= FORK_TOLERANCE, worst


def _window_one_short(right):
    def wrong(self, position):
        window, states = right(self, position)
        _, _, keys, key_start, _ = next(log for log in self.logs if log[0] <= position <= log[1])
        return keys[:position - key_start - 1][-self.keep:], states
    return wrong


def _compressor_state_one_early(right):
    def wrong(self, before, raw, position, rate, dim, overlap):
        return right(self, before, raw, position - 1, rate, dim, overlap)
    return wrong


@pytest.mark.parametrize("target, name, plant", [
    ("CompressedCache", "_at", _window_one_short),  # the cut's window of keys off by one position
    ("Series", "at", _compressor_state_one_early),  # the compressor's state taken one position early
])
def test_a_planted_off_by_one_in_the_cut_fails(v4, monkeypatch, target, name, plant):
    folder, _ = v4
    (stage,) = load_stages(folder, [(0, 5)])
    cls = getattr(V, target)
    monkeypatch.setattr(cls, name, plant(getattr(cls, name)))
    _, worst = worst_fork_error(stage, long_prompt(120, seed=5))
    assert worst > 100 * FORK_TOLERANCE, worst


def test_rejected_drafts_leave_the_caches_as_a_cold_run(v4):
    """A verify trip of 5 positions of which 3 are dropped (Stage.rewind): the caches hold what those
    of a run that fed only the 2 kept positions hold (within rounding: other products), and both
    continue with the same logits."""
    folder, _ = v4
    (stage,) = load_stages(folder, [(0, 5)])
    tokens = long_prompt(110, seed=8)
    for start in (61, 62, 64):  # the dropped positions cross an HCA window's end (64) or not
        for seq, fed in ((1, 5), (2, 2)):
            run(stage, seq, tokens[:start])
            run(stage, seq, tokens[start:start + fed])
        stage.rewind([1], 3)
        for a, b in zip(stage.caches[1], stage.caches[2]):
            assert a.offset == b.offset == start + 2
            assert np.allclose(np.array(a.window), np.array(b.window), atol=1e-5)
            for s, t in zip(a.series(), b.series()):
                assert s.count == t.count
                for field in ("entries", "pending_kv", "pending_gate", "overlap_kv", "overlap_gate"):
                    x, y = getattr(s, field), getattr(t, field)
                    assert (x is None or x.size == 0) == (y is None or y.size == 0), field
                    if x is not None and x.size:
                        assert x.shape == y.shape and np.allclose(np.array(x), np.array(y), atol=1e-5), field
        rewound, plain = run(stage, 1, tokens[start + 2:]), run(stage, 2, tokens[start + 2:])
        assert np.abs(rewound - plain).max() <= FORK_TOLERANCE
        stage.release([1, 2])


class Oracle:
    """Drafts from a known continuation: right for the first `right` tokens of each draft, then wrong."""

    def __init__(self, continuation, prompt_len, k, right):
        self.continuation, self.prompt_len, self.k, self.right = continuation, prompt_len, k, right

    def propose(self, history, limit):
        done = len(history) - self.prompt_len
        drafts = self.continuation[done:done + min(self.k, limit)]
        return [t if i < self.right else (t + 1) % 384 for i, t in enumerate(drafts)]

    def observe(self, drafted, accepted):
        pass


def generate_with(stage, folder, prompt, max_tokens, drafter=None):
    from mpi4py import MPI

    from pipeline.cluster.transport import MpiTransport
    from pipeline.runtime.engine import generate

    stage.release([0])
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.eos_token_ids = set()  # a random model says end-of-text early; decode the full length
    return generate(stage, MpiTransport(MPI.COMM_SELF), tokenizer, prompt, SamplingParams(), max_tokens,
                    drafter=drafter)


@pytest.mark.parametrize("right", [4, 2, 0])
def test_drafts_right_or_wrong_give_plain_greedy_tokens(v4, right):
    """Speculative decoding on V4 (drafts all right, half right, all wrong): plain greedy's tokens."""
    folder, _ = v4
    (stage,) = load_stages(folder, [(0, 5)])
    prompt = long_prompt(45, seed=4)
    plain = generate_with(stage, folder, prompt, 30)
    assert len(set(plain.tokens)) >= 8
    drafted = generate_with(stage, folder, prompt, 30, Oracle(plain.tokens, len(prompt), 4, right))
    assert drafted.tokens == plain.tokens
    stats = drafted.draft
    if right == 4:
        assert stats.accepted == stats.drafted > 0
    elif right == 2:
        assert 0 < stats.accepted < stats.drafted
    else:
        assert stats.accepted == 0 and stats.drafted > 0


def test_prefix_cache_hit_equals_a_cold_run(v4, monkeypatch):
    """Through the scheduler: a second turn re-sending the first's prompt and answer resumes from the
    end of the kept caches, a third sharing 36 positions with the first (whose 40-token prompt call
    was too long to log, at a LOG_LIMIT of 16) from the kept point at 32; each has
    the cold run's greedy text, every chosen token's logprob within float rounding."""
    from test_scheduler import REUSE_TOLERANCE, Collect, scheduler  # another test module's helpers
    from pipeline.runtime.prefix_cache import PrefixCache
    from pipeline.runtime.requests import ListSource, Tokens
    from conftest import greedy_ours

    folder, _ = v4
    (stage,) = load_stages(folder, [(0, 5)])
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.eos_token_ids = set()
    monkeypatch.setattr(V, "LOG_LIMIT", 16)  # fewer positions logged: the first prompt's call is not
    first, greedy = long_prompt(40, seed=6), SamplingParams()
    answer = greedy_ours(stage, folder, first, 6).tokens
    stage.release([0])
    second = first + answer + long_prompt(4, seed=7)
    third = first[:36] + long_prompt(10, seed=9)
    colds = []
    for prompt in (second, third):
        colds.append(Collect())
        scheduler(stage, tokenizer, ListSource([Request(prompt, greedy, 6, colds[-1], logprobs=0)])).run()
    turns = [Collect(), Collect(), Collect()]
    warm = scheduler(stage, tokenizer, ListSource([Request(first, greedy, 6, turns[0]),
                                                   Request(second, greedy, 6, turns[1], logprobs=0),
                                                   Request(third, greedy, 6, turns[2], logprobs=0)]), max_batch=1)
    warm.prefix_cache = PrefixCache(capacity_tokens=4096)
    warm.run()
    assert turns[1].last.cached_tokens == len(first) + len(answer) - 1  # the answer's last token was not fed
    assert turns[2].last.cached_tokens == STRIDE
    for hit, cold in zip(turns[1:], colds):
        assert cold.last.cached_tokens == 0
        assert hit.last.text == cold.last.text and hit.last.completion_tokens == cold.last.completion_tokens == 6
        ours = [e.logprob.logprob for e in hit.events if isinstance(e, Tokens)]
        theirs = [e.logprob.logprob for e in cold.events if isinstance(e, Tokens)]
        assert max(abs(a - b) for a, b in zip(ours, theirs)) <= REUSE_TOLERANCE


@pytest.mark.parametrize("plant", [False, True])
def test_the_last_rank_shares_the_head(v4, monkeypatch, plant):
    """The last rank's share of the LM head reads the collapsed streams (its own hc_head): the
    combined greedy choice is the whole head's argmax on rank 0. Planted: the last rank reads the
    first stream instead of the collapse, and some rows' choices differ."""
    from pipeline.runtime.head_share import combined_argmax, head_share_rows, returned_rows, split_returned

    folder, _ = v4
    first, last = load_stages(folder, [(0, 2)]), None
    config = first[0].model.config
    rows_held = head_share_rows(0.5, config.vocab_size)
    from pipeline.checkpoints.safetensors_checkpoint import Checkpoint
    from pipeline.runtime.stage import Stage

    last = Stage.load(config, Checkpoint(folder), (2, 5), has_ends=False, dtype=mx.float32, head_rows=rows_held)
    if plant:
        monkeypatch.setattr(last.model, "collapse", lambda h: h[..., 0, :], raising=False)
    assert "model.hc_head.hc_fn" in last.loaded_tensors and "model.norm.weight" in last.loaded_tensors
    mx.random.seed(0)
    streams = mx.random.normal((1, 24, 4, config.hidden_size)) * 3  # the last positions of 24 sequences
    for columns in (rows_held, 16):
        rows, share = split_returned(returned_rows(last.model, streams, columns, [(0, 10), (10, 24)]),
                                     config.hidden_size)
        assert rows.shape == (24, config.hidden_size)
        expected = mx.argmax(first[0].model.logits(streams[0]), axis=-1)
        own = config.vocab_size - columns
        got = combined_argmax(first[0].model.logits(rows, vocab_end=own), share, own)
        if plant:
            assert got.tolist() != expected.tolist()
            return
        assert got.tolist() == expected.tolist()
    rows, share = split_returned(returned_rows(last.model, streams, 0, [(0, 24)]), config.hidden_size)
    assert share is None and rows.shape == (24, 4, config.hidden_size)  # no share: the streams as they are


def test_batch_with_a_shared_head_on_two_ranks(v4, tmp_path):
    """`batch` on 2 ranks with --head-share 0.5: transformers' greedy texts."""
    folder, reference = v4
    prompts = [TEXT, "The capital of France is Paris."]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": 10}) + "\n" for i, p in enumerate(prompts)))
    result = mpiexec(2, "batch", "--model", str(folder), "--input", str(inp), "--output", str(out),
                     "--no-chat-template", "--split", "2,3", "--head-share", "0.5",
                     env={"OPENBLAS_NUM_THREADS": "1"}, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "LM head r1 50%" in result.stderr, result.stderr[-2000:]  # the share was used
    texts = {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}
    assert texts == {i: transformers_text(reference, folder, p, 10) for i, p in enumerate(prompts)}


# ------------------------------------------------------------------------------------ V4's MTP module

MTP_TEMPLATE = "model.layers.4."  # a top-k MoE layer: the MTP block's tensors are shaped as its, but sliding


def add_mtp(folder, seed=11):
    """The tiny V4 with an MTP module as DeepSeek publishes one (`mtp.0.*`, DeepSeek's names; transformers
    writes none): a sliding-attention, top-k block shaped as layer 4 (no compressor), its own e_proj,
    h_proj, enorm, hnorm, norm and hc_head, every value drawn at random, far from uniform."""
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    tensors = load_file(str(folder / "model.safetensors"))
    d = tensors["model.norm.weight"].shape[0]
    mtp = {}
    for name, t in tensors.items():
        if name.startswith(MTP_TEMPLATE) and ".compressor." not in name:
            spread = t.float().std() if t.numel() > 1 else 0.3
            mtp["mtp.0." + name[len(MTP_TEMPLATE):]] = t + torch.randn_like(t) * spread
    for own in ("e_proj", "h_proj"):
        mtp[f"mtp.0.{own}.weight"] = torch.randn(d, d) * 0.2
    for own in ("enorm", "hnorm", "norm"):
        mtp[f"mtp.0.{own}.weight"] = 1 + 0.3 * torch.randn(d)
    for part in ("fn", "base", "scale"):
        t = tensors[f"model.hc_head.hc_{part}"]
        mtp[f"mtp.0.hc_head_{part}"] = t + 0.3 * torch.randn_like(t)
    save_file({**tensors, **mtp}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return mtp


@pytest.fixture(scope="module")
def v4_mtp(v4, tmp_path_factory):
    import shutil

    folder = tmp_path_factory.mktemp("deepseek_v4_mtp")
    for f in v4[0].iterdir():
        shutil.copy(f, folder / f.name)
    return folder, add_mtp(folder)


def load_with_mtp(folder, ranges=((0, 5),)):
    from pipeline.checkpoints.mtp import load_mtp
    from pipeline.checkpoints.safetensors_checkpoint import Checkpoint
    from pipeline.models.config import ModelConfig

    stages = load_stages(folder, list(ranges))
    stages[0].mtp = load_mtp(ModelConfig.from_folder(folder), Checkpoint(folder), mx.float32)
    return stages


def reference_mtp_logits(folder, mtp, prompt, streams):
    """DeepSeek's MTPBlock.forward (inference/model.py) in torch, its Block and hc_head transformers':
    e = enorm(embed(t_{j+1})); X = e_proj(e) + h_proj(hnorm(H_j)) on each stream; X' = Block(X) (a
    one-layer transformers V4 whose layer holds the block, its input replaced by X); logits =
    head(norm(hc_head(X'))) with the module's hc_head and norm in that model's. -> [T - 1, vocab]."""
    import tempfile
    from pathlib import Path

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    main = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"],
                  num_nextn_predict_layers=0)
    one = {k: v for k, v in main.items() if not k.startswith(("model.layers.", "mtp."))}
    for name, t in mtp.items():
        rest = name.removeprefix("mtp.0.")
        if rest.startswith("hc_head_"):
            one["model.hc_head.hc_" + rest.removeprefix("hc_head_")] = t
        elif rest == "norm.weight":
            one["model.norm.weight"] = t
        elif not rest.startswith(("e_proj.", "h_proj.", "enorm.", "hnorm.")):
            one["model.layers.0." + rest] = t
    with tempfile.TemporaryDirectory() as tmp:
        save_file(one, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        model = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp).eval()
    eps = config["rms_norm_eps"]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    with torch.no_grad():
        ids = torch.tensor([prompt[1:]])
        e = rms(main["model.embed_tokens.weight"][ids], mtp["mtp.0.enorm.weight"])  # [1, T-1, d]
        h = rms(torch.tensor(np.array(streams[:, :-1])), mtp["mtp.0.hnorm.weight"])  # [1, T-1, n, d]
        x = (e @ mtp["mtp.0.e_proj.weight"].T).unsqueeze(2) + h @ mtp["mtp.0.h_proj.weight"].T
        hook = model.model.layers[0].register_forward_pre_hook(lambda m, args, kw: ((x, *args[1:]), kw),
                                                               with_kwargs=True)
        logits = model(ids).logits[0].numpy()
        hook.remove()
    return logits


MTP_TOLERANCE = 2e-5  # measured 5.9e-6


def test_the_mtp_module_follows_deepseeks_equations(v4_mtp):
    """Our V4 MTP module, given the main model's streams of a prompt, predicts each next-but-one token
    with the logits of DeepSeek's MTPBlock equations (reference_mtp_logits); reading the streams after
    the hc_head's collapse instead, or taking the main model's hc_head, fails by far."""
    folder, mtp = v4_mtp
    (stage,) = load_with_mtp(folder)
    prompt = long_prompt(40, seed=12)
    streams = stage.run_layers(stage.model.embed(mx.array([prompt])))  # [1, T, n, d]: no hash layer ahead
    stage.release([0])
    expected = reference_mtp_logits(folder, mtp, prompt, streams)
    from conftest import assert_far_from_uniform
    assert_far_from_uniform(expected)
    module = stage.mtp
    out = module(stage.model.embed(mx.array([prompt[1:]])), streams[:, :-1], module.make_cache())
    ours = np.array(stage.model.lm_head(module.head_input(out[0])).astype(mx.float32))
    print(f"MTP module against the reference equations: {np.abs(ours - expected).max():.2e}")
    assert np.abs(ours - expected).max() <= MTP_TOLERANCE
    wrong_head = np.array(stage.model.lm_head(module.norm(stage.model.hc_head(out[0]))).astype(mx.float32))
    assert np.abs(wrong_head - expected).max() > 100 * MTP_TOLERANCE
    collapsed = mx.broadcast_to(stage.model.hc_head(streams)[:, :, None], streams.shape)
    wrong_input = module(stage.model.embed(mx.array([prompt[1:]])), collapsed[:, :-1], module.make_cache())
    wrong_input = np.array(stage.model.lm_head(module.head_input(wrong_input[0])).astype(mx.float32))
    assert np.abs(wrong_input - expected).max() > 100 * MTP_TOLERANCE


@pytest.mark.parametrize("right", [0, 3])
def test_mtp_drafting_gives_plain_greedy_tokens(v4_mtp, right):
    """generate with V4's MTP drafter: plain greedy's tokens, its drafts as the module makes them
    (right=0: on this random model they are mostly rejected, which proves nothing about acceptance)
    or replaced by the known continuation while the module runs and keeps its cache (right=3: every
    draft accepted, the same tokens)."""
    from test_mtp import Recording
    from pipeline.runtime.speculative import MtpDrafter

    folder, _ = v4_mtp
    (stage,) = load_with_mtp(folder)
    prompt = long_prompt(45, seed=4)
    plain = generate_with(stage, folder, prompt, 30)
    recording = Recording(MtpDrafter(stage.mtp, stage.model, 3), plain.tokens, len(prompt), right)
    drafted = generate_with(stage, folder, prompt, 30, recording)
    assert drafted.tokens == plain.tokens
    stats = drafted.draft
    assert stats.drafted > 0 and len(recording.rounds) >= 5
    if right:
        assert stats.accepted == stats.drafted and stats.trips <= 30 // 4 + 1
    print(f"MTP drafts accepted on the random model: {stats.accepted}/{stats.drafted}")


def test_generate_with_mtp_on_two_ranks_equals_plain(v4_mtp):
    """`generate --draft mtp` on 2 ranks: the text of `--draft none`."""
    folder, _ = v4_mtp
    args = ["generate", "--model", str(folder), "--no-chat-template", "--prompt", TEXT, "--max-tokens", "16",
            "--split", "2,3"]
    plain = mpiexec(2, *args, env={"OPENBLAS_NUM_THREADS": "1"})
    drafted = mpiexec(2, *args, "--draft", "mtp", env={"OPENBLAS_NUM_THREADS": "1"})
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout


def test_batch_with_mtp_on_two_ranks_equals_batch_without(v4_mtp, tmp_path):
    """`batch --draft mtp` on 2 ranks (the scheduler's MTP path: every prompt position's streams to
    the drafter, verify trips, rewinds on both ranks): the texts of `--draft none`."""
    folder, _ = v4_mtp
    prompts = [TEXT, "The capital of France is Paris.", "def hello(world):\n    return 42\n" * 2]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": 12}) + "\n" for i, p in enumerate(prompts)))
    texts = []
    for draft in ("none", "mtp"):
        out = tmp_path / f"{draft}.jsonl"
        result = mpiexec(2, "batch", "--model", str(folder), "--input", str(inp), "--output", str(out),
                         "--no-chat-template", "--split", "2,3", "--draft", draft, env={"OPENBLAS_NUM_THREADS": "1"},
                         timeout=180)
        assert result.returncode == 0, result.stderr
        assert (draft == "mtp") == ("speculative: drafted" in result.stderr)  # it drafted (all rejected here)
        texts.append({r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())})
    assert texts[0] == texts[1]
