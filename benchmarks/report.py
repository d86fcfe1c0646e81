"""Markdown tables from benchmarks/results/*.json, written into benchmarks/README.md between the
markers `<!-- benchmarks:begin -->` and `<!-- benchmarks:end -->` (or printed with --print).

    python benchmarks/report.py [--print]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"


def load(name: str) -> dict | None:
    path = common.RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def med(s: dict | None, scale: float = 1.0, digits: int = 3) -> str:
    if not s or not s.get("n"):
        return "-"
    return f"{s['median'] * scale:.{digits}g} ±{s['spread_pct'] / 2:.0f}%"


def num(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}g}"


def header(p: dict) -> str:
    m = p["machine"]
    load = p.get("load_after")
    return (f"{m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB; mlx {p['versions'].get('mlx')}, "
            f"mlx-lm {p['versions'].get('mlx-lm')}; commit {p['git']['commit'][:8]}{' plus uncommitted changes' if p['git']['dirty'] else ''}; "
            f"{p['date'][:16]}; load average at the end {load[0]:.1f}" if load else "")


def single(p: dict) -> list[str]:
    out = [f"**2a. One rank, batch 1** (`benchmarks/bench_single.py`; median ±half the min-max spread of "
           f"{p['runs']} interleaved runs; {header(p)}). ![2a](results/single.png)", "",
           "| model | contender | prefill tok/s | decode tok/s | TTFT s | peak RSS MiB | same text |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, r in p["models"].items():
        for c, s in r["stats"].items():
            out.append(f"| {model} ({r['parameters'] / 1e9:.2f} B, prompt {r['prompt_tokens']}, {r['new_tokens']} new) | "
                       f"{c} | {med(s['prefill_tps'])} | {med(s['decode_tps'])} | {med(s['ttft_s'])} | "
                       f"{med(s['peak_rss_mib'], digits=4)} | {'yes' if r['same_text_as_pipeline'][c] else 'no'} |")
    out.append("")
    for model, r in p["models"].items():
        out.append(f"- {model}: " + ratios(r["ratios"]))
    return out


def ratios(values: dict) -> str:
    """'a / b **1.52x**; ...', each ratio where a peer (mlx-lm, llama.cpp) is faster marked as such."""
    return "; ".join(f"{k} **{v:.2f}x**{peer_wins(k, v)}" for k, v in values.items())


def peer_wins(key: str, value: float) -> str:
    """' (mlx-lm wins)' for 'pipeline ... / mlx-lm ...' below 1 or 'mlx-lm ... / pipeline ...' above 1."""
    a, _, b = key.partition(" / ")
    peer = next((name for name in ("mlx-lm", "mlx_lm", "llama.cpp") if (name in a) != (name in b)), None)
    if peer is None:
        return ""
    return f" ({peer.replace('_', '-')} wins)" if (value < 1) == (peer in b) and value != 1 else ""


def contender_rows(p: dict, texts_equal: dict) -> list[str]:
    """Rows of a batch table (generated tok/s, seconds, texts equal out of the requests), then ratios."""
    rows = [f"| {c} | {med(s['tok_s'])} | {med(s['seconds'])} | {texts_equal[c]}/{p['requests']} |"
            for c, s in p["stats"].items()]
    return rows + ["", "- " + ratios(p["ratios"])]


def batch(p: dict) -> list[str]:
    out = [f"**2b. Batch jobs** (`benchmarks/bench_batch.py`; default model, {p['requests']} chat requests, "
           f"{p['prompt_tokens']} prompt tokens, up to {p['max_tokens']} new each, greedy, one BLAS thread per rank"
           + (f", mlx-lm one process with {p['mlx_lm_threads']} BLAS threads" if p.get("mlx_lm_threads") else "") + "; "
           f"{p['runs']} runs; {header(p)}). ![2b](results/batch.png)", "",
           "| contender | generated tok/s | seconds | texts equal to 1 rank |", "| --- | --- | --- | --- |"]
    return out + contender_rows(p, p["texts_equal_to_1_rank"])


def mlx_pipeline(p: dict) -> list[str]:
    out = [f"**2c. Two ranks, single stream, vs mlx-lm's pipeline mode** (`benchmarks/bench_mlx_pipeline.py`; "
           f"random Qwen2-0.5B 4-bit, prompt {p['prompt_tokens']}, {p['new_tokens']} new; {p['runs']} runs; "
           f"{header(p)}). ![2c](results/mlx_pipeline.png)", "",
           "| contender | prefill tok/s | decode tok/s | TTFT s | same text |", "| --- | --- | --- | --- | --- |"]
    for c, s in p["stats"].items():
        out.append(f"| {c} | {med(s['prefill_tps'])} | {med(s['decode_tps'])} | {med(s['ttft_s'])} | "
                   f"{'yes' if p['same_text_as_pipeline'][c] else 'no'} |")
    return out + ["", "- " + ratios(p["ratios"])]


def batch_throughput(p: dict) -> list[str]:
    out = [f"**Batch scaling** (`benchmarks/batch_throughput.py --save`; default model, {p['requests']} "
           f"requests of up to {p['max_tokens']} new tokens, greedy, OPENBLAS_NUM_THREADS=1, every run a fresh "
           f"`mpiexec` job; median ±half the spread of {p['runs']} interleaved rounds"
           + (f" ({p['note']})" if p.get("note") else "") + f"; {header(p)}).", "",
           "| ranks | layers per rank | micro-batches | generated tok/s | vs 1 rank | pipeline bubble | idle per rank |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in p["table"]:
        out.append(f"| {r['ranks']} | {r['split']} | {r['microbatches']} | {med(r['tok_s'])} | **{r['ratio']:.2f}x** | "
                   f"{r['bubble_percent']:.1f}% | " + ", ".join(f"r{k} {v:.1f}%" for k, v in sorted(r['idle_percent'].items()))
                   + " |")
    same = all(p["texts_identical_over_runs"].values())
    out += ["", f"- Texts {'identical' if same else 'NOT identical'} over every rank count and round."]
    out += [f"- {line}" for line in round_ratios(p.get("runs_detail", []))]
    return out


def round_ratios(runs: list[dict]) -> list[str]:
    """Each round's N-rank tok/s over the same round's 1-rank run (the machine's speed drifts
    between rounds, so the median ratio above is not the only view)."""
    base = {(r.get("mode"), r["round"]): r["tok_s"] for r in runs if r["ranks"] == 1}
    lines = []
    for ranks in sorted({r["ranks"] for r in runs} - {1}):
        ratios = [r["tok_s"] / base[r.get("mode"), r["round"]] for r in runs
                  if r["ranks"] == ranks and (r.get("mode"), r["round"]) in base]
        if ratios:
            lines.append(f"{ranks} ranks, round by round: {min(ratios):.2f}x-{max(ratios):.2f}x "
                         f"(mean {sum(ratios) / len(ratios):.2f}x over {len(ratios)} rounds)")
    return lines


def mlx_pipeline_batch(p: dict) -> list[str]:
    out = [f"**2c, batch: two ranks vs mlx-lm's pipeline mode with `batch_generate`** "
           f"(`benchmarks/bench_mlx_pipeline_batch.py`; random Qwen2-0.5B 4-bit, {p['requests']} requests, "
           f"{p['prompt_tokens']} prompt tokens, up to {p['max_tokens']} new each, 1 BLAS thread per rank; "
           f"{p['runs']} runs; {header(p)}). ![2c batch](results/mlx_pipeline_batch.png)", "",
           "| contender | generated tok/s | seconds | texts equal to pipeline's |", "| --- | --- | --- | --- |"]
    return out + contender_rows(p, p["same_text_as_pipeline"])


def hop(p: dict) -> list[str]:
    out = [f"**2d. Per-hop overhead** (`benchmarks/bench_hop.py`; 2 ranks, one host; {p['iters']} round trips "
           f"per run, {p['runs']} runs; {header(p)}). ![2d](results/hop.png)", "",
           "| hidden x tokens | bytes | raw mpi4py us/hop | pipeline transport us/hop | ratio |",
           "| --- | --- | --- | --- | --- |"]
    for label, r in p["micro"].items():
        out.append(f"| {label} | {r['bytes']} | {med(r['stats']['raw'])} | {med(r['stats']['transport'])} | "
                   f"**{r['ratio']:.2f}x** |")
    s = p["in_situ"]
    out += ["", f"- In situ (SmolLM2 decode, 1 BLAS thread per rank): {med(s['decode_ms_per_token']['1 rank'])} "
                f"ms/token on 1 rank, {med(s['decode_ms_per_token']['2 ranks'])} on 2: "
                f"{s['per_hop_us']:.0f} us per hop-equivalent: an upper bound, since one rank also overlaps graph "
                f"building with compute (about 5 ms/token here) and a ring cannot."]
    return out


def memory(p: dict) -> list[str]:
    out = [f"**2e. Peak RSS per rank vs owned weight bytes** (`benchmarks/bench_memory.py`; {p['runs']} runs; "
           f"a process with only the runtime imported: {p['baseline_rss']['median'] / 2**20:.0f} MiB; {header(p)}). "
           f"![2e](results/memory.png)", "",
           "| model | ranks, weights | rank | owned MiB | peak RSS MiB | RSS / owned | (RSS - runtime) / owned |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, r in p["models"].items():
        for label, c in r["configs"].items():
            for rank, q in enumerate(c["per_rank"]):
                out.append(f"| {model} | {label} | r{rank} | {q['owned_bytes'] / 2**20:.0f} | "
                           f"{q['peak_rss']['median'] / 2**20:.0f} | **{q['ratio']:.2f}x** | "
                           f"{q['ratio_above_baseline']:.2f}x |")
    return out


def roofline(p: dict) -> list[str]:
    bw = p["bandwidth_gbps"]
    out = [f"**2f. Roofline** (`benchmarks/bench_roofline.py`; {p['runs']} runs; {header(p)}). Read bandwidth: "
           + ", ".join(f"{k} {med(v)} GB/s" for k, v in bw.items())
           + ". ![2f](results/roofline.png)", "",
           "| model | weights | MiB read per token | decode tok/s | GB/s | of machine bandwidth | roofline tok/s |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, r in p["models"].items():
        for mode, m in r["modes"].items():
            out.append(f"| {model} | {mode} | {m['bytes_per_token']['total'] / 2**20:.0f} | {med(m['decode_tps'])} | "
                       f"{m['achieved_gbps']:.2f} | **{m['fraction_of_machine_bw']:.0%}** | {m['roofline_tps']:.1f} |")
    return out


def vs_llamacpp(p: dict) -> list[str]:
    st = p["settings"]
    out = [f"**pipeline vs llama.cpp** (`benchmarks/vs_llamacpp.py`; the same GGUF files, 2 threads; llama.cpp "
           f"{p['llama_cpp']['build']} from the llama-cpp-python {p['llama_cpp']['llama_cpp_python_sdist']} sdist, "
           f"GGML_NATIVE; median ±half the min-max spread of {p['runs']} interleaved rounds"
           + (" (**a quick smoke run, not the benchmark's figures**)" if p.get("quick") else "")
           + f"; {header(p)}). ![vs llama.cpp](results/vs_llamacpp.png)", "",
           f"Single stream, 1 rank, 2 threads: pp{st['prompt_tokens']} and tg{st['new_tokens']} (llama.cpp's decode "
           f"after a {st['prompt_tokens']}-token context, as `generate` decodes after its prompt; at depth 0 in brackets).", "",
           "| model | contender | prefill tok/s | decode tok/s | peak RSS MiB |", "| --- | --- | --- | --- | --- |"]
    for model, r in p["models"].items():
        for c, s in r["stats"].items():
            if "prefill_tps" in s and "load_over_read" not in s and "tok_s" not in s:
                d0 = f" ({med(s['decode_tps_d0'])})" if s.get("decode_tps_d0", {}).get("n") else ""
                out.append(f"| {model} | {c} | {med(s['prefill_tps'])} | {med(s['decode_tps'])}{d0} | "
                           f"{med(s['peak_rss_mib'], digits=4)} |")
    out += ["", f"Batch, {st['batch']} sequences x {st['batch_new']} new tokens ({st['batch_prompt']}-token prompts): "
                "generated tokens over the whole time, prompts included.", "",
            "| model | contender | generated tok/s | seconds | peak RSS MiB (largest rank) |", "| --- | --- | --- | --- | --- |"]
    for model, r in p["models"].items():
        for c, s in r["stats"].items():
            if "tok_s" in s:
                out.append(f"| {model} | {c} | {med(s['tok_s'])} | {med(s['seconds'])} | {med(s['peak_rss_mib'], digits=4)} |")
    out += ["", "Load, 1 rank: pipeline's plan + load (what `generate` does before its first token) vs reading the "
                "file's bytes; the whole process beside (llama.cpp: start, mmap load, a 1-token prompt and 1 new token):", "",
            "| model | file MiB | contender | load s | whole process s | read s | load / read | peak RSS MiB | weights MiB |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model, r in p["models"].items():
        for c, s in r["stats"].items():
            if "load_over_read" in s:
                out.append(f"| {model} | {r['file_bytes'] / 2**20:.0f} | {c} | {med(s['load_s'])} | {med(s['wall_s'])} | "
                           f"{med(s['read_s'])} | {med(s['load_over_read'])} | {med(s['peak_rss_mib'], digits=4)} | "
                           f"{med(s['weight_mib'], digits=4)} |")
    out += ["", "Goals, weights held quantized (ratios of medians to llama.cpp; batch: the better of 1 rank and 2 ranks):", "",
            "| model | decode >= 0.8x | prefill >= 1.0x | batch >= 1.0x |", "| --- | --- | --- | --- |"]
    verdict = lambda g: f"{g['ratio']:.2f}x, {'met' if g['met'] else 'not met'}" if g["ratio"] is not None else "not run"  # noqa: E731
    for model, r in p["models"].items():
        g = r["goals"]
        out.append(f"| {model} | {verdict(g['decode'])} | {verdict(g['prefill'])} | {verdict(g['batch'])} |")
        if "goals_int8" in r:
            g = r["goals_int8"]
            out.append(f"| {model}, --int8-activations | {verdict(g['decode'])} | {verdict(g['prefill'])} | "
                       f"{verdict(g['batch'])} |")
    out.append("")
    for model, r in p["models"].items():
        out.append(f"- {model}: " + ratios(r["ratios"]))
    return out


def speculative(p: dict) -> list[str]:
    """Decode tok/s per prompt and contender, acceptance beside, then the ngram / none ratios."""
    prompts = list(p["prompts"].values()) if isinstance(p["prompts"], dict) else p["prompts"]
    contenders = list(prompts[0]["stats"])
    llamacpp = p.get("llamacpp") or {}  # absent from runs before llama.cpp's contenders joined
    if "skipped" in llamacpp:
        beside = f"; llama.cpp skipped: {llamacpp['skipped']}"
    elif llamacpp:
        beside = (f"; llama.cpp {llamacpp['build']}: `llama-lookup -t {llamacpp['threads']} --temp 0` on the GGUF our "
                  f"model is converted from, fed the same {llamacpp['fed']}, up to {llamacpp['draft_max']} drafted "
                  f"tokens (none: 0)")
    else:
        beside = ""
    out = [f"**Speculative decoding** (`benchmarks/speculative.py`; default model, chat template, greedy, up to "
           f"{p['max_tokens']} new tokens; decode tok/s, median ±half the spread of {p['runs']} interleaved runs; "
           f"acceptance of the drafts (ngram, lookup) in brackets{beside}; {header(p)}). "
           "![speculative](results/speculative.png)", "",
           "| prompt | " + " | ".join(contenders) + " |", "| --- |" + " --- |" * len(contenders)]
    for item in prompts:
        cells = []
        for c in contenders:
            st = item["stats"][c]
            acc = st.get("acceptance") or {}
            cells.append(med(st["decode_tps"]) + (f" ({100 * acc['median']:.0f}%)" if acc.get("n") else ""))
        out.append(f"| {item['kind']}: {item['prompt'][:48]}... ({item['prompt_tokens']} tokens) | " + " | ".join(cells) + " |")
    out.append("")
    for key, r in p["summary"].items():
        out.append(f"- {key}: " + ", ".join(f"**{x:.2f}x**" for x in r["per_prompt"]) + f" (mean {r['mean']:.2f}x)")
    alike = [a for item in prompts for a in (item.get("llamacpp_text_starts_like_pipeline") or {}).values()]
    if alike:
        out.append(f"- llama.cpp's text starts like pipeline's (draft none) in {sum(a is True for a in alike)} of "
                   f"{len(alike)} prompt x contender pairs")
    return out


def serve_load(p: dict) -> list[str]:
    """Per contender and number of clients: generated tok/s and time to first token (p50/p99)."""
    levels = p["levels"]
    out = [f"**Serving** (`benchmarks/serve_load.py`; default model, {p['max_tokens']} new tokens per request, "
           f"clients streaming over the OpenAI API (http.client); median ±half the spread of {p['runs']} runs; {header(p)}). "
           f"![serve](results/serve_load.png)", "",
           "| contender | " + " | ".join(f"{n} client{'s' * (n > 1)}: tok/s, TTFT p50/p99 s" for n in levels) + " |",
           "| --- |" + " --- |" * len(levels)]
    for c, st in p["stats"].items():
        cells = []
        for n in levels:
            tps, p50 = st.get(f"tok_s_c{n}"), st.get(f"ttft_p50_c{n}")
            ttft = f", {med(p50)}/{med(st.get(f'ttft_p99_c{n}'))}" if p50 and p50.get("median") is not None else ""
            cells.append((med(tps) if tps else "-") + ttft)
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    serve, peer = next((c for c in p["stats"] if "serve" in c), None), next((c for c in p["stats"] if "mlx" in c), None)
    if serve and peer:
        def median(c: str, n: int):
            return (p["stats"][c].get(f"tok_s_c{n}") or {}).get("median")

        per_level = {f"{serve} / {peer}, {n} client{'s' * (n > 1)}, tok/s": median(serve, n) / median(peer, n)
                     for n in levels if median(serve, n) and median(peer, n)}
        out += ["", "- " + ratios(per_level)]
    same = p.get("same_text_serve_vs_batch") or {}
    out += ["- texts of serve equal to batch's: " + ", ".join(f"{k[1:]} clients {v}" for k, v in same.items())]
    same = p.get("same_text_mlx_lm_vs_batch") or {}
    if same:
        out += ["- texts of mlx_lm.server equal to batch's: " + ", ".join(f"{k[1:]} clients {v}" for k, v in same.items())]
    if p.get("failures"):
        out += [f"- failed requests (kept in the JSON with the server's log): {len(p['failures'])}"]
    out += ["- " + ratios(p["ratios"])]
    conversation = (p.get("conversation") or {}).get("stats") or {}
    if conversation:
        out.append("- a chat growing to ~" + str(p.get("history_tokens", 1000)) + " tokens, last turn's time to first "
                   "token: " + ", ".join(f"{c} {med(v['ttft_last'])} s" for c, v in conversation.items()))
    return out


def load_speed(p: dict) -> list[str]:
    out = [f"**Load speed** (`benchmarks/load_speed.py`; one rank's `plan_job` + `load_stage` vs reading the same "
           f"bytes, random Llama-1B-shaped model; cold: {p['cold_method']}; {p['runs']} interleaved runs; {header(p)}). "
           f"![load speed](results/load_speed.png)", "",
           "| stored as, held as | cache | GB read | read s | into new memory s | load s | load / read | GB/s | "
           "CPU s | peak RSS MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in p["table"]:
        out.append(f"| {r['stored']} | {r['cache']} | {r['span_bytes'] / 1e9:.2f} | {med(r['read_s'])} | "
                   f"{med(r['fresh_s'])} | {med(r['load_s'])} | **{r['ratio']:.2f}x** | {r['gb_per_s']:.2f} | "
                   f"{med(r['cpu_s'])} | {med(r['peak_rss'], 2**-20, 4)} |")
    met = [f"{r['form']} {r['cache']}" for r in p["table"] if r["ratio"] <= p["goal"]]
    return out + ["", f"- Goal load <= {p['goal']}x read: met in {len(met)} of {len(p['table'])} rows"
                  + (f" ({', '.join(met)})" if met else "") + "."]


def goals(results: dict) -> list[str]:
    out = ["**Goals**:", "", "| goal | measured | met |", "| --- | --- | --- |"]
    for model, (r, source) in latest_single().items():
        if True:
            same = r["ratios"]["decode pipeline / mlx-lm+OpenBLAS"]
            dense = r["ratios"]["decode pipeline / mlx-lm+OpenBLAS+fp32 weights"]
            kernels = r["ratios"].get("decode pipeline / mlx-lm+pipeline BLAS+fp32 weights")
            installed = r["ratios"]["decode pipeline / mlx-lm"]
            out.append(f"| single-rank decode >= 1.1x mlx-lm with the same BLAS ({model}; {source}) | {same:.2f}x (OpenBLAS, "
                       f"mlx-lm's weights as in the folder), {dense:.2f}x (OpenBLAS, mlx-lm's weights dequantized "
                       f"like ours)" + (f", {kernels:.2f}x (mlx-lm on our whole BLAS set-up incl. the BLAS shim, "
                                        f"fp32 weights: identical kernels)" if kernels else "")
                       + f" | {'yes' if min(same, dense) >= 1.1 else 'no'}"
                       + (f" (runtime alone: {'yes' if kernels >= 1.1 else 'no'})" if kernels else "") + " |")
            out.append(f"| far above mlx-lm as installed ({model}) | decode {installed:.2f}x, prefill "
                       f"{r['ratios']['prefill pipeline / mlx-lm']:.1f}x | {'yes' if installed >= 2 else 'no'} |")
    t, b, mp = results.get("batch_throughput"), results.get("batch"), results.get("mlx_pipeline_batch")
    measured = []
    if t:
        row = next(r for r in t["table"] if r["mode"] == "exact" and r["ranks"] == 2)
        measured.append(f"{row['ratio']:.2f}x ({t['requests']} requests x {t['max_tokens']} tokens, "
                        f"batch_throughput.py, split {row['split']}, bubble {row['bubble_percent']:.1f}%)")
    if b:
        measured.append(f"{b['ratios']['pipeline batch, 2 ranks / pipeline batch, 1 rank']:.2f}x "
                        f"({b['requests']} x {b['max_tokens']}, 2b)")
    if measured:
        verdicts = [f"{'yes' if float(m.split('x')[0]) >= 1.8 else 'no'} ({m.split('(')[1].split(',')[0]})"
                    for m in measured]
        out.append(f"| batch on 2 one-core ranks >= 1.8x one rank | {'; '.join(measured)} | {'; '.join(verdicts)} |")
    else:
        out.append("| batch on 2 one-core ranks >= 1.8x one rank | not run | - |")
    if mp:
        vs = {k.split(" / ")[1]: v for k, v in mp["ratios"].items()}
        out.append("| batch >= 2x mlx-lm's pipeline mode (2 ranks, batch_generate) | "
                   + "; ".join(f"{v:.2f}x {k}" for k, v in vs.items())
                   + f" | {'yes' if min(vs.values()) >= 2 else 'no'} |")
    else:
        out.append("| batch >= 2x mlx-lm's pipeline mode | not run (bench_mlx_pipeline_batch.py) | - |")
    h = results.get("hop")
    if h:
        worst = max(r["ratio"] for r in h["micro"].values())
        out.append(f"| per-hop overhead <= 2x raw ping-pong | {min(r['ratio'] for r in h['micro'].values()):.2f}x-"
                   f"{worst:.2f}x | {'yes' if worst <= 2 else 'no'} |")
    m = results.get("memory")
    if m:
        ratios = [(model, label, q["ratio"]) for model, r in m["models"].items() for label, c in r["configs"].items()
                  for q in c["per_rank"]]
        big = [x for x in ratios if x[0] != "smollm2"]
        worst = {}
        for model, label, ratio in big:
            worst[label] = max(worst.get(label, 0), ratio)
        out.append("| RSS <= 1.15x owned bytes | 1B model, worst rank: " + ", ".join(f"{k} {v:.2f}x" for k, v in worst.items())
                   + f"; SmolLM2 (55-515 MiB owned beside a {m['baseline_rss']['median'] / 2**20:.0f} MiB runtime): "
                   f"{min(x[2] for x in ratios if x[0] == 'smollm2'):.2f}-{max(x[2] for x in ratios if x[0] == 'smollm2'):.2f}x"
                   f" | fp32: {'yes' if all(v <= 1.15 for k, v in worst.items() if 'fp32' in k) else 'no'}; quantized: "
                   f"{'yes' if all(v <= 1.15 for k, v in worst.items() if 'quantized' in k) else 'no'} |")
    return out


def latest_single() -> dict:
    """Per model, its figures from the newest of single.json and the single_*.json reruns."""
    found = {}
    for path in sorted(common.RESULTS.glob("single*.json")):
        p = json.loads(path.read_text())
        for model, r in p["models"].items():
            if "decode pipeline / mlx-lm+OpenBLAS" in r["ratios"] and (model not in found or p["date"] > found[model][2]):
                found[model] = (r, path.name, p["date"])
    return {model: (r, name) for model, (r, name, _) in found.items()}


def reruns() -> list[str]:
    lines = []
    for extra in sorted(common.RESULTS.glob("single_*.json")):  # targeted reruns (bench_single.py --name ...)
        p = json.loads(extra.read_text())
        lines += [f"Rerun `{extra.name}` (`bench_single.py --models {','.join(p['models'])} --contenders ... "
                  f"--name {p['benchmark']}`; {p['runs']} runs; {header(p)}; load average before its runs: "
                  f"{min(r['load_before'] for rs in p['models'][next(iter(p['models']))]['runs'].values() for r in rs):.1f}-"
                  f"{max(r['load_before'] for rs in p['models'][next(iter(p['models']))]['runs'].values() for r in rs):.1f}):", ""] + single(p)[2:] + [""]
    return lines


def render() -> str:
    names = ("single", "batch_throughput", "batch", "mlx_pipeline", "mlx_pipeline_batch", "hop", "memory", "roofline",
             "vs_llamacpp", "load_speed", "speculative", "serve_load")
    results = {name: load(name) for name in names}
    lines = goals(results) + [""]
    for name, fn in (("single", single), ("batch_throughput", batch_throughput), ("batch", batch),
                     ("mlx_pipeline", mlx_pipeline), ("mlx_pipeline_batch", mlx_pipeline_batch), ("hop", hop),
                     ("memory", memory), ("roofline", roofline), ("vs_llamacpp", vs_llamacpp),
                     ("load_speed", load_speed), ("speculative", speculative), ("serve_load", serve_load)):
        if results[name]:
            lines += fn(results[name]) + [""]
        if name == "single":
            lines += reruns()
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--print", action="store_true")
    args = parser.parse_args()
    text = render()
    if args.print:
        print(text)
        return
    readme = common.REPO / "benchmarks" / "README.md"
    content = readme.read_text()
    if BEGIN not in content or END not in content:
        raise SystemExit(f"benchmarks/README.md has no {BEGIN} ... {END} section")
    before, rest = content.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    readme.write_text(before + BEGIN + "\n" + text + END + after)
    print("benchmarks/README.md updated")


if __name__ == "__main__":
    main()
