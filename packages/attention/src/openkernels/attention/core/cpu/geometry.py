"""Which keys each query row sees, per sequence (the mask of reference.py, as ranges).

Query i of a sequence of sq queries sits at key position d = i + sk - sq; it sees keys
lo(i) <= j < hi(i) with lo(i) = max(0, d - left) (0 when left = -1) and
hi(i) = min(sk, d + right + 1) (sk when right = -1). Both grow with i, so a block of rows
[r0, r1) touches keys [lo(r0), hi(r1 - 1)), and the rows that see no key are a prefix
(only a right bound can empty a row when sk > 0: lo(i) <= d < sk always).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Geometry"]


@dataclass(frozen=True)
class Geometry:
    sq: int
    sk: int
    left: int  # -1: unbounded
    right: int  # -1: unbounded; causal is 0

    def lo(self, i: int) -> int:
        """First key row i sees."""
        return 0 if self.left < 0 else max(0, i + self.sk - self.sq - self.left)

    def hi(self, i: int) -> int:
        """One past the last key row i sees (<= lo(i) for an empty row)."""
        return self.sk if self.right < 0 else min(self.sk, i + self.sk - self.sq + self.right + 1)

    def key_range(self, r0: int, r1: int) -> tuple[int, int]:
        """Keys that some row of [r0, r1) sees: [k0, k1), empty when k0 >= k1."""
        return self.lo(r0), self.hi(r1 - 1)

    def empty_rows(self) -> int:
        """How many leading rows see no key (rows sq - sk - right and up see the first key)."""
        if self.sk == 0:
            return self.sq
        return 0 if self.right < 0 else min(self.sq, max(0, self.sq - self.sk - self.right))

    def is_full(self, r0: int, r1: int, k0: int, k1: int) -> bool:
        """Does every row of [r0, r1) see every key of [k0, k1) (no masking needed)?"""
        return self.lo(r1 - 1) <= k0 and k1 <= self.hi(r0)

    def is_causal_square(self) -> bool:
        """Plain causal with sq == sk: top-left and bottom-right alignment agree."""
        return self.sq == self.sk and self.left < 0 and self.right == 0

    def visible(self, r0: int, r1: int, k0: int, k1: int) -> torch.Tensor:
        """(r1 - r0, k1 - k0) bool: row i sees key j."""
        d = torch.arange(r0, r1)[:, None] + (self.sk - self.sq)
        j = torch.arange(k0, k1)[None, :]
        mask = torch.ones(r1 - r0, k1 - k0, dtype=torch.bool)
        if self.left >= 0:
            mask &= j >= d - self.left
        if self.right >= 0:
            mask &= j <= d + self.right
        return mask

    def distance(self, r0: int, r1: int, k0: int, k1: int, dtype: torch.dtype) -> torch.Tensor:
        """(r1 - r0, k1 - k0) |i + sk - sq - j|, ALiBi's distance."""
        d = torch.arange(r0, r1)[:, None] + (self.sk - self.sq)
        return (d - torch.arange(k0, k1)[None, :]).abs().to(dtype)
