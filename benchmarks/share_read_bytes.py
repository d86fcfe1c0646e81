"""Bytes each --tensor-parallel rank reads from a GGUF file against its share (checkpoints/share_reads.py).

For each member of one stage's group of T (all layers; member 0 also the embedding, as generate loads them): the
bytes its checkpoint read (the reader's count: its shares' bytes, row runs and strided column runs), its share of
the file's tensor bytes (each tensor's rows, columns or experts it holds, from the header), the whole file's tensor
bytes, and the distinct pages those reads touch at 4 KiB (Linux) and 16 KiB (macOS): a column share shorter than a
page still touches the pages of the other members' columns of the same rows. Per kind of tensor cut by columns
(o_proj, down_proj, expert down stacks) too, where pages cost the most. In process (one member at a time),
nothing timed.

    python benchmarks/share_read_bytes.py --model FILE.gguf [--tensor-parallel 2]

The last line is the deciding figure: the worst member's bytes read, its share, and its 4 / 16 KiB pages, each as a
fraction of the file's tensor bytes.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

import pipeline  # noqa: F401 -- first (BLAS binding)

import mlx.core as mx

from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
from pipeline.checkpoints.share_reads import narrowed, pages_read, read_shares
from pipeline.models.tensor_parallel import Shard
from pipeline.models.vocab_split import vocab_share
from pipeline.runtime.stage import Stage

MiB = 1 << 20
KIND = re.compile(r"^model\.layers\.\d+\.(.+)\.[^.]+$")


def member_figures(path: str, t: int, member: int) -> dict:
    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.model_config()
    vocab = vocab_share(config.vocab_size, t, member)
    stage = Stage.load(config, checkpoint, (0, config.num_hidden_layers), has_ends=member == 0, dtype=mx.float32,
                       shard=Shard(member, t), vocab_slice=vocab)
    names = stage.loaded_tensors
    shares = read_shares(names, config, Shard(member, t), vocab, member == 0)
    fresh = GGUFCheckpoint(path)
    read, kinds = {}, defaultdict(lambda: [0, 0, 0])  # kind -> [share bytes, 4 KiB pages, 16 KiB pages]
    with narrowed(fresh, shares):
        for name in names:
            for tensor in fresh.tensors[name].source:
                read[tensor.name] = tensor
                kind = KIND.match(name)
                if name in shares and shares[name][0] == -1 and kind:
                    figures = kinds[kind.group(1)]
                    if tensor.name not in figures:
                        figures.append(tensor.name)
                        figures[0] += tensor.nbytes
                        figures[1] += pages_read([tensor], 4096)
                        figures[2] += pages_read([tensor], 16384)
    return dict(bytes_read=checkpoint.bytes_read, share=sum(t.nbytes for t in read.values()),
                pages4=pages_read(read.values(), 4096), pages16=pages_read(read.values(), 16384),
                file=sum(t.nbytes for t in checkpoint.gguf.tensors.values()), kinds=kinds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tensor-parallel", type=int, default=2)
    args = parser.parse_args()
    t, worst = args.tensor_parallel, None
    for member in range(t):
        f = member_figures(args.model, t, member)
        pct = {k: 100 * f[k] / f["file"] for k in ("bytes_read", "share", "pages4", "pages16")}
        print(f"member {member}/{t}: read {f['bytes_read'] / MiB:.1f} MiB ({pct['bytes_read']:.1f}% of the file's "
              f"{f['file'] / MiB:.1f} MiB of tensors; its share {f['share'] / MiB:.1f} MiB, {pct['share']:.1f}%); "
              f"pages touched: 4 KiB {f['pages4'] / MiB:.1f} MiB ({pct['pages4']:.1f}%), 16 KiB "
              f"{f['pages16'] / MiB:.1f} MiB ({pct['pages16']:.1f}%)")
        for kind, (share, p4, p16, *_) in sorted(f["kinds"].items()):
            print(f"  {kind} (columns): share {share / MiB:.2f} MiB, pages 4 KiB {p4 / MiB:.2f} MiB "
                  f"({p4 / share:.2f}x), 16 KiB {p16 / MiB:.2f} MiB ({p16 / share:.2f}x)")
        if worst is None or pct["bytes_read"] > worst[0]:
            worst = (pct["bytes_read"], pct["share"], pct["pages4"], pct["pages16"])
    print(f"T={t} worst member: reads {worst[0]:.1f}% of the file's tensor bytes (share {worst[1]:.1f}%; "
          f"4 KiB pages {worst[2]:.1f}%, 16 KiB pages {worst[3]:.1f}%)")


if __name__ == "__main__":
    main()
