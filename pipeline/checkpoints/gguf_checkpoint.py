"""A GGUF file (or split set) as a `Checkpoint`: the tensors a model folder would hold, under the same
Hugging Face names, read from the GGUF in place, each rank only its own.

The index is built from the header alone (gguf_file.py): llama.cpp's tensor names map to the names
our modules load (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`), and a
quantized tensor appears as the three arrays MLX quantization holds (`.weight` packed, `.scales`,
`.biases`), in the layout quants.py maps it to: exactly where MLX can carry its values, in the file's own
blocks for the types pipeline's kernels compute so (quants.NATIVE: IQ4_NL, IQ4_XS, Q6_K; quants.BLOCKS: the K-quants,
ternary and grid i-quant types as the file's row bytes, expert stacks included), re-quantized otherwise. Reading one of the three decodes the GGUF tensor once, in row chunks, from its byte range.
The index loads no MLX (the planner reads it): MLX is imported where arrays are made.

What llama.cpp's converter changed from the Hugging Face checkpoint is undone here:
- Llama-architecture q/k rows are permuted for llama.cpp's rope (LlamaModel.permute): unpermuted.
- DeepSeek/Kimi MLA's kv_b_proj is stored split and the key half transposed (attn_k_b [heads,
  latent, nope], attn_v_b [heads, v, latent]; files converted before that keep attn_kv_b): rebuilt
  as one float kv_b_proj, which the model splits again into its absorbed halves at load.
- Experts are stacked per projection (ffn_gate_exps [experts, out, in]): exactly the
  `switch_mlp` tensors our MoE layers hold.
"""

from __future__ import annotations

import mmap
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import quants
from ..models.config import ModelConfig
from ..util import cores
from ..util.errors import UserError
from ..util.switches import turned_off
from . import gguf_glm, gguf_minimax, gguf_qwen35
from .gguf_config import build_config
from .gguf_file import GGUFModel, GGUFTensor, open_gguf
from .safetensors_checkpoint import Checkpoint

# llama.cpp's per-layer tensor names -> the module path inside `model.layers.{i}`.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
# Matrices whose modules hold plain float weights (DeepSeek's router is a parameter, not a Linear).
_FLOAT_ONLY = ("ffn_gate_inp",)

MIN_PIECE_VALUES = 1 << 20  # the smallest piece worth a decoder thread
STRIDED_RUN_SPAN = 16 << 10  # a share's runs this long are prefetched each alone (shorter: its whole extent)


def run_spans(t) -> list[tuple[Path, int, int]]:
    """The byte ranges (file, begin, end) a prefetch asks for to read `t`: its bytes, or for a share read in
    `t.rows` runs `t.stride` apart (share_reads.StridedTensor, share_reads.Runs) each run of STRIDED_RUN_SPAN or
    more alone, else first to last byte."""
    stride, run = getattr(t, "stride", 0), t.nbytes // max(1, t.rows)
    if stride and run >= STRIDED_RUN_SPAN:
        return [(t.file, t.begin + i * stride, t.begin + i * stride + run) for i in range(t.rows)]
    return [(t.file, t.begin, t.begin + ((t.rows - 1) * stride + run if stride else t.nbytes))]


@dataclass(frozen=True)
class Entry:
    """One array of the index: what a model folder would hold under this name, and how to get it
    from the GGUF."""
    dtype: str  # safetensors-style: "U32", "U8", "F32", "F16", "BF16"
    shape: tuple[int, ...]
    source: tuple[GGUFTensor, ...]  # the GGUF tensor(s) it comes from
    how: str  # "float", "dequantized", "exact", "requantized", "native", "mla_kv_b"
    part: str = "weight"  # of an MLX-quantized triple: "weight", "scales", "biases"
    layout: quants.Layout | None = None
    unpermute_heads: int = 0  # Llama q/k: undo llama.cpp's row permutation over this many heads
    transform: str = ""  # a float tensor llama.cpp's converter changed (gguf_qwen35.undo)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * {"U32": 4, "U8": 1, "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U16": 2, "I64": 8}.get(self.dtype, 4)


def hf_name(gguf_name: str) -> tuple[int | None, str] | None:
    """(layer, Hugging Face name) of a llama.cpp tensor name, or None if we hold no such tensor."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES and suffix in ("weight", "bias"):
        return None, f"{GLOBAL_NAMES[base]}.{suffix}"
    m = _LAYER.match(gguf_name)
    if not m:
        return None
    layer, kind, suffix = int(m.group(1)), m.group(2), m.group(3)
    if kind == "exp_probs_b":  # DeepSeek V3's router correction bias
        return layer, f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    if kind in LAYER_NAMES:
        return layer, f"model.layers.{layer}.{LAYER_NAMES[kind]}.{suffix}"
    return None


class GGUFCheckpoint(Checkpoint):
    """A GGUF model as a Checkpoint (see the module docstring). `requantize_bits`/`group_size`: the
    MLX layout for types that cannot map exactly (--quantize / --group-size; None: quants.REQUANTIZED's 8 bits).
    native: whether quants.NATIVE types stay in their own blocks where
    --quantize is not given (None: where pipeline's kernels are expected, which compute them; a conversion
    to a folder says False: other tools read MLX layouts only)."""

    def __init__(self, path: Path | str, requantize_bits: int | None = None, group_size: int = 64,
                 model: GGUFModel | None = None, native: bool | None = None):
        self.gguf = model or open_gguf(path)
        self.folder = self.gguf.path  # what error messages name
        self.files = {part: None for part in self.gguf.parts}
        self.requantize_bits, self.group_size = requantize_bits, group_size
        self.native = quants.native_kernels() if native is None else native
        self.config_dict = build_config(self.gguf)
        self.tensors: dict[str, Entry] = {}
        self._pending: dict[str, Any] = {}  # the other arrays of a triple already decoded
        self._requantized: list[tuple[str, str, int, int, float, float]] = []  # what loaded() reports
        self._requantized_bytes: list[tuple[int, int]] = []  # each one's (bytes in the file, bytes held)
        self.bytes_read = 0  # tensor bytes read so far (what each rank reads, for tests and benchmarks)
        self._pool: ThreadPoolExecutor | None | bool = None  # the decoder's threads (False: one CPU)
        self._maps: dict[Path, mmap.mmap] = {}  # each file mapped once, read-only (_read_bytes)
        self._maps_lock = threading.Lock()
        self._index()

    # -- the index ---------------------------------------------------------------------------------------------

    def _index(self) -> None:
        g, config = self.gguf, self.config_dict
        layers = config["num_hidden_layers"]
        unpermute = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]} \
            if g.architecture == "llama" else {}
        split_mla: dict[int, dict[str, GGUFTensor]] = {}
        if g.architecture == gguf_qwen35.ARCH:
            return self._index_qwen35(layers)
        for tensor in g.tensors.values():
            m = _LAYER.match(tensor.name)
            if m and int(m.group(1)) >= layers + (g.architecture == gguf_glm.ARCH):
                continue  # e.g. a multi-token-prediction layer past the last one we run (GLM's first: its MTP)
            if m and m.group(2) in ("attn_k_b", "attn_v_b"):
                split_mla.setdefault(int(m.group(1)), {})[m.group(2)] = tensor
                continue
            named = hf_name(tensor.name)
            if named is None and g.architecture == gguf_glm.ARCH:
                named = gguf_glm.hf_name(tensor.name, config["indexer_types"]) \
                    or gguf_glm.nextn_name(tensor.name)  # the indexer's, the MTP module's own
                if named == gguf_glm.UNUSED:
                    continue  # a shared layer's indexer (llama.cpp does not run it either), the MTP's copies
            if named is None:
                raise UserError(f"{g.path}: tensor {tensor.name} is not one pipeline knows for the {g.architecture} "
                                "architecture; this GGUF layout is not supported")
            kind = m.group(2) if m else tensor.name.rpartition(".")[0]
            if m and g.architecture == gguf_minimax.ARCH:
                named = named[0], gguf_minimax.our_name(named[0], kind, named[1])
            self._add(named[1], tensor, unpermute.get(kind, 0), float_only=kind in _FLOAT_ONLY)
        for layer, pair in sorted(split_mla.items()):
            if set(pair) != {"attn_k_b", "attn_v_b"}:
                raise UserError(f"{g.path}: layer {layer} has {', '.join(pair)} without its other half "
                                "(attn_k_b and attn_v_b come together): the file is incomplete")
            k_b, v_b = pair["attn_k_b"], pair["attn_v_b"]  # [heads, latent, nope], [heads, v, latent]
            heads, latent, nope = k_b.shape
            v_dim = v_b.shape[1]
            self.tensors[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = Entry(
                "F32", (heads * (nope + v_dim), latent), (k_b, v_b), "mla_kv_b")

    def _index_qwen35(self, layers: int) -> None:
        """Qwen3.5-MoE's tensors (gguf_qwen35.py): names, and the float tensors the converter changed."""
        for tensor in self.gguf.tensors.values():
            named = gguf_qwen35.hf_name(tensor.name)
            if named is None:
                raise UserError(f"{self.gguf.path}: tensor {tensor.name} is not one pipeline knows for the "
                                f"{gguf_qwen35.ARCH} architecture; this GGUF layout is not supported")
            layer, name, kind, transform = named
            if layer is not None and layer >= layers:
                continue  # a multi-token-prediction layer past the last one we run
            if transform:
                self.tensors[name] = Entry("F32", gguf_qwen35.held_shape(tensor.shape, transform), (tensor,),
                                           "dequantized", transform=transform)
            else:
                self._add(name, tensor, 0, float_only=kind in gguf_qwen35.FLOAT_ONLY)

    def _add(self, name: str, tensor: GGUFTensor, unpermute_heads: int, float_only: bool) -> None:
        t = tensor.ggml_type
        if t not in quants.SUPPORTED and t not in quants.INTEGERS:
            raise UserError(f"{self.gguf.path}: tensor {tensor.name} has GGML type {t}, which pipeline cannot read "
                            f"(supported: {', '.join(quants.SUPPORTED)})")
        # in its own blocks: a layer's matrix, the LM head, the token embedding and an expert stack (the kernels'
        # products and gathered products, rows dequantized by gguf_rows.py or the BLOCKS types' kernels) where its
        # type's are computed so (quants.NATIVE_ROWS, quants.BLOCKS); but for MLA's kv_b, which DeepSeek's attention
        # dequantizes after loading to split it
        stack = ".switch_mlp." in name
        ends = name in ("lm_head.weight", "model.embed_tokens.weight")
        native = (self.native and not float_only and not name.endswith("kv_b_proj.weight")
                  and (name.startswith("model.layers.") or ends) and len(tensor.shape) == (3 if stack else 2)
                  and (t in quants.NATIVE_ROWS or t in quants.BLOCKS or not (stack or ends)))
        lay = quants.layout(t, tensor.cols, self.requantize_bits, self.group_size, native)
        if (self.native and not float_only and not self.requantize_bits and t in quants.TIED_BLOCKS
                and name == "model.embed_tokens.weight" and len(tensor.shape) == 2 and tensor.cols % 32 == 0
                and "output.weight" not in self.gguf.tensors):  # a tied Q8_0 embedding: held once, as the file's bytes
            lay = quants.Layout("native", 8, 32, "blocks")
        if lay.kind == "float" or float_only or len(tensor.shape) < 2 or not name.endswith(".weight"):
            if lay.kind == "float":
                dtype = {"F64": "F32"}.get(t, t if t in quants.FLOATS else "F32")
                self.tensors[name] = Entry(dtype, tensor.shape, (tensor,), "float", unpermute_heads=unpermute_heads)
            else:
                self.tensors[name] = Entry("F32", tensor.shape, (tensor,), "dequantized", unpermute_heads=unpermute_heads)
            return
        if tensor.cols % lay.group_size:
            raise UserError(f"{self.gguf.path}: tensor {tensor.name} has rows of {tensor.cols} values, which MLX "
                            f"cannot quantize in groups of {lay.group_size}")
        module = name.removesuffix(".weight")
        for part, (shape, dtype) in quants.packed_shapes(tensor.shape[:-1], tensor.cols, lay, t).items():
            self.tensors[f"{module}.{part}"] = Entry(dtype, shape, (tensor,), lay.kind, part, lay, unpermute_heads)

    # -- reading -----------------------------------------------------------------------------------------------

    def model_config(self):
        return ModelConfig.from_dict(self.config_dict)

    def read(self, name: str):
        if name in self._pending:
            return self._pending.pop(name)
        array = self._read(self.tensors[name], name)
        self._release(self.tensors[name].source)
        return array

    def _read(self, entry: Entry, name: str):
        import mlx.core as mx  # here, where arrays are made: the index (the planner's GGUFFormat) loads no MLX

        if entry.how in ("exact", "requantized", "native"):
            module = name.rsplit(".", 1)[0]
            arrays = self._read_quantized(entry)
            for part, array in arrays.items():
                if part != entry.part and f"{module}.{part}" in self.tensors:
                    self._pending[f"{module}.{part}"] = array
            return arrays[entry.part]
        if entry.how == "mla_kv_b":
            k_b, v_b = (self._read_float(t) for t in entry.source)
            heads, latent, nope = k_b.shape
            kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [heads, nope + v, latent]
            return mx.array(np.ascontiguousarray(kv_b.reshape(-1, latent)))
        tensor = entry.source[0]
        if entry.how == "dequantized":
            array = self._read_float(tensor)
        else:
            raw = self._read_bytes(tensor, 0, tensor.rows)
            self.bytes_read += raw.nbytes
            array = np.frombuffer(raw, dtype=(quants.FLOATS | quants.INTEGERS)[tensor.ggml_type]).reshape(tensor.shape)
            if tensor.ggml_type == "F64":
                array = array.astype(np.float32)
        if entry.unpermute_heads:
            array = unpermute_rows(array, entry.unpermute_heads)
        if entry.transform:
            array = gguf_qwen35.undo(array, entry.transform)
        result = mx.array(array)
        return result.view(mx.bfloat16) if tensor.ggml_type == "BF16" else result

    def _release(self, tensors) -> None:
        """Drops the mapped pages of tensors just decoded from this process (they stay in the page cache):
        a rank's resident memory then counts what it holds, not the file's pages too."""
        for t in tensors:
            mapped = self._maps.get(t.file)
            if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
                first = -(-t.begin // mmap.PAGESIZE) * mmap.PAGESIZE
                extent = (t.rows - 1) * t.stride + t.nbytes // t.rows if getattr(t, "stride", 0) else t.nbytes
                last = (t.begin + extent) // mmap.PAGESIZE * mmap.PAGESIZE
                if last > first:
                    mapped.madvise(mmap.MADV_DONTNEED, first, last - first)

    def in_huge_pages(self, name: str) -> bool:
        """Whether the weight `name` is decoded into a buffer of its own in huge pages."""
        entry = self.tensors.get(name)
        return entry is not None and self._decoded_in_huge_pages(entry)

    @staticmethod
    def _decoded_in_huge_pages(entry: Entry) -> bool:
        """An exact weight with the kernels, unless its rows are reordered into a copy after decoding."""
        kernels = quants.repacker()
        return (entry.how == "exact" and not entry.unpermute_heads and kernels is not None
                and hasattr(kernels, "huge_page_array"))

    def spans(self, name: str) -> list[tuple[Path, int, int]]:
        """The byte ranges (file, begin, end) reading `name` reads: its GGUF tensors' (a share read in runs
        `stride` apart, share_reads.StridedTensor: each run of 16 KiB or more, else first to last byte)."""
        return [span for t in self.tensors[name].source for span in run_spans(t)]

    def _read_bytes(self, tensor: GGUFTensor, row: int, rows: int) -> np.ndarray:
        """Rows [row, row + rows) of `tensor` as raw bytes, uint8 [rows, bytes per row] (any thread:
        the caller counts them in `bytes_read`): a read-only view of the file's mapped pages (no copy
        in new memory: the decoders read the page cache), or read into new memory with PIPELINE_MMAP=0."""
        from ..kernels import mapped_files  # loads mlx.core: indexing a GGUF (`pipeline plan`) must not

        row_bytes = tensor.nbytes // tensor.rows
        step = getattr(tensor, "stride", 0) or row_bytes  # a column share (share_reads.StridedTensor): rows apart
        begin, size = tensor.begin + row * step, (rows - 1) * step + row_bytes
        if step != row_bytes:
            return self._read_strided(tensor, begin, rows, row_bytes, step)
        if not turned_off(mapped_files.ENV):
            with self._maps_lock:
                mapped = self._map(tensor.file)
            if begin + size > len(mapped):
                raise UserError(f"{tensor.file} is truncated or corrupt (tensor {tensor.name}): download it again")
            return np.frombuffer(mapped, np.uint8, size, begin).reshape(rows, row_bytes)
        buffer = np.empty((rows, row_bytes), np.uint8)
        with open(tensor.file, "rb") as f:
            f.seek(begin)
            got = f.readinto(memoryview(buffer).cast("B"))
        if got != buffer.nbytes:
            raise UserError(f"{tensor.file} is truncated or corrupt (tensor {tensor.name}): download it again")
        return buffer

    def random_access(self) -> None:
        """No read-ahead on faults in the file mappings from now on (MADV_RANDOM): a --tensor-parallel rank
        reading only its shares (share_reads.py), whose spans the loader's prefetch asks for; the kernel's
        read-ahead (8 MiB a fault on some disks) would read the other ranks' rows around them too."""
        self.no_read_ahead = True
        for mapped in self._maps.values():
            mapped.madvise(mmap.MADV_RANDOM)

    def _map(self, path: Path) -> mmap.mmap:
        """The file mapped, once (under _maps_lock)."""
        if path not in self._maps:
            with open(path, "rb") as f:
                self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if getattr(self, "no_read_ahead", False):
                self._maps[path].madvise(mmap.MADV_RANDOM)
        return self._maps[path]

    def _read_strided(self, tensor: GGUFTensor, begin: int, rows: int, row_bytes: int, step: int) -> np.ndarray:
        """`rows` runs of `row_bytes` bytes, `step` apart from `begin` (a column share), copied out contiguous:
        only the pages holding them are read (through the mapping), or each run read alone (PIPELINE_MMAP=0)."""
        from ..kernels import mapped_files  # as in _read_bytes

        end = begin + (rows - 1) * step + row_bytes
        if not turned_off(mapped_files.ENV):
            with self._maps_lock:
                mapped = self._map(tensor.file)
            if end > len(mapped):
                raise UserError(f"{tensor.file} is truncated or corrupt (tensor {tensor.name}): download it again")
            span = np.frombuffer(mapped, np.uint8, end - begin, begin)
            return np.ascontiguousarray(np.lib.stride_tricks.as_strided(span, (rows, row_bytes), (step, 1)))
        buffer = np.empty((rows, row_bytes), np.uint8)
        with open(tensor.file, "rb") as f:
            for i in range(rows):
                f.seek(begin + i * step)
                if f.readinto(memoryview(buffer[i])) != row_bytes:
                    raise UserError(f"{tensor.file} is truncated or corrupt (tensor {tensor.name}): download it again")
        return buffer

    def _pieces(self, tensor: GGUFTensor, workers: int = 1) -> list[tuple[int, int]]:
        """(first row, rows) of the chunks a tensor is decoded in: at most CHUNK_VALUES values each,
        and at least one per worker (of at least MIN_PIECE_VALUES values) so all of them decode."""
        step = max(1, quants.CHUNK_VALUES // tensor.cols)
        if workers > 1:
            step = min(step, max(-(-tensor.rows // workers), MIN_PIECE_VALUES // tensor.cols, 1))
        return [(row, min(step, tensor.rows - row)) for row in range(0, tensor.rows, step)]

    def _chunks(self, tensor: GGUFTensor):
        for row, rows in self._pieces(tensor):
            raw = self._read_bytes(tensor, row, rows)
            self.bytes_read += raw.nbytes
            yield row, raw

    def _decoder(self) -> ThreadPoolExecutor | None:
        """Threads that read and decode pieces of exact tensors at once (numpy lets go of the GIL),
        one per CPU this rank may use; None with one CPU."""
        if self._pool is None:
            self._workers = min(16, len(cores.cpus_allowed()))
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="gguf-decode") if self._workers > 1 else False
        return self._pool or None

    def _read_float(self, tensor: GGUFTensor) -> np.ndarray:
        """A whole tensor as float32 in its numpy shape (any type: floats, or the gguf package's dequantizer)."""
        t = tensor.ggml_type
        if t in quants.FLOATS:
            raw = self._read_bytes(tensor, 0, tensor.rows)
            self.bytes_read += raw.nbytes
            if t == "BF16":
                out = (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
            else:
                out = raw.view(quants.FLOATS[t]).astype(np.float32)
            return out.reshape(tensor.shape)
        out = np.empty((tensor.rows, tensor.cols), np.float32)
        for row, raw in self._chunks(tensor):
            out[row:row + len(raw)] = quants.dequantize(raw, t)
        return out.reshape(tensor.shape)

    def _read_quantized(self, entry: Entry) -> dict:
        """The MLX triple (or mxfp4 pair) of a quantized GGUF tensor, decoded chunk by chunk."""
        import mlx.core as mx  # where arrays are made, as in _read

        tensor, lay = entry.source[0], entry.layout
        lead = tensor.shape[:-1]
        arrays = {}
        worst = largest = 0.0
        if entry.how == "native":  # the file's bytes, codes apart from scales (quants.native_arrays)
            parts = {"weight": [], "scales": []} | ({"biases": []} if tensor.ggml_type == "Q6_K" else {})
            if lay.mode == "blocks":  # the row bytes verbatim, and the type id beside them
                parts = {"weight": []}
                arrays["ggml_type"] = mx.array(np.array([quants.block_type(tensor.ggml_type)[0]], np.int32))
            for _, raw in self._chunks(tensor):
                for part, array in zip(parts, quants.native_arrays(raw, tensor.ggml_type)):
                    parts[part].append(array)
            for part, chunks in parts.items():
                array = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
                chunks.clear()
                if entry.unpermute_heads:
                    array = unpermute_rows(array, entry.unpermute_heads)
                arrays[part] = mx.array(array).reshape(*lead, array.shape[-1])
                del array
        elif entry.how == "exact":  # numpy only: pieces decode on the decoder's threads at once
            pool = self._decoder()
            kernels = quants.repacker()
            # every piece decodes its rows of the weight straight into the whole tensor's (no joining copy),
            # which is MLX's own buffer (numpy writes through a view of it: no copy into MLX afterwards), where
            # it is kept one in huge pages, uninitialized: the int8 repack may then rearrange it in place
            # (in_huge_pages) rather than copy it into new huge pages
            held_shape = (tensor.rows, tensor.cols * quants.EXACT[tensor.ggml_type][0] // 8)
            if self._decoded_in_huge_pages(entry):
                held = kernels.huge_page_array(list(held_shape), mx.uint8)
            else:
                held = mx.zeros(held_shape, mx.uint8)
                mx.eval(held)
            weight = np.asarray(held)

            def decode(piece: tuple[int, int]):
                row, rows = piece
                raw = self._read_bytes(tensor, row, rows)
                return raw.nbytes, quants.decode_exact(raw, tensor.ggml_type, kernels, weight[row:row + rows])

            pieces = self._pieces(tensor, self._workers if pool else 1)
            parts: dict[str, list] = {"weight": [weight.view("<u4")], "scales": [], "biases": []}
            for nbytes, decoded in (pool.map(decode, pieces) if pool else map(decode, pieces)):
                self.bytes_read += nbytes
                for part, array in zip(("scales", "biases"), decoded[1:]):
                    if array is not None:
                        parts[part].append(array)
            del weight
            if not entry.unpermute_heads:  # else its rows are reordered below, into a copy
                arrays["weight"] = held.view(mx.uint32).reshape(*lead, -1)
                parts["weight"].clear()
            del held
            for part, chunks in parts.items():
                if chunks:
                    array = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)  # (dtypes promoted alike)
                    chunks.clear()
                    if entry.unpermute_heads:
                        array = unpermute_rows(array, entry.unpermute_heads)
                    arrays[part] = mx.array(array).reshape(*lead, array.shape[-1])
                    del array
        else:  # MLX re-quantizes: one piece at a time, on this thread
            parts = {"weight": [], "scales": [], "biases": []}
            for _, raw in self._chunks(tensor):
                w, s, b, error, top = quants.requantize(raw, tensor.ggml_type, lay.bits, lay.group_size)
                worst, largest = max(worst, error), max(largest, top)
                for part, array in (("weight", w), ("scales", s), ("biases", b)):
                    parts[part].append(array)
            for part, chunks in parts.items():
                array = chunks[0] if len(chunks) == 1 else mx.concatenate(chunks)
                if entry.unpermute_heads:
                    array = unpermute_rows(array, entry.unpermute_heads)
                arrays[part] = array.reshape(*lead, array.shape[-1])
        mx.eval(list(arrays.values()))
        if entry.how == "requantized":
            self._requantized.append((tensor.name, tensor.ggml_type, lay.bits, lay.group_size, worst, largest))
            self._requantized_bytes.append((tensor.nbytes, sum(a.nbytes for a in arrays.values())))
        return arrays

    def loaded(self, names: list[str]) -> None:
        """After a rank's load: one line on stderr naming the tensors re-quantized (how many of each type), what
        they take in memory against their bytes in the file, and the error."""
        self._pending.clear()
        if self._pool:
            self._pool.shutdown()
        self._pool = None
        self._maps.clear()  # each mapping closes with the last view of it
        if not self._requantized:
            return
        by_kind: dict[tuple[str, int, int], list[str]] = {}
        for gguf_name, ggml_type, bits, group, _, _ in self._requantized:
            by_kind.setdefault((ggml_type, bits, group), []).append(gguf_name.removesuffix(".weight"))
        worst = max(self._requantized, key=lambda r: r[4] / (r[5] or 1))
        kinds = "; ".join(f"{len(names)} {t} -> {b}-bit group {g}: {summarize_names(names)}"
                          for (t, b, g), names in by_kind.items())
        in_file, held = (sum(sizes) for sizes in zip(*self._requantized_bytes))
        print(f"note: re-quantized {len(self._requantized)} GGUF tensor{'s' * (len(self._requantized) > 1)} neither MLX "
              f"nor pipeline's kernels hold as stored ({kinds}): {_size(held)} in memory for {_size(in_file)} in the file "
              f"({held / (in_file or 1):.2f}x); largest error {worst[4]:.3g} "
              f"({100 * worst[4] / (worst[5] or 1):.2f}% of that tensor's largest |weight|, {worst[0]}); --quantize sets "
              "the bits (docs/formats.md)", file=sys.stderr, flush=True)
        self._requantized.clear()
        self._requantized_bytes.clear()

    @property
    def requantized_report(self) -> list[tuple[str, str, int, int, float, float]]:
        """(GGUF name, type, bits, group, max |error|, max |weight|) of tensors re-quantized so far."""
        return list(self._requantized)


def _size(n: int) -> str:
    """'1.3 GiB', '97.2 MiB' or '12.0 KiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def summarize_names(names: list[str]) -> str:
    """['blk.0.ffn_down', 'blk.1.ffn_down', 'output'] -> 'blk.0-1.ffn_down, output'."""
    groups: dict[str, list[int]] = {}
    for name in names:
        m = re.match(r"^blk\.(\d+)\.(.+)$", name)
        key, layer = (m.group(2), int(m.group(1))) if m else (name, -1)
        groups.setdefault(key, []).append(layer)
    parts = []
    for key, layers in groups.items():
        real = sorted(l for l in layers if l >= 0)
        if not real:
            parts.append(key)
        elif len(real) == 1:
            parts.append(f"blk.{real[0]}.{key}")
        elif real == list(range(real[0], real[-1] + 1)):
            parts.append(f"blk.{real[0]}-{real[-1]}.{key}")
        else:
            parts.append(f"blk.{{{','.join(map(str, real))}}}.{key}")
    return ", ".join(parts)


def unpermute_rows(a, n_heads: int):
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py LlamaModel.permute:
    `w.reshape(n_heads, 2, head_dim // 2, ...).swapaxes(1, 2)`). Only rows move, so this works the
    same on float weights, packed rows, scales, biases and bias vectors (numpy or mx arrays)."""
    rows = a.shape[0]
    return a.reshape(n_heads, rows // n_heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
