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
import json
import resource

from _mlx_lm_common import add_blas_args, dequantize_to_fp32, preload_blas, timed_batch_generate, timed_stream_generate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-ids", default=None)
    parser.add_argument("--prompts", default=None)
    parser.add_argument("--max-tokens", type=int, required=True)
    add_blas_args(parser, pipeline_blas=False)
    args = parser.parse_args()
    preload_blas(args)

    import mlx.core as mx
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init()
    model, tokenizer = sharded_load(args.model, pipeline_group=group)
    model.set_dtype(mx.float32)
    if args.dense:
        dequantize_to_fp32(model)
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))

    # Every rank runs the same generation loop in lockstep; rank 0 reports.
    if args.prompts:
        out = timed_batch_generate(model, tokenizer, json.load(open(args.prompts)), args.max_tokens)
    else:
        out = timed_stream_generate(model, tokenizer, [int(x) for x in args.prompt_ids.split(",")], args.max_tokens)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peaks = mx.distributed.all_gather(mx.array([peak / 2**20], dtype=mx.float32), stream=mx.cpu)
        mx.eval(peaks)
        out["peak_rss"] = [int(p * 2**20) for p in peaks.tolist()]
    if group.rank() == 0:
        print(json.dumps(out), flush=True)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # leave together: no broken sockets


if __name__ == "__main__":
    main()
