"""The files of a batch job: the JSONL requests going in, the JSONL results coming out, and resuming.

Input: one JSON object per line, either ours

    {"id": "q1", "prompt": "...", "max_tokens": 64, "temperature": 0, "stop": ["\\n\\n"]}
    {"id": 2, "messages": [{"role": "user", "content": "..."}], "seed": 7}

or an OpenAI Batch API line

    {"custom_id": "q3", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 64}}

Output: one JSON line per request, appended, flushed and fsync'd the moment it finishes, by rank
0 alone: `{"id", "text", "finish_reason", "usage", "timing"}`, or `{"id", "line", "error"}` for a
line that cannot run (it does not stop the job). Rerunning the same command skips every id
already in the output, so a job killed at any moment ends, once rerun, with exactly one record
per input id. A crash can leave a torn last line (a record cut short); it is cut off before
anything is appended, never read as a result. Two jobs cannot append to one output at once (the
file is locked).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..util.errors import UserError

# Per-request fields of our format, beside "id" and the prompt.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
NATIVE_FIELDS = ("id", "prompt", "messages", "system", "max_tokens", "stop", *SAMPLING_FIELDS)
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
# OpenAI body fields that do not change what we compute (ignored), and ones we accept only at
# the value that means "off".
OPENAI_IGNORED = ("model", "user", "metadata", "store", "service_tier")
OPENAI_ONLY_OFF = {"n": 1, "stream": False, "logprobs": False, "frequency_penalty": 0, "presence_penalty": 0}
MAX_DUPLICATES_NAMED = 10


@dataclass
class InputRequest:
    """A runnable line of the input file."""
    key: str  # the id as canonical JSON: what resuming and the duplicate check compare
    id: Any
    line: int
    prompt: str | None = None
    messages: list[dict] | None = None
    system: str | None = None
    max_tokens: int = 256
    sampling: Any = None  # SamplingParams
    stop: list[str] = field(default_factory=list)


@dataclass
class BadLine:
    key: str
    id: Any  # None when the line has no usable id
    line: int
    error: str

    def record(self) -> dict:
        return error_record(self.id, self.line, self.error)


def error_record(request_id, line: int, message: str) -> dict:
    return {"id": request_id, "line": line, "error": f"line {line}: {message}"}


def id_key(request_id) -> str:
    return json.dumps(request_id, ensure_ascii=False)


def line_key(line: int) -> str:
    """The key of a line whose id is missing or unusable (its error record has "id": null)."""
    return f"line {line}"


def record_key(record: dict) -> str:
    if record.get("id") is None and isinstance(record.get("line"), int):
        return line_key(record["line"])
    return id_key(record.get("id"))


# -- reading the input --------------------------------------------------------------------------------------

class _Bad(Exception):
    """One line's problem: becomes an error record."""


def read_requests(path: Path, defaults, max_tokens: int, system: str | None = None) -> tuple[list[InputRequest], list[BadLine]]:
    """Every line of the input file, as a runnable request or as the reason it cannot run.
    `defaults`: the command's SamplingParams, which per-request fields override.
    Raises UserError for an unreadable file and for ids used more than once."""
    try:
        raw_lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise UserError(f"cannot read the input {path}: {e.strerror or e}") from None
    requests: list[InputRequest] = []
    bad: list[BadLine] = []
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        request_id = None
        try:
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise _Bad("not UTF-8 text") from None
            except json.JSONDecodeError as e:
                raise _Bad(f"not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise _Bad(f"expected a JSON object, got {_json_type(obj)}")
            request_id = _request_id(obj)
            requests.append(_parse(obj, request_id, number, defaults, max_tokens, system))
        except _Bad as e:
            usable = request_id is not None
            bad.append(BadLine(id_key(request_id) if usable else line_key(number), request_id, number, str(e)))
    if not requests and not bad:
        raise UserError(f"the input {path} has no requests (one JSON object per line)")
    _refuse_duplicates(path, requests, bad)
    return requests, bad


def _request_id(obj: dict):
    openai = "custom_id" in obj or "body" in obj
    name = "custom_id" if openai else "id"
    if name not in obj:
        raise _Bad(f"no {name!r} field" + (" (OpenAI Batch lines name requests by custom_id)" if openai else ""))
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _Bad(f"{name} must be a string or an integer, got {_json_type(value)}")
    return value


def _parse(obj: dict, request_id, line: int, defaults, max_tokens: int, system: str | None) -> InputRequest:
    from ..runtime.requests import SamplingParams  # here, not at the top: cli loads this module for its parser (start-up)

    if "custom_id" in obj or "body" in obj:
        fields = _openai_fields(obj)
    else:
        unknown = [k for k in obj if k not in NATIVE_FIELDS]
        if unknown:
            raise _Bad(f"unknown field {unknown[0]!r} (known: {', '.join(NATIVE_FIELDS)})")
        fields = {k: v for k, v in obj.items() if k != "id"}

    # An optional field set to null means "the default" (OpenAI bodies often carry "max_tokens": null).
    fields = {k: v for k, v in fields.items() if v is not None or k in ("prompt", "messages")}
    request = InputRequest(id_key(request_id), request_id, line, max_tokens=max_tokens, system=system)
    has_prompt, has_messages = "prompt" in fields, "messages" in fields
    if has_prompt == has_messages:
        raise _Bad("needs a 'prompt' or 'messages'" if not has_prompt else "has both 'prompt' and 'messages'")
    if has_prompt:
        request.prompt = _typed(fields, "prompt", str)
    else:
        request.messages = _messages(fields["messages"])
    if "system" in fields:
        if has_messages:
            raise _Bad("'system' goes with 'prompt'; with 'messages', put a system message first")
        request.system = _typed(fields, "system", str)
    if "max_tokens" in fields:
        request.max_tokens = _typed(fields, "max_tokens", int)
        if request.max_tokens < 1:
            raise _Bad(f"max_tokens must be >= 1, got {request.max_tokens}")
    if "stop" in fields:
        stop = fields["stop"]
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _Bad(f"stop must be a string or a list of strings, got {_json_type(fields['stop'])}")
        request.stop = stop
    values = {
        "temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k,
        "min_p": defaults.min_p, "repetition_penalty": defaults.repetition_penalty, "seed": defaults.seed}
    for name in SAMPLING_FIELDS:
        if name in fields and fields[name] is not None:
            values[name] = _typed(fields, name, int if name in ("top_k", "seed") else float)
    try:
        request.sampling = SamplingParams(values["temperature"], values["top_p"], values["top_k"], values["min_p"],
                                          values["repetition_penalty"], values["seed"]).validate()
    except UserError as e:
        raise _Bad(str(e)) from None
    return request


def _openai_fields(obj: dict) -> dict:
    for key in obj:
        if key not in ("custom_id", "method", "url", "body"):
            raise _Bad(f"unknown field {key!r} in an OpenAI Batch line (known: custom_id, method, url, body)")
    if obj.get("method", "POST") != "POST":
        raise _Bad(f"method must be POST, got {obj['method']!r}")
    if obj.get("url", OPENAI_URLS[0]) not in OPENAI_URLS:
        raise _Bad(f"url {obj['url']!r} is not supported (supported: {', '.join(OPENAI_URLS)})")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _Bad(f"body must be a JSON object, got {_json_type(body)}" if "body" in obj else "no 'body' field")
    fields = {}
    for key, value in body.items():
        if key in OPENAI_IGNORED:
            continue
        if key in OPENAI_ONLY_OFF:
            if value is not None and value != OPENAI_ONLY_OFF[key]:
                raise _Bad(f"body.{key} = {json.dumps(value)} is not supported (only {json.dumps(OPENAI_ONLY_OFF[key])})")
            continue
        if key == "max_completion_tokens":
            key = "max_tokens"
        if key not in NATIVE_FIELDS or key in ("id", "system"):
            raise _Bad(f"body.{key} is not supported")
        fields[key] = value
    return fields


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _Bad(f"messages must be a non-empty list, got {_json_type(value)}")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _Bad(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: only text
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _Bad(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _Bad(f"messages[{i}].content must be a string, got {_json_type(content)}")
        messages.append({"role": m["role"], "content": content})
    return messages


def _typed(fields: dict, name: str, kind: type):
    value = fields[name]
    ok = (isinstance(value, kind) and not isinstance(value, bool)) or \
         (kind is float and isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        want = {str: "a string", int: "an integer", float: "a number"}[kind]
        shown = f" {_short(value)}" if isinstance(value, (str, int, float)) else ""
        raise _Bad(f"{name} must be {want}, got {_json_type(value)}{shown}")
    return float(value) if kind is float else value


def _json_type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def _refuse_duplicates(path: Path, requests: list[InputRequest], bad: list[BadLine]) -> None:
    lines: dict[str, list[int]] = {}
    for item in [*requests, *(b for b in bad if b.id is not None)]:
        lines.setdefault(item.key, []).append(item.line)
    duplicates = [(key, sorted(ls)) for key, ls in lines.items() if len(ls) > 1]
    if not duplicates:
        return
    duplicates.sort(key=lambda d: d[1][0])
    named = "; ".join(f"{key} (lines {', '.join(map(str, ls))})" for key, ls in duplicates[:MAX_DUPLICATES_NAMED])
    more = f"; and {len(duplicates) - MAX_DUPLICATES_NAMED} more" if len(duplicates) > MAX_DUPLICATES_NAMED else ""
    raise UserError(f"{path} uses {'an id' if len(duplicates) == 1 else f'{len(duplicates)} ids'} more than "
                    f"once: {named}{more}; give every request its own id")


# -- the results file ---------------------------------------------------------------------------------------

class ResultsFile:
    """The output JSONL, opened for appending by rank 0: locked against a second job, its ids
    read (to skip them), a torn last line cut off, then one fsync'd record per `write`."""

    def __init__(self, path: Path):
        self.path = path
        self.done: set[str] = set()
        self.repaired = ""  # what was cut off, for a note on stderr
        self.count = 0  # records written by this run
        self.errors = 0  # of which error records
        self._fd = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise UserError(f"cannot open the output {path}: {e.strerror or e}") from None
        try:
            _lock(fd, path)
            self._read_and_repair(fd)
            _fsync_dir(path)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _read_and_repair(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0) if size else b""
        # Every record is written with its newline in one write: text after the last newline
        # is a record a crash cut short, even if it happens to parse.
        keep = data.rfind(b"\n") + 1
        lines = data[:keep].split(b"\n")[:-1]
        offset = 0
        for number, raw in enumerate(lines, start=1):
            record = _parse_record(raw)
            if record is None and raw.strip():
                if number == len(lines) and keep == len(data):  # garbage a crash left, then a newline
                    keep = offset
                    break
                raise UserError(f"line {number} of {self.path} is not a result record: is --output the "
                                f"right file? (fix or remove that line to resume)")
            if record is not None:
                self.done.add(record_key(record))
            offset += len(raw) + 1
        if keep < len(data):
            self.repaired = f"cut off a torn last line ({len(data) - keep} bytes) left by an interrupted run"
            os.ftruncate(fd, keep)
            os.fsync(fd)

    def write(self, record: dict) -> None:
        try:
            data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (an id or text from "\ud800" in the input): escape it all
            data = (json.dumps(record) + "\n").encode("ascii")
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fsync(self._fd)
        self.done.add(record_key(record))
        self.count += 1
        self.errors += "error" in record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # also releases the lock
            self._fd = None


def _parse_record(raw: bytes) -> dict | None:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or "id" not in record or not ("text" in record or "error" in record):
        return None
    return record


def _lock(fd: int, path: Path) -> None:
    try:
        import fcntl  # optional: Unix only
    except ImportError:  # not on Unix: no lock
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(f"another job is writing {path} (it is locked): wait for it, or choose another --output") from None


def _fsync_dir(path: Path) -> None:
    """Make the output's directory entry durable too (a new file must survive a power cut)."""
    try:
        fd = os.open(path.resolve().parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def result_record(request: InputRequest, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                  cached_tokens: int, queued_s: float, ttft_s: float, total_s: float) -> dict:
    decode_s = total_s - ttft_s
    return {
        "id": request.id, "text": text, "finish_reason": finish_reason,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": cached_tokens}},
        "timing": {"queued_s": round(queued_s, 4), "time_to_first_token_s": round(ttft_s, 4),
                   "total_s": round(total_s, 4),
                   "decode_tokens_per_s": round((completion_tokens - 1) / decode_s, 2)
                   if completion_tokens > 1 and decode_s > 0 else None}}


def note(message: str) -> None:
    print(f"[pipeline] {message}", file=sys.stderr, flush=True)
