"""A request's prompt as token ids: the chat template for chat completions, the raw text (or the
ids themselves) for completions. Runs in the HTTP server's threads, so that a bad or too-long
prompt is answered at once, before it reaches the scheduler.

The ids are those `generate` feeds for the same prompt: `--prompt Q` is the chat of one user
message Q, and `--no-chat-template --prompt T` the completion of T.
"""

from __future__ import annotations

from ..util.errors import UserError
from ..checkpoints.tokenizer import Tokenizer
from .protocol import APIError


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], context: int, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
    if not tokenizer.has_chat_template:
        raise APIError("the model has no chat template: send the raw text to /v1/completions", param="messages")
    try:
        # The rendered text holds the special tokens the model wants (a BOS where it needs one)
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                                             template_kwargs=template_kwargs),
                               add_special_tokens=False)
    except UserError as e:
        raise APIError(str(e), param="messages") from None
    return _checked(ids, context, "messages")


def completion_prompt_ids(tokenizer: Tokenizer, prompt: str | list[int], context: int, vocab_size: int) -> list[int]:
    if isinstance(prompt, list):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(f"prompt: token id {bad} is outside the model's vocabulary (0 to {vocab_size - 1})",
                           param="prompt")
        ids = list(prompt)
    else:
        try:
            ids = tokenizer.encode(prompt, add_special_tokens=True)
        except UserError as e:
            raise APIError(str(e), param="prompt") from None
    return _checked(ids, context, "prompt")


def _checked(ids: list[int], context: int, param: str) -> list[int]:
    if not ids:
        raise APIError("the prompt is empty", param=param)
    if len(ids) >= context:
        raise APIError(f"the prompt has {len(ids)} tokens but the model's context is {context}: shorten it",
                       param=param, code="context_length_exceeded")
    return ids
