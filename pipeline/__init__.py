"""pipeline: an MPI pipeline-parallel runtime for language models too big for one machine."""

__version__ = "0.1.0"
