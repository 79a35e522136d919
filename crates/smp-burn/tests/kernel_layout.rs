//! The shared-memory layout CubeCL gives a kernel must not depend on the process.
//!
//! Upstream cubecl-opt 0.10 assigns shared-memory offsets while iterating a `HashSet` seeded at
//! random, so every process compiled each kernel differently, and the flash forward ran 318 or
//! 335 TFLOP/s by chance. `vendor/cubecl-opt` allocates in
//! ID order. These tests fail with upstream's order: each optimizer's `HashSet` gets new
//! random keys, so six arrays come out in ID order by chance once in 720 runs.

use cubecl::ir::{ElemType, FloatKind, Instruction, Operation, Scope, Type, Variable};
use cubecl::prelude::CubeDim;
use cubecl_opt::{Optimizer, SharedLiveness, SharedMemory};

const ARRAYS: usize = 6;

/// The (id, offset) of every shared allocation of a kernel that declares `ARRAYS` shared
/// arrays of different lengths and reads each once.
fn layout() -> Vec<(u32, usize)> {
    let mut scope = Scope::root(false);
    let f32_ty = Type::scalar(ElemType::Float(FloatKind::F32));
    let arrays: Vec<Variable> = (0..ARRAYS)
        .map(|i| *scope.create_shared_array(f32_ty, 64 + 48 * i, Some(16)))
        .collect();
    let out = *scope.create_local(f32_ty);
    for array in &arrays {
        scope.register(Instruction::new(Operation::Copy(*array), out));
    }
    let mut opt = Optimizer::shared_only(scope, CubeDim::new_1d(32));
    let liveness = opt.analysis::<SharedLiveness>();
    let mut layout: Vec<(u32, usize)> = liveness
        .allocations
        .values()
        .map(|alloc| {
            let id = match alloc.smem {
                SharedMemory::Array { id, .. } | SharedMemory::Value { id, .. } => id,
            };
            (id, alloc.offset)
        })
        .collect();
    layout.sort_unstable();
    layout
}

#[test]
fn shared_memory_is_laid_out_in_declaration_order() {
    let layout = layout();
    assert_eq!(layout.len(), ARRAYS, "{layout:?}");
    assert!(
        layout.windows(2).all(|w| w[0].1 < w[1].1),
        "offsets do not follow the declaration order: {layout:?}"
    );
}

#[test]
fn shared_memory_layout_is_the_same_every_time() {
    let first = layout();
    for _ in 0..4 {
        assert_eq!(layout(), first);
    }
}
