"""The job's settings: frozen, typed records that a command builds once from its parsed command
line (commands/flags.py) and hands to the runtime (job.py), which never sees argparse.

Each field's default is the one its flag has; a test or benchmark that builds a record by hand
names only what it changes. Importing this module loads no MLX: every command's parser, `plan`'s
included, builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..checkpoints.format_adapters import Requantize

DRAFT_CHOICES = ("none", "ngram", "mtp")  # --draft (speculative.py)
MAX_DRAFT_TOKENS = 15  # --draft-tokens: K + 1 verified positions stay within models.layers.EXACT_POSITIONS_MAX


@dataclass(frozen=True)
class WeightSettings:
    """Which model, and how the ranks split, hold and compute with its weights (job.plan_job, job.load_stage)."""
    model: Path | None = None  # --model: a folder or a GGUF file; None: the default model
    split: str | None = None  # --split: layers per rank, e.g. "10,10,10"; None: balanced by bytes
    host_memory: str | None = None  # generate --host-memory: GiB per rank, e.g. "512,512,256,256"
    dtype: str = "float32"  # --dtype of activations and unquantized weights
    quantize: int | None = None  # --quantize BITS: float/FP8 weights re-quantized while loading
    group_size: int = 64  # --group-size of --quantize
    weights_in_memory: str = "auto"  # --weights-in-memory: quantized, fp32 or auto
    int8_activations: bool | None = None  # --[no-]int8-activations; None: on where every rank can (job.resolve_int8)
    draft: str = "none"  # --draft: with "mtp", rank 0 holds DeepSeek's MTP module too
    tensor_parallel: int = 1  # --tensor-parallel T: stages of T consecutive ranks, each a share of its layers
    expert_parallel: bool = False  # --expert-parallel: MoE layers' experts divided among a stage's group, whole

    @property
    def requantize(self) -> Requantize | None:
        """--quantize as the loader applies it, None without it."""
        # checkpoints/format_adapters.py loads mlx.core, which must not load while a parser is built (`pipeline plan`)
        from ..checkpoints.format_adapters import Requantize

        return Requantize(self.quantize, self.group_size) if self.quantize else None


@dataclass(frozen=True)
class DraftSettings:
    """--draft, --draft-tokens, --ngram-max, --ngram-min: each sequence of a batch or server drafts for
    itself (speculative.py)."""
    kind: str = WeightSettings.draft  # --draft: one flag, which WeightSettings reads too (MTP's weights)
    tokens: int = 8  # --draft-tokens K: most tokens drafted per trip, 1 to MAX_DRAFT_TOKENS
    ngram_max: int = 3  # --ngram-max: the longest suffix --draft ngram looks up
    ngram_min: int = 2  # --ngram-min: the shortest it drafts from; the flag's default is at most --ngram-max

    def drafter(self, stage=None):
        """A new sequence's drafter; stage: rank 0's (its MTP module, slice) for kind "mtp"."""
        # speculative.py loads mlx.core, which must not load while a parser is built (`pipeline plan`)
        from .speculative import make_drafter

        return make_drafter(self.kind, self.tokens, self.ngram_max, self.ngram_min, getattr(stage, "mtp", None),
                            getattr(stage, "model", None))


@dataclass(frozen=True)
class TransportSettings:
    """How ranks talk (job.make_transport)."""
    transport: str = "mpi"  # --transport of hidden states: mpi or mlx
    mlx_backend: str = "auto"  # --mlx-backend of --transport mlx: auto, ring or jaccl
    watchdog: float = 300.0  # --watchdog seconds a rank waits for a silent peer; 0: forever


@dataclass(frozen=True)
class RingSettings:
    """How the scheduler (batch, serve) shares the ring's work (job.plan_ring_job)."""
    microbatches: int | None = None  # --microbatches; None: as many as ranks, or twice that
    packed_matmuls: bool = False  # --packed-matmuls: all rows in one product even where not exact
    head_share: str | float = "auto"  # --head-share: "auto", "off", or a fraction of the vocabulary up to 0.5
    prefix_cache_gb: float = 0.0  # --prefix-cache-gb per rank; 0 (batch's default): none; serve's flag defaults to 4
    prompt_cache_dir: Path | None = None  # serve --prompt-cache-dir: the prefix cache's entries also on disk
    prompt_cache_dir_gb: float = 20.0  # serve --prompt-cache-dir-gb: the most its files take, all ranks' together


@dataclass(frozen=True)
class JobSettings:
    """Everything the runtime reads of a command line that runs a model."""
    weights: WeightSettings = field(default_factory=WeightSettings)
    transport: TransportSettings = field(default_factory=TransportSettings)
    ring: RingSettings = field(default_factory=RingSettings)
