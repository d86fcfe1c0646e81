"""Bytes each --tensor-parallel rank reads from the model's files, against its share (issue 34).

For each member of a group of T (one process each, alone: `Stage.load` with its shard, no MPI), on a
private copy of the model's files dropped from the page cache first (posix_fadvise DONTNEED; nobody else
maps the copy), with share reads on and off (PIPELINE_SHARE_READS): the pages of the files in the page
cache after the load (mincore: what was read from disk, the kernel's read-ahead included), the GGUF
reader's own count of tensor bytes read, and the member's share: for every tensor it reads, the bytes of
the rows or columns it keeps (checkpoints/share_reads.py read_shares), whole tensors where it keeps them
whole.

    python benchmarks/tensor_parallel_reads.py [--model PATH] [--tensor-parallel 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (mincore over a fresh mapping)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    if not size:
        return 0
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        libc.munmap(ctypes.c_void_p(addr), size)
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # a fresh copy's pages are dirty: written back first, or they cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def member_run(model: str, t: int, member: int) -> dict:
    """In this process: load member `member`'s share and report what it read (see the module docstring)."""
    import mlx.core as mx

    from pipeline.checkpoints.model_files import locate
    from pipeline.checkpoints.share_reads import read_shares
    from pipeline.models.tensor_parallel import Shard
    from pipeline.models.vocab_split import vocab_share
    from pipeline.runtime.stage import Stage

    checkpoint = locate(Path(model)).open(None)
    config = checkpoint.model_config()
    files = sorted({path for name in checkpoint.tensors for path, _, _ in checkpoint.spans(name)})
    for path in files:
        drop(path)
    before = sum(resident_bytes(p) for p in files)
    shard, vocab = Shard(member, t), vocab_share(config.vocab_size, t, member)
    has_ends = member == 0
    stage = Stage.load(config, checkpoint, (0, config.num_hidden_layers), has_ends=has_ends, dtype=mx.float32,
                       shard=shard, vocab_slice=vocab)
    after = sum(resident_bytes(p) for p in files)
    names = stage.loaded_tensors
    shares = read_shares(names, config, shard, vocab, has_ends)
    whole = share = 0
    gguf = hasattr(checkpoint, "gguf")
    for name in names:
        info = checkpoint.tensors[name]
        if gguf and name.rsplit(".", 1)[-1] in ("scales", "biases", "ggml_type"):
            continue  # a GGUF triple's three entries come from one tensor: counted once (its weight)
        nbytes = info.source[0].nbytes if gguf else sum(end - begin for _, begin, end in checkpoint.spans(name))
        whole += nbytes
        if name not in shares:
            share += nbytes
            continue
        axis, begin, end, full = shares[name]
        share += nbytes * (end - begin) // full
    return {"member": member, "share_reads": os.environ.get("PIPELINE_SHARE_READS", "1") != "0",
            "page_cache_bytes": after - before, "reader_bytes": getattr(checkpoint, "bytes_read", None),
            "owned_tensor_bytes": whole, "share_bytes": share, "file_bytes": sum(p.stat().st_size for p in files)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or GGUF file (default: the default model)")
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--member", type=int, default=None, help=argparse.SUPPRESS)  # one run, in this process
    args = parser.parse_args()
    if args.member is not None:
        print(json.dumps(member_run(args.model, args.tensor_parallel, args.member)))
        return
    source = Path(args.model) if args.model else None
    if source is None:
        from pipeline.checkpoints.default_model import default_model_dir

        source = default_model_dir(progress=False)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        copy = Path(tmp) / source.name  # private: no other process maps it, so dropping its pages works
        (shutil.copytree if source.is_dir() else shutil.copy)(source, copy)
        for member in range(args.tensor_parallel):
            for share_reads in ("1", "0"):
                env = dict(os.environ, PIPELINE_SHARE_READS=share_reads, OPENBLAS_NUM_THREADS="1")
                job = subprocess.run([sys.executable, __file__, "--model", str(copy), "--tensor-parallel",
                                      str(args.tensor_parallel), "--member", str(member)], capture_output=True,
                                     text=True, env=env, cwd=REPO)
                if job.returncode:
                    sys.exit(job.stderr)
                rows.append(json.loads(job.stdout.strip().splitlines()[-1]))
    mib = 2**20
    print(f"model {source} (files {rows[0]['file_bytes'] / mib:.1f} MiB), --tensor-parallel {args.tensor_parallel}")
    print("member  share reads  its tensors MiB  its share MiB  read into page cache MiB  reader's count MiB")
    for r in rows:
        reader = "-" if r["reader_bytes"] is None else f"{r['reader_bytes'] / mib:.1f}"
        print(f"{r['member']:>6}  {'on' if r['share_reads'] else 'off':>11}  {r['owned_tensor_bytes'] / mib:>15.1f}  "
              f"{r['share_bytes'] / mib:>13.1f}  {r['page_cache_bytes'] / mib:>24.1f}  {reader:>18}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(source), "tensor_parallel": args.tensor_parallel, "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
