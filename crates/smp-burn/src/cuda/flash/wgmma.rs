//! Hopper's warpgroup MMA (`wgmma.mma_async`, sm_90a) for CubeCL kernels.
//!
//! Why: `mma.sync` tiles held by single warps top out well below what an H200's tensor cores
//! do (the flash kernels reach 335-360 TFLOP/s forward on them, FlashAttention-3 over 600 on
//! `wgmma`). A `wgmma` is issued by a warpgroup (four warps, 128 threads) for a 64-row tile,
//! reads its B operand (and optionally A) straight from shared memory through a 64-bit matrix
//! descriptor, and runs asynchronously: the warps go on until they wait for its group.
//!
//! CubeCL 0.10 emits none of it; the workspace's `vendor/cubecl-ir` and `vendor/cubecl-cpp`
//! add the operations (`TmaOps::Wgmma*`), announced to `build.rs` as `cfg(cubecl_wgmma)`. A
//! crates.io build against upstream CubeCL has [`WGMMA_BUILT`] false and never launches a
//! kernel that uses them.
//!
//! Accumulators are handed over as the `Sequence` of `16 x 8` fragments the `mma.sync` code
//! already uses (two vectors of two f32 each): a warp's part of an `m64nN` accumulator is
//! exactly `N / 8` such fragments in column order, so the softmax and output code of the
//! `mma.sync` kernels works on them unchanged. Likewise a register A operand is the
//! `m16n8k16` A fragment (four pairs).

use cubecl::prelude::*;

/// Whether this build can emit `wgmma` (the workspace's vendored CubeCL crates).
pub const WGMMA_BUILT: bool = cfg!(cubecl_wgmma);

/// Shared-memory layout type of a descriptor: the 128-byte swizzle (16-byte chunk `c` of
/// 128-byte row `r` stored at chunk `c ^ (r % 8)`, atoms of 8 rows 1024-byte aligned).
pub const SWIZZLE_128B: u32 = 1;

/// `wgmma.fence.sync.aligned`: needed before the first `wgmma` and whenever the warpgroup has
/// touched the accumulator or A registers since (the hardware reads them asynchronously).
pub(super) fn wgmma_fence() {
    panic!("cube functions run only inside kernels")
}

/// The expansion of [`wgmma_fence`].
pub(super) mod wgmma_fence {
    use cubecl::prelude::*;

    /// Registers the operation; see [`super::wgmma_fence`].
    pub fn expand(scope: &mut Scope) {
        super::register(scope, super::ops::fence, None);
    }
}

/// `wgmma.commit_group.sync.aligned`: closes the group of `wgmma`s issued since the last one.
pub(super) fn wgmma_commit_group() {
    panic!("cube functions run only inside kernels")
}

/// The expansion of [`wgmma_commit_group`].
pub(super) mod wgmma_commit_group {
    use cubecl::prelude::*;

    /// Registers the operation; see [`super::wgmma_commit_group`].
    pub fn expand(scope: &mut Scope) {
        super::register(scope, super::ops::commit, None);
    }
}

/// `wgmma.wait_group.sync.aligned max_pending`: waits until at most `max_pending` committed
/// groups are in flight; only then may their accumulators be read or their shared-memory
/// operands be overwritten.
#[allow(unused_variables)]
pub(super) fn wgmma_wait_group(max_pending: u32) {
    panic!("cube functions run only inside kernels")
}

/// The expansion of [`wgmma_wait_group`].
pub(super) mod wgmma_wait_group {
    use cubecl::prelude::*;

    /// Registers the operation; see [`super::wgmma_wait_group`].
    pub fn expand(scope: &mut Scope, max_pending: u32) {
        super::register(scope, || super::ops::wait(max_pending), None);
    }
}

/// Pins the accumulator registers in `acc` at this point of the program: after
/// [`wgmma_wait_group`] (the compiler cannot see the asynchronous writes and might otherwise
/// read them earlier) and before [`wgmma_fence`] (so no access is moved past the `wgmma`s),
/// as CUTLASS's `warpgroup_fence_operand` does.
#[allow(unused_variables)]
pub(super) fn wgmma_fence_operands(acc: &mut Sequence<Array<Vector<f32, Const<2>>>>) {
    panic!("cube functions run only inside kernels")
}

/// The expansion of [`wgmma_fence_operands`].
pub(super) mod wgmma_fence_operands {
    use cubecl::prelude::*;

    /// Registers the operation; see [`super::wgmma_fence_operands`].
    pub fn expand(scope: &mut Scope, acc: SequenceExpand<Array<Vector<f32, Const<2>>>>) {
        let accumulators: Vec<_> = acc.iter_cloned().map(|f| *f.expand).collect();
        super::register(scope, || super::ops::fence_operands(accumulators), None);
    }
}

/// The matrix descriptor of a `wgmma` operand whose tile starts at element `offset` of
/// `smem` (offsets in `smem`'s item type), with the given leading- and stride-dimension byte
/// offsets and layout type ([`SWIZZLE_128B`]).
#[allow(unused_variables)]
pub(super) fn wgmma_descriptor<S: CubePrimitive>(
    smem: &SharedMemory<S>,
    offset: usize,
    leading_bytes: u32,
    stride_bytes: u32,
    swizzle: u32,
) -> u64 {
    panic!("cube functions run only inside kernels")
}

/// The expansion of [`wgmma_descriptor`].
pub(super) mod wgmma_descriptor {
    use cubecl::ir::{ElemType, Type, UIntKind};
    use cubecl::prelude::*;

    /// Registers the operation; see [`super::wgmma_descriptor`].
    pub fn expand<S: CubePrimitive>(
        scope: &mut Scope,
        smem: NativeExpand<SharedMemory<S>>,
        offset: NativeExpand<usize>,
        leading_bytes: u32,
        stride_bytes: u32,
        swizzle: u32,
    ) -> NativeExpand<u64> {
        let out = scope.create_local(Type::scalar(ElemType::UInt(UIntKind::U64)));
        let (source, offset) = (*smem.expand, *offset.expand);
        super::register(
            scope,
            || super::ops::descriptor(source, offset, leading_bytes, stride_bytes, swizzle),
            Some(*out),
        );
        out.into()
    }
}

/// `desc` ([`wgmma_descriptor`]) moved `chunks` 16-byte units further into its buffer: the
/// start address field counts 16-byte units from bit 0, and shared addresses stay below its
/// 18-bit reach, so this is the same value [`wgmma_descriptor`] gives for the later offset.
/// Why: a 64-bit add of a constant is two instructions where a fresh descriptor is about five
/// (address, mask, shift, fields), and a block issues dozens of `wgmma`s per thread.
#[cube]
pub(super) fn wgmma_descriptor_at(desc: u64, #[comptime] chunks: usize) -> u64 {
    desc + u64::new(comptime!(chunks as i64))
}

/// `acc (+)= A B` for this warpgroup's `64 x n` tile, both operands from shared memory
/// (descriptors `desc_a` over 64 rows by 16 of the contraction, `desc_b` over 16 by `n`).
/// `acc` holds the warp's `n / 8` fragments; `accumulate` 0 overwrites them. `trans_a` /
/// `trans_b` 1 read an operand stored MN-major (the M or N index contiguous) instead of
/// K-major. Asynchronous: see the module doc.
// `F` picks the instruction's input type (bf16 or f16) at expansion.
#[allow(unused_variables, clippy::extra_unused_type_parameters)]
pub(super) fn wgmma_ss<F: Float>(
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    desc_a: u64,
    desc_b: u64,
    n: u32,
    trans_a: u32,
    trans_b: u32,
    accumulate: u32,
) {
    panic!("cube functions run only inside kernels")
}

/// The expansion of [`wgmma_ss`].
pub(super) mod wgmma_ss {
    use cubecl::prelude::*;

    /// Registers the operation; see [`super::wgmma_ss`].
    #[allow(clippy::too_many_arguments)]
    pub fn expand<F: Float>(
        scope: &mut Scope,
        acc: SequenceExpand<Array<Vector<f32, Const<2>>>>,
        desc_a: NativeExpand<u64>,
        desc_b: NativeExpand<u64>,
        n: u32,
        trans_a: u32,
        trans_b: u32,
        accumulate: u32,
    ) {
        let f16 = super::is_f16::<F>(scope);
        let accumulators = super::fragments(&acc, n);
        let (desc_a, desc_b) = (*desc_a.expand, *desc_b.expand);
        super::register(
            scope,
            || {
                super::ops::ss(
                    desc_a,
                    desc_b,
                    n,
                    trans_a,
                    trans_b,
                    accumulate,
                    f16,
                    accumulators,
                )
            },
            None,
        );
    }
}

/// `acc (+)= A B` with A from registers: `a` is the warp's `16 x 16` A fragment (rows
/// `16 w ..` of the warpgroup's 64, as `mma.sync.m16n8k16` holds it), B as in [`wgmma_ss`].
/// `a` must not change until the group has completed.
#[allow(unused_variables)]
pub(super) fn wgmma_rs<F: Float>(
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    a: &Array<Vector<F, Const<2>>>,
    desc_b: u64,
    n: u32,
    trans_b: u32,
    accumulate: u32,
) {
    panic!("cube functions run only inside kernels")
}

/// The expansion of [`wgmma_rs`].
pub(super) mod wgmma_rs {
    use cubecl::prelude::*;

    /// Registers the operation; see [`super::wgmma_rs`].
    pub fn expand<F: Float>(
        scope: &mut Scope,
        acc: SequenceExpand<Array<Vector<f32, Const<2>>>>,
        a: NativeExpand<Array<Vector<F, Const<2>>>>,
        desc_b: NativeExpand<u64>,
        n: u32,
        trans_b: u32,
        accumulate: u32,
    ) {
        let f16 = super::is_f16::<F>(scope);
        let accumulators = super::fragments(&acc, n);
        let (a, desc_b) = (*a.expand, *desc_b.expand);
        super::register(
            scope,
            || super::ops::rs(a, desc_b, n, trans_b, accumulate, f16, accumulators),
            None,
        );
    }
}

/// Whether the kernel's `F` is f16 (else bf16, the only other input `wgmma` takes here).
fn is_f16<F: Float>(scope: &Scope) -> u32 {
    use cubecl::ir::{ElemType, FloatKind};
    let elem = F::as_type(scope).elem_type();
    match elem {
        ElemType::Float(FloatKind::F16) => 1,
        ElemType::Float(FloatKind::BF16) => 0,
        other => panic!("wgmma takes bf16 or f16 inputs here, not {other:?}"),
    }
}

/// The accumulator arrays of an `m64n{n}` tile: exactly `n / 8` fragments.
fn fragments(
    acc: &SequenceExpand<Array<Vector<f32, Const<2>>>>,
    n: u32,
) -> Vec<cubecl::ir::Variable> {
    let frags: Vec<_> = acc.iter_cloned().map(|f| *f.expand).collect();
    assert!(
        n.is_multiple_of(8) && (8..=256).contains(&n) && frags.len() == n as usize / 8,
        "an m64n{n} wgmma takes n / 8 accumulator fragments, got {}",
        frags.len()
    );
    frags
}

/// Registers a wgmma operation where this build has them; panics elsewhere (no kernel using
/// them is launched there, see [`WGMMA_BUILT`]).
#[allow(unused_variables)]
fn register<Op: FnOnce() -> ops::Op>(scope: &mut Scope, op: Op, out: Option<cubecl::ir::Variable>) {
    #[cfg(cubecl_wgmma)]
    {
        let op = op();
        scope.register(match out {
            Some(out) => cubecl::ir::Instruction::new(op, out),
            None => cubecl::ir::Instruction::no_out(op),
        });
    }
    #[cfg(not(cubecl_wgmma))]
    panic!("wgmma needs the workspace's vendor/cubecl-ir and vendor/cubecl-cpp");
}

/// The IR operations, where the vendored `cubecl-ir` has them.
#[cfg(cubecl_wgmma)]
mod ops {
    use cubecl::ir::{TmaOps, Variable};

    pub type Op = TmaOps;

    pub fn fence() -> Op {
        TmaOps::WgmmaFence
    }

    pub fn commit() -> Op {
        TmaOps::WgmmaCommitGroup
    }

    pub fn wait(max_pending: u32) -> Op {
        TmaOps::WgmmaWaitGroup { max_pending }
    }

    pub fn fence_operands(accumulators: Vec<Variable>) -> Op {
        TmaOps::WgmmaFenceOperands { accumulators }
    }

    pub fn descriptor(
        source: Variable,
        offset_source: Variable,
        leading_bytes: u32,
        stride_bytes: u32,
        swizzle: u32,
    ) -> Op {
        TmaOps::WgmmaDescriptor {
            source,
            offset_source,
            leading_bytes,
            stride_bytes,
            swizzle,
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn ss(
        desc_a: Variable,
        desc_b: Variable,
        n: u32,
        trans_a: u32,
        trans_b: u32,
        accumulate: u32,
        f16: u32,
        accumulators: Vec<Variable>,
    ) -> Op {
        TmaOps::WgmmaSs {
            desc_a,
            desc_b,
            n,
            trans_a,
            trans_b,
            accumulate,
            f16,
            accumulators,
        }
    }

    pub fn rs(
        a: Variable,
        desc_b: Variable,
        n: u32,
        trans_b: u32,
        accumulate: u32,
        f16: u32,
        accumulators: Vec<Variable>,
    ) -> Op {
        TmaOps::WgmmaRs {
            a,
            desc_b,
            n,
            trans_b,
            accumulate,
            f16,
            accumulators,
        }
    }
}

/// Without the vendored `cubecl-ir` no operation exists; [`register`] panics before using one.
#[cfg(not(cubecl_wgmma))]
mod ops {
    pub type Op = ();
    pub fn fence() {}
    pub fn commit() {}
    pub fn wait(_: u32) {}
    pub fn fence_operands(_: Vec<cubecl::ir::Variable>) {}
    pub fn descriptor(_: cubecl::ir::Variable, _: cubecl::ir::Variable, _: u32, _: u32, _: u32) {}
    #[allow(clippy::too_many_arguments)]
    pub fn ss(
        _: cubecl::ir::Variable,
        _: cubecl::ir::Variable,
        _: u32,
        _: u32,
        _: u32,
        _: u32,
        _: u32,
        _: Vec<cubecl::ir::Variable>,
    ) {
    }
    pub fn rs(
        _: cubecl::ir::Variable,
        _: cubecl::ir::Variable,
        _: u32,
        _: u32,
        _: u32,
        _: u32,
        _: Vec<cubecl::ir::Variable>,
    ) {
    }
}
