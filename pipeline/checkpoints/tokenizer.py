"""Tokenizer, chat template and streaming detokenizer for a Hugging Face-layout model folder.

We load tokenizer.json with the `tokenizers` library (or, for Kimi K2 folders that ship a `tiktoken.model` rank
file instead, build the encoding with the `tiktoken` library) and render chat templates with jinja2 the way
transformers does, so prompts match what the model was trained with, without importing transformers and without
running any Python that came with the model.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from datetime import datetime
from importlib import resources
from pathlib import Path

from ..util.errors import UserError
from .gguf_tokenizer import tokenizer_settings
from .split_patterns import KIMI_PAT_STR

# The model types whose chat format is published as a Python script, not a template: ours, by model type
# (V3.2 and V4 write tool calls and results differently, and a template cannot see the model type)
OUR_TEMPLATES = {"deepseek_v32": "deepseek-v3.2.jinja", "deepseek_v4": "deepseek-v4.jinja"}

# The named special tokens transformers hands to a chat template (when they are set).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REPLACEMENT = "\ufffd"  # what decode gives for an incomplete UTF-8 sequence


class HFTokenizersBackend:
    """The `tokenizers`-library backend (a tokenizer.json, or one built from a GGUF's metadata). A second
    backend (e.g. tiktoken for Kimi) needs the same four members."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)  # base vocabulary + added tokens

    @classmethod
    def from_file(cls, path: Path) -> "HFTokenizersBackend":
        # Here, not at the top: slow to import, and every rank imports this module; only rank 0 reads a tokenizer.
        import tokenizers

        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise UserError(f"cannot load {path}: {_one_line(e)}") from None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


_KIMI_NUM_RESERVED = 256   # special-token ids: the 256 right after the base vocabulary
_KIMI_MAX_CHUNK = 400_000  # Kimi encodes ordinary text in chunks of at most this many characters ...
_KIMI_MAX_RUN = 25_000     # ... cut further so no piece has a longer run of all-space or all-non-space characters


class _TiktokenBackend:
    """Kimi K2's tokenizer (tiktoken.model + tokenizer_config.json), rebuilt without its tokenization_kimi.py.

    Ids 0..n-1 are the n ranks of the rank file; n..n+255 are special tokens, named by tokenizer_config.json's
    added_tokens_decoder where it names them and `<|reserved_token_{id}|>` elsewhere. Special-token text in the
    input always encodes to its id (Kimi's tokenizer passes allowed_special="all"), and no BOS is ever added.
    """

    def __init__(self, rank_file: Path, tokenizer_config: dict):
        import tiktoken  # here, not at the top: slow to import, and only Kimi's tokenizer uses it

        ranks = _read_tiktoken_ranks(rank_file)
        base = len(ranks)
        decoder = tokenizer_config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise UserError(f"{rank_file.parent / 'tokenizer_config.json'}: added_tokens_decoder should be an object")
        named: dict[int, tuple[str, bool]] = {}
        for key, value in decoder.items():
            content = _token_content(value)
            if not (isinstance(key, str) and key.isdigit() and content is not None):
                raise UserError(f"{rank_file.parent / 'tokenizer_config.json'}: bad added_tokens_decoder entry {key!r}")
            special = not (isinstance(value, dict) and value.get("special") is False)
            named[int(key)] = (content, special)
        self._specials: dict[str, int] = {}
        # decode(skip_special_tokens=True) leaves out the named tokens marked special, as transformers does with
        # Kimi's tokenizer: it keeps the tool-call markers ("special": false) and the unnamed reserved ids
        self._skip_ids: set[int] = set()
        for i in range(base, base + _KIMI_NUM_RESERVED):  # as Kimi does: entries outside this range are ignored
            content, special = named.get(i, (f"<|reserved_token_{i}|>", False))
            self._specials[content] = i
            if special:
                self._skip_ids.add(i)
        try:
            self._enc = tiktoken.Encoding(name=rank_file.name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=self._specials)
        except Exception as e:  # tiktoken's Rust side raises plain ValueErrors
            raise UserError(f"cannot load {rank_file}: {_one_line(e)}") from None
        self.vocab_size = self._enc.n_vocab  # base vocabulary + the 256 special ids
        # Longest names first, so a name that starts another one never cuts it short
        names = sorted(self._specials, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, names)) + ")")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # add_special_tokens changes nothing: Kimi's tokenizer has no post-processor and adds no BOS or EOS
        ids: list[int] = []
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2:  # re.split puts the matched special tokens at the odd positions
                ids.append(self._specials[part])
                continue
            for start in range(0, len(part), _KIMI_MAX_CHUNK):
                for piece in _split_long_runs(part[start:start + _KIMI_MAX_CHUNK], _KIMI_MAX_RUN):
                    ids += self._enc.encode_ordinary(piece)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        # Unknown ids are dropped, like the tokenizers library does; tiktoken itself would raise
        n = self.vocab_size
        keep = [i for i in ids if 0 <= i < n and not (skip_special_tokens and i in self._skip_ids)]
        return self._enc.decode(keep, errors="replace")  # U+FFFD for split UTF-8, as StreamingDetokenizer expects

    def token_to_id(self, token: str) -> int | None:
        """A special token's id, or the rank of the token whose bytes are `token` in UTF-8."""
        if token in self._specials:
            return self._specials[token]
        try:
            return self._enc.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None


class Tokenizer:
    def __init__(self, backend, *, name: str, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None, add_bos_token: bool | None = None,
                 extra_eos_ids: tuple[int, ...] = ()):
        self._backend = backend
        self._name = name  # the folder, for error messages
        self._chat_template = chat_template
        self._compiled_template = None
        self._renders_tools: bool | None = None
        self._special_tokens = dict(special_tokens or {})
        self._add_bos_token = add_bos_token
        self.bos_token: str | None = self._special_tokens.get("bos_token")
        self._bos_id = backend.token_to_id(self.bos_token) if self.bos_token is not None else None
        self.vocab_size: int = backend.vocab_size
        eos = set(extra_eos_ids)
        if "eos_token" in self._special_tokens:
            eos_id = backend.token_to_id(self._special_tokens["eos_token"])
            if eos_id is not None:
                eos.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    # -- loading ---------------------------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder) -> "Tokenizer":
        folder = Path(folder)
        if folder.is_file():  # a GGUF file: vocabulary, merges and chat template from its metadata
            tokenizer, settings = tokenizer_settings(folder)
            return cls(HFTokenizersBackend(tokenizer), **settings)
        tok_json, rank_file = folder / "tokenizer.json", folder / "tiktoken.model"
        tcfg = _read_json(folder / "tokenizer_config.json")
        if tok_json.is_file():
            backend = HFTokenizersBackend.from_file(tok_json)
        elif rank_file.is_file():
            # Kimi K2: the folder's tokenization_kimi.py is never imported; its pattern and rules are rebuilt here
            model_type = _read_json(folder / "config.json").get("model_type")
            if model_type == "kimi_k3":
                raise UserError(f"{folder}: Kimi K3's tokenizer (its own split pattern and Python chat encoder) "
                                "is not supported; only Kimi K2-style tiktoken.model folders are")
            backend = _TiktokenBackend(rank_file, tcfg)
        else:
            raise UserError(f"no tokenizer.json (or Kimi's tiktoken.model) in model folder {folder}: "
                            "copy the model's tokenizer files there")

        special = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = _token_content(tcfg.get(key))
            if value is not None:
                special[key] = value

        # chat_template.jinja beside the config takes priority, as in transformers
        template = None
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        elif tcfg.get("chat_template") is not None:
            template = _pick_default_template(tcfg["chat_template"], folder / "tokenizer_config.json")
        elif (model_type := _read_json(folder / "config.json").get("model_type")) in OUR_TEMPLATES:
            # published as a Python script: ours, written from its docs (templates/README.md)
            ours = resources.files(__package__) / "templates" / OUR_TEMPLATES[model_type]
            template = ours.read_text(encoding="utf-8")

        extra_eos = []
        for name in ("config.json", "generation_config.json"):
            extra_eos += _int_list(_read_json(folder / name).get("eos_token_id"), folder / name)

        add_bos = tcfg.get("add_bos_token")
        return cls(backend, name=str(folder), chat_template=template, special_tokens=special,
                   add_bos_token=add_bos if isinstance(add_bos, bool) else None, extra_eos_ids=tuple(extra_eos))

    # -- encoding --------------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        _check_unicode(text)
        ids = self._backend.encode(text, add_special_tokens)
        # tokenizer.json's post-processor decides which special tokens to add (transformers 5 does the same).
        # But when the config explicitly asks for a BOS and the post-processor did not add one, add it: a
        # missing BOS quietly degrades many models, and transformers 4's Llama tokenizer added it here too.
        if (add_special_tokens and self._add_bos_token and self._bos_id is not None
                and (not ids or ids[0] != self._bos_id)):
            ids = [self._bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        # No clean_up_tokenization_spaces: it is lossy, and streaming needs decode to be exact
        return self._backend.decode(list(ids), skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # -- chat template ---------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The chat template's text (the output parsers in pipeline.chat read its format from it)."""
        return self._chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """The prompt text of `messages` (OpenAI's shape: an assistant turn's `tool_calls` with
        `function.arguments` as a JSON string, `role: "tool"` turns with `tool_call_id`, an assistant
        turn's `reasoning_content`), with `tools` (OpenAI's function list) and the template's own
        switches in `template_kwargs` (`thinking`, `enable_thinking`, ...), passed as transformers does."""
        if self._chat_template is None:
            raise UserError(f"the tokenizer in {self._name} has no chat template: run without the chat template")
        import jinja2  # as in _jinja_env: only a chat template needs it

        for i, m in enumerate(messages):  # named as the request names them, before the template mixes them up
            _check_unicode(m.get("content"), f"messages[{i}].content")
        template_kwargs = template_kwargs or {}
        taken = sorted(set(template_kwargs) & ({"messages", "tools", "documents", "add_generation_prompt"}
                                               | set(self._special_tokens)))
        if taken:
            raise UserError(f"chat template variable {taken[0]!r} is set from the request itself, not as a "
                            f"template keyword: drop it")
        try:
            if self._compiled_template is None:
                self._compiled_template = _jinja_env().from_string(self._chat_template)
            # Like transformers: drop None-valued keys (templates handle a missing key better than None), and
            # pass only the special tokens that are set (an unset one must stay undefined, not render "None").
            messages = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
            return self._compiled_template.render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                **self._special_tokens, **template_kwargs)
        except jinja2.TemplateError as e:
            where = f" (template line {e.lineno})" if isinstance(e, jinja2.TemplateSyntaxError) else ""
            raise UserError(f"the chat template of {self._name} failed{where}: {_one_line(e)}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            # e.g. a template adding a string to a missing field; still the template's problem, not ours
            raise UserError(f"the chat template of {self._name} failed: {type(e).__name__}: {_one_line(e)}") from None

    def renders_tools(self) -> bool:
        """Whether the chat template writes a request's `tools` into the prompt at all (DeepSeek V3's
        and R1's first templates ignore them): a probe tool's name must appear in the rendered text."""
        if self._renders_tools is None:
            probe = "pipeline_probe_tool_5f3a"
            tools = [{"type": "function", "function": {"name": probe, "description": "probe",
                                                       "parameters": {"type": "object", "properties": {}}}}]
            try:
                self._renders_tools = probe in self.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                        tools=tools)
            except UserError:  # a template that fails on tools does not render them either
                self._renders_tools = False
        return self._renders_tools

    def prompt_ids(self, prompt: str, system: str | None = None, use_chat_template: bool = True) -> list[int]:
        _check_unicode(prompt)
        _check_unicode(system, "the system message")
        if use_chat_template and self.has_chat_template:
            messages = ([{"role": "system", "content": system}] if system is not None else [])
            messages.append({"role": "user", "content": prompt})
            # The rendered text already carries a BOS wherever the model wants one, so add no special tokens
            # (this is what transformers' apply_chat_template(tokenize=True) does).
            return self.encode(self.apply_chat_template(messages, add_generation_prompt=True),
                               add_special_tokens=False)
        if system is not None:
            why = "it has no chat template" if not self.has_chat_template else "the chat template is turned off"
            raise UserError(f"a system prompt needs a chat template, but {why} ({self._name}): drop the system prompt")
        return self.encode(prompt, add_special_tokens=True)


class StreamingDetokenizer:
    """Turns a growing token list into text pieces as they become printable.

    The pieces concatenate to exactly decode(all ids), cut before the first stop string. Decoding is incremental:
    each step decodes only the tokens since the last clean point plus the step before it as context. The context
    matters because decoders treat the start of a sequence specially (SentencePiece drops the first token's
    leading space), so decode(a) + decode(b) != decode(a + b) in general; with the context token in front, the
    start effect falls on the context in both decodes and cancels out of the difference.
    """

    def __init__(self, tokenizer: Tokenizer, stop_strings: list[str] = ()):
        self._tok = tokenizer
        self._stops = [s for s in stop_strings if s]  # an empty stop string would stop before any text
        self._ids: list[int] = []
        self._prefix = 0          # context tokens start here
        self._read = 0            # text of ids[:read] is fully decoded (ids[read:] is the pending region)
        self._prefix_text = ""    # decode(ids[prefix:read]), for taking the context back off
        self._committed_chars = 0  # len(text of ids[:read]), for the rare full-decode fallback
        self._region_sent = 0     # chars of the pending region's text already passed on
        self._held = ""           # decoded text not yet returned: it might be the start of a stop string
        self._pieces: list[str] = []
        self._finished = False
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int) -> str:
        """Add one generated token; return the new text that is safe to print now (often "")."""
        if self.stopped or self._finished:
            return ""
        self._ids.append(token_id)
        region = self._region_text()
        if region.endswith(_REPLACEMENT):
            # The tail may be an incomplete UTF-8 sequence that later tokens complete: hold it back, but pass
            # on the text before it, which can no longer change.
            stable = len(region.rstrip(_REPLACEMENT))
            new = region[self._region_sent:stable]
            self._region_sent = max(self._region_sent, stable)
        else:
            # A clean end: the region is final. It becomes the context for the next step.
            new = region[self._region_sent:]
            self._committed_chars += len(region)
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
            self._region_sent = 0
        return self._emit(new, final=False)

    def finish(self) -> str:
        """Return any text still held back (cut before a stop string if one completes now)."""
        if self.stopped or self._finished:
            return ""
        self._finished = True
        new = self._region_text()[self._region_sent:] if self._read < len(self._ids) else ""
        return self._emit(new, final=True)

    def _region_text(self) -> str:
        """The text of the pending tokens ids[read:], as it appears in decode(all ids)."""
        window = self._tok.decode(self._ids[self._prefix:])
        if window.startswith(self._prefix_text):
            return window[len(self._prefix_text):]
        # A decoder where the context trick does not hold: decode everything (slow but exact)
        return self._tok.decode(self._ids)[self._committed_chars:]

    def _emit(self, new: str, final: bool) -> str:
        held = self._held + new
        out = held
        self._held = ""
        if self._stops:
            # Every earlier position was checked before it was emitted, so a stop can only start inside `held`
            hits = [i for i in (held.find(s) for s in self._stops) if i >= 0]
            if hits:
                out = held[:min(hits)]
                self.stopped = True
            elif not final:
                keep = _stop_prefix_len(held, self._stops)
                out, self._held = held[:len(held) - keep], held[len(held) - keep:]
        if out:
            self._pieces.append(out)
        return out


# -- helpers -------------------------------------------------------------------------------------------------

def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is the start (not the whole) of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken rank file: one `<base64 token> <rank>` per line, ranks 0..n-1.

    The format is tiktoken's (tiktoken.load.load_tiktoken_bpe parses it the same way), but that function copies
    every file it reads into a cache under /tmp keyed by the file's path, so a folder updated in place would keep
    loading the old ranks; hence this small reader."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except (ValueError, binascii.Error):
            raise UserError(f"{path} line {number} is not `<base64 token> <rank>`: {line[:80]!r}") from None
    values = set(ranks.values())
    if not ranks or len(values) != len(ranks) or min(values) != 0 or max(values) != len(ranks) - 1:
        raise UserError(f"{path}: the ranks should be 0..{len(ranks) - 1}, each used once by a distinct token")
    return ranks


def _split_long_runs(text: str, limit: int):
    """Cut `text` so that no piece has more than `limit` consecutive whitespace or non-whitespace characters.

    Kimi's tokenizer does this before calling tiktoken (whose regex is slow on huge runs), and where it cuts
    changes the tokens, so we cut at the same places."""
    start, run, run_is_space = 0, 0, None
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        if is_space != run_is_space:
            run, run_is_space = 1, is_space
            continue
        run += 1
        if run > limit:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


# The names a message's reasoning goes by: templates read `reasoning_content` (Kimi K2 Thinking, Qwen3) or
# `thinking` (gpt-oss); transformers fills both from whichever a message has, and so do we.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _jinja_env():
    """A sandboxed environment set up like transformers' chat-template renderer."""
    # Here, not at the top: slow to import, and every rank imports this module; only rank 0 renders a template.
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters and sorts keys; templates expect plain json.dumps
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({_one_line(e)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} should hold a JSON object")
    return data


def _token_content(value) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_default_template(value, path: Path) -> str:
    """chat_template is a string, or a list of {"name", "template"} of which we use "default"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise UserError(f"{path} lists chat templates {sorted(map(str, named))} but none named 'default'")
    raise UserError(f"{path}: chat_template should be a string or a list of named templates")


def _int_list(value, path: Path) -> list[int]:
    """eos_token_id in config.json / generation_config.json: absent, an int, or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise UserError(f"{path}: eos_token_id should be an integer or a list of integers, got {value!r}")
    return list(values)


def _check_unicode(text, what: str = "the prompt") -> None:
    """Text must be valid Unicode to be tokenized: a lone surrogate (JSON's "\\ud800", or a command-line
    argument that was not UTF-8, which Python keeps as surrogates) cannot be encoded as UTF-8.
    what: the text as the user knows it, for the message (positions count in it)."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        if 0xDC80 <= bad <= 0xDCFF:  # Python's stand-in for a byte that did not decode
            raise UserError(f"{what} is not UTF-8: byte 0x{bad - 0xDC00:02x} at character {e.start}; "
                            f"convert it to UTF-8 (e.g. with iconv -t UTF-8)") from None
        raise UserError(f"{what} is not valid text: a lone surrogate \\u{bad:04x} at character {e.start} "
                        f"(a surrogate pair needs both halves)") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
