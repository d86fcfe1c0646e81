"""`POST /v1/responses` (OpenAI's Responses API), `GET` and `DELETE /v1/responses/{id}`.

First without a server: a Codex request as Codex CLI 0.169 sends it (its shape, recorded) becomes
the chat template's messages and functions, and the adapter's events for a parsed answer come
in the order and with the indices the official client's stream helper checks. Then a real
`mpiexec -n 2 ... serve` with the scripted chat model of the tool tests (its greedy output is a
tool call, or a thinking block and an answer) and the official `openai` client: streaming and
not, a function call round trip with previous_response_id and the same by resending the items,
cached tokens on the follow-up, GET and DELETE. Last, the real agent: Codex CLI (`codex exec`
with a provider whose wire_api is "responses") completes a turn on a tiny model with a 32k
context, its ~8.5k-token prompt (developer instructions, 9 tools) and all: the model's scripted
call (of exec_command, which Codex runs, or of a function in Codex's multi_agent_v1 namespace,
which Codex finds by namespace and name), and the answer after its output.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import openai
import pytest

from agents import make_agent_model, npm_binary
from pipeline.chat.events import ContentDelta, ReasoningDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from pipeline.chat.output import ChatOutputParser
from pipeline.chat.tool_calls import QWEN
from pipeline.runtime.requests import Finished, Tokens
from pipeline.serve import responses_protocol as rp
from pipeline.serve.protocol import APIError
from pipeline.serve.responses_adapter import ResponsesAdapter, ResponsesAPI
from pipeline.serve.responses_store import ResponseStore, conversation_chars
from scripted_chat_model import ANSWER, CALL, TEMPLATE, THOUGHT
from test_chat_serve import env_vars, server  # noqa: F401 -- fixtures used here (server: the scripted model's)
from test_serve import Server

CODEX_VERSION = "0.169.0"  # what the capture was made with

# What Codex 0.169 sends (captured from a real `codex exec` against a recording endpoint), shortened:
# developer and user messages with their own ids, a function call into a namespace and its output
# resent, function tools with `strict`, a namespace of functions, web_search, and the bookkeeping.
CODEX_BODY = {
    "model": "default", "stream": True, "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "019a",
    "client_metadata": {"x-codex-turn-metadata": "{}", "session_id": "019a"},
    "input": [
        {"type": "message", "id": "msg_1", "role": "developer",
         "content": [{"type": "input_text", "text": "You are a coding agent running in the Codex CLI."}]},
        {"type": "message", "id": "msg_2", "role": "developer",
         "content": [{"type": "input_text", "text": "<skills_instructions>"}, {"type": "input_text", "text": "x"}]},
        {"type": "message", "id": "msg_3", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context>...</environment_context>"}]},
        {"type": "message", "id": "msg_4", "role": "user", "content": [{"type": "input_text", "text": "Say hello"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Ask an agent."}],
         "encrypted_content": None},
        {"type": "function_call", "status": "completed", "id": "fc_1", "name": "wait_agent",
         "namespace": "multi_agent_v1", "arguments": "{\"targets\":[\"a\"]}", "call_id": "call_abc"},
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_abc", "output": "no such agent"}],
    "tools": [
        {"type": "function", "name": "exec_command", "description": "Runs a command", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
        {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.",
         "tools": [{"type": "function", "name": "wait_agent", "description": "Wait", "strict": False,
                    "parameters": {"type": "object", "properties": {"targets": {"type": "array"}}}},
                   {"type": "function", "name": "close_agent", "description": "Close", "strict": False,
                    "parameters": {"type": "object", "properties": {"target": {"type": "string"}}}}]},
        {"type": "web_search", "external_web_access": False}],
}


# -- without a server -------------------------------------------------------------------------------------------

def test_a_codex_request_as_the_chat_templates_messages_and_functions():
    request = rp.parse(json.dumps(CODEX_BODY).encode())
    tools, left_out = request.function_tools()
    assert left_out == ["web_search"]
    names = [tool["function"]["name"] for tool in request.template_tools(tools)]
    assert names == ["exec_command", "multi_agent_v1__wait_agent", "multi_agent_v1__close_agent"]
    # The same dict as a Chat Completions request's tool (one rendering for both APIs)
    assert request.template_tools(tools)[0] == {"type": "function", "function": {
        "name": "exec_command", "description": "Runs a command", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}
    messages = rp.template_messages(request.instructions, request.input)
    assert messages == [
        {"role": "system", "content": "You are a coding agent running in the Codex CLI.\n\n<skills_instructions>\nx"},
        {"role": "user", "content": "<environment_context>...</environment_context>"},
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": "", "reasoning_content": "Ask an agent.", "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "multi_agent_v1__wait_agent", "arguments": "{\"targets\":[\"a\"]}"}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "no such agent"}]
    # A call the model makes comes back with its namespace apart (how Codex routes it); a plain one without
    split = rp.ToolNames(tools).split
    assert split("multi_agent_v1__close_agent") == ("multi_agent_v1", "close_agent")
    assert split("close_agent") == ("multi_agent_v1", "close_agent")  # the namespace dropped by the model
    assert split("exec_command") == (None, "exec_command") and split("other") == (None, "other")


@pytest.mark.parametrize("body, param, words", [
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content",
     "input_image"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "missing"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text", "structured output"),
    ({"input": "hi", "tools": [{"type": "function", "description": "no name"}]}, "tools[0].name", "missing"),
    ({"input": "hi", "temperature": "0.5"}, "temperature", "valid number"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
])
def test_bad_requests_name_the_field(body, param, words):
    with pytest.raises(APIError) as caught:
        request = rp.parse(json.dumps(body).encode())
        request.function_tools()
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message


def test_tool_choice_as_the_call_to_force():
    def forced(choice):
        request = rp.parse(json.dumps({**CODEX_BODY, "tool_choice": choice}).encode())
        return request.forced_call(request.function_tools()[0])

    assert forced("auto") is None and forced("none") is None and forced("required") == ""
    assert forced({"type": "function", "name": "exec_command"}) == "exec_command"
    assert forced({"type": "function", "name": "wait_agent", "namespace": "multi_agent_v1"}) == \
        "multi_agent_v1__wait_agent"
    for bad, words in (({"type": "function", "name": "nope"}, "no function tool named"),
                       ({"type": "web_search"}, "not supported")):
        with pytest.raises(APIError) as caught:
            forced(bad)
        assert caught.value.param == "tool_choice" and words in caught.value.message
    with pytest.raises(APIError) as caught:
        request = rp.parse(json.dumps({"input": "hi", "tool_choice": "required"}).encode())
        request.forced_call([])
    assert "needs a function tool" in caught.value.message


def test_a_tools_image_output_becomes_a_note_for_the_model():
    """Codex's view_image answers with an image part: the model is told it is left out, rather
    than the agent's turn failing (a user's own image is still refused, see above)."""
    output = [{"type": "input_text", "text": "the screenshot:"}, {"type": "input_image", "image_url": "data:,"}]
    request = rp.parse(json.dumps({"input": [{"type": "function_call_output", "call_id": "c", "output": output}]})
                       .encode())
    assert rp.template_messages(None, request.input) == [
        {"role": "tool", "tool_call_id": "c", "content": "the screenshot:\n[input_image left out: this server reads "
                                                        "text only]"}]


def test_unknown_fields_are_ignored():
    request = rp.parse(json.dumps({"input": "hi", "a_field_from_2027": {"x": 1}, "service_tier": "auto"}).encode())
    assert rp.template_messages(request.instructions, request.input) == [{"role": "user", "content": "hi"}]


def adapter_events(pieces: list[str], reason: str = "stop", store: ResponseStore | None = None):
    request = rp.parse(json.dumps(CODEX_BODY).encode())
    tools, _ = request.function_tools()
    adapter = ResponsesAdapter("resp_1", 1, "m", request, ChatOutputParser(in_reasoning=False, tool_format=QWEN),
                               rp.ToolNames(tools), store=store, conversation=list(request.input))
    events = adapter.opening()
    for i, piece in enumerate(pieces):
        events += adapter.tokens(Tokens(i, piece, None))
    events += adapter.finished(Finished(reason, "".join(pieces), "", prompt_tokens=9, completion_tokens=len(pieces),
                                        cached_tokens=4, queued_s=0, ttft_s=0, total_s=1))
    return adapter, events


ANSWER_PIECES = ["<think>", "Who", " asks?", "</think>", "Let me", " ask.", "<tool_call>",
                 '{"name": "multi_agent_v1__close_agent", "arguments": {"target": "a"}}', "</tool_call>"]


def check_stream(events: list[dict]) -> list[dict]:
    """The stream's rules, as the official client's stream helper and Codex rely on them; the
    items as output_item.done sent them."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.failed")
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert len(ids) == 1
    added, done = {}, {}
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(added) and not done.keys() - added.keys()
            added[e["output_index"]] = e["item"]
        elif e["type"] == "response.output_item.done":
            assert e["item"]["id"] == added[e["output_index"]]["id"] and e["output_index"] not in done
            done[e["output_index"]] = e["item"]
        else:  # a part or delta belongs to the item open now
            index = e["output_index"]
            assert index in added and index not in done and e["item_id"] == added[index]["id"], e
    assert added.keys() == done.keys()
    return [done[i] for i in sorted(done)]


def test_adapter_events_in_order_and_the_items_whole():
    store = ResponseStore(capacity=1)
    adapter, events = adapter_events(ANSWER_PIECES, store=store)
    items = check_stream(events)
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call"]
    assert items[0]["summary"] == [{"type": "summary_text", "text": "Who asks?"}]
    assert items[1]["content"][0]["text"] == "Let me ask."
    call = items[2]
    assert (call["namespace"], call["name"], json.loads(call["arguments"])) == ("multi_agent_v1", "close_agent",
                                                                                {"target": "a"})
    assert call["call_id"].startswith("call_") and call["status"] == "completed"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert deltas == call["arguments"]
    final = events[-1]["response"]
    assert final["output"] == items == adapter.response()["output"] and final["status"] == "completed"
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 4} and final["usage"]["input_tokens"] == 9
    # Stored with its conversation: the request's items, then its output as items
    stored = store.get("resp_1")
    assert stored.response == final and len(stored.conversation) == len(CODEX_BODY["input"]) + 3
    assert rp.template_messages(None, stored.conversation)[-1]["tool_calls"][0]["function"]["name"] == \
        "multi_agent_v1__close_agent"


def test_a_cut_off_answer_still_ends_with_response_completed():
    _, events = adapter_events(["Hello", " wor"], reason="length")
    [item] = check_stream(events)
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "Hello wor"


class ScriptedParser:
    """A chat-output parser whose events are given: each feed returns the next batch."""

    def __init__(self, batches: list[list]):
        self.batches, self.reasoned = list(batches), True

    def feed(self, text: str) -> list:
        return self.batches.pop(0) if text else []

    def finish(self) -> list:
        return []


def test_a_failed_stream_ends_with_response_failed():
    """The server stopping (or the request failing) mid-answer: the open item is closed and the
    stream ends with response.failed carrying the error, in the stream's own numbering."""
    request = rp.parse(json.dumps(CODEX_BODY).encode())
    adapter = ResponsesAdapter("resp_3", 1, "m", request, None, rp.ToolNames([]))
    events = adapter.opening() + adapter.tokens(Tokens(0, "Hel", None))
    error = APIError("the request was cancelled: the server is shutting down", status=503, code="cancelled")
    raw = ResponsesAPI().stream_error(error, adapter).decode()
    events += [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    [item] = check_stream(events)
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "Hel"
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"] == {"code": "cancelled", "message": error.message}
    assert raw.startswith("event: response.output_text.done\ndata: ")


def test_the_store_is_bounded_by_count_and_characters():
    big = rp.parse(json.dumps({"input": [{"role": "user", "content": "x" * 1000},
                                         {"type": "reasoning", "summary": [{"type": "summary_text",
                                                                            "text": "y" * 500}]}]}).encode()).input
    assert 1500 <= conversation_chars(big) < 1600  # text in nested parts counts too
    items = rp.parse(json.dumps(CODEX_BODY).encode()).input
    chars = conversation_chars(items)
    store = ResponseStore(capacity=3, max_chars=2 * chars)
    for n in range(4):
        assert store.put({"id": f"r{n}"}, list(items))
    assert [id for id in ("r0", "r1", "r2", "r3") if store.get(id)] == ["r2", "r3"]  # by characters
    store = ResponseStore(capacity=2, max_chars=10 * chars)
    for n in range(3):
        store.put({"id": f"r{n}"}, list(items))
        store.get("r0")  # used: kept
    assert [id for id in ("r0", "r1", "r2") if store.get(id)] == ["r0", "r2"]  # by count, least recently used out
    assert not ResponseStore(max_chars=chars - 1).put({"id": "big"}, list(items))  # alone over the bound
    assert store.delete("r0") and not store.delete("r0") and len(store) == 1


def test_events_of_any_split_make_the_same_items():
    """The adapter consumes the parser's events generically: a call's arguments in many pieces,
    as the streaming parsers send them, make the same item as in one."""
    request = rp.parse(json.dumps(CODEX_BODY).encode())
    tools, _ = request.function_tools()
    batches = [[ReasoningDelta("a"), ReasoningDelta("b"), ContentDelta(" \n")],
               [ToolCallStart(0, "call_1", "exec_command"), ToolCallArguments(0, '{"cmd"')],
               [ToolCallArguments(0, ': "ls"')], [ToolCallArguments(0, "}"), ToolCallEnd(0)],
               [ToolCallStart(1, "call_2", "exec_command"), ToolCallArguments(1, "{}"), ToolCallEnd(1)]]
    adapter = ResponsesAdapter("resp_2", 1, "m", request, ScriptedParser(batches), rp.ToolNames(tools))
    events = adapter.opening()
    for i in range(len(batches)):
        events += adapter.tokens(Tokens(i, "x", None))
    items = check_stream(events + adapter.finished(Finished("stop", "", "", 1, 1, 0, 0, 0, 1)))
    assert [(i["type"], i.get("arguments")) for i in items] == [
        ("reasoning", None), ("function_call", '{"cmd": "ls"}'), ("function_call", "{}")]  # blank text: no message


# -- a real server, the official client -------------------------------------------------------------------------

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
QUESTION = "What's the weather like in Paris?"
THINKING = {"chat_template_kwargs": {"thinking": True}}


def streamed(server, **request) -> tuple[object, list[dict]]:
    """The final response by the client's stream helper (which checks the events' order and
    indices), and the raw events."""
    with server.client.responses.stream(model="default", **request) as stream:
        events = [event.model_dump(warnings=False) for event in stream]
        final = stream.get_final_response()
    return final, events


def test_answers_streamed_and_not(server):
    plain = server.client.responses.create(model="default", input=QUESTION, extra_body=THINKING)
    assert plain.status == "completed" and plain.output_text == ANSWER
    assert [item.type for item in plain.output] == ["reasoning", "message"]
    assert plain.output[0].summary[0].text == THOUGHT
    assert plain.usage.output_tokens == 3 and plain.usage.output_tokens_details.reasoning_tokens == 2
    final, events = streamed(server, input=QUESTION, extra_body=THINKING)
    items = check_stream(events)
    assert final.output_text == ANSWER and [i["type"] for i in items] == ["reasoning", "message"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta") == THOUGHT
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == ANSWER
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["usage"]["output_tokens"] == 3


def test_function_call_round_trip_with_previous_response_id_and_by_resending(server):
    first = server.client.responses.create(model="default", input=QUESTION, tools=TOOLS)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == json.loads(CALL)["arguments"]
    _, events = streamed(server, input=QUESTION, tools=TOOLS)
    [item] = check_stream(events)
    assert (item["name"], item["arguments"]) == (call.name, call.arguments)
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == \
        call.arguments
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    # The follow-up names the first response: the server puts the conversation back together
    chained = server.client.responses.create(model="default", previous_response_id=first.id, input=[result],
                                             tools=TOOLS)
    assert chained.previous_response_id == first.id and chained.output[0].type == "function_call"
    # and it is the prompt a client resending every item gets (store: false, as Codex sends)
    resent = server.client.responses.create(
        model="default", input=[{"role": "user", "content": QUESTION}, *[i.model_dump() for i in first.output], result],
        tools=TOOLS, store=False)
    assert resent.usage.input_tokens == chained.usage.input_tokens > first.usage.input_tokens
    # and the prompt of the same turns through Chat Completions (one rendering for both APIs)
    chat = server.client.chat.completions.create(model="default", messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
        tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}])
    assert chat.usage.prompt_tokens == chained.usage.input_tokens
    # The prefix cache holds the first turn: the follow-up prefills only what is new
    assert chained.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert resent.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):  # store: false is not kept
        server.client.responses.retrieve(resent.id)


def test_tool_choice_required_opens_the_answer_with_a_call(server):
    """The prompt ends with the format's call opening (forced_calls.py): the scripted model, whose
    next token after `<tool_call>` is its call, completes it; the parser read the opening first."""
    answer = server.client.responses.create(model="default", input=QUESTION, tools=TOOLS, tool_choice="required")
    [call] = answer.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather",
                                                                  json.loads(CALL)["arguments"])
    plain = server.client.responses.create(model="default", input=QUESTION, tools=TOOLS)
    assert answer.usage.input_tokens == plain.usage.input_tokens + 1  # the opening's token is the prompt's


def test_get_and_delete(server):
    answer = server.client.responses.create(model="default", input=QUESTION)
    got = server.client.responses.retrieve(answer.id)
    assert got.model_dump() == answer.model_dump()
    server.client.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError) as caught:
        server.client.responses.retrieve(answer.id)
    assert caught.value.body["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        server.client.responses.delete(answer.id)
    with pytest.raises(openai.BadRequestError) as caught:
        server.client.responses.create(model="default", input="again", previous_response_id=answer.id)
    assert caught.value.body["param"] == "previous_response_id"


def test_web_search_is_left_out_and_bad_requests_get_openai_errors(server):
    answer = server.client.responses.create(model="default", input=QUESTION, tools=[{"type": "web_search"}])
    assert answer.output_text == f"<tool_call>{CALL}</tool_call>"  # no function tools: the markup is text
    assert server.stderr.count("tools of type 'web_search' are left out of the prompt") == 1
    with pytest.raises(openai.BadRequestError) as caught:
        server.client.responses.create(model="default", input=QUESTION, tools=TOOLS, tool_choice={
            "type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]})
    assert caught.value.body["param"] == "tool_choice"
    with pytest.raises(openai.NotFoundError):
        server.client.responses.create(model="gpt-5", input=QUESTION)


# -- Codex CLI itself -------------------------------------------------------------------------------------------

def codex_binary() -> Path:
    """Codex CLI of CODEX_VERSION (its native binary comes in an optional dependency)."""
    return npm_binary("@openai/codex", CODEX_VERSION, "codex")


# The model's call: of a plain function (Codex runs the command), or of a function in a namespace
# (Codex routes it by namespace and name: given back as one name, it answers "unsupported call")
SHELL_CALL = '{"name": "exec_command", "arguments": {"cmd": "echo pipeline-codex-ok"}}'
NAMESPACE_CALL = '{"name": "multi_agent_v1__wait_agent", "arguments": {"targets": ["nope"], "timeout_ms": 1000}}'
# The scripted template, with a thinking block opened in the prompt after a tool's output: the
# turn after the call thinks and answers, so a Codex turn is the call, its output, the answer
CODEX_TEMPLATE = TEMPLATE.replace("{% if thinking %}<think>{% endif %}",
                                  "{% if thinking or messages[-1].role == 'tool' %}<think>{% endif %}")


@pytest.mark.parametrize("call", [SHELL_CALL, NAMESPACE_CALL], ids=["function", "namespace"])
def test_codex_exec_calls_a_tool_and_answers(tmp_path, env_vars, call):
    """Codex CLI against `mpiexec -n 2 serve`: its first request (developer instructions, 9 tools)
    gets a function_call, which Codex runs (exec_command) or routes into its namespace
    (multi_agent_v1's wait_agent, which answers that there is no such agent); its second, with
    the call's output, gets reasoning and a message, and Codex ends the turn with that answer and
    exit status 0."""
    codex = codex_binary()
    assert CODEX_TEMPLATE != TEMPLATE
    folder = make_agent_model(tmp_path / "model", call, CODEX_TEMPLATE)
    server = Server(2, "--model", str(folder), "--max-tokens", "16", env={**env_vars, "PIPELINE_API_KEY": "sk-codex"},
                    key="sk-codex")
    try:
        home = tmp_path / "home"
        (home / ".codex").mkdir(parents=True)
        (home / ".codex" / "config.toml").write_text(
            'model = "default"\nmodel_provider = "pipeline"\n\n[model_providers.pipeline]\nname = "pipeline"\n'
            f'base_url = "{server.base}/v1"\nenv_key = "PIPELINE_API_KEY"\nwire_api = "responses"\n')
        work = tmp_path / "work"
        work.mkdir()
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
               "PIPELINE_API_KEY": "sk-codex"}
        result = subprocess.run([str(codex), "exec", "--json", "--skip-git-repo-check", "Say hello"], cwd=work,
                                env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        items = [json.loads(line)["item"] for line in result.stdout.splitlines()
                 if line.startswith("{") and json.loads(line).get("type") == "item.completed"]
        kinds = [item["type"] for item in items]
        assert "unsupported call" not in result.stderr, result.stderr[-3000:]  # Codex found the tool
        if call == SHELL_CALL:
            assert "command_execution" in kinds, result.stdout
            assert "echo pipeline-codex-ok" in items[kinds.index("command_execution")]["command"]
        else:
            assert "invalid agent id nope" in result.stderr, result.stderr[-3000:]  # wait_agent's own answer
        assert items[-1]["type"] == "agent_message" and items[-1]["text"] == ANSWER, result.stdout
        assert {"type": "reasoning", "text": THOUGHT} in [{k: item[k] for k in ("type", "text")} for item in items
                                                          if item["type"] == "reasoning"]
        # The second request resent the first's prompt: the prefix cache had it (usage cached_tokens)
        [usage] = [json.loads(line)["usage"] for line in result.stdout.splitlines() if '"turn.completed"' in line]
        assert usage["cached_input_tokens"] > 5000
        lines = [line for line in server.stderr.splitlines() if "serve: resp_" in line]
        assert len(lines) == 2 and all("finish stop" in line for line in lines), server.stderr
        first, second = (int(line.split(" prompt ")[1].split()[0]) for line in lines)
        assert first > 5000 and second > first  # Codex's instructions and tools, then the call and its output
        assert "tools of type 'web_search' are left out of the prompt" in server.stderr
    finally:
        assert server.stop() == 0, server.stderr
