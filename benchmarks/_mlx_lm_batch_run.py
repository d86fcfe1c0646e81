"""One mlx-lm `batch_generate` run (a fresh process): prompts as token ids from a JSON file,
greedy, prints one JSON line: generated tokens, seconds inside batch_generate, tok/s, texts.

--pipeline-blas  `import pipeline` first (OpenBLAS, threads, the batch-invariant BLAS shim)
--blas PATH      or load that BLAS with RTLD_GLOBAL before mlx is imported
--dense          dequantize quantized layers to fp32 after loading
Floats are cast to fp32 as in _mlx_lm_run.py.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON file: [[ids...], ...]")
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--blas", default=None)
    parser.add_argument("--pipeline-blas", action="store_true")
    parser.add_argument("--dense", action="store_true")
    args = parser.parse_args()
    if args.blas:
        ctypes.CDLL(args.blas, mode=ctypes.RTLD_GLOBAL)
    if args.pipeline_blas:
        import pipeline  # noqa: F401

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten
    from mlx_lm import batch_generate, load

    model, tokenizer = load(args.model)
    model.set_dtype(mx.float32)
    if args.dense:
        for path, module in list(model.named_modules()):
            if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                w = mx.dequantize(module.weight, module.scales, module.get("biases"), group_size=module.group_size,
                                  bits=module.bits, mode=module.mode).astype(mx.float32)
                dense = nn.Linear(w.shape[1], w.shape[0], bias=False) if isinstance(module, nn.QuantizedLinear) \
                    else nn.Embedding(*w.shape)
                dense.weight = w
                mx.eval(dense.parameters())
                model.update_modules(tree_unflatten([(path, dense)]))
    mx.eval(model.parameters())
    prompts = json.load(open(args.prompts))
    start = time.perf_counter()
    response = batch_generate(model, tokenizer, prompts, max_tokens=args.max_tokens, return_token_ids=True)
    seconds = time.perf_counter() - start
    tokens = sum(len(t) for t in response.token_ids)
    print(json.dumps({"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                      "prompt_tokens": response.stats.prompt_tokens, "texts": response.texts}))


if __name__ == "__main__":
    main()
