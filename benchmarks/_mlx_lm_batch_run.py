"""One mlx-lm `batch_generate` run (a fresh process): prompts as token ids from a JSON file,
greedy, prints one JSON line: generated tokens, seconds inside batch_generate, tok/s, texts.

--pipeline-blas  `import pipeline` first (OpenBLAS, threads, the batch-invariant BLAS shim)
--blas PATH      or load that BLAS with RTLD_GLOBAL before mlx is imported
--dense          dequantize quantized layers to fp32 after loading
Floats are cast to fp32 as in _mlx_lm_run.py.
"""

from __future__ import annotations

import argparse
import json

from _mlx_lm_common import add_blas_args, dequantize_to_fp32, preload_blas, timed_batch_generate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON file: [[ids...], ...]")
    parser.add_argument("--max-tokens", type=int, required=True)
    add_blas_args(parser)
    args = parser.parse_args()
    preload_blas(args)

    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(args.model)
    model.set_dtype(mx.float32)
    if args.dense:
        dequantize_to_fp32(model)
    mx.eval(model.parameters())
    print(json.dumps(timed_batch_generate(model, tokenizer, json.load(open(args.prompts)), args.max_tokens)))


if __name__ == "__main__":
    main()
