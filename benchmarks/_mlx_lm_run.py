"""One mlx-lm run (a fresh process per run): load a model folder with `mlx_lm.load`, generate
greedily from the given token ids with `stream_generate`, print one JSON line of timings.

--blas PATH   load that BLAS with RTLD_GLOBAL before mlx is imported (what pipeline does)
--dense       dequantize MLX-quantized layers to fp32 after loading (pipeline's --weights-in-memory fp32)
--pipeline-blas  `import pipeline` first: pipeline's whole BLAS set-up (OpenBLAS, its threads, the
              batch-invariant BLAS shim), so that only the runtimes differ
--as-published  keep the checkpoint's float dtype (default: cast floats to fp32, the dtype pipeline
              computes in: mlx-lm on CPU in fp16/bf16 is 20x slower)
"""

from __future__ import annotations

import argparse
import json
import resource

from _mlx_lm_common import add_blas_args, dequantize_to_fp32, preload_blas, timed_stream_generate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-ids", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--as-published", action="store_true")
    add_blas_args(parser)
    args = parser.parse_args()
    preload_blas(args)

    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(args.model)
    if not args.as_published:
        model.set_dtype(mx.float32)
    if args.dense:
        dequantize_to_fp32(model)
    mx.eval(model.parameters())

    ids = [int(x) for x in args.prompt_ids.split(",")]
    out = timed_stream_generate(model, tokenizer, ids, args.max_tokens)
    out["peak_rss"] = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
