use crate::{Instruction, TypeHash};
use alloc::{string::String, vec::Vec};
use core::fmt::{Display, Write};

use crate::OperationReflect;

use super::Variable;

#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[derive(Debug, Clone, TypeHash, PartialEq, Eq, Hash, OperationReflect)]
#[operation(opcode_name = TmaOpCode)]
/// Operations available on a barrier
pub enum TmaOps {
    TmaStore {
        source: Variable,
        coordinates: Vec<Variable>,
        offset_source: Variable,
    },
    CommitGroup,
    WaitGroup {
        max_pending: u32,
    },
    WaitGroupRead {
        max_pending: u32,
    },
    /// smp-burn addition: `cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32`.
    /// Adds `bytes` bytes of f32 from shared memory `source` (at element `offset_source` of
    /// its item type) into the instruction's output, a global array, at element `offset_out`
    /// of its item type. Asynchronous: the issuing thread commits it with `CommitGroup` and
    /// must `WaitGroupRead` before the shared memory is written again. Both addresses and
    /// `bytes` must be multiples of 16; the writes to `source` must be made visible to the
    /// async proxy first (`fence.proxy.async.shared::cta`, then a barrier).
    BulkReduceAddF32 {
        source: Variable,
        offset_source: Variable,
        offset_out: Variable,
        bytes: Variable,
    },
    /// smp-burn addition: `wgmma.fence.sync.aligned`. Orders this warpgroup's earlier register
    /// accesses (the accumulators, the A fragments) before its next `wgmma.mma_async`.
    WgmmaFence,
    /// smp-burn addition: `wgmma.commit_group.sync.aligned`.
    WgmmaCommitGroup,
    /// smp-burn addition: `wgmma.wait_group.sync.aligned max_pending`: until at most
    /// `max_pending` committed groups of this warpgroup are still running.
    WgmmaWaitGroup {
        max_pending: u32,
    },
    /// smp-burn addition: an empty `asm volatile` that reads and writes every register of the
    /// `accumulators` (arrays, as in `WgmmaSs`), so that the compiler moves no access to them
    /// across it: after a `WgmmaWaitGroup` (whose asynchronous writes it cannot see) and
    /// before a `WgmmaFence`.
    WgmmaFenceOperands {
        accumulators: Vec<Variable>,
    },
    /// smp-burn addition: the 64-bit shared-memory matrix descriptor of a `wgmma` operand that
    /// starts at element `offset_source` of `source` (the instruction's output, a u64).
    /// `leading_bytes` and `stride_bytes` are the descriptor's leading- and stride-dimension
    /// byte offsets; `swizzle` its layout type (0 none, 1 128-byte, 2 64-byte, 3 32-byte).
    WgmmaDescriptor {
        source: Variable,
        offset_source: Variable,
        leading_bytes: u32,
        stride_bytes: u32,
        swizzle: u32,
    },
    /// smp-burn addition: `wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{bf16|f16}` with A and
    /// B from shared-memory descriptors. `accumulators` are `n / 8` local arrays of four f32
    /// each (two vectors of two), the warp's `16 x 8` accumulator tiles in column order; with
    /// `accumulate` 0 they are overwritten, else added to. `f16` 0 for bf16 inputs.
    WgmmaSs {
        desc_a: Variable,
        desc_b: Variable,
        n: u32,
        trans_a: u32,
        trans_b: u32,
        accumulate: u32,
        f16: u32,
        accumulators: Vec<Variable>,
    },
    /// smp-burn addition: as `WgmmaSs`, with A from registers: `a` is a local array holding
    /// the warp's `16 x 16` A fragment as `mma.sync.m16n8k16` holds it (four 32-bit pairs).
    WgmmaRs {
        a: Variable,
        desc_b: Variable,
        n: u32,
        trans_b: u32,
        accumulate: u32,
        f16: u32,
        accumulators: Vec<Variable>,
    },
}

impl Display for TmaOps {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            TmaOps::TmaStore {
                source,
                coordinates,
                offset_source,
            } => {
                let rank = coordinates.len();
                let coords = coordinates.iter().fold(String::new(), |mut s, coord| {
                    let _ = write!(s, ", {coord}");
                    s
                });
                write!(f, "tma_load::<{rank}>({source} + {offset_source} {coords})")
            }
            TmaOps::CommitGroup => write!(f, "memcpy_async_bulk_commit_group()"),
            TmaOps::WaitGroup { max_pending } => {
                write!(f, "tma_wait_group::<{max_pending}>()")
            }
            TmaOps::WaitGroupRead { max_pending } => {
                write!(f, "tma_wait_group_read::<{max_pending}>()")
            }
            TmaOps::BulkReduceAddF32 {
                source,
                offset_source,
                offset_out,
                bytes,
            } => write!(
                f,
                "bulk_reduce_add_f32(out + {offset_out}, {source} + {offset_source}, {bytes})"
            ),
            TmaOps::WgmmaFence => write!(f, "wgmma_fence()"),
            TmaOps::WgmmaCommitGroup => write!(f, "wgmma_commit_group()"),
            TmaOps::WgmmaWaitGroup { max_pending } => {
                write!(f, "wgmma_wait_group::<{max_pending}>()")
            }
            TmaOps::WgmmaFenceOperands { accumulators } => {
                write!(f, "wgmma_fence_operands({} arrays)", accumulators.len())
            }
            TmaOps::WgmmaDescriptor {
                source,
                offset_source,
                leading_bytes,
                stride_bytes,
                swizzle,
            } => write!(
                f,
                "wgmma_descriptor({source} + {offset_source}, {leading_bytes}, {stride_bytes}, {swizzle})"
            ),
            TmaOps::WgmmaSs {
                desc_a,
                desc_b,
                n,
                accumulate,
                accumulators,
                ..
            } => write!(
                f,
                "wgmma_ss::<{n}>({desc_a}, {desc_b}, {accumulate}, {} accumulators)",
                accumulators.len()
            ),
            TmaOps::WgmmaRs {
                a,
                desc_b,
                n,
                accumulate,
                accumulators,
                ..
            } => write!(
                f,
                "wgmma_rs::<{n}>({a}, {desc_b}, {accumulate}, {} accumulators)",
                accumulators.len()
            ),
        }
    }
}

impl From<TmaOps> for Instruction {
    fn from(value: TmaOps) -> Self {
        Instruction::no_out(value)
    }
}
