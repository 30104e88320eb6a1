"""Import of GPTQ and AWQ checkpoints (4-bit, int32-packed) into this family's layout.

Both converters read the tensors of one quantized nn.Linear (out_features N, in_features K)
as the quantization libraries save them and return an `Int4Weight` (format.py) whose
dequantized weight is the one those libraries compute. The conventions below were read in
the projects' own sources; nothing else is assumed.

GPTQ (AutoGPTQ, GPTQModel, transformers / optimum, vLLM)
--------------------------------------------------------
    qweight  (K // 8, N) int32   eight 4-bit codes per word, packed along K: row k of the
                                 weight sits in word k // 8 at bits 4 * (k % 8) .. +3 (the
                                 first row in the lowest bits).
    qzeros   (G, N // 8) int32   eight 4-bit zero points per word, packed along N the same
                                 way: column n in word n // 8 at bits 4 * (n % 8).
    scales   (G, N) float16      one scale per group and output column.
    g_idx    (K,) int32          the group of each input column; k // group_size unless the
                                 checkpoint was quantized with act-order (desc_act=True), where
                                 columns were quantized in a data-dependent order and the groups
                                 are spread over K.

    W[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]

The packing is AutoGPTQ's `QuantLinear.pack` (auto_gptq/nn_modules/qlinear/
qlinear_cuda_old.py: `qweight[row] |= intweight[j] << (bits * (j - i))` over eight input
rows j, and the same loop over output columns for qzeros); the unpacking with shifts
0, 4, .., 28 is the one of its `forward`, of GPTQModel's `PackableQuantLinear.
dequantize_weight` (`gptqmodel/nn_modules/qlinear/__init__.py`) and of vLLM's exllama kernel
(csrc/quantization/gptq/q_gemm.cu), all of which compute
`scales[g_idx] * (weight - zeros[g_idx])` on the (K, N) unpacked weight.

What z is depends on the checkpoint format (`checkpoint_format` in the quantization config;
transformers' `GPTQConfig` documents "gptq" (v1, AutoGPTQ and GPTQModel) and "gptq_v2"
(GPTQModel only)):

    "gptq" (v1):   the stored nibble is zero - 1, so z = nibble + 1. AutoGPTQ's pack does
                   `zeros -= 1` before packing and its forward does `zeros = zeros + 1` after
                   unpacking; vLLM's q_gemm.cu adds `zero_offset = use_v2_format ? 0 : 1` to
                   every unpacked zero; GPTQModel's `convert_gptq_v1_to_v2_format_module`
                   (gptqmodel/utils/model.py) adds 1 to every 4-bit field when loading v1.
    "gptq_v2":     the stored nibble is the zero point, z = nibble (GPTQModel's
                   `dequantize_weight` uses the unpacked zeros as they are).

The +1 is applied per nibble, as AutoGPTQ and vLLM do: a v1 nibble of 15 (written only when
a real zero of 0 underflowed to -1 at packing) gives z = 16, which is what those runtimes
use; GPTQModel's conversion adds 0x11111111 to the whole word and would carry that 1 into
the next nibble instead. A zero of 16 is kept as is (zeros are stored in the scales' float
dtype), so the imported weight dequantizes exactly as AutoGPTQ / vLLM run it.

Symmetric GPTQ (sym=True): the quantizer sets zero = (maxq + 1) / 2 = 8 (`Quantizer.
find_params` in AutoGPTQ's auto_gptq/quantization/quantizer.py and GPTQModel's
gptqmodel/quantization/quantizer.py), so v1 stores nibbles 7 (words 0x77777777) and v2
stores 8; those weights are returned with zeros=None, the symmetric layout
(W = (q - 8) * s).

Act-order: this layout needs each group's columns to be contiguous. When g_idx is not
k // group_size, the columns are put in the stable order of g_idx (perm = argsort(g_idx)),
so column j of the converted weight is column perm[j] of the checkpoint and lies in group
j // group_size, and Int4Weight.perm = perm: x[..., perm] @ W'^T == x @ W^T. Every group
must hold group_size = K // G columns (GPTQ forms its groups that way). vLLM does the same
for its exllama kernel (vllm/model_executor/layers/quantization/gptq.py: `argsort(g_idx)`
before `gptq_shuffle`; q_gemm.cu then reads the input as `a[b_q_perm[k]]`).

AWQ (AutoAWQ, "gemm" version)
-----------------------------
    qweight  (K, N // 8) int32   eight 4-bit codes per word, packed along N in an
                                 interleaved order: nibble i (bits 4i .. 4i+3) of word c
                                 holds column 8c + AWQ_ORDER[i], AWQ_ORDER =
                                 [0, 2, 4, 6, 1, 3, 5, 7]; equivalently column 8c + j sits
                                 at bits 4 * AWQ_REVERSE_ORDER[j], AWQ_REVERSE_ORDER =
                                 [0, 4, 1, 5, 2, 6, 3, 7].
    qzeros   (G, N // 8) int32   the zero points, packed along N in the same order.
    scales   (G, N) float16

    W[n, k] = (q[k, n] - z[k // group_size, n]) * scales[k // group_size, n]

with zeros stored as they are (no offset) and no act-order. Read in AutoAWQ's
`WQLinear_GEMM.from_linear` (awq/modules/linear/gemm.py: `order_map = [0, 2, 4, 6, 1, 3,
5, 7]`, `qweight[:, col] |= intweight[:, col * pack_num + order_map[i]] << (i * w_bit)`,
the same for qzeros) and `dequantize_gemm` (awq/utils/packing_utils.py: unpack with shifts
0, 4, .., 28, reorder with AWQ_REVERSE_ORDER, `(iweight - izeros) * scales`). The "gemv"
and "gemv_fast" AWQ versions pack differently and are not read here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .format import SCALE_DTYPES, Int4Weight, check_scale_values
from .quantize import pack_codes

__all__ = [
    "from_gptq",
    "from_awq",
    "load_gptq_state_dict",
    "load_awq_state_dict",
    "GPTQ_FORMATS",
    "AWQ_ORDER",
    "AWQ_REVERSE_ORDER",
]

GPTQ_FORMATS = ("gptq", "gptq_v2")
# AutoAWQ's interleaving of the eight columns of a word: nibble i holds column AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Its inverse: column j of a word sits in nibble AWQ_REVERSE_ORDER[j].
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

_PACK = 8  # 4-bit fields per int32 word


def _check_int32_2d(t: object, name: str, shape_text: str, where: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor {shape_text} int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(
            f"{where}: {name} must be int32 {shape_text} (eight 4-bit fields per word), got {t.dtype}"
        )
    if t.dim() != 2:
        raise ValueError(f"{where}: {name} must be 2D {shape_text}, got shape {tuple(t.shape)}")
    return t


def _check_scales(scales: object, where: str) -> Tensor:
    if not isinstance(scales, Tensor):
        raise TypeError(f"{where}: scales must be a torch.Tensor (G, N), got {type(scales).__name__}")
    if scales.dtype not in SCALE_DTYPES:
        raise TypeError(f"{where}: scales must be float16 or bfloat16 (G, N), got {scales.dtype}")
    if scales.dim() != 2:
        raise ValueError(f"{where}: scales must be 2D (G, N), got shape {tuple(scales.shape)}")
    check_scale_values(scales, f"{where}: scales")
    return scales


def _check_devices(where: str, **tensors: Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"{where}: all tensors must be on one device, got {listed}")


def _unpack_along_rows(packed: Tensor, shifts: Tensor) -> Tensor:
    """(R, C) int32 -> (8 R, C) int64 fields: row 8 r + i from bits shifts[i] of word (r, c)."""
    # (R, 8, C); the arithmetic shift of a negative word still yields its bits 4i .. 4i+3.
    fields = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & 0xF
    return fields.reshape(-1, packed.shape[1]).long()


def _unpack_along_cols(packed: Tensor, shifts: Tensor) -> Tensor:
    """(R, C) int32 -> (R, 8 C) int64 fields: column 8 c + j from bits shifts[j] of word (r, c)."""
    fields = (packed.unsqueeze(2) >> shifts.view(1, 1, -1)) & 0xF  # (R, C, 8)
    return fields.reshape(packed.shape[0], -1).long()


def _shifts(order: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.tensor([4 * i for i in order], dtype=torch.int32, device=device)


def _finish(
    codes_kn: Tensor,
    scales: Tensor,
    zeros_gn: Tensor,
    group_size: int,
    sym: bool | None,
    perm: Tensor | None,
    where: str,
) -> Int4Weight:
    """Int4Weight from codes (K, N) int64 (already in perm order), scales (G, N) and integer
    zeros (G, N) int64."""
    all_eight = bool((zeros_gn == 8).all())
    if sym is True and not all_eight:
        bad = sorted({int(v) for v in zeros_gn[zeros_gn != 8].unique()[:4]})
        raise ValueError(
            f"{where}: sym=True but qzeros decodes to zero points other than 8 (e.g. {bad}); "
            "pass sym=False or sym=None for an asymmetric checkpoint"
        )
    symmetric = all_eight if sym is None else bool(sym)
    qweight = pack_codes(codes_kn.t())  # (N, K // 2) uint8
    zeros = None if symmetric else zeros_gn.to(scales.dtype).contiguous()
    return Int4Weight(qweight.contiguous(), scales.contiguous(), zeros, group_size, "int4", perm)


def _group_size(where: str, qzeros: Tensor, scales: Tensor, k: int, k_source: str = "") -> int:
    """K // G, G from the scales (G, N): checks that qzeros is (G, N // 8), that G divides K
    (`k_source` says where K came from) and that the groups hold an even count of columns."""
    groups, n = scales.shape
    if tuple(qzeros.shape) != (groups, n // _PACK):
        raise ValueError(
            f"{where}: qzeros has shape {tuple(qzeros.shape)}, expected (G, N // 8) = ({groups}, {n // _PACK}) "
            f"from scales {tuple(scales.shape)}"
        )
    if groups == 0 or k % groups:
        raise ValueError(
            f"{where}: scales has G = {groups} groups, which must divide in_features K = {k}{k_source}"
        )
    group_size = k // groups
    if group_size % 2:
        raise ValueError(f"{where}: group_size K // G = {group_size} must be even (two codes per byte)")
    return group_size


def from_gptq(
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    g_idx: Tensor | None = None,
    *,
    bits: int = 4,
    checkpoint_format: str = "gptq",
    sym: bool | None = None,
) -> Int4Weight:
    """Convert the tensors of a GPTQ-quantized linear layer (module docstring) to an Int4Weight.

    Args:
        qweight: (K // 8, N) int32, codes packed along K, first row in the lowest bits.
        qzeros: (G, N // 8) int32, zero points packed along N, first column lowest.
        scales: (G, N) float16 or bfloat16; G divides K and group_size = K // G.
        g_idx: (K,) int32 or int64 group of each input column, or None for k // group_size.
            A g_idx that is not k // group_size (act-order) sets the result's perm.
        bits: must be 4 (only 4-bit checkpoints are read).
        checkpoint_format: "gptq" (v1: stored zero = zero - 1) or "gptq_v2" (stored as is).
        sym: True: the checkpoint is symmetric (every zero point 8; else ValueError) and the
            result has zeros=None. False: zeros are kept even when all are 8. None (default):
            zeros=None exactly when every zero point is 8.

    Returns:
        Int4Weight of kind "int4": qweight (N, K // 2) uint8, scales (G, N) as given, zeros
        (G, N) in the scales' dtype or None, group_size K // G, perm (K,) int64 or None.
        Dequantized (with perm applied to the input) it equals the checkpoint's weight.
    """
    where = "from_gptq"
    if bits != 4:
        raise ValueError(
            f"{where}: bits={bits} is not supported; only 4-bit GPTQ checkpoints can be imported"
        )
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"{where}: checkpoint_format must be one of {GPTQ_FORMATS}, got {checkpoint_format!r}"
        )
    if sym not in (None, True, False):
        raise ValueError(f"{where}: sym must be None, True or False, got {sym!r}")
    _check_int32_2d(qweight, "qweight", "(K // 8, N)", where)
    _check_int32_2d(qzeros, "qzeros", "(G, N // 8)", where)
    _check_scales(scales, where)
    k = qweight.shape[0] * _PACK
    n = qweight.shape[1]
    groups = scales.shape[0]
    if k == 0 or n == 0:
        raise ValueError(f"{where}: qweight has shape {tuple(qweight.shape)}; K and N must be positive")
    if scales.shape[1] != n:
        raise ValueError(
            f"{where}: scales has shape {tuple(scales.shape)} but qweight {tuple(qweight.shape)} "
            f"has N = {n} output columns; expected scales (G, {n})"
        )
    if n % _PACK:
        raise ValueError(
            f"{where}: out_features N = {n} must be a multiple of 8 (qzeros packs 8 columns per int32)"
        )
    group_size = _group_size(where, qzeros, scales, k, " (8 * qweight.shape[0])")
    if g_idx is not None:
        if not isinstance(g_idx, Tensor) or g_idx.dtype not in (torch.int32, torch.int64):
            got = g_idx.dtype if isinstance(g_idx, Tensor) else type(g_idx).__name__
            raise TypeError(f"{where}: g_idx must be an int32 or int64 tensor (K,), got {got}")
        if tuple(g_idx.shape) != (k,):
            raise ValueError(f"{where}: g_idx has shape {tuple(g_idx.shape)}, expected (K,) = ({k},)")
    _check_devices(where, qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)

    device = qweight.device
    shifts = _shifts(tuple(range(_PACK)), device)
    codes = _unpack_along_rows(qweight, shifts)  # (K, N)
    zeros = _unpack_along_cols(qzeros, shifts)  # (G, N)
    if checkpoint_format == "gptq":
        zeros = zeros + 1

    perm = None
    if g_idx is not None:
        g = g_idx.long()
        if int(g.min()) < 0 or int(g.max()) >= groups:
            raise ValueError(
                f"{where}: g_idx values must lie in [0, G) = [0, {groups}), got min {int(g.min())} max {int(g.max())}"
            )
        counts = torch.bincount(g, minlength=groups)
        if bool((counts != group_size).any()):
            bad = int(torch.nonzero(counts != group_size)[0, 0])
            raise ValueError(
                f"{where}: g_idx puts {int(counts[bad])} columns in group {bad}; every group must hold "
                f"K // G = {group_size} columns to be laid out as contiguous groups"
            )
        trivial = torch.arange(k, device=device) // group_size
        if not torch.equal(g, trivial):
            perm = torch.argsort(g, stable=True)
            codes = codes[perm]

    return _finish(codes, scales, zeros, group_size, sym, perm, where)


def from_awq(qweight: Tensor, qzeros: Tensor, scales: Tensor) -> Int4Weight:
    """Convert the tensors of an AutoAWQ "gemm" linear layer (module docstring) to an Int4Weight.

    Args:
        qweight: (K, N // 8) int32, codes packed along N in AutoAWQ's interleaved order.
        qzeros: (G, N // 8) int32, zero points packed the same way (stored as is).
        scales: (G, N) float16 or bfloat16; G divides K and group_size = K // G.

    Returns:
        Int4Weight of kind "int4": qweight (N, K // 2) uint8, scales (G, N) as given, zeros
        (G, N) in the scales' dtype (AWQ is asymmetric), group_size K // G, no perm.
    """
    where = "from_awq"
    _check_int32_2d(qweight, "qweight", "(K, N // 8)", where)
    _check_int32_2d(qzeros, "qzeros", "(G, N // 8)", where)
    _check_scales(scales, where)
    k, words = qweight.shape
    n = scales.shape[1]
    if k == 0 or words == 0:
        raise ValueError(f"{where}: qweight has shape {tuple(qweight.shape)}; K and N must be positive")
    if n % _PACK:
        raise ValueError(
            f"{where}: out_features N = {n} (scales.shape[1]) must be a multiple of 8 "
            f"(qweight and qzeros pack 8 columns per int32)"
        )
    if words * _PACK != n:
        raise ValueError(
            f"{where}: qweight has shape {tuple(qweight.shape)}, expected (K, N // 8) with N = {n} from "
            f"scales {tuple(scales.shape)}, i.e. {n // _PACK} int32 per row"
        )
    group_size = _group_size(where, qzeros, scales, k)
    _check_devices(where, qweight=qweight, qzeros=qzeros, scales=scales)

    shifts = _shifts(AWQ_REVERSE_ORDER, qweight.device)
    codes = _unpack_along_cols(qweight, shifts)  # (K, N)
    zeros = _unpack_along_cols(qzeros, shifts)  # (G, N)
    return _finish(codes, scales, zeros, group_size, False, None, where)


def _get(state_dict: Mapping[str, Tensor], prefix: str, name: str, required: bool = True) -> Tensor | None:
    key = f"{prefix}{name}"
    if key not in state_dict:
        if required:
            raise KeyError(f"state_dict has no {key!r}")
        return None
    return state_dict[key]


def _prefix(prefix: str) -> str:
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


def load_gptq_state_dict(
    state_dict: Mapping[str, Tensor],
    prefix: str,
    *,
    bits: int = 4,
    checkpoint_format: str = "gptq",
    sym: bool | None = None,
) -> Int4Weight:
    """`from_gptq` on `{prefix}.qweight`, `.qzeros`, `.scales` and `.g_idx` (optional) of a
    state dict (e.g. safetensors.torch.load_file of a GPTQ checkpoint); prefix is the layer's
    module path, such as "model.layers.0.self_attn.q_proj". The bias, if any, is not read."""
    p = _prefix(prefix)
    return from_gptq(
        _get(state_dict, p, "qweight"),
        _get(state_dict, p, "qzeros"),
        _get(state_dict, p, "scales"),
        _get(state_dict, p, "g_idx", required=False),
        bits=bits,
        checkpoint_format=checkpoint_format,
        sym=sym,
    )


def load_awq_state_dict(state_dict: Mapping[str, Tensor], prefix: str) -> Int4Weight:
    """`from_awq` on `{prefix}.qweight`, `.qzeros` and `.scales` of a state dict (see
    `load_gptq_state_dict`). The bias, if any, is not read."""
    p = _prefix(prefix)
    return from_awq(
        _get(state_dict, p, "qweight"), _get(state_dict, p, "qzeros"), _get(state_dict, p, "scales")
    )
