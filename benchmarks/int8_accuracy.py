"""What rounding activations to int8 costs in accuracy: SmolLM2-135M-Instruct (the default model, Q4_1
GGUF) reading a real English text (Python's own LICENSE.txt, from the running interpreter's standard
library), scored three ways on 1 rank:

- fp32: the weights dequantized to float32 at load (--weights-in-memory fp32), float products;
- quantized: the weights held quantized, pipeline's float32 kernels (the activations stay float32);
- int8: the weights held quantized, activations rounded to int8 per 32 inputs (--int8-activations,
  as llama.cpp's CPU products round them for Q4_0/Q4_1/Q8_0 weights).

The text is cut into chunks of 512 tokens, back to back, each read from scratch; the next-token
distributions at every position of the second half of each chunk (255 a chunk, each with 256 tokens
of context at least) are scored: llama.cpp's `llama-perplexity -c 512` protocol, so that its figure
for the same GGUF file (SmolLM2's add_bos_token is false: the chunks are the raw tokens) stands
beside ours. Per contender: perplexity, and against fp32 the share of positions whose top token is
the same and the mean KL divergence of the next-token distributions. Accuracy, not speed: one run
each is exact (the products are deterministic). llama.cpp's figure comes from its `llama-perplexity`
where a llama.cpp build is cached (benchmarks/llamacpp_build.py llama-perplexity), as llama.cpp
rounds activations for these weights too (Q8_1 blocks of 32 for Q4_1).

    python benchmarks/int8_accuracy.py [--no-llamacpp]
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CONTENDERS = {"fp32": {"weights_in_memory": "fp32", "int8_activations": False},
              "quantized": {"weights_in_memory": "quantized", "int8_activations": False},
              "int8": {"weights_in_memory": "quantized", "int8_activations": True}}
CHUNK = 512  # tokens a chunk, as llama-perplexity -c 512


def text_file() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def score(flags: dict, ids: list[int]):
    """Log-probabilities [positions, vocab] (float64 numpy) of the scored next tokens, and those tokens."""
    import mlx.core as mx
    import numpy as np

    from pipeline import cli
    from pipeline.commands.flags import weight_settings
    from pipeline.runtime.job import load_stage, plan_job

    args = cli._validated(cli.build_parser().parse_args(["generate", "--prompt", "x"]))
    for key, value in flags.items():
        setattr(args, key, value)
    from mpi4py import MPI

    settings = weight_settings(args)
    plan = plan_job(settings, MPI.COMM_SELF)
    stage = load_stage(settings, plan, 0, progress=False)
    out, targets = [], []
    first = CHUNK // 2
    for start in range(0, len(ids) - CHUNK + 1, CHUNK):
        chunk = ids[start:start + CHUNK]
        stage.release([0])
        hidden = stage.run_layers(stage.model.embed(mx.array([chunk])))
        logits = stage.model.logits(hidden[0, first:CHUNK - 1]).astype(mx.float32)
        out.append(np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(np.float64))
        targets.extend(chunk[first + 1:])
    return np.concatenate(out), np.array(targets), stage


def llamacpp_perplexity(text: Path) -> tuple[float | None, str]:
    """llama.cpp's `llama-perplexity -c 512` figure for the default model's GGUF file, and its build;
    (None, why) without a cached build."""
    import re
    import subprocess

    import llamacpp_build
    from pipeline.checkpoints.default_model import find_default_gguf

    found = llamacpp_build.cached_binaries((llamacpp_build.PERPLEXITY,))
    if not found:
        return None, "no cached llama.cpp build with llama-perplexity (python benchmarks/llamacpp_build.py llama-perplexity)"
    binary = found[llamacpp_build.PERPLEXITY]
    proc = subprocess.run([str(binary), "-m", str(find_default_gguf()), "-f", str(text), "-c", str(CHUNK), "-t", "2"],
                          capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([\d.]+)", proc.stdout + proc.stderr)
    return (float(m.group(1)) if m else None), llamacpp_build.commit_of(binary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-llamacpp", action="store_true", help="leave out llama.cpp's figure")
    args = parser.parse_args()
    import numpy as np

    from pipeline.cluster import mpi
    from pipeline.util import private_tmp

    mpi.use_the_launchers_mpi()
    private_tmp.use()
    from pipeline.checkpoints.tokenizer import Tokenizer

    model = common.default_model()
    text = text_file().read_text()
    ids = Tokenizer.from_folder(model).prompt_ids(text, use_chat_template=False)
    table, reference = {}, None
    for name, flags in CONTENDERS.items():
        logp, targets, stage = score({**flags, "model": model}, ids)
        nll = -logp[np.arange(len(targets)), targets]
        row = {"perplexity": math.exp(nll.mean()), "mean_nll": float(nll.mean())}
        if reference is None:
            reference = logp
        else:
            p = np.exp(reference)
            row["top1_same_as_fp32"] = float((logp.argmax(-1) == reference.argmax(-1)).mean())
            row["kl_from_fp32"] = float((p * (reference - logp)).sum(-1).mean())
            row["perplexity_vs_fp32"] = row["perplexity"] / table["fp32"]["perplexity"]
        table[name] = row
        extra = "".join(f", {k} {v:.4g}" for k, v in row.items() if k != "perplexity")
        print(f"{name}: perplexity {row['perplexity']:.4f}{extra}", flush=True)
        del stage
    llamacpp, build = (None, "left out (--no-llamacpp)") if args.no_llamacpp else llamacpp_perplexity(text_file())
    print(f"llama.cpp ({build}): perplexity {llamacpp}")
    payload = common.record("int8_accuracy", "accuracy of int8 activations: perplexity, top-1 agreement, KL",
                            model=str(model), text=str(text_file()), scored_tokens=len(targets), chunk=CHUNK,
                            table=table, llamacpp={"perplexity": llamacpp, "build": build})
    print(f"wrote {common.write_json('int8_accuracy', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
