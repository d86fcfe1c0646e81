"""`plan`: will a model fit on these hosts, how to split it, how fast (config.json only, no MPI).
The planner itself is pipeline/planner/ (shapes, formats, bytes, the speed model, the report); this
is its command line."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..checkpoints.model_files import find
from ..kernels.build import int8_by_default
from ..planner.calibration import known_measurement
from ..planner.cluster_costs import TERM_SETS
from ..planner.config_files import load_config
from ..planner.host_memory import parse_per_host
from ..planner.memory import GIB, size
from ..planner.layouts import check_tensor_parallel, plan_layouts
from ..planner.report import format_layouts, format_plan
from ..planner.speed import Hardware, plan_cluster
from ..planner.stored_formats import checkpoint_format
from ..planner.weights_bytes import Precision
from ..runtime.settings import MAX_DRAFT_TOKENS, WeightSettings
from ..util.errors import UserError


def add_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="will a model fit on these hosts, how to split it, how fast (config.json only, no MPI)",
        description="From config.json alone (a model folder, a config.json, or a bundled config name such as "
                    "DeepSeek-V3.1 or Kimi-K2-Thinking): each rank's layers, weight and KV cache bytes, "
                    "headroom and whether it fits, and decode tok/s predicted by a stated roofline "
                    "(memory bandwidth per host, link bandwidth and latency per hop).")
    plan.add_argument("--model", required=True,
                      help="model folder, GGUF file (its header only), config.json file, or bundled config name")
    plan.add_argument("--hosts", type=int, default=None, help="hosts, one rank each (default: as many as --host-memory)")
    plan.add_argument("--host-memory", default=None, metavar="GIB,GIB,...",
                      help="memory per host in GiB, e.g. 512,512,256,256: shares proportional to it (the split "
                           "generate --host-memory uses) and a fit verdict; without it, an even split")
    plan.add_argument("--quantize", type=int, choices=[2, 3, 4, 5, 6, 8], default=WeightSettings.quantize,
                      metavar="BITS",
                      help="plan for weights re-quantized to MLX affine BITS (as generate --quantize)")
    plan.add_argument("--group-size", type=int, choices=[32, 64, 128], default=WeightSettings.group_size,
                      help=f"for --quantize (default {WeightSettings.group_size})")
    plan.add_argument("--weights-in-memory", choices=["quantized", "fp32"], default="quantized",
                      help="MLX-quantized weights held packed (default) or dequantized to --dtype, as generate "
                           "--weights-in-memory fp32 (or auto, where memory allows) holds them")
    plan.add_argument("--int8-activations", action=argparse.BooleanOptionalAction,
                      default=WeightSettings.int8_activations,
                      help="plan for int8 products, as generate holds them: 4- and 8-bit matrices repacked "
                           "(float16 scales where the checkpoint stores them so), a tied 4-bit embedding held twice "
                           "on rank 0 (default: as generate decides it on this machine)")
    plan.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=WeightSettings.dtype,
                      help="activation dtype, which unquantized weights and the KV cache are held in "
                           f"(default {WeightSettings.dtype}, as generate)")
    plan.add_argument("--context", type=int, default=None,
                      help="tokens per sequence for the KV cache (default 8192, or the model's context if shorter)")
    plan.add_argument("--batch", type=int, default=None,
                      help="sequences decoded together (default: one per host, which fills the pipeline)")
    plan.add_argument("--bandwidth-gbs", default="819",
                      help="memory bandwidth per host in GB/s, one value or one per host (default 819: M3 Ultra)")
    plan.add_argument("--link-gbs", default="5",
                      help="link bandwidth per hop in GB/s (default 5: Thunderbolt 5, in practice)")
    plan.add_argument("--link-latency-us", type=float, default=100.0,
                      help="latency per hop in microseconds (default 100: MPI over TCP on a Thunderbolt bridge; "
                           "about 10 with RDMA)")
    plan.add_argument("--tflops", default=None,
                      help="compute per host in TFLOPS (one value or one per host) to cap large batches; "
                           "default: not modelled")
    plan.add_argument("--draft-acceptance", type=float, default=None, metavar="A",
                      help="also predict single-stream speculative decoding (generate --draft) with this chance that "
                           "each drafted token is accepted, e.g. 0.85")
    plan.add_argument("--draft-tokens", type=int, action="append", default=None, metavar="K",
                      help="drafted tokens per trip for that prediction; repeat for several (default: 1 and 2)")
    plan.add_argument("--tensor-parallel", type=int, default=None, metavar="T",
                      help="plan stages of T consecutive ranks each (ranks = stages x T; T must divide the hosts; "
                           "T = hosts is pure tensor parallelism): each rank of a stage holds 1/T of its layers' "
                           "split parts (heads, MLPs, every expert sliced, the LM head) plus the parts every rank "
                           "holds whole (MLA's latent projections and KV cache, V4's shared KV head and compressors, "
                           "routers, indexers, norms, the embedding); a stage's memory is its group's smallest host "
                           "times T. Prints that layout's prediction; without it a multi-host plan prints every "
                           "layout. Planned only: generate, batch and serve do not run it yet (issue 34)")
    plan.add_argument("--cluster-terms", choices=sorted(TERM_SETS), default="m3-ultra-rdma", metavar="TERMS",
                      help="the fitted host and link terms the layouts are predicted with "
                           "(pipeline/planner/cluster_costs.py): m3-ultra-rdma (MLX on M3 Ultra, Thunderbolt 5 RDMA; "
                           "fitted on exo's published runs) or linux-tcp (CPU ranks, TCP over 10 Gigabit Ethernet; "
                           "not yet fitted). Default m3-ultra-rdma")
    plan.add_argument("--reserve-gb", type=float, default=0.0,
                      help="GiB per host to keep free for the OS and activations when judging the fit (default 0)")
    plan.add_argument("--prefix-cache-gb", type=float, default=0.0, metavar="GB",
                      help="the job's --prefix-cache-gb (serve's default is 4, batch's 0): each rank's prefix cache "
                           "may hold up to this, counted in its memory (default: 0, none)")


def run(args: argparse.Namespace, comm=None) -> int:
    config = load_config(args.model)
    hosts = args.hosts
    memory = None
    if args.host_memory is not None:
        memory = parse_per_host(args.host_memory, "--host-memory", hosts)
        hosts = hosts or len(memory)
    if hosts is None:
        raise UserError("plan: give --hosts N or --host-memory with one value per host")
    if hosts < 1:
        raise UserError(f"--hosts must be >= 1, got {hosts}")
    hardware = Hardware(
        memory_gib=memory,
        bandwidth_gbs=parse_per_host(args.bandwidth_gbs, "--bandwidth-gbs", hosts, allow_one=True),
        link_gbs=parse_per_host(args.link_gbs, "--link-gbs", 1)[0],
        link_latency_us=_non_negative(args.link_latency_us, "--link-latency-us"),
        tflops=parse_per_host(args.tflops, "--tflops", hosts, allow_one=True) if args.tflops else None,
        reserve_gib=_non_negative(args.reserve_gb, "--reserve-gb"),
        prefix_cache_gb=_non_negative(args.prefix_cache_gb, "--prefix-cache-gb"),
    )
    precision = Precision(checkpoint_format(config, find(args.model), args.quantize, args.group_size), args.dtype,
                          args.quantize, args.group_size,
                          dense=args.weights_in_memory == "fp32",
                          int8=int8_by_default(args.int8_activations, args.dtype))  # as generate resolves it here
    acceptance = args.draft_acceptance
    if acceptance is not None and not 0 <= acceptance <= 1:
        raise UserError(f"--draft-acceptance must be in [0, 1], got {acceptance}")
    drafts = args.draft_tokens or ([1, 2] if acceptance is not None else [])
    if any(not 1 <= k <= MAX_DRAFT_TOKENS for k in drafts):
        raise UserError(f"--draft-tokens must be from 1 to {MAX_DRAFT_TOKENS}, got {drafts}")
    t = args.tensor_parallel
    if t is not None:
        check_tensor_parallel(t, hosts)
    plan = plan_cluster(config, hosts, precision, hardware, args.context, args.batch, drafts,
                        0.0 if acceptance is None else acceptance)
    title = Path(str(args.model)).name.removesuffix(".json") or str(args.model)
    print(format_plan(plan, title), flush=True)
    if hosts > 1 or t is not None:
        host_terms, link_terms = TERM_SETS[args.cluster_terms]
        layouts = plan_layouts(plan.arch, precision, hardware.bandwidth_gbs, memory, host_terms, link_terms,
                               plan.context, args.batch or 16, drafts, 0.0 if acceptance is None else acceptance,
                               hardware.prefix_cache_gb)
        measured = None
        if args.cluster_terms == "m3-ultra-rdma":  # the published runs are MLX's on M3 Ultras over RDMA
            measured = known_measurement(title, memory, args.quantize, t or hosts)
        print(format_layouts(layouts, host_terms, link_terms, plan.context, t, measured, args.dtype), flush=True)
        chosen = next((lay for lay in layouts if lay.tensor_parallel == t), None)
        if chosen is not None and chosen.fits is False:
            short = [f"stage {s} needs {size(r.total)} per rank of {m:g} GiB"
                     for s, (r, m) in enumerate(zip(chosen.ranks, chosen.stage_memory_gib)) if r.total > m * GIB]
            raise UserError(f"the model does not fit as {chosen.name}: {'; '.join(short)}; try another "
                            f"--tensor-parallel, more memory, or fewer bytes (--quantize 4)")
        if chosen is not None:
            return 0
    if plan.fits is False:
        short = [f"rank {r.rank} needs {size(r.needed)} of {r.memory_gib:g} GiB" for r in plan.ranks if not r.fits]
        raise UserError(f"the model does not fit: {'; '.join(short)}"
                        + (f" (with --reserve-gb {hardware.reserve_gib:g})" if hardware.reserve_gib else "")
                        + (f" (with --prefix-cache-gb {hardware.prefix_cache_gb:g})" if hardware.prefix_cache_gb else "")
                        + "; add hosts or memory, or hold the weights in fewer bytes (--dtype bfloat16, --quantize 4)")
    return 0


def _non_negative(value: float, flag: str) -> float:
    if not (value >= 0 and math.isfinite(value)):
        raise UserError(f"{flag} must be a finite number >= 0, got {value}")
    return value
