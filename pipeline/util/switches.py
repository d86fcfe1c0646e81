"""The environment switches that turn one of pipeline's parts off (PIPELINE_BLAS_SHIM,
PIPELINE_QMM, PIPELINE_ATTENTION, PIPELINE_LAYER_KERNELS, PIPELINE_BIND, PIPELINE_MMAP,
PIPELINE_PMI_ABORT): one spelling of "off"."""

from __future__ import annotations

import os

OFF = ("0", "off", "no", "none")


def turned_off(variable: str) -> bool:
    """Whether `variable` is set to 0, off, no or none (any case, spaces around ignored)."""
    return os.environ.get(variable, "").strip().lower() in OFF
