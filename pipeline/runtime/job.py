"""A multi-rank job's set-up, shared by the commands that run a model (generate, batch, serve):
the model folder, the split of its layers over the ranks, and the transport between them (the
figures every rank reports at the end are rank_figures.py's). Each step that can fail on a user's
input runs as a collective checkpoint, so every rank learns of a failure anywhere."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx

from ..checkpoints.default_model import default_model_dir
from ..checkpoints.int8_repack import use_int8
from ..checkpoints.model_files import locate
from ..checkpoints.mtp import load_mtp
from ..checkpoints.safetensors_checkpoint import Checkpoint
from ..checkpoints.tensor_names import layer_nbytes
from ..checkpoints.weights_in_memory import available_memory_bytes, is_quantized
from ..cluster import mpi
from ..cluster.transport import MlxTransport, MpiTransport, this_process
from ..kernels import blas, build, qmm
from ..kernels.int8_layout import INT8_BLOCK
from ..models.config import ModelConfig
from ..models.mtp import check_mtp, mtp_nbytes
from ..models.registry import family_for
from ..models.tensor_parallel import Shard, check_family, head_share, share_fractions
from ..models.tensor_parallel_mla import is_mla_family
from ..models.vocab_split import vocab_share
from ..planner.host_memory import MemoryPlan
from ..planner.layer_split import SplitWeights, split_layers
from ..planner.partition import layer_ranges
from ..planner.shapes import architecture
from ..planner.weights_bytes import held_and_dense, with_mtp
from ..util import cores, huge_pages
from ..util.errors import UserError
from ..util.switches import turned_off
from .head_share import HeadSplit, head_share_fraction, head_share_rows
from .prefix_cache import StoredIndex
from .prefix_cache import for_job as prefix_cache_for
from .prompt_cache_store import PromptCacheStore, entry_key, model_identity
from .scheduler import exact_group_rows
from .settings import JobSettings, RingSettings, TransportSettings, WeightSettings
from .stage import Stage
from .tensor_group import Group, LeaderStage, SplitHead, form_group


@dataclass
class Plan:
    folder: Path
    config: ModelConfig
    checkpoint: Checkpoint
    ranges: list[tuple[int, int]]
    dense: list[bool] | None = None  # per rank: MLX-quantized weights dequantized at load
    host_memory: MemoryPlan | None = None  # generate --host-memory: the planner's split and fit check
    int8: bool = False  # --int8-activations as every rank resolved it (resolve_int8)


def resolve_model_folder(model: Path | None, comm) -> Path:
    """The --model folder, or the default model (converted once per host: the first rank on
    each host converts while the others on that host wait, then all reuse the cache)."""
    if model is not None:
        return model
    from mpi4py import MPI  # here, not at the top: after cli binds the launcher's MPI (mpi.use_the_launchers_mpi)

    host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
    error = None
    if host_comm.Get_rank() == 0:
        try:
            default_model_dir(progress=comm.Get_rank() == 0)
        except UserError as e:
            error = e
    host_comm.Barrier()
    host_comm.Free()
    if error:
        raise error
    return default_model_dir(progress=False)


def resolve_int8(flag: bool | None, dtype: str, comm) -> bool:
    """--int8-activations for the job (collective where not given): on by default where every
    rank can (build.int8_by_default)."""
    if flag is None:
        return all(comm.allgather(build.int8_by_default(None, dtype)))
    return flag


def plan_job(settings: WeightSettings, comm, last_rank_head: float = 0.0) -> Plan:
    """Read the model's config and tensor index and split its layers over the ranks.
    Every rank computes the same plan from the same files. last_rank_head: the part of the LM head
    the last rank holds besides its layers (batch, head_share.py), counted in its memory."""
    mode = settings.weights_in_memory
    # Collective, so before anything that can fail on one rank only.
    int8 = resolve_int8(settings.int8_activations, settings.dtype, comm)
    memory = fast_quantized = None
    if mode == "auto":
        gathered = comm.allgather((socket.gethostname(), available_memory_bytes(),
                                   settings.dtype == "float32" and build.expected()))
        memory, fast_quantized = [(h, a) for h, a, _ in gathered], [f for _, _, f in gathered]
    folder = resolve_model_folder(settings.model, comm)
    checkpoint = locate(folder).open(settings.requantize)
    config = checkpoint.model_config()
    family = family_for(config)
    if settings.draft != "none" and not family.drafts:
        raise UserError(f"{config.model_type} keeps {family.kept_state} that cannot drop a rejected draft's "
                        f"positions: run it without --draft")
    if settings.draft == "mtp":
        check_mtp(checkpoint, config, folder)
    t = settings.tensor_parallel  # stages of t ranks: the split speaks of stages (a stage's memory: its smallest x t)
    ranks = comm.Get_size() // t
    if t > 1:
        check_family(config, family.module_name, t)
        if memory is not None:
            memory = [(memory[s * t][0], t * min(a for _, a in memory[s * t:s * t + t])) for s in range(ranks)]
            fast_quantized = [all(fast_quantized[s * t:s * t + t]) for s in range(ranks)]
    host_memory = None
    if settings.host_memory:
        host_memory = MemoryPlan.for_job(config, settings.host_memory, ranks, folder, settings.dtype, settings.quantize,
                                         settings.group_size, int8, settings.draft == "mtp")
    planned = host_memory.counts() if host_memory and not settings.split else None
    counts, dense = split_layers(split_weights(checkpoint, config, folder, settings, int8), ranks, settings.split, mode,
                                 memory, fast_quantized, planned=planned, last_rank_head=last_rank_head)
    return Plan(folder, config, checkpoint, layer_ranges(counts), dense, host_memory, int8)


def split_weights(checkpoint: Checkpoint, config: ModelConfig, folder: Path, settings: WeightSettings,
                  int8: bool) -> SplitWeights:
    """What the job's split weighs (layer_split.SplitWeights); int8: --int8-activations as resolved (resolve_int8)."""
    stored_layers, stored_ends = layer_nbytes(checkpoint, config.num_hidden_layers)
    if settings.draft == "mtp":  # rank 0 holds the MTP module too
        stored_ends += mtp_nbytes(checkpoint, config)
    if settings.weights_in_memory == "quantized" or not is_quantized(checkpoint):
        return SplitWeights(stored_layers, stored_ends)
    held, dense_held = held_and_dense(config, folder, settings.dtype, int8=int8)
    if settings.draft == "mtp":
        held, dense_held = with_mtp(held), with_mtp(dense_held)
    return SplitWeights(stored_layers, stored_ends, held, dense_held)


def share_cores(comm) -> None:
    """This host's cores shared among its ranks: each bound to its share where the launcher left
    them free, its threads SCHED_BATCH on a single CPU (cores.py), and as many BLAS threads (blas.py)."""
    from mpi4py import MPI  # as in resolve_model_folder

    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    cpus = cores.bind(host)
    blas.note_binding(cores.describe(cpus, batch=cores.schedule_as_batch()))
    blas.set_threads_for_ranks(host.Get_size())
    host.Free()


def load_stage(settings: WeightSettings, plan: Plan, rank: int, progress: bool, head_rows: int = 0,
               group: Group | None = None) -> Stage:
    """This rank's layers of the planned split, held as the weight flags say; on rank 0 with
    --draft mtp, DeepSeek's MTP module too (it reads rank 0's embedding, head and final states).
    group: --tensor-parallel T > 1, this rank's stage group: its share of its stage's layers
    (tensor_group.py); `rank` stays the job's rank."""
    index, shard, group_sum, stage_class, vocab_slice = rank, None, None, Stage, None
    if group is not None and group.size > 1:
        index, shard, group_sum = group.stage, group.shard, group.group_sum
        shard = replace(shard, experts=settings.expert_parallel)  # --expert-parallel (models/expert_parallel.py)
        stage_class = LeaderStage if group.leads else Stage
        if group.stage == 0 and not turned_off(VOCAB_SPLIT):  # stage 0's group splits the LM head by vocabulary
            vocab_slice = vocab_share(plan.config.vocab_size, group.size, group.member)
    dense = bool(plan.dense and plan.dense[index])
    int8 = plan.int8
    # rearranged in the buffers they were read into where those are in huge pages (else the products
    # would walk small pages: 1B Llama decode -5%), into new huge pages otherwise
    in_place = huge_pages.active()
    stage = stage_class.load(plan.config, plan.checkpoint, plan.ranges[index], has_ends=rank == 0,
                             dtype=getattr(mx, settings.dtype), requantize=settings.requantize, progress=progress,
                             dense=dense, head_rows=head_rows, int8_in_place=in_place if int8 else None,
                             shard=shard, group_sum=group_sum,
                             group_choice=group_sum.from_first if group_sum is not None else None,
                             vocab_slice=vocab_slice)
    if stage_class is LeaderStage:
        stage.group = group
    if vocab_slice is not None and rank == 0:
        stage.model.vocab_split = SplitHead(group, plan.config.vocab_size)
    if settings.dtype == "float32":
        build.load()  # the kernels' extension (attention, quantized products): built now, not at the first token
        qmm.set_gguf_int8(bool(int8))  # IQ4 blocks (gguf_kernels.cpp) round activations as the flag says
    if rank == 0 and settings.draft == "mtp":
        stage.mtp = load_mtp(plan.config, plan.checkpoint, getattr(mx, settings.dtype), settings.requantize, dense,
                             progress)
    if int8:  # int8 products (int8_kernels.cpp); none without the kernels
        config = plan.config
        # the last rank's share of the LM head computes as rank 0's head does, or both stay float32
        share = config.vocab_size % INT8_BLOCK == 0 and not (plan.dense and plan.dense[0])
        for module in (stage.model, stage.mtp):  # what was not repacked while loading: the head, MTP
            if module is not None:
                use_int8(module, tied_head=bool(config.tie_word_embeddings), head_share=share, in_place=in_place)
    if vocab_slice is not None and rank == 0:
        keep_own_head_rows(stage.model, vocab_slice[1])
    return stage


VOCAB_SPLIT = "PIPELINE_VOCAB_SPLIT"  # =0: the LM head stays whole on rank 0 under --tensor-parallel (A/B)


def keep_own_head_rows(model, rows: int) -> None:
    """Rank 0 of a vocabulary-split head with a tied embedding: the embedding stays whole (tokens are
    looked up in it), but its int8 copy, which only the head reads, keeps rank 0's rows [0, rows)."""
    embedding = model.get("embed_tokens")
    if embedding is None or "int8_weight" not in embedding:
        return
    for name in ("int8_weight", "int8_scales", "int8_biases"):
        if name in embedding:
            embedding[name] = mx.array(embedding[name][:rows])  # a copy: the rest is freed
    mx.eval(embedding.parameters())


@dataclass
class RingJob:
    """What batch and serve set up before their scheduler starts: the transport, the split, and how
    the ring shares work (exact products, the LM head's share on the last rank, micro-batches)."""
    transport: object
    plan: Plan
    group_rows: int  # rows of different sequences one product may hold on this rank (scheduler.exact_group_rows)
    head_fraction: float  # the part of the LM head the last rank holds (head_share.py)
    head_rows: int
    microbatches: int
    group: Group = field(default_factory=Group)  # --tensor-parallel: this rank's stage group (tensor_group.py)


def plan_ring_job(settings: JobSettings, comm) -> RingJob:
    """Collective: the transport and the plan, before anything big is read."""
    transport_settings = settings.transport
    group = mpi.checkpoint(comm, lambda: form_group(comm, settings.weights.tensor_parallel, transport_settings.transport,
                                                    transport_settings.watchdog))
    transport = make_transport(transport_settings, group.ring) if group.leads else None  # the ring: stage leaders
    group_rows = exact_group_rows(settings.ring.packed_matmuls)  # this rank's own: it depends on its BLAS
    head_fraction = head_share_fraction(settings.ring.head_share, comm.allgather(group_rows))
    if group.size > 1:
        head_fraction = 0.0  # under --tensor-parallel stage 0's group splits the head by vocabulary instead
    plan = mpi.checkpoint(comm, lambda: plan_job(settings.weights, comm, last_rank_head=head_fraction))
    if not family_for(plan.config).head_share:  # DeepSeek V4: the head reads collapsed streams
        head_fraction = 0.0
    size = comm.Get_size() // group.size  # stages
    # Sequences sharing products: one micro-batch per rank, since smaller ones make smaller, less
    # efficient products. Each on its own: twice as many, so a late one never starves a stage (a
    # micro-batch's round trip alone takes as long as the ring needs for N of them).
    microbatches = settings.ring.microbatches or (size if group_rows or size == 1 else 2 * size)
    return RingJob(transport, plan, group_rows, head_fraction, head_share_rows(head_fraction, plan.config.vocab_size),
                   microbatches, group)


def load_ring_stage(settings: JobSettings, job: RingJob, comm, progress: bool) -> Stage:
    """Collective: this rank's layers, and on the last rank its share of the LM head."""
    rank = comm.Get_rank()
    head_rows = job.head_rows if rank == comm.Get_size() - 1 else 0
    stage = mpi.checkpoint(comm, lambda: load_stage(settings.weights, job.plan, rank, progress=progress,
                                                    head_rows=head_rows, group=job.group))
    if settings.ring.prefix_cache_gb and hasattr(stage.model, "keep_points"):
        stage.model.keep_points = True  # Qwen3.5: linear states kept at prompt chunks' ends, to resume from
    return stage


def head_split(settings: RingSettings, job: RingJob):
    """Rank 0's control of the LM head's share (None: not shared)."""
    if not job.head_rows:
        return None
    return HeadSplit(job.head_rows, None if settings.head_share == "auto" else job.head_rows)


def prefix_cache(settings: JobSettings, job: RingJob):
    """Rank 0's prefix cache for --prefix-cache-gb (None when 0): kept sequences up to that many GB on
    the rank whose caches hold the most."""
    gb = settings.ring.prefix_cache_gb
    if not gb or not family_for(job.plan.config).prefix_cache:
        return None
    arch = architecture(job.plan.config)
    linear = [c.kind == "linear_attention" for c in arch.kv_layers or []]
    first, last = job.plan.ranges[0]
    if any(linear) and not any(linear[first:last]):
        return None  # rank 0 reads the resume points from its own linear states: with none, no prefix cache
    # In bytes, each kept sequence as its caches hold it (prefix_cache.EntryBytes: KV caches as grown, a
    # linear layer's states at each resume point, DeepSeek V4's kept points and logs)
    return prefix_cache_for(gb, arch, job.plan.ranges, getattr(mx, settings.weights.dtype).size)


STORED_MIN_POSITIONS = 64  # shorter entries are not worth a file: reading one costs more than computing them


@dataclass
class PromptCache:
    """The prompt cache on disk (--prompt-cache-dir) as one rank holds it."""
    store: PromptCacheStore  # this rank's files
    index: StoredIndex | None  # rank 0: the entries every rank holds
    removed: int = 0  # files of this rank removed at start-up (held by some ranks only, or over the bound)


def prompt_cache(settings: JobSettings, job: RingJob, comm) -> PromptCache | None:
    """Collective: each rank opens its files in --prompt-cache-dir (a folder others may write to is
    refused), reads their headers, and rank 0 indexes the entries that every rank holds with a valid
    header; the other files of this model and split go. None without the flag. Under --tensor-parallel
    each member of a stage's group keeps its own share of every entry (its shard in its files' names and
    its identity), and the bound counts every member's files."""
    ring, plan = settings.ring, job.plan
    if ring.prompt_cache_dir is None:
        return None
    family = family_for(plan.config)
    if not family.prefix_cache:
        raise UserError(f"--prompt-cache-dir: {plan.config.model_type} keeps {family.kept_state} that the prefix "
                        f"cache cannot cut back to a shorter prefix: run it without --prompt-cache-dir")
    rank = comm.Get_rank()
    weights = settings.weights

    def open_store() -> PromptCacheStore:
        if not family.stored_cache:  # (here: a UserError in mpi.checkpoint is one line)
            raise UserError(f"--prompt-cache-dir: the entries on disk do not hold {plan.config.model_type}'s "
                            f"{family.kept_state} yet: run it without --prompt-cache-dir (the prefix cache in "
                            f"memory serves it)")
        identity = model_identity(model_files(plan.folder), {
            "dtype": weights.dtype, "quantize": weights.quantize, "group_size": weights.group_size,
            "int8_activations": plan.int8, **shard_identity(plan.config, job.group)})
        index = job.group.stage if job.group.size > 1 else rank  # the split speaks of stages
        return PromptCacheStore(ring.prompt_cache_dir, identity, plan.ranges[index],
                                (job.group.member, job.group.size))

    store = mpi.checkpoint(comm, open_store)
    held_share = mpi.checkpoint(comm, lambda: kv_held_share(plan.config, job.group.size))
    found = store.scan()
    held = comm.gather({key: entry.positions for key, entry in found.items()}, root=0)
    index, keep = None, None
    if rank == 0:
        arch = architecture(plan.config)
        per_position = arch.kv_values * getattr(mx, weights.dtype).size * plan.config.num_hidden_layers  # all ranks'
        per_position *= held_share  # under --tensor-parallel: every member's share (KV heads held twice, MLA's latent)
        capacity = int(ring.prompt_cache_dir_gb * 1e9 // per_position) if per_position else 0
        per_entry = 4 * sum(c.per_sequence for c in arch.kv_layers or [])  # fixed-size states, float32 at most
        index = StoredIndex(capacity, entry_key, min_positions=STORED_MIN_POSITIONS,
                            point_positions=-(-int(per_entry) // int(per_position)) if per_position else 0)
        complete = [entry for key, entry in found.items()
                    if entry.tokens is not None and all(other.get(key) == entry.positions for other in held)]
        complete.sort(key=lambda entry: entry.last_used)
        index.restore([(entry.key, entry.tokens, entry.points) for entry in complete])
        keep = set(index.index.entries)
    keep = comm.bcast(keep, root=0)
    removed = [key for key in found if key not in keep]
    store.remove(removed)
    store.flush()
    return PromptCache(store, index, len(removed))


def shard_identity(config: ModelConfig, group: Group) -> dict:
    """What a member's share of an entry depends on beyond the model (its tensor-parallel shard, the KV
    heads it holds), for its files' identity: none at T = 1, so that today's files keep their names."""
    if group.size == 1:
        return {}
    shard = Shard(group.member, group.size)
    if is_mla_family(config):  # the latent cache is whole on every member
        return {"tensor_parallel": [shard.member, shard.size]}
    heads = head_share(config.num_attention_heads, config.num_key_value_heads, shard)
    return {"tensor_parallel": [shard.member, shard.size], "kv_heads": list(heads.kv)}


def kv_held_share(config: ModelConfig, t: int) -> float:
    """The KV cache a stage's group holds over the whole stage's: the sum of its members' fractions (1 at
    T = 1; more where KV heads are held by several members, T where each holds it whole, as MLA's latent)."""
    if t == 1:
        return 1.0
    return sum(share_fractions(config, Shard(member, t))[1] for member in range(t))


def model_files(path: Path) -> list[Path]:
    """The files that make the model what it is, for its identity (prompt_cache_store.model_identity):
    a folder's weights and JSON files (config, tokenizer), or the GGUF file itself."""
    if path.is_file():
        return [path]
    return [p for p in path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json", ".gguf")]


def make_transport(settings: TransportSettings, comm):
    """The transport of `--transport`, with the `--watchdog` on silent peers (collective)."""
    placement = comm.allgather((socket.gethostname(), cores.cpus_allowed()))
    hosts = [host for host, _ in placement]
    watchdog = settings.watchdog
    own_core = cores.has_own_core(placement, comm.Get_rank())
    processes = comm.allgather(this_process())  # a waiting rank notices a killed peer on its host
    if settings.transport == "mlx":
        from ..cluster.mlx_group import init_group  # only with --transport mlx: MLX's distributed group

        return MlxTransport(comm, init_group(comm, settings.mlx_backend), watchdog, hosts, own_core, processes)
    return MpiTransport(comm, watchdog, hosts, own_core, processes)
