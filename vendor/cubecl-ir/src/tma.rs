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
        }
    }
}

impl From<TmaOps> for Instruction {
    fn from(value: TmaOps) -> Self {
        Instruction::no_out(value)
    }
}
