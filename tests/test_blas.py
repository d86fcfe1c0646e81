"""The optimized BLAS under MLX (blas.py) and --weights-in-memory (weights dequantized at load)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from conftest import REPO, cache_with_builds, mpiexec, openblas_installed

PROMPT = [1, 5, 77, 23, 299, 3, 4, 5, 6, 100, 42, 17]


def clean_env(**extra: str) -> dict:
    """The environment without BLAS thread settings the tests do not expect."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS", "PIPELINE_BLAS", "PIPELINE_BLAS_SHIM")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def run_python(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter (MLX binds its BLAS when first imported) -> its JSON."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPO, env=clean_env(**env))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


needs_openblas = pytest.mark.skipif(not openblas_installed(),
                                    reason="no OpenBLAS installed (apt-get install libopenblas0-pthread)")

MATMUL = """
import json, numpy as np
import pipeline
from pipeline.kernels import blas
import mlx.core as mx
rng = np.random.default_rng(0)
a, b = rng.standard_normal((96, 640), dtype=np.float32), rng.standard_normal((640, 200), dtype=np.float32)
v = rng.standard_normal((1, 640), dtype=np.float32)
ours, vec = np.array(mx.array(a) @ mx.array(b)), np.array(mx.array(v) @ mx.array(b))
err = float(max(np.abs(ours - a @ b).max() / np.abs(a @ b).max(), np.abs(vec - v @ b).max() / np.abs(v @ b).max()))
print(json.dumps({"in_use": blas.in_use(), "describe": blas.describe(), "err": err,
                  "optimized": blas.is_optimized()}))
"""


@needs_openblas
def test_openblas_is_what_mlx_calls_and_matches_numpy():
    out = run_python(MATMUL)
    name = os.path.basename(out["in_use"]).lower()
    assert "openblas" in name or "sgemm-shim" in name, out  # the shim forwards all but 1-row products
    assert out["optimized"] and out["describe"].startswith("OpenBLAS"), out
    assert out["err"] < 1e-5, out


SHIM_CASES = """
import json, numpy as np
import pipeline
import mlx.core as mx
from pipeline.kernels import blas
rng = np.random.default_rng(1)
K, N, M = 300, 200, 150
A1, A1t = rng.standard_normal((1, K), dtype=np.float32), rng.standard_normal((K, 1), dtype=np.float32)
B, Bt = rng.standard_normal((K, N), dtype=np.float32), rng.standard_normal((N, K), dtype=np.float32)
A, At = rng.standard_normal((M, K), dtype=np.float32), rng.standard_normal((K, M), dtype=np.float32)
v, vt = rng.standard_normal((K, 1), dtype=np.float32), rng.standard_normal((1, K), dtype=np.float32)
m = mx.array
cases = [(m(A1) @ m(B), A1 @ B), (m(A1) @ m(Bt).T, A1 @ Bt.T), (m(A1t).T @ m(B), A1t.T @ B),
         (m(A1t).T @ m(Bt).T, A1t.T @ Bt.T), (m(A) @ m(v), A @ v), (m(A) @ m(vt).T, A @ vt.T),
         (m(At).T @ m(v), At.T @ v), (m(At).T @ m(vt).T, At.T @ vt.T),
         (m(A1[None].repeat(3, 0)) @ m(B), A1[None].repeat(3, 0) @ B),
         (mx.addmm(m(A1 @ B), m(A1), m(B), alpha=0.5, beta=2.0), 2.5 * (A1 @ B)), (m(A) @ m(B), A @ B)]
err = max(float(np.abs(np.array(o) - r).max() / np.abs(r).max()) for o, r in cases)
print(json.dumps({"err": err, "describe": blas.describe(), "in_use": blas.in_use()}))
"""


@needs_openblas
def test_products_through_the_shim_are_exact():
    """Every transpose layout of 1-row and 1-column products (the shim's own kernel, or GEMV) and
    ordinary ones against numpy; with the shim and without it."""
    from pipeline.kernels import build

    if not build.c_compiler():
        pytest.skip("no C compiler for the shim")
    out = run_python(SHIM_CASES)
    assert "batch-invariant GEMM <= 64 rows" in out["describe"] and "sgemm-shim" in out["in_use"], out
    assert out["err"] < 1e-5, out
    out = run_python(SHIM_CASES, PIPELINE_BLAS_SHIM="0")
    assert "batch-invariant" not in out["describe"] and "openblas" in out["in_use"].lower(), out
    assert out["err"] < 1e-5, out


def test_opt_out_keeps_the_bundled_blas():
    out = run_python(MATMUL, PIPELINE_BLAS="bundled")
    assert "mlx_cpu.libs" in out["in_use"] or sys.platform != "linux", out
    assert not out["optimized"]
    assert "netlib" in out["describe"] and "PIPELINE_BLAS=bundled" in out["describe"], out
    assert out["err"] < 1e-5, out


def test_mlx_imported_first_is_reported_not_hidden():
    code = "import mlx.core\n" + MATMUL
    out = run_python(code)
    assert not out["optimized"] and "imported before pipeline" in out["describe"], out


def test_importing_pipeline_leaves_mlx_to_the_blas_set_up():
    """`import pipeline` loads the BLAS before anything imports mlx.core: no module it imports may
    import mlx.core at its top (the GGUF converter's writer, then gguf.py, once did, and every rank ran the netlib BLAS)."""
    code = "import sys, pipeline; print('mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_threads_share_the_host_cores(monkeypatch):
    from pipeline.kernels import blas

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(blas, "usable_cores", lambda: 16)
    assert [blas.threads_for(n) for n in (1, 2, 3, 4, 16, 32)] == [16, 8, 5, 4, 1, 1]
    monkeypatch.setattr(blas, "usable_cores", lambda: 1)  # each rank bound to one core
    assert blas.threads_for(2) == 1


@needs_openblas
def test_stats_line_names_the_blas_and_threads(tiny_models):
    args = ("generate", "--model", str(tiny_models["llama"]), "--prompt", "hi", "--max-tokens", "4")
    result = mpiexec(2, *args, env=clean_env())
    assert result.returncode == 0, result.stderr
    (stats,) = [line for line in result.stderr.splitlines() if line.startswith("[pipeline]")]
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert "BLAS OpenBLAS" in stats and f"{threads} thread" in stats and "2 ranks/host" in stats, stats

    result = mpiexec(2, *args, env=clean_env(OPENBLAS_NUM_THREADS="1"))
    assert "1 thread, OPENBLAS_NUM_THREADS" in result.stderr, result.stderr

    result = mpiexec(1, *args, env=clean_env(PIPELINE_BLAS="bundled"))
    assert result.returncode == 0, result.stderr
    assert "BLAS netlib reference BLAS (bundled with mlx) [PIPELINE_BLAS=bundled]" in result.stderr


# ---- --weights-in-memory ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def quantized_models(tiny_models, tmp_path_factory):
    """The tiny llama (own LM head) and qwen3 (tied embeddings) MLX-quantized: 4-bit
    projections and head, 8-bit embedding, fp16 scales, as mlx-community publishes them."""
    from pipeline.checkpoints.safetensors_checkpoint import Checkpoint

    out = {}
    for kind in ("llama", "qwen3"):
        source = tiny_models[kind]
        folder = tmp_path_factory.mktemp(f"q-{kind}")
        tensors = {}
        for name in Checkpoint(source).tensors:
            w = Checkpoint(source).read(name)
            bits = 8 if name == "model.embed_tokens.weight" else 4
            if name.endswith("proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight"):
                q, s, b = mx.quantize(w, group_size=32, bits=bits)
                tensors[name], tensors[name[:-6] + "scales"], tensors[name[:-6] + "biases"] = \
                    q, s.astype(mx.float16), b.astype(mx.float16)
            else:
                tensors[name] = w
        mx.save_safetensors(str(folder / "model.safetensors"), tensors)
        config = json.loads((source / "config.json").read_text())
        config["quantization"] = {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
        (folder / "config.json").write_text(json.dumps(config))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).write_bytes((source / name).read_bytes())
        out[kind] = folder
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_dequantized_weights_compute_the_same(quantized_models, kind):
    import mlx.nn as nn

    from pipeline.models.config import ModelConfig
    from pipeline.runtime.stage import Stage
    from pipeline.planner.weights_bytes import model_bytes_of
    from pipeline.checkpoints.safetensors_checkpoint import Checkpoint

    folder = quantized_models[kind]
    config, checkpoint = ModelConfig.from_folder(folder), Checkpoint(folder)
    stages = {dense: Stage.load(config, checkpoint, (0, 4), has_ends=True, dtype=mx.float32, dense=dense)
              for dense in (False, True)}
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                   for m in stages[True].model.modules())
    assert isinstance(stages[False].model.embed_tokens, nn.QuantizedEmbedding)
    logits = {}
    for dense, stage in stages.items():
        hidden = stage.run_layers(stage.model.embed(mx.array([PROMPT])))
        logits[dense] = np.array(stage.model.logits(hidden))[0]
        # What the planner counts is what the rank holds.
        from mlx.utils import tree_flatten

        held = sum(a.nbytes for _, a in tree_flatten(stage.model.parameters()))
        mb = model_bytes_of(config, folder, dense=dense)
        assert sum(mb.layers) + mb.ends == held
    scale = np.abs(logits[False]).max()
    assert np.abs(logits[True] - logits[False]).max() <= 1e-5 * scale
    assert (logits[True].argmax(-1) == logits[False].argmax(-1)).all()


def test_greedy_identical_quantized_or_dequantized(quantized_models):
    from pipeline.kernels import build

    folder = quantized_models["qwen3"]
    outputs = {}
    for n, mode in ((1, "quantized"), (1, "fp32"), (2, "fp32"), (2, "auto"), (2, "quantized")):
        result = mpiexec(n, "generate", "--model", str(folder), "--prompt", "The capital of France",
                         "--max-tokens", "16", "--no-chat-template", "--weights-in-memory", mode)
        assert result.returncode == 0, result.stderr
        (stats,) = [line for line in result.stderr.splitlines() if line.startswith("[pipeline]")]
        # auto keeps them quantized where pipeline's quantized kernels run (qmm.py), as here when they build
        kept = mode == "quantized" or (mode == "auto" and build.expected())
        assert f"weights {'quantized' if kept else 'fp32'}," in stats, stats
        outputs[n, mode] = result.stdout
    assert len(set(outputs.values())) == 1, outputs


def test_auto_keeps_weights_quantized_where_memory_is_short():
    from pipeline.checkpoints.weights_in_memory import choose_dense

    hosts = ["a", "a", "b"]
    # Host a: 100 free -> 75 usable; quantized 10 + 10; dense extras 40 and 40: only one fits.
    assert choose_dense(hosts, [100, 100, 1000], [10, 10, 10], [50, 50, 50]) == [True, False, True]
    assert choose_dense(hosts, [1000, 1000, 10], [10, 10, 10], [50, 50, 50]) == [True, True, False]


def test_plan_counts_dequantized_weights(quantized_models):
    def weights_line(mode: str) -> str:
        result = subprocess.run([sys.executable, "-m", "pipeline", "plan", "--model", str(quantized_models["llama"]),
                                 "--hosts", "1", "--weights-in-memory", mode], capture_output=True, text=True,
                                timeout=60, cwd=REPO, env=clean_env())
        assert result.returncode == 0, result.stderr
        return next(l for l in result.stdout.splitlines() if l.startswith("weights in memory"))

    quantized, dense = weights_line("quantized"), weights_line("fp32")
    assert "as stored" in quantized and "dequantized to float32" in dense, (quantized, dense)


INVARIANCE = """
import json, numpy as np
import pipeline
import mlx.core as mx
from pipeline.kernels import blas
rng = np.random.default_rng(2)
differ, err = {}, 0.0
for n, k in [(576, 576), (1536, 576), (200, 1000), (37, 13), (4096, 64)]:
    w = mx.array(rng.standard_normal((n, k), dtype=np.float32))
    bias = mx.array(rng.standard_normal((n,), dtype=np.float32))
    x = mx.array(rng.standard_normal((64, k), dtype=np.float32))
    alone = [np.array(x[i:i + 1] @ w.T)[0] for i in range(64)]
    alone_bias = [np.array(mx.addmm(bias, x[i:i + 1], w.T))[0] for i in range(64)]
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    for m in (2, 3, 5, 6, 7, 13, 16, 31, 64):
        for offset in (0, 64 - m):  # the same rows at the top of the call, and lower down
            rows = np.array(x[offset:offset + m] @ w.T)
            with_bias = np.array(mx.addmm(bias, x[offset:offset + m], w.T))
            differ[f"{n}x{k} m{m}+{offset}"] = sum(
                int((rows[i] != alone[offset + i]).any() or (with_bias[i] != alone_bias[offset + i]).any())
                for i in range(m))
            err = max(err, float(np.abs(rows - exact[offset:offset + m]).max() / np.abs(exact).max()))
print(json.dumps({"differ": differ, "err": err, "rows": blas.invariant_rows(), "describe": blas.describe()}))
"""


@needs_openblas
@pytest.mark.parametrize("threads", ["1", "2"])
def test_shim_rounds_each_row_as_alone_whatever_shares_the_call(threads):
    """The batch-invariant kernel: a row's product with w.T (and with a bias) is bit-identical
    whether it is alone or among up to 64 rows, at any place, on 1 or 2 threads (OpenBLAS's own
    kernels are not: checked below, so this test would notice if the shim stopped being used)."""
    from pipeline.kernels import build

    if not build.c_compiler():
        pytest.skip("no C compiler for the shim")
    out = run_python(INVARIANCE, OPENBLAS_NUM_THREADS=threads)
    assert out["rows"] == 64, out
    assert not any(out["differ"].values()), {k: v for k, v in out["differ"].items() if v}
    assert out["err"] < 1e-5, out
    plain = run_python(INVARIANCE, OPENBLAS_NUM_THREADS=threads, PIPELINE_BLAS_SHIM="0")
    assert plain["rows"] == 0 and any(plain["differ"].values()), plain


def _shim_sgemm(path):
    """The shim's cblas_sgemm, loaded on its own (RTLD_LOCAL: MLX keeps the one it has)."""
    import ctypes

    fn = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL).cblas_sgemm
    fp = ctypes.POINTER(ctypes.c_float)
    fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, fp, ctypes.c_int, fp, ctypes.c_int, ctypes.c_float, fp,
                                        ctypes.c_int]

    def x_times_wt(x: np.ndarray, w: np.ndarray, c: np.ndarray, beta: float) -> np.ndarray:
        (m, k), n = x.shape, w.shape[0]
        out = c.copy()
        fn(101, 111, 112, m, n, k, 1.0, x.ctypes.data_as(fp), k, w.ctypes.data_as(fp), k, beta,
           out.ctypes.data_as(fp), n)  # row-major x @ w.T: the batch-invariant kernel's case
        return out

    return x_times_wt


def test_shim_kernel_rounds_the_same_with_or_without_avx512(tmp_path):
    """The AVX-512 tiles (two columns' 8 lanes in one 16-lane register) must give the very bits of
    the 8-lane tiles a CPU without AVX-512 runs, so that a layer rounds the same on either kind of
    node: the shim built both ways, compared over shapes with k and n tails and 1..64 rows."""
    from pipeline.kernels import build

    if not build.c_compiler():
        pytest.skip("no C compiler for the shim")
    if "avx512f" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX-512: both builds would be the same code")
    native, portable = tmp_path / "native.so", tmp_path / "portable.so"
    build.build_shim(native)
    build.build_shim(portable, ("-mno-avx512f",))
    ours, theirs = _shim_sgemm(native), _shim_sgemm(portable)
    rng = np.random.default_rng(3)
    differ = []
    for n, k in [(576, 576), (1536, 576), (200, 1000), (37, 13), (4096, 64), (49, 7), (96, 17), (3, 1)]:
        w = rng.standard_normal((n, k), dtype=np.float32)
        for m in (1, 2, 3, 5, 7, 8, 9, 13, 16, 31, 32, 64):
            x = rng.standard_normal((m, k), dtype=np.float32)
            c = rng.standard_normal((m, n), dtype=np.float32)
            for beta in (0.0, 1.0):
                if not np.array_equal(ours(x, w, c, beta).view(np.uint32), theirs(x, w, c, beta).view(np.uint32)):
                    differ.append((n, k, m, beta))
    assert not differ, differ


LOADED = """
import json
from pipeline.kernels import blas
import mlx.core as mx
print(json.dumps({"shim": blas.load().shim, "rows": blas.invariant_rows(), "problem": blas.problem(),
                  "describe": blas.describe()}))
"""

PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PLANTED_MARK"), "w");
    if (f) fclose(f);
}
"""


def _plant_library(path, mark):
    """A library at the shim's path whose loading would leave the file `mark` behind."""
    from pipeline.kernels import build

    source = path.parent / "planted.c"
    source.write_text(PLANTED)
    subprocess.run([build.c_compiler(), "-shared", "-fPIC", "-o", str(path), str(source)], check=True)
    source.unlink()


@needs_openblas
@pytest.mark.parametrize("case", ["folder writable by all", "folder writable by its group",
                                  "folder above writable by all", "library writable by all",
                                  "library writable by its group", "library of another user"])
def test_shim_refused_where_other_users_can_write(tmp_path, monkeypatch, case):
    """The shim is code every rank runs: a library another user could have written (or a folder in
    which they could swap it) is never loaded; the run says so in one line and falls back to
    per-sequence products. The planted library would leave a mark if it were ever loaded."""
    from pipeline.kernels import build

    if not build.c_compiler():
        pytest.skip("no C compiler for the shim")
    if case == "library of another user" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    cache = tmp_path / "cache"
    monkeypatch.setenv("PIPELINE_CACHE", str(cache))
    shim = build.shim_path()
    shim.parent.mkdir(parents=True, mode=0o755)
    cache.chmod(0o755)
    mark = tmp_path / "planted-library-ran"
    _plant_library(shim, mark)
    shim.chmod(0o755)
    target, mode = {"folder writable by all": (shim.parent, 0o757),
                    "folder writable by its group": (shim.parent, 0o775),
                    "folder above writable by all": (cache, 0o777),
                    "library writable by all": (shim, 0o757),
                    "library writable by its group": (shim, 0o775),
                    "library of another user": (shim, None)}[case]
    if mode is None:
        os.chown(shim, 65534, 65534)
    else:
        target.chmod(mode)
    out = run_python(LOADED, PIPELINE_CACHE=str(cache), PLANTED_MARK=str(mark))
    assert not mark.exists(), "the planted library was loaded"
    assert out["shim"] is None and out["rows"] == 0, out
    shown = target if case != "library of another user" else shim
    assert f"refused {shown}" in out["problem"] and "\n" not in out["problem"], out
    assert ("user id 65534" if mode is None else f"mode {mode:o}") in out["problem"], out
    assert out["describe"].startswith("OpenBLAS") and "batch-invariant" not in out["describe"], out


@needs_openblas
def test_shim_built_into_a_private_folder_whatever_the_umask(tmp_path):
    """A user private group's umask (002) would leave the folders and the library group-writable,
    and so refused next time: they are made writable by their owner only, and the shim loads."""
    from pipeline.kernels import build

    if not build.c_compiler():
        pytest.skip("no C compiler for the shim")
    cache = tmp_path / "fresh" / "cache"
    code = "import os; os.umask(0o002)\n" + LOADED
    for run in ("builds", "loads what it built"):
        out = run_python(code, PIPELINE_CACHE=str(cache))
        assert out["rows"] == 64 and out["problem"] == "", (run, out)
    for place in (tmp_path / "fresh", cache, cache / "blas", *(cache / "blas").iterdir()):
        assert place.stat().st_mode & 0o022 == 0, place


def _job_env(**extra):
    """The tests' environment with PATH cut to the Python and MPI of this venv: no C compiler."""
    return clean_env(PATH=os.path.dirname(sys.executable), **extra)


@needs_openblas
def test_missing_compiler_is_one_warning_with_the_fix(tiny_models, tmp_path):
    """No C compiler: the job runs (products per sequence), rank 0 says so once in one line with
    the fix (and once for the quantized kernels' C++ compiler), and the stats line still names the
    BLAS the ranks use."""
    import shutil

    assert not any(shutil.which(cc, path=os.path.dirname(sys.executable)) for cc in ("cc", "gcc", "clang"))
    apt = tmp_path / "bin"
    apt.mkdir()
    if shutil.which("apt-get"):  # apt-get on the PATH, as on Debian: the fix names the package
        (apt / "apt-get").symlink_to(shutil.which("apt-get"))
    env = _job_env(PIPELINE_CACHE=str(tmp_path / "cache"))
    env["PATH"] += os.pathsep + str(apt)
    result = subprocess.run([os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2", sys.executable,
                             "-m", "pipeline", "generate", "--model", str(tiny_models["llama"]), "--prompt", "hi",
                             "--max-tokens", "2"], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    fix = "apt-get install gcc" if shutil.which("apt-get") else "install a C compiler"
    shim = [line for line in warnings if "no BLAS shim" in line]
    assert len(shim) == 1 and "no C compiler" in shim[0] and fix in shim[0], result.stderr
    kernels = [line for line in warnings if "quantized kernels" in line]
    fix = "apt-get install g++" if shutil.which("apt-get") else "install a C++ compiler"
    assert len(kernels) == 1 and "no C++ compiler" in kernels[0] and fix in kernels[0], result.stderr
    assert len(warnings) == 2, result.stderr
    (stats,) = [line for line in result.stderr.splitlines() if line.startswith("[pipeline]")]
    assert "BLAS OpenBLAS" in stats and "batch-invariant" not in stats, stats


def test_missing_openblas_is_one_warning_with_the_fix(tiny_models, tmp_path):
    """No OpenBLAS (hidden here by mounting an empty folder over each place it is looked for, in a
    mount namespace of this run's own): one warning line with the apt-get line, and the stats line
    names the netlib BLAS MLX then calls."""
    import shutil

    from pipeline.kernels import blas

    if not shutil.which("unshare") or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("hiding OpenBLAS needs a mount namespace (unshare -rm)")
    folders = sorted({os.path.dirname(os.path.realpath(p)) for p in blas.candidates() if os.path.exists(p)})
    if any("openblas" not in os.path.basename(folder) for folder in folders):
        pytest.skip(f"OpenBLAS lies in a folder shared with other libraries ({folders}): it cannot be hidden alone")
    hide = "; ".join(f"mount -t tmpfs none {shlex.quote(folder)}" for folder in folders)
    job = shlex.join(["mpiexec", "-n", "1", sys.executable, "-m", "pipeline", "generate", "--model",
                      str(tiny_models["llama"]), "--prompt", "hi", "--max-tokens", "2"])
    result = subprocess.run(["unshare", "-rm", "sh", "-c", f"{hide}; exec {job}"], capture_output=True, text=True,
                            timeout=120, cwd=REPO,
                            env=clean_env(PIPELINE_CACHE=str(cache_with_builds(tmp_path / "cache"))))  # kernels built
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    fix = "apt-get install libopenblas0-pthread" if shutil.which("apt-get") else "install OpenBLAS"
    assert len(warnings) == 1 and "no OpenBLAS found" in warnings[0] and fix in warnings[0], result.stderr
    (stats,) = [line for line in result.stderr.splitlines() if line.startswith("[pipeline]")]
    assert "netlib" in stats, stats
