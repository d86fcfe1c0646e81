"""A tiny Llama whose greedy output is scripted, for end-to-end tests of what a chat model's
answer becomes (reasoning, tool calls) through a real server: a random model never writes a tool
call, and a test that hopes it will shows nothing.

How: every layer's output projections are zero, so each position's hidden state is its token's
embedding, and the next token depends on the current one alone. The tokens of two scripts get
orthogonal embeddings and the LM head maps each to its successor:

    prompt ends "assistant\\n"          -> <tool_call> CALL </tool_call> <|im_end|>
    prompt ends "<think>" (thinking on) -> THOUGHT </think> ANSWER <|im_end|>

Whole strings (CALL, THOUGHT, ANSWER) are added tokens, so each is one step. Everything else is
the ordinary pipeline: the tokenizer, the chat template (written here in Qwen's style: tools in
the system turn, calls in <tool_call> tags, `thinking` opening <think> in the prompt), the engine
and the server.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from conftest import make_tiny_model

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
THOUGHT = "The user greets me; a short greeting back will do."
ANSWER = "Hello! How can I help?"
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", CALL, THOUGHT, ANSWER]
EOS = "<|im_end|>"

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    "Call a tool as <tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content.split('</think>')[-1] }}"
    "{% for c in message.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if thinking %}<think>{% endif %}{% endif %}")


def make_scripted_chat_model(folder: Path) -> Path:
    import tokenizers

    make_tiny_model("llama", folder, vocab_size=400)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens(ADDED)
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))

    def id_of(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, (text, ids)
        return ids[0]

    newline = tok.encode("assistant\n", add_special_tokens=False).ids[-1]  # the tool script's start
    scripts = [[newline, *map(id_of, ["<tool_call>", CALL, "</tool_call>", EOS])],
               [*map(id_of, ["<think>", THOUGHT, "</think>", ANSWER, EOS])]]
    return script_weights(folder, scripts)


def script_weights(folder: Path, scripts: list[list[int]]) -> Path:
    """The saved model's weights rewritten so that greedy decoding follows each script: after a
    script's token, the next one (one axis of the hidden state per step, so fewer steps than the
    hidden size; a token followed in two scripts must be followed by the same one)."""
    from safetensors.numpy import load_file, save_file

    weights_file = folder / "model.safetensors"
    weights = load_file(str(weights_file))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = np.zeros_like(weights[name])
    embed, head = weights["model.embed_tokens.weight"], np.zeros_like(weights["lm_head.weight"])
    weights["model.norm.weight"] = np.ones_like(weights["model.norm.weight"])
    axis = 0
    for script in scripts:
        for current, successor in zip(script, script[1:]):
            embed[current] = 0
            embed[current, axis] = 1.0
            head[successor, axis] = 10.0  # logit 80 after the final norm; every other token's is 0
            axis += 1
    weights["lm_head.weight"] = head
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    return folder
