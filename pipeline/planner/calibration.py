"""Fitting cluster_costs.py's terms on its MEASUREMENTS, and each measurement's prediction with them:
tests/test_plan_layouts.py recomputes the fit (the constants must be it) and the errors (each pure
tensor-parallel exo figure within 15%); `plan` prints a matching measurement beside its prediction."""

from __future__ import annotations

import math
from typing import NamedTuple

from .cluster_costs import MEASURED_CONTEXT, MEASURED_DTYPE, MEASUREMENTS, THUNDERBOLT5_RDMA, HostTerms, LinkTerms, \
    Measurement
from .config_files import load_config
from .layouts import plan_layout
from .shapes import architecture
from .stored_formats import checkpoint_format
from .weights_bytes import Precision

M3_ULTRA_GBS = 819.0


def predict(m: Measurement, host: HostTerms, link: LinkTerms = THUNDERBOLT5_RDMA) -> float:
    """Single-stream tok/s the layouts model gives for measurement m's run."""
    config = load_config(m.model)
    precision = Precision(checkpoint_format(config, None, m.quantize, m.group_size), MEASURED_DTYPE, m.quantize,
                          m.group_size, mla_kv_b_float=False)  # exo's mlx-lm and llama.cpp keep MLA's kv_b quantized
    memory = [float(g) for g in m.host_memory]
    return plan_layout(architecture(config), precision, m.tensor_parallel, [M3_ULTRA_GBS] * len(memory), memory,
                       host, link, MEASURED_CONTEXT, batch=1).single_tps


class Fit(NamedTuple):
    bandwidth_fraction: float
    link_fraction: float


def fit(name: str = "fitted", link: LinkTerms = THUNDERBOLT5_RDMA, sums_role: str = "sum") -> Fit:
    """bandwidth_fraction: the geometric mean of measured / roofline over the one-node figures;
    link_fraction: the value (by bisection) that makes the one "sum" figure exact with it."""
    roofline = HostTerms("roofline", 1.0, 1.0)
    ratios = [m.tps / predict(m, roofline, link) for m in MEASUREMENTS if m.role == "fraction"]
    fraction = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    target = next(m for m in MEASUREMENTS if m.role == sums_role)
    low, high = 1e-4, 1.0  # a smaller link fraction: slower sums, fewer tok/s
    for _ in range(60):
        mid = math.sqrt(low * high)
        if predict(target, HostTerms(name, fraction, mid), link) > target.tps:
            high = mid
        else:
            low = mid
    return Fit(fraction, math.sqrt(low * high))


def known_measurement(model: str, host_memory: list[float] | None, quantize: int | None,
                      tensor_parallel: int) -> Measurement | None:
    """The published figure of this very run (model, hosts' memory, bits, T), if there is one."""
    if host_memory is None:
        return None
    for m in MEASUREMENTS:
        if (m.model.lower() == model.lower() and tuple(host_memory) == m.host_memory and m.quantize == quantize
                and m.tensor_parallel == tensor_parallel):
            return m
    return None
