"""A request's prompt as token ids: the chat template for chat completions, the raw text (or the
ids themselves) for completions. Runs in the HTTP server's threads, so that a bad or too-long
prompt is answered at once, before it reaches the scheduler.

The ids are those `generate` feeds for the same prompt: `--prompt Q` is the chat of one user
message Q, and `--no-chat-template --prompt T` the completion of T.

A prompt that cannot fit the context is refused without tokenizing all of it (docs/serve.md,
"Limits"): first by its characters alone (no token covers more characters than the vocabulary's
longest token, so a text of N characters has at least N / that many tokens), for a chat before its
template is rendered; then by counting the tokens of its pieces and stopping once they pass the
context. Pieces are short, because the tokenizers library holds the GIL while it works: one long
call would stall the event loop, and every other request with it. Only a prompt that fits is
tokenized whole, for its exact ids.
"""

from __future__ import annotations

import functools
import json
import re
import time

from ..util.errors import UserError
from ..checkpoints.tokenizer import Tokenizer
from ..chat.tool_calls import format_for_template
from .protocol import APIError

PIECE_CHARS = 16_384  # characters tokenized in one call: ~8 ms of the GIL for English text
PIECE_SLACK = 2  # tokens a cut between two pieces may add to their total, over the whole text's tokens
# Where a text is cut into pieces: a space between a word character and a letter, where every
# pre-tokenizer we know (GPT-2's and Llama 3's patterns, SentencePiece's spaces) ends a pre-token
WORD_GAP = re.compile(r"(?<=[^\W_]) (?=[^\W\d_])")


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], context: int, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
    if not tokenizer.has_chat_template:
        raise APIError("the model has no chat template: send the raw text to /v1/completions", param="messages")
    # Before the template: rendering megabytes holds the GIL for as long as tokenizing them would. Every
    # message's content counts (a template that leaves out some of it, the thinking of earlier turns, is
    # not served megabytes of it)
    content = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    _refuse_by_characters(tokenizer, content, context, "messages", of="its messages'")
    if any(m.get("tool_calls") for m in messages) and wants_argument_objects(tokenizer):
        messages = _arguments_as_objects(messages)
    try:
        # The rendered text holds the special tokens the model wants (a BOS where it needs one)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                             template_kwargs=template_kwargs)
        return text_prompt_ids(tokenizer, text, context, "messages", add_special_tokens=False)
    except UserError as e:
        raise APIError(str(e), param="messages") from None


PROBE_ARGUMENTS = {"pipeline_probe_argument": "5f3a"}


@functools.cache
def wants_argument_objects(tokenizer: Tokenizer) -> bool:
    """Whether the chat template needs an earlier call's `arguments` as an object, not the JSON text
    clients send. The markup formats' templates (Qwen3-Coder's and Qwen3.5's XML, GLM's, MiniMax-M2's,
    our DeepSeek V3.2/V4 DSML ones) write them argument by argument: they do. A JSON format's template
    either prints the text as is (Kimi K2's, DeepSeek V3/V3.1's, Qwen3's: an object would come out as
    Python's repr, or fail) or writes an object with `tojson` (Qwen2.5's and other Hermes-style ones: the
    text would come out as a quoted string); which one is found as llama.cpp's minja does, by rendering
    a probe call both ways (once per tokenizer)."""
    tool_format = format_for_template(tokenizer.chat_template)
    if tool_format is not None and tool_format.markup is not None:
        return True
    text = json.dumps(PROBE_ARGUMENTS)
    return text not in _probe_render(tokenizer, text) and text in _probe_render(tokenizer, PROBE_ARGUMENTS)


def _probe_render(tokenizer: Tokenizer, arguments) -> str:
    call = {"id": "call_probe", "type": "function", "function": {"name": "probe_tool", "arguments": arguments}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    except UserError:  # a template that fails on this kind of arguments does not write them
        return ""


def _arguments_as_objects(messages: list[dict]) -> list[dict]:
    """`messages` with each assistant call's `function.arguments` JSON text given as the object it holds
    (as vLLM's chat_utils does; empty text is no arguments, `{}`), new dicts where they change (the
    request's own stay as sent). Text that is not a JSON object is the request's error (400)."""
    converted = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if not calls:
            converted.append(message)
            continue
        new_calls = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if not isinstance(arguments, str):  # already an object (or no function: the template's to judge)
                new_calls.append(call)
                continue
            new_calls.append({**call, "function": {**function, "arguments": _arguments_object(arguments, i, j, call)}})
        converted.append({**message, "tool_calls": new_calls})
    return converted


def _arguments_object(text: str, i: int, j: int, call: dict) -> dict:
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        what = f"tool call {call.get('id')!r} ({call['function'].get('name')!r})"
        raise APIError(f"messages[{i}].tool_calls[{j}].function.arguments: {what} has arguments that are not a JSON "
                       f"object; this model's chat template writes them one by one: send them as a JSON object",
                       param="messages")
    return value


def completion_prompt_ids(tokenizer: Tokenizer, prompt: str | list[int], context: int, vocab_size: int) -> list[int]:
    if isinstance(prompt, list):
        check_length(len(prompt), context, "prompt")  # before looking at each of a million ids
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(f"prompt: token id {bad} is outside the model's vocabulary (0 to {vocab_size - 1})",
                           param="prompt")
        return list(prompt)
    try:
        return text_prompt_ids(tokenizer, prompt, context, "prompt", add_special_tokens=True)
    except UserError as e:
        raise APIError(str(e), param="prompt") from None


def text_prompt_ids(tokenizer: Tokenizer, text: str, context: int, param: str, add_special_tokens: bool) -> list[int]:
    """`text`'s token ids, or APIError(400, context_length_exceeded) as soon as it is certain that
    they cannot fit in `context` (their count must be below it: one position is left to generate).
    `context` also bounds the work: the text is tokenized whole, in one call that holds the GIL,
    only once its pieces are known to fit; a caller that passes no real bound (to count the tokens
    of any text) gets that one long call for a long text."""
    _refuse_by_characters(tokenizer, len(text), context, param)
    if len(text) > PIECE_CHARS:
        counted = 0
        for cuts, piece in enumerate(pieces(text, PIECE_CHARS)):
            try:
                counted += len(tokenizer.encode(piece, add_special_tokens=False))
            except UserError:  # text that is not UTF-8: the whole text's error, with the position in it
                tokenizer.encode(text, add_special_tokens=add_special_tokens)
                raise
            if counted - PIECE_SLACK * cuts >= context:
                raise _too_long(f"more than {context - 1} tokens", context, param)
            time.sleep(0)  # let the event loop's thread have the GIL between pieces
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    check_length(len(ids), context, param)
    return ids


def pieces(text: str, size: int):
    """`text` in consecutive pieces of at most `size` characters, each cut at a WORD_GAP in the
    second half of its window where there is one (else at `size`: a few tokens more at the cut)."""
    start = 0
    while len(text) - start > size:
        gap = WORD_GAP.search(text, start + size // 2, start + size)
        end = gap.start() if gap else start + size
        yield text[start:end]
        start = end
    yield text[start:]


@functools.cache
def max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters of a text one token can cover: its longest token's decoded text, plus
    one (a SentencePiece token's leading space, dropped when it is decoded alone). A token cut
    inside a character decodes to U+FFFD, so the count holds for any text. Computed once per
    tokenizer, on the first long prompt (~30 ms for 49152 tokens)."""
    return 1 + max(len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size))


def _refuse_by_characters(tokenizer: Tokenizer, characters: int, context: int, param: str, of: str = "its") -> None:
    """APIError(400) where `characters` alone prove the prompt has `context` tokens or more."""
    if characters < context:  # the bound is not needed (nor computed) for a short text
        return
    floor = characters // max_token_chars(tokenizer)
    if floor >= context:
        raise _too_long(f"at least {floor} tokens (from {of} {characters} characters)", context, param)


def check_length(tokens: int, context: int, param: str) -> None:
    """APIError(400) for a prompt of no tokens, or of too many for `context` (one position is left to
    generate)."""
    if tokens == 0:
        raise APIError("the prompt is empty", param=param)
    if tokens >= context:
        raise _too_long(f"{tokens} tokens", context, param)


def _too_long(count: str, context: int, param: str) -> APIError:
    return APIError(f"the prompt has {count} but the model's context is {context}: shorten it", param=param,
                    code="context_length_exceeded")
