"""--tensor-parallel T on GGUF files whose matrices are held in their own blocks (checkpoints/quants.py: the K-quants
and grid i-quants as the file's row bytes, IQ4_NL / IQ4_XS / Q6_K as codes and scales, expert stacks of them): every
layout cut by input features on whole blocks (models/tensor_parallel.py _columns), each rank reading only its share
(checkpoints/share_reads.py, strided row reads; a stack's rows per expert). Against transformers on gguf's
dequantization of the same file (tests/test_gguf_inplace.py's writer): tiny Llama and Qwen3-MoE shapes, T = 1, 2
(and 3 where the shapes allow it), float products and int8; a planted cut one block off fails; a share whose edge
falls inside a block is one error line naming the tensor and a T that works."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import test_gguf_inplace
from conftest import mpiexec, REPO, assert_far_from_uniform, make_tiny_model, write_tokenizer
from test_gguf_inplace import LONG_PROMPT, gguf_vocab, reference, write_model

from pipeline.checkpoints.gguf_checkpoint import GGUFCheckpoint
from pipeline.checkpoints.share_reads import read_shares
from pipeline.models.tensor_parallel import Shard
from pipeline.models.vocab_split import vocab_share

# Per layer (4 layers): o_proj and down_proj (cut by input features) in every held layout; q/k/v, gate/up by rows.
DENSE_TYPES = {"attn_q.": [QT.IQ4_NL] * 4, "attn_k.": [QT.Q4_K] * 4, "attn_v.": [QT.Q6_K] * 4,
               "attn_output.": [QT.Q6_K, QT.IQ4_XS, QT.Q3_K, QT.IQ4_NL], "ffn_gate.": [QT.IQ4_XS] * 4,
               "ffn_up.": [QT.Q5_K] * 4, "ffn_down.": [QT.Q6_K, QT.Q2_K, QT.IQ4_XS, QT.IQ2_XXS],
               "token_embd": [QT.Q8_0], "output.": [QT.Q6_K]}
# T = 3's 3 + 3 + 2 heads of 64 cut o_proj's 256-value blocks: there o_proj in blocks of 32
DENSE3_TYPES = {**DENSE_TYPES, "attn_output.": [QT.IQ4_NL] * 4}
MOE_TYPES = {"attn": [QT.Q8_0] * 4, "ffn_gate_exps": [QT.Q2_K, QT.IQ4_XS, QT.Q6_K, QT.IQ2_XXS],
             "ffn_up_exps": [QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.Q3_K],
             "ffn_down_exps": [QT.Q6_K, QT.Q3_K, QT.IQ4_NL, QT.IQ2_XXS], "token_embd": [QT.Q8_0],
             "output.": [QT.Q6_K]}
# DeepSeek V3 (MLA, 8 heads of v 64: o_proj's 512 inputs, 256 a member at T = 2; layer 0 dense, then 8 routed experts
# of 512 features and a shared expert), as llama.cpp's deepseek2 (kv_b split into attn_k_b / attn_v_b)
MLA_TYPES = {"attn_output": [QT.Q6_K, QT.Q3_K, QT.IQ4_XS, QT.Q2_K], "ffn_gate_exps": [QT.IQ4_XS, QT.Q2_K, QT.Q6_K],
             "ffn_up_exps": [QT.Q5_K, QT.IQ4_NL, QT.Q3_K], "ffn_down_exps": [QT.Q6_K, QT.Q3_K, QT.IQ4_XS, QT.IQ2_XXS],
             "shexp": [QT.Q5_K], "ffn_down": [QT.Q6_K], "ffn_": [QT.IQ4_XS], "attn": [QT.Q8_0],
             "token_embd": [QT.Q8_0], "output.": [QT.Q6_K]}
GRID = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M)


def encode(w: np.ndarray, qtype: QT) -> np.ndarray:
    """What the file stores for `qtype`: K-quants and IQ4 fitted to w by the packers of tests/test_gguf_inplace.py
    and tests/test_gguf_iquants.py, grid i-quants random codes spread as w (gguf quantizes neither)."""
    import test_gguf_block_experts
    import test_gguf_iquants

    if qtype in (QT.IQ4_NL, QT.IQ4_XS):
        return test_gguf_iquants.pack_iq4(w.reshape(-1, w.shape[-1]), qtype).reshape(*w.shape[:-1], -1)
    if qtype in GRID:
        return test_gguf_block_experts._encode(w, qtype)
    return PACK(w, qtype)


PACK = test_gguf_inplace.encode


def choose(types: dict):
    def pick(name: str, array):
        layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
        for key, per_layer in types.items():
            if key in name:
                return per_layer[layer % len(per_layer)]
        return QT.F32
    return pick


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{kind: (file, transformers' logits on the file's values)} for the dense and MoE models."""
    root = tmp_path_factory.mktemp("tp_blocks")
    (root / "vocab").mkdir()
    write_tokenizer(root / "vocab")
    vocab = gguf_vocab(root / "vocab")
    saved, test_gguf_inplace.encode = test_gguf_inplace.encode, encode
    try:
        import transformers
        from test_moe import make_qwen3_moe

        out = {}
        make_tiny_model("mistral", root / "dense_hf", hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                        intermediate_size=768)
        dense = transformers.MistralForCausalLM.from_pretrained(root / "dense_hf").eval()
        for kind, types in (("dense", DENSE_TYPES), ("dense3", DENSE3_TYPES)):
            written = write_model(root / f"{kind}.gguf", dense, "llama", choose(types), vocab=vocab)
            out[kind] = (written["files"][0], reference(dense, written["state"]))
        moe = make_qwen3_moe(root / "moe_hf", hidden_size=256, moe_intermediate_size=512, intermediate_size=512,
                             head_dim=64, norm_topk_prob=True)
        written = write_model(root / "moe.gguf", moe, "qwen3moe", choose(MOE_TYPES), vocab=vocab)
        out["moe"] = (written["files"][0], reference(moe, written["state"]))
        from test_gguf_inplace import _deepseek

        mla = _deepseek(root / "mla_hf", num_attention_heads=8, num_key_value_heads=8, v_head_dim=64,
                        moe_intermediate_size=512, intermediate_size=512)
        written = write_model(root / "mla.gguf", mla, "deepseek2", choose(MLA_TYPES), vocab=vocab)
        out["mla"] = (written["files"][0], reference(mla, written["state"]))
    finally:
        test_gguf_inplace.encode = saved
    for _, truth in out.values():
        assert_far_from_uniform(truth)
    return out


def worker_logits(path, ranks: int, tmp_path, int8: bool, plant: str = "", experts: bool = False) -> np.ndarray:
    """[whole prompt, token by token] logits of one stage of T = ranks (tests/tensor_parallel_blocks_worker.py)."""
    out = tmp_path / f"logits{ranks}{int(int8)}{plant}{int(experts)}.npy"
    job = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, str(REPO / "tests" / "tensor_parallel_blocks_worker.py"),
                          str(path), str(out), ",".join(map(str, LONG_PROMPT))], capture_output=True, text=True,
                         timeout=300, cwd=REPO, env={**os.environ, "INT8": str(int(int8)), "PLANT": plant,
                                                           "EXPERTS": str(int(experts))})
    assert job.returncode == 0, job.stderr
    return np.load(out)


def errors(logits: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """(max |logits - truth|, the median over positions of each position's max): a MoE routing flip under int8
    moves a position far, as on one rank."""
    per_position = np.abs(logits - truth).max(-1)
    return float(per_position.max()), float(np.median(per_position))


def near_ties(logits: np.ndarray, margin: float) -> np.ndarray:
    top = np.sort(logits, axis=-1)
    return top[..., -1] - top[..., -2] < margin


@pytest.mark.parametrize("kind, ranks", [("dense", (1, 2)), ("dense3", (1, 3)), ("moe", (1, 2)), ("mla", (1, 2))])
def test_block_held_matrices_split_by_input_features(files, kind, ranks, tmp_path):
    """Logits of T = 2 (3) within float32 rounding of transformers' on the file's values, as T = 1's (float
    products); int8 products within what int8 rounding costs T = 1; the greedy choice of T = 1 at every position
    whose top two logits are not a near-tie; the whole prompt and token by token through the KV cache alike."""
    path, truth = files[kind]
    measured = {}
    for int8 in (False, True):
        for t in ranks:
            whole, incremental = worker_logits(path, t, tmp_path, int8)
            measured[int8, t] = (whole, errors(whole, truth), errors(incremental, truth))
    one, many = ranks
    for int8 in (False, True):
        whole1, (max1, median1), _ = measured[int8, one]
        whole, (err, median), (err_inc, median_inc) = measured[int8, many]
        apart = float(np.abs(whole - whole1).max())
        print(f"{kind} int8={int8}: T={one} {max1:.3g} (median {median1:.3g}), T={many} {err:.3g} (median {median:.3g},"
              f" token by token {err_inc:.3g}), |T={many} - T={one}| {apart:.3g}, logits up to {np.abs(truth).max():.3g}")
        bound, near = TOLERANCE[kind, int8]
        if int8 and kind in ("moe", "mla"):  # a routing flip moves a few positions far: the median, as on one rank
            assert max(median, median_inc, median1) <= bound, (median, median_inc, median1)
        else:
            assert max(err, err_inc, max1) <= bound, (err, err_inc, max1)
        # the same greedy choice as T = 1 wherever T = 1's top two are further apart than the runs differ
        assert apart <= near, apart
        clear = ~near_ties(whole1, 2 * near)
        assert clear.mean() > (0.3 if int8 else 0.9), clear.mean()  # (int8 dense: 0.48 of the positions)
        assert (whole.argmax(-1) == whole1.argmax(-1))[clear].all(), kind


# (max |ours - transformers on gguf's dequantization| of the fp32 logits of LONG_PROMPT (logits up to |19|) for T = 1
# and T > 1 (int8 MoE: the median over positions), max |T > 1 - T = 1|), just above the measured (T = 1 / T > 1; apart):
# dense float 4.09e-4 / 4.08e-4 (T = 2), 3.50e-4 / 3.67e-4 (T = 3); apart 4.7e-5, 6.5e-5; int8 4.02 / 4.01, 4.45 /
# 4.35, apart 0.31, 0.65 (int8 rounding of activations, each thresholds flipped by float rounding; k_proj's Q4_K in
# its blocks rounds them per 256 as llama.cpp, where MLX's 4-bit layout rounded per 32: 3.2-3.3 then); MoE float
# 1.68e-4 / 1.56e-4, apart 6.5e-5; int8 median 0.639 / 0.639 (max 11 on both: routing flips), apart 1.1e-5; MLA
# float 9.28e-5 / 9.06e-5, apart 1.4e-5; int8 median 0.749 / 0.756 (max 7.9 on both), apart 0.25
TOLERANCE = {("dense", False): (5e-4, 1e-4), ("dense", True): (5.0, 0.8), ("dense3", False): (5e-4, 1e-4),
             ("dense3", True): (5.0, 0.8), ("moe", False): (2e-4, 1e-4), ("moe", True): (0.7, 3e-5),
             ("mla", False): (1e-4, 3e-5), ("mla", True): (0.8, 0.3)}


def test_whole_experts_from_block_stacks(files, tmp_path):
    """--expert-parallel on the Qwen3-MoE file: each member holds (and reads) whole experts of the block-held
    stacks; float products within float32 rounding of transformers' as one rank's (measured 1.56e-4)."""
    path, truth = files["moe"]
    whole, incremental = worker_logits(path, 2, tmp_path, False, experts=True)
    print("expert parallel", np.abs(whole - truth).max(), np.abs(incremental - truth).max())
    assert max(np.abs(whole - truth).max(), np.abs(incremental - truth).max()) <= TOLERANCE["moe", False][0]


def test_a_cut_one_block_off_is_caught(files, tmp_path):
    path, truth = files["dense"]
    whole, _ = worker_logits(path, 2, tmp_path, False, plant="block")
    print("planted", np.abs(whole - truth).max())
    assert np.abs(whole - truth).max() > 100 * TOLERANCE["dense", False][0]


def test_a_share_inside_a_block_is_one_line(files, tmp_path):
    """T = 3 splits 8 heads of 64 as 3 + 3 + 2: o_proj's shares end at inputs 192 and 384, inside its 256-value
    Q6_K blocks; the Qwen3-MoE's 512 expert features over 3 are cut on 128s: one line naming the tensor and a T."""
    for kind, module in (("dense", "self_attn.o_proj"), ("moe", "mlp.switch_mlp.down_proj")):
        out = tmp_path / f"{kind}.npy"
        job = subprocess.run(["mpiexec", "-n", "3", sys.executable, str(REPO / "tests" / "tensor_parallel_blocks_worker.py"),
                              str(files[kind][0]), str(out), "1,2,3"], capture_output=True, text=True, timeout=300,
                             cwd=REPO, env={**os.environ, "INT8": "0", "PLANT": ""})
        assert job.returncode != 0
        lines = [line for line in job.stderr.splitlines() if "--tensor-parallel 3" in line]
        assert lines and module in lines[0] and "use --tensor-parallel 2" in lines[0], job.stderr[-2000:]
        # preflight says the same from the file's index, before a job loads anything
        checked = mpiexec(3, "preflight", "--model", str(files[kind][0]), "--tensor-parallel", "3", timeout=300)
        said = lines[0][lines[0].index("--tensor-parallel 3:"):]
        assert checked.returncode != 0 and said in checked.stdout + checked.stderr, \
            (lines[0], checked.stdout[-2000:], checked.stderr[-2000:])


@pytest.mark.parametrize("kind, t, experts", [("dense", 2, False), ("dense3", 3, False), ("moe", 2, False),
                                              ("moe", 2, True), ("mla", 2, False)])
def test_each_rank_reads_only_its_share(files, kind, t, experts):
    """The GGUF reader's bytes read per member == the share of each tensor's bytes (from the file's header, by the
    gguf package): rows [b, e) of R are (e - b) / R of a tensor's bytes, columns and each expert's rows likewise."""
    from pipeline.runtime.stage import Stage
    import mlx.core as mx

    path = files[kind][0]
    sizes = {x.name: int(x.n_bytes) for x in gguf.GGUFReader(path).tensors}
    for member in range(t):
        checkpoint = GGUFCheckpoint(path)
        config = checkpoint.model_config()
        vocab = vocab_share(config.vocab_size, t, member)
        stage = Stage.load(config, checkpoint, (0, config.num_hidden_layers), has_ends=member == 0, dtype=mx.float32,
                           shard=Shard(member, t, experts), vocab_slice=vocab)
        shares = read_shares(stage.loaded_tensors, config, Shard(member, t, experts), vocab, member == 0)
        expected = 0
        for name in stage.loaded_tensors:
            if name.rsplit(".", 1)[-1] in ("scales", "biases", "ggml_type"):
                continue  # one GGUF tensor each, counted with its weight
            entry = checkpoint.tensors[name]
            nbytes = sum(sizes[source.name] for source in entry.source)
            if name in shares:  # (kv_b: attn_k_b and attn_v_b joined, each read for the member's heads)
                _, begin, end, of = shares[name]
                nbytes = nbytes * (end - begin) // of
            expected += nbytes
        assert checkpoint.bytes_read == expected, (member, checkpoint.bytes_read, expected)
        print(kind, t, member, checkpoint.bytes_read, sum(sizes.values()))


def test_pages_read_counts_the_distinct_pages():
    """share_reads.pages_read (benchmarks/share_read_bytes.py's page figures) against a set of every page each run
    touches, for column shares (runs shorter and longer than a page), a stack's rows per expert and whole tensors,
    two of them on shared pages."""
    from pathlib import Path

    from pipeline.checkpoints.gguf_file import GGUFTensor
    from pipeline.checkpoints.share_reads import narrow_tensor, pages_read

    def brute(tensors, page):
        pages = set()
        for t in tensors:
            stride = getattr(t, "stride", 0)
            run = t.nbytes // t.rows if stride else t.nbytes
            for i in range(t.rows if stride else 1):
                start = t.begin + i * stride
                pages.update(range(start // page, (start + run - 1) // page + 1))
        return len(pages) * page

    file = Path("f")
    a = GGUFTensor("a", "Q4_K", (96, 2048), file, 4100, 96 * 8 * 144)
    b = GGUFTensor("b", "Q6_K", (4, 40, 4096), file, a.begin + a.nbytes, 4 * 40 * 16 * 210)
    c = GGUFTensor("c", "Q8_0", (16, 4096), file, b.begin + b.nbytes + 999, 16 * 128 * 34)
    shares = [narrow_tensor(a, -1, 256, 1024), narrow_tensor(a, -1, 1024, 2048), narrow_tensor(b, -1, 0, 2048),
              narrow_tensor(b, -2, 8, 30), narrow_tensor(c, -1, 2048, 4096), narrow_tensor(c, -2, 3, 9), c]
    for page in (4096, 16384):
        for t in shares:
            assert pages_read([t], page) == brute([t], page), (t.name, page)
        assert pages_read(shares, page) == brute(shares, page)
        assert pages_read([shares[0]], page) > shares[0].nbytes  # runs of 432 bytes in rows of 1152: every page
