"""What every benchmark shares: the machine/versions/commit record, contenders interleaved run
by run (A B C A B C ...), median and spread, the model folders, JSON and PNG output.

Each contender run is a fresh process (the BLAS MLX uses is fixed per process when it first
imports mlx.core), so a run measures exactly what a user's command would.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"

PROSE = ("The history of the river valley begins with the first farmers who settled along its banks. "
         "They cleared the forests, planted barley and wheat, and built small villages of timber and clay. "
         "Over the centuries the villages grew into towns, the towns traded with one another, and roads "
         "followed the river down to the sea. ")


def env_with_repo(**extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


# ---- what was measured, where ----------------------------------------------------------------

def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"hostname": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
            "os": platform.platform(), "python": platform.python_version()}


def versions() -> dict:
    out = {}
    for dist in ("mlx", "mlx-cpu", "mlx-lm", "mpi4py", "mpich", "numpy", "pipeline"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        probe = subprocess.run([sys.executable, "-c", "import pipeline, mlx.core; from pipeline.kernels import blas; "
                                "print(blas.describe())"], capture_output=True, text=True, env=env_with_repo(),
                               timeout=60)
        out["blas"] = probe.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out["blas"] = None
    mpiexec = shutil.which("mpiexec")
    if mpiexec:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
        out["mpiexec"] = next((l.strip() for l in text.splitlines() if "Version" in l or "mpirun" in l), "")
    return out


def git_commit() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()

    # The results a benchmark run writes, and the tables report.py makes of them, are not code: a series
    # of runs at one commit stays clean.
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results",
                  ":(exclude)benchmarks/README.md")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changed)}


def load_average() -> list[float]:
    return list(os.getloadavg())


def record(name: str, description: str, **payload) -> dict:
    return {"benchmark": name, "description": description,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(), "versions": versions(),
            "git": git_commit(), **payload}


# ---- statistics and interleaving ---------------------------------------------------------------

def summary(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0}
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values), "n": len(values),
            "spread_pct": 100.0 * (max(values) - min(values)) / med if med else 0.0,
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "values": values}


def arguments(doc: str, warmup: bool = True) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring's first line, --runs (at least 5 for a median
    and spread by default) and, for interleaved contenders, --warmup rounds kept apart."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    if warmup:
        parser.add_argument("--warmup", type=int, default=1)
    return parser


def interleave(contenders: dict[str, Callable[[], dict]], runs: int, warmup: int = 1,
               log: Callable[[str], None] = print) -> dict[str, list[dict]]:
    """Run each contender once per round, rounds A B C A B C ...; the first `warmup` rounds
    (page cache, first-run compilation) are kept apart from the measured ones."""
    measured: dict[str, list[dict]] = {name: [] for name in contenders}
    for round_ in range(warmup + runs):
        for name, run in contenders.items():
            load = load_average()[0]
            result = run()
            result["load_before"] = load
            tag = "warmup" if round_ < warmup else f"run {round_ - warmup + 1}/{runs}"
            log(f"  {tag:>10} {name:<34} " + " ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in result.items() if k not in ("text", "tokens")))
            if round_ >= warmup:
                measured[name].append(result)
    return measured


def same_text(a: str, b: str) -> bool:
    """Equal up to surrounding space and newline style (our stdout passes through text-mode pipes,
    which turn \r\n and \r into \n)."""
    norm = lambda s: s.replace("\r\n", "\n").replace("\r", "\n").strip()  # noqa: E731
    return norm(a) == norm(b)


def summarize_runs(runs: list[dict], keys: list[str]) -> dict:
    return {key: summary([r.get(key) for r in runs]) for key in keys}


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


# ---- running our CLI and mlx-lm ------------------------------------------------------------------

STATS = re.compile(r"\[pipeline\] prompt (\d+) tokens, prefill ([\d.]+) tok/s, decode ([\d.]+) tok/s "
                   r"\((\d+) tokens, (\w+)\), TTFT ([\d.]+) s, peak RSS (.*?)(?:, weights (.*?), BLAS (.*))?$")


def parse_stats(stderr: str) -> dict:
    lines = [l for l in stderr.splitlines() if l.startswith("[pipeline]")]
    if not lines:
        raise RuntimeError(f"no stats line in:\n{stderr[-3000:]}")
    m = STATS.match(lines[-1])
    if not m:
        raise RuntimeError(f"unparsed stats line: {lines[-1]}")
    rss = [int(x) * 2**20 for x in re.findall(r"r\d+ (\d+) MiB", m.group(7))]
    return {"prompt_tokens": int(m.group(1)), "prefill_tps": float(m.group(2)), "decode_tps": float(m.group(3)),
            "generated": int(m.group(4)), "finish": m.group(5), "ttft_s": float(m.group(6)),
            "peak_rss": rss, "weights": m.group(8), "blas": m.group(9)}


def run_pipeline(ranks: int, model: Path, prompt: str, max_tokens: int, *extra: str, env: dict | None = None,
                 timeout: float = 1800) -> dict:
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "pipeline", "generate", "--model", str(model),
           "--prompt", prompt, "--no-chat-template", "--max-tokens", str(max_tokens), *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env_with_repo(**(env or {})),
                          timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    out = parse_stats(proc.stderr)
    out["wall_s"] = wall
    out["text"] = proc.stdout.rstrip("\n")
    return out


def run_mlx_lm(model: Path, prompt_ids: list[int], max_tokens: int, *, openblas: bool, dense: bool,
               cast_fp32: bool = True, pipeline_blas: bool = False, env: dict | None = None,
               timeout: float = 1800) -> dict:
    cmd = [sys.executable, str(REPO / "benchmarks" / "_mlx_lm_run.py"), "--model", str(model),
           "--prompt-ids", ",".join(map(str, prompt_ids)), "--max-tokens", str(max_tokens)]
    if openblas:
        cmd += ["--blas", OPENBLAS]
    if dense:
        cmd.append("--dense")
    if not cast_fp32:
        cmd.append("--as-published")
    if pipeline_blas:
        cmd.append("--pipeline-blas")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env_with_repo(**(env or {})),
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - start
    return out


def prompt_ids(model: Path, text: str) -> list[int]:
    sys.path.insert(0, str(REPO))
    from pipeline.checkpoints.tokenizer import Tokenizer

    return Tokenizer.from_folder(model).prompt_ids(text, use_chat_template=False)


def prompt_of(model: Path, tokens: int) -> tuple[str, list[int]]:
    """A raw-text prompt of about `tokens` tokens (whole sentences of PROSE) and its ids."""
    text = PROSE
    while len(prompt_ids(model, text)) < tokens:
        text += PROSE
    words = text.split(" ")
    while len(prompt_ids(model, " ".join(words))) > tokens:
        words.pop()
    text = " ".join(words)
    return text, prompt_ids(model, text)


# ---- model folders -------------------------------------------------------------------------------

def cache_dir() -> Path:
    env = os.environ.get("PIPELINE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pipeline"


def default_model() -> Path:
    """The default SmolLM2-135M-Instruct (Q4_1 GGUF -> MLX 4-bit, group 32), converted once."""
    sys.path.insert(0, str(REPO))
    from pipeline.checkpoints.default_model import default_model_dir

    return default_model_dir(progress=False)


LLAMA_1B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                tie_word_embeddings=True, attention_bias=False, mlp_bias=False, torch_dtype="bfloat16")


def random_model(name: str, shape: dict, bits: int | None = 4, group_size: int = 64, seed: int = 0,
                 scales_dtype: str = "bfloat16", shards: int = 1) -> Path:
    """A random model of the given config shape, MLX-quantized like mlx-community publishes
    (bits=None: bf16 weights), with the default model's tokenizer. Made once, in the cache
    (never in the repository). Weights are N(0, 0.02) like a fresh init; norms 1."""
    import mlx.core as mx

    sys.path.insert(0, str(REPO))
    from pipeline.checkpoints import safetensors_file

    folder = cache_dir() / "bench-models" / name
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    source = default_model()
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = {**shape, "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2}
    if bits:
        config["quantization"] = config["quantization_config"] = {"group_size": group_size, "bits": bits}
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    mx.random.seed(seed)
    dtype = getattr(mx, scales_dtype)
    tensors: dict[str, mx.array] = {}
    index: dict[str, str] = {}
    shard_of_layer = lambda i: min(shards - 1, i * shards // layers)  # noqa: E731

    def add(name: str, shape_: tuple[int, ...], shard: int, norm: bool = False, quantize: bool = True):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        if norm:
            arrays = {name: mx.ones(shape_, dtype=dtype)}
        else:
            w = (mx.random.normal(shape_) * 0.02).astype(dtype)
            if bits and quantize:
                q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
                base = name.removesuffix(".weight")
                arrays = {name: q, base + ".scales": s, base + ".biases": b}
            else:
                arrays = {name: w}
        for key, value in arrays.items():
            mx.eval(value)
            tensors.setdefault(file, {})[key] = value
            index[key] = file

    add("model.embed_tokens.weight", (vocab, h), 0)
    if not shape.get("tie_word_embeddings"):
        add("lm_head.weight", (vocab, h), shards - 1)
    add("model.norm.weight", (h,), shards - 1, norm=True)
    for i in range(layers):
        p, s = f"model.layers.{i}.", shard_of_layer(i)
        for proj, dims in (("self_attn.q_proj", (heads * hd, h)), ("self_attn.k_proj", (kv * hd, h)),
                           ("self_attn.v_proj", (kv * hd, h)), ("self_attn.o_proj", (h, heads * hd)),
                           ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)), ("mlp.down_proj", (h, inter))):
            add(p + proj + ".weight", dims, s)
        if shape.get("model_type") in ("qwen2",):
            for proj, n in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
                add(p + f"self_attn.{proj}.bias", (n,), s, quantize=False)
        add(p + "input_layernorm.weight", (h,), s, norm=True)
        add(p + "post_attention_layernorm.weight", (h,), s, norm=True)
    for file, arrays in tensors.items():
        if bits:  # as mlx-lm writes them: tensors at any offset
            mx.save_safetensors(str(tmp / file), arrays, metadata={"format": "mlx"})
        else:  # as the `safetensors` library writes Hugging Face's: each aligned to its element size
            safetensors_file.save(tmp / file, arrays, metadata={"format": "pt"})
    if shards > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name_ in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name_, tmp / name_)
    try:
        tmp.rename(folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def llama_1b() -> Path:
    """A random Llama-3.2-1B-shaped model (16 layers, hidden 2048, GQA 32/8, tied embeddings,
    SmolLM2's 49152-token vocabulary: 1.07 B parameters), 4-bit group 64, bf16 scales."""
    return random_model("llama-1b-4bit", LLAMA_1B)


def param_count(folder: Path) -> int:
    sys.path.insert(0, str(REPO))
    from pipeline.models.config import ModelConfig
    from pipeline.planner.shapes import architecture, count_params

    return count_params(architecture(ModelConfig.from_folder(folder))).total


# ---- plots -----------------------------------------------------------------------------------------

def bars(ax, title: str, groups: list[str], series: dict[str, list[dict | None]], ylabel: str,
         log: bool = False) -> None:
    """Grouped bars of medians with min-max whiskers: one group per x label, one bar per series."""
    width = 0.8 / max(1, len(series))
    for i, (name, stats) in enumerate(series.items()):
        xs, meds, lo, hi = [], [], [], []
        for j, s in enumerate(stats):
            if not s or not s.get("n"):
                continue
            xs.append(j + (i - (len(series) - 1) / 2) * width)
            meds.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
        ax.bar(xs, meds, width, label=name, yerr=[lo, hi], capsize=3)
        for x, m in zip(xs, meds):
            ax.annotate(f"{m:.3g}", (x, m), ha="center", va="bottom", fontsize=6, xytext=(0, 2),
                        textcoords="offset points")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if log:
        ax.set_yscale("log")


def figure(panels: int, width: float = 6.0, height: float = 4.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(width * panels, height), squeeze=False)
    return fig, list(axes[0])


def save(fig, path: Path, legend_ax=None) -> Path:
    import matplotlib.pyplot as plt

    if legend_ax is not None:
        legend_ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bar_chart(path: Path, title: str, groups: list[str], series: dict[str, list[dict | None]], ylabel: str,
              log: bool = False) -> Path:
    fig, (ax,) = figure(1, width=max(6, 1.6 * len(groups) * max(1, len(series)) / 2.5))
    bars(ax, title, groups, series, ylabel, log)
    return save(fig, path, ax)
