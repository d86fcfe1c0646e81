"""Load speed: one rank's load time against the time to read the same bytes, warm and cold cache.

A random Llama-3.2-1B-shaped model (16 layers, hidden 2048, SmolLM2's 49152-token vocabulary,
tied embeddings: 1.07 B parameters) in five forms, each made once under
$PIPELINE_CACHE/bench-models/: bf16 in 3 shards (loaded as fp32, the default --dtype, and kept
bf16 with --dtype bfloat16), FP8 e4m3 with 128x128 block scales re-quantized at load
(--quantize 4), MLX 4-bit group 64 (held quantized), and a GGUF Q4_0 file read in place (held
quantized, exactly). Per form and cache state, interleaved, every run a fresh process:

- load: `mpiexec -n 1` of this file with --worker, timing `plan_job` + `load_stage` (what
  `generate` does before its first token), with its bytes read (/proc/self/io rchar), CPU
  seconds (all threads) and peak RSS;
- read: the same byte ranges (the tensors the rank loads) read into one 8 MB buffer, as `cat`
  would: the time its disk needs;
- into new memory: the same ranges read into newly allocated buffers, one per tensor: what any
  loader that keeps the bytes pays at least (page faults on new memory cost about as much as the
  copy from the page cache here).

Cold: each run starts after `posix_fadvise(POSIX_FADV_DONTNEED)` on the model's files (their pages
leave the page cache; checked with `fincore` when present). Warm: after the files were read.

    python benchmarks/load_speed.py [--runs 3] [--formats bf16,bf16-as-bf16,fp8,mlx4,gguf-q4_0]
    python benchmarks/load_speed.py --plot     (redraw from the JSON)
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

GOAL = 1.5  # load seconds / read seconds
# form -> (how it is stored, the flags it loads with)
FORMATS = {
    "bf16": ("bf16, 3 shards -> fp32", {"dtype": "float32"}),
    "bf16-as-bf16": ("bf16, 3 shards -> bf16 (--dtype bfloat16)", {"dtype": "bfloat16"}),
    "fp8": ("FP8 blocks -> 4-bit (--quantize 4)", {"dtype": "float32", "quantize": 4}),
    "mlx4": ("MLX 4-bit, held quantized", {"dtype": "float32"}),
    "gguf-q4_0": ("GGUF Q4_0 in place, held quantized", {"dtype": "float32"}),
}


# ---- the models ---------------------------------------------------------------------------------------------

def model_path(form: str) -> Path:
    shape = common.LLAMA_1B
    if form in ("bf16", "bf16-as-bf16"):
        return common.random_model("llama-1b-bf16-aligned", shape, bits=None, shards=3)  # as safetensors writes
    if form == "mlx4":
        return common.llama_1b()
    if form == "fp8":
        return fp8_model()
    return gguf_q4_0()


def _layer_shapes() -> dict[str, tuple[int, int]]:
    s = common.LLAMA_1B
    h, inter, heads, kv, hd = (s[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                              "num_key_value_heads", "head_dim"))
    return {"self_attn.q_proj": (heads * hd, h), "self_attn.k_proj": (kv * hd, h), "self_attn.v_proj": (kv * hd, h),
            "self_attn.o_proj": (h, heads * hd), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter)}


def _vocab() -> int:
    return json.loads((common.default_model() / "config.json").read_text())["vocab_size"]


def fp8_model() -> Path:
    """The Llama-1B shape as DeepSeek publishes FP8: projections e4m3 with one float32 scale per
    128x128 block (`weight_scale_inv`), embedding and norms bf16; 3 shards, written shard by shard."""
    import torch
    from safetensors.torch import save_file

    folder = common.cache_dir() / "bench-models" / "llama-1b-fp8"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(0)
    shape, layers, shards = common.LLAMA_1B, common.LLAMA_1B["num_hidden_layers"], 3
    h, vocab = shape["hidden_size"], _vocab()
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for shard, file in enumerate(files):
        tensors = {}
        if shard == 0:
            tensors["model.embed_tokens.weight"] = (torch.randn(vocab, h) * 0.02).to(torch.bfloat16)
        if shard == shards - 1:
            tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        for i in range(layers):
            if min(shards - 1, i * shards // layers) != shard:
                continue
            p = f"model.layers.{i}."
            for proj, (rows, cols) in _layer_shapes().items():
                w = torch.randn(rows, cols) * 0.02
                blocks = w.reshape(rows // 128, 128, cols // 128, 128)
                scale = blocks.abs().amax(dim=(1, 3)) / 448.0
                tensors[p + proj + ".weight"] = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
                tensors[p + proj + ".weight_scale_inv"] = scale
            for norm in ("input_layernorm", "post_attention_layernorm"):
                tensors[p + norm + ".weight"] = torch.ones(h, dtype=torch.bfloat16)
        save_file(tensors, str(tmp / file))
        weight_map.update({name: file for name in tensors})
        del tensors
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {**shape, "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic"}}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(common.default_model() / name, tmp / name)
    tmp.rename(folder)
    return folder


def gguf_q4_0() -> Path:
    """The Llama-1B shape as a pure Q4_0 GGUF: the very file vs_llamacpp.py gives llama.cpp."""
    from vs_llamacpp import random_llama_gguf

    return random_llama_gguf("Q4_0")


# ---- one load, one read ---------------------------------------------------------------------------------------

def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _settings(model: Path, flags: dict):
    from pipeline.runtime.settings import WeightSettings

    return WeightSettings(model=model, dtype=flags["dtype"], weights_in_memory="quantized",
                          int8_activations=None,  # as generate decides it (int8 products by default on x86)
                          quantize=flags.get("quantize"), group_size=64)


def worker(form: str, model: str) -> None:
    """One rank's load (as generate's), reported as one JSON line."""
    from mpi4py import MPI

    from pipeline.runtime.job import load_stage, plan_job
    from pipeline.runtime.rank_figures import peak_rss_bytes

    comm = MPI.COMM_WORLD
    settings = _settings(Path(model), FORMATS[form][1])
    read_before, cpu_before, start = _rchar(), _cpu_seconds(), time.perf_counter()
    plan = plan_job(settings, comm)
    stage = load_stage(settings, plan, comm.Get_rank(), progress=False)
    seconds = time.perf_counter() - start
    print("RESULT " + json.dumps({"load_s": seconds, "read_bytes": _rchar() - read_before,
                                  "cpu_s": _cpu_seconds() - cpu_before, "peak_rss": peak_rss_bytes(),
                                  "weight_bytes": stage.weight_nbytes, "tensors": len(stage.loaded_tensors)}),
          flush=True)


def spans_of(form: str, model: Path) -> list[tuple[str, int, int]]:
    """The byte ranges one rank (of one) reads: its tensors', in file order."""
    sys.path.insert(0, str(common.REPO))
    from pipeline.checkpoints.model_files import locate
    from pipeline.checkpoints.tensor_names import owned_tensor_names

    checkpoint = locate(model).open()
    config = checkpoint.model_config()
    names = owned_tensor_names(checkpoint, 0, config.num_hidden_layers, True)
    spans = sorted({span for name in names for span in checkpoint.spans(name)})
    return [(str(path), begin, end) for path, begin, end in spans]


READER = r"""
import json, sys, time
import numpy as np
spans, fresh = json.loads(sys.argv[1]), sys.argv[2] == "fresh"
buffer = bytearray(8 << 20)
start = time.perf_counter()
total, kept, files = 0, [], {}
for path, begin, end in spans:
    f = files.get(path) or files.setdefault(path, open(path, "rb", buffering=0))
    f.seek(begin)
    if fresh:  # each tensor into new memory, as a loader must
        out = np.empty(end - begin, np.uint8)
        total += f.readinto(out)
        kept.append(out)
    else:
        left = end - begin
        while left:
            got = f.readinto(memoryview(buffer)[:min(left, len(buffer))])
            left -= got
            total += got
print(json.dumps({"seconds": time.perf_counter() - start, "bytes": total}))
"""


def run_read(spans: list, fresh: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", READER, json.dumps(spans), "fresh" if fresh else "buffer"],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    out = json.loads(proc.stdout)
    return {"read_s": out["seconds"], "read_bytes": out["bytes"]}


def run_load(form: str, model: Path) -> dict:
    sys.path.insert(0, str(common.REPO))
    from pipeline.util import huge_pages

    cmd = ["mpiexec", "-n", "1", sys.executable, __file__, "--worker", form, str(model)]
    # the environment a `python -m pipeline` rank gets from its supervisor (huge_pages.py)
    env = huge_pages.environment(common.env_with_repo())
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


# ---- the page cache -------------------------------------------------------------------------------------------

def model_files(model: Path) -> list[Path]:
    return [model] if model.is_file() else sorted(model.glob("*.safetensors"))


def drop_from_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fill_cache(files: list[Path]) -> None:
    buffer = bytearray(8 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def resident_bytes(files: list[Path]) -> int | None:
    """Bytes of the files in the page cache (util-linux `fincore`), None without it."""
    if not shutil.which("fincore"):
        return None
    proc = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                          capture_output=True, text=True)
    return sum(int(x) for x in proc.stdout.split()) if proc.returncode == 0 else None


def with_cache(files: list[Path], cold: bool, run) -> dict:
    (drop_from_cache if cold else fill_cache)(files)
    resident = resident_bytes(files)
    out = run()
    out["resident_before"] = resident
    return out


# ---- main -----------------------------------------------------------------------------------------------------

def main() -> None:
    parser = common.arguments(__doc__)
    parser.set_defaults(runs=3)
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    forms = args.formats.split(",")
    models = {form: model_path(form) for form in forms}
    spans = {form: spans_of(form, models[form]) for form in forms}
    contenders = {}
    for form in forms:
        files = model_files(models[form])
        for cache in ("warm", "cold"):
            cold = cache == "cold"
            contenders[f"{form} {cache} load"] = lambda f=form, fs=files, c=cold: with_cache(fs, c, lambda: run_load(f, models[f]))
            contenders[f"{form} {cache} read"] = lambda f=form, fs=files, c=cold: with_cache(fs, c, lambda: run_read(spans[f], False))
            contenders[f"{form} {cache} into new memory"] = \
                lambda f=form, fs=files, c=cold: with_cache(fs, c, lambda: run_read(spans[f], True))
    runs = common.interleave(contenders, args.runs, args.warmup)
    table = []
    for form in forms:
        for cache in ("warm", "cold"):
            load, read, fresh = (runs[f"{form} {cache} {kind}"] for kind in ("load", "read", "into new memory"))
            row = {"form": form, "stored": FORMATS[form][0], "cache": cache,
                   "bytes": load[0]["read_bytes"], "span_bytes": sum(e - b for _, b, e in spans[form]),
                   "load_s": common.summary([r["load_s"] for r in load]),
                   "cpu_s": common.summary([r["cpu_s"] for r in load]),
                   "peak_rss": common.summary([r["peak_rss"] for r in load]),
                   "weight_bytes": load[0]["weight_bytes"],
                   "read_s": common.summary([r["read_s"] for r in read]),
                   "fresh_s": common.summary([r["read_s"] for r in fresh]),
                   "resident_before": [r["resident_before"] for r in load]}
            row["ratio"] = row["load_s"]["median"] / row["read_s"]["median"]
            row["ratio_fresh"] = row["load_s"]["median"] / row["fresh_s"]["median"]
            row["gb_per_s"] = row["span_bytes"] / row["load_s"]["median"] / 1e9
            table.append(row)
            print(f"{form:>13} {cache}: load {row['load_s']['median']:.2f} s ({row['gb_per_s']:.2f} GB/s, "
                  f"{row['cpu_s']['median']:.2f} CPU-s), read {row['read_s']['median']:.2f} s, into new memory "
                  f"{row['fresh_s']['median']:.2f} s: {row['ratio']:.2f}x read, {row['ratio_fresh']:.2f}x new memory",
                  flush=True)
    payload = common.record("load_speed", "one rank's load time vs reading its bytes, warm and cold page cache",
                            runs=args.runs, goal=GOAL, cold_method="posix_fadvise(POSIX_FADV_DONTNEED) on the model's files",
                            models={form: str(models[form]) for form in forms}, table=table, raw=runs,
                            load_after=common.load_average())
    out = common.write_json("load_speed", payload)
    plot(payload)
    print(f"wrote {out}")


def plot(payload: dict) -> None:
    fig, (left, right) = common.figure(2, width=7.5)
    groups = [f"{r['form'].replace('-as-', ' as ')}\n{r['cache']}" for r in payload["table"]]
    common.bars(left, "one rank's load vs reading its bytes", groups,
                {"load": [r["load_s"] for r in payload["table"]], "read (cat)": [r["read_s"] for r in payload["table"]],
                 "read into new memory": [r["fresh_s"] for r in payload["table"]]}, "seconds")
    ratios = [r["ratio"] for r in payload["table"]]
    right.bar(range(len(groups)), ratios, color=["C0" if r["cache"] == "warm" else "C1" for r in payload["table"]])
    for x, v in enumerate(ratios):
        right.annotate(f"{v:.2f}x", (x, v), ha="center", va="bottom", fontsize=7)
    right.axhline(payload["goal"], color="gray", ls=":", lw=1, label=f"goal {payload['goal']}x")
    right.set_xticks(range(len(groups)))
    right.set_xticklabels(groups, fontsize=6)
    right.set_ylabel("load s / read s")
    right.set_title("ratio (blue warm, orange cold)", fontsize=9)
    left.legend(fontsize=7)
    common.save(fig, common.RESULTS / "load_speed.png", right)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--plot":
        plot(json.loads((common.RESULTS / "load_speed.json").read_text()))
    elif len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(common.REPO))
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
