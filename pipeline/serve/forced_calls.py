"""A tool call forced by the request (Anthropic's `tool_choice` `any` or `tool`; Chat Completions'
and Responses' `required` or a named function): the assistant turn is opened with the model's own
call markup, so the model's first words are a call's.

The prefix goes after the rendered prompt (its tokens are prompt tokens) and into the output
parser first, as if the model had written it: the parser then reads the model's continuation as
the rest of the call. With `any` the prefix ends where the call's name would begin, and the model
picks the tool; with `tool` it ends after the name. The parser must not have started the call by
the prefix's end (app.py feeds it the prefix and expects no events): the JSON formats' prefixes end
where the arguments begin, before their `{`; the markup formats' (Qwen3.5's XML, GLM, MiniMax-M2,
DSML) end right after the name, before what closes it (`>`, `">`, GLM's newline or `<arg_key>`),
which the model writes.
"""

from __future__ import annotations

import json

from ..chat.tool_calls import DEEPSEEK_SEP, KIMI_ARGUMENT_BEGIN, ToolCallFormat, markup_call_opening
from .protocol import APIError


def forced_call_prefix(format: ToolCallFormat, name: str | None, calls_so_far: int = 0) -> str:
    """The text that opens a call in `format`: of the tool `name`, or of any tool where None.
    calls_so_far: the calls in the conversation before it (Kimi K2 numbers its call ids)."""
    if format.markup is not None:
        return markup_call_opening(format, None) + (name or "")
    opening = (format.section_begin or "") + format.call_begin
    if name is None:
        return opening
    if format.name == "qwen":
        return f'{opening}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
    if format.name == "deepseek_v3":
        return f"{opening}function{DEEPSEEK_SEP}{name}\n```json\n"
    if format.name == "deepseek_v31":
        return f"{opening}{name}{DEEPSEEK_SEP}"
    if format.name == "kimi_k2":
        return f"{opening}functions.{name}:{calls_so_far}{KIMI_ARGUMENT_BEGIN}"
    raise APIError(f"tool_choice: a call cannot be forced in this model's tool-call format ({format.name}): use "
                   f"tool_choice auto", param="tool_choice")
