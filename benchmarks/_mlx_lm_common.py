"""What the mlx-lm runner scripts (_mlx_lm_run.py, _mlx_lm_batch_run.py, _mlx_lm_pipeline_run.py)
share: the BLAS set-up before mlx is imported, fp32 weights like pipeline's, and their timings.
Importing this module does not import mlx: `preload_blas` must run first.
"""

from __future__ import annotations

import argparse
import ctypes
import time


def add_blas_args(parser: argparse.ArgumentParser, pipeline_blas: bool = True) -> None:
    parser.add_argument("--blas", default=None, help="load this BLAS with RTLD_GLOBAL before mlx is imported")
    parser.add_argument("--dense", action="store_true", help="dequantize quantized layers to fp32 after loading")
    if pipeline_blas:
        parser.add_argument("--pipeline-blas", action="store_true",
                            help="`import pipeline` first: its whole BLAS set-up (OpenBLAS, threads, the shim)")


def preload_blas(args: argparse.Namespace) -> None:
    """Before the first `import mlx.core`, which binds its BLAS symbols as it loads."""
    if args.blas:
        ctypes.CDLL(args.blas, mode=ctypes.RTLD_GLOBAL)
    if getattr(args, "pipeline_blas", False):
        import pipeline  # noqa: F401 -- loads OpenBLAS and the shim before mlx


def dequantize_to_fp32(model) -> None:
    """Every quantized Linear/Embedding of `model` replaced by its fp32 dequantization, as
    pipeline's --weights-in-memory fp32 holds them (biases kept)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    for path, module in list(model.named_modules()):
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        w = mx.dequantize(module.weight, module.scales, module.get("biases"), group_size=module.group_size,
                          bits=module.bits, mode=module.mode).astype(mx.float32)
        if isinstance(module, nn.QuantizedLinear):
            dense = nn.Linear(w.shape[1], w.shape[0], bias="bias" in module)
            if "bias" in module:
                dense.bias = module.bias
        else:
            dense = nn.Embedding(*w.shape)
        dense.weight = w
        mx.eval(dense.parameters())
        model.update_modules(tree_unflatten([(path, dense)]))


def timed_stream_generate(model, tokenizer, ids: list[int], max_tokens: int) -> dict:
    """Greedy `stream_generate` from token ids: prefill/decode tok/s and TTFT, timed as pipeline's."""
    from mlx_lm import stream_generate

    text, tokens = "", []
    start = time.perf_counter()
    first = last = None
    finish = None
    for response in stream_generate(model, tokenizer, ids, max_tokens=max_tokens):
        now = time.perf_counter()
        first = first or now
        last = now
        text += response.text
        finish = response.finish_reason
        if finish != "stop":
            tokens.append(int(response.token))
    generated = len(tokens)
    return {"prompt_tokens": len(ids), "ttft_s": first - start, "prefill_tps": len(ids) / (first - start),
            "decode_tps": (generated - 1) / (last - first) if generated > 1 and last > first else 0.0,
            "generated": generated, "finish": finish, "text": text}


def timed_batch_generate(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy `batch_generate`: generated tokens over the seconds inside it."""
    from mlx_lm import batch_generate

    start = time.perf_counter()
    response = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True)
    seconds = time.perf_counter() - start
    tokens = sum(len(t) for t in response.token_ids)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "prompt_tokens": response.stats.prompt_tokens, "texts": response.texts}
