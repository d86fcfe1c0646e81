"""The text `pipeline plan` prints: the model's parameters and bytes, one line per rank (layers,
weights, KV cache, headroom, fit, ms per token), and the predicted tok/s with the model behind it;
for a cluster, the layouts table (stages x T) predicted with the fitted terms."""

from __future__ import annotations

from ..models.registry import FAMILIES
from .cluster_costs import HostTerms, LinkTerms, Measurement
from .layouts import Layout
from .memory import POINTS_MAX, size
from .speed import ClusterPlan


def _b(n: float) -> str:
    return f"{n / 1e9:.1f}B"


def format_plan(plan: ClusterPlan, title: str) -> str:
    arch, c, p, hw = plan.arch, plan.counts, plan.precision, plan.hardware
    cp = p.checkpoint
    runs_mtp = arch.name in FAMILIES and FAMILIES[arch.name].mtp
    lines = [f"{title} ({arch.name}): {len(arch.layers)} layers, {_b(c.total)} parameters, "
             f"{_b(c.active)} read per token (embedding table excluded)"
             + (f"; MTP module {_b(c.unused)} in the checkpoint, " + ("run only with --draft mtp" if runs_mtp
                                                                         else "not run by the runtime")
                if c.unused else "")
             + "".join(f"; {what} {_b(n)} in the published checkpoint, loaded by no rank" for what, n in arch.not_loaded)]
    if arch.name not in FAMILIES:
        lines.append(f"note: the runtime does not run {arch.name} yet (issue 36): generate and serve refuse it; "
                     f"this plan is what it will need")
    resident = sum(plan.mb.layers) + plan.mb.ends
    disk = sum(cp.disk_bytes(q) for layer in arch.layers for q in layer) + sum(cp.disk_bytes(q) for q in arch.ends)
    disk_unused = sum(cp.disk_bytes(q) for q in arch.unused)
    lines.append(f"weights in memory: {size(resident)}; {p.describe()}")
    lines.append(f"checkpoint on disk: {disk / 1e9:.1f} GB" + (f" (+{disk_unused / 1e9:.1f} GB MTP module)" if disk_unused else "")
                 + f", {cp.describe()}")
    kv_token = arch.kv_values * p.dtype_bytes * len(arch.layers)
    if arch.kv_layers is None:
        lines.append(f"KV cache: {arch.kv_note} = {arch.kv_values} values/token/layer, {kv_token / 1024:.1f} KiB per "
                     f"token ({p.dtype}); context {plan.context} x batch {plan.batch}")
    else:  # layers differ: per token, plus what a sequence holds whatever its length (windows, linear states)
        fixed = arch.kv_bytes(0, len(arch.layers), 0, p.dtype_bytes)
        kv_token = arch.kv_bytes(0, len(arch.layers), 1, p.dtype_bytes) - fixed  # (V4: its kept points too)
        lines.append(f"KV cache: {arch.kv_note} = {arch.kv_values:.1f} values/token/layer on average, "
                     f"{kv_token / 1024:.2f} KiB per token" + (f" + {fixed / 2**20:.1f} MiB per sequence" if fixed else "")
                     + f" ({p.dtype}); context {plan.context} x batch {plan.batch}")
    prefix = _prefix_cache_line(plan)
    lines += [prefix] if prefix else []
    lines.append("")
    lines.append(f"{'rank':>4}  {'memory':>9}  {'layers':<14}  {'weights':>10}  {'KV cache':>9}  {'headroom':>10}  "
                 f"{'fits':>4}  {'bandwidth':>10}  {'ms/token':>8}")
    bandwidth = hw.bandwidth_gbs if len(hw.bandwidth_gbs) == len(plan.ranks) else hw.bandwidth_gbs[:1] * len(plan.ranks)
    for r, ms, bw in zip(plan.ranks, plan.stage_ms, bandwidth):
        memory = f"{r.memory_gib:g} GiB" if r.memory_gib is not None else "-"
        headroom = size(r.headroom) if r.headroom is not None else "-"
        fits = "-" if r.fits is None else ("yes" if r.fits else "NO")
        span = f"{r.start}-{r.end - 1} ({r.end - r.start})"
        lines.append(f"{r.rank:>4}  {memory:>9}  {span:<14}  {size(r.weight_bytes):>10}  {size(r.kv_bytes):>9}  "
                     f"{headroom:>10}  {fits:>4}  {bw:>6g} GB/s  {ms:>8.2f}")
    lines.append("")
    hops = len(plan.ranks) if len(plan.ranks) > 1 else 0
    link = (f" + {hops} hops of {hw.link_latency_us:g} us + {arch.hidden_values or arch.config.hidden_size} x "
            f"{p.dtype_bytes} B at "
            f"{hw.link_gbs:g} GB/s" if hops else "")
    lines.append(f"decode roofline: single stream {plan.single_tps:.1f} tok/s (stage times in turn{link}); "
                 f"batch {plan.batch}: {plan.batch_tps:.1f} tok/s (stages overlap; slowest stage bounds it)")
    for k, how, tps in plan.speculative or ():
        drafting = f"MTP module, {size(plan.mb.mtp)} more on rank 0" if how == "mtp" else "prompt lookup, drafting free"
        lines.append(f"  speculative, {k} draft{'s' if k > 1 else ''} ({drafting}), acceptance "
                     f"{100 * plan.draft_acceptance:.0f}%: single stream {tps:.1f} tok/s "
                     f"({tps / plan.single_tps:.2f}x; the {k + 1} verified positions read more experts)")
    lines.append(f"  for scale: one host holding the whole model at {max(hw.bandwidth_gbs):g} GB/s would reach "
                 f"{plan.one_host_tps:.1f} tok/s single stream; a pipeline's single stream cannot beat that")
    if plan.even_split:
        counts, tps = plan.even_split
        lines.append(f"  note: an even split also fits ({','.join(map(str, counts))}); it gives batch {plan.batch} "
                     f"{tps:.1f} tok/s, since the larger hosts are the slowest stages: generate --split "
                     f"{','.join(map(str, counts))}")
    lines.append("  model: stage time = bytes read / bandwidth (non-expert weights, distinct routed experts "
                 "E*(1-(1-k/E)^m) for m tokens, KV cache at the full context"
                 + ("; GLM's DSA: indexer keys + top-k latents" if arch.name == "glm_moe_dsa" else "")
                 + ("; linear attention: its whole state" if any(c.kind == "linear_attention" for c in arch.kv_layers or ())
                    else "") + ")"
                 + ("; compute-bound at 2 x params x tokens / --tflops" if hw.tflops else "; compute not modelled")
                 + "; peak numbers, no efficiency factor: real runs land below")
    return "\n".join(lines)


def _prefix_cache_line(plan: ClusterPlan) -> str:
    """Serve's prefix cache (--prefix-cache-gb), counted at its whole budget on each rank (the runtime's
    cache counts each kept sequence at the bytes its caches hold: runtime/prefix_cache.py EntryBytes), and
    for linear-attention families what one resume point of a sequence holds on the rank holding the most
    (models/cache.py keeps at most LinearAttentionState.points_max per sequence, memory.POINTS_MAX, counted
    in each live sequence's KV cache with the flag). Empty for other families without the flag."""
    gb, arch = plan.hardware.prefix_cache_gb, plan.arch
    point, layers = max(((arch.linear_state_bytes(r.start, r.end, plan.precision.dtype_bytes),
                          sum(c.kind == "linear_attention" for c in (arch.kv_layers or [])[r.start:r.end]))
                         for r in plan.ranks), default=(0, 0))
    if not gb and not point:
        return ""
    text = (f"prefix cache (--prefix-cache-gb {gb:g}): up to {gb:g} GB per rank, counted in each rank's memory"
            if gb else "prefix cache: none counted (serve's --prefix-cache-gb defaults to 4: give it to plan)")
    if point:
        text += (f"; a kept point: {size(point)} per rank (linear states of {layers} layers, recurrent memory in "
                 f"float32), up to {POINTS_MAX} per sequence while its prompt runs"
                 + (", counted in its KV cache" if gb else ""))
    return text


def format_layouts(layouts: list[Layout], host: HostTerms, link: LinkTerms, context: int,
                   chosen: int | None = None, measured: Measurement | None = None, dtype: str = "") -> str:
    """The layouts table (every stages x T of the hosts), or with `chosen` (--tensor-parallel T) that
    layout's lines; a published figure of the same run beside its prediction."""
    rows = [lay for lay in layouts if chosen is None or lay.tensor_parallel == chosen]
    batch = rows[0].batch
    overhead = f" + {host.sum_overhead_us:g} us of the host's own" if host.sum_overhead_us else ""
    hop = f" + {host.hop_overhead_us:g} us of the host's own" if host.hop_overhead_us else ""
    lines = ["", f"layouts, predicted with fitted terms (pipeline/planner/cluster_costs.py): {host.name} reads "
                 f"{100 * host.bandwidth_fraction:.1f}% of --bandwidth-gbs; a group sum of T ranks costs "
                 f"{link.latency_us:g} us + (T-1) x hidden x 4 B at {link.gbs:g} GB/s x {host.link_fraction:.3g} "
                 f"({link.name}){overhead}, 2 per layer; a hop between stages {link.latency_us:g} us + hidden x 4 B "
                 f"at that bandwidth{hop}; a stage's memory is its group's smallest host x T; KV cache for "
                 f"{batch} sequences of {context} tokens"
                 + (f" (with their resume points) + prefix cache {size(kept)} per rank (--prefix-cache-gb)"
                    if (kept := rows[0].ranks[0].prefix_cache) else "")]
    lines.append(f"  {'stages x T':<20}  {'layers per stage':<18}  {'per rank (largest)':>18}  {'fits':>4}  "
                 f"{'1 stream':>12}  {'sums/token':>10}  {f'{batch} streams':>12}")
    for lay in rows:
        largest = max(lay.ranks, key=lambda r: r.total)
        fits = "-" if lay.fits is None else ("yes" if lay.fits else "NO")
        lines.append(f"  {lay.name:<20}  {','.join(map(str, lay.counts)):<18}  {size(largest.total):>18}  {fits:>4}  "
                     f"{lay.single_tps:>6.1f} tok/s  {lay.sums_ms:>7.1f} ms  {lay.batch_tps:>6.1f} tok/s")
        for k, tps in lay.speculative or ():
            lines.append(f"  {'':<20}  speculative, {k} draft{'s' if k > 1 else ''}: 1 stream {tps:.1f} tok/s")
    fitting = [lay for lay in rows if lay.fits is not False]
    if chosen is None and len(fitting) > 1:
        single = max(fitting, key=lambda lay: lay.single_tps)
        batched = max(fitting, key=lambda lay: lay.batch_tps)
        lines.append(f"  best single stream: {single.name}; best {batch}-stream throughput: {batched.name}"
                     + ("" if single.tensor_parallel == 1 else
                        " (the runtime runs --tensor-parallel for the Llama family, Qwen3-MoE, DeepSeek V3/V3.2 "
                        "and Kimi K2, and refuses it for the others by name; measured on CPUs: docs/tensor-parallel.md)"))
    if measured:
        lay = next(lay for lay in rows if lay.tensor_parallel == measured.tensor_parallel)
        lines.append(f"  measured by {measured.who}: {measured.tps:g} tok/s for this model and cluster "
                     f"(T = {measured.tensor_parallel}); predicted {lay.single_tps:.1f} tok/s "
                     f"({100 * (lay.single_tps / measured.tps - 1):+.0f}%)"
                     + (f"; the run held scales and unquantized tensors in bfloat16, this plan counts {dtype}"
                        if dtype and dtype != "bfloat16" else ""))
    return "\n".join(lines)
