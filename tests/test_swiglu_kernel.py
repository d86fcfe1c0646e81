"""pipeline's SwiGLU kernel (layer_kernels.cpp: gate * sigmoid(gate) * up, 16 elements at a time) against MLX's
own results, the truth it replaces: nn.silu(gate) * up, uncompiled (mx.sigmoid and two multiplies, each its own
operation) and compiled (models/layers.py's fallback), bit for bit on ~1e6 gates: every scale, random bit
patterns (huge, denormal, inf, NaN), and the values where MLX's exp is easiest to miss (its floor(x + 0.5) is
summed in double: x * log2(e) just under and over k + 1/2 for every k; |x| around its cut at 88). A NaN is
compared as a NaN (which operand's payload a multiply passes on is the compiler's choice, MLX's too).
Then models: a tiny Llama's logits and SwitchGLU's outputs the same bits with the kernel as without it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import forward, load_stages, long_prompt
from pipeline.kernels import layer_kernels, qmm
from pipeline.models import layers
from pipeline.models.experts import SwitchGLU

F32 = np.float32
LOG2E = F32(1.442695)


def differing(got: mx.array, want: mx.array) -> int:
    """How many elements differ: in their bits, or one a NaN and the other not."""
    g, w = np.array(got), np.array(want)
    assert g.shape == w.shape and g.dtype == w.dtype == F32
    gn, wn = np.isnan(g), np.isnan(w)
    return int((gn != wn).sum() + ((g.view(np.uint32) != w.view(np.uint32)) & ~gn & ~wn).sum())


def neighbours(values, ulps: int) -> np.ndarray:
    """Each value and the `ulps` float32s on either side of it."""
    bits = np.asarray(values, F32).view(np.int32).astype(np.int64)
    steps = np.arange(-ulps, ulps + 1)
    return (bits[:, None] + steps[None, :]).clip(-(2 ** 31), 2 ** 31 - 1).astype(np.int32).view(F32).ravel()


def edge_gates() -> np.ndarray:
    """The values where a Sigmoid other than MLX's shows."""
    info = np.finfo(F32)
    # |g| * log2(e) at k + 1/2 (MLX: floor of the double sum; a float sum would round 0.49999997 up)
    halves = (np.arange(0, 128) + 0.5) / np.float64(LOG2E)
    special = [0.0, -0.0, info.tiny, -info.tiny, info.smallest_subnormal, -info.smallest_subnormal, 1e-40, -1e-40,
               info.max, -info.max, 1e30, -1e30, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0, 0.5, -0.5]
    payloads = np.array([0x7FC00001, 0x7F800001, 0xFFC12345, 0xFF812345], np.uint32).view(F32)  # NaNs, quiet or not
    return np.concatenate([
        neighbours(np.concatenate([halves, -halves]), 40),
        neighbours([88.0, -88.0, 88.0 / np.float64(LOG2E), -88.0 / np.float64(LOG2E), 87.0, -87.0], 300),
        neighbours(special, 3), payloads,
        np.linspace(-100, 100, 20001, dtype=F32),
        np.linspace(-1, 1, 20001, dtype=F32) * info.tiny,  # subnormals
    ]).astype(F32)


def gates_and_ups(n: int = 1_000_000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    edges = edge_gates()
    bits = rng.integers(0, 2 ** 32, 2 ** 17, dtype=np.uint64).astype(np.uint32).view(F32)  # any float32 at all
    rest = n - edges.size - bits.size
    scales = F32(10.0) ** rng.integers(-6, 3, rest).astype(F32)
    gate = np.concatenate([edges, bits, (rng.standard_normal(rest) * scales).astype(F32)])
    up = rng.standard_normal(n).astype(F32) * F32(3)
    some = rng.choice(n, 4000, replace=False)  # ups that overflow, vanish or are not numbers
    up[some] = rng.choice(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e38, 1e-42, 1.0], F32), some.size)
    return gate, up


def mlx_uncompiled(gate: mx.array, up: mx.array) -> mx.array:
    s = mx.sigmoid(gate)
    mx.eval(s)
    h = gate * s
    mx.eval(h)
    return h * up


@pytest.fixture
def kernel(kernels, monkeypatch):
    monkeypatch.delenv(layer_kernels.ENV, raising=False)
    return kernels


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's float64 sigmoid of the edges (the plant)
def test_kernel_has_mlx_bits(kernel):
    """Every gate and up above: the kernel's bits are MLX's, uncompiled and compiled (as the model's
    fallback); an element-at-a-time tail (a length not a multiple of 16) too."""
    g, u = gates_and_ups()
    gate, up = mx.array(g), mx.array(u)
    want = mlx_uncompiled(gate, up)
    assert differing(nn.silu(gate) * up, want) == 0 and differing(layers._compiled_swiglu(gate, up), want) == 0
    got = kernel.swiglu(gate, up)
    assert differing(got, want) == 0
    assert differing(layers.swiglu(gate, up), want) == 0
    for n in (1, 7, 15, 17, 33, 4099):  # the tail past the last 16
        assert differing(kernel.swiglu(gate[-n:], up[-n:]), want[-n:]) == 0
    # a plant of the test's own: a sigmoid rounded otherwise (float64, once) is told apart on many values
    other = (g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u).astype(F32)
    assert differing(mx.array(other), want) > 10_000


def test_shapes_strides_threads_and_donation(kernel):
    """Any shape; views (a transpose, a slice) as their values; many elements over 2 threads; a temporary gate
    whose buffer the kernel writes into: each element as MLX computes it alone."""
    g, u = gates_and_ups(300_000, seed=1)
    gate, up = mx.array(g[:288_000]).reshape(3, 96_000), mx.array(u[:288_000]).reshape(3, 96_000)
    try:
        for threads in (1, 2):
            qmm.set_threads(threads)
            assert differing(kernel.swiglu(gate, up), mlx_uncompiled(gate, up)) == 0
    finally:
        qmm.set_threads()
    t_gate, t_up = gate.reshape(96, 3000).T, up.reshape(96, 3000).T  # [3000, 96], not row-contiguous
    assert differing(kernel.swiglu(t_gate, t_up), mlx_uncompiled(t_gate, t_up)) == 0
    s_gate, s_up = gate[:, 5:1000:3], up[:, 7:1002:3]
    assert differing(kernel.swiglu(s_gate, s_up), mlx_uncompiled(s_gate, s_up)) == 0
    temporary = kernel.swiglu(gate * 1.5, up)  # the gate's buffer is the output's
    assert differing(temporary, mlx_uncompiled(gate * 1.5, up)) == 0
    assert differing(kernel.swiglu(mx.array(g[:5]).reshape(5, 1, 1), mx.array(u[:5]).reshape(5, 1, 1)),
                     mlx_uncompiled(mx.array(g[:5]), mx.array(u[:5])).reshape(5, 1, 1)) == 0


def test_refusals_and_fallbacks(kernel, monkeypatch):
    """The kernel takes float32 gate and up of one shape; layers.swiglu sends the rest to MLX's compiled one."""
    gate = mx.array(np.linspace(-9, 9, 64, dtype=F32))
    for bad in (gate.astype(mx.bfloat16), gate[:32]):
        with pytest.raises(ValueError, match="float32 gate and up of one shape"):
            kernel.swiglu(gate, bad)
        assert layer_kernels.swiglu(gate, bad) is None
    half = gate.astype(mx.bfloat16)
    assert mx.array_equal(layers.swiglu(half, half), nn.silu(half) * half).item()
    assert layers.swiglu(half, half).dtype == mx.bfloat16
    monkeypatch.setenv(layer_kernels.ENV, "0")
    assert layer_kernels.swiglu(gate, gate) is None


def calls_of_the_kernel(monkeypatch) -> list:
    """layer_kernels.swiglu counted: the list grows by one per call the kernel takes."""
    calls, original = [], layer_kernels.swiglu

    def counted(gate, up):
        out = original(gate, up)
        if out is not None:
            calls.append(gate.shape)
        return out

    monkeypatch.setattr(layer_kernels, "swiglu", counted)
    return calls


def test_model_logits_unchanged(kernel, tiny_models, monkeypatch):
    """A tiny Llama (float32, 4 layers) over a prompt and then one token at a time: the same logits, bit for
    bit, with the SwiGLU kernel as with MLX's compiled SwiGLU."""
    prompt = long_prompt(40)

    def run() -> np.ndarray:  # fresh stages (their caches hold what a run appended)
        stages = load_stages(tiny_models["llama"], ((0, 2), (2, 4)))
        logits = [forward(stages, prompt[:32])]
        logits += [forward(stages, [token]) for token in prompt[32:]]
        return np.concatenate(logits)

    calls = calls_of_the_kernel(monkeypatch)
    ours = run()
    assert len(calls) == 4 * 9
    monkeypatch.setattr(layer_kernels, "swiglu", lambda gate, up: None)
    theirs = run()
    assert np.array_equal(ours, theirs)
    assert ours.shape == (40, 384) and np.abs(ours).max() > 1  # not all zero or tiny


def test_switch_glu_unchanged(kernel, monkeypatch):
    """SwitchGLU's activation (float experts, sorted and unsorted routing): the same outputs with the kernel."""
    rng = np.random.default_rng(2)
    block = SwitchGLU(64, 96, 8)
    block.update({name: {"weight": mx.array(rng.normal(0, 0.3, p["weight"].shape).astype(F32))}
                  for name, p in block.children().items()})
    for tokens in (3, 40):  # 40 * 2 pairs: sorted by expert
        x = mx.array(rng.normal(0, 2, (tokens, 64)).astype(F32))
        indices = mx.array(rng.integers(0, 8, (tokens, 2)).astype(np.int32))
        with monkeypatch.context() as patch:
            calls = calls_of_the_kernel(patch)
            ours = block(x, indices)
            mx.eval(ours)
            assert len(calls) == 1
            patch.setattr(layer_kernels, "swiglu", lambda gate, up: None)
            assert differing(ours, block(x, indices)) == 0
