"""Quantized matrix products on CPU at memory speed: pipeline's own kernels (qmm_kernels.cpp) as an
MLX operation, with MLX's kernels as the fallback.

MLX's CPU `quantized_matmul` reads a quantized weight matrix at a few percent of memory bandwidth
and costs about a whole matvec per row, so quantized models decoded 2x slower than with their
weights dequantized to fp32. qmm_kernels.cpp defines a custom MLX Primitive (the route of MLX's
"Custom Extensions" docs) whose `eval_cpu` runs our kernels: products stay lazy nodes of the graph
like any MLX op, evaluated on MLX's CPU stream. A load-ahead shim (as blas.py does for
`cblas_sgemm`) could not do this: libmlx.so does not export its quantized kernels, so there is no
symbol to take over. What the kernels compute, and why each row rounds the same whatever else
shares the call (batch jobs equal `generate`), is in qmm_kernels.cpp's opening comment.

Building. The extension takes and returns `mx.array`, so it is a nanobind module like `mlx.core`
itself, built against the same nanobind ABI and domain ("mlx"): nanobind's type registry is then
shared, and an `mx.array` passes in and out as the very C++ object. `pip install .` builds nothing:
at first use the system C++ compiler compiles qmm_kernels.cpp with nanobind's sources (the
`nanobind` package, a dependency) against MLX's headers and libmlx.so (about 20 s), once per
machine, CPU (-march=native), MLX, nanobind and Python version, into $PIPELINE_CACHE/qmm/, with the
same refusals as the BLAS shim: a folder or file another user may write to is never loaded.
The module refuses to start under an MLX other than the one it was built for (one line).

With --int8-activations (`use_int8`), 4- and 8-bit weights are repacked at load for int8_kernels.cpp:
activations rounded to int8 per 32 inputs, integer dot products (AVX-512 VNNI where the CPU has it),
as llama.cpp computes; 2-6x faster than the float32 kernels, outputs within about 1% of them, and
still the same bits whatever the batch, row count or ISA.

Without a compiler, with the build or a check failing, or with `PIPELINE_QMM=0`, every product goes
to MLX's `quantized_matmul` / `gather_qmm` as before, and the stats line says so (`describe()`).
Products the kernels do not cover go there too: activations other than float32, MLX's mxfp4/mxfp8
modes (no biases), gathers with lhs indices, or a default device other than the CPU.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from . import blas
from ..util import private_folder
from ..util.switches import turned_off

ENV = "PIPELINE_QMM"
SOURCE = Path(__file__).with_name("qmm_kernels.cpp")
# compiled with it into the one extension: the attention (attention.py), RMSNorm and RoPE (layer_kernels.py),
# re-quantization at load (requantize.py), int8 products (--int8-activations, below), weight files
# mapped without a copy (mapped_files.py)
SOURCES = (SOURCE, SOURCE.with_name("attention_kernels.cpp"), SOURCE.with_name("layer_kernels.cpp"),
           SOURCE.with_name("requantize_kernels.cpp"), SOURCE.with_name("int8_kernels.cpp"),
           SOURCE.with_name("mapped_files.cpp"))
HEADERS = (SOURCE.with_name("kernels_common.h"),)
MODULE = "pipeline_qmm"
NB_DOMAIN = "mlx"  # mlx.core's nanobind domain: types are shared only within one domain
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# -ffp-contract=off: the compiler must not fuse some multiply-adds and not others (see the .cpp).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++20", "-fvisibility=hidden", "-shared",
         "-fPIC")


@dataclass
class QmmState:
    module: object = None  # the loaded extension, or None: MLX's kernels
    path: str = ""
    why_not: str = ""  # why MLX's kernels run (opted out, no compiler, refused, ...)
    threads: int = 0
    used: dict = field(default_factory=lambda: {"pipeline": 0, "int8": 0, "mlx": 0})  # products built, by kernel


_state: QmmState | None = None


class NotBuilt(Exception):
    """Why the extension could not be built or loaded, in a phrase."""


def cxx_compiler() -> str | None:
    import shutil

    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _nanobind():
    try:
        import nanobind
    except ImportError:
        raise NotBuilt("the nanobind package is missing: pip install nanobind") from None
    return nanobind


def _mlx_dir() -> Path:
    return Path(mx.__file__).resolve().parent  # site-packages/mlx (mx.__file__ is its core.*.so)


def extension_path(extra_flags: tuple[str, ...] = ()) -> Path:
    """Where this machine's build lives: keyed by the source, CPU, MLX, nanobind, Python and flags."""
    from ..checkpoints.default_model import cache_root

    key = b"\0".join([*(f.read_bytes() for f in SOURCES + HEADERS), blas._cpu_signature().encode(), mx.__version__.encode(),
                      _nanobind().__version__.encode(), sys.version.encode(), " ".join(FLAGS + extra_flags).encode()])
    digest = hashlib.sha256(key).hexdigest()[:12]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cache_root() / "qmm" / f"{MODULE}-mlx{mx.__version__}-{os.uname().machine}-{digest}{suffix}"


def build(path: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Compile the extension into `path` (about 20 s), or raise NotBuilt saying why not.
    extra_flags: e.g. ("-mno-avx512f",) builds the variant a CPU without AVX-512 gets (tests)."""
    nanobind = _nanobind()
    compiler = cxx_compiler()
    missing = missing_tools()
    if missing:
        raise NotBuilt(missing)
    nb_dir = Path(nanobind.__file__).parent
    mlx_dir = _mlx_dir()
    command = [compiler, *FLAGS, *extra_flags, f"-DNB_DOMAIN={NB_DOMAIN}",
               f"-I{nanobind.include_dir()}", f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}",
               f"-I{sysconfig.get_paths()['include']}", f"-I{mlx_dir / 'include'}",
               *map(str, SOURCES), str(Path(nanobind.source_dir()) / "nb_combined.cpp"),
               f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}"]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            result = subprocess.run([*command, "-o", str(out)], capture_output=True, timeout=600)
            if result.returncode != 0:
                errors = result.stderr.decode(errors="replace")
                first = next((line.strip() for line in errors.splitlines() if "error" in line), "") or errors[:200]
                raise NotBuilt(f"{Path(compiler).name} could not compile pipeline's kernels: {first}")
            out.chmod(0o755)  # whatever the umask: a library others may write to would be refused
            os.replace(out, path)  # atomic: ranks building at once each publish a whole file
    except (OSError, subprocess.SubprocessError) as e:
        raise NotBuilt(f"cannot build it in {path.parent}: {e}") from None


def _import(path: Path):
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load_extension(path: Path, build_if_missing: bool = True):
    """Build (if needed), check and import the extension at `path`; NotBuilt says why not."""
    import fcntl
    import stat

    try:
        private_folder.make_private_folder(path.parent)
    except OSError as e:
        raise NotBuilt(f"cannot create {path.parent}: {e.strerror}") from None
    path = Path(os.path.realpath(path.parent)) / path.name  # checked and loaded through the real path
    unsafe = private_folder.unsafe_folder(path.parent)
    if unsafe:
        raise NotBuilt(f"refused {unsafe}")
    if build_if_missing and not path.exists():
        with open(path.parent / ".build-lock", "a") as lock:  # ranks of one host build it once
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                build(path)
    try:
        st = os.lstat(path)
    except OSError as e:
        raise NotBuilt(f"{path}: {e.strerror}") from None
    why = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else private_folder.writable_by_others(st)
    if why:
        raise NotBuilt(f"refused {path}: {why}")
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
    if turned_off(ENV):
        return f"{ENV}={os.environ[ENV]}"
    return "macOS: MLX's Metal kernels" if sys.platform == "darwin" else ""


def load() -> QmmState:
    """The kernels of this process: built and loaded once, or the reason they are not."""
    global _state
    if _state is not None:
        return _state
    _state = QmmState()
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


def available() -> bool:
    return load().module is not None


def missing_tools() -> str:
    """What the build needs from the system and does not find, with the fix; "" when all is there:
    a C++ compiler, and Python's headers (nanobind includes Python.h; Debian's python3-dev)."""
    if not cxx_compiler():
        return f"no C++ compiler: {blas.install_hint('g++', 'a C++ compiler')}"
    headers = Path(sysconfig.get_paths()["include"])
    if not (headers / "Python.h").is_file():
        return f"no Python headers ({headers / 'Python.h'}): {blas.install_hint('python3-dev', 'Python development headers')}"
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
    (job.py): a model without quantized weights never builds them. Should the build fail after all, that rank runs MLX's kernels."""
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


def _kernels(x: mx.array) -> object:
    """The extension if it takes this product's activations, else None."""
    state = load()
    if state.module is None or x.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return None
    if not state.threads:
        set_threads()
    return state.module


def set_threads(threads: int | None = None) -> None:
    """The kernels' threads: `threads`, else the BLAS's (blas.num_threads(), a rank's share of its
    host's cores), read once per load and again by use_in() (not per product: a ctypes call)."""
    state = load()
    if state.module is not None:
        state.threads = threads or blas.num_threads() or 1
        state.module.set_threads(state.threads)


def covers(w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int, mode: str,
           transpose: bool = True) -> bool:
    """Whether the kernels compute this layout (MLX affine; the rest goes to MLX)."""
    return (mode == "affine" and transpose and biases is not None and bits in BITS and group_size in GROUP_SIZES
            and w.dtype == mx.uint32 and scales.dtype in SCALE_DTYPES and biases.dtype == scales.dtype)


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None = None,
                     transpose: bool = True, group_size: int = 64, bits: int = 4, mode: str = "affine",
                     int8: bool = False) -> mx.array:
    """`mx.quantized_matmul`, through pipeline's kernels where they cover the product. int8: w, scales
    and biases are in the int8 products' layout (`use_int8`)."""
    state = load()
    if int8:
        state.used["int8"] += 1
        return _in_dtype_of(x, state.module.int8_matmul(_float32(x), w, scales, biases, group_size, bits))
    kernels = _kernels(x)
    if kernels is not None and covers(w, scales, biases, group_size, bits, mode, transpose):
        if w.ndim == 2:
            state.used["pipeline"] += 1
            return kernels.quantized_matmul(x, w, scales, biases, group_size, bits)
        if w.ndim == 3 and x.ndim >= 3 and x.shape[-3] == w.shape[0]:
            # a batch of matrices, one per x[..., b, :, :] (DeepSeek V4's grouped projection): a gather of each
            return gather_qmm(x, w, scales, biases, rhs_indices=mx.arange(w.shape[0], dtype=mx.uint32),
                              group_size=group_size, bits=bits, mode=mode)
    state.used["mlx"] += 1
    return mx.quantized_matmul(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits,
                               mode=mode)


def _float32(x: mx.array) -> mx.array:
    """x as the int8 kernels take it (--dtype float32 already is: an astype would add a node anyway)."""
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _in_dtype_of(x: mx.array, out: mx.array) -> mx.array:
    return out if x.dtype == out.dtype else out.astype(x.dtype)


def gather_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None = None,
               lhs_indices: mx.array | None = None, rhs_indices: mx.array | None = None, transpose: bool = True,
               group_size: int = 64, bits: int = 4, mode: str = "affine", sorted_indices: bool = False,
               int8: bool = False) -> mx.array:
    """`mx.gather_qmm` with rhs indices (each row of x times the experts it chose), through
    pipeline's kernels where they cover the product: rows grouped per expert in the kernel. int8:
    the weights are in the int8 products' layout (`use_int8`)."""
    state = load()
    kernels = state.module if int8 else _kernels(x)
    if int8 or (kernels is not None and lhs_indices is None and rhs_indices is not None and w.ndim == 3
                and covers(w, scales, biases, group_size, bits, mode, transpose)):
        state.used["int8" if int8 else "pipeline"] += 1
        rows, k = x.shape[-2:]
        batch = tuple(mx.broadcast_shapes(x.shape[:-2], rhs_indices.shape))
        flat_x = mx.broadcast_to(x, (*batch, rows, k)).reshape(-1, k)
        experts = mx.broadcast_to(rhs_indices[..., None], (*batch, rows)).reshape(-1).astype(mx.uint32)
        if int8:
            out = _in_dtype_of(x, kernels.int8_gather_qmm(_float32(flat_x), w, scales, biases, experts, group_size, bits))
        else:
            out = kernels.gather_qmm(flat_x, w, scales, biases, experts, group_size, bits)
        return out.reshape(*batch, rows, w.shape[1])
    state.used["mlx"] += 1
    return mx.gather_qmm(x, w, scales, biases, lhs_indices=lhs_indices, rhs_indices=rhs_indices,
                         transpose=transpose, group_size=group_size, bits=bits, mode=mode,
                         sorted_indices=sorted_indices)


# ---- the model's quantized layers --------------------------------------------------------------

class QuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product goes through `quantized_matmul` above."""

    def __call__(self, x: mx.array) -> mx.array:
        out = rows_product(self, x)
        return out + self["bias"] if "bias" in self else out


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose use as the LM head (tied embeddings) goes through `quantized_matmul`."""

    def as_linear(self, x: mx.array) -> mx.array:
        return rows_product(self, x)


def rows_product(module: nn.Module, x: mx.array, begin: int = 0, end: int | None = None) -> mx.array:
    """x @ rows [begin, end) of a quantized Linear's (or Embedding's) weight, transposed: in the int8
    layout where `use_int8` made one (an embedding keeps its own for lookups beside it; begin and end
    are then multiples of 16, whole blocks), else MLX's."""
    int8 = getattr(module, "int8", False)
    assert not int8 or begin % INT8_BLOCK == 0 and (end is None or end % INT8_BLOCK == 0), (begin, end)
    prefix = "int8_" if int8 and "int8_weight" in module else ""
    weight, scales, biases = module[prefix + "weight"], module[prefix + "scales"], module.get(prefix + "biases")
    if begin or end is not None:  # a slice is a node of the graph: none for the whole matrix (every layer's call)
        weight, scales = weight[begin:end], scales[begin:end]
        biases = None if biases is None else biases[begin:end]
    return quantized_matmul(x, weight, scales, biases, transpose=True, group_size=module.group_size,
                            bits=module.bits, mode=getattr(module, "mode", "affine"), int8=int8)


def _int8_together(modules: list[nn.Module], x: mx.array) -> bool:
    """Whether these Linears' products can be one int8 operation on x: each in the int8 layout (not an
    embedding's copy), one group size and bit width, float32 2-D x."""
    first = modules[0]
    return (x.ndim == 2 and x.dtype == mx.float32
            and all(getattr(m, "int8", False) and "int8_weight" not in m and m.group_size == first.group_size
                    and m.bits == first.bits for m in modules))


def _int8_fused(kernel: str, modules: list[nn.Module], x: mx.array):
    """The extension's fused int8 call `kernel` (int8_products, int8_swiglu) on these Linears' repacked weights."""
    state = load()
    state.used["int8"] += len(modules)
    return getattr(state.module, kernel)(x, [m["weight"] for m in modules], [m["scales"] for m in modules],
                                         [m["biases"] for m in modules], modules[0].group_size, modules[0].bits)


def products(modules: list[nn.Module], x: mx.array) -> list[mx.array]:
    """[m(x) for m in modules] (a layer's q, k and v projections). With int8 products, one operation: x is
    rounded once and MLX dispatches one node instead of one per product, each output the same bits."""
    if not _int8_together(modules, x):
        return [m(x) for m in modules]
    outs = _int8_fused("int8_products", modules, x)
    return [out + m["bias"] if "bias" in m else out for m, out in zip(modules, outs)]


def swiglu_product(gate: nn.Module, up: nn.Module, x: mx.array, swiglu) -> mx.array:
    """swiglu(gate(x), up(x)). With int8 products and no Linear biases, one operation (int8_kernels.cpp's
    Int8Products): the same bits as the three it replaces."""
    if "bias" in gate or "bias" in up or not _int8_together([gate, up], x):
        return swiglu(gate(x), up(x))
    return _int8_fused("int8_swiglu", [gate, up], x)


_OURS = {nn.QuantizedLinear: QuantizedLinear, nn.QuantizedEmbedding: QuantizedEmbedding}


def use_in(model: nn.Module) -> int:
    """Route `model`'s MLX quantized layers through pipeline's kernels: each module's class becomes
    the subclass above, in place (same parameters, same tree; isinstance checks still hold). Returns
    how many. Experts (models/experts.py) call `gather_qmm` themselves."""
    set_threads()
    count = 0
    for module in model.modules():
        ours = _OURS.get(type(module))
        if ours is not None:
            module.__class__ = ours
            count += 1
    return count


INT8_BITS = (4, 8)
INT8_BLOCK = 16  # columns per block of the int8 layout (int8_kernels.cpp)


def int8_covers(module: nn.Module) -> bool:
    """Whether a quantized module's weights can take the int8 layout (int8_fits)."""
    w = module.get("weight")
    return (w is not None and module.get("scales") is not None
            and int8_fits(w, module["scales"], module.get("biases"), module.group_size, module.bits,
                          getattr(module, "mode", "affine")))


def int8_fits(w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
              mode: str = "affine") -> bool:
    """Whether these arrays can take the int8 layout: MLX affine 4 or 8 bits, whole blocks of 16 weight
    rows (a multiple of 32 inputs follows from the group sizes)."""
    return (covers(w, scales, biases, group_size, bits, mode) and bits in INT8_BITS
            and w.shape[-2] % INT8_BLOCK == 0)


def use_int8(model: nn.Module, tied_head: bool = False, head_share: bool = True, in_place: bool = False) -> int:
    """--int8-activations: repack the 4- and 8-bit weights of `model`'s quantized modules for the int8
    products (int8_kernels.cpp), in place, one module at a time: same shapes, another order (float32 scales
    holding float16 values, a GGUF's, become float16: fewer bytes a token, same numbers),
    and `module.int8` set so their products take the int8 path. tied_head: the embedding is also the
    LM head (tie_word_embeddings): it keeps its MLX layout for lookups and gains an int8 copy for the
    head; an embedding that is not the head is left alone. head_share: the last rank's share of the
    head (head_share.py) may take the int8 path; the caller says no where rank 0's head cannot (its
    rows not whole blocks, or rank 0 dense), so that both compute the head the same way.
    in_place: rearrange a layer's weights in their own buffer, so that loading pays for no second copy
    in new memory; only for a caller that knows no graph built before still reads them (the loader).
    Returns how many were repacked (0 without the kernels: the stats line says why)."""
    from ..models.experts import QuantizedSwitchLinear

    state = load()
    if state.module is None:
        return 0
    set_threads()
    skip = set()
    if not head_share and "head_share" in model:
        skip.add(id(model["head_share"]))
    count = 0
    for module in model.modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            continue
        embedding = isinstance(module, nn.QuantizedEmbedding)
        if (embedding and not tied_head) or id(module) in skip or getattr(module, "int8", False) \
                or not int8_covers(module):
            continue
        # a tied embedding keeps its layout for lookups: its head is a copy
        w, s, b = state.module.int8_repack(module["weight"], module["scales"], module["biases"], module.group_size,
                                           module.bits, in_place=in_place and not embedding)
        prefix = "int8_" if embedding else ""
        module[prefix + "weight"], module[prefix + "scales"], module[prefix + "biases"] = w, s, b
        module.int8 = True
        count += 1
    mx.clear_cache()
    return count


class Int8WhileLoading:
    """use_int8 for the decoder layers' matrices while the rest of the rank's tensors are still being read
    (loading.load_tensors calls it with each group of tensors once evaluated, while the next group
    reads): a cold load then takes about the longer of reading and repacking, not their sum. Layers
    only: the embedding, the LM head and its share (whose rows are cut from the loaded head) and
    DeepSeek's MTP module are repacked by use_int8 afterwards, which skips what was done here, as are
    the matrices of a module that reads them again after loading (`after_load`: DeepSeek's attention).
    in_place(weight's checkpoint name): as use_int8's, per matrix (nothing else holds the freshly read
    arrays; a GGUF's weights decoded into huge pages are rearranged there whatever the rank's malloc does)."""

    def __init__(self, model: nn.Module, in_place: Callable[[str], bool]):
        self.modules = dict(model.named_modules())
        self.in_place = in_place
        self.ready: set[str] = set()  # checkpoint names evaluated so far
        self.repacked: set[str] = set()  # module paths
        self.no_biases: dict[str, mx.array] = {}  # path -> the empty biases of a symmetric matrix

    def __call__(self, weights: dict, local_names: dict[str, str]) -> None:
        """weights: the loaded arrays by checkpoint name; local_names: the group just evaluated, each
        checkpoint name with its parameter path in the model."""
        state = load()
        if state.module is None:
            return
        self.ready.update(local_names)
        candidates = {}  # module path -> its weight, scales and biases (checkpoint names)
        for name, local in local_names.items():
            stem, _, part = name.rpartition(".")
            if part in ("weight", "scales", "biases") and local.startswith("layers."):
                candidates[local.rpartition(".")[0]] = tuple(f"{stem}.{p}" for p in ("weight", "scales", "biases"))
        for path, triple in candidates.items():
            if path in self.repacked or not all(n in self.ready and n in weights for n in triple):
                continue  # the rest comes in a later group
            layout = self._layout(path, *(weights[n] for n in triple))
            if layout is None:
                continue
            set_threads()
            biases = weights[triple[2]]
            repacked = state.module.int8_repack(*(weights[n] for n in triple), *layout, in_place=self.in_place(triple[0]))
            if repacked[2].shape != biases.shape:  # a symmetric matrix's biases are not held (int8_repack):
                self.no_biases[path] = repacked[2]  # loading checks their shape, so a stand-in goes in first
                repacked = (*repacked[:2], mx.broadcast_to(mx.zeros((1,) * biases.ndim, biases.dtype), biases.shape))
            for n, array in zip(triple, repacked):
                weights[n] = array
            self.repacked.add(path)

    def _layout(self, path: str, w: mx.array, scales: mx.array, biases: mx.array) -> tuple[int, int] | None:
        """(group size, bits) where this module's matrix takes the int8 layout (as int8_covers), else None."""
        from ..models.experts import SwitchLinear
        from ..checkpoints.weights import packed_layout

        module, parent = self.modules.get(path), self.modules.get(path.rpartition(".")[0])
        if not isinstance(module, (nn.Linear, SwitchLinear)) or w.dtype != mx.uint32 or w.ndim != module.weight.ndim:
            return None
        if hasattr(parent, "after_load"):  # its weights are read again after loading (DeepSeek's kv_b_proj)
            return None
        layout = packed_layout(module.weight.shape[-1], w.shape[-1], scales.shape[-1])
        return layout if layout is not None and int8_fits(w, scales, biases, *layout) else None

    def mark(self, model: nn.Module) -> None:
        """After the arrays are in `model` (its modules now quantized): the repacked ones take the int8 path."""
        modules = dict(model.named_modules())
        for path in self.repacked:
            modules[path].int8 = True
            if path in self.no_biases:
                modules[path]["biases"] = self.no_biases[path]


def describe() -> str:
    """The stats line's phrase for quantized products ("" if this process ran none)."""
    state = _state
    if state is None or not any(state.used.values()):
        return ""
    if state.used["pipeline"] or state.used["int8"]:
        threads = state.threads or 1
        ours = f"pipeline's {state.module.isa()} kernels ({threads} thread{'s' if threads != 1 else ''})"
        if state.used["int8"]:
            ours += f", int8 activations ({state.module.int8_isa()})"
            ours += ", some float32" if state.used["pipeline"] else ""
        return ours + (", some MLX's" if state.used["mlx"] else "")
    return "MLX's" + (f" ({state.why_not})" if state.why_not else "")
