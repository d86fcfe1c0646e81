"""Finding markers (`</think>`, `<｜tool▁call▁begin｜>`, ...) in text that arrives in pieces split
anywhere, even inside a marker."""

from __future__ import annotations


def find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest marker in `text` and where it starts (the longest one where two start at
    the same place), or None."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(marker) > len(best[1]))):
            best = (at, marker)
    return best


def partial_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a marker that the next
    piece completes: those must be held back, not passed on yet."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest
