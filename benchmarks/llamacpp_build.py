"""llama.cpp's programs that our benchmarks run (`llama-bench` and `llama-batched-bench` for
vs_llamacpp.py, `llama-lookup` for speculative.py), built from the source that the PyPI sdist of
`llama-cpp-python` vendors, cached under $PIPELINE_CACHE/llama.cpp/<version>/ (never in the
repository, never in CI). Each caller asks for the targets it runs; a target missing from the cache
is built in the same build folder, so only its own sources compile (llama-lookup on a finished
llama-bench build: 7 s on 2 cores).

Why the sdist: PyPI is the one registry every machine of ours reaches, and the sdist pins one
llama.cpp revision per llama-cpp-python version, so a result names exactly what it measured.
The build uses -DGGML_NATIVE=ON (the same CPU features a user building it on that node gets) except
AMX (see CMAKE_OPTIONS), and turns off everything that would reach the network (the prebuilt web
UI, OpenSSL/HTTPS).

    python benchmarks/llamacpp_build.py [TARGET ...]   # build (about 8 minutes on 2 cores) and print the paths
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cache_dir  # noqa: E402

TARGETS = ("llama-bench", "llama-batched-bench")  # what vs_llamacpp.py runs: build()'s default
LOOKUP = "llama-lookup"  # prompt lookup decoding (examples/lookup), what speculative.py runs
PERPLEXITY = "llama-perplexity"  # what int8_accuracy.py compares with
KNOWN = (*TARGETS, LOOKUP, PERPLEXITY)
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 # examples ON only declares their targets (llama-lookup is one); nothing builds unless asked for
                 "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
                 # AMX off: ggml's AMX matmul (chosen by -march=native on Sapphire Rapids) crashed with SIGSEGV
                 # on the first prompt on our test machine. GCC lets an explicit -mno-* win over -march=native.
                 *(f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" for lang in ("C", "CXX")))
STAMP = "cmake-options.txt"  # in the build folder once built: a change of options rebuilds what it built


def root() -> Path:
    return cache_dir() / "llama.cpp"


def _run(cmd: list[str], log: Path, **kw) -> None:
    with open(log, "a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, **kw)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"error: `{' '.join(cmd[:3])} ...` failed (exit {proc.returncode}); the log is {log}:\n{tail}")


def _stamped(build_dir: Path) -> bool:
    stamp = build_dir / STAMP
    return stamp.is_file() and stamp.read_text() == "\n".join(CMAKE_OPTIONS)


def cached_binaries(targets: tuple[str, ...] = TARGETS) -> dict | None:
    """The newest finished build in the cache that has all of `targets`: {"version", target: path, ...}."""
    builds = sorted((p for p in root().glob("*/build/bin") if all((p / t).is_file() for t in targets)
                     and _stamped(p.parent)), key=lambda p: p.stat().st_mtime)
    if not builds:
        return None
    bin_ = builds[-1]
    return {"version": bin_.parents[1].name, **{t: bin_ / t for t in targets}}


def _download_sdist(dest: Path, log: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    have = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not have:
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              "llama-cpp-python", "-d", str(dest)], log)
        have = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not have:
        raise SystemExit(f"error: pip download left no llama_cpp_python sdist in {dest}; see {log}")
    return have[-1]


def _cmake() -> str:
    found = shutil.which("cmake")
    if found:
        return found
    print("cmake not found: pip install cmake", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "cmake"], check=True)
    found = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    if not Path(found).exists():
        raise SystemExit("error: cmake is missing and `pip install cmake` did not provide it; install cmake")
    return found


def build(targets: tuple[str, ...] = TARGETS, jobs: int = 2) -> dict:
    """Download, unpack and build `targets`, unless a finished build with them is cached; returns
    cached_binaries(targets). An existing build folder is reused: make compiles only what is missing or
    out of date, so adding llama-lookup to a llama-bench build compiles one example, not ggml again."""
    done = cached_binaries(targets)
    if done:
        return done
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    log = base / "build.log"
    sdist = _download_sdist(base / "src", log)
    version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    where = base / version
    out = where / "build"
    # With the options unchanged, build only the targets asked for. With options changed, the
    # programs already in bin/ are rebuilt too, so that none of them is left built under the old ones
    # while the stamp names the new.
    stamped = _stamped(out)
    wanted = [t for t in KNOWN if t in targets or (not stamped and (out / "bin" / t).is_file())]
    wanted += [t for t in targets if t not in wanted]
    fresh = not (out / "CMakeCache.txt").is_file()
    print(f"llama.cpp: building {', '.join(wanted)} from the llama-cpp-python {version} sdist under {where} "
          f"({'about 8 minutes on 2 cores' if fresh else 'reusing the build folder: under a minute'}; log: {log})",
          file=sys.stderr, flush=True)
    source = where / "src"
    if not (source / "CMakeLists.txt").is_file():
        tmp = where / "unpack.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
            tar.extractall(tmp, members=members, filter="data")
        vendored = next(tmp.glob("*/vendor/llama.cpp"))
        shutil.rmtree(source, ignore_errors=True)
        vendored.rename(source)
        shutil.rmtree(tmp, ignore_errors=True)
    cmake = _cmake()
    _run([cmake, "-S", str(source), "-B", str(out), *CMAKE_OPTIONS], log)
    (out / STAMP).unlink(missing_ok=True)
    _run([cmake, "--build", str(out), "--target", *wanted, f"-j{jobs}"], log)
    (out / STAMP).write_text("\n".join(CMAKE_OPTIONS))
    done = cached_binaries(targets)
    if not done:
        raise SystemExit(f"error: the llama.cpp build finished without {', '.join(targets)} in {out}/bin; see {log}")
    return done


def commit_of(bench: Path) -> str:
    """The llama.cpp build string (`version: N (hash)`) its binaries print."""
    proc = subprocess.run([str(bench), "--version"], capture_output=True, text=True)
    text = (proc.stdout + proc.stderr).strip().splitlines()
    return next((l.strip() for l in text if l.startswith("version")), text[0] if text else "")


if __name__ == "__main__":
    asked = tuple(sys.argv[1:]) or TARGETS
    unknown = [t for t in asked if t not in KNOWN]
    if unknown:
        raise SystemExit(f"error: unknown target {unknown[0]!r}; choose from {', '.join(KNOWN)}")
    found = build(asked)
    print({k: str(v) for k, v in found.items()})
