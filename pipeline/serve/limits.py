"""How much of a request the server reads: a body past the cap (`--max-request-mb`) is refused with
413 as soon as its Content-Length says so, or as soon as the bytes read pass the cap, without
reading the rest first; the HTTP server then discards the rest of that body (it keeps no more
than a read buffer of it), and the connection goes on.

A prompt that cannot fit the context is the prompts module's business (prompts.py): a body under
the cap is bounded, and what is done with it is bounded by the model's context.
"""

from __future__ import annotations

from starlette.requests import Request as HTTPRequest

from .protocol import APIError

MB = 1 << 20  # --max-request-mb counts in these


def too_large(max_bytes: int, size: str) -> APIError:
    """The 413 of a body of `size` (words: "12.0 MB", "more than 16.0 MB") over `max_bytes`."""
    return APIError(f"the request body is {size}, over this server's limit of {max_bytes / MB:g} MB "
                    f"(--max-request-mb): send a shorter prompt", status=413, code="request_too_large")


async def read_body(http: HTTPRequest, max_bytes: int) -> bytes:
    """The request's body, at most `max_bytes` of it; else APIError(413) as soon as it is certain,
    before the rest arrives. What is held while reading is bounded by `max_bytes`."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes, f"{int(declared) / MB:.1f} MB")
    chunks, size = [], 0
    async for chunk in http.stream():  # also a chunked body, which declares no length
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes, f"more than {max_bytes / MB:g} MB")
        chunks.append(chunk)
    return b"".join(chunks)
