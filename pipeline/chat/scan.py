"""Scanning text that arrives in pieces split anywhere: finding markers (`</think>`,
`<｜tool▁call▁begin｜>`, ...), even one split across pieces, and reading a JSON object as it streams
(how much of it is certainly the object's, as written or normalized)."""

from __future__ import annotations

import json
import re


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


# -- a JSON object's text as it streams --------------------------------------------------------------------------------

JSON_SPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_CONSTANTS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")  # Python's json reads all six
_TOKEN_CHARS = frozenset("0123456789+-.eEabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")

# what the scanner expects next, outside a string
_START, _KEY_OR_CLOSE, _KEY, _COLON, _VALUE, _VALUE_OR_CLOSE, _COMMA_OR_CLOSE, _DONE = range(8)


class JsonPairs(list):
    """A JSON object read as its (key, value) pairs, every key it had kept in order, repeated ones
    included (a dict keeps only the last value of a repeated key)."""


def read_json(text: str):
    """`text`'s JSON value, its objects as JsonPairs (raises ValueError where it is not JSON)."""
    return json.loads(text, object_pairs_hook=JsonPairs)


def dump_json(value) -> str:
    """`value` as json.dumps(value, ensure_ascii=False) writes it, JsonPairs as the object they are."""
    if isinstance(value, JsonPairs):
        return "{" + ", ".join(f"{dump_json(k)}: {dump_json(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dump_json(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


class JsonObjectScanner:
    """Reads one JSON object's text as it arrives in pieces, and gives back the part of it that is
    certainly the object's: never a character that no JSON object can have there, and nothing after
    the object closes (`closed`). A character that cannot come next makes it `broken`: it reads no
    further. Validity is Python's json module's (NaN and Infinity included, no raw control characters
    in strings).

    raw: the text as written, from its `{` (a number or constant once it has ended);
    normalized: as `dump_json` writes the parsed object (", " and ": " between items, strings
    re-escaped, numbers as Python writes them), each token once it is whole."""

    def __init__(self, normalize: bool):
        self.normalize = normalize
        self.broken = False
        self._expect = _START
        self._stack: list[str] = []
        self._string: bool = False       # inside a string
        self._key = False                # ... that is a key
        self._escape: str | None = None  # inside an escape: what of it came after the backslash
        self._high: str = ""             # normalized: a high surrogate waiting for its low half
        self._token = ""                 # a number or constant so far

    @property
    def closed(self) -> bool:
        return self._expect == _DONE

    def finish(self) -> str:
        """The call's end marker came: nothing more (a JSON object closes by its own `}`)."""
        return ""

    def feed(self, text: str) -> str:
        out: list[str] = []
        for c in text:
            if self.broken or self._expect == _DONE:
                break
            if not self._step(c, out):
                self.broken = True
        return "".join(out)

    def _step(self, c: str, out: list[str]) -> bool:
        if self._string:
            return self._string_char(c, out)
        if self._token:
            if c in _TOKEN_CHARS:
                self._token += c
                return True
            if not self._end_token(out):
                return False
        if c in JSON_SPACE:
            if self._expect != _START and not self.normalize:
                out.append(c)
            return True
        expect = self._expect
        if c == "{" and expect in (_START, _VALUE, _VALUE_OR_CLOSE):
            self._stack.append("{")
            self._expect = _KEY_OR_CLOSE
        elif c == "[" and expect in (_VALUE, _VALUE_OR_CLOSE):
            self._stack.append("[")
            self._expect = _VALUE_OR_CLOSE
        elif (c == "}" and expect in (_KEY_OR_CLOSE, _COMMA_OR_CLOSE) and self._stack[-1] == "{") or \
                (c == "]" and expect in (_VALUE_OR_CLOSE, _COMMA_OR_CLOSE) and self._stack[-1] == "["):
            self._stack.pop()
            self._after_value()
        elif c == "," and expect == _COMMA_OR_CLOSE:
            self._expect = _KEY if self._stack[-1] == "{" else _VALUE
            c = ", " if self.normalize else c
        elif c == ":" and expect == _COLON:
            self._expect = _VALUE
            c = ": " if self.normalize else c
        elif c == '"' and expect in (_KEY_OR_CLOSE, _KEY, _VALUE, _VALUE_OR_CLOSE):
            self._string, self._key = True, expect in (_KEY_OR_CLOSE, _KEY)
        elif c in _TOKEN_CHARS and expect in (_VALUE, _VALUE_OR_CLOSE):
            self._token = c
            return True
        else:
            return False
        out.append(c)
        return True

    def _after_value(self) -> None:
        self._expect = _COMMA_OR_CLOSE if self._stack else _DONE

    def _end_token(self, out: list[str]) -> bool:
        token, self._token = self._token, ""
        if token not in _CONSTANTS and not _NUMBER.fullmatch(token):
            return False
        if self.normalize:
            try:
                token = json.dumps(json.loads(token))  # "1E2" is written 100.0, "-0" 0, as Python does
            except ValueError:  # an integer too long for Python to read
                return False
        out.append(token)
        self._after_value()
        return True

    def _string_char(self, c: str, out: list[str]) -> bool:
        if self._escape is None:
            if c == '"':
                self._flush_high(out)
                out.append(c)
                self._string = False
                if self._key:
                    self._expect = _COLON
                else:
                    self._after_value()
                return True
            if c < " ":  # raw control characters are not allowed in a JSON string
                return False
            if c == "\\":
                self._escape = ""
                return True
            self._char(c, out)
            return True
        if self._escape == "":
            if c == "u":
                self._escape = "u"
                return True
            if c not in _ESCAPES:
                return False
            self._escape = None
            self._char(_ESCAPES[c], out, "\\" + c)
            return True
        if c not in _HEX:
            return False
        self._escape += c
        if len(self._escape) < 5:
            return True
        escape, self._escape = self._escape, None
        self._char(chr(int(escape[1:], 16)), out, "\\" + escape)
        return True

    def _char(self, char: str, out: list[str], raw: str | None = None) -> None:
        """One character of a string (`raw`: as escaped in the text)."""
        if not self.normalize:
            out.append(raw or char)
            return
        if self._high and "\udc00" <= char <= "\udfff" and raw is not None and raw.startswith("\\u"):
            char, self._high = (self._high + char).encode("utf-16", "surrogatepass").decode("utf-16"), ""
        self._flush_high(out)
        if "\ud800" <= char <= "\udbff" and raw is not None and raw.startswith("\\u"):
            self._high = char  # its low half may follow, as an escape too: then the two are one character
            return
        out.append(json.dumps(char, ensure_ascii=False)[1:-1])

    def _flush_high(self, out: list[str]) -> None:
        if self._high:
            out.append(self._high)
            self._high = ""
