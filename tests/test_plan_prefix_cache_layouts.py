"""`plan`'s layouts table (stages x T) counts --prefix-cache-gb as its main fit does (issue 36): the budget
in each rank's memory, and each live sequence's resume points (Qwen3.5's linear states at up to 8 prompt
chunks' ends, kept only with a prefix cache) in its KV cache; a layout that no longer fits is marked so."""

from __future__ import annotations

import math

import pytest

from pipeline.commands.plan import add_parser, run
from pipeline.planner.cluster_costs import TERM_SETS
from pipeline.planner.config_files import load_config
from pipeline.planner.layouts import plan_layouts
from pipeline.planner.memory import POINTS_MAX, GIB
from pipeline.planner.shapes import architecture, qwen3_5_layer_types
from pipeline.planner.speed import Hardware, plan_cluster
from pipeline.planner.stored_formats import checkpoint_format
from pipeline.planner.weights_bytes import Precision
from pipeline.util.errors import UserError

# One linear layer's state of Qwen3.5-397B-A17B by hand: 64 value heads x 128 x 128 float32 memory +
# (4 - 1) x (2 x 16 x 128 + 64 x 128) bfloat16 convolution inputs (test_plan_linear_states.py).
STATE = 64 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 64 * 128) * 2
BATCH, GB = 16, 8


def _layouts(gb: float, memory: list[float], dtype: str = "bfloat16"):
    config = load_config("Qwen3.5-397B-A17B")
    precision = Precision(checkpoint_format(config, None, 4, 64), dtype, 4, 64)
    host, link = TERM_SETS["m3-ultra-rdma"]
    return plan_layouts(architecture(config), precision, [819.0] * 4, memory, host, link, 8192, BATCH,
                        prefix_cache_gb=gb)


def test_points_max_is_the_runtimes():
    pytest.importorskip("mlx.core")
    from pipeline.models.cache import LinearAttentionState

    assert POINTS_MAX == LinearAttentionState.points_max


def test_every_layouts_ranks_count_the_budget_and_each_sequences_resume_points():
    """--prefix-cache-gb 8 on 2 x 512 + 2 x 256 GiB: each rank of every layout holds 8 GB (7.45 GiB) more,
    plus 16 sequences x 8 points x its linear layers' states (its share of the 64 value heads under T);
    weights and the layer split unchanged."""
    memory = [512.0, 512.0, 256.0, 256.0]
    linear = [kind == "linear_attention" for kind in qwen3_5_layer_types(load_config("Qwen3.5-397B-A17B"))]
    for plain, served in zip(_layouts(0, memory), _layouts(GB, memory)):
        assert (plain.stages, plain.tensor_parallel, plain.counts) == (served.stages, served.tensor_parallel,
                                                                       served.counts)
        share = math.ceil(64 / plain.tensor_parallel) / 64
        start = 0
        for count, a, b in zip(plain.counts, plain.ranks, served.ranks):
            points = BATCH * POINTS_MAX * sum(linear[start:start + count]) * STATE * share
            assert b.prefix_cache == GB * 10**9 and b.weights == a.weights
            assert abs(b.kv_cache - a.kv_cache - points) <= count  # (rounded per layer)
            assert abs(b.total - a.total - GB * 10**9 - points) <= count
            print(f"{plain.name}: +{(b.total - a.total) / GIB:.2f} GiB per rank ({GB * 1e9 / GIB:.2f} budget + "
                  f"{points / GIB:.2f} points)")
            start += count


def test_a_layout_the_budget_pushes_over_its_memory_is_marked_and_refused():
    """On 4 x 78 GiB (float32, plan's default --dtype), tensor 1 x 4 holds 66.8 GiB per rank without a
    prefix cache and 80.1 GiB with 8 GB: NO in the table, and `plan --tensor-parallel 4` refuses it in one
    line; the pipeline and hybrid layouts (74.6, 74.4 GiB) still fit."""
    plain, served = _layouts(0, [78.0] * 4, "float32"), _layouts(GB, [78.0] * 4, "float32")
    assert [lay.fits for lay in plain] == [True, True, True]
    assert [lay.fits for lay in served] == [True, True, False]
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = ["plan", "--model", "Qwen3.5-397B-A17B", "--host-memory", "78,78,78,78", "--quantize", "4",
            "--no-int8-activations", "--tensor-parallel", "4"]
    assert run(parser.parse_args(args)) == 0
    with pytest.raises(UserError, match="does not fit as tensor 1 x 4"):
        run(parser.parse_args(args + ["--prefix-cache-gb", str(GB)]))


def test_the_main_fit_counts_the_resume_points_too():
    """plan's main fit (4 ranks, batch 16): the KV column grows by the same points, the total by the budget too."""
    config = load_config("Qwen3.5-397B-A17B")
    precision = Precision(checkpoint_format(config, None, 4, 64), "bfloat16", 4, 64)
    linear = [kind == "linear_attention" for kind in qwen3_5_layer_types(config)]
    plans = [plan_cluster(config, 4, precision, Hardware([512.0] * 4, [819.0] * 4, prefix_cache_gb=gb), 8192, BATCH)
             for gb in (0, GB)]
    for a, b in zip(*(p.ranks for p in plans)):
        points = BATCH * POINTS_MAX * sum(linear[a.start:a.end]) * STATE
        assert abs(b.kv_bytes - a.kv_bytes - points) <= a.end - a.start
        assert abs(b.needed - a.needed - GB * 10**9 - points) <= a.end - a.start


def test_preflight_counts_a_live_sequences_resume_points_as_a_stage_holds_them(tmp_path):
    """preflight --prefix-cache-gb 1 on the tiny Qwen3.5 (3 linear layers of 6): its KV cache per linear
    layer is what a loaded stage keeping points holds for one sequence whose 10-chunk prompt kept 8 points
    and which then decoded a token (9 states, each LinearAttentionState's nbytes); without the flag, one."""
    import argparse

    import mlx.core as mx

    from conftest import load_stages, long_prompt
    from pipeline.commands.preflight import RankReport, add_parser as add_preflight, measure_model
    from pipeline.models.cache import LinearAttentionState
    from test_qwen3_5_moe import make_qwen3_5_moe

    make_qwen3_5_moe(tmp_path)
    parser = argparse.ArgumentParser()
    add_preflight(parser.add_subparsers())
    kv = {}
    for gb in ("0", "1"):
        args = parser.parse_args(["preflight", "--model", str(tmp_path), "--context", "64", "--prefix-cache-gb", gb])
        report = RankReport(0, "h", "", {}, "", None, None, str(tmp_path))
        measure_model(report, tmp_path, args, int8=False)
        kv[gb] = report.kv_layer_bytes
    (stage,) = load_stages(tmp_path, [(0, 6)])
    stage.model.keep_points = True
    prompt = long_prompt(41, seed=3)
    for start in range(0, 40, 4):  # 10 chunks of 4: a point at each end, the newest replaced past 8
        stage.run_layers(stage.model.embed(mx.array([prompt[start:start + 4]])), [0])
    stage.run_layers(stage.model.embed(mx.array([prompt[40:]])), [0])  # a decoded token: the state moves on
    held = [c.nbytes for c in stage.caches[0]]
    linear = [i for i, c in enumerate(stage.caches[0]) if isinstance(c, LinearAttentionState)]
    assert linear == [0, 3, 4] and all(len(stage.caches[0][i].points) == POINTS_MAX for i in linear)
    assert [kv["1"][i] for i in linear] == [held[i] for i in linear]
    assert [kv["0"][i] * (POINTS_MAX + 1) for i in linear] == [held[i] for i in linear]
