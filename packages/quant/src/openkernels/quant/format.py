"""The packed 4-bit weight format every backend of this family reads.

A linear layer's weight W (N, K) (nn.Linear layout: out_features x in_features) becomes

    qweight  (N, K // 2) uint8: the 4-bit codes, two per byte along K; the code of column
             2j sits in the low nibble of byte j, column 2j + 1 in the high nibble.
    scales   (K // group_size, N), float16 or bfloat16: one scale per group of
             `group_size` consecutive columns of a row (group-major, as GPTQ and AWQ
             store theirs, so a tile of N columns reads contiguous scales).
    zeros    (K // group_size, N), the dtype of scales, integer values 0..15 (16 occurs in
             GPTQ v1 checkpoints), or None.

and W is recovered per element as

    kind "int4", zeros given:   W[n, k] = (code - zeros[g, n]) * scales[g, n]
    kind "int4", zeros None:    W[n, k] = (code - 8) * scales[g, n]          (symmetric)
    kind "nf4":                 W[n, k] = NF4_VALUES[code] * scales[g, n]    (zeros None)

with g = k // group_size. An optional `perm` (K,) int64 reorders the input columns first
(GPTQ act-order checkpoints): y = x[..., perm] @ W^T. The layout is the same on every
backend, so converting is done once, when a weight is quantized or loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from openkernels.shared import replay

from . import problem

__all__ = [
    "Int4Weight",
    "NF4_VALUES",
    "KINDS",
    "SCALE_DTYPES",
    "nf4_values",
    "check_parts",
    "check_scale_values",
    "tile_codes",
    "untile_codes",
    "LAYOUTS",
    "LAYOUT_VERSIONS",
    "codes_shape",
    "layout_refusal",
    "rows_of",
]

KINDS = problem.KINDS
SCALE_DTYPES = tuple(getattr(torch, name) for name in problem.SCALE_DTYPES)

# The 16 NF4 levels (normal-float 4-bit, QLoRA / bitsandbytes): quantiles of a standard
# normal scaled to [-1, 1], with an exact zero.
NF4_VALUES: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

_nf4_tables: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def nf4_values(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """NF4_VALUES as a (16,) tensor on `device` (cached: kernels read it on every call; a
    replay.persistent constant, so replayed launches may pass its address)."""
    key = (torch.device(device), dtype)
    table = _nf4_tables.get(key)
    if table is None:
        table = torch.tensor(NF4_VALUES, dtype=dtype, device=key[0])
        _nf4_tables[key] = replay.persistent(table)
    return table


def check_parts(
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    group_size: int,
    kind: str,
    perm: Tensor | None = None,
    *,
    in_features: int | None = None,
    where: str = "Int4Weight",
) -> int:
    """Raise ValueError / TypeError naming the tensor when the parts do not form a valid
    weight (problem.check_parts, plus one device); return in_features (K)."""
    k = problem.check_parts(
        _part(qweight), _part(scales), _part(zeros), group_size, kind, _part(perm),
        in_features=in_features, where=where,
    )  # fmt: skip
    devices = {t.device for t in (qweight, scales, zeros, perm) if t is not None}
    if len(devices) > 1:
        raise ValueError(
            f"{where}: qweight, scales, zeros and perm must be on one device, got {sorted(map(str, devices))}"
        )
    return k


def check_perm_values(perm: Tensor | None, in_features: int, name: str) -> None:
    """ValueError unless `perm` (None, or (K,) int64, checked by check_parts) holds each of
    0..K-1 once: an act-order permutation. Reads its values (a device sync on a GPU), so it
    runs where a weight is built or loaded, never per call."""
    if perm is None or perm.is_meta:
        return
    if not torch.equal(perm.sort().values.cpu(), torch.arange(in_features)):
        raise ValueError(f"{name}: not a permutation of 0..{in_features - 1}")


def tile_codes(qweight: Tensor) -> Tensor:
    """qweight (N, K // 2) uint8 in the tiled layout of the tensor-core GEMV (quant's CUDA
    "tc..." configs): (N // 16, K // 128, 1024) uint8, N a multiple of 16 and K of 128.

    Block [R, c] holds the codes of rows 16 R .. 16 R + 15 in columns 128 c .. 128 c + 127: byte
    h * 512 + 64 g + 16 t + b of it is byte 64 c + 16 t + b of row 16 R + 8 h + g (g < 8, t < 4,
    b < 16; the nibble order inside a byte as in the stored rows). Lane 4 g + t of a warp reads
    its 16 bytes of rows g and g + 8 at 16 (4 g + t) and 512 + 16 (4 g + t): one 512-byte
    contiguous read per warp instruction, where the stored rows give 64 bytes of 8 rows. A
    permutation of 16-byte pieces, nothing recomputed; untile_codes inverts it."""
    if qweight.dim() != 2 or qweight.dtype != torch.uint8:
        raise ValueError(
            f"tile_codes: qweight must be (N, K // 2) uint8, got {tuple(qweight.shape)} {qweight.dtype}"
        )
    n, half_k = qweight.shape
    if n % 16 or half_k % 64:
        raise ValueError(f"tile_codes: N = {n} must be a multiple of 16 and K = {2 * half_k} of 128")
    pieces, unit = _as_units(qweight)
    blocks = pieces.reshape(n // 16, 2, 8, half_k // 64, 4, unit).permute(0, 3, 1, 2, 4, 5)
    return (
        blocks.reshape(n // 16, half_k // 64, 64 * unit)
        .contiguous()
        .view(torch.uint8)
        .reshape(n // 16, half_k // 64, 1024)
    )


def _as_units(codes: Tensor) -> tuple[Tensor, int]:
    """The codes as 8-byte words where their storage allows (contiguous, 8-byte aligned): the
    permutations move 16-byte pieces, and a copy of int64 elements runs several times faster
    than one of bytes (28672 x 8192 on an H100: ~300 us of bytes). Returns (view, elements per
    16-byte piece)."""
    if codes.is_contiguous() and codes.data_ptr() % 8 == 0 and codes.numel() % 8 == 0:
        return codes.view(torch.int64), 2
    return codes, 16


def untile_codes(tiled: Tensor) -> Tensor:
    """tile_codes' input back: (N // 16, K // 128, 1024) uint8 -> (N, K // 2)."""
    if tiled.dim() != 3 or tiled.shape[2] != 1024 or tiled.dtype != torch.uint8:
        raise ValueError(
            f"untile_codes: expected (N // 16, K // 128, 1024) uint8, got {tuple(tiled.shape)} {tiled.dtype}"
        )
    tiles, chunks, _ = tiled.shape
    pieces, unit = _as_units(tiled)
    rows = pieces.reshape(tiles, chunks, 2, 8, 4, unit).permute(0, 2, 3, 1, 4, 5)
    return (
        rows.reshape(16 * tiles, 4 * chunks * unit)
        .contiguous()
        .view(torch.uint8)
        .reshape(16 * tiles, 64 * chunks)
    )


# How an Int4Linear stores its codes (Int4Linear(layout=...), save_quantized's metadata):
# "rows" (N, K // 2), the layout above and every backend's; "tiled" (N // 16, K // 128, 1024),
# tile_codes' layout, which the tensor-core GEMV (sm_90, 1-16 rows of x) reads with a warp's
# 16-byte loads on 512 contiguous bytes. Each layout's version goes into the file's metadata.
LAYOUTS = ("rows", "tiled")
LAYOUT_VERSIONS = {"rows": 1, "tiled": 1}


def layout_refusal(layout: object, out_features: int, in_features: int) -> str | None:
    """Why codes of an (out_features, in_features) weight cannot be stored in `layout` (None:
    they can)."""
    if layout not in LAYOUTS:
        return f"layout must be one of {LAYOUTS}, got {layout!r}"
    if layout == "tiled" and (out_features % 16 or in_features % 128):
        return (
            f"layout 'tiled' needs out_features a multiple of 16 and in_features of 128, got "
            f"{out_features} x {in_features}"
        )
    return None


def codes_shape(layout: str, out_features: int, in_features: int) -> tuple[int, ...]:
    """The codes' shape in `layout` (layout_refusal(...) must be None)."""
    if layout == "tiled":
        return (out_features // 16, in_features // 128, 1024)
    return (out_features, in_features // 2)


def rows_of(codes: Tensor) -> Tensor:
    """The codes in the stored rows (N, K // 2): `codes` itself when 2-D, untile_codes (a copy)
    when tiled."""
    return codes if codes.dim() == 2 else untile_codes(codes)


def _part(t: Tensor | None) -> problem.Part | None:
    return None if t is None else problem.Part(tuple(t.shape), str(t.dtype).removeprefix("torch."))


def check_scale_values(scales: Tensor, name: str) -> None:
    """Raise ValueError naming `name` (the tensor, "from_gptq: scales") when scales hold NaN, infinity or negative values (any
    of them turns the layer's output into garbage or NaN). A pass over the tensor: for
    loading and import, not per call."""
    bad = ~torch.isfinite(scales) | (scales < 0)
    if bool(bad.any()):
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"{name} must be finite and non-negative; {int(bad.sum())} of {scales.numel()} values are not "
            f"(e.g. {scales[first].item()} at {first})"
        )


@dataclass(frozen=True, eq=False)
class Int4Weight(problem.Int4Shape):
    """A 4-bit weight in this family's layout (module docstring): qweight (N, K // 2) uint8,
    scales and zeros (K // group_size, N), kind "int4" or "nf4", optional act-order perm (K,)."""

    qweight: Tensor
    scales: Tensor
    zeros: Tensor | None
    group_size: int
    kind: str = "int4"
    perm: Tensor | None = None

    def __post_init__(self) -> None:
        k = check_parts(self.qweight, self.scales, self.zeros, self.group_size, self.kind, self.perm)
        check_perm_values(self.perm, k, "Int4Weight: perm")
        # The kernels read each part densely: a part of other strides (a transposed copy of the
        # scales, say) is copied once here, not refused by a kernel at every call (which made
        # dispatch give up on that kernel for the rest of the process).
        for name in ("qweight", "scales", "zeros", "perm"):
            part = getattr(self, name)
            if part is not None and not part.is_contiguous():
                object.__setattr__(self, name, part.contiguous())

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def nbytes(self) -> int:
        """Bytes the weight occupies (codes, scales, zeros, perm)."""
        arrays = (self.qweight, self.scales, self.zeros, self.perm)
        return sum(t.numel() * t.element_size() for t in arrays if t is not None)

    def to(self, device: torch.device | str) -> Int4Weight:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Int4Weight(move(self.qweight), move(self.scales), move(self.zeros), self.group_size, self.kind,
                          move(self.perm))  # fmt: skip

    def __repr__(self) -> str:
        return self.describe("Int4Weight", f"{str(self.scales.dtype).removeprefix('torch.')}, {self.device}")
