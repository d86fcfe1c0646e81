"""One mlx-lm pipeline-mode run, launched by `mlx.launch --backend ring -n N`: every rank loads
its layers with `mlx_lm.utils.sharded_load(pipeline_group=...)` (PipelineMixin.pipeline), all ranks
run `stream_generate` in lockstep, rank 0 prints one JSON line of timings.

--prompts FILE  a batch instead (JSON [[ids...], ...]) through `batch_generate`, in lockstep too;
               rank 0 prints generated tokens, seconds and tok/s
--blas PATH  load that BLAS with RTLD_GLOBAL before mlx is imported
--dense      dequantize quantized layers to fp32 after loading
Floats are cast to fp32 as in _mlx_lm_run.py.
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
    parser.add_argument("--prompt-ids", default=None)
    parser.add_argument("--prompts", default=None)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--blas", default=None)
    parser.add_argument("--dense", action="store_true")
    args = parser.parse_args()
    if args.blas:
        ctypes.CDLL(args.blas, mode=ctypes.RTLD_GLOBAL)

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten
    from mlx_lm import batch_generate, stream_generate
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init()
    model, tokenizer = sharded_load(args.model, pipeline_group=group)
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
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))

    if args.prompts:
        prompts = json.load(open(args.prompts))
        start = time.perf_counter()
        response = batch_generate(model, tokenizer, prompts, max_tokens=args.max_tokens, return_token_ids=True)
        seconds = time.perf_counter() - start
        tokens = sum(len(t) for t in response.token_ids)
        if group.rank() == 0:
            print(json.dumps({"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                              "texts": response.texts}), flush=True)
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
        return

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
    peaks = mx.distributed.all_gather(mx.array([peak / 2**20], dtype=mx.float32), stream=mx.cpu)
    mx.eval(peaks)
    if group.rank() == 0:
        print(json.dumps({"prompt_tokens": len(ids), "ttft_s": first - start,
                          "prefill_tps": len(ids) / (first - start),
                          "decode_tps": (generated - 1) / (last - first) if generated > 1 and last > first else 0.0,
                          "generated": generated, "finish": finish, "peak_rss": [int(p * 2**20) for p in peaks.tolist()],
                          "text": text}), flush=True)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # leave together: no broken sockets


if __name__ == "__main__":
    main()
