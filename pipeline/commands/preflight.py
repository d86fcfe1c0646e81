"""`python -m pipeline preflight`: check every rank's host before committing to a long job.

Run it under mpiexec exactly like the job (same hostfile, same number of ranks, same --model,
--split and --dtype). Every rank reports what it has; rank 0 compares them all against rank 0
(or, if rank 0 lacks the model, the first rank that has it), prints one table on stdout and one
`problem:` line per thing wrong on stderr, and every rank exits 1 if there was any:

- Python (major.minor) or a package version (pipeline, mlx, mpi4py, numpy, tokenizers, jinja2)
  differs from the reference rank's;
- the model folder is missing, or unreadable, on a rank;
- a file is missing, extra, or of another size than on the reference rank; config.json differs
  (sha256);
- the rank's free memory is below what its slice of the layers needs: its weights as they will
  be held (floats in --dtype, --quantize applied as the loader applies it, MLX-quantized weights
  packed or dequantized as --weights-in-memory decides, auto included, from every host's free
  memory) plus the KV cache of --context tokens (a linear layer's fixed state per sequence) and
  --prefix-cache-gb (serve's prefix cache), and 10% on top for activations. The count is the
  planner's (memory.py), the one `plan` and the stats line print. Slices are split, and free
  memory read, by the job's own functions (layer_split.split_layers, weights_in_memory.available_memory_bytes),
  --int8-activations resolved over every rank as the job resolves it (job.resolve_int8).
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import socket
import sys
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

from .. import __version__
from ..checkpoints.gguf_file import open_gguf
from ..checkpoints.model_files import find, locate
from ..checkpoints.tensor_names import layer_nbytes
from ..checkpoints.weights_in_memory import available_memory_bytes, is_quantized
from ..kernels import build
from ..planner.layer_split import SplitWeights, split_layers
from ..planner.memory import DTYPE_LABEL, RankBytes, kv_layer_bytes, live_points, rank_bytes, size
from ..planner.partition import layer_ranges
from ..planner.shapes import architecture
from ..planner.weights_bytes import DTYPE_BYTES, ModelBytes, held_and_dense, with_mtp
from ..runtime.settings import DRAFT_CHOICES, WeightSettings
from ..util.errors import UserError
from .flags import add_tensor_parallel_arg, add_weights_args, weight_settings

PACKAGES = ("pipeline", "mlx", "mpi4py", "numpy", "tokenizers", "jinja2")
HEADROOM = 1.10  # caches and activations on top of the weights


@dataclass
class RankReport:
    """What one rank has (collect), sent to rank 0 (evaluate)."""
    rank: int
    host: str
    python: str
    packages: dict[str, str]
    mpi_library: str
    available: int | None  # bytes of memory free for this job, as the job reads it; None if unknown
    metal_limit: int | None  # macOS: the GPU's recommended working-set size
    folder: str
    folder_error: str | None = None
    files: dict[str, int] = field(default_factory=dict)  # name -> size in bytes
    config_sha256: str | None = None
    num_layers: int = 0
    held: ModelBytes | None = None  # the model's bytes in memory, MLX-quantized weights packed
    dense_held: ModelBytes | None = None  # the same with them dequantized (--weights-in-memory)
    quantized: bool = False  # the checkpoint has MLX-quantized weights
    dtype: str = "float32"  # --dtype: unquantized (and dequantized) weights are held in it
    fast_quantized: bool = False  # this rank will multiply quantized weights with pipeline's kernels (qmm.py)
    kv_layer_bytes: list[int] = field(default_factory=list)  # per layer, for --context tokens
    disk_layer_bytes: list[int] = field(default_factory=list)  # per layer as stored: the default split balances them
    disk_ends_bytes: int = 0  # embedding, final norm, LM head (+ the MTP module with --draft mtp) as stored
    tensor_parallel: int = 1  # --tensor-parallel T: this rank's stage is a group of T
    layer_fraction: float = 1.0  # under it, the fraction of each layer's weights this rank holds
    kv_fraction: float = 1.0  # and of each layer's KV cache
    layer_fractions: list[float] = field(default_factory=list)  # per layer where they differ (MLA: dense/MoE layers)
    prefix_cache: int = 0  # --prefix-cache-gb in bytes: the most this rank's prefix cache may hold
    # --tensor-parallel, stage 0's group: the LM head's rows (vocabulary entries) this rank computes
    # (models/vocab_split.py), of vocab_size; head_trimmed (packed, dense): whether rank 0 then holds only
    # its rows of the head's matrix (an untied lm_head, or a tied embedding's int8 copy; a tied embedding
    # stays whole, tokens are looked up in it)
    vocab_rows: int = 0
    vocab_size: int = 0
    head_trimmed: tuple[bool, bool] = (False, False)
    slice_bytes: tuple[int, int] = (0, 0)  # (packed, dense): a mate's slice as held (a Linear: int8-repacked where it can be)


def add_parser(commands) -> None:
    pre = commands.add_parser("preflight", help="check every rank's host before a long job",
                              description="Run under mpiexec with the job's hostfile and rank count: every "
                                          "rank reports its host, Python and package versions, the model "
                                          "folder (files, sizes, config.json hash) and free memory against "
                                          "what its slice of the model needs. Rank 0 prints one table; the "
                                          "exit status is 1 if anything is wrong, naming each problem.")
    pre.add_argument("--model", type=Path, default=None, help="model folder (default: the default model)")
    add_weights_args(pre)
    pre.add_argument("--context", type=int, default=None, metavar="TOKENS",
                     help="tokens the job keeps in its KV cache, all sequences together (default: the "
                          "model's context, at most 8192)")
    add_tensor_parallel_arg(pre)
    pre.add_argument("--draft", choices=DRAFT_CHOICES, default=WeightSettings.draft,
                     help="the job's --draft: with mtp, rank 0 also holds DeepSeek's multi-token-prediction module")
    pre.add_argument("--prefix-cache-gb", type=float, default=0.0, metavar="GB",
                     help="the job's --prefix-cache-gb (serve's default is 4): each rank's prefix cache may hold "
                          "up to this, counted in what its slice needs (default: 0, none)")


def run(args: argparse.Namespace, comm) -> int:
    report = collect(args, comm)
    reports = comm.gather(report, root=0)
    problems: list[str] = []
    if comm.Get_rank() == 0:
        table, problems = evaluate(reports, args.split, args.weights_in_memory)
        print(table, flush=True)
        for problem in problems:
            print(f"problem: {problem}", file=sys.stderr)
        if problems:
            print(f"preflight: {len(problems)} problem{'s' if len(problems) != 1 else ''} on "
                  f"{len(reports)} ranks: fix them before starting the job", file=sys.stderr, flush=True)
        else:
            print(f"preflight: all {len(reports)} ranks ready", file=sys.stderr, flush=True)
    return 1 if comm.bcast(bool(problems), root=0) else 0


def collect(args: argparse.Namespace, comm) -> RankReport:
    """What this rank has: host, versions, model files, memory."""
    from mpi4py import MPI  # here, not at the top: after cli binds the launcher's MPI (mpi.use_the_launchers_mpi)

    # This loads MLX, which `plan` (its parser built with this module's) must not
    from ..runtime.job import resolve_int8

    int8 = resolve_int8(args.int8_activations, args.dtype, comm)  # collective, as the job asks it
    folder, error = model_folder(args.model, comm)
    report = RankReport(
        rank=comm.Get_rank(), host=socket.gethostname(), python=platform.python_version(),
        packages={name: package_version(name) for name in PACKAGES},
        mpi_library=" ".join(MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
                             .replace("Version:", "").split())[:40],
        available=available_memory_bytes(), metal_limit=metal_working_set(), folder=str(folder))
    try:
        if error:
            raise UserError(error)
        list_model_files(report, folder)
        measure_model(report, folder, args, int8)
    except UserError as e:
        report.folder_error = str(e)
    return report


def model_folder(model: Path | None, comm) -> tuple[Path, str | None]:
    """--model, or the default model's folder (collective); and why there is none, if so."""
    if model is not None:
        return model, None
    from ..runtime.job import resolve_model_folder  # loads MLX, as in collect

    try:
        return resolve_model_folder(None, comm), None
    except UserError as e:
        return Path("(default model)"), str(e)


def list_model_files(report: RankReport, folder: Path) -> None:
    """The model's files and sizes, and the sha256 of its config.json; of a GGUF (split set), its
    parts, and of the first part's header (metadata and tensor table) in place of config.json's.
    No tensor data is read."""
    model = find(folder)
    if model is None:
        raise UserError(f"model folder {folder} does not exist")
    if model.format == "gguf":
        gguf = open_gguf(model.path)
        report.files = {p.name: p.stat().st_size for p in gguf.parts}
        with open(gguf.parts[0], "rb") as f:
            report.config_sha256 = hashlib.sha256(f.read(gguf.header_bytes[gguf.parts[0]])).hexdigest()
        return
    report.files = {p.name: p.stat().st_size for p in sorted(folder.iterdir())
                    if p.is_file() and not p.name.startswith(".")}
    config = folder / "config.json"
    if config.is_file():
        report.config_sha256 = hashlib.sha256(config.read_bytes()).hexdigest()


def measure_model(report: RankReport, folder: Path, args: argparse.Namespace, int8: bool) -> None:
    """The model's bytes as stored and as held (int8: --int8-activations as the job resolves it)."""
    checkpoint = locate(folder).open(weight_settings(args).requantize)
    config = checkpoint.model_config()
    report.num_layers = config.num_hidden_layers
    report.disk_layer_bytes, report.disk_ends_bytes = layer_nbytes(checkpoint, config.num_hidden_layers)
    report.held, report.dense_held = held_and_dense(config, folder, args.dtype, args.quantize, args.group_size,
                                                    int8=int8)
    if args.draft == "mtp":  # the module on rank 0, as job.plan_job counts it
        from ..models.mtp import check_mtp, mtp_nbytes  # loads MLX, as in collect

        check_mtp(checkpoint, config, folder)
        report.disk_ends_bytes += mtp_nbytes(checkpoint, config)
        report.held, report.dense_held = with_mtp(report.held), with_mtp(report.dense_held)
    report.quantized, report.dtype = is_quantized(checkpoint), args.dtype
    if 1 < args.tensor_parallel and report.rank < args.tensor_parallel:  # stage 0's group: the head split by vocabulary
        head_split_bytes(report, config, folder, args, int8)
    report.fast_quantized = args.dtype == "float32" and build.expected()  # as job.plan_job asks every rank
    context = args.context or min(8192, config.max_position_embeddings)
    if context < 1:
        raise UserError(f"--context must be >= 1, got {context}")
    if not (args.prefix_cache_gb >= 0 and args.prefix_cache_gb != float("inf")):
        raise UserError(f"--prefix-cache-gb must be a finite number >= 0, got {args.prefix_cache_gb:g}")
    # (with a prefix cache, the sequence also keeps its resume points: Qwen3.5's linear states, as plan counts them)
    report.kv_layer_bytes = kv_layer_bytes(architecture(config), DTYPE_BYTES[args.dtype], context,
                                           points=live_points(args.prefix_cache_gb))
    report.prefix_cache = round(args.prefix_cache_gb * 1e9)
    t = report.tensor_parallel = args.tensor_parallel
    if t > 1:  # each rank of a stage holds a share of each of its layers (rank 0 the ends too)
        from ..models.registry import family_for  # as the MTP import above: where used
        from ..models.tensor_parallel import MLA_TOOLS, Shard, check_family, share_fractions  # loads MLX, as in collect
        from ..models import tensor_parallel_mla as mla  # as the line above

        check_family(config, family_for(config).module_name, t)
        check_block_edges(checkpoint, config, t, args.expert_parallel, weight_settings(args).requantize)
        report.layer_fraction, report.kv_fraction = share_fractions(config, Shard(report.rank % t, t,
                                                                          args.expert_parallel))
        if mla.is_mla_family(config):  # MLA's layers: the replicated latents weigh differently in dense and MoE ones
            report.layer_fractions = mla.layer_fractions(config, Shard(report.rank % t, t), MLA_TOOLS)


def check_block_edges(checkpoint, config, t: int, experts: bool, requantize) -> None:
    """The line the load would stop at (tensor_parallel.check_block_cuts), from the index: a matrix cut by its input
    columns (o_proj, down_proj, experts' down_proj) whose held blocks a group of `t` would cut."""
    from ..checkpoints.share_reads import held_block  # loads MLX, as the imports in measure_model
    from ..models.tensor_parallel import Shard, block_cut_problem, column_cuts  # as the line above

    group = requantize.group_size if requantize else None
    for module, stored in (("self_attn.o_proj", "self_attn.o_proj"), ("mlp.down_proj", "mlp.down_proj"),
                           ("mlp.switch_mlp.down_proj", "mlp.switch_mlp.down_proj"),
                           ("mlp.switch_mlp.down_proj", "mlp.experts.0.down_proj"),
                           ("mlp.shared_experts.down_proj", "mlp.shared_experts.down_proj")):
        names = [f"model.layers.{i}.{stored}.weight" for i in range(config.num_hidden_layers)]
        names = [name for name in names if name in checkpoint.tensors]
        cuts = column_cuts(module, config, t, experts) if names else None  # the same for every layer
        for name in names if cuts else ():
            held = held_block(checkpoint, name, cuts[0], group)
            problem = held and block_cut_problem(module, cuts, held[0], config, Shard(0, t, experts), held[1])
            if problem:
                raise UserError(problem)


def evaluate(reports: list[RankReport], split: str | None, weights_in_memory: str = "quantized") -> tuple[str, list[str]]:
    """Rank 0: the table, and one line per problem."""
    who = {r.rank: f"rank {r.rank} ({r.host})" for r in reports}
    with_model = [r for r in reports if not r.folder_error]
    ref = with_model[0] if with_model else None
    problems = [f"{who[r.rank]}: {r.folder_error}" for r in reports if r.folder_error]
    problems += version_problems(reports, who)
    if ref is not None:
        problems += [problem for r in with_model if r is not ref for problem in model_problems(r, ref, who[r.rank])]
    slices: list[Slice] | None = None
    if ref is not None:
        try:
            slices = plan_slices(reports, ref, split, weights_in_memory)
        except UserError as e:
            problems.append(str(e))
    rows = []
    for r in reports:
        piece = slices[r.rank] if slices else None
        if piece is not None:
            problems += memory_problems(r, piece, who[r.rank])
        mine = [p for p in problems if p.startswith(who[r.rank] + ":")]
        rows.append(table_row(r, piece, mine))
    header = ["rank", "host", "python", "mlx", "mpi4py", "MPI", "model", "config sha256", "layers",
              "weights", "KV cache", "needs", "free", "status"]
    problems.sort(key=lambda p: int(p.split()[1]) if p.startswith("rank ") else -1)
    return _table(header, rows), problems


def version_problems(reports: list[RankReport], who: dict[int, str]) -> list[str]:
    """Python (major.minor) or a package version that differs from rank 0's."""
    base, problems = reports[0], []
    for r in reports[1:]:
        if r.python.split(".")[:2] != base.python.split(".")[:2]:
            problems.append(f"{who[r.rank]}: Python {r.python}, rank 0 has {base.python}")
        problems += [f"{who[r.rank]}: {name} {r.packages[name]}, rank 0 has {base.packages[name]}"
                     for name in PACKAGES if r.packages[name] != base.packages[name]]
    return problems


def model_problems(r: RankReport, ref: RankReport, who: str) -> list[str]:
    """A file missing, extra or of another size than on the reference rank; another config.json."""
    problems = []
    for name in sorted(set(ref.files) | set(r.files)):
        if name not in r.files:
            problems.append(f"{who}: {name} is missing from {r.folder} (rank {ref.rank} has it)")
        elif name not in ref.files:
            problems.append(f"{who}: {name} in {r.folder} is not on rank {ref.rank}")
        elif r.files[name] != ref.files[name]:
            problems.append(f"{who}: {name} is {r.files[name]:,} bytes, {ref.files[name]:,} on rank {ref.rank}: "
                            f"copy it again")
    if r.config_sha256 != ref.config_sha256:
        problems.append(f"{who}: config.json differs from rank {ref.rank}'s "
                        f"(sha256 {str(r.config_sha256)[:12]} vs {str(ref.config_sha256)[:12]})")
    return problems


def head_split_bytes(report: RankReport, config, folder: Path, args: argparse.Namespace, int8: bool) -> None:
    """What a member of stage 0's group holds of the LM head split by vocabulary (RankReport.vocab_rows)."""
    from ..models.vocab_split import vocab_share  # loads MLX, as in collect
    from ..planner.weights_bytes import Precision, checkpoint_format, find  # as the line above: where used

    t = args.tensor_parallel
    begin, end = vocab_share(config.vocab_size, t, report.rank % t)
    report.vocab_rows, report.vocab_size = end - begin, config.vocab_size
    if not config.tie_word_embeddings:
        report.head_trimmed = (True, True)
        return
    stored = checkpoint_format(config, find(folder), args.quantize, args.group_size)
    embedding = next(p for p in architecture(config).ends if p.is_embedding)
    precisions = [Precision(stored, args.dtype, args.quantize, args.group_size, dense, int8) for dense in (False, True)]
    report.head_trimmed = tuple(p.int8_head_copy(embedding) > 0 for p in precisions)
    if report.rank % t:  # a mate holds its rows of the tied embedding as a Linear, repacked as one is
        report.slice_bytes = tuple(tied_slice_bytes(p, stored, embedding, end - begin) for p in precisions)


def tied_slice_bytes(precision, stored, embedding, rows: int) -> int:
    """Bytes of `rows` rows of a tied embedding held as a Linear (a mate's head slice): as the embedding's,
    but int8-repacked (float16 scales where stored so, no biases where symmetric) where --int8-activations
    repacks a matrix of its bits."""
    from ..planner.stored_formats import affine_bytes  # as the imports above: where used

    native = stored.native(embedding)
    if not native or precision.dense or stored.held_in_blocks(embedding):
        return precision.resident_bytes(embedding) // embedding.shape[0] * rows
    repacked = precision.int8_repacked(embedding, native[0])
    half = repacked and stored.half_scales(embedding)
    return affine_bytes((rows, embedding.shape[1]), *native, 2 if half else precision.dtype_bytes,
                        biases=not (repacked and stored.symmetric(embedding)))


@dataclass
class Slice:
    """One rank's part of the job: its layers, and what it holds of them."""
    start: int
    end: int
    held: RankBytes  # weights as held + KV cache for --context tokens
    need: int  # bytes, with HEADROOM


def plan_slices(reports: list[RankReport], ref: RankReport, split: str | None, weights_in_memory: str) -> list[Slice]:
    """Each rank's slice, split as the job splits it (layer_split.split_layers), from the reference
    rank's model and every rank's free memory; UserError if --split does not fit the job."""
    t = ref.tensor_parallel  # --tensor-parallel: the split is over stages of t ranks
    if len(reports) % t:
        raise UserError(f"--tensor-parallel {t} must divide the {len(reports)} ranks (ranks = stages x T)")
    ranks = len(reports) // t
    choice = (ref.held, ref.dense_held) if ref.quantized else (None, None)  # --weights-in-memory's
    weights = SplitWeights(ref.disk_layer_bytes, ref.disk_ends_bytes, *choice)
    memory = [(r.host, r.available) for r in reports]  # unknown (None): no room, to the split as to the job
    fast = [r.fast_quantized for r in reports]
    if t > 1:  # a stage's memory: its group's smallest host times t
        memory = [(memory[s * t][0], None if any(a is None for _, a in memory[s * t:s * t + t])
                   else t * min(a for _, a in memory[s * t:s * t + t])) for s in range(ranks)]
        fast = [all(fast[s * t:s * t + t]) for s in range(ranks)]
    counts, dense = split_layers(weights, ranks, split, weights_in_memory, memory, fast_quantized=fast)
    slices = []
    for rank, r in enumerate(reports):
        stage = rank // t
        start, end = layer_ranges(counts)[stage]
        mb = ref.dense_held if dense[stage] else ref.held
        held_as = "quantized" if ref.quantized and not dense[stage] else DTYPE_LABEL[ref.dtype]
        held = rank_bytes(mb.layers, mb.ends, ref.kv_layer_bytes, (start, end), stage, ranks, held_as=held_as,
                          prefix_cache=ref.prefix_cache)
        if t > 1:  # a share of each layer, the ends on rank 0 only
            ends = mb.ends if rank == 0 else 0
            layers = held.weights - (mb.ends if stage == 0 else 0)
            share = (round(sum(mb.layers[i] * r.layer_fractions[i] for i in range(start, end))) if r.layer_fractions
                     else round(layers * r.layer_fraction))
            held = replace(held, weights=share + ends,
                           kv_cache=round(held.kv_cache * r.kv_fraction))
        if t > 1 and r.vocab_rows:  # stage 0's group: the LM head split by vocabulary (models/vocab_split.py)
            per_row = mb.head // r.vocab_size
            if rank == 0:  # its own rows only, where it does not hold the whole head anyway (a tied embedding)
                trimmed = per_row * (r.vocab_size - r.vocab_rows) if r.head_trimmed[bool(dense[stage])] else 0
                held = replace(held, weights=held.weights - trimmed)
            else:  # its slice, as the stats line's "LM head share"
                held = replace(held, head_share=r.slice_bytes[bool(dense[stage])] or per_row * r.vocab_rows)
        slices.append(Slice(start, end, held, int(held.total * HEADROOM)))
    return slices


def memory_problems(r: RankReport, piece: Slice, who: str) -> list[str]:
    """The rank's slice needs more memory than it has free, or than the GPU may wire."""
    problems = []
    if r.available is not None and piece.need > r.available:
        problems.append(f"{who}: its slice (layers {piece.start}-{piece.end - 1}) needs {size(piece.need)} "
                        f"({piece.held.describe()}, +10%) but only {size(r.available)} of memory is free: add a "
                        f"host, or move layers off it with --split")
    if r.metal_limit is not None and piece.need > r.metal_limit:
        problems.append(f"{who}: its slice needs {size(piece.need)} but the GPU may wire only "
                        f"{size(r.metal_limit)}: raise it with `sudo sysctl iogpu.wired_limit_mb=N` "
                        f"(see docs/thunderbolt.md)")
    return problems


def table_row(r: RankReport, piece: Slice | None, mine: list[str]) -> list:
    return [
        r.rank, r.host, r.python, r.packages["mlx"], r.packages["mpi4py"], r.mpi_library,
        "missing" if r.folder_error else f"{len(r.files)} files, {size(sum(r.files.values()))}",
        (r.config_sha256 or "-")[:12],
        f"{piece.start}-{piece.end - 1}" if piece else "-",
        f"{size(piece.held.weights)} {piece.held.held_as}" if piece else "-",
        size(piece.held.kv_cache) if piece else "-",
        size(piece.need) if piece else "-",
        size(r.available) if r.available is not None else "unknown",
        "OK" if not mine else f"{len(mine)} problem{'s' if len(mine) > 1 else ''}",
    ]


def package_version(name: str) -> str:
    if name == "pipeline":
        return __version__
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


def metal_working_set() -> int | None:
    try:
        import mlx.core as mx  # here, not at the top: `pipeline plan` builds its parser with this module, without MLX

        if not mx.metal.is_available():
            return None
        info = mx.metal.device_info() if hasattr(mx.metal, "device_info") else mx.device_info()
        return int(info["max_recommended_working_set_size"])
    except Exception:
        return None


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)
