"""The commands of `python -m pipeline`, one module each (the front-ends): each has
`add_parser(subparsers)`, an optional `validate(args)` and `run(args, comm) -> exit status`.
They sit above the engine (engine.py for one stream, scheduler.py for many) and never import
each other, except batch_io, the batch command's files."""
