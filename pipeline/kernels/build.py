"""Builds, caches and loads pipeline's compiled parts: the BLAS shim (blas_shim.c, a C library that
blas.py loads with ctypes) and the kernels' extension (qmm_kernels.cpp and the sources compiled with
it, a nanobind module that qmm.py, attention.py, layer_kernels.py, requantize.py and mapped_files.py
call). `pip install .` builds nothing: at first use the system's compiler builds each part once per
machine, into $PIPELINE_CACHE/<part>/ under a name keyed by what went into it (sources, CPU, flags
and, for the extension, MLX, nanobind and Python), so a cache shared by unlike nodes keeps one build
each. Both go through one path (`ready_library`): the folder is made private, a folder or file
another user may write to is never loaded (the library is code this process runs), and ranks of one
host build once, under a lock, each publishing a whole file (an atomic rename).

The extension. It takes and returns `mx.array`, so it is a nanobind module like `mlx.core` itself,
built against the same nanobind ABI and domain ("mlx"): nanobind's type registry is then shared, and
an `mx.array` passes in and out as the very C++ object. The system C++ compiler compiles it with
nanobind's sources (the `nanobind` package, a dependency) against MLX's headers and libmlx.so (about
20 s, -march=native). The module refuses to start under an MLX other than the one it was built for
(one line). Without a compiler, with the build or a check failing, or with `PIPELINE_QMM=0`, there
is no extension and every caller runs MLX's kernels (the stats line says why: qmm.describe()).

This module loads no MLX when imported: the planner asks `int8_by_default` and `expected` before
anything loads MLX (`pipeline plan` reads config.json only), and blas.py builds the shim before
mlx.core loads, which it must (see blas.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..util import private_folder
from ..util.paths import cache_root
from ..util.switches import turned_off


class NotBuilt(Exception):
    """Why a compiled part could not be built or loaded, in a phrase; `fix`: what the user can do."""

    def __init__(self, why: str, fix: str = ""):
        super().__init__(why)
        self.fix = fix


# ---- what every compiled part goes through ---------------------------------------------------

def cpu_signature() -> str:
    """The CPU the parts are built for (-march=native): a cache shared by unlike nodes keeps one each."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return os.uname().machine


def install_hint(debian_package: str, what: str) -> str:
    """How to install something: the apt-get line where apt exists, else what to install."""
    if shutil.which("apt-get"):
        return f"{'' if os.geteuid() == 0 else 'sudo '}apt-get install {debian_package}"
    return f"install {what} with your system's package manager"


def c_compiler() -> str | None:
    """The C compiler the shim is built with: $CC, else cc, gcc or clang on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cxx_compiler() -> str | None:
    """The C++ compiler the extension is built with: $CXX, else c++, g++ or clang++ on the PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def cached_file(part: str, stem: str, key: bytes, suffix: str) -> Path:
    """$PIPELINE_CACHE/<part>/<stem>-<digest of key><suffix>: a new key (a changed source, CPU, flag...)
    is a new file, built once; files of other keys stay for the nodes that use them."""
    return cache_root() / part / f"{stem}-{hashlib.sha256(key).hexdigest()[:12]}{suffix}"


def compile_library(path: Path, compiler: str, attempts: list[list[str]], what: str, timeout: int) -> None:
    """Compile a shared library into `path` with the first of `attempts` (the compiler's arguments, less
    `-o`) that succeeds, or raise NotBuilt saying why, naming `what` was compiled."""
    errors = ""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            for arguments in attempts:
                result = subprocess.run([compiler, *arguments, "-o", str(out)], capture_output=True, timeout=timeout)
                if result.returncode == 0:
                    out.chmod(0o755)  # whatever the umask: a library others may write to would be refused
                    os.replace(out, path)  # atomic: ranks building at once each publish a whole file
                    return
                errors = errors or result.stderr.decode(errors="replace") or f"exit status {result.returncode}"
    except (OSError, subprocess.SubprocessError) as e:
        raise NotBuilt(f"cannot build it in {path.parent}: {e}") from None
    first = next((line.strip() for line in errors.splitlines() if "error" in line), "") or errors.strip()[:200]
    raise NotBuilt(f"{Path(compiler).name} could not compile {what}: {first}")


_REBUILT = "delete it; it is rebuilt on the next run"


def ready_library(path: Path, build: Callable[[Path], None] | None) -> Path:
    """The real path of the library `path`, safe to load: built by `build` where nothing is there yet
    (None: never), in a folder and a file that no other user may write to. NotBuilt says why not."""
    try:
        private_folder.make_private_folder(path.parent)
    except OSError as e:
        raise NotBuilt(f"cannot create {path.parent}: {e.strerror}",
                       "set PIPELINE_CACHE to a folder of yours") from None
    # Checked, built and loaded through the real path: a link above it cannot point elsewhere later.
    path = Path(os.path.realpath(path.parent)) / path.name
    unsafe = private_folder.unsafe_folder(path.parent)
    if unsafe:
        raise NotBuilt(f"refused {unsafe}", "chmod go-w that folder, or set PIPELINE_CACHE to a folder of yours")
    if build is not None and not os.path.lexists(path):
        # ranks of one host build it once; the lock, like all in the folder, writable by its owner alone
        try:
            lock = os.open(path.parent / ".build-lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise NotBuilt(f"cannot build it in {path.parent}: {e}", "set PIPELINE_CACHE to a folder of yours") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.lexists(path):
                build(path)
        finally:
            os.close(lock)
    try:
        st = os.lstat(path)
    except OSError as e:
        raise NotBuilt(f"{path}: {e.strerror}", _REBUILT) from None
    why = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else private_folder.writable_by_others(st)
    if why:
        raise NotBuilt(f"refused {path}: {why}", _REBUILT)
    return path


# ---- the BLAS shim (blas_shim.c; loaded by blas.py) --------------------------------------------

SHIM_SOURCE = Path(__file__).with_name("blas_shim.c")
# Tried in order: OpenMP spreads the batch-invariant kernel over the BLAS's threads; -march=native
# gives it FMA and wide vectors. -ffp-contract=off: the compiler must not fuse some multiply-adds and
# not others, or a row's rounding would depend on which tile computed it.
SHIM_FLAGS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])


def shim_path() -> Path:
    """Where this machine's shim lives: keyed by its source and the CPU."""
    return cached_file("blas", f"sgemm-shim-{os.uname().machine}", SHIM_SOURCE.read_bytes() + cpu_signature().encode(),
                       ".so")


def build_shim(path: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Compile the shim into `path` (about a second), or raise NotBuilt saying why not, with the fix.
    extra_flags: e.g. ("-mno-avx512f",) builds the variant a CPU without AVX-512 gets (tests)."""
    compiler = c_compiler()
    if not compiler:
        raise NotBuilt("no C compiler", install_hint("gcc", "a C compiler"))
    attempts = [[*flags, *extra_flags, "-ffp-contract=off", "-shared", "-fPIC", str(SHIM_SOURCE), "-ldl"]
                for flags in SHIM_FLAGS]
    try:
        compile_library(path, compiler, attempts, "it", timeout=120)
    except NotBuilt as e:
        raise NotBuilt(str(e), "check that the C compiler builds a shared library, or "
                       + install_hint("gcc", "a C compiler")) from None


# ---- the kernels' extension (qmm_kernels.cpp and the sources compiled with it) -----------------

KERNELS_ENV = "PIPELINE_QMM"
SOURCE = Path(__file__).with_name("qmm_kernels.cpp")
# compiled with it into the one extension: the attention (attention.py), RMSNorm and RoPE (layer_kernels.py),
# re-quantization at load (requantize.py), int8 products (--int8-activations, checkpoints/int8_repack.py),
# weight files mapped without a copy (mapped_files.py), GGUF tensors in their own blocks (qmm.py's gguf_matmul)
SOURCES = (SOURCE, SOURCE.with_name("attention_kernels.cpp"), SOURCE.with_name("layer_kernels.cpp"),
           SOURCE.with_name("requantize_kernels.cpp"), SOURCE.with_name("int8_kernels.cpp"),
           SOURCE.with_name("mapped_files.cpp"), SOURCE.with_name("gguf_kernels.cpp"),
           SOURCE.with_name("gguf_iquant_kernels.cpp"))
SOURCES += (SOURCE.with_name("gguf_kquant_kernels.cpp"),)  # GGUF K-quants and ternary types in their own blocks
SOURCES += (SOURCE.with_name("gguf_q5_kernels.cpp"),)  # GGUF Q5_0 / Q5_1 int8 products (qmm.py gguf_q5_matmul)
SOURCES += (SOURCE.with_name("group_sum_kernels.cpp"),)  # --tensor-parallel's group sum in the graph (group_sum.py)
HEADERS = (SOURCE.with_name("kernels_common.h"), SOURCE.with_name("iquant_grids.h"))
MODULE = "pipeline_qmm"
NB_DOMAIN = "mlx"  # mlx.core's nanobind domain: types are shared only within one domain
# -ffp-contract=off: the compiler must not fuse some multiply-adds and not others (see qmm_kernels.cpp).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++20", "-fvisibility=hidden", "-shared",
         "-fPIC")


@dataclass
class KernelsState:
    module: object = None  # the loaded extension, or None: MLX's kernels
    path: str = ""
    why_not: str = ""  # why MLX's kernels run (opted out, no compiler, refused, ...)
    threads: int = 0  # set by qmm.set_threads
    gguf_int8: bool | None = None  # qmm.gguf_int8, decided once
    used: dict = field(default_factory=lambda: {"pipeline": 0, "int8": 0, "mlx": 0})  # products built, by kernel


_state: KernelsState | None = None


def _nanobind():
    try:
        import nanobind  # a build dependency only: loaded where the extension is built or keyed
    except ImportError:
        raise NotBuilt("the nanobind package is missing: pip install nanobind") from None
    return nanobind


def _mlx_version() -> str:
    return importlib.metadata.version("mlx")  # as mx.__version__, without loading mlx.core


def _mlx_dir() -> Path:
    """site-packages/mlx, where mlx.core's library is (found, not loaded). Not the first folder of the
    `mlx` namespace package: an `mlx/` folder in the current directory would come first."""
    return Path(importlib.util.find_spec("mlx.core").origin).resolve().parent


def extension_path(extra_flags: tuple[str, ...] = ()) -> Path:
    """Where this machine's build lives: keyed by the source, CPU, MLX, nanobind, Python and flags."""
    key = b"\0".join([*(f.read_bytes() for f in SOURCES + HEADERS), cpu_signature().encode(), _mlx_version().encode(),
                      _nanobind().__version__.encode(), sys.version.encode(), " ".join(FLAGS + extra_flags).encode()])
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cached_file("qmm", f"{MODULE}-mlx{_mlx_version()}-{os.uname().machine}", key, suffix)


def build_extension(path: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Compile the extension into `path` (about 20 s), or raise NotBuilt saying why not.
    extra_flags: e.g. ("-mno-avx512f",) builds the variant a CPU without AVX-512 gets (tests)."""
    nanobind = _nanobind()
    compiler = cxx_compiler()
    missing = missing_tools()
    if missing:
        raise NotBuilt(missing)
    nb_dir = Path(nanobind.__file__).parent
    mlx_dir = _mlx_dir()
    arguments = [*FLAGS, *extra_flags, f"-DNB_DOMAIN={NB_DOMAIN}",
                 f"-I{nanobind.include_dir()}", f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}",
                 f"-I{sysconfig.get_paths()['include']}", f"-I{mlx_dir / 'include'}",
                 *map(str, SOURCES), str(Path(nanobind.source_dir()) / "nb_combined.cpp"),
                 f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}"]
    compile_library(path, compiler, [arguments], "pipeline's kernels", timeout=600)


def _import(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load_extension(path: Path, build_if_missing: bool = True):
    """Build (if needed), check and import the extension at `path`; NotBuilt says why not."""
    # Here, not at the top: importing this module must not load MLX (the planner; blas.py before MLX).
    import mlx.core as mx

    path = ready_library(path, build_extension if build_if_missing else None)
    try:
        module = _import(path)
    except ImportError as e:  # e.g. "pipeline_qmm was built for MLX 0.32.4, this is MLX 0.33.0"
        raise NotBuilt(str(e).splitlines()[0] if str(e) else f"{path} does not load") from None
    try:
        module.probe(mx.zeros((1,)))
    except TypeError:
        raise NotBuilt(f"nanobind {_nanobind().__version__} does not share mlx {mx.__version__}'s ABI: "
                       "install the nanobind version mlx was built with") from None
    return module


def _not_wanted() -> str:
    """Why this process does not try the kernels at all ("" if it does): opted out, or macOS."""
    if turned_off(KERNELS_ENV):
        return f"{KERNELS_ENV}={os.environ[KERNELS_ENV]}"
    return "macOS: MLX's Metal kernels" if sys.platform == "darwin" else ""


def load() -> KernelsState:
    """The kernels of this process: built and loaded once, or the reason they are not."""
    global _state
    if _state is not None:
        return _state
    _state = KernelsState()
    _state.why_not = _not_wanted()
    if _state.why_not:
        return _state
    try:
        path = extension_path()
        _state.module = load_extension(path)
        _state.path = str(path)
    except NotBuilt as e:
        _state.why_not = str(e)
    return _state


def loaded() -> KernelsState | None:
    """The kernels' state if this process has loaded them (or tried), else None: nothing is built."""
    return _state


def missing_tools() -> str:
    """What the build needs from the system and does not find, with the fix; "" when all is there:
    a C++ compiler, and Python's headers (nanobind includes Python.h; Debian's python3-dev)."""
    if not cxx_compiler():
        return f"no C++ compiler: {install_hint('g++', 'a C++ compiler')}"
    headers = Path(sysconfig.get_paths()["include"])
    if not (headers / "Python.h").is_file():
        return f"no Python headers ({headers / 'Python.h'}): {install_hint('python3-dev', 'Python development headers')}"
    return ""


def problem() -> str:
    """One line for the job's warnings (blas.report_problems) when the kernels cannot be built for
    want of a system package, with the fix; "" otherwise (opted out, macOS, or all there)."""
    if _not_wanted():
        return ""
    if _state is not None and _state.module is not None:
        return ""
    missing = missing_tools()
    return f"pipeline's quantized kernels cannot be built ({missing}); quantized weights run MLX's slow kernels" \
        if missing else ""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def int8_by_default(flag: bool | None, dtype: str) -> bool:
    """--int8-activations resolved for this process: as given, or by default (flag None) on where
    pipeline's kernels are expected on an x86-64 CPU with AVX2 and the activations are float32. There
    the int8 products are vectorized (AVX2, AVX-512 or VNNI: the same bits on each) and 2-6x faster
    than the float32 kernels; elsewhere (other CPUs' generic code) they would not pay."""
    if flag is not None:
        return flag
    return dtype == "float32" and os.uname().machine in ("x86_64", "AMD64") and "avx2" in _cpu_flags() \
        and expected()


def expected() -> bool:
    """Whether this process will have the kernels, without building them: already loaded, or a
    build looks possible (not opted out, Linux, a C++ compiler and Python's headers, nanobind, a cache
    folder no other user can write to). `--weights-in-memory auto` decides with it before loading
    (runtime/job.py): a model without quantized weights never builds them. Should the build fail
    after all, that rank runs MLX's kernels."""
    if _state is not None:
        return _state.module is not None
    if _not_wanted():
        return False
    try:
        _nanobind()
        folder = extension_path().parent
    except NotBuilt:
        return False
    if (folder / extension_path().name).is_file():
        return True
    place = folder
    while not place.exists() and place != place.parent:
        place = place.parent
    return not missing_tools() and not private_folder.unsafe_folder(place)
