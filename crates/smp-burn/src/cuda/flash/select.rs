//! Which kernels run: what the device and the build offer, and the choice of the forward and
//! backward kernels from the device, the head dim and [`KernelConfig`].
//!
//! A kernel left to the device ([`KernelConfig::flash_forward`] or
//! [`KernelConfig::flash_backward`] `None`) is the fastest measured there
//! ([`default_forward`], [`default_backward`]). A kernel asked for by name runs as asked, or
//! the launch panics naming it where the device or build cannot run it: falling back would
//! make a benchmark measure something else than it says. The one exception is the warpgroup
//! backward on inputs it cannot take whole (another head dim, rows not 16-byte aligned): a
//! model or a check asks for one kernel for all its attention calls, so those calls take the
//! default that the device would run without `wgmma` instead.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use cubecl::features::MmaConfig;
use cubecl::ir::{BarrierLevel, ElemType, FloatKind, OpaqueType};
use cubecl::prelude::*;

use super::dq::BULK_REDUCE_BUILT;
use super::wgmma::WGMMA_BUILT;
use crate::{FlashBackward, FlashForward, KernelConfig};

/// Whether the device has `mma.sync` m16n8k16 with `dtype` inputs and f32 accumulators, and
/// `ldmatrix` for `dtype` (CUDA sm_80 and later): what every flash kernel needs. Where it is
/// missing (older GPUs, f32 inputs) attention takes the reference ops.
pub fn mma_supported<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType) -> bool {
    let elem = match dtype {
        DType::BF16 => ElemType::Float(FloatKind::BF16),
        DType::F16 => ElemType::Float(FloatKind::F16),
        _ => return false,
    };
    let features = client.features();
    features.matmul.mma.contains(&MmaConfig {
        a_type: elem.into(),
        b_type: elem.into(),
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: 16,
        n: 8,
        k: 16,
    }) && features.matmul.ldmatrix.contains(&elem.into())
}

/// Whether the device runs `cp.async` and cube-level barriers (CUDA sm_80 and later), with
/// which every flash kernel double-buffers its streamed tiles.
pub fn mma_async_supported<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    let features = client.features();
    features.copy_async && features.supports_type(OpaqueType::Barrier(BarrierLevel::Cube))
}

/// Whether this build and device run the warpgroup-MMA forward ([`FlashForward::Wgmma`]): the
/// vendored CubeCL crates ([`WGMMA_BUILT`]) and sm_90 or later (TMA, which arrived with
/// `wgmma`, stands for the architecture here).
pub fn wgmma_supported<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    WGMMA_BUILT
        && mma_async_supported(client)
        && client
            .properties()
            .features
            .tma
            .contains(cubecl::ir::features::Tma::Base)
}

/// Whether this build and device run the warpgroup-MMA backward ([`FlashBackward::Wgmma`]):
/// `wgmma` ([`wgmma_supported`]) and the bulk reduction ([`BULK_REDUCE_BUILT`]) that adds its
/// dQ rows.
pub fn wgmma_backward_supported<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    BULK_REDUCE_BUILT && wgmma_supported(client)
}

/// Whether the device adds pairs of f32 atomically in global memory (CUDA sm_90 and later), as
/// the backward kernels with a fused dQ do ([`FlashBackward::Atomic`],
/// [`FlashBackward::AtomicGrid`]).
pub fn pair_atomics_supported<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    let pair = cubecl::ir::Type::new(cubecl::ir::StorageType::Atomic(ElemType::Float(
        FloatKind::F32,
    )))
    .with_vector_size(2);
    client
        .properties()
        .atomic_type_usage(pair)
        .contains(cubecl::ir::features::AtomicUsage::Add)
}

/// Whether the backward kernels with a fused dQ add it by Hopper's bulk reductions instead of
/// f32-pair atomics: this build has the operation ([`BULK_REDUCE_BUILT`]) and the device
/// Hopper's copy engine (TMA, sm_90+).
pub fn bulk_dq_supported<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    BULK_REDUCE_BUILT
        && client
            .properties()
            .features
            .tma
            .contains(cubecl::ir::features::Tma::Base)
}

/// The forward the device runs by default at `head_dim`, where it runs the warpgroup MMA
/// (`wgmma`: [`wgmma_supported`] and rows of 16 bytes) or not.
///
/// - `wgmma` at head dim 64 or 128: [`FlashForward::Wgmma`]. Causal, batch 1, H200: 466-535
///   TFLOP/s at head dim 128 (S 4096-32768) where [`FlashForward::Mma8x2`] gives 297-361;
///   H100: 331-374 at head dim 64 (B8 S 4096, B2 S 16384) where [`FlashForward::Mma4x2`]
///   gives 291-311, since its tiles are loaded by the tensor memory accelerator.
/// - head dim 64 without `wgmma`: [`FlashForward::Mma4x2`]: half the head dim halves the work
///   per staged K/V block, so smaller cubes (two per SM) hide the copies better. On an H200,
///   causal, S 4096: 223 TFLOP/s where [`FlashForward::Mma8x2`] gives 195.
/// - otherwise [`FlashForward::Mma8x2`]: 285 / 340 TFLOP/s at S 4096 / 16384 (PyTorch's flash
///   forward 256 / 333 on the same GPU); 4 warps of two m-tiles stay 2-12 % slower there.
pub fn default_forward(head_dim: usize, wgmma: bool) -> FlashForward {
    match head_dim {
        64 | 128 if wgmma => FlashForward::Wgmma,
        64 => FlashForward::Mma4x2,
        _ => FlashForward::Mma8x2,
    }
}

/// The backward the device runs by default at `head_dim`, where it does or does not add f32
/// pairs atomically ([`pair_atomics_supported`]) and run the warpgroup backward (`wgmma`:
/// [`wgmma_backward_supported`] and rows of 16 bytes), with or without `deterministic`
/// ([`KernelConfig::deterministic`]).
///
/// - without pair atomics or with `deterministic`: [`FlashBackward::Split`], the only
///   bitwise reproducible one (H200, causal: 189 / 203 TFLOP/s at hd 128, S 4096 / 16384; 187 /
///   200 at hd 64).
/// - head dim 128 with `wgmma`: [`FlashBackward::Wgmma`], 333 / 378 TFLOP/s at B8 S 4k /
///   B2 S 16k where [`FlashBackward::AtomicGrid`] gives 258 / 290.
/// - head dim 64 with `wgmma`: [`FlashBackward::Wgmma`] too, 285-287 TFLOP/s at B1 S 16k on
///   an H100 where [`FlashBackward::Atomic`] gives 247-249; the 1.2B Llama trains 2.7-3.4 %
///   faster with it.
/// - head dim 128 and above otherwise: [`FlashBackward::AtomicGrid`] (230 / 270 TFLOP/s at
///   S 4096 / 16384, against 220 / 257 for the per-warp [`FlashBackward::Atomic`]).
/// - head dim 64 otherwise: [`FlashBackward::Atomic`] (185 / 228 TFLOP/s, where the split kernels give
///   182 / 202 and the warp grid 186 / 220; the 1B Llama trains 1.9 % faster with it).
pub fn default_backward(
    head_dim: usize,
    pair_atomics: bool,
    wgmma: bool,
    deterministic: bool,
) -> FlashBackward {
    if !pair_atomics || deterministic {
        FlashBackward::Split
    } else if matches!(head_dim, 64 | 128) && wgmma {
        FlashBackward::Wgmma
    } else if head_dim >= 128 {
        FlashBackward::AtomicGrid
    } else if head_dim == 64 {
        FlashBackward::Atomic
    } else {
        FlashBackward::Split
    }
}

/// The forward that runs at `head_dim` on `client` for inputs read in vectors of `nv`
/// elements: `asked` (from [`KernelConfig::flash_forward`]), else [`default_forward`].
pub(super) fn forward_kernel<R: CubeRuntime>(
    client: &ComputeClient<R>,
    asked: Option<FlashForward>,
    head_dim: usize,
    nv: usize,
) -> FlashForward {
    // The warpgroup kernel copies 16-byte chunks: its default needs rows in 8-element units.
    asked.unwrap_or_else(|| default_forward(head_dim, nv == 8 && wgmma_supported(client)))
}

/// The backward that runs at `head_dim` on `client` for inputs read in vectors of `nv`
/// elements: `asked`, else [`default_backward`] (see the [module documentation](self) for
/// the warpgroup kernel on inputs it cannot take).
pub(super) fn backward_kernel<R: CubeRuntime>(
    client: &ComputeClient<R>,
    asked: Option<FlashBackward>,
    deterministic: bool,
    head_dim: usize,
    nv: usize,
) -> FlashBackward {
    choose_backward(
        asked,
        deterministic,
        head_dim,
        nv == 8,
        pair_atomics_supported(client),
        wgmma_backward_supported(client),
    )
}

/// [`backward_kernel`] from what the device offers: `rows16` (inputs read in 16-byte
/// vectors), `pair_atomics` ([`pair_atomics_supported`]), `wgmma`
/// ([`wgmma_backward_supported`]).
pub(crate) fn choose_backward(
    asked: Option<FlashBackward>,
    deterministic: bool,
    head_dim: usize,
    rows16: bool,
    pair_atomics: bool,
    wgmma: bool,
) -> FlashBackward {
    match asked {
        Some(FlashBackward::Wgmma) if !(rows16 && matches!(head_dim, 64 | 128)) => {
            default_backward(head_dim, pair_atomics, false, deterministic)
        }
        Some(kernel) => kernel,
        None => default_backward(head_dim, pair_atomics, rows16 && wgmma, deterministic),
    }
}

/// Panics, naming `kernel`, where `client`'s device or this build cannot run it (the inputs'
/// shape aside, which the launches check).
pub(super) fn assert_forward_runs<R: CubeRuntime>(client: &ComputeClient<R>, kernel: FlashForward) {
    let name = kernel.name();
    assert!(
        mma_async_supported(client),
        "flash attention: forward {name} needs cp.async and cube barriers (sm_80+)"
    );
    if kernel == FlashForward::Wgmma {
        assert!(
            wgmma_supported(client),
            "flash attention: forward {name} needs warpgroup MMA (sm_90+ and the workspace's \
             vendored CubeCL crates)"
        );
    }
}

/// [`assert_forward_runs`] for the backward.
pub(super) fn assert_backward_runs<R: CubeRuntime>(
    client: &ComputeClient<R>,
    kernel: FlashBackward,
) {
    let name = kernel.name();
    assert!(
        mma_async_supported(client),
        "flash attention: backward {name} needs cp.async and cube barriers (sm_80+)"
    );
    match kernel {
        FlashBackward::Split => {}
        FlashBackward::Atomic | FlashBackward::AtomicGrid => assert!(
            pair_atomics_supported(client),
            "flash attention: backward {name} adds f32 pairs atomically, which needs sm_90 or \
             later; use {}",
            FlashBackward::Split.name()
        ),
        FlashBackward::Wgmma => assert!(
            wgmma_backward_supported(client),
            "flash attention: backward {name} needs warpgroup MMA and the bulk reduction \
             (sm_90+ and the workspace's vendored CubeCL crates)"
        ),
    }
}

/// Whether asking for `kernel` runs it on `client`'s device with this build (on inputs with
/// 16-byte rows, as contiguous ones have).
pub fn forward_supported<R: CubeRuntime>(client: &ComputeClient<R>, kernel: FlashForward) -> bool {
    mma_async_supported(client) && (kernel != FlashForward::Wgmma || wgmma_supported(client))
}

/// [`forward_supported`] for the backward.
pub fn backward_supported<R: CubeRuntime>(
    client: &ComputeClient<R>,
    kernel: FlashBackward,
) -> bool {
    mma_async_supported(client)
        && match kernel {
            FlashBackward::Split => true,
            FlashBackward::Atomic | FlashBackward::AtomicGrid => pair_atomics_supported(client),
            FlashBackward::Wgmma => wgmma_backward_supported(client),
        }
}

/// The kernels in force for a `head_dim` call on `client` with 16-byte rows: the
/// configuration's, else the device's defaults.
pub fn current_kernels<R: CubeRuntime>(
    client: &ComputeClient<R>,
    head_dim: usize,
) -> (FlashForward, FlashBackward) {
    let config = KernelConfig::current();
    (
        forward_kernel(client, config.flash_forward, head_dim, 8),
        backward_kernel(
            client,
            config.flash_backward,
            config.deterministic,
            head_dim,
            8,
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The forward's default follows the head dim and whether `wgmma` runs: the warpgroup
    /// kernel only at head dim 128, where it is 20-30 % faster.
    #[test]
    fn forward_default_by_head_dim_and_device() {
        assert_eq!(default_forward(64, true), FlashForward::Wgmma);
        assert_eq!(default_forward(64, false), FlashForward::Mma4x2);
        assert_eq!(default_forward(128, true), FlashForward::Wgmma);
        assert_eq!(default_forward(128, false), FlashForward::Mma8x2);
        assert_eq!(default_forward(96, true), FlashForward::Mma8x2);
    }

    /// The backward's default follows the head dim, the device and the determinism switch.
    #[test]
    fn backward_default_by_head_dim_and_device() {
        use FlashBackward::*;
        // (head dim, pair atomics, wgmma backward) -> default.
        for (head_dim, pair_atomics, wgmma, expected) in [
            (128, true, true, Wgmma),
            (128, true, false, AtomicGrid),
            (128, false, true, Split),
            (128, false, false, Split),
            (256, true, true, AtomicGrid),
            (64, true, true, Wgmma),
            (64, true, false, Atomic),
            (64, false, false, Split),
            (96, true, true, Split),
        ] {
            assert_eq!(
                default_backward(head_dim, pair_atomics, wgmma, false),
                expected,
                "head dim {head_dim}, pair atomics {pair_atomics}, wgmma {wgmma}"
            );
            assert_eq!(default_backward(head_dim, pair_atomics, wgmma, true), Split);
        }
    }

    /// An asked-for kernel runs as asked, except the warpgroup backward on inputs it cannot
    /// take, which gets the default without `wgmma`; nothing asked for, the 16-byte rows
    /// decide whether the warpgroup kernel is the default.
    #[test]
    fn asked_backward_and_its_shape_fallback() {
        use FlashBackward::*;
        // (asked, head dim, 16-byte rows) on an sm_90 device with the vendored build.
        for (asked, head_dim, rows16, expected) in [
            (Some(Wgmma), 128, true, Wgmma),
            (Some(Wgmma), 64, true, Wgmma),
            (Some(Wgmma), 128, false, AtomicGrid),
            (Some(Wgmma), 96, true, Split),
            (Some(Atomic), 128, true, Atomic),
            (Some(Split), 128, true, Split),
            (None, 128, true, Wgmma),
            (None, 128, false, AtomicGrid),
            (None, 64, true, Wgmma),
        ] {
            assert_eq!(
                choose_backward(asked, false, head_dim, rows16, true, true),
                expected,
                "{asked:?} at head dim {head_dim}, 16-byte rows {rows16}"
            );
        }
        assert_eq!(choose_backward(None, true, 128, true, true, true), Split);
    }

    /// Where the workspace vendors cubecl-ir, smp-burn must have been built against it (its
    /// `[patch.crates-io]` entry): otherwise the flash backward falls back to the f32-pair
    /// atomics (4-6 % slower) and the hd-128 forward to `mma.sync` (20-30 % slower) without a
    /// word.
    #[test]
    fn workspace_build_has_the_bulk_reduction_and_wgmma() {
        let vendored = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../vendor/cubecl-ir")
            .is_dir();
        assert!(
            !vendored || (BULK_REDUCE_BUILT && WGMMA_BUILT),
            "vendor/cubecl-ir exists but smp-burn was built against another cubecl-ir (is its \
             [patch.crates-io] entry in the workspace Cargo.toml?)"
        );
    }
}
