"""Tensor parallelism (issue 34): one stream on 2 one-core ranks as one tensor-parallel group
(`--tensor-parallel 2`) vs 1 rank vs a 2-stage pipeline, and the same over a real TCP stack.

Models (random weights, made once under $PIPELINE_CACHE/bench-models, never in the repository):
- llama-1b: a Llama-3.2-1B-shaped model (16 layers, hidden 2048, GQA 32/8, tied embeddings, SmolLM2's
  49152-token vocabulary; 1.07 B parameters), MLX 4-bit group 64, bf16 scales (common.llama_1b);
- qwen3-moe-2b: a Qwen3-MoE-shaped model (16 layers, hidden 2048, 32 query / 4 KV heads of 128, 64
  experts of 256 intermediate features, top 8, norm_topk_prob; untied head; 2.1 B parameters, 0.5 B
  active per token), MLX 4-bit group 64, bf16 scales, experts stored stacked as mlx-community does.
Both held quantized (`--weights-in-memory quantized`), greedy, raw prompts (no chat template).

Contenders, interleaved run by run (A B C A B C ...; a warm-up round kept apart), each run a fresh
`mpiexec` job, one core per rank (OPENBLAS_NUM_THREADS=1; 1 rank runs under `taskset -c 0`, 2 ranks
bind themselves one core each as generate does):
  1 rank           `mpiexec -n 1 ... generate`
  pipeline 2 x 1   `mpiexec -n 2 ... generate --tensor-parallel 1` (2 stages of 1 rank)
  tensor 1 x 2     `mpiexec -n 2 ... generate --tensor-parallel 2` (1 stage of 2 ranks)
single stream: prefill tok/s (a ~128-token prompt) and decode tok/s (32 new tokens) from the stats
line; batch: `pipeline batch` of 16 prompts x 64 new tokens, tensor 1 x 2 vs pipeline 2 x 1.
A contender the runtime refuses (e.g. a family without tensor parallelism) is recorded with its
error line and the rest go on.

Two hosts (part `hosts`, on where we are root): the two ranks in two network namespaces joined by a
veth pair (netns_hosts.py, names unique to the run, removed at the end also on failure), MPI over TCP
across it, so that every group sum and every hop crosses a real TCP stack: single-stream decode of
tensor 1 x 2 and pipeline 2 x 1 (llama-1b), interleaved with 1 rank on this machine; the link measured
before and after the runs (ping's round trip, an MPI ping-pong's one-way median of 8 B, one sum's
8 KB and 1 MiB, the bandwidth from those), the veth's byte counters per run; and one line per layout
("TWO HOSTS ..."): the measured decode tok/s, the planner's prediction of that run (layouts.plan_layout:
the model, its split, the measured link's latency and bandwidth, cluster_costs.LINUX_CPU's host terms,
the host's bandwidth fitted so that its 1-rank figure is the 1 rank measured in the same rounds), and
predicted / measured; the same with the linux-tcp link terms and other host bandwidths below it.

Goals (issue 34): single-stream decode with T = 2 >= 1.6x one rank (dense), >= 1.5x (MoE); the
planner's TCP terms within 25% of the two-host single-stream figure.

    python benchmarks/tensor_parallel.py [--runs 2] [--warmup 1] [--models llama-1b,qwen3-moe-2b]
        [--no-batch] [--no-hosts] [--batch-runs 1] [--parts single,batch,hosts] [--name NAME]
    python benchmarks/tensor_parallel.py --models llama-1b --parts hosts --runs 3 --name tensor_parallel_hosts
        # the planner's TCP check alone (as root; a few minutes)
    python benchmarks/tensor_parallel.py --plot     # redraw the PNG from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import netns_hosts  # noqa: E402

NAME = "tensor_parallel"
GOALS = {"llama-1b": 1.6, "qwen3-moe-2b": 1.5}
PLANNER_GOAL = 0.25  # |predicted / measured - 1| on the two-host run
PROMPT_TOKENS, NEW_TOKENS = 128, 32
LINK_SIZES = [8, 2048 * 4, 1 << 20]  # ping-pong: latency, llama-1b's group sum (hidden 2048 x 4 B), bandwidth
BATCH_REQUESTS, BATCH_TOKENS = 16, 64
KEYS = ["prefill_tps", "decode_tps", "ttft_s", "sum_ms_per_token", "peak_rss_mib"]

QWEN3_MOE_2B = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                    intermediate_size=6144, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, hidden_act="silu",
                    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=8192,
                    tie_word_embeddings=False, attention_bias=False, torch_dtype="bfloat16")


# ---- the MoE model ------------------------------------------------------------------------------------

def qwen3_moe_2b(bits: int = 4, group_size: int = 64, seed: int = 0) -> Path:
    """The random Qwen3-MoE-shaped model of the module docstring, written once into the cache as
    mlx-community writes MoE checkpoints (stacked `mlp.switch_mlp.*` experts, every matrix quantized,
    the router too), with the default model's tokenizer. Weights N(0, 0.02), norms 1."""
    import mlx.core as mx

    folder = common.cache_dir() / "bench-models" / "qwen3-moe-2b-4bit"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    source = common.default_model()
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    shape = QWEN3_MOE_2B
    config = {**shape, "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2,
              "quantization": {"group_size": group_size, "bits": bits},
              "quantization_config": {"group_size": group_size, "bits": bits}}
    h, layers, e, inter = shape["hidden_size"], shape["num_hidden_layers"], shape["num_experts"], \
        shape["moe_intermediate_size"]
    heads, kv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    mx.random.seed(seed)
    files: dict[str, dict[str, mx.array]] = {}
    index: dict[str, str] = {}

    def add(name: str, dims: tuple[int, ...], file: str, norm: bool = False) -> None:
        if norm:
            arrays = {name: mx.ones(dims, dtype=mx.bfloat16)}
        else:
            w = (mx.random.normal(dims) * 0.02).astype(mx.bfloat16)
            q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
            base = name.removesuffix(".weight")
            arrays = {name: q, base + ".scales": s, base + ".biases": b}
        for key, value in arrays.items():
            mx.eval(value)
            files.setdefault(file, {})[key] = value
            index[key] = file

    shards = 4
    name_of = lambda s: f"model-{s + 1:05d}-of-{shards:05d}.safetensors"  # noqa: E731
    add("model.embed_tokens.weight", (vocab, h), name_of(0))
    add("lm_head.weight", (vocab, h), name_of(shards - 1))
    add("model.norm.weight", (h,), name_of(shards - 1), norm=True)
    for i in range(layers):
        p, f = f"model.layers.{i}.", name_of(min(shards - 1, i * shards // layers))
        for proj, dims in (("self_attn.q_proj", (heads * hd, h)), ("self_attn.k_proj", (kv * hd, h)),
                           ("self_attn.v_proj", (kv * hd, h)), ("self_attn.o_proj", (h, heads * hd)),
                           ("mlp.gate", (e, h)), ("mlp.switch_mlp.gate_proj", (e, inter, h)),
                           ("mlp.switch_mlp.up_proj", (e, inter, h)), ("mlp.switch_mlp.down_proj", (e, h, inter))):
            add(p + proj + ".weight", dims, f)
        for norm, dims in (("input_layernorm", (h,)), ("post_attention_layernorm", (h,)),
                           ("self_attn.q_norm", (hd,)), ("self_attn.k_norm", (hd,))):
            add(p + norm + ".weight", dims, f, norm=True)
        if f != name_of(min(shards - 1, (i + 1) * shards // layers)) or i == layers - 1:
            mx.save_safetensors(str(tmp / f), files.pop(f), metadata={"format": "mlx"})  # one shard at a time
    for f, arrays in files.items():
        mx.save_safetensors(str(tmp / f), arrays, metadata={"format": "mlx"})
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name_ in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name_, tmp / name_)
    try:
        tmp.rename(folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


MODELS = {"llama-1b": common.llama_1b, "qwen3-moe-2b": qwen3_moe_2b}


# ---- one run --------------------------------------------------------------------------------------------

SUMS = re.compile(r"group sums? ([\d.]+) ms(?:/| per )token")
ERROR = re.compile(r"^error: .*$", re.M)
ANY_ERROR = re.compile(r"^.*\berror: .*$", re.M)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def code_state() -> str:
    """HEAD and a hash of the uncommitted changes under pipeline/ (others edit the shared tree while
    this runs: a run's text that differs from its neighbours' can then be told apart from a code change)."""
    import hashlib

    git = lambda *a: subprocess.run(["git", *a], capture_output=True, cwd=common.REPO).stdout  # noqa: E731
    diff = git("diff", "HEAD", "--", "pipeline")
    return git("rev-parse", "--short", "HEAD").decode().strip() + ("+" + hashlib.sha1(diff).hexdigest()[:10] if diff else "")


def refusal(stderr: str) -> str | None:
    """The runtime's one-line refusal (`error: ...`), if that is how the job ended."""
    m = ERROR.search(stderr) or ANY_ERROR.search(stderr)  # ours, else argparse's ("generate: error: ...")
    return m.group(0).strip() if m else None


_HAS_FLAG: dict[str, bool] = {}


def has_tensor_parallel(command: str) -> bool:
    """Whether `pipeline COMMAND` takes --tensor-parallel at this commit (before the runtime has it, the
    2-stage pipeline runs without the flag, and tensor 1 x 2 is recorded as refused)."""
    if command not in _HAS_FLAG:
        out = subprocess.run([sys.executable, "-m", "pipeline", command, "--help"], capture_output=True, text=True,
                             cwd=common.REPO, env=common.env_with_repo())
        _HAS_FLAG[command] = "--tensor-parallel" in out.stdout
    return _HAS_FLAG[command]


def layout_flags(layout: str, command: str = "generate") -> tuple[int, list[str]]:
    """(ranks, flags) of a contender: '1 rank', 'pipeline 2 x 1', 'tensor 1 x 2'."""
    if layout == "1 rank":
        return 1, []
    if layout == "pipeline 2 x 1":
        return 2, ["--tensor-parallel", "1"] if has_tensor_parallel(command) else []
    if layout == "tensor 1 x 2":
        return 2, ["--tensor-parallel", "2"]
    raise ValueError(layout)


def launcher(ranks: int, hosts: netns_hosts.TwoHosts | None) -> tuple[list[str], dict]:
    env = common.env_with_repo(OPENBLAS_NUM_THREADS="1")
    if hosts is not None:
        return hosts.mpiexec([sys.executable, "-m", "pipeline"]), hosts.environment(env)
    if ranks == 1:  # one core for one rank, as each of two ranks gets one
        return ["taskset", "-c", "0", "mpiexec", "-n", "1", sys.executable, "-m", "pipeline"], env
    return ["mpiexec", "-n", str(ranks), sys.executable, "-m", "pipeline"], env


def run_generate(model: Path, layout: str, prompt: str, hosts: netns_hosts.TwoHosts | None = None,
                 timeout: float = 900) -> dict:
    ranks, flags = layout_flags(layout)
    prefix, env = launcher(ranks, hosts)
    cmd = [*prefix, "generate", "--model", str(model), "--prompt", prompt, "--no-chat-template",
           "--max-tokens", str(NEW_TOKENS), "--weights-in-memory", "quantized", *flags]
    before = hosts.traffic() if hosts else None
    load, code = common.load_average(), code_state()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=common.REPO, env=env)
    connections = None
    if hosts is not None:  # what TCP connections the job holds while it runs (MPI's, across the veth)
        deadline = time.perf_counter() + 8
        while proc.poll() is None and time.perf_counter() < deadline:
            time.sleep(0.5)
            found = [c for c in hosts.connections() if netns_hosts.ADDRESSES[1] in c]
            if len(found) > len(connections or []):
                connections = found
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    out = {"layout": layout, "load_before": load[0], "uptime": uptime(), "wall_s": wall, "code": code}
    if hosts is not None:
        after = hosts.traffic()
        out["veth_rx_bytes"] = {ns: after[ns] - before.get(ns, 0) for ns in after}
        out["tcp_connections"] = connections or []
    if proc.returncode != 0:
        out["refused"] = refusal(stderr) or f"exit {proc.returncode}: {stderr.strip().splitlines()[-1:]}"
        out["stderr_tail"] = stderr[-2000:]
        return out
    out.update(common.parse_stats(stderr))
    out["peak_rss_mib"] = max(out["peak_rss"]) / 2**20 if out["peak_rss"] else None
    m = SUMS.search(stderr)
    out["sum_ms_per_token"] = float(m.group(1)) if m else None
    out["stats_line"] = [line for line in stderr.splitlines() if line.startswith("[pipeline]")][-1]
    out["text"] = stdout.rstrip("\n")
    return out


BATCH_SUMMARY = re.compile(r"\[pipeline\] batch: (\d+) done, (\d+) error records, (\d+) tokens generated in "
                           r"([\d.]+) s: ([\d.]+) tok/s")


def batch_requests() -> list[dict]:
    topics = ["a lighthouse keeper", "a lost robot", "the first snow", "a city under the sea", "an old clock",
              "a dragon who cannot fly", "a library at midnight", "a train across the desert"]
    prompts = [f"{task} {t}." for task in ("Write a short story about", "Describe in one paragraph") for t in topics]
    return [{"id": i, "prompt": prompts[i % len(prompts)], "max_tokens": BATCH_TOKENS} for i in range(BATCH_REQUESTS)]


def run_batch(model: Path, layout: str, folder: Path, timeout: float = 1200) -> dict:
    ranks, flags = layout_flags(layout, "batch")
    prefix, env = launcher(ranks, None)
    inp, outp = folder / "requests.jsonl", folder / f"out-{layout.replace(' ', '_')}.jsonl"
    if not inp.exists():
        inp.write_text("".join(json.dumps(r) + "\n" for r in batch_requests()))
    outp.unlink(missing_ok=True)
    cmd = [*prefix, "batch", "--model", str(model), "--input", str(inp), "--output", str(outp), "--quiet",
           "--weights-in-memory", "quantized", *flags]
    load, code = common.load_average(), code_state()
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.REPO, env=env, timeout=timeout)
    out = {"layout": layout, "load_before": load[0], "uptime": uptime(), "job_wall_s": time.perf_counter() - start,
           "code": code}
    if proc.returncode != 0:
        out["refused"] = refusal(proc.stderr) or f"exit {proc.returncode}"
        out["stderr_tail"] = proc.stderr[-2000:]
        return out
    m = BATCH_SUMMARY.search(proc.stderr)
    if not m:
        out["refused"] = f"no batch summary line in: {proc.stderr[-500:]}"
        return out
    out.update({"done": int(m[1]), "errors": int(m[2]), "tokens": int(m[3]), "schedule_s": float(m[4]),
                "tok_s": float(m[5])})
    out["texts"] = {r["id"]: r.get("text") for r in map(json.loads, outp.read_text().splitlines())}
    return out


# ---- interleaving -----------------------------------------------------------------------------------------

def interleave(contenders: dict, runs: int, warmup: int) -> dict[str, list[dict]]:
    """common.interleave's rounds, keeping failed runs (their refusal line) and skipping a contender
    after it is refused once (a refusal does not change from run to run)."""
    measured: dict[str, list[dict]] = {name: [] for name in contenders}
    refused: set[str] = set()
    for round_ in range(warmup + runs):
        for name, run in contenders.items():
            if name in refused:
                continue
            result = run()
            tag = "warmup" if round_ < warmup else f"run {round_ - warmup + 1}/{runs}"
            if "refused" in result:
                refused.add(name)
                print(f"  {tag:>10} {name:<16} REFUSED: {result['refused']}", flush=True)
                measured[name].append(result)
                continue
            print(f"  {tag:>10} {name:<16} " + " ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()
                if k in ("prefill_tps", "decode_tps", "sum_ms_per_token", "tok_s", "tokens", "load_before",
                         "veth_rx_bytes")), flush=True)
            if round_ >= warmup:
                measured[name].append(result)
    return measured


def stats_of(runs: list[dict], keys: list[str]) -> dict:
    ok = [r for r in runs if "refused" not in r]
    if not ok:
        return {"refused": runs[0]["refused"]} if runs else {}
    return common.summarize_runs(ok, keys)


def median(stats: dict, key: str) -> float | None:
    s = stats.get(key) or {}
    return s.get("median")


# ---- the planner's prediction -----------------------------------------------------------------------------

def host_bandwidth_gbs() -> dict:
    """Memory read bandwidth one process on one core reaches while the other core reads too (the two
    ranks' situation): numpy sum, two processes at once, halved (bench_roofline's probe), the best of
    three (other jobs on the machine take their share); and bench_roofline's figure for one process
    on an idle machine, from results/roofline.json, where there is one."""
    import bench_roofline

    values = [bench_roofline.python_gbps(bench_roofline.SUM, 2) / 2 for _ in range(3)]
    out = {"per_rank_gbs": max(values), "values": values, "load": common.load_average()}
    try:
        roofline = json.loads((common.RESULTS / "roofline.json").read_text())
        out["idle_one_process_gbs"] = roofline["bandwidth_gbps"]["numpy sum, 1 process"]["median"]
        out["idle_from"] = f"results/roofline.json ({roofline['date']}, load after {roofline['load_after'][0]:.1f})"
    except (OSError, KeyError, ValueError):
        pass
    return out


def predict(model: Path, t: int, bandwidth_gbs: float, link_terms: dict | None, context: int,
            hosts: int = 2) -> dict:
    """The planner's single-stream tok/s for `hosts` hosts as stages of t ranks (layouts.plan_layout), with
    its linux-tcp terms or with these link terms (latency_us, gbs) and its Linux CPU host terms."""
    sys.path.insert(0, str(common.REPO))
    from pipeline.checkpoints.model_files import find
    from pipeline.planner.cluster_costs import TERM_SETS, LinkTerms
    from pipeline.planner.config_files import load_config
    from pipeline.planner.layouts import plan_layout
    from pipeline.planner.shapes import architecture
    from pipeline.planner.stored_formats import checkpoint_format
    from pipeline.planner.weights_bytes import Precision

    config = load_config(str(model))
    host, link = TERM_SETS["linux-tcp"]
    if link_terms is not None:
        link = LinkTerms("veth, measured", link_terms["latency_us"], link_terms["gbs"])
    # Held as generate holds them here: packed 4-bit, float32 activations; int8 products as on this machine
    # (the stats line's weights field says which the runs used).
    from pipeline.kernels.build import int8_by_default

    precision = Precision(checkpoint_format(config, find(str(model))), "float32", None, 64, dense=False,
                          int8=int8_by_default(None, "float32"))
    layout = plan_layout(architecture(config), precision, t, [bandwidth_gbs] * hosts, None, host, link,
                         context, batch=BATCH_REQUESTS)
    return {"layout": layout.name, "layers_per_stage": layout.counts, "single_tps": layout.single_tps, "batch_tps": layout.batch_tps,
            "sums_ms_per_token": layout.sums_ms, "host_terms": host._asdict(), "link_terms": link._asdict(),
            "bandwidth_gbs": bandwidth_gbs, "context": context}


# ---- what synchronizing costs on this machine, without pipeline -------------------------------------------

def sums_worker(tokens: int, layers: int) -> None:
    """One rank of the sums probe: per token, 2 x layers + 1 rounds of ~1-2 ms of matrix-vector work (a
    rank's share of a layer) then an Iallgather of 2048 float32 polled by a busy loop, as GroupSum
    does; prints rank 0's ms per token, the part of it spent waiting in the gathers, and the same work
    without the gathers."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    a = np.random.default_rng(comm.Get_rank()).standard_normal((1024, 2048), dtype=np.float32)
    x, mine, parts = np.ones(2048, np.float32), np.ones(2048, np.float32), np.empty((2, 2048), np.float32)
    sums = 2 * layers + 1

    def work():
        for _ in range(4):
            a @ x

    alone = time.perf_counter()
    for _ in range(sums * 3):
        work()
    alone = (time.perf_counter() - alone) / 3
    comm.Barrier()
    per_token, waits = [], []
    for _ in range(tokens):
        start, waited = time.perf_counter(), 0.0
        for _ in range(sums):
            work()
            t = time.perf_counter()
            request = comm.Iallgather(mine, parts)
            while not request.Test():
                pass
            waited += time.perf_counter() - t
        per_token.append(time.perf_counter() - start)
        waits.append(waited)
    if comm.Get_rank() == 0:
        import statistics
        print(json.dumps({"sums_per_token": sums, "token_ms": 1e3 * statistics.median(per_token),
                          "wait_ms_per_token": 1e3 * statistics.median(waits),
                          "work_alone_ms_per_token": 1e3 * alone}), flush=True)


def group_sum_worker(tokens: int, layers: int) -> None:
    """One member of the in-graph sums probe: the runtime's own group sum (form_group, as generate forms it),
    2 x layers + 1 chained sums of 2048 float32 per graph (a token's, no compute between), evaluated once;
    rank 0 prints the per-sum time of the best and the median graph."""
    import statistics

    import mlx.core as mx
    import numpy as np
    from mpi4py import MPI

    sys.path.insert(0, str(common.REPO))
    import pipeline  # noqa: F401 -- first, as a real run
    from pipeline.runtime.tensor_group import form_group

    comm = MPI.COMM_WORLD
    group = form_group(comm, comm.Get_size(), watchdog=60.0)
    gsum, sums = group.group_sum, 2 * layers + 1
    base = mx.array(np.random.default_rng(comm.Get_rank()).standard_normal(2048).astype(np.float32))
    times = []
    for i in range(tokens + 5):
        comm.Barrier()
        x = base
        for _ in range(sums):
            x = gsum(x * 0.5)
        start = time.perf_counter()
        mx.eval(x)
        if i >= 5:
            times.append((time.perf_counter() - start) / sums)
    if comm.Get_rank() == 0:
        print(json.dumps({"kind": "in-graph" if getattr(gsum, "in_graph", False) else "python", "sums": sums,
                          "best_us": 1e6 * min(times), "median_us": 1e6 * statistics.median(times),
                          "graphs": len(times)}), flush=True)


def group_sum_probe(hosts: netns_hosts.TwoHosts | None = None, tokens: int = 200) -> dict:
    """The in-graph sums probe on 2 one-core ranks: on this machine (shared memory) or across the two hosts."""
    env = common.env_with_repo(OPENBLAS_NUM_THREADS="1")
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "groupsum", "--tokens", str(tokens)]
    if hosts is None:
        cmd = ["mpiexec", "-n", "2", "-bind-to", "core", *argv]
    else:
        cmd, env = hosts.mpiexec(argv), hosts.environment(env)
    load = common.load_average()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=common.REPO, timeout=300)
    if proc.returncode != 0:
        return {"failed": proc.stderr[-1000:], "load_before": load[0]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(load_before=load[0], link="veth, TCP" if hosts else "shared memory")
    return out


def sums_probe(tokens: int = 15, layers: int = 16) -> dict:
    """The sums probe on 2 one-core ranks (mpiexec binds them as generate does not: -bind-to core)."""
    env = common.env_with_repo(OPENBLAS_NUM_THREADS="1")
    cmd = ["mpiexec", "-n", "2", "-bind-to", "core", sys.executable, str(Path(__file__).resolve()), "--worker", "sums",
           "--tokens", str(tokens), "--layers", str(layers)]
    load = common.load_average()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        return {"failed": proc.stderr[-1000:], "load_before": load[0]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(load_before=load[0], uptime=uptime())
    print(f"  sums probe (mpi4py, no pipeline; {out['sums_per_token']} Iallgathers of 8 KB per token between 2 one-core "
          f"ranks): {out['token_ms']:.0f} ms/token of which {out['wait_ms_per_token']:.0f} ms waiting; the same work "
          f"alone {out['work_alone_ms_per_token']:.0f} ms; load {load[0]:.1f}", flush=True)
    return out


# ---- main ------------------------------------------------------------------------------------------------

def single_stream(model: Path, name: str, prompt: str, runs: int, warmup: int) -> dict:
    layouts = ["1 rank", "pipeline 2 x 1", "tensor 1 x 2"]
    runs_ = interleave({lay: (lambda lay=lay: run_generate(model, lay, prompt)) for lay in layouts}, runs, warmup)
    stats = {lay: stats_of(rs, KEYS) for lay, rs in runs_.items()}
    decode = {lay: median(s, "decode_tps") for lay, s in stats.items()}
    prefill = {lay: median(s, "prefill_tps") for lay, s in stats.items()}
    ratios = {}
    for what, table in (("decode", decode), ("prefill", prefill)):
        for a, b in (("tensor 1 x 2", "1 rank"), ("tensor 1 x 2", "pipeline 2 x 1"), ("pipeline 2 x 1", "1 rank")):
            if table.get(a) and table.get(b):
                ratios[f"{what} {a} / {b}"] = table[a] / table[b]
    texts = {lay: rs[0].get("text") for lay, rs in runs_.items() if rs and "text" in rs[0]}
    same = {lay: common.same_text(t, texts["1 rank"]) for lay, t in texts.items()} if "1 rank" in texts else {}
    stable = {lay: all(r.get("text") == rs[0].get("text") for r in rs) for lay, rs in runs_.items() if rs}
    goal = GOALS.get(name)
    got = ratios.get("decode tensor 1 x 2 / 1 rank")
    return {"stats": stats, "ratios": ratios, "same_text_as_1_rank": same, "text_same_every_run": stable,
            "goal_decode_tensor_over_1_rank": goal, "goal_met": (got >= goal) if got and goal else None,
            "refused": {lay: s["refused"] for lay, s in stats.items() if "refused" in s}, "runs": runs_}


def batch(model: Path, runs: int, warmup: int) -> dict:
    layouts = ["pipeline 2 x 1", "tensor 1 x 2"]
    with tempfile.TemporaryDirectory(prefix="tp-batch-") as tmp:
        runs_ = interleave({lay: (lambda lay=lay: run_batch(model, lay, Path(tmp))) for lay in layouts}, runs, warmup)
    stats = {lay: stats_of(rs, ["tok_s", "tokens", "schedule_s"]) for lay, rs in runs_.items()}
    tps = {lay: median(s, "tok_s") for lay, s in stats.items()}
    ratio = tps["tensor 1 x 2"] / tps["pipeline 2 x 1"] if all(tps.values()) else None
    texts = {lay: rs[0].get("texts") for lay, rs in runs_.items() if rs and "texts" in rs[0]}
    for rs in runs_.values():
        for r in rs:
            r.pop("texts", None)
    same = None
    if len(texts) == 2:
        a, b = texts.values()
        same = sum(a[k] == b.get(k) for k in a)
    return {"requests": BATCH_REQUESTS, "max_tokens": BATCH_TOKENS, "stats": stats,
            "ratio_tensor_over_pipeline": ratio, "texts_equal_across_layouts": same,
            "winner": (max(tps, key=lambda k: tps[k]) if all(tps.values()) else None),
            "refused": {lay: s["refused"] for lay, s in stats.items() if "refused" in s}, "runs": runs_}


def two_hosts(model: Path, name: str, prompt: str, runs: int, warmup: int, bandwidth: dict) -> dict:
    """Single-stream decode of pipeline 2 x 1 and tensor 1 x 2 with the two ranks in two network namespaces
    (MPI over TCP on the veth), interleaved with 1 rank on this machine (outside the namespaces: the host
    term of the headline prediction is fitted on it, so that what the prediction checks is the link's and
    the sums' terms); the link measured before and after (ping, MPI ping-pong); one line per layout:
    measured tok/s, the planner's prediction of that run, their ratio."""
    layouts = ["pipeline 2 x 1", "tensor 1 x 2"]
    with netns_hosts.TwoHosts() as hosts:
        rtt = netns_hosts.ping_rtt(hosts)
        link = netns_hosts.pingpong(hosts, LINK_SIZES)
        print(f"  veth ({uptime()}): ping round trip min/avg {rtt.get('min_us', 0):.0f}/{rtt.get('avg_us', 0):.0f} us; "
              f"MPI ping-pong one way (median trip) " + ", ".join(
                  f"{size} B {1e6 * s:.1f} us" for size, s in link["one_way_s"].items())
              + f"; {link['gbs']:.2f} GB/s (1 MiB); veth received {link['veth_rx_bytes']}", flush=True)
        probes = [group_sum_probe(None), group_sum_probe(hosts)]  # the bare in-graph sum on each link
        for pr in probes:
            if "failed" not in pr:
                print(f"  bare group sum ({pr['kind']}, {pr['sums']} chained a graph, 2048 float32) over {pr['link']}: "
                      f"{pr['best_us']:.1f} us at best, {pr['median_us']:.1f} median; load {pr['load_before']:.1f}",
                      flush=True)
        contenders = {"1 rank": lambda: run_generate(model, "1 rank", prompt)}  # this machine, no namespaces
        contenders.update({lay: (lambda lay=lay: run_generate(model, lay, prompt, hosts)) for lay in layouts})
        runs_ = interleave(contenders, runs, warmup)
        rtt_after = netns_hosts.ping_rtt(hosts)
        link_after = netns_hosts.pingpong(hosts, LINK_SIZES)
        namespaces = netns_hosts.NAMESPACES
    print(f"  namespaces {', '.join(namespaces)} removed: "
          f"{not any(ns in netns_hosts._ip('netns', 'list', check=False).stdout for ns in namespaces)}", flush=True)
    stats = {lay: stats_of(rs, KEYS) for lay, rs in runs_.items()}
    one_rank_tps = median(stats["1 rank"], "decode_tps")
    context = PROMPT_TOKENS + NEW_TOKENS
    sum_bytes = 4 * int(json.loads((model / "config.json").read_text())["hidden_size"])
    measured_link = {"latency_us": (link["latency_us"] + link_after["latency_us"]) / 2,
                     "gbs": (link["gbs"] + link_after["gbs"]) / 2,
                     "sum_message_one_way_us": 1e6 * (link["one_way_s"][sum_bytes] + link_after["one_way_s"][sum_bytes]) / 2,
                     "ping_rtt_min_us": [r.get("min_us") for r in (rtt, rtt_after)],
                     "ping_rtt_avg_us": [r.get("avg_us") for r in (rtt, rtt_after)]}
    # The host's bandwidth the planner is given, three ways: fitted, so that the planner's one-rank figure
    # equals the one-rank decode measured in these rounds on this machine (the planner's single stream on one
    # host is linear in the bandwidth: this removes the host term and leaves the link's and the sums' to be
    # checked; the headline); the probe's (numpy sum on each core, at the start); the idle machine's
    # (roofline.json).
    bases = {}
    if one_rank_tps:
        bases["fitted to 1 rank"] = bandwidth["per_rank_gbs"] * one_rank_tps / predict(
            model, 1, bandwidth["per_rank_gbs"], None, context, hosts=1)["single_tps"]
    bases["probe"] = bandwidth["per_rank_gbs"]
    if bandwidth.get("idle_one_process_gbs"):
        bases["idle machine"] = bandwidth["idle_one_process_gbs"]
    comparison, headline = {}, {}
    for lay in layouts:
        t = 2 if lay.startswith("tensor") else 1
        got = median(stats[lay], "decode_tps")
        table = {base: {"measured link": predict(model, t, gbs, measured_link, context),
                        "linux-tcp": predict(model, t, gbs, None, context)}
                 for base, gbs in bases.items()}
        comparison[lay] = {"measured_decode_tps": got, "measured_sum_ms_per_token": median(stats[lay], "sum_ms_per_token"),
                           "host_bandwidth_gbs": bases, "predicted": table,
                           "ratio": {base: {k: v["single_tps"] / got for k, v in row.items()} if got else None
                                     for base, row in table.items()}}
        base = next(iter(bases))
        p = table[base]["measured link"]
        loads = [r.get("load_before") for r in runs_[lay] if "refused" not in r]
        headline[lay] = {
            "model": name, "layout": p["layout"], "layers_per_stage": p["layers_per_stage"], "measured_decode_tps": got, "predicted_tps": p["single_tps"],
            "ratio_predicted_over_measured": p["single_tps"] / got if got else None,
            "within_goal": abs(p["single_tps"] / got - 1) <= PLANNER_GOAL if got else None,
            "predicted_sums_ms_per_token": p["sums_ms_per_token"],
            "measured_sums_ms_per_token": comparison[lay]["measured_sum_ms_per_token"],
            "host_bandwidth": f"{base}: {bases[base]:.2f} GB/s" + (f" (1 rank {one_rank_tps:.2f} tok/s)" if one_rank_tps else ""),
            "link": {"latency_us": measured_link["latency_us"], "gbs": measured_link["gbs"]},
            "host_terms": p["host_terms"], "load_before_runs": loads}
        if got:
            h = headline[lay]
            print(f"  TWO HOSTS {lay}: measured {got:.2f} tok/s, planner {h['predicted_tps']:.2f} tok/s "
                  f"(model {name}, {lay}, layers {p['layers_per_stage']}, link {measured_link['latency_us']:.1f} us + {measured_link['gbs']:.2f} GB/s "
                  f"measured, sum overhead {p['host_terms']['sum_overhead_us']:g} us, host bw {h['host_bandwidth']}), "
                  f"predicted/measured {h['ratio_predicted_over_measured']:.2f} "
                  f"({'within' if h['within_goal'] else 'NOT within'} {PLANNER_GOAL:.0%}); sums measured "
                  f"{h['measured_sums_ms_per_token']} / predicted {h['predicted_sums_ms_per_token']:.2f} ms/token; "
                  f"load {', '.join(f'{x:.1f}' for x in loads)}", flush=True)
            for base_, row in table.items():
                print(f"    host bandwidth {base_} ({bases[base_]:.1f} GB/s): " + "; ".join(
                    f"{k} terms {v['single_tps']:.2f} tok/s ({v['single_tps'] / got - 1:+.0%}, sums "
                    f"{v['sums_ms_per_token']:.2f} ms/token)" for k, v in row.items()), flush=True)
    ratios = comparison["tensor 1 x 2"]["ratio"]
    within = {base: abs(r["linux-tcp"] - 1) <= PLANNER_GOAL for base, r in ratios.items() if r}
    return {"namespaces": namespaces, "addresses": netns_hosts.ADDRESSES, "mpi_env": netns_hosts.MPI_ENV,
            "ping_before": rtt, "ping_after": rtt_after, "link_before": link, "link_after": link_after,
            "measured_link": measured_link, "group_sum_probe": probes, "headline": headline,
            "stats": stats, "planner": comparison, "planner_goal": PLANNER_GOAL,
            "planner_linux_tcp_within_goal": within,  # per host bandwidth basis
            "refused": {lay: s["refused"] for lay, s in stats.items() if "refused" in s}, "runs": runs_}


def strip_texts(section: dict) -> None:
    for rs in section.get("runs", {}).values():
        for r in rs:
            if "text" in r:
                r["text"] = r["text"][:200]


def main() -> None:
    parser = common.arguments(__doc__)
    parser.set_defaults(runs=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch-runs", type=int, default=1, help="measured rounds of the batch (default 1)")
    parser.add_argument("--no-batch", dest="batch", action="store_false", help="skip the 16 x 64 batch")
    parser.add_argument("--no-hosts", dest="hosts", action="store_false",
                        help="skip the two-host run (network namespaces; needs root)")
    parser.add_argument("--hosts-model", default="llama-1b", help="the model of the two-host run (default llama-1b)")
    parser.add_argument("--parts", default="single,batch,hosts",
                        help="which parts to run, of single (1 rank / pipeline / tensor on one machine), batch "
                        "(16 x 64) and hosts (two network namespaces); default all. A short check of the planner's "
                        "TCP terms: --models llama-1b --parts hosts --runs 3")
    parser.add_argument("--name", default=NAME, help=f"results/NAME.json and .png (default {NAME})")
    parser.add_argument("--plot", action="store_true", help="only redraw the PNG from results/NAME.json")
    parser.add_argument("--worker", choices=["sums", "groupsum"], default=None, help="run as one rank of the sums probe "
                        "(started by mpiexec, not by hand)")
    parser.add_argument("--tokens", type=int, default=15, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if parts - {"single", "batch", "hosts"}:
        parser.error(f"--parts {args.parts}: each part is one of single, batch, hosts")
    if not args.batch:
        parts.discard("batch")
    if not args.hosts:
        parts.discard("hosts")
    if args.worker == "sums":
        sums_worker(args.tokens, args.layers)
        return
    if args.worker == "groupsum":
        group_sum_worker(args.tokens, args.layers)
        return
    if args.plot:
        plot(json.loads((common.RESULTS / f"{args.name}.json").read_text()))
        return
    started = time.time()
    uptime_before = uptime()
    print(f"load: {uptime_before}", flush=True)
    bandwidth = host_bandwidth_gbs() if "hosts" in parts else None  # the planner's input, for the hosts part
    if bandwidth:
        print(f"memory bandwidth per one-core rank (numpy sum, 2 at once): {bandwidth['per_rank_gbs']:.1f} GB/s",
              flush=True)
    probes = [sums_probe()] if "single" in parts else []
    models = {}
    for name in args.models.split(","):
        model = MODELS[name]()
        text, ids = common.prompt_of(model, PROMPT_TOKENS)
        print(f"{name}: {model} ({common.param_count(model) / 1e9:.2f} B parameters), prompt {len(ids)} tokens, "
              f"{NEW_TOKENS} new; {uptime()}", flush=True)
        entry = {"folder": str(model), "parameters": common.param_count(model), "prompt_tokens": len(ids),
                 "new_tokens": NEW_TOKENS}
        if "single" in parts:
            entry["single"] = single_stream(model, name, text, args.runs, args.warmup)
            for key, value in entry["single"]["ratios"].items():
                print(f"  {key}: {value:.2f}x", flush=True)
        if "batch" in parts:
            print(f"{name}: batch {BATCH_REQUESTS} x {BATCH_TOKENS}; {uptime()}", flush=True)
            entry["batch"] = batch(model, args.batch_runs, 0)
            if entry["batch"]["ratio_tensor_over_pipeline"]:
                print(f"  batch tensor 1 x 2 / pipeline 2 x 1: {entry['batch']['ratio_tensor_over_pipeline']:.2f}x",
                      flush=True)
        if "hosts" in parts and name == args.hosts_model:
            if os.geteuid() != 0:
                entry["two_hosts"] = {"skipped": "not root: ip netns needs root"}
            else:
                print(f"{name}: two hosts (network namespaces, MPI over TCP on a veth); {uptime()}", flush=True)
                entry["two_hosts"] = two_hosts(model, name, text, args.runs, 0 if "single" in parts else args.warmup,
                                               bandwidth)
        for section in ("single", "two_hosts"):
            strip_texts(entry.get(section, {}))
        models[name] = entry
    payload = common.record(args.name, "issue 34: --tensor-parallel 2 vs 1 rank vs a 2-stage pipeline, one core per rank; "
                            "and across two network namespaces (MPI over TCP on a veth)",
                            runs=args.runs, warmup=args.warmup, parts=sorted(parts), uptime_before=uptime_before,
                            environment={k: os.environ[k] for k in ("PIPELINE_GROUP_SUM",) if k in os.environ},
                            load_after=common.load_average(), uptime_after=uptime(),
                            sums_probe=probes + ([sums_probe()] if "single" in parts else []), minutes=(time.time() - started) / 60, bandwidth=bandwidth,
                            goals=GOALS, models=models)
    path = common.write_json(args.name, payload)
    plot(payload)
    print(f"wrote {path} ({payload['minutes']:.1f} min)")


def plot(payload: dict) -> None:
    models = list(payload["models"])
    panels = [("single", "decode_tps", "decode tok/s, 1 stream", ["1 rank", "pipeline 2 x 1", "tensor 1 x 2"]),
              ("single", "prefill_tps", "prefill tok/s", ["1 rank", "pipeline 2 x 1", "tensor 1 x 2"]),
              ("batch", "tok_s", f"batch {BATCH_REQUESTS} x {BATCH_TOKENS} tok/s", ["pipeline 2 x 1", "tensor 1 x 2"]),
              ("two_hosts", "decode_tps", "decode tok/s, two hosts (veth, TCP)", ["pipeline 2 x 1", "tensor 1 x 2"])]
    fig, axes = common.figure(len(panels), width=4.6)
    for ax, (section, key, label, names) in zip(axes, panels):
        series = {n: [payload["models"][m].get(section, {}).get("stats", {}).get(n, {}).get(key) for m in models]
                  for n in names}
        common.bars(ax, label, models, series, label)
        if section == "two_hosts":
            for j, m in enumerate(models):
                planner = payload["models"][m].get("two_hosts", {}).get("planner", {})
                for i, n in enumerate(names):
                    predicted = planner.get(n, {}).get("predicted", {})
                    for base, style in (("fitted to 1 rank", "k--"), ("idle machine", "k:")):
                        p = predicted.get(base, {}).get("linux-tcp", {}).get("single_tps")
                        if p:
                            x = j + (i - (len(names) - 1) / 2) * 0.8 / len(names)
                            ax.plot([x - 0.15, x + 0.15], [p, p], style, lw=1,
                                    label=f"planner, linux-tcp, host bw {base}" if i == 0 and j == 0 else None)
        ax.legend(fontsize=6)
    fig.suptitle(f"issue 34: tensor parallelism, one core per rank ({payload['machine']['cores']} cores; median, "
                 f"min-max of {payload['runs']} runs; load after {payload['load_after'][0]:.1f})", fontsize=9)
    common.save(fig, common.RESULTS / f"{payload['benchmark']}.png")


if __name__ == "__main__":
    main()
