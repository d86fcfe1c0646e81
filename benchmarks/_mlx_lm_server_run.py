"""`mlx_lm.server` with pipeline's benchmark set-up: the BLAS loaded before mlx (see
_mlx_lm_common.py) and every quantized layer dequantized to fp32 after loading, as pipeline holds
its weights, so that the two servers differ in their serving, not in their matmuls.

    python benchmarks/_mlx_lm_server_run.py [--blas PATH | --pipeline-blas] [--dense] -- SERVER ARGS...

Under `mlx.launch --backend ring -n N` with `--pipeline` among the server's arguments, every rank
loads its layers (mlx-lm's pipeline mode) and rank 0 answers HTTP.
"""

from __future__ import annotations

import argparse
import sys

from _mlx_lm_common import add_blas_args, dequantize_to_fp32, preload_blas

LISTEN_BACKLOG = 2048


def main() -> None:
    parser = argparse.ArgumentParser()
    add_blas_args(parser)
    parser.add_argument("server_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    preload_blas(args)

    import mlx.core as mx
    from mlx_lm import server

    def in_fp32(load):
        def loaded(*a, **kw):
            result = load(*a, **kw)
            model = result[0]
            model.set_dtype(mx.float32)
            if args.dense:
                dequantize_to_fp32(model)
            mx.eval(model.parameters())
            return result
        return loaded

    # http.server's listen backlog is socketserver's default of 5: 16 clients connecting at once
    # overflow it, the kernel drops the handshakes it cannot queue, and those clients get
    # "connection reset by peer" a minute later (seen as ListenOverflows in `nstat`). pipeline
    # serve listens with a backlog of 2048 (pipeline/serve/server.py); the same here, so that the
    # two servers differ in their serving, not in their socket. mlx-lm's run() builds its
    # ThreadingHTTPServer from this class, so the class attribute is the one it reads.
    server.ThreadingHTTPServer.request_queue_size = LISTEN_BACKLOG
    server.load = in_fp32(server.load)
    server.sharded_load = in_fp32(server.sharded_load)
    rest = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    sys.argv = ["mlx_lm.server", *rest]
    server.main()


if __name__ == "__main__":
    main()
