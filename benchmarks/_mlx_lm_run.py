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
import ctypes
import json
import resource
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-ids", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--blas", default=None)
    parser.add_argument("--dense", action="store_true")
    parser.add_argument("--as-published", action="store_true")
    parser.add_argument("--pipeline-blas", action="store_true")
    args = parser.parse_args()
    if args.blas:
        ctypes.CDLL(args.blas, mode=ctypes.RTLD_GLOBAL)
    if args.pipeline_blas:
        import pipeline  # noqa: F401 -- loads OpenBLAS and the shim before mlx

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten
    from mlx_lm import load, stream_generate

    model, tokenizer = load(args.model)
    if not args.as_published:
        model.set_dtype(mx.float32)
    if args.dense:
        for path, module in list(model.named_modules()):
            if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
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
    mx.eval(model.parameters())

    ids = [int(x) for x in args.prompt_ids.split(",")]
    text, tokens = "", []
    start = time.perf_counter()
    first = last = None
    finish = None
    for response in stream_generate(model, tokenizer, ids, max_tokens=args.max_tokens):
        now = time.perf_counter()
        first = first or now
        last = now
        text += response.text
        finish = response.finish_reason
        if finish != "stop":
            tokens.append(int(response.token))
    generated = len(tokens)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"prompt_tokens": len(ids), "ttft_s": first - start, "prefill_tps": len(ids) / (first - start),
                      "decode_tps": (generated - 1) / (last - first) if generated > 1 and last > first else 0.0,
                      "generated": generated, "finish": finish, "peak_rss": [peak], "text": text}))


if __name__ == "__main__":
    main()
