"""An optimized BLAS for MLX's CPU backend on Linux.

The `mlx[cpu]` wheel links netlib's reference BLAS (bundled as `mlx_cpu.libs/libblas-*.so`), which
is 10-50x slower than an optimized one on the fp32 matrix products of prefill and batches.
`libmlx.so` resolves `cblas_sgemm` and friends in the process's global symbol scope before its
own dependencies, and binds them as it is loaded (Python dlopens extensions with RTLD_NOW), so a
BLAS loaded with RTLD_GLOBAL before the first `import mlx.core` takes the bundled one's place;
loaded after, it changes nothing. `load()` does that (from `pipeline/__init__.py`, before anything
imports `mlx.core`) with Debian's OpenBLAS (`apt-get install libopenblas0-pthread`) or another
OpenBLAS it finds; without one, MLX keeps its bundled BLAS and the stats line says so.

Threads: ranks on one host would oversubscribe its cores if each ran a BLAS thread per core, so
`set_threads_for_ranks()` gives each rank cores // ranks-on-this-host threads, unless the user
set `OPENBLAS_NUM_THREADS` (which OpenBLAS itself reads at load).

The shim (blas_shim.c): MLX calls `cblas_sgemm` for every fp32 product, one row (each decode
step) included. A small C file, compiled once per machine and CPU into $PIPELINE_CACHE/blas/ when a
C compiler is there (build.py) and loaded ahead of the BLAS, takes `cblas_sgemm` first and
- computes `x @ w.T` of up to 64 rows with its own batch-invariant kernel: each row rounds the same
  whatever else shares the call, so packing several sequences' rows into one product (batch jobs)
  gives each exactly what it gets alone; OpenBLAS's kernels round a row differently by row count.
  One row reads the weights at sgemv's speed (OpenBLAS before 0.3.27 runs a 1-row GEMM as a full
  GEMM that packs the weight matrix: half the speed);
- sends other 1-row (and 1-column) products to `cblas_sgemv`, all others on to the BLAS.
`PIPELINE_BLAS_SHIM=0` leaves it out (batch jobs then multiply each sequence's rows on their own).
The shim is code this process runs, so it is built and loaded only where no other user can change
it: a cache folder (or a folder above it) or a library file that another user owns or may write to
is refused, and the run carries on without the shim.

What is missing (OpenBLAS, a C compiler) or refused is `problem()`: one line with the fix, which
`report_problems()` prints once per job on rank 0.

`in_use()` says which library MLX's `cblas_sgemm` actually resolves to, by reading libmlx.so's
own GOT slot for it; that is what the stats line reports.

`PIPELINE_BLAS=bundled` keeps MLX's bundled BLAS; `PIPELINE_BLAS=/path/to/libcblas.so` loads that
library instead of searching.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import struct
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from . import build
from ..util import cores
from ..util.switches import turned_off

ENV = "PIPELINE_BLAS"
OPT_OUT = ("bundled", "off", "0", "none", "no")
THREAD_ENV = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


@dataclass
class BlasState:
    path: str | None = None  # the library we loaded, if any
    shim: str | None = None  # the shim in front of it (blas_shim.c), if loaded
    invariant_rows: int = 0  # the shim's batch-invariant kernel takes products of up to this many rows
    name: str = ""  # e.g. "OpenBLAS 0.3.21"
    handle: ctypes.CDLL | None = None
    note: str = ""  # why nothing was loaded, or a caveat
    threads_from: str = ""  # "ranks per host", "OPENBLAS_NUM_THREADS", ...
    bound: str = ""  # how many CPUs each rank bound itself to (cores.py), e.g. "1 CPU/rank"
    problem: str = ""  # what is missing or refused that the user did not choose, and the fix (one line)


_state: BlasState | None = None


def candidates() -> list[str]:
    """OpenBLAS builds to try, most preferred first (pthread builds: no OpenMP runtime mixing)."""
    arch = sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"
    paths = [f"/usr/lib/{arch}/openblas-pthread/libopenblas.so.0",
             f"/usr/lib/{arch}/libopenblas.so.0",  # Debian's alternatives link
             f"/usr/lib/{arch}/openblas-openmp/libopenblas.so.0",
             "/usr/lib64/libopenblasp.so.0",  # Fedora/RHEL pthread build
             "/usr/lib64/libopenblas.so.0",
             "/usr/lib/libopenblas.so.0"]
    for prefix in (os.environ.get("CONDA_PREFIX"), sys.prefix):
        if prefix:
            paths.append(str(Path(prefix) / "lib" / "libopenblas.so.0"))
    found = ctypes.util.find_library("openblas")
    if found:
        paths.append(found)
    return paths


def load() -> BlasState:
    """Load an optimized BLAS into the global symbol scope (once; Linux only)."""
    global _state
    if _state is not None:
        return _state
    _state = BlasState()
    if not sys.platform.startswith("linux"):
        _state.note = "not Linux"
        return _state
    choice = os.environ.get(ENV, "").strip()
    if choice.lower() in OPT_OUT:
        _state.note = f"{ENV}={choice}"
        return _state
    if "mlx.core" in sys.modules:
        _state.note = "mlx was imported before pipeline"  # in_use() says whether it still took
    paths = [choice] if choice else candidates()
    for path in paths:
        if not os.path.exists(path):
            continue
        try:
            handle = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
            handle.cblas_sgemm  # noqa: B018 -- a CBLAS, or useless to MLX
        except (OSError, AttributeError) as e:
            _state.note = f"{path}: {e}"
            continue
        _state.path, _state.handle = os.path.realpath(path), handle
        _state.name = _library_name(handle, path)
        _load_shim(handle)  # first in the global scope, so MLX's cblas_sgemm binds to it
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # then the BLAS itself, for every other symbol
        _early_threads()
        return _state
    if choice:
        _state.note = f"{ENV}={choice} could not be loaded" + (f" ({_state.note})" if _state.note else "")
        _state.problem = f"{_state.note}: MLX runs its bundled reference BLAS; unset {ENV}, or name a CBLAS library"
    else:
        why = f"OpenBLAS could not be loaded ({_state.note})" if _state.note else "no OpenBLAS found"
        _state.note = why
        _state.problem = (f"{why}: MLX runs its bundled reference BLAS, prompts 10-20x slower; "
                          + build.install_hint("libopenblas0-pthread", "OpenBLAS"))
    return _state


SHIM_ENV = "PIPELINE_BLAS_SHIM"


def _shim_problem(why: str, fix: str) -> str:
    return (f"no BLAS shim ({why}): batch jobs multiply each sequence on its own and one-row products may "
            f"run slower; {fix}")


def _load_shim(blas: ctypes.CDLL) -> None:
    """Put the shim in front of `blas` in the global scope (see blas_shim.c), where it is safe to."""
    if turned_off(SHIM_ENV):
        return
    try:
        blas.cblas_sgemv  # noqa: B018
    except AttributeError:
        return  # a CBLAS without GEMV: nothing for the shim to send 1-row products to
    try:
        path = build.ready_library(build.shim_path(), build.build_shim)
    except build.NotBuilt as e:
        _state.problem = _shim_problem(str(e), e.fix)
        return
    try:
        shim = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        shim.pipeline_shim_init.argtypes = [ctypes.c_void_p]
        if shim.pipeline_shim_init(blas._handle):
            _state.shim = os.path.realpath(path)
            _state.invariant_rows = int(shim.pipeline_invariant_max_rows())
    except (OSError, AttributeError) as e:
        _state.problem = _shim_problem(f"{path} does not load: {e}", "delete it; it is rebuilt on the next run")


def invariant_rows() -> int:
    """Up to how many rows an fp32 `x @ w.T` rounds each row the same whatever else is in the call
    (the shim's batch-invariant kernel is in use); 0 if not known to."""
    state = load()
    return state.invariant_rows if state.shim and os.path.realpath(in_use() or "") == state.shim else 0


def _library_name(handle: ctypes.CDLL, path: str) -> str:
    try:
        get_config = handle.openblas_get_config
    except AttributeError:
        return Path(path).name
    get_config.restype = ctypes.c_char_p
    words = get_config().decode(errors="replace").split()  # "OpenBLAS 0.3.21 DYNAMIC_ARCH ..."
    return " ".join(words[:2]) if words[:1] == ["OpenBLAS"] else Path(path).name


def _user_threads() -> str | None:
    return next((var for var in THREAD_ENV if os.environ.get(var, "").strip()), None)


def _early_threads() -> None:
    """Before MPI is up: guess ranks on this host from the launcher's environment."""
    if _user_threads():
        _state.threads_from = _user_threads()
        return
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_LOCAL_SIZE", "MPI_LOCAL_NRANKS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            set_threads_for_ranks(int(value))
            return


def usable_cores() -> int:
    return len(cores.cpus_allowed()) or 1


def threads_for(ranks_on_host: int) -> int:
    """BLAS threads per rank so that the ranks of one host together use its cores once."""
    return max(1, min(usable_cores(), (os.cpu_count() or 1) // max(1, ranks_on_host)))


def note_binding(cpus: str) -> None:
    """Say in the stats line that this rank bound itself to its share of CPUs (cores.bind)."""
    load().bound = cpus


def set_threads_for_ranks(ranks_on_host: int) -> int | None:
    """Give this rank its share of the host's cores; returns the thread count set (None: the
    user's OPENBLAS_NUM_THREADS stands, or the library has no thread control)."""
    state = load()
    if state.handle is None:
        return None
    user = _user_threads()
    if user:
        state.threads_from = user
        return None
    try:
        setter = state.handle.openblas_set_num_threads
    except AttributeError:
        return None
    threads = threads_for(ranks_on_host)
    setter.argtypes = [ctypes.c_int]
    setter(threads)
    state.threads_from = f"{ranks_on_host} rank{'s' if ranks_on_host != 1 else ''}/host"
    return threads


def num_threads() -> int | None:
    state = load()
    if state.handle is None:
        return None
    try:
        getter = state.handle.openblas_get_num_threads
    except AttributeError:
        return None
    getter.restype = ctypes.c_int
    return int(getter())


def in_use(symbol: str = "cblas_sgemm") -> str | None:
    """Path of the library that MLX's calls to `symbol` go to, read from libmlx.so's GOT slot.
    None if that cannot be told (no libmlx loaded yet, not ELF64, no such relocation). Should the
    slot still point at libmlx's own PLT (a lazily bound load), the answer is where the first
    call will land: the global scope's definition, else that of libmlx's own dependencies."""
    try:
        return _resolve_through_got(symbol)
    except (OSError, ValueError, struct.error, AttributeError):
        return None


def is_optimized() -> bool:
    path = in_use()
    state = load()
    return bool(path) and (os.path.realpath(path) in (state.path, state.shim) or
                           ("openblas" in Path(path).name.lower() and "mlx_cpu.libs" not in path))


def describe() -> str:
    """One phrase for the stats line, e.g. 'OpenBLAS 0.3.21 (1 thread: 2 ranks/host)', and which
    kernels ran the quantized products where there were any (qmm.py) and the attention (attention.py)."""
    quantized = sys.modules["pipeline.kernels.qmm"].describe() if "pipeline.kernels.qmm" in sys.modules else ""
    attention = sys.modules["pipeline.kernels.attention"].describe() if "pipeline.kernels.attention" in sys.modules else ""
    return (_describe_library() + (f"; quantized products: {quantized}" if quantized else "")
            + (f"; attention: {attention}" if attention else ""))


def _describe_library() -> str:
    state = load()
    if sys.platform == "darwin":
        return "Accelerate"
    path = in_use()
    if path is None:
        used = "unknown"
    elif state.path and os.path.realpath(path) in (state.path, state.shim):
        threads = num_threads()
        detail = ", ".join(x for x in (f"{threads} thread{'s' if threads != 1 else ''}" if threads else "",
                                       state.threads_from, f"bound, {state.bound}" if state.bound else "",
                                       f"batch-invariant GEMM <= {state.invariant_rows} rows" if os.path.realpath(path) == state.shim else "") if x)
        return f"{state.name}" + (f" ({detail})" if detail else "")
    elif "mlx_cpu.libs" in path and Path(path).name.startswith("libblas"):
        used = "netlib reference BLAS (bundled with mlx)"
    else:
        used = Path(path).name
    note = state.note or (f"{state.name} loaded too late" if state.path else "")
    return used + (f" [{note}]" if note else "")


def problem() -> str:
    """What this process misses for full speed that the user did not opt out of (no OpenBLAS, no
    shim), with the fix, in one line; "" when nothing is missing."""
    return load().problem


def report_problems(comm, *more: str) -> None:
    """Collective: rank 0 prints each rank's problem() (and build.problem(): the kernels' extension's
    compiler and headers; and `more`, the caller's) once, as `warning: ...` on stderr, naming the hosts when the job spans several."""
    found = comm.gather((socket.gethostname(), (problem(), build.problem(), *more)), root=0)
    if comm.Get_rank() != 0:
        return
    hosts_with = {}
    for host, lines in found:
        for line in lines:
            if line:
                hosts_with.setdefault(line, []).append(host)
    several = len({host for host, _ in found}) > 1
    for line, hosts in hosts_with.items():
        where = f"on {', '.join(dict.fromkeys(hosts))}: " if several else ""
        print(f"warning: {where}{line}", file=sys.stderr, flush=True)


# ---- reading libmlx.so's GOT --------------------------------------------------------------

class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


class _LinkMap(ctypes.Structure):
    _fields_ = [("l_addr", ctypes.c_size_t), ("l_name", ctypes.c_char_p)]


_RTLD_DI_LINKMAP = 2
_SHT_RELA = 4
_R_JUMP_SLOT = {62: 7, 183: 1026}  # x86_64, aarch64
_R_GLOB_DAT = {62: 6, 183: 1025}


def _libmlx_path() -> str | None:
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[-1].endswith("/libmlx.so"):
                return fields[-1]
    return None


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def _dlinfo_linkmap(handle: int) -> _LinkMap:
    libc = _libc()
    try:
        dlinfo = libc.dlinfo
    except AttributeError:  # glibc < 2.34 keeps it in libdl
        dlinfo = ctypes.CDLL("libdl.so.2").dlinfo
    dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    out = ctypes.POINTER(_LinkMap)()
    if dlinfo(handle, _RTLD_DI_LINKMAP, ctypes.byref(out)) != 0:
        raise OSError("dlinfo failed")
    return out.contents


def _dladdr(address: int) -> str | None:
    libc = _libc()
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not libc.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def _got_offsets(path: str, symbol: str) -> list[int]:
    """r_offset of each JUMP_SLOT/GLOB_DAT relocation for `symbol` in an ELF64 LE file."""
    with open(path, "rb") as f:
        ident = f.read(64)
        if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            raise ValueError("not ELF64 little-endian")
        machine = struct.unpack_from("<H", ident, 18)[0]
        shoff, = struct.unpack_from("<Q", ident, 40)
        shentsize, shnum = struct.unpack_from("<HH", ident, 58)
        f.seek(shoff)
        sections = [struct.unpack("<IIQQQQIIQQ", f.read(shentsize)[:64]) for _ in range(shnum)]

        def read(section):
            f.seek(section[4])
            return f.read(section[5])

        offsets = []
        wanted = {_R_JUMP_SLOT.get(machine), _R_GLOB_DAT.get(machine)}
        for sec in sections:
            if sec[1] != _SHT_RELA:
                continue
            dynsym = sections[sec[6]]
            symtab, strtab = read(dynsym), read(sections[dynsym[6]])
            for r_offset, r_info, _ in struct.iter_unpack("<QQq", read(sec)):
                if (r_info & 0xFFFFFFFF) not in wanted:
                    continue
                st_name, = struct.unpack_from("<I", symtab, (r_info >> 32) * 24)
                end = strtab.index(b"\0", st_name)
                if strtab[st_name:end] == symbol.encode():
                    offsets.append(r_offset)
        return offsets


def _resolve_through_got(symbol: str) -> str | None:
    path = _libmlx_path()
    if path is None:
        return None
    offsets = _got_offsets(path, symbol)
    if not offsets:
        return None
    handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
    base = _dlinfo_linkmap(handle).l_addr
    target = ctypes.c_void_p.from_address(base + offsets[0]).value
    owner = _dladdr(target) if target else None
    if owner is None or owner == os.path.realpath(path):
        # Not bound yet (the slot points into libmlx's PLT): the first call binds it to the
        # first definition in the global scope, else in libmlx's own dependencies.
        libc = _libc()
        libc.dlsym.restype = ctypes.c_void_p
        libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        address = libc.dlsym(None, symbol.encode())  # RTLD_DEFAULT: the global scope
        if address:
            return _dladdr(address)
        address = libc.dlsym(handle, symbol.encode())
        return _dladdr(address) if address else None
    return owner
