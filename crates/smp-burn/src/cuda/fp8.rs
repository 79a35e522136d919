//! FP8 linear layers on Hopper and Ada: per-tensor current scaling, casts with the transposed
//! copies the backward GEMMs need, and cuBLASLt FP8 GEMMs, all queued on Burn's stream with
//! the scales kept on the device (no host synchronization per layer).
//!
//! Per layer `y = x w^T` (`x: [m, k]`, `w: [n, k]`, both bf16):
//! - forward: the amaxes of `x` and `w`, then one pass per tensor that casts it to E4M3 with
//!   scale `448 / amax` ([`crate::fp8::scale_for`]), writing the row-major copy and, for `x`,
//!   the transposed one the weight gradient needs (kept for the backward in place of `x`,
//!   half its bytes), and for `w` the transposed one `dx` needs (kept too: the backward does
//!   not read or cast the bf16 weight again); then `y` by an FP8 GEMM with fp32 accumulation
//!   (fast accumulation, as Transformer Engine and torchao do for the forward) and a bf16
//!   output;
//! - backward: the amax of `dy`, one pass casting it to E5M2 in both layouts, then `dx = dy w`
//!   and `dw = dy^T x` as FP8 GEMMs with full-precision accumulation. cuBLASLt's FP8 kernels
//!   take only the "TN" layout (both operands with the reduction dimension contiguous), hence
//!   the transposed copies.
//!
//! Layers that read one input (q, k and v; gate and up) share its cast: the last input's FP8
//! copies are kept, keyed by its autodiff node, and a layer that reads the same node again
//! uses them instead of measuring and casting the input once more.
//!
//! The kernels are CUDA C compiled by NVRTC when a device first needs them: CubeCL 0.10 writes
//! FP8 casts without saturation (an overflow becomes NaN), while `cvt.rn.satfinite` is what
//! every FP8 recipe relies on.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::{DType as BurnDType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use cubecl::server::Binding;
use cudarc::cublaslt::{result as lt, sys as lts};
use cudarc::driver::sys as ds;

use super::bridge::Cube;
use super::device::{CudaCube, cuda_compute_capability, cuda_err, launch_ptx};
use super::gemm::{CudaAutodiff, Step, dx_buffer, register_linear_grads, rows_cols, submit_steps};
use crate::error::SmpError;
use crate::fp8::Fp8Format;

/// The kernels: amax by a grid-stride pass (vectors of 8 bf16) with an atomic max over the
/// float bits (non-negative floats order as their bits); the cast by 64 x 64 tiles, each
/// thread converting 4 x 4 values, the transposed copy written from the tile in shared memory.
/// The scale is computed from the amax by every block, so no kernel sits between the two.
const FP8_KERNELS: &str = r#"
typedef unsigned short bf16_t;

__device__ __forceinline__ float fp8_scale(const unsigned* amax, float fmax) {
    float a = __uint_as_float(*amax);
    if (a == 0.0f) return 1.0f;
    if (!(a <= 3.402823466e38f)) return __int_as_float(0x7fffffff);
    return fmax / a;
}

extern "C" __global__ void smp_fp8_amax(const bf16_t* __restrict__ x, unsigned long long n,
                                        unsigned* __restrict__ amax) {
    float m = 0.0f;
    unsigned long long n8 = n / 8;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long start = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const uint4* x8 = (const uint4*)x;
    for (unsigned long long i = start; i < n8; i += stride) {
        uint4 v = x8[i];
        unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            m = fmaxf(m, fabsf(__uint_as_float(w[j] << 16)));
            m = fmaxf(m, fabsf(__uint_as_float(w[j] & 0xffff0000u)));
        }
    }
    for (unsigned long long i = n8 * 8 + start; i < n; i += stride) {
        m = fmaxf(m, fabsf(__uint_as_float(((unsigned)x[i]) << 16)));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __shared__ float warp_max[32];
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (threadIdx.x == 0) atomicMax(amax, __float_as_uint(m));
    }
}

// Delayed scaling's state per tensor: [amax of the casts since the last roll, ring position,
// scale, descale, ring of the last HISTORY amaxes] (u32 words, floats as bits).
#define HISTORY 16
extern "C" __global__ void smp_fp8_roll(unsigned* state, float fmax) {
    unsigned pos = state[1];
    state[4 + pos] = state[0];
    state[0] = 0u;
    state[1] = (pos + 1) % HISTORY;
    float m = 0.0f;
    bool overflow = false;
    for (int i = 0; i < HISTORY; i++) {
        float a = __uint_as_float(state[4 + i]);
        if (!(a <= 3.402823466e38f)) overflow = true; else m = fmaxf(m, a);
    }
    float s = overflow ? __int_as_float(0x7fffffff) : (m == 0.0f ? 1.0f : fmax / m);
    state[2] = __float_as_uint(s);
    state[3] = __float_as_uint(1.0f / s);
}

__device__ __forceinline__ float abs_max4(unsigned lo2, unsigned hi2) {
    return fmaxf(fmaxf(fabsf(__uint_as_float(lo2 << 16)), fabsf(__uint_as_float(lo2 & 0xffff0000u))),
                 fmaxf(fabsf(__uint_as_float(hi2 << 16)), fabsf(__uint_as_float(hi2 & 0xffff0000u))));
}

template <bool E5M2>
__device__ __forceinline__ unsigned cvt4(unsigned lo2, unsigned hi2, float s) {
    float f0 = __uint_as_float(lo2 << 16) * s, f1 = __uint_as_float(lo2 & 0xffff0000u) * s;
    float f2 = __uint_as_float(hi2 << 16) * s, f3 = __uint_as_float(hi2 & 0xffff0000u) * s;
    unsigned short a, b;
    if (E5M2) {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(a) : "f"(f1), "f"(f0));
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(b) : "f"(f3), "f"(f2));
    } else {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(a) : "f"(f1), "f"(f0));
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(b) : "f"(f3), "f"(f2));
    }
    return (unsigned)a | ((unsigned)b << 16);
}

// rows and cols are multiples of 4; grid (ceil(cols / 64), ceil(rows / 64)), 256 threads.
// The scale comes from `amax`, or with a delayed-scaling `history` from its state, and then the
// amax of this tensor is max-reduced into the state for the next roll.
template <bool E5M2>
__device__ void cast_tile(const bf16_t* __restrict__ x, int rows, int cols,
                          const unsigned* __restrict__ amax, unsigned* __restrict__ history,
                          float fmax, unsigned char* __restrict__ out,
                          unsigned char* __restrict__ out_t, float* __restrict__ descale) {
    __shared__ unsigned tile[64][17];
    __shared__ float warp_max[8];
    float s = history ? __uint_as_float(history[2]) : fp8_scale(amax, fmax);
    float m = 0.0f;
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *descale = 1.0f / s;
    int r0 = blockIdx.y * 64, c0 = blockIdx.x * 64;
    int tc = (threadIdx.x & 15) * 4, tr = threadIdx.x >> 4;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = tr + 16 * i, gr = r0 + r, gc = c0 + tc;
        unsigned packed = 0;
        if (gr < rows && gc < cols) {
            uint2 v = *(const uint2*)(x + (size_t)gr * cols + gc);
            packed = cvt4<E5M2>(v.x, v.y, s);
            m = fmaxf(m, abs_max4(v.x, v.y));
            if (out) *(unsigned*)(out + (size_t)gr * cols + gc) = packed;
        }
        tile[r][tc >> 2] = packed;
    }
    if (history) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int i = 1; i < 8; i++) m = fmaxf(m, warp_max[i]);
            atomicMax(history, __float_as_uint(m));
        }
    }
    if (!out_t) return;
    __syncthreads();
    int rr = (threadIdx.x & 15) * 4, cc0 = threadIdx.x >> 4;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int cc = cc0 + 16 * i, gc = c0 + cc, gr = r0 + rr;
        if (gc < cols && gr < rows) {
            unsigned shift = (cc & 3) * 8, b = 0;
#pragma unroll
            for (int j = 0; j < 4; j++) b |= ((tile[rr + j][cc >> 2] >> shift) & 0xffu) << (8 * j);
            *(unsigned*)(out_t + (size_t)gc * rows + gr) = b;
        }
    }
}

extern "C" __global__ void smp_fp8_cast_e4m3(const bf16_t* x, int rows, int cols,
                                             const unsigned* amax, unsigned* history,
                                             unsigned char* out, unsigned char* out_t,
                                             float* descale) {
    cast_tile<false>(x, rows, cols, amax, history, 448.0f, out, out_t, descale);
}

extern "C" __global__ void smp_fp8_cast_e5m2(const bf16_t* x, int rows, int cols,
                                             const unsigned* amax, unsigned* history,
                                             unsigned char* out, unsigned char* out_t,
                                             float* descale) {
    cast_tile<true>(x, rows, cols, amax, history, 57344.0f, out, out_t, descale);
}
"#;

/// cuBLASLt's workspace per stream: what NVIDIA recommends for Hopper's GEMM kernels.
const LT_WORKSPACE_BYTES: usize = 32 << 20;

/// Whether CUDA device `index` has FP8 tensor cores (compute capability 8.9 or later).
pub fn fp8_capable(index: usize) -> bool {
    static SEEN: Mutex<Vec<(usize, bool)>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, ok)) = seen.iter().find(|(i, _)| *i == index) {
        return *ok;
    }
    let ok = cuda_compute_capability(index).is_some_and(|cc| cc >= (8, 9));
    seen.push((index, ok));
    ok
}

/// The refusal of a device without FP8 tensor cores, naming it and its capability.
pub fn check_fp8_device(index: usize) -> Result<(), SmpError> {
    if fp8_capable(index) {
        return Ok(());
    }
    Err(SmpError::Config(match cuda_compute_capability(index) {
        Some((major, minor)) => format!(
            "FP8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); CUDA device \
             {index} is {major}.{minor}"
        ),
        None => format!("FP8 needs a CUDA GPU; CUDA device {index} is not there"),
    }))
}

/// One step of an FP8 layer, issued on Burn's stream in order with the GEMMs around it.
pub(super) enum Fp8Step {
    /// Zeroes `amax` (one u32) and max-reduces `|x|` over `len` bf16 values into it.
    Amax {
        x: Binding,
        len: usize,
        amax: Binding,
    },
    /// Moves a delayed-scaling state's latest amax into its history and sets the scale of the
    /// next casts from the history's largest ([`crate::fp8::AmaxHistory`] on the device).
    Roll { state: Binding, format: Fp8Format },
    /// Casts bf16 `x` (`rows x cols`) with the scale of `scale` to `format`: row-major into
    /// `out`, transposed (`cols x rows`) into `out_t`, and `1 / scale` into `descale`.
    Cast {
        x: Binding,
        rows: usize,
        cols: usize,
        scale: ScaleSource,
        format: Fp8Format,
        out: Option<Binding>,
        out_t: Option<Binding>,
        descale: Binding,
    },
    /// Column-major `C[m, n] (+)= descale_a descale_b A^T B`, `A` stored `k x m` and `B`
    /// stored `k x n` (both with `k` contiguous, leading dimension `lda` / `ldb`), bf16 `C`.
    Gemm {
        m: usize,
        n: usize,
        k: usize,
        a: Fp8Operand,
        b: Fp8Operand,
        c: Binding,
        ldc: usize,
        accumulate: bool,
        fast_accumulation: bool,
    },
}

/// Where a cast's scale comes from.
pub(super) enum ScaleSource {
    /// This tensor's amax (u32 float bits), computed just before: current scaling.
    Amax(Binding),
    /// A delayed-scaling state (`HISTORY_STATE_WORDS` u32): its scale, and the cast adds its
    /// amax to the state for the next roll.
    History(Binding),
}

/// The u32 words of a delayed-scaling state: the pending amax, the ring position, the scale,
/// the descale and [`AMAX_HISTORY`] amaxes (the kernels' `HISTORY`).
const HISTORY_STATE_WORDS: usize = 4 + AMAX_HISTORY;

/// How many casts' amaxes a delayed scale looks back over (torchao's delayed recipe took 16).
pub const AMAX_HISTORY: usize = 16;

/// An FP8 GEMM operand: its bytes, leading dimension, format and descale (one f32).
pub(super) struct Fp8Operand {
    data: Binding,
    ld: usize,
    format: Fp8Format,
    descale: Binding,
}

impl Fp8Step {
    /// Every buffer the step touches (for the stream's ordering and the bindings' lifetime).
    pub(super) fn bindings(&self) -> Vec<&Binding> {
        match self {
            Self::Amax { x, amax, .. } => vec![x, amax],
            Self::Roll { state, .. } => vec![state],
            Self::Cast {
                x,
                scale: ScaleSource::Amax(scale) | ScaleSource::History(scale),
                out,
                out_t,
                descale,
                ..
            } => [
                Some(x),
                Some(scale),
                out.as_ref(),
                out_t.as_ref(),
                Some(descale),
            ]
            .into_iter()
            .flatten()
            .collect(),
            Self::Gemm { a, b, c, .. } => vec![&a.data, &a.descale, &b.data, &b.descale, c],
        }
    }

    /// Issues the step on `stream` of `device` (whose context is current), resolving buffers
    /// with `ptr`.
    pub(super) fn issue<G>(
        &self,
        device: usize,
        stream: ds::CUstream,
        ptr: &mut impl FnMut(&Binding) -> Result<(u64, G), SmpError>,
    ) -> Result<(), SmpError> {
        let engine = fp8_engine(device)?;
        match self {
            Self::Amax { x, len, amax } => {
                let ((mut xp, _gx), (mut ap, _ga)) = (ptr(x)?, ptr(amax)?);
                let mut n = *len as u64;
                let blocks = (len.div_ceil(8 * 256)).clamp(1, 1024) as u32;
                // SAFETY: `amax` is a live 4-byte buffer on this stream's device.
                unsafe { cudarc::driver::result::memset_d8_async(ap, 0, 4, stream) }
                    .map_err(|e| cuda_err("zeroing an FP8 amax", e))?;
                let mut params = [
                    (&mut xp as *mut u64).cast(),
                    (&mut n as *mut u64).cast(),
                    (&mut ap as *mut u64).cast(),
                ];
                // SAFETY: the kernel takes (bf16*, u64, u32*) as passed; `x` holds `len` bf16.
                unsafe {
                    launch_ptx(
                        "FP8 amax kernel",
                        engine.amax,
                        (blocks, 1),
                        256,
                        stream,
                        &mut params,
                    )
                }
            }
            Self::Roll { state, format } => {
                let (mut sp, _gs) = ptr(state)?;
                let mut fmax = format.max();
                let mut params = [(&mut sp as *mut u64).cast(), (&mut fmax as *mut f32).cast()];
                // SAFETY: the kernel takes (u32*, f32); `state` holds HISTORY_STATE_WORDS words.
                unsafe {
                    launch_ptx(
                        "FP8 amax-history kernel",
                        engine.roll,
                        (1, 1),
                        1,
                        stream,
                        &mut params,
                    )
                }
            }
            Self::Cast {
                x,
                rows,
                cols,
                scale,
                format,
                out,
                out_t,
                descale,
            } => {
                let (mut xp, _gx) = ptr(x)?;
                let (source, history) = match scale {
                    ScaleSource::Amax(b) => (b, false),
                    ScaleSource::History(b) => (b, true),
                };
                let (source, _ga) = ptr(source)?;
                let (mut ap, mut hp) = if history { (0, source) } else { (source, 0) };
                let (mut dp, _gd) = ptr(descale)?;
                let out = out.as_ref().map(&mut *ptr).transpose()?;
                let out_t = out_t.as_ref().map(&mut *ptr).transpose()?;
                let mut op = out.as_ref().map_or(0, |o| o.0);
                let mut otp = out_t.as_ref().map_or(0, |o| o.0);
                let (mut r, mut c) = (dim(*rows)?, dim(*cols)?);
                let grid = (cols.div_ceil(64) as u32, rows.div_ceil(64) as u32);
                let mut params = [
                    (&mut xp as *mut u64).cast(),
                    (&mut r as *mut i32).cast(),
                    (&mut c as *mut i32).cast(),
                    (&mut ap as *mut u64).cast(),
                    (&mut hp as *mut u64).cast(),
                    (&mut op as *mut u64).cast(),
                    (&mut otp as *mut u64).cast(),
                    (&mut dp as *mut u64).cast(),
                ];
                let f = match format {
                    Fp8Format::E4M3 => engine.cast_e4m3,
                    Fp8Format::E5M2 => engine.cast_e5m2,
                };
                // SAFETY: the kernel takes the parameters as passed; the buffers hold
                // `rows x cols` values (bf16 in, bytes out), a u32 amax and an f32 descale.
                unsafe { launch_ptx("FP8 cast kernel", f, grid, 256, stream, &mut params) }
            }
            Self::Gemm {
                m,
                n,
                k,
                a,
                b,
                c,
                ldc,
                accumulate,
                fast_accumulation,
            } => {
                let key = GemmKey {
                    m: *m,
                    n: *n,
                    k: *k,
                    lda: a.ld,
                    ldb: b.ld,
                    ldc: *ldc,
                    a: a.format,
                    b: b.format,
                    accumulate: *accumulate,
                    fast_accumulation: *fast_accumulation,
                };
                let (ad, _g1) = ptr(&a.data)?;
                let (mut a_scale, _g2) = ptr(&a.descale)?;
                let (bd, _g3) = ptr(&b.data)?;
                let (mut b_scale, _g4) = ptr(&b.descale)?;
                let (cd, _g5) = ptr(c)?;
                engine.gemm(key, stream, [ad, bd, cd], [&mut a_scale, &mut b_scale])
            }
        }
    }
}

fn dim(v: usize) -> Result<i32, SmpError> {
    i32::try_from(v).map_err(|_| SmpError::Cuda(format!("FP8 dimension {v} exceeds i32")))
}

/// The shape and options of one cached cuBLASLt FP8 GEMM.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct GemmKey {
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
    a: Fp8Format,
    b: Fp8Format,
    accumulate: bool,
    fast_accumulation: bool,
}

/// A GEMM's descriptors and the algorithm cuBLASLt's heuristic picked, kept for the process.
struct LtGemm {
    desc: lts::cublasLtMatmulDesc_t,
    layouts: [lts::cublasLtMatrixLayout_t; 3],
    algo: lts::cublasLtMatmulAlgo_t,
}

/// One device's FP8 machinery, owned by CubeCL's device-server thread.
struct Fp8Engine {
    amax: ds::CUfunction,
    roll: ds::CUfunction,
    cast_e4m3: ds::CUfunction,
    cast_e5m2: ds::CUfunction,
    handle: lts::cublasLtHandle_t,
    /// One workspace per stream: GEMMs of different streams may run at the same time.
    workspaces: RefCell<Vec<(ds::CUstream, ds::CUdeviceptr)>>,
    gemms: RefCell<HashMap<GemmKey, LtGemm>>,
}

thread_local! {
    static ENGINES: RefCell<HashMap<usize, Rc<Fp8Engine>>> = RefCell::new(HashMap::new());
}

fn lt_dtype(f: Fp8Format) -> lts::cudaDataType {
    match f {
        Fp8Format::E4M3 => lts::cudaDataType::CUDA_R_8F_E4M3,
        Fp8Format::E5M2 => lts::cudaDataType::CUDA_R_8F_E5M2,
    }
}

fn lt_err(what: &str) -> impl Fn(lt::CublasError) -> SmpError + '_ {
    move |e| cuda_err(what, e)
}

/// `device`'s engine (its context is current): kernels compiled and a cuBLASLt handle made
/// on first use.
fn fp8_engine(device: usize) -> Result<Rc<Fp8Engine>, SmpError> {
    if let Some(e) = ENGINES.with(|m| m.borrow().get(&device).cloned()) {
        return Ok(e);
    }
    check_fp8_device(device)?;
    let (major, minor) = cuda_compute_capability(device).unwrap_or((9, 0));
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(FP8_KERNELS, opts)
        .map_err(|e| cuda_err("compiling the FP8 kernels (NVRTC)", e))?;
    let image = std::ffi::CString::new(ptx.to_src())
        .map_err(|_| SmpError::Cuda("the FP8 kernels' PTX holds a NUL byte".into()))?;
    let function = |module, name: &str| {
        // SAFETY: `module` is a loaded module of the current context.
        unsafe {
            cudarc::driver::result::module::get_function(
                module,
                std::ffi::CString::new(name).expect("no NUL inside"),
            )
        }
        .map_err(|e| cuda_err(&format!("cuModuleGetFunction({name})"), e))
    };
    // SAFETY: a NUL-terminated PTX image; the module stays loaded for the process.
    let module = unsafe { cudarc::driver::result::module::load_data(image.as_ptr().cast()) }
        .map_err(|e| cuda_err("loading the FP8 kernels (cuModuleLoadData)", e))?;
    let engine = Rc::new(Fp8Engine {
        amax: function(module, "smp_fp8_amax")?,
        roll: function(module, "smp_fp8_roll")?,
        cast_e4m3: function(module, "smp_fp8_cast_e4m3")?,
        cast_e5m2: function(module, "smp_fp8_cast_e5m2")?,
        handle: lt::create_handle().map_err(lt_err("cublasLtCreate"))?,
        workspaces: RefCell::new(Vec::new()),
        gemms: RefCell::new(HashMap::new()),
    });
    ENGINES.with(|m| m.borrow_mut().insert(device, engine.clone()));
    Ok(engine)
}

impl Fp8Engine {
    fn workspace(&self, stream: ds::CUstream) -> Result<ds::CUdeviceptr, SmpError> {
        let mut all = self.workspaces.borrow_mut();
        if let Some((_, w)) = all.iter().find(|(s, _)| *s == stream) {
            return Ok(*w);
        }
        // SAFETY: the device's context is current; the allocation lives for the process.
        let w = unsafe { cudarc::driver::result::malloc_sync(LT_WORKSPACE_BYTES) }
            .map_err(|e| cuda_err("allocating cuBLASLt's workspace", e))?;
        all.push((stream, w));
        Ok(w)
    }

    /// The descriptors and algorithm for `key`, made and chosen on first use.
    fn prepared(&self, key: GemmKey) -> Result<(), SmpError> {
        if self.gemms.borrow().contains_key(&key) {
            return Ok(());
        }
        let desc = lt::create_matmul_desc(
            lts::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lts::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err("cublasLtMatmulDescCreate"))?;
        let set = |attr, value: &[u8]| {
            // SAFETY: a live descriptor; `value` is the attribute's documented type.
            unsafe { lt::set_matmul_desc_attribute(desc, attr, value.as_ptr().cast(), value.len()) }
                .map_err(lt_err("cublasLtMatmulDescSetAttribute"))
        };
        use lts::cublasLtMatmulDescAttributes_t as A;
        let op_t = (cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as i32).to_ne_bytes();
        let op_n = (cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N as i32).to_ne_bytes();
        set(A::CUBLASLT_MATMUL_DESC_TRANSA, &op_t)?;
        set(A::CUBLASLT_MATMUL_DESC_TRANSB, &op_n)?;
        set(
            A::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
            &[key.fast_accumulation as u8],
        )?;
        let u = |v: usize| v as u64;
        let layout = |t, rows, cols, ld| {
            lt::create_matrix_layout(t, u(rows), u(cols), ld as i64)
                .map_err(lt_err("cublasLtMatrixLayoutCreate"))
        };
        let layouts = [
            layout(lt_dtype(key.a), key.k, key.m, key.lda)?,
            layout(lt_dtype(key.b), key.k, key.n, key.ldb)?,
            layout(lts::cudaDataType::CUDA_R_16BF, key.m, key.n, key.ldc)?,
        ];
        let pref = lt::create_matmul_pref().map_err(lt_err("cublasLtMatmulPreferenceCreate"))?;
        let ws = LT_WORKSPACE_BYTES as u64;
        // SAFETY: a live preference; the attribute is a u64.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                lts::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                8,
            )
        }
        .map_err(lt_err("cublasLtMatmulPreferenceSetAttribute"))?;
        // SAFETY: live descriptors of one GEMM.
        let heuristic = unsafe {
            lt::get_matmul_algo_heuristic(
                self.handle,
                desc,
                layouts[0],
                layouts[1],
                layouts[2],
                layouts[2],
                pref,
            )
        };
        // SAFETY: created above, no longer needed.
        unsafe { lt::destroy_matmul_pref(pref) }.map_err(lt_err("destroying a preference"))?;
        let heuristic = heuristic.map_err(|e| {
            SmpError::Cuda(format!(
                "cuBLASLt has no FP8 GEMM for {key:?} on this GPU: {e:?}"
            ))
        })?;
        self.gemms.borrow_mut().insert(
            key,
            LtGemm {
                desc,
                layouts,
                algo: heuristic.algo,
            },
        );
        Ok(())
    }

    /// Issues one FP8 GEMM on `stream`: `[a, b, c]` data pointers, the two descale pointers.
    fn gemm(
        &self,
        key: GemmKey,
        stream: ds::CUstream,
        [a, b, c]: [u64; 3],
        [a_scale, b_scale]: [&mut u64; 2],
    ) -> Result<(), SmpError> {
        self.prepared(key)?;
        let workspace = self.workspace(stream)?;
        let gemms = self.gemms.borrow();
        let g = &gemms[&key];
        use lts::cublasLtMatmulDescAttributes_t as A;
        for (attr, p) in [
            (A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale),
            (A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale),
        ] {
            // SAFETY: a live descriptor; the attribute is a device pointer, read when the GEMM
            // is enqueued below (the descriptor is this thread's alone).
            unsafe { lt::set_matmul_desc_attribute(g.desc, attr, (p as *const u64).cast(), 8) }
                .map_err(lt_err("setting an FP8 scale pointer"))?;
        }
        let (alpha, beta) = (1.0f32, if key.accumulate { 1.0f32 } else { 0.0 });
        // SAFETY: the pointers are live device buffers of the sizes the layouts describe (the
        // callers' shape checks), on the current context; `stream` orders them after the kernels
        // that wrote them.
        unsafe {
            lt::matmul(
                self.handle,
                g.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                a as *const _,
                g.layouts[0],
                b as *const _,
                g.layouts[1],
                c as *const _,
                g.layouts[2],
                c as *mut _,
                g.layouts[2],
                &g.algo,
                workspace as *mut _,
                LT_WORKSPACE_BYTES,
                stream as _,
            )
        }
        .map_err(lt_err("cublasLtMatmul (FP8)"))
    }
}

/// Whether `x w^T` can take the FP8 path: bf16 operands (`x`: `rows x inner`, `w`:
/// `[out, inner]`) on an FP8 device, every dimension a multiple of 16
/// ([`crate::fp8::fp8_shape_supported`]), fewer than 4M rows (the cast's grid).
pub fn fp8_linear_supported(
    x_dtype: BurnDType,
    w_dtype: BurnDType,
    rows: usize,
    inner: usize,
    [out, w_inner]: [usize; 2],
    device: usize,
) -> bool {
    x_dtype == BurnDType::BF16
        && w_dtype == BurnDType::BF16
        && w_inner == inner
        && crate::fp8::fp8_shape_supported(rows, inner, out)
        && rows.max(inner).max(out) / 64 < 65_535
        && fp8_capable(device)
}

fn supported_operands(x: &Cube, w: &Cube) -> bool {
    let (m, k) = rows_cols(x.meta.shape());
    let dims = w.meta.shape().as_slice();
    dims.len() == 2
        && fp8_linear_supported(x.dtype, w.dtype, m, k, [dims[0], dims[1]], x.device.index)
}

/// Where a kept scale lives: a current-scaling amax or a delayed-scaling state.
#[derive(Clone, Debug)]
enum KeptScale {
    Amax(Cube),
    History(Cube),
}

impl KeptScale {
    fn source(&self) -> ScaleSource {
        match self {
            Self::Amax(t) => ScaleSource::Amax(binding(t)),
            Self::History(t) => ScaleSource::History(binding(t)),
        }
    }
}

/// What an FP8 layer's backward needs from its forward.
#[derive(Clone, Debug)]
pub struct Fp8Saved {
    /// `x^T` in E4M3 (`[k, m]`) and its descale: the weight gradient's operand.
    x_t: Option<(Cube, Cube)>,
    /// What the input gradient's GEMM takes of the weight.
    w: Option<WeightForDx>,
    /// The layer's key under delayed scaling (the gradient's state is looked up by it).
    layer: Option<u64>,
}

/// The weight's part of the input gradient: `w^T` cast in the forward (with its descale), or,
/// when the forward does not keep weight copies ([`keep_weight_copies`]), the weight's scale
/// for casting it again in the backward.
#[derive(Clone, Debug)]
enum WeightForDx {
    Cast(Box<(Cube, Cube)>),
    Scale(Box<KeptScale>),
}

static KEEP_WEIGHT_COPIES: AtomicBool = AtomicBool::new(true);

/// Whether the forward keeps each weight's transposed FP8 copy for the backward (the default)
/// or the backward casts the bf16 weight again: a byte per parameter of every layer that keeps
/// its graph against 3.5 % of Llama 2 7B's step. A memory planner turns it off where the
/// copies would otherwise cost recomputed layers, which cost more.
pub fn keep_weight_copies(keep: bool) {
    KEEP_WEIGHT_COPIES.store(keep, Ordering::Relaxed);
}

/// Whether the forward keeps the weights' FP8 copies ([`keep_weight_copies`]).
pub fn weight_copies_kept() -> bool {
    KEEP_WEIGHT_COPIES.load(Ordering::Relaxed)
}

/// The tensors of a layer whose scales delayed scaling tracks.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Role {
    Input,
    Weight,
    Gradient,
}

/// A delayed-scaling state on the device and whether its history holds a measured amax yet.
type HistoryState = (Cube, bool);

thread_local! {
    // Delayed-scaling states of the layers this thread builds graphs for, by (device, layer,
    // tensor). A thread per rank, so ranks in one process keep their own (their tensors differ).
    static STATES: RefCell<HashMap<(usize, u64, Role), HistoryState>> =
        RefCell::new(HashMap::new());
}

/// Pushes the steps that give tensor `t` (`len` values) its scale and returns where its cast
/// reads it: current scaling (`layer` = `None`) measures the amax now; delayed scaling rolls
/// the layer's history, after seeding it with a measured amax on first use (a first cast at
/// scale 1 would flush small gradients to zero).
fn scale_steps(
    t: &Cube,
    len: usize,
    layer: Option<(u64, Role)>,
    format: Fp8Format,
    steps: &mut Vec<Fp8Step>,
) -> KeptScale {
    let Some((key, role)) = layer else {
        let amax = scalar(t, BurnDType::U32);
        steps.push(Fp8Step::Amax {
            x: binding(t),
            len,
            amax: binding(&amax),
        });
        return KeptScale::Amax(amax);
    };
    let (state, seeded) = STATES.with(|m| {
        let mut m = m.borrow_mut();
        let entry = m.entry((t.device.index, key, role)).or_insert_with(|| {
            let handle = t.client.create_from_slice(&[0u8; HISTORY_STATE_WORDS * 4]);
            let state = burn_cubecl::tensor::CubeTensor::new_contiguous(
                t.client.clone(),
                t.device.clone(),
                Shape::from(vec![HISTORY_STATE_WORDS]),
                handle,
                BurnDType::U32,
            );
            (state, false)
        });
        let seeded = entry.1;
        entry.1 = true;
        (entry.0.clone(), seeded)
    });
    if !seeded {
        // The state's first word is the pending amax: the measurement lands where the roll
        // moves it into the history.
        steps.push(Fp8Step::Amax {
            x: binding(t),
            len,
            amax: binding(&state),
        });
    }
    steps.push(Fp8Step::Roll {
        state: binding(&state),
        format,
    });
    KeptScale::History(state)
}

/// An input's FP8 copies, kept for the next layer that reads the same input.
struct InputCast {
    /// `(device, autodiff node of the input)`.
    key: (usize, u64),
    x8: Cube,
    x8t: Option<Cube>,
    descale: Cube,
}

thread_local! {
    // One entry: the layers that share an input run one after another (q, k, v; gate, up), and
    // a single entry bounds what the cache holds beyond the graph to one input's copies.
    static LAST_INPUT_CAST: RefCell<Option<InputCast>> = const { RefCell::new(None) };
}

/// The kept casts of input `key`, when they include `x^T` or it is not wanted.
fn kept_input_cast(key: (usize, u64), want_t: bool) -> Option<(Cube, Option<Cube>, Cube)> {
    LAST_INPUT_CAST.with(|c| {
        c.borrow()
            .as_ref()
            .filter(|c| c.key == key && (c.x8t.is_some() || !want_t))
            .map(|c| (c.x8.clone(), c.x8t.clone(), c.descale.clone()))
    })
}

/// Drops the kept input cast (its memory returns to the pool once the graph lets go too).
fn forget_input_cast() {
    LAST_INPUT_CAST.with(|c| c.borrow_mut().take());
}

/// Pushes the cast of `t` (`[rows, cols]`) by `scale` to `format`, into the row-major copy
/// `out` and the transposed copy `out_t` where given, and returns the descale it writes.
fn push_cast(
    steps: &mut Vec<Fp8Step>,
    t: &Cube,
    [rows, cols]: [usize; 2],
    scale: &KeptScale,
    format: Fp8Format,
    out: Option<&Cube>,
    out_t: Option<&Cube>,
) -> Cube {
    let descale = scalar(t, BurnDType::F32);
    steps.push(Fp8Step::Cast {
        x: binding(t),
        rows,
        cols,
        scale: scale.source(),
        format,
        out: out.map(binding),
        out_t: out_t.map(binding),
        descale: binding(&descale),
    });
    descale
}

fn scalar(like: &Cube, dtype: BurnDType) -> Cube {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(vec![1]),
        dtype,
    )
}

fn bytes(like: &Cube, rows: usize, cols: usize) -> Cube {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(vec![rows, cols]),
        BurnDType::U8,
    )
}

fn binding(t: &Cube) -> Binding {
    t.handle.clone().binding()
}

/// `y = x w^T` in FP8 (see the [module documentation](self)); with `keep_x_t` / `keep_w`
/// it also returns what the backward of `dw` / `dx` needs, for `dx` the weight's FP8 copy when
/// `weight_copy` (else its scale, to cast it again). `layer` (a key unique to the
/// layer, the same at every step) selects delayed scaling; `None`, current scaling. `input`
/// identifies `x` (its autodiff node) so that layers reading the same input share its cast.
///
/// # Panics
/// If [`fp8_linear_supported`] does not hold for the operands.
pub fn linear_fp8_forward(
    x: Cube,
    w: Cube,
    keep_x_t: bool,
    keep_w: bool,
    weight_copy: bool,
    layer: Option<u64>,
    input: Option<u64>,
) -> (Cube, Fp8Saved) {
    assert!(
        supported_operands(&x, &w),
        "FP8 linear: unsupported operands {:?} {:?} and {:?} {:?}",
        x.meta.shape(),
        x.dtype,
        w.meta.shape(),
        w.dtype
    );
    let (x, w) = (into_contiguous(x), into_contiguous(w));
    let (m, k) = rows_cols(x.meta.shape());
    let n = w.meta.shape()[0];
    let mut out_dims = x.meta.shape().as_slice().to_vec();
    *out_dims.last_mut().expect("input has a dimension") = n;
    let y = empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::from(out_dims),
        x.dtype,
    );
    let mut steps = Vec::new();
    let e4 = Fp8Format::E4M3;
    let input = input.map(|node| (x.device.index, node));
    let (x8, x8t, x_descale) = match input.and_then(|key| kept_input_cast(key, keep_x_t)) {
        Some((x8, x8t, descale)) => (x8, x8t.filter(|_| keep_x_t), descale),
        None => {
            let x_scale = scale_steps(&x, m * k, layer.map(|l| (l, Role::Input)), e4, &mut steps);
            let x8 = bytes(&x, m, k);
            let x8t = keep_x_t.then(|| bytes(&x, k, m));
            let x_descale = push_cast(
                &mut steps,
                &x,
                [m, k],
                &x_scale,
                e4,
                Some(&x8),
                x8t.as_ref(),
            );
            if let Some(key) = input {
                LAST_INPUT_CAST.with(|c| {
                    *c.borrow_mut() = Some(InputCast {
                        key,
                        x8: x8.clone(),
                        x8t: x8t.clone(),
                        descale: x_descale.clone(),
                    })
                });
            }
            (x8, x8t, x_descale)
        }
    };
    let w_scale = scale_steps(&w, n * k, layer.map(|l| (l, Role::Weight)), e4, &mut steps);
    let w8 = bytes(&x, n, k);
    let w8t = (keep_w && weight_copy).then(|| bytes(&x, k, n));
    let w_descale = push_cast(
        &mut steps,
        &w,
        [n, k],
        &w_scale,
        e4,
        Some(&w8),
        w8t.as_ref(),
    );
    // Column-major y^T [n, m] = w8 (k x n)^T x8 (k x m).
    steps.push(Fp8Step::Gemm {
        m: n,
        n: m,
        k,
        a: Fp8Operand {
            data: binding(&w8),
            ld: k,
            format: e4,
            descale: binding(&w_descale),
        },
        b: Fp8Operand {
            data: binding(&x8),
            ld: k,
            format: e4,
            descale: binding(&x_descale),
        },
        c: binding(&y),
        ldc: n,
        accumulate: false,
        fast_accumulation: true,
    });
    submit_steps(
        x.device.index,
        x.dtype,
        steps.into_iter().map(Step::Fp8).collect(),
    );
    let saved = Fp8Saved {
        x_t: x8t.map(|t| (t, x_descale)),
        w: match w8t {
            Some(t) => Some(WeightForDx::Cast(Box::new((t, w_descale)))),
            None => keep_w.then(|| WeightForDx::Scale(Box::new(w_scale))),
        },
        layer,
    };
    (y, saved)
}

/// The gradients of [`linear_fp8_forward`]: `dx` (when the forward kept the weight's part; `w`
/// is the bf16 weight, needed when the forward kept no FP8 copy of it; added into `dx_into`
/// when given) and `dw` (when it kept `x^T`).
///
/// # Panics
/// On shapes that do not match the forward's, or without `w` where the forward kept no copy.
pub fn linear_fp8_backward(
    dy: Cube,
    saved: Fp8Saved,
    w: Option<Cube>,
    x_shape: &Shape,
    dx_into: Option<Cube>,
) -> (Option<Cube>, Option<Cube>) {
    // The forward is over: the kept input cast has no reader left.
    forget_input_cast();
    let dy = into_contiguous(dy);
    let (m, n) = rows_cols(dy.meta.shape());
    let (_, k) = rows_cols(x_shape);
    let e5 = Fp8Format::E5M2;
    let mut steps = Vec::new();
    let dy_scale = scale_steps(
        &dy,
        m * n,
        saved.layer.map(|l| (l, Role::Gradient)),
        e5,
        &mut steps,
    );
    let dy8 = saved.w.as_ref().map(|_| bytes(&dy, m, n));
    let dy8t = saved.x_t.as_ref().map(|_| bytes(&dy, n, m));
    let dy_descale = push_cast(
        &mut steps,
        &dy,
        [m, n],
        &dy_scale,
        e5,
        dy8.as_ref(),
        dy8t.as_ref(),
    );
    let gradient_operand = |data: &Cube, ld| Fp8Operand {
        data: binding(data),
        ld,
        format: e5,
        descale: binding(&dy_descale),
    };
    let dx = match (saved.w, &dy8) {
        (Some(weight), Some(dy8)) => {
            let (w8t, w_descale) = match weight {
                WeightForDx::Cast(copy) => *copy,
                WeightForDx::Scale(w_scale) => {
                    let w = into_contiguous(w.expect("FP8 linear backward: the weight, to cast"));
                    let w8t = bytes(&dy, k, n);
                    let w_descale = push_cast(
                        &mut steps,
                        &w,
                        [n, k],
                        &w_scale,
                        Fp8Format::E4M3,
                        None,
                        Some(&w8t),
                    );
                    (w8t, w_descale)
                }
            };
            assert_eq!(
                w8t.meta.shape().as_slice(),
                &[k, n],
                "FP8 linear backward: the weight does not match dy {:?} and x {x_shape:?}",
                dy.meta.shape()
            );
            let (dx, accumulate) = dx_buffer(&dy, x_shape, dx_into);
            // Column-major dx^T [k, m] = w8t (n x k)^T dy8 (n x m).
            steps.push(Fp8Step::Gemm {
                m: k,
                n: m,
                k: n,
                a: Fp8Operand {
                    data: binding(&w8t),
                    ld: n,
                    format: Fp8Format::E4M3,
                    descale: binding(&w_descale),
                },
                b: gradient_operand(dy8, n),
                c: binding(&dx),
                ldc: k,
                accumulate,
                fast_accumulation: false,
            });
            Some(dx)
        }
        _ => None,
    };
    let dw = match (&saved.x_t, &dy8t) {
        (Some((x8t, x_descale)), Some(dy8t)) => {
            let dw = empty_device_contiguous_dtype(
                dy.client.clone(),
                dy.device.clone(),
                Shape::from(vec![n, k]),
                dy.dtype,
            );
            // Column-major dw^T [k, n] = x8t (m x k)^T dy8t (m x n).
            steps.push(Fp8Step::Gemm {
                m: k,
                n,
                k: m,
                a: Fp8Operand {
                    data: binding(x8t),
                    ld: m,
                    format: Fp8Format::E4M3,
                    descale: binding(x_descale),
                },
                b: gradient_operand(dy8t, m),
                c: binding(&dw),
                ldc: k,
                accumulate: false,
                fast_accumulation: false,
            });
            Some(dw)
        }
        _ => None,
    };
    submit_steps(
        dy.device.index,
        dy.dtype,
        steps.into_iter().map(Step::Fp8).collect(),
    );
    (dx, dw)
}

#[derive(Debug)]
struct Fp8LinearBackward;

impl Backward<CudaCube, 2> for Fp8LinearBackward {
    /// What the forward kept, the checkpointed weight (for a `dx` without a kept weight
    /// copy), the input's shape.
    type State = (Fp8Saved, Option<NodeId>, Shape);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let dy = grads.consume::<CudaCube>(&ops.node);
        let saved = ops.state.0.clone();
        let w = ops
            .state
            .1
            .map(|id| checkpointer.retrieve_node_output::<Cube>(id));
        let dx_into = match &saved.w {
            Some(_) => {
                super::accumulate::take_grad_for_accumulation(&ops, 0, grads, &dy, &ops.state.2)
            }
            None => None,
        };
        let (dx, dw) = linear_fp8_backward(dy, saved, w, &ops.state.2, dx_into);
        register_linear_grads::<CudaCube>(grads, ops.parents.map(|p| p.map(|n| n.id)), dx, dw);
    }
}

/// `x w^T` with FP8 GEMMs on [`CudaCube`] with autodiff; differentiable in both operands.
/// `layer` as for [`linear_fp8_forward`]. The caller checks [`fp8_linear_supported`].
pub fn linear_fp8_autodiff<const D: usize>(
    x: Tensor<CudaAutodiff, D>,
    w: Tensor<CudaAutodiff, 2>,
    layer: Option<u64>,
) -> Tensor<CudaAutodiff, D> {
    let x = x.into_primitive().tensor();
    let w = w.into_primitive().tensor();
    let (x_tracked, w_tracked) = (x.is_tracked(), w.is_tracked());
    let x_shape = burn::tensor::TensorMetadata::shape(&x.primitive);
    let input = Some(x.node.id.value);
    let out = match Fp8LinearBackward
        .prepare::<NoCheckpointing>([x.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let copies = KEEP_WEIGHT_COPIES.load(Ordering::Relaxed);
            let w_state = (x_tracked && !copies).then(|| prep.checkpoint(&w));
            let (y, saved) = linear_fp8_forward(
                x.primitive,
                w.primitive,
                w_tracked,
                x_tracked,
                copies,
                layer,
                input,
            );
            prep.finish((saved, w_state, x_shape), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(
            linear_fp8_forward(x.primitive, w.primitive, false, false, false, layer, input).0,
        ),
    };
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// `x w^T` with FP8 GEMMs on plain [`CudaCube`] (evaluation under an FP8 recipe).
pub fn linear_fp8_plain<const D: usize>(
    x: Tensor<CudaCube, D>,
    w: Tensor<CudaCube, 2>,
    layer: Option<u64>,
) -> Tensor<CudaCube, D> {
    let (y, _) = linear_fp8_forward(
        x.into_primitive().tensor(),
        w.into_primitive().tensor(),
        false,
        false,
        false,
        layer,
        None,
    );
    Tensor::from_primitive(TensorPrimitive::Float(y))
}
