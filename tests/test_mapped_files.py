"""Weights over their files' mapped pages (mapped_files.py, mapped_files.cpp) and the writer that keeps
files mappable (safetensors_file.py): same values as a read into new memory, no memory of MLX's own,
nothing written back, mappings gone with their arrays."""

import gc
import json

import mlx.core as mx
import numpy as np
import pytest

from pipeline.kernels import mapped_files, qmm
from pipeline.checkpoints import safetensors_file
from pipeline.checkpoints.safetensors_checkpoint import Checkpoint


@pytest.fixture
def mapping(kernels, monkeypatch):
    monkeypatch.delenv(mapped_files.ENV, raising=False)
    assert mapped_files.available()
    return kernels


def _arrays() -> dict[str, mx.array]:
    """Every width, in an order that would leave wide tensors misaligned if written as given."""
    mx.random.seed(3)
    return {"a.bytes": mx.array(np.arange(3, dtype=np.uint8)),  # 3 bytes first: MLX's writer misaligns the rest
            "b.half": mx.random.normal((5,)).astype(mx.float16),
            "c.bf16": mx.random.normal((7, 9)).astype(mx.bfloat16),
            "d.float": mx.random.normal((33, 17)),
            "e.words": mx.random.randint(0, 2**30, (16, 8)).astype(mx.uint32),
            "f.int": mx.array(np.arange(-5, 6, dtype=np.int32)),
            "g.int64": mx.array(np.arange(3, dtype=np.int64))}


def _same(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())


def test_writer_aligns_every_tensor_and_the_safetensors_library_reads_it(tmp_path):
    import torch
    from safetensors import safe_open

    arrays = _arrays()
    safetensors_file.save(tmp_path / "m.safetensors", arrays, metadata={"format": "mlx"})
    infos = Checkpoint(tmp_path).tensors
    for name, a in arrays.items():
        assert infos[name].begin % a.dtype.size == 0, name  # mappable
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:  # an independent reader
        assert f.metadata() == {"format": "mlx"}
        for name, a in arrays.items():
            theirs = f.get_tensor(name)
            ours = np.array(a.astype(mx.float32)) if a.dtype == mx.bfloat16 else np.array(a)
            assert np.array_equal(theirs.float().numpy() if theirs.dtype == torch.bfloat16 else theirs.numpy(), ours)
    loaded = mx.load(str(tmp_path / "m.safetensors"))
    assert all(_same(loaded[name], a) for name, a in arrays.items())


def test_mapped_reads_equal_reads_into_new_memory_and_allocate_nothing(tmp_path, mapping, monkeypatch):
    arrays = _arrays()
    safetensors_file.save(tmp_path / "m.safetensors", arrays)
    mx.clear_cache()
    before = mx.get_active_memory()
    checkpoint = Checkpoint(tmp_path)
    mapped = {name: checkpoint.read(name) for name in arrays}
    mx.eval(list(mapped.values()))
    assert mx.get_active_memory() == before  # the file's pages, not MLX's buffers
    assert mapping.mapped_files() == 1
    monkeypatch.setenv(mapped_files.ENV, "0")
    read = {name: Checkpoint(tmp_path).read(name) for name in arrays}
    mx.eval(list(read.values()))
    assert mx.get_active_memory() > before  # the switch works: MLX read them into its own memory
    for name, a in arrays.items():
        assert _same(mapped[name], a) and _same(read[name], a), name
        assert _same(mapped[name] * 2 + 1, a * 2 + 1), name  # operations read the mapped pages
    del mapped
    gc.collect()
    assert mapping.mapped_files() == 0  # unmapped with its last array


def test_a_misaligned_tensor_is_read_into_new_memory(tmp_path, mapping):
    arrays = _arrays()
    mx.save_safetensors(str(tmp_path / "m.safetensors"), arrays)  # MLX's writer: offsets as they fall
    checkpoint = Checkpoint(tmp_path)
    assert any(info.begin % arrays[name].dtype.size for name, info in checkpoint.tensors.items())
    for name, a in arrays.items():
        assert _same(checkpoint.read(name), a), name


def test_a_mapped_weight_is_never_rewritten_in_place(tmp_path, mapping):
    """The int8 repack rewrites a buffer in place only where MLX's allocator owns it: a mapped weight
    (and the file behind it) keeps its bytes, the repack goes to new memory, the same as a copy's."""
    if not hasattr(mapping, "int8_repack"):
        pytest.skip("no int8 products")
    mx.random.seed(0)
    w = mx.random.normal((64, 256))
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    safetensors_file.save(tmp_path / "m.safetensors", {"l.weight": q, "l.scales": s, "l.biases": b})
    file_bytes = (tmp_path / "m.safetensors").read_bytes()
    checkpoint = Checkpoint(tmp_path)
    mq, ms, mb = (checkpoint.read(f"l.{part}") for part in ("weight", "scales", "biases"))
    copied = mapping.int8_repack(q, s, b, 64, 4, in_place=False)
    repacked = mapping.int8_repack(mq, ms, mb, 64, 4, in_place=True)
    assert all(_same(x, y) for x, y in zip(repacked, copied))
    assert _same(mq, q) and _same(ms, s) and _same(mb, b)
    assert (tmp_path / "m.safetensors").read_bytes() == file_bytes


def test_a_stage_loads_the_same_mapped_or_read(tiny_models, mapping, monkeypatch):
    """A Hugging Face folder (float32, written by the safetensors library: aligned) loads over its mapped
    pages, to the same parameters as read into new memory, as stored (float32) and cast (bfloat16)."""
    from conftest import load_stages
    from mlx.utils import tree_flatten

    folder = tiny_models["qwen3"]
    for dtype in (mx.float32, mx.bfloat16):
        mapped = load_stages(folder, [(0, 4)], dtype=dtype)[0]
        assert mapping.mapped_files() == (1 if dtype == mx.float32 else 0)  # kept as stored, or cast from the pages
        monkeypatch.setenv(mapped_files.ENV, "0")
        read = load_stages(folder, [(0, 4)], dtype=dtype)[0]
        monkeypatch.delenv(mapped_files.ENV)
        theirs, ours = dict(tree_flatten(read.model.parameters())), dict(tree_flatten(mapped.model.parameters()))
        assert theirs.keys() == ours.keys() and all(_same(ours[k], theirs[k]) for k in theirs)
        del mapped, read, theirs, ours
        gc.collect()
    assert mapping.mapped_files() == 0


def test_a_file_larger_than_memory_maps(tmp_path, mapping):
    """A mapping is read-only: a writable private one counts the whole file against the kernel's commit
    limit, and a shard larger than RAM + swap (a 64 GiB sparse file here) would not map at all."""
    size = 64 << 30
    small = np.arange(4, dtype=np.float32)
    header = json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "big": {"dtype": "U8", "shape": [size], "data_offsets": [16, 16 + size]}}).encode()
    header += b" " * (-(8 + len(header)) % 8)
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + small.tobytes())
        f.truncate(8 + len(header) + 16 + size)  # sparse: no disk used
    before = mapping.mapped_files()
    t = Checkpoint(tmp_path).read("t")
    assert mapping.mapped_files() == before + 1
    assert np.array_equal(np.array(t), small)


def test_writer_writes_empty_tensors_and_refuses_what_safetensors_cannot_hold(tmp_path):
    arrays = {"empty": mx.zeros((0, 4)), "scalar": mx.array(2.5), "w": mx.arange(6, dtype=mx.float32).reshape(2, 3)}
    safetensors_file.save(tmp_path / "m.safetensors", arrays)
    loaded = mx.load(str(tmp_path / "m.safetensors"))
    assert all(_same(loaded[name], a) for name, a in arrays.items())
    with pytest.raises(ValueError, match=r"no safetensors dtype for x \(mlx.core.complex64\)"):
        safetensors_file.save(tmp_path / "c.safetensors", {"x": mx.array([1 + 2j]), "w": arrays["w"]})


def _file_with_header(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("bad", [{"shape": [3, 4]},  # 48 bytes claimed over a 32-byte range
                                 {"shape": [-2, -4]},  # negative dimensions whose product fits
                                 {"data_offsets": [32, 16]},  # a range that ends before it starts
                                 {"shape": "2x4"},
                                 {"dtype": ["F32"]}])
def test_a_header_whose_shape_and_bytes_disagree_is_refused(tmp_path, mapping, bad):
    """A tensor's shape must fill its byte range exactly: a mapped array is the bytes from its offset on,
    so a corrupt header would otherwise hand out its neighbour's bytes (mx.load refused such a file)."""
    from pipeline.util.errors import UserError

    header = {"a": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [32, 48]}}
    data = np.arange(12, dtype=np.float32).tobytes()
    _file_with_header(tmp_path / "model.safetensors", header, data)
    assert _same(Checkpoint(tmp_path).read("a"), mx.arange(8, dtype=mx.float32).reshape(2, 4))  # the good file
    header["a"].update(bad)
    _file_with_header(tmp_path / "model.safetensors", header, data)
    with pytest.raises(UserError, match=r"model.safetensors(: tensor a has unsupported dtype| is corrupt \(tensor a: .*"
                                        r"download it again)"):
        Checkpoint(tmp_path)


def test_mapping_a_tensor_lets_other_python_threads_run(tmp_path, mapping):
    """Populating a tensor's pages (a disk read when cold) runs without the GIL: the loader's other
    threads (a GGUF's decoders, the bar) go on meanwhile."""
    import os
    import threading
    import time

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs: the spinner and the page work")

    size = 512 << 20
    path = tmp_path / "model.safetensors"
    _file_with_header(path, {"t": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}, b"")
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) + size)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    offset = Checkpoint(tmp_path).tensors["t"].begin
    counts, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            counts[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        while counts[0] < 1000:  # running
            pass
        start, at_start = time.perf_counter(), counts[0]
        time.sleep(0.05)  # the spinner alone: its pace
        pace = (counts[0] - at_start) / (time.perf_counter() - start)
        start, at_start = time.perf_counter(), counts[0]
        array = mapped_files.mapped_array(path, offset, (size,), mx.uint8)
        seconds, spun = time.perf_counter() - start, counts[0] - at_start
    finally:
        stop.set()
        spinner.join()
    assert array is not None and array.size == size
    # holding the GIL, the spinner would get at most a switch interval (5 ms) of the call's 0.05-0.4 s (measured:
    # 0.05 of its pace); without, most of it (0.6-1.0), less where the kernel's page work shares its CPU
    assert spun > 0.2 * pace * seconds, (spun, pace, seconds)
