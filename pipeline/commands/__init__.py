"""The commands of `python -m pipeline`, one module each (the front-ends): each has
`add_parser(subparsers)`, an optional `validate(args)` and `run(args, comm) -> exit status`:
generate.py, batch.py (with batch_io.py, its files of requests and results), serve.py, plan.py,
convert.py, preflight.py and ping.py; flags.py holds the flags several share, their checks and the
runtime's settings built from them. They sit above the engine (engine.py for one stream,
scheduler.py for many) and never import each other, except batch_io, the batch command's files."""
