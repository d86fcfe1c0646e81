"""Tool-call arguments written as markup, one parameter at a time with every value as text
(Qwen3-Coder's and Qwen3.5's `<parameter=KEY>`, GLM's `<arg_key>`/`<arg_value>`, MiniMax-M2's and
DeepSeek DSML's `<parameter name="KEY">`), read into the JSON object that the call's arguments are,
as the text streams.

The object is written as `dump_json` writes one (`{"k": v, "k2": v2}`), a key's value once it is
known: a string value (its schema says string, or DSML's `string="true"`) character by character
as it arrives, any other value whole at its closing tag, typed from the request's tool schema: a
parameter whose schema type is integer, number, boolean, object, array or null is read as JSON
(Python's `True`/`False`, which Qwen3-Coder's template writes, as booleans), a string stays the
text; where the schema does not say (no schema, no type), JSON where the text is JSON, else the
text. A value that does not read as a type its schema allows is passed on as the text, a string.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .scan import JSON_SPACE, JsonPairs, dump_json, partial_tail, read_json

# a tool's name -> its parameters' JSON Schema `properties` (each parameter's schema)
Schemas = dict[str, dict]


def tool_schemas(tools: list | None) -> Schemas:
    """The parameter schemas of a request's tools: OpenAI's `{"type": "function", "function":
    {"name", "parameters"}}`, or `{"name", "parameters" | "input_schema"}` (Anthropic's shape)."""
    schemas: Schemas = {}
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        parameters = function.get("parameters", function.get("input_schema"))
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if isinstance(function.get("name"), str) and isinstance(properties, dict):
            schemas[function["name"]] = properties
    return schemas


def _schema_types(schema) -> set[str]:
    """The JSON types a parameter's schema allows (`type` as a name or a list, or the union of
    `anyOf`/`oneOf`); empty where it does not say."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    types: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            types |= _schema_types(option)
    return types


def _json_types(value) -> set[str]:
    """The schema types a JSON value is an instance of."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"object"} if isinstance(value, JsonPairs) else {"array"}


def is_string(schema) -> bool:
    """The parameter is a string and nothing else: its text is its value."""
    return _schema_types(schema) == {"string"}


def typed_value(text: str, schema) -> str:
    """A parameter's text as the JSON value its schema says it is (see the module's docstring)."""
    types = _schema_types(schema)
    if types == {"string"}:
        return dump_json(text)
    try:
        value = read_json(text)
    except (ValueError, RecursionError):  # not JSON (or nested past what Python reads): the text
        if "boolean" in types and text.strip() in ("True", "False"):
            return "true" if text.strip() == "True" else "false"
        return dump_json(text)
    if types and not types & _json_types(value):
        return dump_json(text)
    return dump_json(value)


@dataclass(frozen=True)
class Markup:
    """How a format writes one parameter: `open_start` ... `open_end` (matched whole by `opening`,
    its group `key` the parameter's name, an optional group `string` DSML's true/false), the
    value, `value_end`. Blank space may come between parameters. `arguments_end`: the tag that
    closes the arguments (Qwen's `</function>`), else the call's end marker closes them.
    `trim`: what around a value is not the value's: NEWLINE, one newline after the opening and one
    before `value_end` (Qwen writes the value on lines of its own); SPACE, all blank space at either
    end (MiniMax's published parser strips values); "" none."""
    open_start: str
    open_end: str
    opening: re.Pattern
    value_end: str
    arguments_end: str | None = None
    trim: str = ""


NEWLINE, SPACE = "newline", "space"  # Markup.trim


_BETWEEN, _VALUE, _DONE = "between", "value", "done"


class MarkupArgumentsScanner:
    """Reads a call's parameters as their text arrives in pieces (from just after the call's
    name) and gives back pieces of the JSON object they make; the pieces joined are the same
    however the text was split. `finish()` at the call's end marker closes the object. A text that
    is not the markup makes it `broken`: nothing more is given back (the call's whole parse, the
    same scanner over its whole text, then says it is malformed)."""

    def __init__(self, markup: Markup, schemas: dict | None):
        self.markup = markup
        self.schemas = schemas or {}
        self.broken = False
        self._state = _BETWEEN
        self._text = ""             # the text not yet read (what is read is dropped)
        self._opened = False        # the object's `{` went out
        self._keys = 0              # parameters read so far
        self._string = False        # the current value streams as a string
        self._schema = None         # the current value's schema
        self._lead_checked = False  # trim: the blank space opening the value was dropped
        self._searched = 0          # where in _text the value's end was not found

    @property
    def closed(self) -> bool:
        return self._state == _DONE

    def feed(self, text: str) -> str:
        out: list[str] = []
        if not self._opened:
            self._opened = True
            out.append("{")
        self._text += text
        while not self.broken and self._step(out):
            pass
        return "".join(out)

    def finish(self) -> str:
        """The call's end marker came: the object closes if it is between parameters."""
        if self.broken or self._state == _DONE:
            return ""
        if self._state != _BETWEEN or self._text.strip(JSON_SPACE) or self.markup.arguments_end:
            self.broken = True  # inside a parameter, or Qwen's </function> never came
            return ""
        self._state = _DONE
        return "}"

    def _step(self, out: list[str]) -> bool:
        """Reads what the text holds in the current state; False when it must wait for more."""
        m = self.markup
        if self._state == _DONE:
            if self._text.strip(JSON_SPACE):
                self.broken = True  # text after the arguments' closing tag, inside the call
            self._text = ""
            return False
        if self._state == _VALUE:
            return self._value(out)
        rest = self._text.lstrip(JSON_SPACE)
        self._text = rest
        if not rest:
            return False
        if rest.startswith(m.open_start):
            end = rest.find(m.open_end, len(m.open_start))
            if end < 0:
                return False
            end += len(m.open_end)
            match = m.opening.fullmatch(rest[:end])
            if match is None:
                self.broken = True
                return False
            self._open_value(match, out)
            self._text = rest[end:]
            return True
        if m.arguments_end and rest.startswith(m.arguments_end):
            self._state = _DONE
            self._text = rest[len(m.arguments_end):]
            out.append("}")
            return True
        if not (m.open_start.startswith(rest) or (m.arguments_end and m.arguments_end.startswith(rest))):
            self.broken = True
        return False

    def _open_value(self, match: re.Match, out: list[str]) -> None:
        key = match["key"]
        string = match.groupdict().get("string")
        self._schema = self.schemas.get(key)
        self._string = string == "true" if string is not None else is_string(self._schema)
        if string == "false" and is_string(self._schema):
            self._schema = None  # DSML says it is JSON: read it as such, whatever the schema says
        out.append((", " if self._keys else "") + dump_json(key) + ": " + ('"' if self._string else ""))
        self._keys += 1
        self._state, self._lead_checked, self._searched = _VALUE, False, 0

    def _value(self, out: list[str]) -> bool:
        m = self.markup
        if m.trim and not self._lead_checked:
            if m.trim == SPACE:
                self._text = self._text.lstrip()
            if not self._text:
                return False
            self._lead_checked = True
            if m.trim == NEWLINE and self._text[0] == "\n":
                self._text = self._text[1:]
        at = self._text.find(m.value_end, self._searched)
        if at < 0:
            self._searched = max(0, len(self._text) - len(m.value_end) + 1)
            if self._string:  # what cannot be the value's end goes out now
                end = len(self._text) - partial_tail(self._text, (m.value_end,))
                if m.trim == NEWLINE and end > 0 and self._text[end - 1] == "\n":
                    end -= 1  # perhaps the newline before the closing tag
                elif m.trim == SPACE:
                    end = len(self._text[:end].rstrip())  # perhaps the blank space before it
                if end > 0:
                    out.append(dump_json(self._text[:end])[1:-1])
                    self._text = self._text[end:]
                    self._searched = max(0, self._searched - end)
            return False
        value = self._text[:at]
        if m.trim == NEWLINE and value.endswith("\n"):
            value = value[:-1]
        elif m.trim == SPACE:
            value = value.rstrip()
        out.append(dump_json(value)[1:-1] + '"' if self._string else typed_value(value, self._schema))
        self._text = self._text[at + len(m.value_end):]
        self._state = _BETWEEN
        return True
