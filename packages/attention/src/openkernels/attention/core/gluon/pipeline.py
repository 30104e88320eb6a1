"""Shared-memory rings, mbarriers and warpgroup layouts of the Gluon kernels (kernels.py,
kernels_bwd.py)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def alloc_blocks(desc, SLOTS: gl.constexpr):
    """SLOTS blocks of `desc`'s block shape and layout in shared memory, indexed by slot."""
    # (list + list: the JIT front end takes no starred list displays)
    return gl.allocate_shared_memory(desc.dtype, [SLOTS] + desc.block_type.shape, desc.layout)  # noqa: RUF005


@gluon.jit
def alloc_barriers(N: gl.constexpr, COUNT: gl.constexpr):
    """N mbarriers, each completing a phase after COUNT arrivals (plus the transaction bytes
    an `expect` adds)."""
    bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N):
        mbarrier.init(bars.index(i), count=COUNT)
    return bars


@gluon.constexpr_function
def warpgroup_acc(n):
    """Accumulator layout of one warpgroup's wgmma over 64-row tiles, N = n, 16-bit operands."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def warpgroup_operand(acc_layout):
    """Layout of a 16-bit A operand in registers for a wgmma accumulating into acc_layout
    (an accumulator of the previous product converts to it without shuffles)."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
