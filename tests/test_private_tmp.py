"""MLX's compiled CPU kernels go to a folder of ours ($PIPELINE_CACHE/tmp), not the shared /tmp
where another user could have planted a library (pipeline/util/private_tmp.py)."""

from __future__ import annotations

import os

from conftest import mpiexec


def compiled_kernels(root) -> list:
    return sorted(p.name for p in root.rglob("*.so")) if root.exists() else []


def test_compiled_kernels_land_in_the_private_folder(tiny_models, tmp_path):
    shared, cache = tmp_path / "shared-tmp", tmp_path / "cache"
    shared.mkdir()
    env = {"TMPDIR": str(shared), "PIPELINE_CACHE": str(cache), "PIPELINE_QMM": "0", "PIPELINE_BLAS_SHIM": "0"}
    result = mpiexec(2, "generate", "--model", str(tiny_models["llama"]), "--prompt", "Hi", "--max-tokens", "2",
                     "--no-chat-template", env=env)
    assert result.returncode == 0, result.stderr
    assert compiled_kernels(cache / "tmp" / "mlx"), "no compiled kernel in the private folder"
    assert not compiled_kernels(shared), compiled_kernels(shared)
    assert oct(os.stat(cache / "tmp").st_mode & 0o777) == "0o755"
    assert "warning: MLX compiles" not in result.stderr


def test_a_refused_folder_is_a_warning_and_the_job_runs(tiny_models, tmp_path):
    shared, cache = tmp_path / "shared-tmp", tmp_path / "cache"
    shared.mkdir()
    (cache / "tmp").mkdir(parents=True)
    (cache / "tmp").chmod(0o777)  # others may write to it: refused, as the BLAS shim's folder would be
    env = {"TMPDIR": str(shared), "PIPELINE_CACHE": str(cache), "PIPELINE_QMM": "0", "PIPELINE_BLAS_SHIM": "0"}
    result = mpiexec(2, "generate", "--model", str(tiny_models["llama"]), "--prompt", "Hi", "--max-tokens", "2",
                     "--no-chat-template", env=env)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: MLX compiles")]
    assert len(warnings) == 1 and "is refused" in warnings[0] and "every user may write to it" in warnings[0], \
        result.stderr
    assert not compiled_kernels(cache / "tmp")
