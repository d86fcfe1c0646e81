"""The planner's count of Qwen3.5's linear-attention states (issue 36 item 2): what one sequence keeps
per Gated DeltaNet layer whatever its length (the recurrent memory, in float32 whatever --dtype, and the
convolution's last kernel - 1 inputs, in --dtype), against what a loaded Stage's caches hold
(LinearAttentionState.nbytes) and a hand computation from the 397B config; and the prefix cache's
budget (--prefix-cache-gb) in `plan`'s memory per rank."""

from __future__ import annotations

import mlx.core as mx
import pytest

from conftest import load_stages, long_prompt
from pipeline.models.cache import LinearAttentionState
from pipeline.models.config import ModelConfig
from pipeline.planner.config_files import load_config
from pipeline.planner.memory import POINTS_MAX, kv_layer_bytes
from pipeline.planner.report import format_plan
from pipeline.planner.shapes import architecture
from pipeline.planner.speed import Hardware, plan_cluster
from pipeline.planner.weights_bytes import Precision
from pipeline.planner.stored_formats import checkpoint_format
from test_qwen3_5_moe import make_qwen3_5_moe

MIB = 2**20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_plan_states")
    make_qwen3_5_moe(folder)
    return folder


def _held(stage) -> int:
    """Bytes the stage's linear-attention states hold, every sequence together."""
    return sum(c.nbytes for caches in stage.caches.values() for c in caches if isinstance(c, LinearAttentionState))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_per_sequence_state_bytes_are_what_a_stage_holds(tiny, dtype):
    """One and two sequences (of 9 and 23 tokens: a state does not grow) through the 6 layers (3 linear,
    3 full attention): the planner's bytes of the linear layers equal the stage's LinearAttentionStates'
    nbytes, in bfloat16 (recurrent memory float32, convolution window bfloat16) and float32."""
    (stage,) = load_stages(tiny, [(0, 6)], dtype=getattr(mx, dtype))
    arch = architecture(ModelConfig.from_folder(tiny))
    linear = [i for i, c in enumerate(arch.kv_layers) if c.kind == "linear_attention"]
    assert linear == [0, 3, 4]
    dtype_bytes = getattr(mx, dtype).size
    for seq, n in ((0, 9), (1, 23)):
        hidden = stage.model.embed(mx.array([long_prompt(n, seed=seq)]))
        stage.run_layers(hidden, [seq])
        sequences = seq + 1
        planned = kv_layer_bytes(arch, dtype_bytes, n, sequences)
        assert sum(planned[i] for i in linear) == _held(stage), (sequences, dtype)
        assert arch.linear_state_bytes(0, 6, dtype_bytes) * sequences == _held(stage)
    # by hand: 4 value heads x 16 x 16 float32, (4 - 1) x (2 x 2 x 16 + 4 x 16) convolution values in --dtype
    assert _held(stage) == 2 * 3 * (4 * 16 * 16 * 4 + 3 * (2 * 2 * 16 + 4 * 16) * dtype_bytes)
    stage.release([0, 1])


def test_the_397b_figure_by_hand():
    """Qwen3.5-397B-A17B: 45 linear layers, each 64 value heads x 128 x 128 float32 + (4 - 1) x
    (2 x 16 x 128 + 64 x 128) bfloat16 convolution values per sequence; 15 full-attention layers of
    2 KV heads x 256 keys+values per token."""
    config = load_config("Qwen3.5-397B-A17B")
    r = config.raw
    assert (r["linear_num_value_heads"], r["linear_key_head_dim"], r["linear_value_head_dim"],
            r["linear_num_key_heads"], r["linear_conv_kernel_dim"]) == (64, 128, 128, 16, 4)
    arch = architecture(config)
    per_layer = 64 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 64 * 128) * 2  # 4,268,032 B: 4.07 MiB
    assert arch.linear_state_bytes(0, 60, 2) == 45 * per_layer
    context, batch = 1000, 3
    full = 2 * 2 * 256 * 2 * context  # keys + values, bfloat16
    assert sum(kv_layer_bytes(arch, 2, context, batch)) == batch * (45 * per_layer + 15 * full)


def _plan(name: str, gb: float = 0.0, dtype: str = "bfloat16", hosts: int = 2):
    config = load_config(name)
    precision = Precision(checkpoint_format(config, None, 4, 64), dtype, 4, 64)
    hardware = Hardware([512.0] * hosts, [819.0] * hosts, prefix_cache_gb=gb)
    return plan_cluster(config, hosts, precision, hardware, 8192, 2)


def test_plan_counts_the_prefix_cache_and_names_a_kept_point():
    """--prefix-cache-gb 4: each rank's memory counts 4 GB more, and its KV cache each live sequence's
    resume points (up to 8, kept only with a prefix cache); the 397B's line names a kept point's size on
    the rank with the most linear layers (23 of the 45 on 2 ranks: 23 x 4.07 MiB)."""
    without, served = _plan("Qwen3.5-397B-A17B"), _plan("Qwen3.5-397B-A17B", 4)
    for a, b in zip(without.ranks, served.ranks):
        # and each of the 2 live sequences' resume points (up to 8, kept only with a prefix cache) in its KV cache
        points = 2 * POINTS_MAX * served.arch.linear_state_bytes(a.start, a.end, 2)
        assert b.needed - a.needed == 4 * 10**9 + points and b.kv_bytes - a.kv_bytes == points
    text = format_plan(served, "Qwen3.5-397B-A17B")
    point = 23 * (64 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 64 * 128) * 2)
    assert f"a kept point: {point / MIB:.1f} MiB per rank (linear states of 23 layers" in text
    assert "up to 4 GB per rank" in text
    # a family without linear states and without the flag: no line
    assert "prefix cache" not in format_plan(_plan("Qwen3-235B-A22B"), "Qwen3-235B-A22B")


def test_a_decode_step_reads_the_state_as_held():
    """The roofline reads a linear layer's whole state per step: its recurrent memory at 4 bytes in
    bfloat16 too (4.07 MiB a layer of the 397B), a full-attention layer's keys and values in bfloat16."""
    arch = architecture(load_config("Qwen3.5-397B-A17B"))
    per_layer = 64 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 64 * 128) * 2
    assert arch.kv_read_bytes(0, 10, 2) == arch.kv_read_bytes(0, 100_000, 2) == per_layer
    assert arch.kv_read_bytes(3, 1000, 2) == 2 * 2 * 256 * 1000 * 2


def test_preflight_counts_the_prefix_cache_in_a_slices_need():
    """preflight --prefix-cache-gb 4: each rank's slice needs 4 GB more (+10%), named in the problem line."""
    from test_preflight import report

    from pipeline.commands.preflight import evaluate

    plain = [report(0, 512 * 2**30), report(1, 223 * 2**30)]
    _, problems = evaluate(plain, split=None)
    assert problems == []  # layers 2-3: weights 200 GiB + KV cache 2 GiB, +10%: 222.2 GiB of 223
    served = [report(0, 512 * 2**30, prefix_cache=4 * 10**9), report(1, 223 * 2**30, prefix_cache=4 * 10**9)]
    _, problems = evaluate(served, split=None)
    assert problems == ["rank 1 (studio-2): its slice (layers 2-3) needs 226.3 GiB (weights 200.0 GiB fp32 + KV "
                        "cache 2.0 GiB + prefix cache 3.7 GiB, +10%) but only 223.0 GiB of memory is free: add a "
                        "host, or move layers off it with --split"]
