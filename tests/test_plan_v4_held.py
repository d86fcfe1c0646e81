"""What a DeepSeek V4 sequence's caches hold, as plan and preflight count it (planner/shapes.py `_v4_kept`):
besides what a decode step reads (the window, compressed entries, open compressions), each layer's cache
keeps its state every `reuse_stride` positions (a window of keys, CSA's overlap halves) and the logs of its
last calls (LOG_LIMIT positions: each call's window and keys, its series' raw projections). Checked against
the tiny model's loaded caches (CompressedCache.nbytes, itself checked against a walk of every array in
tests/test_prefix_cache_budget.py), a prompt in two chunks then 70 decoded tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest

from conftest import load_stages, long_prompt
from pipeline.models import deepseek_v4 as V
from pipeline.models.config import ModelConfig
from pipeline.planner.config_files import load_config
from pipeline.planner.shapes import V4_LOG_LIMIT, architecture, v4_reuse_stride
from test_deepseek_v4 import make_deepseek_v4


def test_the_planners_constants_are_the_models():
    assert V4_LOG_LIMIT == V.LOG_LIMIT
    for name in ("DeepSeek-V4-Flash", "DeepSeek-V4-Pro"):
        config = load_config(name)
        assert v4_reuse_stride(config) == V.reuse_stride(config) == 512


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan_v4_held")
    make_deepseek_v4(folder)
    return folder


def test_the_plan_bounds_what_each_layer_holds_and_meets_it_once_the_logs_are_full(v4):
    """At every decoded token, each layer's cache holds at most the planner's bytes for that many positions;
    once 64 single-token calls fill the logs, within 3% of them (sliding, CSA, HCA layers alike). Without the
    kept points and logs the planner counted 10-80 times less than these caches hold."""
    (stage,) = load_stages(v4, [(0, 5)])
    config = ModelConfig.from_folder(v4)
    arch = architecture(config)
    assert v4_reuse_stride(config) == V.reuse_stride(config) == 32
    tokens = long_prompt(170, seed=1)
    run = lambda ids: stage.run_layers(stage.model.embed(mx.array([ids])), [1])  # noqa: E731
    run(tokens[:50])
    run(tokens[50:100])
    worst_under = 0.0
    for n in range(101, 171):
        run(tokens[n - 1:n])
        for layer, cache in enumerate(stage.caches[1]):
            planned = arch.kv_bytes(layer, layer + 1, n, 4)
            assert cache.nbytes <= planned, (n, layer, cache.kind)
            if n >= 100 + V4_LOG_LIMIT:
                assert cache.nbytes >= 0.97 * planned, (n, layer, cache.kind, cache.nbytes / planned)
                c = arch.kv_layers[layer]
                worst_under = max(worst_under, cache.nbytes / ((c.per_token * n + c.per_sequence) * 4))
    print(f"the read-only count was up to {worst_under:.0f}x under")
    assert worst_under > 10
    stage.release([1])
