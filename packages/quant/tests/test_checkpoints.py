"""checkpoints.py: GPTQ and AWQ tensors -> Int4Weight.

The packed checkpoint tensors are built here from known integer codes with plain loops and
shifts, following the packing of the projects themselves (AutoGPTQ `QuantLinear.pack`:
eight rows per int32 along K, first row lowest; AutoAWQ `WQLinear_GEMM.from_linear`: eight
columns per int32 along N, nibble i holding column AWQ_ORDER[i]). The expected weight is
computed from those packed tensors with the libraries' dequantization formula written out
element by element, independently of the converter; the converted weight, dequantized by
reference.dequantize_int4_ref in float64, must equal it exactly (the products of small
integers and fp16 / bf16 scales are exact in float64). For act-order, the converted layer
must compute x @ W^T of the checkpoint as x[..., perm] @ W'^T.
"""

from __future__ import annotations

import pytest
import torch

from openkernels.quant.checkpoints import from_awq, from_gptq, load_awq_state_dict, load_gptq_state_dict
from openkernels.quant.format import Int4Weight
from openkernels.quant.reference import dequantize_int4_ref, int4_linear_ref, unpack_codes
from openkernels.shared.platform import triton_interpreting

pytestmark = pytest.mark.skipif(triton_interpreting(), reason="conversions are tested in the main run")

F16, BF16, F64 = torch.float16, torch.bfloat16, torch.float64

# AutoAWQ's order (awq/modules/linear/gemm.py): nibble i of a word holds column 8c + _AWQ_ORDER[i].
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_GPTQ_ORDER = tuple(range(8))


# ----------------------------------------------------------------------------------------------
# Packing helpers (checkpoint writers) and the checkpoint's own dequantization
# ----------------------------------------------------------------------------------------------


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> int32 with the same 32 bits (as numpy's uint32 -> int32)."""
    assert int(words.min()) >= 0 and int(words.max()) < 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_k(codes_kn: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight: (K, N) codes -> (K // 8, N) int32, row 8r + i at bits 4i of word r."""
    K, N = codes_kn.shape
    words = torch.zeros(K // 8, N, dtype=torch.int64)
    for r in range(K // 8):
        for i in range(8):
            words[r] |= codes_kn[8 * r + i].long() << (4 * i)
    return _as_int32(words)


def pack_along_n(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """(R, N) 4-bit values -> (R, N // 8) int32; nibble i of word c holds column 8c + order[i]."""
    R, N = values.shape
    words = torch.zeros(R, N // 8, dtype=torch.int64)
    for c in range(N // 8):
        for i in range(8):
            words[:, c] |= values[:, 8 * c + order[i]].long() << (4 * i)
    return _as_int32(words)


def _nibble(words: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The 4-bit field at `shift` of int32 words read as unsigned 32-bit, as int64."""
    return ((words.long() & 0xFFFFFFFF) >> shift) & 0xF


def gptq_weight(qweight, qzeros, scales, g_idx, checkpoint_format) -> torch.Tensor:
    """W (N, K) float64: W[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n], with
    q from bits 4 (k % 8) of qweight[k // 8, n], and z from bits 4 (n % 8) of qzeros[g, n // 8]
    plus 1 for the v1 "gptq" format (AutoGPTQ forward: zeros = zeros + 1)."""
    K, N = 8 * qweight.shape[0], qweight.shape[1]
    k, n = torch.arange(K), torch.arange(N)
    q = _nibble(qweight[k // 8], (4 * (k % 8))[:, None])  # (K, N)
    z = _nibble(qzeros[:, n // 8], (4 * (n % 8))[None, :])  # (G, N)
    if checkpoint_format == "gptq":
        z = z + 1
    if g_idx is None:
        g_idx = k // (K // scales.shape[0])
    g = g_idx.long()
    return ((q - z[g]).to(F64) * scales.to(F64)[g]).t()


def awq_weight(qweight, qzeros, scales) -> torch.Tensor:
    """W (N, K) float64: W[n, k] = (q[k, n] - z[k // gs, n]) * scales[k // gs, n], with column n
    in nibble _AWQ_ORDER.index(n % 8) of word n // 8 (AutoAWQ dequantize_gemm)."""
    K, N = qweight.shape[0], scales.shape[1]
    n = torch.arange(N)
    shift = torch.tensor([4 * _AWQ_ORDER.index(j % 8) for j in range(N)])
    q = _nibble(qweight[:, n // 8], shift[None, :])  # (K, N)
    z = _nibble(qzeros[:, n // 8], shift[None, :])  # (G, N)
    g = torch.arange(K) // (K // scales.shape[0])
    return ((q - z[g]).to(F64) * scales.to(F64)[g]).t()


def dequant(w: Int4Weight) -> torch.Tensor:
    return dequantize_int4_ref(w.qweight, w.scales, w.zeros, w.group_size, w.kind, F64)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _scales(G: int, N: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.rand(G, N, generator=gen) * 0.05 + 0.001).to(dtype)


def _g_idx(K: int, group_size: int, act_order: bool, gen: torch.Generator) -> torch.Tensor:
    g = torch.arange(K) // group_size
    if act_order:
        g = g[torch.randperm(K, generator=gen)]
    return g.to(torch.int32)


def _gptq_case(K, N, group_size, act_order, scale_dtype=F16, seed=0, zero_nibbles=None):
    """Random GPTQ tensors: (qweight, qzeros, scales, g_idx, codes (K, N), stored zeros (G, N))."""
    gen = _gen(seed)
    G = K // group_size
    codes = torch.randint(0, 16, (K, N), generator=gen)
    stored = torch.randint(0, 16, (G, N), generator=gen) if zero_nibbles is None else zero_nibbles
    scales = _scales(G, N, scale_dtype, gen)
    g_idx = _g_idx(K, group_size, act_order, gen)
    return pack_along_k(codes), pack_along_n(stored, _GPTQ_ORDER), scales, g_idx, codes, stored


SHAPES = [(256, 64), (384, 200), (256, 200), (384, 64)]


# ----------------------------------------------------------------------------------------------
# GPTQ
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("group_size", [32, 128, None])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_matches_checkpoint_dequantization(K, N, group_size, checkpoint_format, act_order):
    gs = K if group_size is None else group_size
    qweight, qzeros, scales, g_idx, _, _ = _gptq_case(K, N, gs, act_order, seed=K + N + gs)
    w = from_gptq(qweight, qzeros, scales, g_idx, checkpoint_format=checkpoint_format, sym=False)
    assert isinstance(w, Int4Weight) and w.kind == "int4"
    assert w.qweight.dtype == torch.uint8 and w.qweight.shape == (N, K // 2)
    assert w.group_size == gs and w.shape == (N, K)
    assert w.scales.dtype == F16 and torch.equal(w.scales, scales)
    assert w.zeros is not None and w.zeros.dtype == F16 and w.zeros.shape == (K // gs, N)
    expected = gptq_weight(qweight, qzeros, scales, g_idx, checkpoint_format)
    got = dequant(w)
    if act_order and gs < K:
        assert w.perm is not None and w.perm.dtype == torch.int64
        assert torch.equal(torch.sort(w.perm).values, torch.arange(K))
        # column j of the converted weight is column perm[j] of the checkpoint, in group j // gs
        assert torch.equal(got, expected[:, w.perm])
        assert torch.equal(g_idx[w.perm].long(), torch.arange(K) // gs)
    else:
        assert w.perm is None  # a trivial g_idx needs no permutation (one group: always trivial)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("K,N", [(256, 64), (384, 200)])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_act_order_linear_semantics(K, N, group_size, checkpoint_format):
    """x[..., perm] @ W'^T equals the checkpoint's x @ W^T (float64)."""
    qweight, qzeros, scales, g_idx, _, _ = _gptq_case(K, N, group_size, True, seed=7 * K + N)
    w = from_gptq(qweight, qzeros, scales, g_idx, checkpoint_format=checkpoint_format)
    assert w.perm is not None
    x = torch.randn(3, 5, K, generator=_gen(1), dtype=F64)
    y_checkpoint = x @ gptq_weight(qweight, qzeros, scales, g_idx, checkpoint_format).t()
    y = int4_linear_ref(x[..., w.perm], w.qweight, w.scales, w.zeros, w.group_size, w.kind)
    torch.testing.assert_close(y, y_checkpoint, rtol=1e-12, atol=1e-12)
    # without the permutation the result is wrong: the test can tell
    y_unpermuted = int4_linear_ref(x, w.qweight, w.scales, w.zeros, w.group_size, w.kind)
    assert not torch.allclose(y_unpermuted, y_checkpoint, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale_dtype", [F16, BF16])
def test_gptq_bfloat16_scales_and_g_idx_dtypes(scale_dtype):
    K, N, gs = 256, 64, 32
    qweight, qzeros, scales, g_idx, _, _ = _gptq_case(K, N, gs, True, scale_dtype=scale_dtype, seed=3)
    expected = gptq_weight(qweight, qzeros, scales, g_idx, "gptq_v2")
    for g in (g_idx, g_idx.long()):
        w = from_gptq(qweight, qzeros, scales, g, checkpoint_format="gptq_v2")
        assert w.scales.dtype == scale_dtype and w.zeros.dtype == scale_dtype
        assert torch.equal(dequant(w), expected[:, w.perm])


def test_gptq_without_g_idx_is_trivial():
    K, N, gs = 384, 64, 128
    qweight, qzeros, scales, g_idx, _, _ = _gptq_case(K, N, gs, False, seed=5)
    a = from_gptq(qweight, qzeros, scales, None)
    b = from_gptq(qweight, qzeros, scales, g_idx)
    assert a.perm is None and b.perm is None
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.zeros, b.zeros)
    assert torch.equal(dequant(a), gptq_weight(qweight, qzeros, scales, None, "gptq"))


def test_gptq_known_words():
    """Pinned values: word 0x76543210 holds codes 0..7 for rows 0..7 (first row lowest), and
    our layout puts column 2j in the low nibble of byte j."""
    N = 8  # K = 8: one word per column
    qweight = torch.full((1, N), 0x76543210, dtype=torch.int32)
    qweight[0, 1] = _as_int32(torch.tensor([0xF0000001]))[0]  # negative as int32: row 7 = 15, row 0 = 1
    qzeros = torch.tensor([[0x76543210]], dtype=torch.int32)  # column n: nibble n
    scales = torch.ones(1, N, dtype=F16)
    v2 = from_gptq(qweight, qzeros, scales, checkpoint_format="gptq_v2")
    assert torch.equal(v2.qweight[0], torch.tensor([0x10, 0x32, 0x54, 0x76], dtype=torch.uint8))
    assert torch.equal(v2.qweight[1], torch.tensor([0x01, 0x00, 0x00, 0xF0], dtype=torch.uint8))
    assert torch.equal(unpack_codes(v2.qweight)[2], torch.arange(8))
    assert torch.equal(v2.zeros[0], torch.arange(8, dtype=F16))
    v1 = from_gptq(qweight, qzeros, scales, checkpoint_format="gptq")
    assert torch.equal(v1.qweight, v2.qweight)
    assert torch.equal(v1.zeros[0], torch.arange(1, 9, dtype=F16))  # stored zero - 1
    # row k of column 0 has code k, zero (v2) 0: W[0, k] = k
    assert torch.equal(dequant(v2)[0], torch.arange(8, dtype=F64))
    assert torch.equal(dequant(v1)[0], torch.arange(8, dtype=F64) - 1)


def test_gptq_v1_zero_nibble_15_is_16_without_carry():
    """v1 adds 1 per nibble (AutoGPTQ forward, vLLM zero_offset): a stored 15 gives zero 16 and
    leaves the neighbouring column's zero alone."""
    qweight = torch.zeros(1, 8, dtype=torch.int32)
    qzeros = torch.tensor([[0x000000FF]], dtype=torch.int32)  # columns 0 and 1 store 15
    scales = torch.ones(1, 8, dtype=F16)
    w = from_gptq(qweight, qzeros, scales, checkpoint_format="gptq")
    assert w.zeros[0].tolist() == [16.0, 16.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert torch.equal(dequant(w), gptq_weight(qweight, qzeros, scales, None, "gptq"))


@pytest.mark.parametrize("checkpoint_format,stored", [("gptq", 7), ("gptq_v2", 8)])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_symmetric(checkpoint_format, stored, act_order):
    """sym=True checkpoints store zero 8 as 7 (v1) or 8 (v2); the result is symmetric (zeros None)."""
    K, N, gs = 256, 200, 128
    G = K // gs
    nibbles = torch.full((G, N), stored)
    qweight, qzeros, scales, g_idx, _, _ = _gptq_case(K, N, gs, act_order, seed=11, zero_nibbles=nibbles)
    if checkpoint_format == "gptq":
        assert int(qzeros[0, 0]) == 0x77777777
    expected = gptq_weight(qweight, qzeros, scales, g_idx, checkpoint_format)
    for sym in (True, None, False):
        w = from_gptq(qweight, qzeros, scales, g_idx, checkpoint_format=checkpoint_format, sym=sym)
        if sym is False:
            assert w.zeros is not None and bool((w.zeros == 8).all())
        else:
            assert w.zeros is None and w.symmetric
        assert (w.perm is not None) == act_order
        assert torch.equal(dequant(w), expected[:, w.perm] if act_order else expected)
    # the other format's reading of the same bytes is off by one zero point: not symmetric
    other = "gptq_v2" if checkpoint_format == "gptq" else "gptq"
    with pytest.raises(ValueError, match="sym=True"):
        from_gptq(qweight, qzeros, scales, g_idx, checkpoint_format=other, sym=True)
    assert from_gptq(qweight, qzeros, scales, g_idx, checkpoint_format=other).zeros is not None


# ----------------------------------------------------------------------------------------------
# AWQ
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("group_size", [32, 128, None])
@pytest.mark.parametrize("scale_dtype", [F16, BF16])
def test_awq_matches_checkpoint_dequantization(K, N, group_size, scale_dtype):
    gs = K if group_size is None else group_size
    G = K // gs
    gen = _gen(K * N + gs)
    codes = torch.randint(0, 16, (K, N), generator=gen)
    zeros = torch.randint(0, 16, (G, N), generator=gen)
    scales = _scales(G, N, scale_dtype, gen)
    qweight, qzeros = pack_along_n(codes, _AWQ_ORDER), pack_along_n(zeros, _AWQ_ORDER)
    w = from_awq(qweight, qzeros, scales)
    assert w.qweight.shape == (N, K // 2) and w.group_size == gs and w.perm is None
    assert torch.equal(w.scales, scales) and w.zeros.dtype == scale_dtype
    assert torch.equal(unpack_codes(w.qweight), codes.t())
    assert torch.equal(w.zeros, zeros.to(scale_dtype))
    assert torch.equal(dequant(w), awq_weight(qweight, qzeros, scales))


def test_awq_known_words():
    """Pinned values: codes 0..7 in columns 0..7 pack to 0x75316420 (nibble i = column
    AWQ_ORDER[i])."""
    K, N = 8, 8
    qweight = torch.full((K, 1), 0x75316420, dtype=torch.int32)
    qzeros = torch.tensor([[0x75316420]], dtype=torch.int32)
    scales = torch.full((1, N), 0.5, dtype=F16)
    assert torch.equal(pack_along_n(torch.arange(8)[None, :], _AWQ_ORDER), qzeros)
    w = from_awq(qweight, qzeros, scales)
    assert torch.equal(unpack_codes(w.qweight), torch.arange(8)[:, None].expand(N, K))
    assert torch.equal(w.zeros[0], torch.arange(8, dtype=F16))
    assert torch.equal(dequant(w), torch.zeros(N, K, dtype=F64))
    w0 = from_awq(qweight, torch.zeros(1, 1, dtype=torch.int32), scales)
    assert torch.equal(dequant(w0)[:, 0], torch.arange(8, dtype=F64) * 0.5)


def test_wrong_nibble_order_is_detected():
    """The comparisons above can fail: a swapped nibble order or the wrong packing order changes
    the weight."""
    K, N, gs = 256, 64, 32
    qweight, qzeros, scales, g_idx, _, _ = _gptq_case(K, N, gs, False, seed=13)
    w = from_gptq(qweight, qzeros, scales, g_idx)
    expected = gptq_weight(qweight, qzeros, scales, g_idx, "gptq")
    assert torch.equal(dequant(w), expected)
    swapped = (w.qweight << 4) | (w.qweight >> 4)
    bad = Int4Weight(swapped, w.scales, w.zeros, w.group_size)
    assert not torch.equal(dequant(bad), expected)
    # the v1 / v2 zero conventions differ
    assert not torch.equal(
        dequant(from_gptq(qweight, qzeros, scales, g_idx, checkpoint_format="gptq_v2")), expected
    )
    # AWQ codes packed in plain (GPTQ-style) order are not read as the same codes
    gen = _gen(17)
    codes = torch.randint(0, 16, (K, N), generator=gen)
    zeros = torch.randint(0, 16, (K // gs, N), generator=gen)
    awq_scales = _scales(K // gs, N, F16, gen)
    plain = from_awq(pack_along_n(codes, _GPTQ_ORDER), pack_along_n(zeros, _GPTQ_ORDER), awq_scales)
    assert not torch.equal(unpack_codes(plain.qweight), codes.t())


# ----------------------------------------------------------------------------------------------
# State dicts
# ----------------------------------------------------------------------------------------------


def test_load_state_dicts():
    K, N, gs = 256, 64, 32
    qweight, qzeros, scales, g_idx, _, _ = _gptq_case(K, N, gs, True, seed=19)
    sd = {"m.q.qweight": qweight, "m.q.qzeros": qzeros, "m.q.scales": scales, "m.q.g_idx": g_idx}
    direct = from_gptq(qweight, qzeros, scales, g_idx)
    for prefix in ("m.q", "m.q."):
        w = load_gptq_state_dict(sd, prefix)
        assert torch.equal(w.qweight, direct.qweight) and torch.equal(w.perm, direct.perm)
    no_g_idx = load_gptq_state_dict({k: v for k, v in sd.items() if not k.endswith("g_idx")}, "m.q")
    assert no_g_idx.perm is None
    with pytest.raises(KeyError, match=r"m\.k\.qweight"):
        load_gptq_state_dict(sd, "m.k")
    aqw, aqz = pack_along_n(torch.zeros(K, N, dtype=torch.long), _AWQ_ORDER), qzeros
    w = load_awq_state_dict({"l.qweight": aqw, "l.qzeros": aqz, "l.scales": scales}, "l")
    assert w.shape == (N, K)
    with pytest.raises(KeyError, match=r"l\.scales"):
        load_awq_state_dict({"l.qweight": aqw, "l.qzeros": aqz}, "l")


# ----------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------


def _good_gptq(K=256, N=64, gs=32):
    qweight, qzeros, scales, g_idx, _, _ = _gptq_case(K, N, gs, True, seed=23)
    return qweight, qzeros, scales, g_idx


def _move_one_column(g_idx: torch.Tensor) -> torch.Tensor:
    """A monotonic g_idx with one column of group 0 moved to group 1: groups of 31 and 33."""
    g = torch.sort(g_idx).values.clone()
    g[0] = 1
    return g


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: {**a, "qweight": a["qweight"].long()}, TypeError, "qweight must be int32"),
        (lambda a: {**a, "qweight": a["qweight"].float()}, TypeError, "qweight must be int32"),
        (lambda a: {**a, "qweight": a["qweight"].flatten()}, ValueError, "qweight must be 2D"),
        (lambda a: {**a, "qweight": a["qweight"].numpy()}, TypeError, "qweight must be a torch.Tensor"),
        (lambda a: {**a, "qzeros": a["qzeros"].to(torch.int16)}, TypeError, "qzeros must be int32"),
        (lambda a: {**a, "qzeros": a["qzeros"][:, :-1]}, ValueError, "qzeros has shape"),
        (lambda a: {**a, "qzeros": a["qzeros"][:-1]}, ValueError, "qzeros has shape"),
        (lambda a: {**a, "scales": a["scales"].float()}, TypeError, "scales must be float16 or bfloat16"),
        (lambda a: {**a, "scales": a["scales"][0]}, ValueError, "scales must be 2D"),
        (lambda a: {**a, "scales": a["scales"][:, :-8]}, ValueError, "scales has shape"),
        (
            lambda a: {**a, "qweight": a["qweight"][:, :60], "scales": a["scales"][:, :60]},
            ValueError,
            "multiple of 8",
        ),
        (lambda a: {**a, "qzeros": a["qzeros"][:-1], "scales": a["scales"][:-1]}, ValueError, "must divide"),
        (lambda a: {**a, "g_idx": a["g_idx"][:-1]}, ValueError, "g_idx has shape"),
        (lambda a: {**a, "g_idx": a["g_idx"].float()}, TypeError, "g_idx must be an int32 or int64"),
        (lambda a: {**a, "g_idx": a["g_idx"].to(torch.int16)}, TypeError, "g_idx must be an int32 or int64"),
        (lambda a: {**a, "g_idx": torch.where(a["g_idx"] == 0, 8, a["g_idx"])}, ValueError, r"g_idx values"),
        (lambda a: {**a, "g_idx": torch.where(a["g_idx"] == 0, -1, a["g_idx"])}, ValueError, r"g_idx values"),
        (
            lambda a: {**a, "g_idx": _move_one_column(a["g_idx"])},
            ValueError,
            "g_idx puts 31 columns in group 0",
        ),
        (lambda a: {**a, "g_idx": torch.zeros_like(a["g_idx"])}, ValueError, "g_idx puts"),
    ],
)
def test_gptq_bad_inputs(change, error, match):
    qweight, qzeros, scales, g_idx = _good_gptq()
    args = change({"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx})
    with pytest.raises(error, match=match):
        from_gptq(args["qweight"], args["qzeros"], args["scales"], args["g_idx"])


def test_gptq_bad_options():
    qweight, qzeros, scales, g_idx = _good_gptq()
    from_gptq(qweight, qzeros, scales, g_idx)  # the baseline is valid
    for bits in (2, 3, 8):
        with pytest.raises(ValueError, match=f"bits={bits} is not supported"):
            from_gptq(qweight, qzeros, scales, g_idx, bits=bits)
    with pytest.raises(ValueError, match="checkpoint_format"):
        from_gptq(qweight, qzeros, scales, g_idx, checkpoint_format="gptq_v3")
    with pytest.raises(ValueError, match="sym"):
        from_gptq(qweight, qzeros, scales, g_idx, sym="yes")
    with pytest.raises(ValueError, match="sym=True"):  # random zeros are not all 8
        from_gptq(qweight, qzeros, scales, g_idx, sym=True)
    # K = 24, G = 8: group_size 3 cannot hold whole bytes
    with pytest.raises(ValueError, match="must be even"):
        from_gptq(qweight[:3], qzeros[:1].expand(8, -1), scales[:1].expand(8, -1), None)


def _good_awq(K=256, N=64, gs=32):
    gen = _gen(29)
    codes = torch.randint(0, 16, (K, N), generator=gen)
    zeros = torch.randint(0, 16, (K // gs, N), generator=gen)
    return pack_along_n(codes, _AWQ_ORDER), pack_along_n(zeros, _AWQ_ORDER), _scales(K // gs, N, F16, gen)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: {**a, "qweight": a["qweight"].long()}, TypeError, "qweight must be int32"),
        (lambda a: {**a, "qweight": a["qweight"][0]}, ValueError, "qweight must be 2D"),
        (lambda a: {**a, "qweight": a["qweight"][:, :-1]}, ValueError, "qweight has shape"),
        (lambda a: {**a, "qweight": a["qweight"].t().contiguous()}, ValueError, "qweight has shape"),
        (lambda a: {**a, "qzeros": a["qzeros"].float()}, TypeError, "qzeros must be int32"),
        (lambda a: {**a, "qzeros": a["qzeros"][:, :-1]}, ValueError, "qzeros has shape"),
        (lambda a: {**a, "qzeros": a["qzeros"][:-1]}, ValueError, "qzeros has shape"),
        (lambda a: {**a, "scales": a["scales"].double()}, TypeError, "scales must be float16 or bfloat16"),
        (lambda a: {**a, "scales": a["scales"][:, :60]}, ValueError, "multiple of 8"),
        (lambda a: {**a, "scales": a["scales"][:, :56]}, ValueError, "qweight has shape"),
        (lambda a: {**a, "scales": a["scales"][:-1], "qzeros": a["qzeros"][:-1]}, ValueError, "must divide"),
    ],
)
def test_awq_bad_inputs(change, error, match):
    qweight, qzeros, scales = _good_awq()
    from_awq(qweight, qzeros, scales)  # the baseline is valid
    args = change({"qweight": qweight, "qzeros": qzeros, "scales": scales})
    with pytest.raises(error, match=match):
        from_awq(args["qweight"], args["qzeros"], args["scales"])
