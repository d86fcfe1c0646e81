"""Serve under load: `pipeline serve` on 2 ranks with 1, 4 and 16 concurrent streaming clients,
~40-token chat prompts, 64 new tokens each (greedy); beside it the same requests as a
`pipeline batch` job, and `mlx_lm.server` in one process on the same cores.

Contenders, interleaved run by run (each a fresh server or job per run; load excluded):
  pipeline serve, 2 ranks            as shipped (weights auto -> fp32, OpenBLAS + the shim, 1 BLAS thread per rank)
  pipeline batch, 2 ranks            the same requests as a JSONL job, --max-batch = the clients
  mlx_lm.server, 1 process           `import pipeline` first (our BLAS set-up), fp32 weights, 2 BLAS threads
                                     (the same 2 cores), --decode-concurrency and --prompt-concurrency 16,
                                     listen backlog 2048 as ours (http.server's 5 reset clients at 16)
mlx_lm.server's --pipeline mode (under mlx.launch) is not among them: mlx-lm 0.32 refuses it for
Llama-family models such as the default SmolLM2 ("The model does not support pipelining").
Each client (http.client on OpenAI's streaming chat-completions API, light on the shared cores)
sends its requests one after another (a closed loop): clients x 2 requests per level (at least 4). Generated tok/s = completion tokens of all requests / time from the first request
sent to the last token received; time to first token from sending to the first content chunk.
A request that fails (connection reset, HTTP error) is recorded with the server's last log lines
under "failures" in the JSON, and its level has no figures for that run.

--multi-turn: a chat whose history grows to ~1000 tokens, 64 new tokens a turn; time to first
token of each turn, `pipeline serve` with its prefix cache (the default) and with
`--prefix-cache-gb 0`, and mlx_lm.server (its prompt cache).

    python benchmarks/serve_load.py [--runs 5] [--warmup 1] [--levels 1,4,16] [--max-tokens 64]
                                    [--no-mlx-lm] [--multi-turn]
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_batch import TOPICS, run_batch  # noqa: E402

ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1"}
LOG_LINES = 40  # of a server's log, shown and kept when a client fails
CLIENT_ERRORS = (OSError, http.client.HTTPException, RuntimeError, ValueError)  # connection, protocol, status, JSON
NAMES = ["Ada", "Bruno", "Chiara", "Dmitri", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kofi", "Lena"]


def prompts(count: int, offset: int = 0) -> list[str]:
    """Distinct ~40-token chat prompts (a prefix cache finds no whole prompt twice in a run)."""
    texts = [f"Write a short story about {topic}. The hero is called {name}."
             for name in NAMES for topic in TOPICS]
    return [texts[(offset + i) % len(texts)] for i in range(count)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# ---- servers -----------------------------------------------------------------------------------

class ServerProcess:
    """A server started as its own process group, ready once GET `ready_path` answers 200."""

    def __init__(self, cmd: list[str], port: int, model_name: str, env: dict, ready_path: str):
        self.port, self.model_name = port, model_name
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=common.REPO, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + 600
        while not self._answers(ready_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start: {' '.join(cmd)}\n{self.output()[-3000:]}")
            time.sleep(0.5)

    def _answers(self, path: str) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            conn.request("GET", path)
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def failure(self, what: str, error: BaseException) -> dict:
        """A client's error, shown with the server's last log lines (why it failed is there, if it
        knows), and kept for the JSON instead of ending the benchmark."""
        tail = self.output().splitlines()[-LOG_LINES:]
        exited = self.proc.poll()
        message = f"{what}: {type(error).__name__}: {error}" + (f" (server exited with {exited})"
                                                               if exited is not None else "")
        print(f"  FAILED {message}\n  server's last {len(tail)} log lines:\n" +
              "\n".join(f"    | {line}" for line in tail), flush=True)
        return {"error": message, "server_log_tail": tail}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def pipeline_server(model: Path, max_tokens: int, *extra: str) -> ServerProcess:
    port = free_port()
    return ServerProcess(["mpiexec", "-n", "2", sys.executable, "-m", "pipeline", "serve", "--model", str(model),
                          "--port", str(port), "--max-tokens", str(max_tokens), *extra], port, "default",
                         common.env_with_repo(**ONE_THREAD), "/health")


def mlx_lm_server(model: Path, max_tokens: int) -> ServerProcess:
    """One process on both cores: our BLAS set-up, 2 BLAS threads, fp32 weights. It answers
    /health before its model is loaded; the warm-up request waits for the load."""
    port = free_port()
    cmd = [sys.executable, str(common.REPO / "benchmarks" / "_mlx_lm_server_run.py"), "--pipeline-blas", "--dense",
           "--", "--model", str(model), "--port", str(port), "--max-tokens", str(max_tokens),
           "--decode-concurrency", "16", "--prompt-concurrency", "16", "--log-level", "WARNING"]
    return ServerProcess(cmd, port, "default_model", common.env_with_repo(OPENBLAS_NUM_THREADS="2"), "/health")


# ---- clients -----------------------------------------------------------------------------------

def chat_body(server: ServerProcess, messages: list[dict], max_tokens: int) -> dict:
    return {"model": server.model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


def stream_chat(server: ServerProcess, body: dict) -> dict:
    """One streaming request: when it was sent, its first content chunk, its end, its text and tokens."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=1800)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    first, text, usage = None, "", None
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                first = first or time.perf_counter()
                text += piece
    end = time.perf_counter()
    conn.close()
    return {"start": start, "ttft_s": (first or end) - start, "end": end, "text": text,
            "tokens": usage["completion_tokens"] if usage else None,
            "prompt_tokens": usage["prompt_tokens"] if usage else None,
            "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")}


def caught(request, *args):
    """`request(*args)`, or the client error it raised (one failed client must not stop the others)."""
    try:
        return request(*args)
    except CLIENT_ERRORS as e:
        return e


def load_level(server: ServerProcess, clients: int, texts: list[str], max_tokens: int) -> dict:
    """`clients` clients in a closed loop over `texts`; throughput and time to first token, or the
    first error and how many requests failed."""
    bodies = [chat_body(server, [{"role": "user", "content": t}], max_tokens) for t in texts]
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda body: caught(stream_chat, server, body), bodies))
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        return {**server.failure(f"{len(errors)} of {len(results)} requests at {clients} clients", errors[0]),
                "failed_requests": len(errors)}
    tokens = sum(r["tokens"] for r in results)
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    ttfts = [r["ttft_s"] for r in results]
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "ttft_p50": percentile(ttfts, 50),
            "ttft_p99": percentile(ttfts, 99), "texts": [r["text"] for r in results]}


def requests_for(clients: int) -> int:
    return max(4, 2 * clients)


def level_texts(levels: list[int]) -> dict[int, list[str]]:
    offsets = {c: sum(requests_for(l) for l in levels[:i]) for i, c in enumerate(levels)}
    return {c: prompts(requests_for(c), offsets[c]) for c in levels}


def serve_run(start, levels: list[int], max_tokens: int) -> dict:
    """One contender run: a fresh server, one warm-up request, then each level."""
    server = start()
    try:
        warm = caught(stream_chat, server, chat_body(server, [{"role": "user", "content": "Say hi."}], 8))
        if isinstance(warm, BaseException):
            return server.failure("the warm-up request", warm)
        out = {}
        for clients, texts in level_texts(levels).items():
            if server.proc.poll() is not None:  # it died at an earlier level: its error is recorded there
                break
            result = load_level(server, clients, texts, max_tokens)
            out.update({f"{k}_c{clients}": v for k, v in result.items()})
        return out
    finally:
        server.stop()


def batch_run(model: Path, levels: list[int], max_tokens: int) -> dict:
    """The same requests as `pipeline batch` jobs on 2 ranks, --max-batch = the clients."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for clients, texts in level_texts(levels).items():
            requests = Path(tmp) / f"c{clients}.jsonl"
            requests.write_text("".join(json.dumps({"id": i, "prompt": t, "max_tokens": max_tokens}) + "\n"
                                        for i, t in enumerate(texts)))
            result = run_batch(2, model, requests, max_tokens, "--max-batch", str(clients))
            out.update({f"tok_s_c{clients}": result["tok_s"], f"texts_c{clients}": result["texts"]})
    return out


# ---- a growing chat --------------------------------------------------------------------------------

def conversation_run(start, history_tokens: int, max_tokens: int) -> dict:
    """A chat whose history grows past `history_tokens`; each turn's time to first token."""
    server = start()
    try:
        warm = caught(stream_chat, server, chat_body(server, [{"role": "user", "content": "Say hi."}], 8))
        if isinstance(warm, BaseException):
            return server.failure("the warm-up request", warm)
        messages, turns = [], []
        sentences = [s.strip() + "." for s in common.PROSE.split(".") if s.strip()]
        while not turns or turns[-1]["prompt_tokens"] < history_tokens:
            part = " ".join(sentences[len(turns) % len(sentences):] + sentences[:len(turns) % len(sentences)])
            messages.append({"role": "user", "content": f"Here is more of the chronicle: {part} What happens next?"})
            result = caught(stream_chat, server, chat_body(server, messages, max_tokens))
            if isinstance(result, BaseException):
                return {**server.failure(f"turn {len(turns) + 1} of the chat", result), "turns": turns}
            messages.append({"role": "assistant", "content": result["text"]})
            turns.append({k: result[k] for k in ("ttft_s", "prompt_tokens", "cached_tokens", "tokens")})
        return {"ttft_last": turns[-1]["ttft_s"], "prompt_tokens_last": turns[-1]["prompt_tokens"],
                "cached_last": turns[-1]["cached_tokens"], "turns": turns}
    finally:
        server.stop()


# ---- main --------------------------------------------------------------------------------------

def main() -> None:
    parser = common.arguments(__doc__)
    parser.add_argument("--levels", default="1,4,16", help="concurrent clients, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-mlx-lm", action="store_true", help="leave out the mlx_lm.server contenders")
    parser.add_argument("--multi-turn", action="store_true", help="also the growing chat (prefix cache)")
    parser.add_argument("--history-tokens", type=int, default=1000)
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    model = common.default_model()
    print(f"{model}: levels {levels} clients, {args.max_tokens} new tokens each; load {common.load_average()}",
          flush=True)
    contenders = {
        "pipeline serve, 2 ranks": lambda: serve_run(lambda: pipeline_server(model, args.max_tokens), levels,
                                                     args.max_tokens),
        "pipeline batch, 2 ranks": lambda: batch_run(model, levels, args.max_tokens),
    }
    if not args.no_mlx_lm:
        contenders["mlx_lm.server, 1 process"] = lambda: serve_run(
            lambda: mlx_lm_server(model, args.max_tokens), levels, args.max_tokens)
    log = lambda line: print(line[:400], flush=True)  # noqa: E731 -- the texts make long lines
    runs = common.interleave(contenders, args.runs, args.warmup, log=log)
    keys = [f"{k}_c{c}" for c in levels for k in ("tok_s", "ttft_p50", "ttft_p99")]
    stats = {c: common.summarize_runs(rs, keys) for c, rs in runs.items()}
    ours, top = "pipeline serve, 2 ranks", f"c{levels[-1]}"
    # A contender whose top level failed in every run has no median there, so no ratio
    ratios = {f"{ours} / {c}, {levels[-1]} clients, tok/s": stats[ours][f"tok_s_{top}"]["median"]
              / stats[c][f"tok_s_{top}"]["median"] for c in stats
              if c != ours and stats[ours][f"tok_s_{top}"].get("median") and stats[c][f"tok_s_{top}"].get("median")}
    failures = {c: [{k: v for k, v in r.items() if k.startswith(("error", "failed_requests"))} for r in rs]
                for c, rs in runs.items() if any(k.startswith("error") for r in rs for k in r)}

    def same_as_batch(contender: str) -> dict[str, int | None]:
        """Greedy texts against the batch job's, request by request, in the first run (None: no texts)."""
        batch, other = runs["pipeline batch, 2 ranks"][0], runs[contender][0]
        return {f"c{c}": sum(common.same_text(a, b) for a, b in zip(other[f"texts_c{c}"], batch[f"texts_c{c}"]))
                if f"texts_c{c}" in other and f"texts_c{c}" in batch else None for c in levels}

    same = same_as_batch(ours)
    same_mlx_lm = same_as_batch("mlx_lm.server, 1 process") if "mlx_lm.server, 1 process" in runs else None

    conversation = None
    if args.multi_turn:
        chat_contenders = {
            "pipeline serve, prefix cache": lambda: conversation_run(
                lambda: pipeline_server(model, args.max_tokens), args.history_tokens, args.max_tokens),
            "pipeline serve, --prefix-cache-gb 0": lambda: conversation_run(
                lambda: pipeline_server(model, args.max_tokens, "--prefix-cache-gb", "0"), args.history_tokens,
                args.max_tokens),
        }
        if not args.no_mlx_lm:
            chat_contenders["mlx_lm.server, 1 process"] = lambda: conversation_run(
                lambda: mlx_lm_server(model, args.max_tokens), args.history_tokens, args.max_tokens)
        chat_runs = common.interleave(chat_contenders, args.runs, args.warmup, log=log)
        conversation = {"stats": {c: common.summarize_runs(rs, ["ttft_last"]) for c, rs in chat_runs.items()},
                        "runs_detail": chat_runs}
        cold = conversation["stats"]["pipeline serve, --prefix-cache-gb 0"]["ttft_last"].get("median")
        warm = conversation["stats"]["pipeline serve, prefix cache"]["ttft_last"].get("median")
        if cold and warm:
            ratios["last turn's time to first token, --prefix-cache-gb 0 / prefix cache"] = cold / warm
        failures.update({f"chat: {c}": [{k: v for k, v in r.items() if k == "error"} for r in rs]
                         for c, rs in chat_runs.items() if any("error" in r for r in rs)})
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    print(f"  texts equal to the batch job's (requests per level): serve {same}, mlx_lm.server {same_mlx_lm}")
    for c, errors in failures.items():
        print(f"  FAILED runs of {c}: {errors}")
    for rs in runs.values():
        for r in rs:
            for key in [k for k in r if k.startswith("texts")]:
                r.pop(key)
    payload = common.record(
        "serve_load", "pipeline serve on 2 ranks under 1/4/16 streaming clients vs the same requests as a batch "
        "job and mlx_lm.server (1 process on the same 2 cores)", runs=args.runs, warmup=args.warmup,
        levels=levels, max_tokens=args.max_tokens, requests={c: requests_for(c) for c in levels},
        load_after=common.load_average(), stats=stats, ratios=ratios, same_text_serve_vs_batch=same,
        same_text_mlx_lm_vs_batch=same_mlx_lm, failures=failures, conversation=conversation, runs_detail=runs)
    path = common.write_json("serve_load", payload)

    panels = 4 if conversation else 3
    fig, axes = common.figure(panels, width=5.5)
    groups = [f"{c} client{'s' if c > 1 else ''}" for c in levels]
    for ax, (key, label) in zip(axes, [("tok_s", "generated tok/s"), ("ttft_p50", "time to first token p50, s"),
                                       ("ttft_p99", "time to first token p99, s")]):
        series = {c: [s.get(f"{key}_c{l}") if s.get(f"{key}_c{l}", {}).get("n") else None for l in levels]
                  for c, s in stats.items()}
        common.bars(ax, f"{label} ({args.max_tokens} new tokens, ~40-token prompts)", groups, series, label)
    if conversation:
        common.bars(axes[3], f"chat reaching ~{args.history_tokens} tokens: last turn's time to first token",
                    ["last turn"], {c: [s["ttft_last"]] for c, s in conversation["stats"].items()}, "s")
        axes[3].legend(fontsize=7)
    common.save(fig, common.RESULTS / "serve_load.png", axes[0])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
