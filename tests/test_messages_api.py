"""Anthropic's Messages API on `serve`: the adapter's events for parsed output (no server), then a
real `mpiexec -n 2 ... serve` with the official `anthropic` client on the scripted chat model
(tests/scripted_chat_model.py: its greedy answer is a tool call, or a thinking block and an answer),
then Claude Code itself on a tiny model with a 32k context (skipped where npm cannot get it, but in CI).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import anthropic
import pytest

from pipeline.chat.output import ChatMessage, ChatOutputParser
from pipeline.chat.tool_calls import ALL_FORMATS, KIMI_K2
from pipeline.runtime.requests import Finished, SamplingParams, Tokens
from pipeline.serve.anthropic_adapter import MessagesAPI
from pipeline.serve.app import with_pings
from pipeline.serve.forced_calls import forced_call_prefix
from agents import make_agent_model, npm_binary
from scripted_chat_model import ANSWER, CALL, TEMPLATE, THOUGHT, make_scripted_chat_model
from test_chat_serve import KIMI_OUTPUT, env_vars  # noqa: F401 -- env_vars is a fixture used here
from test_serve import Server

KEY = "sk-test-messages"
CLAUDE_CODE_VERSION = "2.1.332"
TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
QUESTION = [{"role": "user", "content": "What's the weather like in Paris?"}]
THINKING = {"type": "enabled", "budget_tokens": 1024}


def run_adapter(body: dict, pieces: list[str], parser: ChatOutputParser, reason="stop", completion=None):
    api = MessagesAPI()
    generation = api.parse(json.dumps(body).encode(), SamplingParams(), lambda name: None)
    generation.prompt_tokens, generation.stop = 9, generation.stop or []
    adapter = api.adapter("msg_1", 1, "served", lambda token_id: pieces[token_id], generation, parser)
    events = adapter.opening()
    for i, piece in enumerate(pieces):
        events += adapter.tokens(Tokens(i, piece))
    events += adapter.finished(Finished(reason, "".join(pieces), "", prompt_tokens=9,
                                        completion_tokens=completion or len(pieces), cached_tokens=4, queued_s=0,
                                        ttft_s=0.1, total_s=0.5))
    return events, adapter.response()


def test_adapter_streams_blocks_and_the_whole_message_agrees():
    # Kimi K2's output with the call's arguments in two pieces: two input_json_deltas, one parsed input
    body = {"model": "claude-opus-5-5", "max_tokens": 64000, "messages": QUESTION, "tools": TOOLS}
    events, message = run_adapter(body, KIMI_OUTPUT, ChatOutputParser(in_reasoning=False, tool_format=KIMI_K2))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] == 9
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert kinds.count("content_block_stop") == 3
    pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
              and e["delta"]["type"] == "input_json_delta"]
    assert len(pieces) == 2 and json.loads("".join(pieces)) == {"city": "Paris"}  # a delta per piece the parser makes
    signature = [e["delta"]["signature"] for e in events if e["type"] == "content_block_delta"
                 and e["delta"]["type"] == "signature_delta"]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    # Anthropic's usage: input_tokens excludes what was read from the cache
    assert events[-2]["usage"] == message["usage"] == {"input_tokens": 5, "output_tokens": len(KIMI_OUTPUT),
                                                       "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4}
    thinking, text, call = message["content"]
    assert thinking == {"type": "thinking", "thinking": "Need the weather.", "signature": signature[0]}
    assert text == {"type": "text", "text": "Let me check."}
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_") and call["name"] == "get_weather"
    assert call["input"] == {"city": "Paris"} and message["stop_reason"] == "tool_use"
    assert message["model"] == "served"


def test_omitted_thinking_keeps_its_block_and_signature():
    body = {"model": "m", "max_tokens": 64, "messages": QUESTION, "thinking": {"type": "adaptive", "display": "omitted"}}
    events, message = run_adapter(body, ["<think>", "secret", "</think>", "Hi"],
                                  ChatOutputParser(in_reasoning=False, tool_format=None))
    assert not [e for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta"]
    thinking, text = message["content"]
    assert thinking["thinking"] == "" and thinking["signature"] and text["text"] == "Hi"


# What a model writes after each format's forced opening: of any tool (the name is the model's), of get_weather
CONTINUATIONS = {
    "qwen": ('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', '{"city": "Paris"}}\n</tool_call>'),
    "deepseek_v3": ('function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "deepseek_v31": ('get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                     '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "kimi_k2": ('functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
                '<|tool_calls_section_end|>', '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'),
}
# The markup formats' prefix ends with the name (of a forced tool), before what closes it: the model writes that
MARKUP_CALLS = {
    "qwen_xml": "get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "glm": "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
    "minimax_m2": 'get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>',
    **{f"dsml_{v}": f'get_weather">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                    f"</｜DSML｜invoke>\n</｜DSML｜{block}>" for v, block in [("v32", "function_calls"), ("v4", "tool_calls")]},
}
CONTINUATIONS.update({name: (rest, rest.removeprefix("get_weather")) for name, rest in MARKUP_CALLS.items()})


@pytest.mark.parametrize("format", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("name", [None, "get_weather"], ids=["any", "tool"])
def test_forced_call_prefix_is_read_as_the_call_it_opens(format, name):
    """The prefix fed to the parser first, as app.py does, and the model's continuation: one call."""
    prefix = forced_call_prefix(format, name)
    parser = ChatOutputParser(in_reasoning=None, tool_format=format)
    assert parser.feed(prefix) == []
    message = ChatMessage()
    message.add(parser.feed(CONTINUATIONS[format.name][name is not None]) + parser.finish())
    [call] = message.tool_calls
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert not (message.content or "").strip()


def test_adapter_stop_reasons():
    body = {"model": "m", "max_tokens": 5, "messages": QUESTION, "stop_sequences": ["END"]}
    plain = ChatOutputParser(in_reasoning=None, tool_format=None)
    _, message = run_adapter(body, ["Hello", " there"], plain)
    assert (message["stop_reason"], message["stop_sequence"]) == ("end_turn", None)
    _, message = run_adapter(body, ["Hello", " E", "ND"], ChatOutputParser(in_reasoning=None, tool_format=None))
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    events, message = run_adapter(body, ["a"] * 5, ChatOutputParser(in_reasoning=None, tool_format=None),
                                  reason="length")
    assert message["stop_reason"] == "max_tokens" and events[-2]["delta"]["stop_reason"] == "max_tokens"


def test_requests_as_claude_code_sends_them():
    """Billing header dropped, a system message folded in, tool results and thinking given back,
    fields with no meaning here accepted."""
    body = {
        "model": "claude-opus-5-5", "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cc_entrypoint=cli;"},
                   {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call it.", "signature": "pipeline-abc"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
                {"type": "text", "text": "And?"}]}],
        "tools": [{**TOOLS[0], "defer_loading": False, "cache_control": {"type": "ephemeral"}},
                  {"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "thinking": {"type": "adaptive", "display": "summarized"}, "output_config": {"effort": "high"},
        "metadata": {"user_id": "u"}, "context_management": {"edits": []}, "service_tier": "auto",
        "speed": "standard"}
    generation = MessagesAPI().parse(json.dumps(body).encode(), SamplingParams(temperature=0.5), lambda name: None)
    assert generation.messages == [
        {"role": "system", "content": "You are Claude Code.\n\nBe brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "And?"}]
    assert [t["function"]["name"] for t in generation.tools] == ["get_weather"]  # a server tool is not offered
    assert generation.template_kwargs == {"thinking": True, "enable_thinking": True}
    assert generation.max_tokens == 32000 and generation.stream and generation.sampling.temperature == 0.5
    assert generation.forced_call is None


@pytest.mark.parametrize("fields, words", [
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, '"image"'),
    ({"messages": QUESTION + [{"role": "assistant", "content": "Sure"}]}, "prefill"),
    ({"tool_choice": {"type": "any"}, "thinking": THINKING}, "thinking may not be enabled"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "'nope'"),
    ({"tool_choice": {"type": "any"}}, "no tools"),
])
def test_bad_requests_name_the_field(fields, words):
    body = {"model": "m", "max_tokens": 10, "messages": QUESTION, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(Exception) as caught:
        MessagesAPI().parse(json.dumps(body).encode(), SamplingParams(), lambda name: None)
    error = MessagesAPI().error_body(caught.value)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error


def test_a_full_queue_is_overloaded():
    """The gateway's 429 (capacity) is Anthropic's 529 overloaded_error, which its clients retry."""
    from pipeline.serve.protocol import APIError

    error = APIError("the server is at capacity", status=429, code="rate_limit_exceeded")
    api = MessagesAPI()
    assert api.error_status(error) == 529
    assert api.error_body(error) == {"type": "error", "error": {"type": "overloaded_error",
                                                                "message": "the server is at capacity"}}
    assert api.stream_error(error) == (b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
                                       b'"message":"the server is at capacity"}}\n\n')


def test_pings_while_nothing_comes():
    async def slow():
        await asyncio.sleep(0.35)
        yield "event"

    async def collect():
        return [e async for e in with_pings(slow(), 0.1)]

    got = asyncio.run(collect())
    assert got[-1] == "event" and got[:-1] == [None] * len(got[:-1]) and len(got) >= 3


# -- a real server -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory, env_vars):  # noqa: F811 -- env_vars is test_chat_serve's fixture
    folder = make_scripted_chat_model(tmp_path_factory.mktemp("scripted") / "model")
    server = Server(2, "--model", str(folder), "--max-tokens", "16", "--api-key", KEY, env=env_vars, key=KEY)
    server.anthropic = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=120)
    yield server
    assert server.stop() == 0, server.stderr


def blocks(message) -> list[dict]:
    """A message's content blocks, what both replies have of them (the streamed one's are the client's "Parsed" kind)."""
    return [{k: v for k, v in b.model_dump().items() if k in ("type", "text", "thinking", "signature", "name", "input")}
            for b in message.content]


def stream(server, **request):
    """The raw events of a streamed request, and the message the client's own accumulation makes."""
    with server.anthropic.messages.stream(**request) as events:
        raw = list(events)
        return raw, events.get_final_message()


def test_thinking_and_answer_streamed_and_whole(server):
    request = dict(model="claude-opus-5-5", max_tokens=128000, messages=QUESTION, thinking=THINKING)
    message = server.anthropic.messages.create(**request)
    assert message.model == server.name and message.stop_reason == "end_turn"
    thinking, text = message.content
    assert (thinking.type, thinking.thinking, text.type, text.text) == ("thinking", THOUGHT, "text", ANSWER)
    assert thinking.signature
    raw, streamed = stream(server, **request)
    kinds = [e.type for e in raw]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert blocks(streamed) == blocks(message) and streamed.stop_reason == "end_turn"
    # The thinking goes back with its signature, and the conversation goes on
    history = QUESTION + [{"role": "assistant", "content": [b.model_dump() for b in message.content]},
                          {"role": "user", "content": "Thanks!"}]
    again = server.anthropic.messages.create(model="x", max_tokens=64, messages=history, thinking=THINKING)
    assert again.content[-1].text == ANSWER


def test_tool_use_round_trip(server):
    question = dict(model="claude-opus-5-5", max_tokens=4096, messages=QUESTION, tools=TOOLS)
    message = server.anthropic.messages.create(**question)
    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input == json.loads(CALL)["arguments"]
    raw, streamed = stream(server, **question)
    pieces = [e.delta.partial_json for e in raw if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert json.loads("".join(pieces)) == call.input and streamed.content[0].input == call.input
    assert streamed.stop_reason == "tool_use"
    # The client's tool_result goes back; with thinking on the scripted model answers in words
    history = QUESTION + [{"role": "assistant", "content": [call.model_dump()]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                        "content": "sunny, 21 C"}]}]
    answer = server.anthropic.messages.create(model="x", max_tokens=64, messages=history, tools=TOOLS,
                                              thinking=THINKING)
    assert answer.stop_reason == "end_turn" and answer.content[-1].text == ANSWER


def test_forced_tool_call_opens_the_answer(server):
    # With thinking on the scripted model would think and answer; tool_choice any makes it call
    # (thinking is then refused, as Anthropic does): the prompt gains the call's opening marker.
    plain = server.anthropic.messages.create(model="x", max_tokens=64, messages=QUESTION, tools=TOOLS,
                                             tool_choice={"type": "none"})
    assert plain.stop_reason == "end_turn" and plain.content[0].text == f"<tool_call>{CALL}</tool_call>"
    forced = server.anthropic.messages.create(model="x", max_tokens=64, messages=QUESTION, tools=TOOLS,
                                              tool_choice={"type": "any"})
    assert forced.stop_reason == "tool_use" and forced.content[0].input == {"city": "Paris"}
    auto = server.anthropic.messages.create(model="x", max_tokens=64, messages=QUESTION, tools=TOOLS)
    assert usage_total(forced.usage) == usage_total(auto.usage) + 1  # "<tool_call>" is one token here


def usage_total(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens


def test_count_tokens_and_prefix_cache_usage(server):
    long = [{"role": "user", "content": "Tell me about the weather in Paris. " * 20}]
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cc_entrypoint=cli;"},
              {"type": "text", "text": "You are a weather bot."}]
    counted = server.anthropic.messages.count_tokens(model="claude-opus-5-5", messages=long, system=system)
    first = server.anthropic.messages.create(model="x", max_tokens=4, messages=long, system=system)
    assert usage_total(first.usage) == counted.input_tokens
    # The billing header changes; the prompt does not (it is dropped), so the cache holds all of it but the last token
    system[0]["text"] = "x-anthropic-billing-header: cc_version=2; cc_entrypoint=cli;"
    second = server.anthropic.messages.create(model="x", max_tokens=4, messages=long, system=system)
    assert second.usage.cache_read_input_tokens >= counted.input_tokens - 1 > 0
    assert second.usage.input_tokens == counted.input_tokens - second.usage.cache_read_input_tokens


def test_errors_in_anthropics_shape(server):
    nobody = anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        nobody.messages.create(model="x", max_tokens=8, messages=QUESTION)
    assert caught.value.status_code == 401
    assert caught.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                            "message": "incorrect API key"}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        server.anthropic.messages.create(model="x", max_tokens=8, messages=QUESTION,
                                         output_config={"format": {"type": "json_schema", "schema": {}}})
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert "output_config.format" in caught.value.body["error"]["message"]
    # Bearer works as well as x-api-key; the query string Claude Code adds is ignored; no key is a 401 too
    status, body, _ = server.post("/v1/messages?beta=true", {"model": "x", "max_tokens": 4, "messages": QUESTION},
                                  {"authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"})
    assert status == 200 and body["type"] == "message"
    status, body, _ = server.post("/v1/messages/count_tokens", {"model": "x", "messages": QUESTION},
                                  {"x-api-key": KEY})  # as Claude Code sends it (this client sends a Bearer)
    assert status == 200 and body["input_tokens"] > 0
    status, body, _ = server.post("/v1/messages", {"model": "x", "max_tokens": 4, "messages": QUESTION})
    assert status == 401 and body["error"]["type"] == "authentication_error" and "x-api-key" in body["error"]["message"]
    status, body, _ = server.post("/v1/messages/nothing", {}, {"x-api-key": KEY})
    assert status == 404 and body["error"]["type"] == "not_found_error"


# -- Claude Code itself ------------------------------------------------------------------------------------------

# The scripted model's template (tools in the system turn, Qwen-style calls), thinking after a tool's result
CLAUDE_TEMPLATE = TEMPLATE.replace("{% if thinking %}<think>{% endif %}",
                                   "{% if messages[-1].role == 'tool' %}<think>{% endif %}")


def claude_binary() -> Path:
    """Claude Code of CLAUDE_CODE_VERSION (its package carries a native binary for each platform;
    its postinstall puts this one's in place)."""
    return npm_binary("@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, "claude")


def run_claude(claude: Path, server: Server, tmp_path: Path, prompt: str, *flags: str) -> subprocess.CompletedProcess:
    """`claude -p PROMPT` against the server, in a home and a folder of its own, with no other traffic."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": server.base,
           "ANTHROPIC_API_KEY": KEY, "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    return subprocess.run([str(claude), "-p", prompt, *flags], cwd=work, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)


def served(server: Server) -> list[tuple[int, int]]:
    """(prompt tokens, of them cached) of each Messages request, from the server's log lines."""
    lines = [line for line in server.stderr.splitlines() if "serve: msg_" in line]
    assert all("finish stop" in line for line in lines), server.stderr
    return [(int(line.split(" prompt ")[1].split()[0]), int(line.split(" tokens (")[1].split()[0])) for line in lines]


def test_claude_code_runs_a_tool_and_answers(tmp_path, env_vars):  # noqa: F811 -- env_vars is test_chat_serve's fixture
    """Claude Code's first request (its whole system prompt and tools) gets a Read call; Claude Code
    reads the file and sends its content back; the second request, its prefix from the cache, gets
    the answer, which Claude Code prints. Its usage adds up the two requests as Anthropic counts them."""
    claude = claude_binary()
    note = tmp_path / "work" / "note.txt"
    note.parent.mkdir()
    note.write_text("pipeline-magic-7\n")
    call = json.dumps({"name": "Read", "arguments": {"file_path": str(note)}})
    server = Server(2, "--model", str(make_agent_model(tmp_path / "model", call, CLAUDE_TEMPLATE)), "--api-key", KEY,
                    env=env_vars, key=KEY)
    try:
        result = run_claude(claude, server, tmp_path, "What does note.txt say?", "--output-format", "stream-json",
                            "--verbose")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr
        records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        results = [block for record in records if record["type"] == "user"
                   for block in record["message"]["content"] if block.get("type") == "tool_result"]
        assert any("pipeline-magic-7" in json.dumps(block["content"]) for block in results), records
        final = records[-1]
        assert (final["type"], final["result"], final["num_turns"], final["is_error"]) == ("result", ANSWER, 2, False)
        (first, first_cached), (second, second_cached) = served(server)
        assert first > 8192 and first_cached == 0  # more than the default model's context holds
        assert second_cached >= first  # the whole first prompt from the prefix cache
        usage = final["usage"]
        assert usage["cache_read_input_tokens"] == second_cached
        assert usage["input_tokens"] == first + second - second_cached
    finally:
        assert server.stop() == 0, server.stderr
    # With the default model's 8k context, Claude Code's prompt does not fit: it says so in its own words
    server = Server(2, "--model", str(make_agent_model(tmp_path / "small", call, CLAUDE_TEMPLATE, 8192)), "--api-key", KEY,
                    env=env_vars, key=KEY)
    try:
        result = run_claude(claude, server, tmp_path, "What does note.txt say?")
        assert result.returncode != 0
        # Claude Code's own words for Anthropic's "prompt is too long" error, which the server's 400 reads as
        assert result.stdout.startswith("Prompt is too long"), result.stdout + result.stderr
    finally:
        assert server.stop() == 0, server.stderr
