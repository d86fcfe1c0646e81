"""Expert parallelism vs slicing (issue 34's MoE choice): single-stream decode of the qwen3-moe-2b benchmark
model (benchmarks/tensor_parallel.py: 16 layers, hidden 2048, 64 experts of 256 features, top 8, MLX 4-bit)
with `--tensor-parallel 2 --expert-parallel` (each rank 32 whole experts) vs `--tensor-parallel 2` (every
expert sliced: 128 features each) vs 1 rank, one core per rank, interleaved run by run; and the routing's
balance: for each decoded token and layer, the most chosen experts any one member holds (what that member
runs, the group waits for it), averaged, for T = 2 and 3, from the model's own routing (1 rank, in-process).

    python benchmarks/expert_parallel.py [--runs 3] [--warmup 1] [--balance-only] [--sliced-only]

The deciding figure is its last line but one, `HEADLINE: T = 2 sliced decode X tok/s = R x 1 rank (Y tok/s)`
(medians; the load before and after beside it). Two ranks against one are only fair on an idle machine: a
job elsewhere that takes CPU time from either rank of T = 2 stalls both (each waits for the other at
every group sum), where one rank leaves the second core to it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import tensor_parallel as tp  # noqa: E402

NAME = "expert_parallel"
CONTENDERS = {"1 rank": (1, []), "tensor 1 x 2 sliced": (2, ["--tensor-parallel", "2"]),
              "tensor 1 x 2 experts": (2, ["--tensor-parallel", "2", "--expert-parallel"])}


def run(model: Path, prompt: str, ranks: int, flags: list[str]) -> dict:
    prefix, env = tp.launcher(ranks, None)
    cmd = [*prefix, "generate", "--model", str(model), "--prompt", prompt, "--no-chat-template",
           "--max-tokens", str(tp.NEW_TOKENS), "--weights-in-memory", "quantized", *flags]
    up = tp.uptime()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.REPO, env=env, timeout=900)
    if proc.returncode != 0:
        return {"refused": tp.refusal(proc.stderr) or proc.stderr[-500:], "uptime": up}
    out = {"uptime": up, **common.parse_stats(proc.stderr)}
    m = tp.SUMS.search(proc.stderr)
    out["sum_ms_per_token"] = float(m.group(1)) if m else None
    out["text"] = proc.stdout.rstrip("\n")
    return out


def balance(model: Path, prompt_ids: list[int], tokens: int, sizes=(2, 3)) -> dict:
    """The routing of a greedy decode on 1 rank: per decoded token and layer, the most of its k chosen experts
    one member of T holds (contiguous shares, as --expert-parallel holds them), averaged; the ideal is k / T."""
    import mlx.core as mx
    import numpy as np

    from pipeline.checkpoints.model_files import locate
    from pipeline.models import qwen3_moe
    from pipeline.models.expert_parallel import expert_share
    from pipeline.runtime.stage import Stage

    checkpoint = locate(model).open(None)
    config = checkpoint.model_config()
    chosen: list[np.ndarray] = []
    call = qwen3_moe.SparseMoeBlock.__call__

    def recording(self, x):
        tokens_ = x.reshape(-1, x.shape[-1])
        probs = mx.softmax(self.gate(tokens_).astype(mx.float32), axis=-1)
        chosen.append(np.array(mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[:, : self.top_k]))
        return call(self, x)

    qwen3_moe.SparseMoeBlock.__call__ = recording
    try:
        stage = Stage.load(config, checkpoint, (0, config.num_hidden_layers), has_ends=True, dtype=mx.float32)
        model_ = stage.model
        hidden = stage.run_layers(model_.embed(mx.array([prompt_ids])), [0])
        token = int(mx.argmax(model_.logits(hidden)[0, -1]))
        chosen.clear()  # the decoded tokens' routing only
        for _ in range(tokens):
            hidden = stage.run_layers(model_.embed(mx.array([[token]])), [0])
            token = int(mx.argmax(model_.logits(hidden)[0, -1]))
    finally:
        qwen3_moe.SparseMoeBlock.__call__ = call
    picks = np.concatenate(chosen)  # [tokens x layers, k]
    experts, k = qwen3_moe.num_experts(config), picks.shape[1]
    out = {"experts": experts, "top_k": k, "samples": int(picks.shape[0])}
    for t in sizes:
        member = np.zeros(experts, int)
        for m in range(t):
            b, e = expert_share(experts, t, m)
            member[b:e] = m
        counts = np.stack([(member[picks] == m).sum(axis=1) for m in range(t)], axis=1)
        out[f"T={t}"] = {"mean_max_experts": float(counts.max(axis=1).mean()), "ideal": k / t,
                         "cap_speedup": k / float(counts.max(axis=1).mean()),
                         "max_histogram": np.bincount(counts.max(axis=1), minlength=k + 1).tolist()}
    rng = np.random.default_rng(0)  # uniform random top-k for comparison
    uniform = np.stack([rng.choice(experts, k, replace=False) for _ in range(20000)])
    for t in sizes:
        member = np.repeat(np.arange(t), [expert_share(experts, t, m)[1] - expert_share(experts, t, m)[0]
                                          for m in range(t)])
        out[f"T={t}"]["uniform_random_mean_max"] = float(
            np.stack([(member[uniform] == m).sum(axis=1) for m in range(t)], axis=1).max(axis=1).mean())
    return out


def compute(model: Path, prompt_ids: list[int], tokens: int, rounds: int) -> dict:
    """One member's own work per decoded token, in-process on this one core, no group sums (they are what the
    shared machine's load makes noisy): member 0 of T = 2 sliced, member 0 of T = 2 expert-parallel (its
    choices evaluated at each MoE layer), and the whole model; interleaved round by round, ms per token."""
    import mlx.core as mx

    from pipeline.checkpoints.int8_repack import use_int8
    from pipeline.checkpoints.model_files import locate
    from pipeline.models.tensor_parallel import Shard
    from pipeline.runtime.stage import Stage

    checkpoint = locate(model).open(None)
    config = checkpoint.model_config()
    layers = (0, config.num_hidden_layers)
    stages = {name: Stage.load(config, checkpoint, layers, has_ends=True, dtype=mx.float32, shard=shard)
              for name, shard in (("1 rank", None), ("member 0 of 2 sliced", Shard(0, 2)),
                                  ("member 0 of 2 experts", Shard(0, 2, True)))}
    for stage in stages.values():  # int8 activations, as generate holds them on an AVX2/AVX-512 CPU
        use_int8(stage.model, tied_head=bool(config.tie_word_embeddings))
    embed = stages["1 rank"].model.embed
    hidden = embed(mx.array([prompt_ids[:16]]))
    step = embed(mx.array([[prompt_ids[16]]]))
    mx.eval(hidden, step)
    out: dict[str, list[float]] = {name: [] for name in stages}
    for round_ in range(rounds + 1):
        for name, stage in stages.items():
            stage.run_layers(hidden, [round_])
            start = time.perf_counter()
            for _ in range(tokens):
                stage.run_layers(step, [round_])
            if round_:
                out[name].append(1000 * (time.perf_counter() - start) / tokens)
            stage.release([round_])
    return {name: common.summary(v) for name, v in out.items()}


def load(uptime: str) -> str:
    """The load averages of an `uptime` line."""
    return uptime.rsplit("load average:", 1)[-1].strip()


def main() -> None:
    parser = common.arguments(__doc__)
    parser.set_defaults(runs=3)
    parser.add_argument("--balance-only", action="store_true")
    parser.add_argument("--sliced-only", action="store_true",
                        help="1 rank and T = 2 sliced only (not --expert-parallel): the deciding figure, sooner")
    parser.add_argument("--compute-only", action="store_true",
                        help="only one member's work per token, in-process (run it under taskset -c 0)")
    args = parser.parse_args()
    if args.compute_only:
        model = tp.qwen3_moe_2b()
        _, ids = common.prompt_of(model, tp.PROMPT_TOKENS)
        print(f"load: {tp.uptime()}", flush=True)
        result = compute(model, ids, tp.NEW_TOKENS, args.runs)
        for name, stats in result.items():
            print(f"{name:<24} {stats['median']:.1f} ms/token (min {stats['min']:.1f}, max {stats['max']:.1f})")
        print(f"load: {tp.uptime()}", flush=True)
        common.write_json(NAME + "_compute", common.record(NAME + "_compute", compute.__doc__.split("\n")[0],
                                                           compute=result, uptime=tp.uptime()))
        return
    model = tp.qwen3_moe_2b()
    text, ids = common.prompt_of(model, tp.PROMPT_TOKENS)
    started = tp.uptime()
    print(f"load: {started}", flush=True)
    result = {} if args.sliced_only else {"balance": balance(model, ids, tp.NEW_TOKENS)}
    if "balance" in result:
        print(f"balance: {result['balance']}", flush=True)
    contenders = {name: c for name, c in CONTENDERS.items() if not (args.sliced_only and "experts" in name)}
    if not args.balance_only:
        measured = common.interleave({name: (lambda r=r, f=f: run(model, text, r, f))
                                      for name, (r, f) in contenders.items()}, args.runs, args.warmup)
        result["runs"] = measured
        result["stats"] = {name: common.summarize_runs([r for r in runs if "refused" not in r],
                                                       ["decode_tps", "prefill_tps", "sum_ms_per_token"])
                           for name, runs in measured.items()}
        base = result["stats"]["1 rank"]["decode_tps"].get("median")
        for name, stats in result["stats"].items():
            d, p = stats["decode_tps"].get("median"), stats["prefill_tps"].get("median")
            print(f"{name:<22} decode {d} tok/s ({d / base:.2f}x 1 rank)  prefill {p} tok/s" if d and base
                  else f"{name}: {stats}", flush=True)
        texts = {name: {r.get("text") for r in runs} for name, runs in measured.items()}
        result["texts_same_run_after_run"] = {name: len(t) == 1 for name, t in texts.items()}
        sliced = result["stats"]["tensor 1 x 2 sliced"]["decode_tps"].get("median")
        if sliced and base:
            result["headline"] = (f"HEADLINE: T = 2 sliced decode {sliced} tok/s = {sliced / base:.2f}x 1 rank "
                                  f"({base} tok/s); medians of {args.runs}; load {load(started)} .. {load(tp.uptime())}")
    result["finished_uptime"] = tp.uptime()
    path = common.write_json(NAME, common.record(NAME, __doc__.split("\n")[0], **result, time=time.time()))
    if "headline" in result:
        print(result["headline"], flush=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
