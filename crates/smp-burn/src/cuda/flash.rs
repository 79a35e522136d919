//! Causal flash attention (forward and backward) as CubeCL kernels on Burn's `CubeTensor`s.
//!
//! Why our own kernels: Burn 0.21's attention stores the full `S x S` score matrix under
//! autodiff (95 GB at S=4096 for a 1.2B Llama, where PyTorch needs 30 GB) and its forward runs
//! at 39 TFLOP/s; see DESIGN.md "Stack facts".
//!
//! Layout: `q [B, Hq, S, D]`, `k`, `v [B, Hkv, S, D]` with `Hq % Hkv == 0` (grouped-query
//! attention: query head `h` reads kv head `h / (Hq / Hkv)`), `D` in {64, 128}, any `S >= 1`,
//! causal (query `i` sees keys `j <= i`). The last dimension must be contiguous; the other
//! strides are read from the tensors, so pitched or sliced inputs work. Outputs are written
//! through their strides too; [`FlashLayout`] picks their memory order (by default the
//! model's `[B, S, H, D]`, so that its `swap_dims(1, 2).reshape(..)` costs no copy).
//!
//! Algorithm (FlashAttention-2):
//! - forward: one cube per (block of query rows, query head, batch); it walks the key blocks up
//!   to the causal limit with an online softmax (running max `m`, running sum `l`, an f32 output
//!   accumulator) and writes `o` and `lse = m + ln(l)` (f32, of the scaled scores).
//! - backward: `delta = rowsum(dO * O)` (f32), then a cube per (key block, kv head, batch) that
//!   loops over the query heads of its group and the query blocks from the causal start and
//!   accumulates `dK`, `dV` on chip (written once, no atomics), then a cube per (query block,
//!   query head, batch) for `dQ`. `P = exp(s * scale - lse)` is recomputed in both.
//!
//! Three implementations, chosen by [`FlashVariant`] ([`FlashVariant::best`] picks the fastest
//! the device runs: `Mma`, else `Cmma`, else `Plain`; `SMP_BURN_FLASH` overrides it):
//! - [`FlashVariant::Plain`]: scalar f32 FMAs from shared memory. Slow, simple, any float dtype;
//!   the reference the fast variant is checked against.
//! - [`FlashVariant::Cmma`]: the matrix products on tensor cores through `cubecl::cmma` (CUDA
//!   `wmma`, 16x16x16, bf16/f16 inputs, f32 accumulators). `wmma` accumulator fragments have
//!   an unspecified element layout, so scores go through shared memory (f32) to ordinary
//!   threads for the softmax, and `P`/`dS` come back as the input dtype (rounded, as in
//!   FlashAttention-2). The forward keeps O in fragments and rescales it lazily: a row's
//!   reference max only moves when a block beats it by more than `RESCALE_THRESHOLD`, and
//!   only then does the warp round-trip O through shared memory. Inputs are read in 16-byte
//!   vectors where aligned, and the forward and dQ kernels load the next K/V block into
//!   registers while computing on the current one. Each warp owns 16 rows of the block, so
//!   only the tile staging needs a cube-wide barrier.
//!
//! - [`FlashVariant::Mma`] ([`flash_mma`]): the products through `mma.sync` m16n8k16 with
//!   manually managed registers, whose layout is documented, so the scores, the softmax, `P`
//!   and `O` stay in registers (FlashAttention-2's structure). Its backward keeps `S^T`, `dP^T`,
//!   `P^T`, `dS^T`, dK and dV in registers too, and computes dQ either inside the dK/dV kernel
//!   with f32 atomics (FlashAttention-2's scheme) or in a separate kernel
//!   ([`MmaBwdTiling`]).
//!
//! Masking uses a finite `-1e30` and forces masked probabilities to exactly 0, so rows with no
//! visible key yet never produce NaN; padded rows and keys (past `S`) are zero-filled in shared
//! memory so that `0 * garbage` cannot happen.

// Kernel code is expanded by `#[cube]`, which has no `div_ceil` on runtime integers.
#![allow(clippy::manual_div_ceil)]

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::ops::permute;
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::MmaConfig;
use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::*;
use std::sync::Mutex;

#[path = "flash_mma.rs"]
pub mod flash_mma;
pub use super::wgmma::WGMMA_BUILT;
pub use flash_mma::{
    BULK_REDUCE_BUILT, FLASH_BULK_DQ_ENV, MmaBwdPipe, MmaBwdTiling, MmaDq, MmaTiling,
    bulk_dq_supported, bulk_dq_used, deterministic, mma_async_supported, mma_bwd_tiling,
    mma_fragment_probe, mma_supported, mma_tiling, pair_atomics_supported, set_deterministic,
    set_mma_bwd_tiling, set_mma_tiling, wgmma_backward_supported, wgmma_supported,
};

/// Rows and keys per block in the plain kernels (one thread per (row, quarter of the columns)).
const PLAIN_BLOCK: usize = 64;
/// Threads per cube in the plain kernels: 4 per row of a 64-row block.
const PLAIN_THREADS: usize = 256;
/// Warps per cube in the cmma kernels; each warp owns a strip of 16 rows, so a cube covers
/// `16 * CMMA_WARPS` rows (queries in forward and dQ, keys in dK/dV).
const CMMA_WARPS: usize = 4;
/// The block of the inner loop of the cmma kernels (keys in forward and dQ, queries in dK/dV).
const CMMA_INNER: usize = 64;
/// Lazy rescaling in the cmma forward: the running max of a row only moves when a block's max
/// exceeds it by more than this (natural-log units), so unnormalized probabilities stay below
/// e^8 ~ 3e3 (harmless in f32 sums and bf16 P) and O is rescaled on few blocks.
const RESCALE_THRESHOLD: f32 = 8.0;
/// Threads per cube of the `delta` kernel.
const DELTA_THREADS: usize = 256;

/// Which implementation of the kernels to launch.
///
/// All compute the same function; `Plain` exists to check the others against on the GPU and to
/// run where tensor cores or bf16/f16 inputs are missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlashVariant {
    /// Scalar f32 FMAs from shared memory; any float dtype.
    Plain,
    /// Tensor-core products (`wmma` 16x16x16, f32 accumulators); bf16 or f16 inputs only.
    Cmma,
    /// Tensor-core products through `mma.sync` m16n8k16 with register-resident scores
    /// ([`flash_mma`]), forward and backward; bf16 or f16 inputs, sm_80+.
    Mma,
}

/// Environment variable that picks the variant of the model path ([`flash_forward`],
/// [`flash_backward`]): `plain`, `cmma` or `mma`; unset means [`FlashVariant::best`].
pub const FLASH_VARIANT_ENV: &str = "SMP_BURN_FLASH";

/// Memory order of the `[B, H, S, D]` tensors the kernels write: the forward's `o` and the
/// backward's `dq`, `dk`, `dv` (and, through [`flash_layout`], the RoPE backward's `dx` in
/// `fused.rs`). The shape Burn sees is `[B, H, S, D]` either way; only the strides differ. The
/// kernels index every output through its strides, so both are the same computation.
///
/// Why: the model projects to `[B, S, H * D]`, views it as `[B, H, S, D]` with
/// `reshape` + `swap_dims(1, 2)`, and after attention goes back with `swap_dims(1, 2)` +
/// `reshape`. A contiguous `[B, H, S, D]` result makes that `reshape` (and the gradients' on the
/// way back) a copy kernel: one per layer after the forward and three after the backward, ~47
/// us each on an H200 at the 1b shape. Written in `[B, S, H, D]` order, the swapped view is
/// contiguous and the reshape free.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlashLayout {
    /// Contiguous `[B, H, S, D]` (strides `[H S D, S D, D, 1]`): the original layout.
    Bhsd,
    /// `[B, S, H, D]` memory order returned as a `[B, H, S, D]` tensor with strides
    /// `[S H D, D, H D, 1]`: what the model's `swap_dims(1, 2).reshape(..)` wants.
    Bshd,
}

/// Environment variable for [`flash_layout`]: `bshd` or `bhsd`.
pub const FLASH_LAYOUT_ENV: &str = "SMP_BURN_FLASH_LAYOUT";

impl FlashLayout {
    /// The default: [`FlashLayout::Bshd`] (the kernels were already stride-generic, so only the
    /// allocation changes). Not yet measured on a GPU.
    pub const DEFAULT: FlashLayout = FlashLayout::Bshd;

    /// The lower-case name [`FLASH_LAYOUT_ENV`] takes.
    pub fn name(self) -> &'static str {
        match self {
            FlashLayout::Bhsd => "bhsd",
            FlashLayout::Bshd => "bshd",
        }
    }

    /// Parses [`Self::name`]'s output.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bhsd" => Some(FlashLayout::Bhsd),
            "bshd" => Some(FlashLayout::Bshd),
            _ => None,
        }
    }

    /// An uninitialized (or, through `alloc`, zeroed) tensor of logical shape `[B, H, S, D]`
    /// in this layout: `alloc` allocates a contiguous tensor of the shape it is given (the
    /// memory order), which is then viewed as `[B, H, S, D]` by permuting its metadata.
    pub(crate) fn alloc<R: CubeRuntime>(
        self,
        shape: [usize; 4],
        alloc: impl FnOnce(Shape) -> CubeTensor<R>,
    ) -> CubeTensor<R> {
        let [b, h, s, d] = shape;
        match self {
            FlashLayout::Bhsd => alloc(Shape::new(shape)),
            // [B, S, H, D] contiguous, dims 1 and 2 swapped: strides [S H D, D, H D, 1].
            FlashLayout::Bshd => permute(alloc(Shape::new([b, s, h, d])), &[0, 2, 1, 3]),
        }
    }
}

/// Process-wide override of the layout; `None` means "from the environment".
static LAYOUT_OVERRIDE: Mutex<Option<FlashLayout>> = Mutex::new(None);

/// The layout the flash kernels (and the RoPE backward) write their `[B, H, S, D]` results
/// in: the last [`set_flash_layout`], else [`FLASH_LAYOUT_ENV`], else
/// [`FlashLayout::DEFAULT`].
///
/// # Panics
/// If the environment variable names no layout (a silent fallback would measure the wrong
/// thing).
pub fn flash_layout() -> FlashLayout {
    if let Some(l) = *LAYOUT_OVERRIDE.lock().unwrap_or_else(|e| e.into_inner()) {
        return l;
    }
    match std::env::var(FLASH_LAYOUT_ENV) {
        Ok(s) => FlashLayout::parse(&s)
            .unwrap_or_else(|| panic!("{FLASH_LAYOUT_ENV}={s:?}: expected bshd or bhsd")),
        Err(_) => FlashLayout::DEFAULT,
    }
}

/// Overrides [`flash_layout`] for this process (`None`: back to the environment / default).
pub fn set_flash_layout(layout: Option<FlashLayout>) {
    *LAYOUT_OVERRIDE.lock().unwrap_or_else(|e| e.into_inner()) = layout;
}

impl FlashVariant {
    /// The fastest variant the device can run for `dtype`, so that callers who just want
    /// attention need not know the device: `Mma` when it has `mma.sync` m16n8k16 and `ldmatrix`
    /// for `dtype` (its forward measured 175 TFLOP/s against Cmma's 85 on an H200, causal hd
    /// 128, S = 4096), else `Cmma` when it has `wmma` 16x16x16 with f32 accumulators, else
    /// `Plain`.
    pub fn best<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType) -> Self {
        if mma_supported(client, dtype) {
            FlashVariant::Mma
        } else if cmma_supported(client, dtype) {
            FlashVariant::Cmma
        } else {
            FlashVariant::Plain
        }
    }

    /// The lower-case name used by [`FLASH_VARIANT_ENV`] and `flash_check --variant`.
    pub fn name(self) -> &'static str {
        match self {
            FlashVariant::Plain => "plain",
            FlashVariant::Cmma => "cmma",
            FlashVariant::Mma => "mma",
        }
    }

    /// Parses [`Self::name`]'s output.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "plain" => Some(FlashVariant::Plain),
            "cmma" => Some(FlashVariant::Cmma),
            "mma" => Some(FlashVariant::Mma),
            _ => None,
        }
    }

    /// Whether this variant can run `dtype` inputs on `client`'s device.
    pub fn supported<R: CubeRuntime>(self, client: &ComputeClient<R>, dtype: DType) -> bool {
        match self {
            FlashVariant::Plain => matches!(dtype, DType::F32 | DType::F16 | DType::BF16),
            FlashVariant::Cmma => cmma_supported(client, dtype),
            FlashVariant::Mma => mma_supported(client, dtype),
        }
    }

    /// The variant of the model path: [`FLASH_VARIANT_ENV`] when set, else [`Self::best`].
    /// Read on every call (it is one environment lookup) so the training path can be switched
    /// between runs without rebuilding.
    ///
    /// # Panics
    /// If the variable names no variant, or one the device cannot run for `dtype`: silently
    /// falling back would make a run measure something else than asked.
    pub fn from_env<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType) -> Self {
        match std::env::var(FLASH_VARIANT_ENV) {
            Ok(s) => {
                let variant = Self::parse(&s).unwrap_or_else(|| {
                    panic!("{FLASH_VARIANT_ENV}={s:?}: expected plain, cmma or mma")
                });
                assert!(
                    variant.supported(client, dtype),
                    "{FLASH_VARIANT_ENV}={s:?}: the {} variant cannot run {dtype:?} on this device",
                    variant.name()
                );
                variant
            }
            Err(_) => Self::best(client, dtype),
        }
    }
}

/// Whether the device offers `wmma` 16x16x16 products with `dtype` inputs and f32 accumulators.
pub fn cmma_supported<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType) -> bool {
    let elem = match dtype {
        DType::BF16 => ElemType::Float(FloatKind::BF16),
        DType::F16 => ElemType::Float(FloatKind::F16),
        _ => return false,
    };
    client.features().matmul.cmma.contains(&MmaConfig {
        a_type: elem.into(),
        b_type: elem.into(),
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: 16,
        k: 16,
        n: 16,
    })
}

// ------------------------------------------------------------------------------------------
// Shared helpers (device side)
// ------------------------------------------------------------------------------------------

/// Copies rows `row0 .. row0 + rows` (all `d` columns) of one head into `dst` with row pitch
/// `ld`; rows at or past `seq` are written as zeros so that later products never see garbage.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_rows<F: Float>(
    src: &Tensor<F>,
    base: usize,
    row_stride: usize,
    row0: usize,
    seq: usize,
    dst: &mut SharedMemory<F>,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ld: usize,
    #[comptime] nthreads: usize,
) {
    let t = UNIT_POS as usize;
    let per_thread = comptime!(rows * d / nthreads);
    for i in 0..per_thread {
        let e = i * nthreads + t;
        let r = e / d;
        let c = e % d;
        let gr = row0 + r;
        let mut val = F::new(0.0);
        if gr < seq {
            val = src[base + gr * row_stride + c];
        }
        dst[r * ld + c] = val;
    }
}

/// Loads this thread's share of rows `row0 .. row0 + rows` (all `d` columns) of one head into
/// registers, in vectors of `nv` elements (`base_v`, `stride_v` in vectors); rows at or past
/// `seq` read as zeros. Split from the shared-memory store so the next tile's global loads can
/// be in flight while the current tile is used.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile_regs<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    base_v: usize,
    stride_v: usize,
    row0: usize,
    seq: usize,
    regs: &mut Array<Vector<F, N>>,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    let t = UNIT_POS as usize;
    let dv = comptime!(d / nv);
    let per_thread = comptime!(rows * d / nv / nthreads);
    #[unroll]
    for i in 0..per_thread {
        let e = i * nthreads + t;
        let r = e / dv;
        let cv = e % dv;
        let gr = row0 + r;
        let mut val = Vector::new(F::new(0.0));
        if gr < seq {
            val = src[base_v + gr * stride_v + cv];
        }
        regs[i] = val;
    }
}

/// Writes registers filled by [`load_tile_regs`] (same `rows`, `d`, `nv`, `nthreads`) into a
/// shared tile of row pitch `ld` elements.
#[cube]
fn store_tile_regs<F: Float, N: Size>(
    regs: &Array<Vector<F, N>>,
    dst: &mut SharedMemory<Vector<F, N>>,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ld: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    let t = UNIT_POS as usize;
    let dv = comptime!(d / nv);
    let ldv = comptime!(ld / nv);
    let per_thread = comptime!(rows * d / nv / nthreads);
    #[unroll]
    for i in 0..per_thread {
        let e = i * nthreads + t;
        dst[(e / dv) * ldv + e % dv] = regs[i];
    }
}

/// [`load_tile_regs`] then [`store_tile_regs`]: a synchronous copy of a tile into shared memory.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_tile<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    base_v: usize,
    stride_v: usize,
    row0: usize,
    seq: usize,
    dst: &mut SharedMemory<Vector<F, N>>,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ld: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    let mut regs = Array::<Vector<F, N>>::new(comptime!(rows * d / nv / nthreads));
    load_tile_regs::<F, N>(
        src, base_v, stride_v, row0, seq, &mut regs, rows, d, nv, nthreads,
    );
    store_tile_regs::<F, N>(&regs, dst, rows, d, ld, nv, nthreads);
}

/// `out[strip] = A[strip] * B^T` for one warp. `A` is 16 rows (row-major, pitch `ld_a`
/// elements, starting at element `a_off`) by `16 * k_tiles` columns; `B` is `16 * n_tiles`
/// rows (pitch `ld_b`) of the same `16 * k_tiles` columns, read as a column-major `K x N`
/// operand. Both live in shared tiles of `nv`-element vectors (offsets there are in vectors,
/// `wmma` strides in elements). The f32 result (16 x `16 * n_tiles`) is stored row-major at
/// `out_off` with pitch `ld_out`; `n_tiles` accumulators are live at once.
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_strip_abt<F: Float, N: Size>(
    a: &SharedMemory<Vector<F, N>>,
    a_off: usize,
    b: &SharedMemory<Vector<F, N>>,
    out: &mut SharedMemory<f32>,
    out_off: usize,
    #[comptime] ld_a: usize,
    #[comptime] ld_b: usize,
    #[comptime] ld_out: usize,
    #[comptime] n_tiles: usize,
    #[comptime] k_tiles: usize,
    #[comptime] nv: usize,
) {
    let lda = comptime!(ld_a as u32);
    let ldb = comptime!(ld_b as u32);
    let a_len = comptime!(16 * ld_a / nv);
    let b_len = comptime!(16 * ld_b / nv);
    let a_frag = unsafe {
        cmma::Matrix::<F>::uninitialized(
            cmma::MatrixIdent::A,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::RowMajor,
        )
    };
    let b_frag = unsafe {
        cmma::Matrix::<F>::uninitialized(
            cmma::MatrixIdent::B,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::ColMajor,
        )
    };
    // One accumulator per output tile, so each A fragment is loaded once.
    let accs = zero_accumulators(n_tiles);
    for kt in 0..k_tiles {
        let a_start = (a_off + kt * 16) / nv;
        cmma::load(&a_frag, &a.slice(a_start, a_start + a_len), lda);
        #[unroll]
        for nt in 0..n_tiles {
            let b_start = (nt * 16 * ld_b + kt * 16) / nv;
            cmma::load(&b_frag, &b.slice(b_start, b_start + b_len), ldb);
            let acc = accs.index(nt);
            cmma::execute::<F, F, f32, f32>(&a_frag, &b_frag, acc, acc);
        }
    }
    store_accumulators(&accs, out, out_off, ld_out, n_tiles);
}

/// `acc[t] += A[strip] * B[:, 16t .. 16t + 16]` for `t` in `0 .. d_tiles`, one warp: `A` is 16
/// rows (scalar, row-major, pitch `ld_a`, at `a_off`) by `16 * k_tiles` columns, `B` a
/// row-major vector tile (`16 * k_tiles` rows, pitch `ld_b` elements). The accumulators
/// persist across calls.
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_strip_ab_acc<F: Float, N: Size>(
    a: &SharedMemory<F>,
    a_off: usize,
    b: &SharedMemory<Vector<F, N>>,
    accs: &Sequence<cmma::Matrix<f32>>,
    #[comptime] ld_a: usize,
    #[comptime] ld_b: usize,
    #[comptime] d_tiles: usize,
    #[comptime] k_tiles: usize,
    #[comptime] nv: usize,
) {
    let lda = comptime!(ld_a as u32);
    let ldb = comptime!(ld_b as u32);
    let b_len = comptime!(16 * ld_b / nv);
    let a_frag = unsafe {
        cmma::Matrix::<F>::uninitialized(
            cmma::MatrixIdent::A,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::RowMajor,
        )
    };
    let b_frag = unsafe {
        cmma::Matrix::<F>::uninitialized(
            cmma::MatrixIdent::B,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::RowMajor,
        )
    };
    for kt in 0..k_tiles {
        let a_start = a_off + kt * 16;
        cmma::load(&a_frag, &a.slice(a_start, a_start + 16 * ld_a), lda);
        #[unroll]
        for dt in 0..d_tiles {
            let b_start = (kt * 16 * ld_b + dt * 16) / nv;
            cmma::load(&b_frag, &b.slice(b_start, b_start + b_len), ldb);
            let acc = accs.index(dt);
            cmma::execute::<F, F, f32, f32>(&a_frag, &b_frag, acc, acc);
        }
    }
}

/// A sequence of `n` f32 accumulator fragments set to zero.
#[cube]
fn zero_accumulators(#[comptime] n: usize) -> Sequence<cmma::Matrix<f32>> {
    let mut accs = Sequence::<cmma::Matrix<f32>>::new();
    #[unroll]
    for _i in 0..n {
        accs.push(cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::Undefined,
            f32::new(0.0),
        ));
    }
    accs
}

/// Stores one warp's strip of accumulators (16 rows x `16 * n` columns) row-major into `out`.
#[cube]
fn store_accumulators(
    accs: &Sequence<cmma::Matrix<f32>>,
    out: &mut SharedMemory<f32>,
    out_off: usize,
    #[comptime] ld_out: usize,
    #[comptime] n: usize,
) {
    let ldo = comptime!(ld_out as u32);
    #[unroll]
    for dt in 0..n {
        let start = out_off + dt * 16;
        cmma::store(
            &mut out.slice_mut(start, start + 16 * ld_out),
            accs.index(dt),
            ldo,
            cmma::MatrixLayout::RowMajor,
        );
    }
}

// ------------------------------------------------------------------------------------------
// delta = rowsum(dO * O)
// ------------------------------------------------------------------------------------------

/// One thread per query row: `delta[b, h, i] = sum_c dO[b, h, i, c] * O[b, h, i, c]` in f32.
#[cube(launch_unchecked)]
fn flash_delta_kernel<F: Float>(
    o: &Tensor<F>,
    d_o: &Tensor<F>,
    delta: &mut Tensor<f32>,
    seq_len: u32,
    heads: u32,
    total_rows: u32,
    #[comptime] d: usize,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos < total_rows as usize {
        let seq = seq_len as usize;
        let i = pos % seq;
        let bh = pos / seq;
        let h = bh % heads as usize;
        let b = bh / heads as usize;
        let ob = b * o.stride(0) + h * o.stride(1) + i * o.stride(2);
        let gb = b * d_o.stride(0) + h * d_o.stride(1) + i * d_o.stride(2);
        let mut acc = f32::new(0.0);
        for c in 0..d {
            acc += f32::cast_from(o[ob + c]) * f32::cast_from(d_o[gb + c]);
        }
        delta[b * delta.stride(0) + h * delta.stride(1) + i * delta.stride(2)] = acc;
    }
}

// ------------------------------------------------------------------------------------------
// Plain kernels: 256 threads, 64 x 64 blocks, thread t owns row t / 4 and the columns
// congruent to t % 4 (mod 4).
// ------------------------------------------------------------------------------------------

/// Forward, plain. Cube = (query head, query block from the last, batch).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_fwd_plain<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    o: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[define(F)] _dtype: StorageType,
) {
    let blk = comptime!(PLAIN_BLOCK);
    let nthreads = comptime!(PLAIN_THREADS);
    let ld = comptime!(d + 2);
    let ld_s = comptime!(PLAIN_BLOCK + 1);
    let dq = comptime!(d / 4);
    let jq = comptime!(PLAIN_BLOCK / 4);

    let seq = seq_len as usize;
    let h = CUBE_POS_X as usize;
    let qb = n_blocks as usize - 1 - CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let hk = h / group as usize;
    let t = UNIT_POS as usize;
    let r = t / 4;
    let g = t % 4;
    let q0 = qb * blk;
    let row = q0 + r;

    let q_base = b * q.stride(0) + h * q.stride(1);
    let k_base = b * k.stride(0) + hk * k.stride(1);
    let v_base = b * v.stride(0) + hk * v.stride(1);

    let mut qs = SharedMemory::<F>::new(comptime!(PLAIN_BLOCK * (d + 2)));
    let mut ks = SharedMemory::<F>::new(comptime!(PLAIN_BLOCK * (d + 2)));
    let mut vs = SharedMemory::<F>::new(comptime!(PLAIN_BLOCK * (d + 2)));
    let mut ss = SharedMemory::<f32>::new(comptime!(PLAIN_BLOCK * (PLAIN_BLOCK + 1)));

    stage_rows::<F>(
        q,
        q_base,
        q.stride(2),
        q0,
        seq,
        &mut qs,
        blk,
        d,
        ld,
        nthreads,
    );

    let mut acc = Array::<f32>::new(dq);
    #[unroll]
    for cc in 0..dq {
        acc[cc] = f32::new(0.0);
    }
    let mut sc = Array::<f32>::new(jq);
    let mut m_i = f32::new(-1.0e30);
    let mut l_i = f32::new(0.0);

    let mut q_end = q0 + blk;
    if seq < q_end {
        q_end = seq;
    }
    let n_kb = (q_end + blk - 1) / blk;

    for kb in 0..n_kb {
        let k0 = kb * blk;
        sync_cube();
        stage_rows::<F>(
            k,
            k_base,
            k.stride(2),
            k0,
            seq,
            &mut ks,
            blk,
            d,
            ld,
            nthreads,
        );
        stage_rows::<F>(
            v,
            v_base,
            v.stride(2),
            k0,
            seq,
            &mut vs,
            blk,
            d,
            ld,
            nthreads,
        );
        sync_cube();

        #[unroll]
        for jj in 0..jq {
            sc[jj] = f32::new(0.0);
        }
        for c in 0..d {
            let qv = f32::cast_from(qs[r * ld + c]);
            #[unroll]
            for jj in 0..jq {
                let j = g + 4 * jj;
                sc[jj] += qv * f32::cast_from(ks[j * ld + c]);
            }
        }
        #[unroll]
        for jj in 0..jq {
            let j = g + 4 * jj;
            let key = k0 + j;
            let mut sv = f32::new(-1.0e30);
            if key <= row && row < seq {
                sv = sc[jj] * scale;
            }
            ss[r * ld_s + j] = sv;
        }
        sync_cube();

        // Every thread of the row computes the same statistics from the shared scores.
        let mut mx = m_i;
        for j in 0..blk {
            mx = f32::max(mx, ss[r * ld_s + j]);
        }
        let alpha = (m_i - mx).exp();
        #[unroll]
        for cc in 0..dq {
            acc[cc] *= alpha;
        }
        let mut lsum = f32::new(0.0);
        for j in 0..blk {
            let key = k0 + j;
            let mut p = f32::new(0.0);
            if key <= row && row < seq {
                p = (ss[r * ld_s + j] - mx).exp();
            }
            lsum += p;
            #[unroll]
            for cc in 0..dq {
                acc[cc] += p * f32::cast_from(vs[j * ld + g + 4 * cc]);
            }
        }
        l_i = l_i * alpha + lsum;
        m_i = mx;
    }

    if row < seq {
        let inv = f32::new(1.0) / l_i;
        let o_base = b * o.stride(0) + h * o.stride(1) + row * o.stride(2);
        #[unroll]
        for cc in 0..dq {
            o[o_base + g + 4 * cc] = F::cast_from(acc[cc] * inv);
        }
        if g == 0 {
            lse[b * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2)] = m_i + l_i.ln();
        }
    }
}

/// dK and dV, plain. Cube = (kv head, key block, batch); loops over the query heads of the
/// group and the query blocks from the diagonal on. Thread t owns key row t / 4.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_bwd_dkdv_plain<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    d_o: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    scale: f32,
    seq_len: u32,
    group: u32,
    #[comptime] d: usize,
    #[define(F)] _dtype: StorageType,
) {
    let blk = comptime!(PLAIN_BLOCK);
    let nthreads = comptime!(PLAIN_THREADS);
    let ld = comptime!(d + 2);
    let ld_s = comptime!(PLAIN_BLOCK + 1);
    let dq = comptime!(d / 4);
    let iq = comptime!(PLAIN_BLOCK / 4);

    let seq = seq_len as usize;
    let hk = CUBE_POS_X as usize;
    let kb = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let grp = group as usize;
    let t = UNIT_POS as usize;
    let r = t / 4;
    let g = t % 4;
    let k0 = kb * blk;
    let key = k0 + r;

    let mut ks = SharedMemory::<F>::new(comptime!(PLAIN_BLOCK * (d + 2)));
    let mut vs = SharedMemory::<F>::new(comptime!(PLAIN_BLOCK * (d + 2)));
    let mut qs = SharedMemory::<F>::new(comptime!(PLAIN_BLOCK * (d + 2)));
    let mut dos = SharedMemory::<F>::new(comptime!(PLAIN_BLOCK * (d + 2)));
    let mut ps = SharedMemory::<f32>::new(comptime!(PLAIN_BLOCK * (PLAIN_BLOCK + 1)));
    let mut dss = SharedMemory::<f32>::new(comptime!(PLAIN_BLOCK * (PLAIN_BLOCK + 1)));
    let mut lse_s = SharedMemory::<f32>::new(comptime!(PLAIN_BLOCK));
    let mut delta_s = SharedMemory::<f32>::new(comptime!(PLAIN_BLOCK));

    let k_base = b * k.stride(0) + hk * k.stride(1);
    let v_base = b * v.stride(0) + hk * v.stride(1);
    stage_rows::<F>(
        k,
        k_base,
        k.stride(2),
        k0,
        seq,
        &mut ks,
        blk,
        d,
        ld,
        nthreads,
    );
    stage_rows::<F>(
        v,
        v_base,
        v.stride(2),
        k0,
        seq,
        &mut vs,
        blk,
        d,
        ld,
        nthreads,
    );

    let mut acc_dk = Array::<f32>::new(dq);
    let mut acc_dv = Array::<f32>::new(dq);
    #[unroll]
    for cc in 0..dq {
        acc_dk[cc] = f32::new(0.0);
        acc_dv[cc] = f32::new(0.0);
    }
    let mut s_acc = Array::<f32>::new(iq);
    let mut dp_acc = Array::<f32>::new(iq);

    let n_qb = (seq + blk - 1) / blk;
    for hh in 0..grp {
        let h = hk * grp + hh;
        let q_base = b * q.stride(0) + h * q.stride(1);
        let do_base = b * d_o.stride(0) + h * d_o.stride(1);
        let lse_base = b * lse.stride(0) + h * lse.stride(1);
        let delta_base = b * delta.stride(0) + h * delta.stride(1);
        // Queries before k0 see none of this block's keys.
        for qb in kb..n_qb {
            let q0 = qb * blk;
            sync_cube();
            stage_rows::<F>(
                q,
                q_base,
                q.stride(2),
                q0,
                seq,
                &mut qs,
                blk,
                d,
                ld,
                nthreads,
            );
            stage_rows::<F>(
                d_o,
                do_base,
                d_o.stride(2),
                q0,
                seq,
                &mut dos,
                blk,
                d,
                ld,
                nthreads,
            );
            if t < blk {
                let qi = q0 + t;
                let mut lv = f32::new(0.0);
                let mut dv_ = f32::new(0.0);
                if qi < seq {
                    lv = lse[lse_base + qi * lse.stride(2)];
                    dv_ = delta[delta_base + qi * delta.stride(2)];
                }
                lse_s[t] = lv;
                delta_s[t] = dv_;
            }
            sync_cube();

            #[unroll]
            for ii in 0..iq {
                s_acc[ii] = f32::new(0.0);
                dp_acc[ii] = f32::new(0.0);
            }
            for c in 0..d {
                let kv = f32::cast_from(ks[r * ld + c]);
                let vv = f32::cast_from(vs[r * ld + c]);
                #[unroll]
                for ii in 0..iq {
                    let i = g + 4 * ii;
                    s_acc[ii] += kv * f32::cast_from(qs[i * ld + c]);
                    dp_acc[ii] += vv * f32::cast_from(dos[i * ld + c]);
                }
            }
            #[unroll]
            for ii in 0..iq {
                let i = g + 4 * ii;
                let qi = q0 + i;
                let mut p = f32::new(0.0);
                if key <= qi && qi < seq {
                    p = (s_acc[ii] * scale - lse_s[i]).exp();
                }
                ps[r * ld_s + i] = p;
                dss[r * ld_s + i] = p * (dp_acc[ii] - delta_s[i]);
            }
            sync_cube();

            for i in 0..blk {
                let p = ps[r * ld_s + i];
                let ds = dss[r * ld_s + i];
                #[unroll]
                for cc in 0..dq {
                    let c = g + 4 * cc;
                    acc_dv[cc] += p * f32::cast_from(dos[i * ld + c]);
                    acc_dk[cc] += ds * f32::cast_from(qs[i * ld + c]);
                }
            }
        }
    }

    if key < seq {
        let dk_base = b * dk.stride(0) + hk * dk.stride(1) + key * dk.stride(2);
        let dv_base = b * dv.stride(0) + hk * dv.stride(1) + key * dv.stride(2);
        #[unroll]
        for cc in 0..dq {
            let c = g + 4 * cc;
            dk[dk_base + c] = F::cast_from(acc_dk[cc] * scale);
            dv[dv_base + c] = F::cast_from(acc_dv[cc]);
        }
    }
}

/// dQ, plain. Cube = (query head, query block from the last, batch).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_bwd_dq_plain<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    d_o: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq_out: &mut Tensor<F>,
    scale: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[define(F)] _dtype: StorageType,
) {
    let blk = comptime!(PLAIN_BLOCK);
    let nthreads = comptime!(PLAIN_THREADS);
    let ld = comptime!(d + 2);
    let ld_s = comptime!(PLAIN_BLOCK + 1);
    let dq = comptime!(d / 4);
    let jq = comptime!(PLAIN_BLOCK / 4);

    let seq = seq_len as usize;
    let h = CUBE_POS_X as usize;
    let qb = n_blocks as usize - 1 - CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let hk = h / group as usize;
    let t = UNIT_POS as usize;
    let r = t / 4;
    let g = t % 4;
    let q0 = qb * blk;
    let row = q0 + r;

    let mut qs = SharedMemory::<F>::new(comptime!(PLAIN_BLOCK * (d + 2)));
    let mut dos = SharedMemory::<F>::new(comptime!(PLAIN_BLOCK * (d + 2)));
    let mut ks = SharedMemory::<F>::new(comptime!(PLAIN_BLOCK * (d + 2)));
    let mut vs = SharedMemory::<F>::new(comptime!(PLAIN_BLOCK * (d + 2)));
    let mut dss = SharedMemory::<f32>::new(comptime!(PLAIN_BLOCK * (PLAIN_BLOCK + 1)));

    let q_base = b * q.stride(0) + h * q.stride(1);
    let do_base = b * d_o.stride(0) + h * d_o.stride(1);
    let k_base = b * k.stride(0) + hk * k.stride(1);
    let v_base = b * v.stride(0) + hk * v.stride(1);
    stage_rows::<F>(
        q,
        q_base,
        q.stride(2),
        q0,
        seq,
        &mut qs,
        blk,
        d,
        ld,
        nthreads,
    );
    stage_rows::<F>(
        d_o,
        do_base,
        d_o.stride(2),
        q0,
        seq,
        &mut dos,
        blk,
        d,
        ld,
        nthreads,
    );

    let mut lse_r = f32::new(0.0);
    let mut delta_r = f32::new(0.0);
    if row < seq {
        lse_r = lse[b * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2)];
        delta_r = delta[b * delta.stride(0) + h * delta.stride(1) + row * delta.stride(2)];
    }

    let mut acc = Array::<f32>::new(dq);
    #[unroll]
    for cc in 0..dq {
        acc[cc] = f32::new(0.0);
    }
    let mut s_acc = Array::<f32>::new(jq);
    let mut dp_acc = Array::<f32>::new(jq);

    let mut q_end = q0 + blk;
    if seq < q_end {
        q_end = seq;
    }
    let n_kb = (q_end + blk - 1) / blk;

    for kb in 0..n_kb {
        let k0 = kb * blk;
        sync_cube();
        stage_rows::<F>(
            k,
            k_base,
            k.stride(2),
            k0,
            seq,
            &mut ks,
            blk,
            d,
            ld,
            nthreads,
        );
        stage_rows::<F>(
            v,
            v_base,
            v.stride(2),
            k0,
            seq,
            &mut vs,
            blk,
            d,
            ld,
            nthreads,
        );
        sync_cube();

        #[unroll]
        for jj in 0..jq {
            s_acc[jj] = f32::new(0.0);
            dp_acc[jj] = f32::new(0.0);
        }
        for c in 0..d {
            let qv = f32::cast_from(qs[r * ld + c]);
            let gv = f32::cast_from(dos[r * ld + c]);
            #[unroll]
            for jj in 0..jq {
                let j = g + 4 * jj;
                s_acc[jj] += qv * f32::cast_from(ks[j * ld + c]);
                dp_acc[jj] += gv * f32::cast_from(vs[j * ld + c]);
            }
        }
        #[unroll]
        for jj in 0..jq {
            let j = g + 4 * jj;
            let key = k0 + j;
            let mut ds = f32::new(0.0);
            if key <= row && row < seq {
                let p = (s_acc[jj] * scale - lse_r).exp();
                ds = p * (dp_acc[jj] - delta_r);
            }
            dss[r * ld_s + j] = ds;
        }
        sync_cube();

        for j in 0..blk {
            let ds = dss[r * ld_s + j];
            #[unroll]
            for cc in 0..dq {
                acc[cc] += ds * f32::cast_from(ks[j * ld + g + 4 * cc]);
            }
        }
    }

    if row < seq {
        let base = b * dq_out.stride(0) + h * dq_out.stride(1) + row * dq_out.stride(2);
        #[unroll]
        for cc in 0..dq {
            dq_out[base + g + 4 * cc] = F::cast_from(acc[cc] * scale);
        }
    }
}

// ------------------------------------------------------------------------------------------
// Cmma kernels: 32 * CMMA_WARPS threads; warp w owns rows 16w .. 16w + 16 of the cube's block
// for the tensor-core products; for the element-wise work thread t owns row t / 2 (a row of its
// own warp's strip) and the inner-block columns congruent to t % 2 (mod 2).
// ------------------------------------------------------------------------------------------

/// Forward, tensor cores. Cube = (query head, query block from the last, batch). `q`, `k`, `v`
/// are read in vectors of `nv` elements; the next key block is loaded into registers while the
/// current one is in use.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_fwd_cmma<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    o: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[define(F)] _dtype: StorageType,
) {
    let bq = comptime!(16 * CMMA_WARPS);
    let bk = comptime!(CMMA_INNER);
    let nthreads = comptime!(32 * CMMA_WARPS);
    let ldt = comptime!(d + 8);
    let ld_s = comptime!(CMMA_INNER + 4);
    let ld_p = comptime!(CMMA_INNER + 8);
    let ld_o = comptime!(d + 4);
    let half_d = comptime!(d / 2);
    let half_k = comptime!(CMMA_INNER / 2);
    let d_tiles = comptime!(d / 16);
    let k_tiles = comptime!(CMMA_INNER / 16);
    let kv_regs = comptime!(CMMA_INNER * d / nv / (32 * CMMA_WARPS));

    let seq = seq_len as usize;
    let h = CUBE_POS_X as usize;
    let qb = n_blocks as usize - 1 - CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let hk = h / group as usize;
    let t = UNIT_POS as usize;
    let warp = t / 32;
    let r = t / 2;
    let half = t % 2;
    // Row r within this warp's strip; all per-iteration work after staging is warp-private.
    let lr = r % 16;
    // This warp's part of scratch: its scores (pitch ld_s), then its P V (pitch ld_o).
    let wbase = warp * 16 * ld_o;
    let q0 = qb * bq;
    let row = q0 + r;

    let q_base = (b * q.stride(0) + h * q.stride(1)) / nv;
    let k_base = (b * k.stride(0) + hk * k.stride(1)) / nv;
    let v_base = (b * v.stride(0) + hk * v.stride(1)) / nv;
    let q_rs = q.stride(2) / nv;
    let k_rs = k.stride(2) / nv;
    let v_rs = v.stride(2) / nv;

    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(
        comptime!(16 * CMMA_WARPS * (d + 8) / nv),
        128usize,
    );
    let mut ks =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(CMMA_INNER * (d + 8) / nv), 128usize);
    let mut vs =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(CMMA_INNER * (d + 8) / nv), 128usize);
    let mut ps =
        SharedMemory::<F>::new_aligned(comptime!(16 * CMMA_WARPS * (CMMA_INNER + 8)), 128usize);
    // Scores (pitch ld_s), then P V (pitch ld_o); ld_o >= ld_s since d >= CMMA_INNER.
    let mut scratch =
        SharedMemory::<f32>::new_aligned(comptime!(16 * CMMA_WARPS * (d + 4)), 128usize);

    stage_tile::<F, N>(q, q_base, q_rs, q0, seq, &mut qs, bq, d, ldt, nv, nthreads);

    // The output strip of this warp lives in accumulator fragments for the whole loop.
    let o_accs = zero_accumulators(d_tiles);
    let ld_o_u32 = comptime!((d + 4) as u32);
    let mut sc = Array::<f32>::new(half_k);
    // Running reference max and sum of row r. The reference only moves when a block's max
    // exceeds it by more than RESCALE_THRESHOLD (lazy rescaling): probabilities then stay
    // below e^RESCALE_THRESHOLD, and O is rescaled (through shared memory, since fragments
    // have no element access) only on the rare blocks that move it.
    let mut m_i = f32::new(-1.0e30);
    let mut l_i = f32::new(0.0);

    let mut q_end = q0 + bq;
    if seq < q_end {
        q_end = seq;
    }
    let n_kb = (q_end + bk - 1) / bk;

    let mut k_regs = Array::<Vector<F, N>>::new(kv_regs);
    let mut v_regs = Array::<Vector<F, N>>::new(kv_regs);
    load_tile_regs::<F, N>(k, k_base, k_rs, 0, seq, &mut k_regs, bk, d, nv, nthreads);
    load_tile_regs::<F, N>(v, v_base, v_rs, 0, seq, &mut v_regs, bk, d, nv, nthreads);

    for kb in 0..n_kb {
        let k0 = kb * bk;
        sync_cube();
        store_tile_regs::<F, N>(&k_regs, &mut ks, bk, d, ldt, nv, nthreads);
        store_tile_regs::<F, N>(&v_regs, &mut vs, bk, d, ldt, nv, nthreads);
        sync_cube();
        if kb + 1 < n_kb {
            load_tile_regs::<F, N>(
                k,
                k_base,
                k_rs,
                k0 + bk,
                seq,
                &mut k_regs,
                bk,
                d,
                nv,
                nthreads,
            );
            load_tile_regs::<F, N>(
                v,
                v_base,
                v_rs,
                k0 + bk,
                seq,
                &mut v_regs,
                bk,
                d,
                nv,
                nthreads,
            );
        }

        // S = Q K^T for this warp's 16 rows.
        mma_strip_abt::<F, N>(
            &qs,
            warp * 16 * ldt,
            &ks,
            &mut scratch,
            wbase,
            ldt,
            ldt,
            ld_s,
            k_tiles,
            d_tiles,
            nv,
        );
        sync_plane();

        // Softmax statistics of row r; the two threads of a row are lanes 2r' and 2r' + 1.
        let mut mx = f32::new(-1.0e30);
        #[unroll]
        for jj in 0..half_k {
            let j = half + 2 * jj;
            let key = k0 + j;
            let mut sv = f32::new(-1.0e30);
            if key <= row && row < seq {
                sv = scratch[wbase + lr * ld_s + j] * scale;
            }
            sc[jj] = sv;
            mx = f32::max(mx, sv);
        }
        mx = f32::max(mx, plane_shuffle_xor(mx, 1u32));
        let mut m_new = m_i;
        if mx > m_i + f32::new(RESCALE_THRESHOLD) {
            m_new = mx;
        }
        // 1 when the reference stays; 0 when the row had no visible key before.
        let alpha = (m_i - m_new).exp();
        // O rows are still zero while m_i is the initial -1e30, so only rows that saw keys
        // and move their reference need the (warp-wide) rescale.
        let rescale = plane_any(m_new > m_i && m_i > f32::new(-1.0e29));
        let mut lsum = f32::new(0.0);
        #[unroll]
        for jj in 0..half_k {
            let j = half + 2 * jj;
            let key = k0 + j;
            let mut p = f32::new(0.0);
            if key <= row && row < seq {
                p = (sc[jj] - m_new).exp();
            }
            lsum += p;
            ps[r * ld_p + j] = F::cast_from(p);
        }
        lsum += plane_shuffle_xor(lsum, 1u32);
        l_i = l_i * alpha + lsum;
        m_i = m_new;

        if rescale {
            // O *= alpha row-wise: fragments -> scratch (the scores there are consumed),
            // scale, and back.
            sync_plane();
            store_accumulators(&o_accs, &mut scratch, wbase, ld_o, d_tiles);
            sync_plane();
            #[unroll]
            for cc in 0..half_d {
                let idx = wbase + lr * ld_o + half + 2 * cc;
                scratch[idx] = scratch[idx] * alpha;
            }
            sync_plane();
            #[unroll]
            for dt in 0..d_tiles {
                let start = wbase + dt * 16;
                cmma::load_with_layout(
                    o_accs.index(dt),
                    &scratch.slice(start, start + 16 * ld_o),
                    ld_o_u32,
                    cmma::MatrixLayout::RowMajor,
                );
            }
        }
        sync_plane();

        // O += P V for this warp's strip.
        mma_strip_ab_acc::<F, N>(
            &ps,
            warp * 16 * ld_p,
            &vs,
            &o_accs,
            ld_p,
            ldt,
            d_tiles,
            k_tiles,
            nv,
        );
    }

    sync_plane();
    store_accumulators(&o_accs, &mut scratch, wbase, ld_o, d_tiles);
    sync_plane();
    if row < seq {
        let inv = f32::new(1.0) / l_i;
        let o_base = b * o.stride(0) + h * o.stride(1) + row * o.stride(2);
        #[unroll]
        for cc in 0..half_d {
            let c = half + 2 * cc;
            o[o_base + c] = F::cast_from(scratch[wbase + lr * ld_o + c] * inv);
        }
        if half == 0 {
            lse[b * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2)] = m_i + l_i.ln();
        }
    }
}

/// dK and dV, tensor cores. Cube = (kv head, key block, batch); loops over the query heads of
/// the group and the query blocks from the diagonal on; the accumulators stay in fragments.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_bwd_dkdv_cmma<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    scale: f32,
    seq_len: u32,
    group: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[define(F)] _dtype: StorageType,
) {
    let bk = comptime!(16 * CMMA_WARPS);
    let bq = comptime!(CMMA_INNER);
    let nthreads = comptime!(32 * CMMA_WARPS);
    let ldt = comptime!(d + 8);
    let ld_s = comptime!(CMMA_INNER + 4);
    let ld_p = comptime!(CMMA_INNER + 8);
    let ld_o = comptime!(d + 4);
    let half_d = comptime!(d / 2);
    let half_q = comptime!(CMMA_INNER / 2);
    let d_tiles = comptime!(d / 16);
    let q_tiles = comptime!(CMMA_INNER / 16);
    // Second score buffer (dP^T) starts after the first (S^T).
    // Each warp owns a part of scratch: its S and dP rows (pitch ld_s, dP at dp_off), at the
    // end its accumulators (pitch ld_o).
    let dp_off = comptime!(16 * (CMMA_INNER + 4));
    let warp_scratch = comptime!(scratch_len(16, CMMA_INNER + 4, d + 4));

    let seq = seq_len as usize;
    let hk = CUBE_POS_X as usize;
    let kb = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let grp = group as usize;
    let t = UNIT_POS as usize;
    let warp = t / 32;
    let r = t / 2;
    let half = t % 2;
    let lr = r % 16;
    let wbase = warp * warp_scratch;
    let k0 = kb * bk;
    let key = k0 + r;

    let mut ks = SharedMemory::<Vector<F, N>>::new_aligned(
        comptime!(16 * CMMA_WARPS * (d + 8) / nv),
        128usize,
    );
    let mut vs = SharedMemory::<Vector<F, N>>::new_aligned(
        comptime!(16 * CMMA_WARPS * (d + 8) / nv),
        128usize,
    );
    let mut qs =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(CMMA_INNER * (d + 8) / nv), 128usize);
    let mut dos =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(CMMA_INNER * (d + 8) / nv), 128usize);
    let mut pts =
        SharedMemory::<F>::new_aligned(comptime!(16 * CMMA_WARPS * (CMMA_INNER + 8)), 128usize);
    let mut dsts =
        SharedMemory::<F>::new_aligned(comptime!(16 * CMMA_WARPS * (CMMA_INNER + 8)), 128usize);
    // S^T and dP^T (two blocks of pitch ld_s), at the end dK / dV (pitch ld_o).
    let mut scratch = SharedMemory::<f32>::new_aligned(
        comptime!(scratch_len(16 * CMMA_WARPS, CMMA_INNER + 4, d + 4)),
        128usize,
    );
    let mut lse_s = SharedMemory::<f32>::new(comptime!(CMMA_INNER));
    let mut delta_s = SharedMemory::<f32>::new(comptime!(CMMA_INNER));

    let k_base = (b * k.stride(0) + hk * k.stride(1)) / nv;
    let v_base = (b * v.stride(0) + hk * v.stride(1)) / nv;
    stage_tile::<F, N>(
        k,
        k_base,
        k.stride(2) / nv,
        k0,
        seq,
        &mut ks,
        bk,
        d,
        ldt,
        nv,
        nthreads,
    );
    stage_tile::<F, N>(
        v,
        v_base,
        v.stride(2) / nv,
        k0,
        seq,
        &mut vs,
        bk,
        d,
        ldt,
        nv,
        nthreads,
    );
    let q_rs = q.stride(2) / nv;
    let do_rs = d_o.stride(2) / nv;

    let dk_accs = zero_accumulators(d_tiles);
    let dv_accs = zero_accumulators(d_tiles);

    let n_qb = (seq + bq - 1) / bq;
    // Queries before k0 see none of this block's keys.
    let qb_start = k0 / bq;
    for hh in 0..grp {
        let h = hk * grp + hh;
        let q_base = (b * q.stride(0) + h * q.stride(1)) / nv;
        let do_base = (b * d_o.stride(0) + h * d_o.stride(1)) / nv;
        let lse_base = b * lse.stride(0) + h * lse.stride(1);
        let delta_base = b * delta.stride(0) + h * delta.stride(1);
        for qb in qb_start..n_qb {
            let q0 = qb * bq;
            sync_cube();
            stage_tile::<F, N>(q, q_base, q_rs, q0, seq, &mut qs, bq, d, ldt, nv, nthreads);
            stage_tile::<F, N>(
                d_o, do_base, do_rs, q0, seq, &mut dos, bq, d, ldt, nv, nthreads,
            );
            if t < bq {
                let qi = q0 + t;
                let mut lv = f32::new(0.0);
                let mut dl = f32::new(0.0);
                if qi < seq {
                    lv = lse[lse_base + qi * lse.stride(2)];
                    dl = delta[delta_base + qi * delta.stride(2)];
                }
                lse_s[t] = lv;
                delta_s[t] = dl;
            }
            sync_cube();

            // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys.
            mma_strip_abt::<F, N>(
                &ks,
                warp * 16 * ldt,
                &qs,
                &mut scratch,
                wbase,
                ldt,
                ldt,
                ld_s,
                q_tiles,
                d_tiles,
                nv,
            );
            mma_strip_abt::<F, N>(
                &vs,
                warp * 16 * ldt,
                &dos,
                &mut scratch,
                wbase + dp_off,
                ldt,
                ldt,
                ld_s,
                q_tiles,
                d_tiles,
                nv,
            );
            sync_plane();

            #[unroll]
            for ii in 0..half_q {
                let i = half + 2 * ii;
                let qi = q0 + i;
                let mut p = f32::new(0.0);
                let mut ds = f32::new(0.0);
                if key <= qi && qi < seq {
                    p = (scratch[wbase + lr * ld_s + i] * scale - lse_s[i]).exp();
                    ds = p * (scratch[wbase + dp_off + lr * ld_s + i] - delta_s[i]);
                }
                pts[r * ld_p + i] = F::cast_from(p);
                dsts[r * ld_p + i] = F::cast_from(ds);
            }
            sync_plane();

            // dV += P^T dO and dK += dS^T Q for this warp's 16 keys.
            mma_strip_ab_acc::<F, N>(
                &pts,
                warp * 16 * ld_p,
                &dos,
                &dv_accs,
                ld_p,
                ldt,
                d_tiles,
                q_tiles,
                nv,
            );
            mma_strip_ab_acc::<F, N>(
                &dsts,
                warp * 16 * ld_p,
                &qs,
                &dk_accs,
                ld_p,
                ldt,
                d_tiles,
                q_tiles,
                nv,
            );
        }
    }

    let dk_base = b * dk.stride(0) + hk * dk.stride(1) + key * dk.stride(2);
    let dv_base = b * dv.stride(0) + hk * dv.stride(1) + key * dv.stride(2);

    sync_cube();
    store_accumulators(&dk_accs, &mut scratch, wbase, ld_o, d_tiles);
    sync_cube();
    if key < seq {
        #[unroll]
        for cc in 0..half_d {
            let c = half + 2 * cc;
            dk[dk_base + c] = F::cast_from(scratch[wbase + lr * ld_o + c] * scale);
        }
    }
    sync_cube();
    store_accumulators(&dv_accs, &mut scratch, wbase, ld_o, d_tiles);
    sync_cube();
    if key < seq {
        #[unroll]
        for cc in 0..half_d {
            let c = half + 2 * cc;
            dv[dv_base + c] = F::cast_from(scratch[wbase + lr * ld_o + c]);
        }
    }
}

/// dQ, tensor cores. Cube = (query head, query block from the last, batch); the next key
/// block is loaded into registers while the current one is in use.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_bwd_dq_cmma<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq_out: &mut Tensor<F>,
    scale: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[define(F)] _dtype: StorageType,
) {
    let bq = comptime!(16 * CMMA_WARPS);
    let bk = comptime!(CMMA_INNER);
    let nthreads = comptime!(32 * CMMA_WARPS);
    let ldt = comptime!(d + 8);
    let ld_s = comptime!(CMMA_INNER + 4);
    let ld_p = comptime!(CMMA_INNER + 8);
    let ld_o = comptime!(d + 4);
    let half_d = comptime!(d / 2);
    let half_k = comptime!(CMMA_INNER / 2);
    let d_tiles = comptime!(d / 16);
    let k_tiles = comptime!(CMMA_INNER / 16);
    // Each warp owns a part of scratch: its S and dP rows (pitch ld_s, dP at dp_off), at the
    // end its accumulators (pitch ld_o).
    let dp_off = comptime!(16 * (CMMA_INNER + 4));
    let warp_scratch = comptime!(scratch_len(16, CMMA_INNER + 4, d + 4));
    let kv_regs = comptime!(CMMA_INNER * d / nv / (32 * CMMA_WARPS));

    let seq = seq_len as usize;
    let h = CUBE_POS_X as usize;
    let qb = n_blocks as usize - 1 - CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let hk = h / group as usize;
    let t = UNIT_POS as usize;
    let warp = t / 32;
    let r = t / 2;
    let half = t % 2;
    let lr = r % 16;
    let wbase = warp * warp_scratch;
    let q0 = qb * bq;
    let row = q0 + r;

    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(
        comptime!(16 * CMMA_WARPS * (d + 8) / nv),
        128usize,
    );
    let mut dos = SharedMemory::<Vector<F, N>>::new_aligned(
        comptime!(16 * CMMA_WARPS * (d + 8) / nv),
        128usize,
    );
    let mut ks =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(CMMA_INNER * (d + 8) / nv), 128usize);
    let mut vs =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(CMMA_INNER * (d + 8) / nv), 128usize);
    let mut dss =
        SharedMemory::<F>::new_aligned(comptime!(16 * CMMA_WARPS * (CMMA_INNER + 8)), 128usize);
    let mut scratch = SharedMemory::<f32>::new_aligned(
        comptime!(scratch_len(16 * CMMA_WARPS, CMMA_INNER + 4, d + 4)),
        128usize,
    );

    let q_base = (b * q.stride(0) + h * q.stride(1)) / nv;
    let do_base = (b * d_o.stride(0) + h * d_o.stride(1)) / nv;
    let k_base = (b * k.stride(0) + hk * k.stride(1)) / nv;
    let v_base = (b * v.stride(0) + hk * v.stride(1)) / nv;
    let k_rs = k.stride(2) / nv;
    let v_rs = v.stride(2) / nv;
    stage_tile::<F, N>(
        q,
        q_base,
        q.stride(2) / nv,
        q0,
        seq,
        &mut qs,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );
    stage_tile::<F, N>(
        d_o,
        do_base,
        d_o.stride(2) / nv,
        q0,
        seq,
        &mut dos,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );

    let mut lse_r = f32::new(0.0);
    let mut delta_r = f32::new(0.0);
    if row < seq {
        lse_r = lse[b * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2)];
        delta_r = delta[b * delta.stride(0) + h * delta.stride(1) + row * delta.stride(2)];
    }

    let dq_accs = zero_accumulators(d_tiles);

    let mut q_end = q0 + bq;
    if seq < q_end {
        q_end = seq;
    }
    let n_kb = (q_end + bk - 1) / bk;

    let mut k_regs = Array::<Vector<F, N>>::new(kv_regs);
    let mut v_regs = Array::<Vector<F, N>>::new(kv_regs);
    load_tile_regs::<F, N>(k, k_base, k_rs, 0, seq, &mut k_regs, bk, d, nv, nthreads);
    load_tile_regs::<F, N>(v, v_base, v_rs, 0, seq, &mut v_regs, bk, d, nv, nthreads);

    for kb in 0..n_kb {
        let k0 = kb * bk;
        sync_cube();
        store_tile_regs::<F, N>(&k_regs, &mut ks, bk, d, ldt, nv, nthreads);
        store_tile_regs::<F, N>(&v_regs, &mut vs, bk, d, ldt, nv, nthreads);
        sync_cube();
        if kb + 1 < n_kb {
            load_tile_regs::<F, N>(
                k,
                k_base,
                k_rs,
                k0 + bk,
                seq,
                &mut k_regs,
                bk,
                d,
                nv,
                nthreads,
            );
            load_tile_regs::<F, N>(
                v,
                v_base,
                v_rs,
                k0 + bk,
                seq,
                &mut v_regs,
                bk,
                d,
                nv,
                nthreads,
            );
        }

        // S = Q K^T and dP = dO V^T for this warp's 16 rows.
        mma_strip_abt::<F, N>(
            &qs,
            warp * 16 * ldt,
            &ks,
            &mut scratch,
            wbase,
            ldt,
            ldt,
            ld_s,
            k_tiles,
            d_tiles,
            nv,
        );
        mma_strip_abt::<F, N>(
            &dos,
            warp * 16 * ldt,
            &vs,
            &mut scratch,
            wbase + dp_off,
            ldt,
            ldt,
            ld_s,
            k_tiles,
            d_tiles,
            nv,
        );
        sync_plane();

        #[unroll]
        for jj in 0..half_k {
            let j = half + 2 * jj;
            let key = k0 + j;
            let mut ds = f32::new(0.0);
            if key <= row && row < seq {
                let p = (scratch[wbase + lr * ld_s + j] * scale - lse_r).exp();
                ds = p * (scratch[wbase + dp_off + lr * ld_s + j] - delta_r);
            }
            dss[r * ld_p + j] = F::cast_from(ds);
        }
        sync_plane();

        // dQ += dS K for this warp's strip.
        mma_strip_ab_acc::<F, N>(
            &dss,
            warp * 16 * ld_p,
            &ks,
            &dq_accs,
            ld_p,
            ldt,
            d_tiles,
            k_tiles,
            nv,
        );
    }

    sync_cube();
    store_accumulators(&dq_accs, &mut scratch, wbase, ld_o, d_tiles);
    sync_cube();
    if row < seq {
        let base = b * dq_out.stride(0) + h * dq_out.stride(1) + row * dq_out.stride(2);
        #[unroll]
        for cc in 0..half_d {
            let c = half + 2 * cc;
            dq_out[base + c] = F::cast_from(scratch[wbase + lr * ld_o + c] * scale);
        }
    }
}

/// Elements of a scratch buffer that holds either two `rows x ld_two` score blocks or one
/// `rows x ld_one` output block.
const fn scratch_len(rows: usize, ld_two: usize, ld_one: usize) -> usize {
    let two = 2 * rows * ld_two;
    let one = rows * ld_one;
    if two > one { two } else { one }
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

/// The validated sizes of one attention call.
#[derive(Clone, Copy, Debug)]
struct Dims {
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq: usize,
    head_dim: usize,
}

impl Dims {
    fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }
}

fn dims4(name: &str, t: &CubeTensor<impl CubeRuntime>) -> [usize; 4] {
    let shape = t.meta.shape();
    assert!(
        shape.num_dims() == 4,
        "flash attention: {name} must be [B, H, S, D], got shape {:?}",
        shape
    );
    [shape[0], shape[1], shape[2], shape[3]]
}

/// Checks q/k/v against each other and the kernels' limits; panics with the shapes otherwise.
fn check_qkv<R: CubeRuntime>(q: &CubeTensor<R>, k: &CubeTensor<R>, v: &CubeTensor<R>) -> Dims {
    let [b, hq, s, d] = dims4("q", q);
    let kd = dims4("k", k);
    let vd = dims4("v", v);
    let ctx = || format!("q {:?}, k {:?}, v {:?}", [b, hq, s, d], kd, vd);
    assert!(
        kd == vd,
        "flash attention: k and v shapes differ ({})",
        ctx()
    );
    assert!(
        kd[0] == b && kd[2] == s && kd[3] == d,
        "flash attention: k/v must be [B, Hkv, S, D] with q's B, S and D ({})",
        ctx()
    );
    let hkv = kd[1];
    assert!(
        hkv > 0 && hq > 0 && hq % hkv == 0,
        "flash attention: query heads must be a multiple of kv heads ({})",
        ctx()
    );
    assert!(
        s >= 1 && b >= 1,
        "flash attention: empty batch or sequence ({})",
        ctx()
    );
    assert!(
        d == 64 || d == 128,
        "flash attention: head dim must be 64 or 128 ({})",
        ctx()
    );
    assert!(
        q.dtype == k.dtype && q.dtype == v.dtype,
        "flash attention: q, k, v dtypes differ ({:?}, {:?}, {:?})",
        q.dtype,
        k.dtype,
        v.dtype
    );
    assert!(
        matches!(q.dtype, DType::F32 | DType::F16 | DType::BF16),
        "flash attention: unsupported dtype {:?}",
        q.dtype
    );
    q.assert_is_on_same_device(k);
    q.assert_is_on_same_device(v);
    // The grid puts query heads on x and blocks on y (at most 65535).
    assert!(
        s.div_ceil(PLAIN_BLOCK) <= 65_535 && b <= 65_535,
        "flash attention: sequence or batch too large for the launch grid ({})",
        ctx()
    );
    Dims {
        batch: b,
        heads_q: hq,
        heads_kv: hkv,
        seq: s,
        head_dim: d,
    }
}

/// Kernels index with 32-bit offsets and assume a unit stride on the last dimension.
fn prepare<R: CubeRuntime>(name: &str, t: CubeTensor<R>) -> CubeTensor<R> {
    let t = if t.meta.strides()[t.meta.num_dims() - 1] != 1 {
        into_contiguous(t)
    } else {
        t
    };
    assert!(
        t.required_address_type() == AddressType::U32,
        "flash attention: {name} {:?} is too large for 32-bit indexing",
        t.meta.shape()
    );
    t
}

/// Widest vector (8, 4, 2 or 1 elements) in which the cmma kernels can read all of `tensors`:
/// 16-byte loads instead of 2-byte ones, when every row start is aligned for them.
fn vector_width<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> usize {
    [8usize, 4, 2]
        .into_iter()
        .find(|&w| {
            tensors.iter().all(|t| {
                let strides = t.meta.strides();
                let bytes = (w * t.dtype.size()) as u64;
                t.meta.shape()[3] % w == 0
                    && (0..3).all(|i| strides[i] % w == 0)
                    && t.handle.offset_start.unwrap_or(0) % bytes == 0
            })
        })
        .unwrap_or(1)
}

fn check_variant<R: CubeRuntime>(variant: FlashVariant, q: &CubeTensor<R>) {
    match variant {
        FlashVariant::Plain => {}
        FlashVariant::Cmma => assert!(
            cmma_supported(&q.client, q.dtype),
            "flash attention: the Cmma variant needs bf16/f16 inputs with tensor-core support \
             (dtype {:?}); use FlashVariant::Plain",
            q.dtype
        ),
        FlashVariant::Mma => assert!(
            mma_supported(&q.client, q.dtype),
            "flash attention: the Mma variant needs bf16/f16 inputs and mma.sync m16n8k16 + \
             ldmatrix (sm_80+) (dtype {:?}); use FlashVariant::Plain or Cmma",
            q.dtype
        ),
    }
}

/// Causal flash attention forward with the model path's variant ([`FlashVariant::from_env`]:
/// `SMP_BURN_FLASH`, else the best for the device and dtype).
///
/// Returns `(o, lse)`: `o [B, Hq, S, D]` in q's dtype (memory order per [`flash_layout`]) and
/// `lse [B, Hq, S]` (contiguous) in f32, the
/// log-sum-exp of the scaled scores per query row, which the backward needs instead of the
/// `S x S` probabilities. `scale` is usually `1 / sqrt(D)`.
pub fn flash_forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let variant = FlashVariant::from_env(&q.client, q.dtype);
    flash_forward_with(variant, q, k, v, scale)
}

/// [`flash_forward`] with an explicit [`FlashVariant`], so the two can be checked against each
/// other.
pub fn flash_forward_with<R: CubeRuntime>(
    variant: FlashVariant,
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let dims = check_qkv(&q, &k, &v);
    check_variant(variant, &q);
    let (q, k, v) = (prepare("q", q), prepare("k", k), prepare("v", v));
    let client = q.client.clone();
    let device = q.device.clone();
    let dtype = q.dtype;
    let Dims {
        batch,
        heads_q,
        seq,
        head_dim,
        ..
    } = dims;

    let o = flash_layout().alloc([batch, heads_q, seq, head_dim], |shape| {
        empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), shape, dtype)
    });
    let lse = empty_device_contiguous_dtype::<R>(
        client.clone(),
        device,
        Shape::new([batch, heads_q, seq]),
        DType::F32,
    );

    let group = dims.group() as u32;
    match variant {
        FlashVariant::Plain => {
            let n_blocks = seq.div_ceil(PLAIN_BLOCK) as u32;
            let count = CubeCount::Static(heads_q as u32, n_blocks, batch as u32);
            // SAFETY: every index is bounded by the shapes checked above: rows and keys past
            // `seq` are never read from global memory, and shared indices stay inside the
            // comptime-sized tiles.
            unsafe {
                flash_fwd_plain::launch_unchecked::<R>(
                    &client,
                    count,
                    CubeDim::new_1d(PLAIN_THREADS as u32),
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    o.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    scale,
                    seq as u32,
                    group,
                    n_blocks,
                    head_dim,
                    dtype.into(),
                );
            }
        }
        FlashVariant::Cmma => {
            let nv = vector_width(&[&q, &k, &v]);
            let n_blocks = seq.div_ceil(16 * CMMA_WARPS) as u32;
            let count = CubeCount::Static(heads_q as u32, n_blocks, batch as u32);
            // SAFETY: as for the plain kernel.
            unsafe {
                flash_fwd_cmma::launch_unchecked::<R>(
                    &client,
                    count,
                    CubeDim::new_1d(32 * CMMA_WARPS as u32),
                    nv,
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    o.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    scale,
                    seq as u32,
                    group,
                    n_blocks,
                    head_dim,
                    nv,
                    dtype.into(),
                );
            }
        }
        FlashVariant::Mma => flash_mma::launch_forward(
            q,
            k,
            v,
            &o,
            &lse,
            scale,
            heads_q,
            batch,
            seq,
            head_dim,
            dims.group(),
        ),
    }
    (o, lse)
}

/// Causal flash attention backward with the model path's variant ([`FlashVariant::from_env`]).
///
/// Takes the forward's inputs, its outputs `o` and `lse`, and `d_o` (the gradient of `o`);
/// returns `(dq, dk, dv)` in the inputs' dtype (memory order per [`flash_layout`]), `dk`/`dv`
/// summed over the query heads that share a kv head. Recomputes the probabilities from `lse` instead of storing them.
///
/// Deterministic with the default tilings. The Mma variant's `*-atomic` backward tilings
/// ([`MmaBwdTiling`], `SMP_BURN_FLASH_MMA_BWD_TILING`) sum dQ with f32 atomics and are not
/// bitwise reproducible from run to run.
#[allow(clippy::too_many_arguments)]
pub fn flash_backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    o: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_o: CubeTensor<R>,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let variant = FlashVariant::from_env(&q.client, q.dtype);
    flash_backward_with(variant, q, k, v, o, lse, d_o, scale)
}

/// [`flash_backward`] with an explicit [`FlashVariant`]. The backward only needs `o` and `lse`,
/// which every forward variant produces alike, so the variants can be mixed across the two
/// calls.
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_with<R: CubeRuntime>(
    variant: FlashVariant,
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    o: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_o: CubeTensor<R>,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let dims = check_qkv(&q, &k, &v);
    check_variant(variant, &q);
    let Dims {
        batch,
        heads_q,
        heads_kv,
        seq,
        head_dim,
    } = dims;
    let q_shape = [batch, heads_q, seq, head_dim];
    assert!(
        dims4("o", &o) == q_shape && dims4("d_o", &d_o) == q_shape,
        "flash attention backward: o {:?} and d_o {:?} must have q's shape {:?}",
        o.meta.shape(),
        d_o.meta.shape(),
        q_shape
    );
    assert!(
        o.dtype == q.dtype && d_o.dtype == q.dtype,
        "flash attention backward: o ({:?}) and d_o ({:?}) must have q's dtype {:?}",
        o.dtype,
        d_o.dtype,
        q.dtype
    );
    let lse_shape = lse.meta.shape();
    assert!(
        lse_shape.num_dims() == 3
            && [lse_shape[0], lse_shape[1], lse_shape[2]] == [batch, heads_q, seq]
            && lse.dtype == DType::F32,
        "flash attention backward: lse must be f32 [B, Hq, S] = {:?}, got {:?} {:?}",
        [batch, heads_q, seq],
        lse_shape,
        lse.dtype
    );
    q.assert_is_on_same_device(&o);
    q.assert_is_on_same_device(&d_o);
    q.assert_is_on_same_device(&lse);

    let (q, k, v) = (prepare("q", q), prepare("k", k), prepare("v", v));
    let (o, d_o) = (prepare("o", o), prepare("d_o", d_o));
    let lse = prepare("lse", lse);
    let client = q.client.clone();
    let device = q.device.clone();
    let dtype = q.dtype;
    let group = dims.group() as u32;

    let delta = empty_device_contiguous_dtype::<R>(
        client.clone(),
        device.clone(),
        Shape::new([batch, heads_q, seq]),
        DType::F32,
    );
    let layout = flash_layout();
    let alloc =
        |shape| empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), shape, dtype);
    let dq = layout.alloc(q_shape, alloc);
    let dk = layout.alloc([batch, heads_kv, seq, head_dim], alloc);
    let dv = layout.alloc([batch, heads_kv, seq, head_dim], alloc);

    let total_rows = batch * heads_q * seq;
    assert!(
        total_rows <= u32::MAX as usize,
        "flash attention backward: too many rows ({total_rows})"
    );
    if variant == FlashVariant::Mma
        && flash_mma::backward_tiling(&client, head_dim, vector_width(&[&q, &k, &v, &d_o]))
            .wide_delta
    {
        flash_mma::launch_delta_wide(o, &d_o, &delta, q_shape);
    } else {
        // SAFETY: the kernel guards `pos < total_rows`; indices follow the checked shapes.
        unsafe {
            flash_delta_kernel::launch_unchecked::<R>(
                &client,
                CubeCount::Static(total_rows.div_ceil(DELTA_THREADS) as u32, 1, 1),
                CubeDim::new_1d(DELTA_THREADS as u32),
                o.into_tensor_arg(),
                d_o.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                seq as u32,
                heads_q as u32,
                total_rows as u32,
                head_dim,
                dtype.into(),
            );
        }
    }

    match variant {
        FlashVariant::Plain => {
            let dim = CubeDim::new_1d(PLAIN_THREADS as u32);
            let n_blocks = seq.div_ceil(PLAIN_BLOCK) as u32;
            // SAFETY: see flash_forward_with.
            unsafe {
                flash_bwd_dkdv_plain::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(heads_kv as u32, n_blocks, batch as u32),
                    dim,
                    q.clone().into_tensor_arg(),
                    k.clone().into_tensor_arg(),
                    v.clone().into_tensor_arg(),
                    d_o.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    delta.clone().into_tensor_arg(),
                    dk.clone().into_tensor_arg(),
                    dv.clone().into_tensor_arg(),
                    scale,
                    seq as u32,
                    group,
                    head_dim,
                    dtype.into(),
                );
                flash_bwd_dq_plain::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(heads_q as u32, n_blocks, batch as u32),
                    dim,
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    d_o.into_tensor_arg(),
                    lse.into_tensor_arg(),
                    delta.into_tensor_arg(),
                    dq.clone().into_tensor_arg(),
                    scale,
                    seq as u32,
                    group,
                    n_blocks,
                    head_dim,
                    dtype.into(),
                );
            }
        }
        FlashVariant::Mma => flash_mma::launch_backward(
            q, k, v, d_o, lse, delta, &dq, &dk, &dv, scale, q_shape, heads_kv, layout,
        ),
        FlashVariant::Cmma => {
            let nv = vector_width(&[&q, &k, &v, &d_o]);
            let dim = CubeDim::new_1d(32 * CMMA_WARPS as u32);
            let n_blocks = seq.div_ceil(16 * CMMA_WARPS) as u32;
            // SAFETY: see flash_forward_with.
            unsafe {
                flash_bwd_dkdv_cmma::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(heads_kv as u32, n_blocks, batch as u32),
                    dim,
                    nv,
                    q.clone().into_tensor_arg(),
                    k.clone().into_tensor_arg(),
                    v.clone().into_tensor_arg(),
                    d_o.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    delta.clone().into_tensor_arg(),
                    dk.clone().into_tensor_arg(),
                    dv.clone().into_tensor_arg(),
                    scale,
                    seq as u32,
                    group,
                    head_dim,
                    nv,
                    dtype.into(),
                );
                flash_bwd_dq_cmma::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(heads_q as u32, n_blocks, batch as u32),
                    dim,
                    nv,
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    d_o.into_tensor_arg(),
                    lse.into_tensor_arg(),
                    delta.into_tensor_arg(),
                    dq.clone().into_tensor_arg(),
                    scale,
                    seq as u32,
                    group,
                    n_blocks,
                    head_dim,
                    nv,
                    dtype.into(),
                );
            }
        }
    }
    (dq, dk, dv)
}
