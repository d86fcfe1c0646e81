"""A function-preserving 256-aligned copy of the default model (SmolLM2-135M-Instruct) for
benchmarks/gguf_accuracy.py --model padded (issue 37).

Why: SmolLM2's hidden size is 576, not a multiple of 256, so llama-quantize gives every matrix whose rows
are 576 wide Q4_0 / Q5_0 / IQ4_NL instead of the K-quant or i-quant asked for; each such type lands only on
the 30 ffn_down matrices. This copy has hidden size 768, so every type lands on every matrix, and computes
the same function as the original (to float rounding):

- the hidden size 576 -> 768 with zeros at the end: the token embedding gets 192 zero columns; every
  matrix that reads the residual stream (q, k, v, gate, up; the tied LM head is the embedding) zero
  columns there, every matrix that writes it (o, down) zero rows, so the padded dimensions stay exactly
  zero through the stream, in every quantized type too (a zero row is whole zero blocks: scale 0);
- RMSNorm over 768 values of which 192 are zero takes mean(x^2) * 576/768: every RMSNorm weight is
  scaled by sqrt(576/768) and the epsilon by 576/768, so that w' / sqrt(ms' + eps') = w / sqrt(ms + eps);
- attention: o's input is heads x head_dim = 9 x 64 = 576; padded to 12 heads (768; head_dim stays
  768 / 12 = 64, what llama.cpp derives) and 4 key/value heads (3 query heads each, as before: real
  heads 0-8 keep key/value heads 0-2 under GQA). The 3 new query heads (9-11) have zero q rows and
  read the new key/value head 3, whose k and v rows are zero: a zero query attends uniformly, and its
  output, the mean of v, is exactly zero only because its v is. (Zero query heads sharing a real
  key/value head, 4 per group, would output a nonzero mean of real v rows, which their o columns must
  cancel: zero columns in a block beside real ones, which the grid i-quants (IQ1/IQ2/IQ3: no zero in
  their grids) cannot hold exactly, so the file's function would change with the type.)
  llama.cpp's GGUF permutes q/k rows for its RoPE layout within each head (convert_hf_to_gguf's
  permute: reshape(n_head, 2, head_dim/2, ...).swapaxes(1, 2)), so whole heads appended at the end are
  the same rows in either order: the file's q/k rows are copied as they are.

Written as an F32 GGUF with the gguf package (the weights dequantized by the gguf package's dequantizers,
llama.cpp's), every KV of the original copied (tokenizer, chat template), the shape keys changed:
embedding_length 768, head_count 12, head_count_kv 4, layer_norm_rms_epsilon x 0.75, file_type F32.

    python benchmarks/padded_model.py            # write the file (once) and print its path
    python benchmarks/padded_model.py --check    # max logit difference padded vs original (transformers, float32)
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

HIDDEN = 768
HEADS = 12
KV_HEADS = 4
NAME = f"SmolLM2-135M-Instruct-padded{HIDDEN}"


def source_gguf() -> Path:
    sys.path.insert(0, str(common.REPO))
    from pipeline.checkpoints.default_model import find_default_gguf

    return find_default_gguf()


def padded_path() -> Path:
    return common.cache_dir() / "gguf_types" / "padded" / f"{NAME}.F32.gguf"


def pad_tensor(name: str, w, hidden: int, heads: int, kv_heads: int, head_dim: int, scale: float):
    """The padded copy of one tensor (numpy, GGUF's row-major (rows, cols) = (out, in) order)."""
    import numpy as np

    base = name.removesuffix(".weight")
    if w.ndim == 1:  # the RMSNorm weights (the only vectors in the file)
        assert base.endswith("_norm"), name
        out = np.zeros(HIDDEN, np.float32)
        out[:hidden] = w * np.float32(scale)
        return out
    kind = base.rsplit(".", 1)[-1]
    rows = {"token_embd": w.shape[0], "attn_q": HEADS * head_dim, "attn_k": KV_HEADS * head_dim,
            "attn_v": KV_HEADS * head_dim, "attn_output": HIDDEN, "ffn_gate": w.shape[0], "ffn_up": w.shape[0],
            "ffn_down": HIDDEN}[kind]
    cols = HEADS * head_dim if kind == "attn_output" else w.shape[1] if kind == "ffn_down" else HIDDEN
    expected_in = {"attn_output": heads * head_dim, "ffn_down": w.shape[1]}.get(kind, hidden)
    assert w.shape[1] == expected_in, (name, w.shape)
    out = np.zeros((rows, cols), np.float32)
    out[:w.shape[0], :w.shape[1]] = w  # real heads first, in the file's (RoPE-permuted within each head) order
    return out


def write_padded(dest: Path | None = None, source: Path | None = None) -> Path:
    """Write the padded F32 GGUF (once; an existing file is kept) and return its path."""
    import gguf
    import numpy as np
    dest = dest or padded_path()
    if dest.is_file():
        return dest
    source = source or source_gguf()
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    assert arch == "llama", arch
    get = lambda key: reader.fields[f"{arch}.{key}"].contents()  # noqa: E731
    hidden, heads, kv_heads = get("embedding_length"), get("attention.head_count"), get("attention.head_count_kv")
    head_dim = hidden // heads
    assert HIDDEN % 256 == 0 and HIDDEN // HEADS == head_dim and HEADS // KV_HEADS == heads // kv_heads, \
        (hidden, heads, kv_heads)
    assert f"{arch}.attention.key_length" not in reader.fields  # head_dim is derived, as above
    eps = float(get("attention.layer_norm_rms_epsilon"))
    changed = {f"{arch}.embedding_length": HIDDEN, f"{arch}.attention.head_count": HEADS,
               f"{arch}.attention.head_count_kv": KV_HEADS,
               f"{arch}.attention.layer_norm_rms_epsilon": eps * hidden / HIDDEN,
               "general.file_type": int(gguf.LlamaFileType.ALL_F32),
               "general.name": f"{reader.fields['general.name'].contents()} padded {hidden}->{HIDDEN}"}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.quantization_version"):
            continue
        value = changed.get(key, field.contents())
        writer.add_key_value(key, value, field.types[0], sub_type=field.types[1] if len(field.types) > 1 else None)
    scale = math.sqrt(hidden / HIDDEN)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        writer.add_tensor(t.name, pad_tensor(t.name, w, hidden, heads, kv_heads, head_dim, scale))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dest)
    return dest


def check(prompt: str = "The history of the river valley begins with the first farmers who settled along its banks.") -> dict:
    """Max |logit difference| padded vs original on one prompt, both read by transformers' GGUF loader
    (dequantized, q/k un-permuted by its own code: independent of pipeline's loader), float32."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original, padded = source_gguf(), write_padded()
    import gguf

    hidden = gguf.GGUFReader(original).fields["llama.embedding_length"].contents()
    tok = AutoTokenizer.from_pretrained(str(original.parent), gguf_file=original.name)
    ids = torch.tensor([tok.encode(prompt)])
    logits = []
    for path in (original, padded):
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        logits.append(out.logits[0].numpy().astype(np.float64))
        if path == padded:  # the padded dimensions of the residual stream, every layer
            pad_max = max(float(h[0, :, -(HIDDEN - hidden):].abs().max()) for h in out.hidden_states)
        del model
    diff = np.abs(logits[0] - logits[1])
    return {"tokens": int(ids.shape[1]), "max_abs_logit_diff": float(diff.max()),
            "max_abs_logit": float(np.abs(logits[0]).max()),
            "argmax_equal": bool((logits[0].argmax(-1) == logits[1].argmax(-1)).all()),
            "max_abs_padded_dims_in_residual": pad_max}


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        print(check())
    else:
        print(write_padded())
