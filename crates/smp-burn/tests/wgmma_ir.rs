//! The warpgroup-MMA operations that `vendor/cubecl-ir` adds must survive CubeCL's optimizer
//! with their accumulator arrays intact.
//!
//! Why: a `wgmma` reads and writes its accumulators as whole arrays (inline PTX operands), while
//! the kernel reads single elements at constant indices. Upstream cubecl-opt's
//! `DisaggregateArray` turns every array whose indices are all constants into scalars; it does
//! not see an operation that takes the array whole, so the `wgmma` would write an array nobody
//! reads and the softmax would read the zeros it started from. `vendor/cubecl-opt` keeps such
//! arrays whole; these tests keep that guard in CI, which has no GPU.
#![cfg(cubecl_wgmma)]

use cubecl::ir::{
    ElemType, FloatKind, IndexAssignOperator, IndexOperator, Instruction, Operation, Operator,
    Scope, TmaOps, Type, UIntKind, Variable, VariableKind,
};
use cubecl::prelude::CubeDim;
use cubecl_opt::Optimizer;

/// Elements per accumulator array (a warp's `16 x 8` fragment: four f32 per lane).
const FRAGMENT: usize = 4;

/// Builds a kernel that zeroes a local array at constant indices, optionally hands it whole to
/// a `wgmma`, then reads element 1 at a constant index into shared memory; optimizes it and
/// returns its instructions.
fn optimized(with_wgmma: bool) -> Vec<Instruction> {
    let mut scope = Scope::root(false);
    let f32_ty = Type::scalar(ElemType::Float(FloatKind::F32));
    let u64_ty = Type::scalar(ElemType::UInt(UIntKind::U64));
    let acc = *scope.create_local_array(f32_ty, FRAGMENT);
    for i in 0..FRAGMENT {
        scope.register(Instruction::new(
            Operator::IndexAssign(IndexAssignOperator {
                index: (i as u32).into(),
                value: 0.0f32.into(),
                vector_size: 0,
                unroll_factor: 1,
            }),
            acc,
        ));
    }
    if with_wgmma {
        let desc = *scope.create_local(u64_ty);
        scope.register(Instruction::new(Operation::Copy(7u64.into()), desc));
        scope.register(Instruction::no_out(TmaOps::WgmmaSs {
            desc_a: desc,
            desc_b: desc,
            n: 8,
            trans_a: 0,
            trans_b: 0,
            accumulate: 1,
            f16: 0,
            accumulators: vec![acc],
        }));
        scope.register(Instruction::no_out(TmaOps::WgmmaCommitGroup));
        scope.register(Instruction::no_out(TmaOps::WgmmaWaitGroup {
            max_pending: 0,
        }));
        scope.register(Instruction::no_out(TmaOps::WgmmaFenceOperands {
            accumulators: vec![acc],
        }));
    }
    let value = *scope.create_local(f32_ty);
    scope.register(Instruction::new(
        Operator::Index(IndexOperator {
            list: acc,
            index: 1u32.into(),
            vector_size: 0,
            unroll_factor: 1,
        }),
        value,
    ));
    let out = *scope.create_shared_array(f32_ty, 4, None);
    scope.register(Instruction::new(
        Operator::IndexAssign(IndexAssignOperator {
            index: 0u32.into(),
            value,
            vector_size: 0,
            unroll_factor: 1,
        }),
        out,
    ));
    let opt = Optimizer::new(scope, CubeDim::new_1d(128), vec![], vec![]);
    opt.node_ids()
        .into_iter()
        .flat_map(|block| {
            opt.block(block)
                .ops
                .borrow()
                .values()
                .cloned()
                .collect::<Vec<_>>()
        })
        .collect()
}

fn local_array_id(var: &Variable) -> Option<u32> {
    match var.kind {
        VariableKind::LocalArray { id, .. } => Some(id),
        _ => None,
    }
}

/// Ids of the local arrays still read element by element after optimization.
fn arrays_indexed(ops: &[Instruction]) -> Vec<u32> {
    ops.iter()
        .filter_map(|op| match &op.operation {
            Operation::Operator(Operator::Index(index) | Operator::UncheckedIndex(index)) => {
                local_array_id(&index.list)
            }
            _ => None,
        })
        .collect()
}

/// The control: without a `wgmma` the pass is active and splits the array, so the test below
/// would see the same if the guard were gone.
#[test]
fn constant_indexed_array_alone_is_split_into_scalars() {
    let ops = optimized(false);
    assert!(
        arrays_indexed(&ops).is_empty(),
        "expected DisaggregateArray to split the array: {ops:#?}"
    );
}

#[test]
fn wgmma_accumulators_stay_one_array() {
    let ops = optimized(true);
    let wgmma_arrays: Vec<u32> = ops
        .iter()
        .filter_map(|op| match &op.operation {
            Operation::Tma(TmaOps::WgmmaSs { accumulators, .. }) => Some(
                accumulators
                    .iter()
                    .filter_map(local_array_id)
                    .collect::<Vec<_>>(),
            ),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(wgmma_arrays.len(), 1, "the wgmma lost its array: {ops:#?}");
    assert!(
        arrays_indexed(&ops).contains(&wgmma_arrays[0]),
        "the read after the wgmma no longer reads its array: {ops:#?}"
    );
    assert!(
        ops.iter().any(|op| matches!(
            op.operation,
            Operation::Tma(TmaOps::WgmmaFenceOperands { .. })
        )),
        "the operand fence was dropped: {ops:#?}"
    );
}
