//! The LM-head loss's softmax statistics and gradient as fused kernels.
//!
//! With Burn's ops, the chunked loss ([`crate::ops::linear_cross_entropy_chunked`]) spends
//! about 10 ms of a 107 ms step of the 1b model on an H200 around its GEMMs: a cast of each
//! chunk's bf16 logits to f32, `max_dim` and `sum_dim` through Burn's reduce kernel at about
//! 0.2 TB/s (1.4 ms each on a 2048 x 32000 chunk), unvectorized elementwise ops and a scatter.
//! Here [`row_stats`] reads a chunk's logits once per pass and writes each row's log-sum-exp and
//! loss, and [`softmax_grad`] writes `(softmax - onehot(target)) * scale` in the logits' dtype
//! in one pass. Both compute in f32 in the reference's order of operations.

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

use super::fused::cube_sum;

type Cube = CubeTensor<CudaRuntime>;

/// Threads per cube (one cube per row; a 32k-vocabulary row is 4,000 vectors of 8).
const THREADS: usize = 256;

/// The maximum of `value` over the cube (every thread gets it).
#[cube]
// Kernel code is expanded by `#[cube]`, which has no `div_ceil` on runtime integers.
#[allow(clippy::manual_div_ceil)]
fn cube_max(value: f32, scratch: &mut SharedMemory<f32>) -> f32 {
    let plane_m = plane_max(value);
    if UNIT_POS_PLANE == 0 {
        scratch[PLANE_POS as usize] = plane_m;
    }
    sync_cube();
    let planes = (CUBE_DIM + PLANE_DIM - 1) / PLANE_DIM;
    let mut m = scratch[0];
    for i in 1..planes as usize {
        m = f32::max(m, scratch[i]);
    }
    sync_cube();
    m
}

/// Element `col` of row `base` of a vectorized row-major tensor.
#[cube]
fn element<F: Float, N: Size>(
    t: &Tensor<Vector<F, N>>,
    base: usize,
    col: usize,
    #[comptime] nv: usize,
) -> f32 {
    let v = Vector::<f32, N>::cast_from(t[base + col / nv]);
    let lane = col % nv;
    let mut out = f32::new(0.0);
    #[unroll]
    for k in 0..nv {
        if k == lane {
            out = v[k];
        }
    }
    out
}

/// Cube = one row of `logits: [rows, vocab]` (`row_vectors = vocab / nv`): `lse[row] =
/// log(sum(exp(l - max))) + max` and `loss[row] = lse[row] - l[target]` (0 where the target is
/// negative, i.e. ignored), all in f32.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn row_stats_kernel<F: Float, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    targets: &Tensor<i32>,
    lse: &mut Tensor<f32>,
    loss: &mut Tensor<f32>,
    rows: u32,
    row_vectors: u32,
    #[comptime] nv: usize,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= rows as usize {
        terminate!();
    }
    let t = UNIT_POS as usize;
    let hv = row_vectors as usize;
    let base = row * hv;
    let mut scratch = SharedMemory::<f32>::new(comptime!(THREADS / 32));
    let mut m = f32::new(-3.0e38);
    let mut c = t;
    while c < hv {
        let v = Vector::<f32, N>::cast_from(logits[base + c]);
        #[unroll]
        for k in 0..nv {
            m = f32::max(m, v[k]);
        }
        c += THREADS;
    }
    let row_max = cube_max(m, &mut scratch);
    let mv = Vector::<f32, N>::new(row_max);
    let mut s = f32::new(0.0);
    c = t;
    while c < hv {
        let e = (Vector::<f32, N>::cast_from(logits[base + c]) - mv).exp();
        #[unroll]
        for k in 0..nv {
            s += e[k];
        }
        c += THREADS;
    }
    let total = cube_sum(s, &mut scratch);
    if t == 0 {
        let l = total.ln() + row_max;
        lse[row] = l;
        let target = targets[row];
        if target >= 0 {
            loss[row] = l - element::<F, N>(logits, base, target as usize, nv);
        } else {
            loss[row] = f32::new(0.0);
        }
    }
}

/// Cube = one row: `g[row, j] = round((exp(l[j] - lse[row]) - [j == target]) * scale[0])`, and
/// zeros for a row whose target is negative (ignored).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn softmax_grad_kernel<F: Float, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    targets: &Tensor<i32>,
    scale: &Tensor<f32>,
    g: &mut Tensor<Vector<F, N>>,
    rows: u32,
    row_vectors: u32,
    #[comptime] nv: usize,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= rows as usize {
        terminate!();
    }
    let t = UNIT_POS as usize;
    let hv = row_vectors as usize;
    let base = row * hv;
    let lv = Vector::<f32, N>::new(lse[row]);
    let raw_target = targets[row];
    let mut s = scale[0];
    let mut target = raw_target as usize;
    if raw_target < 0 {
        s = f32::new(0.0);
        target = 0;
    }
    let sv = Vector::<f32, N>::new(s);
    let mut c = t;
    while c < hv {
        let mut p = (Vector::<f32, N>::cast_from(logits[base + c]) - lv).exp();
        if c == target / nv {
            let lane = target % nv;
            #[unroll]
            for k in 0..nv {
                if k == lane {
                    p[k] = p[k] - f32::new(1.0);
                }
            }
        }
        g[base + c] = Vector::<F, N>::cast_from(p * sv);
        c += THREADS;
    }
}

/// The widest vector (up to 16 bytes) that divides a row of `len` elements (the vocabulary
/// here, the embedding's width in [`super::embedding`]).
pub(super) fn vector_width(len: usize, dtype: DType) -> usize {
    let max = 16 / dtype.size();
    [8, 4, 2, 1]
        .into_iter()
        .find(|w| *w <= max && len.is_multiple_of(*w))
        .expect("1 divides everything")
}

fn dims(op: &str, logits: &Cube, targets: &Cube) -> (usize, usize) {
    let [rows, vocab] = logits.meta.shape().dims::<2>();
    assert_eq!(
        targets.meta.shape().as_slice(),
        &[rows],
        "{op}: logits {:?} and targets {:?} do not match",
        logits.meta.shape(),
        targets.meta.shape()
    );
    assert!(
        matches!(logits.dtype, DType::BF16 | DType::F16 | DType::F32),
        "{op}: logits must be a float tensor, got {:?}",
        logits.dtype
    );
    assert_eq!(
        targets.dtype,
        DType::I32,
        "{op}: targets must be i32 (the CUDA backend's int type)"
    );
    assert!(
        rows * vocab < u32::MAX as usize,
        "{op}: {rows} x {vocab} logits are too many for 32-bit indexing"
    );
    (rows, vocab)
}

/// Each row's log-sum-exp and loss (`lse - logits[target]`) of `logits: [rows, vocab]`
/// (bf16, f16 or f32) with `targets: [rows]` (i32, each below `vocab`; a negative target is
/// ignored and scores 0): two f32 `[rows]`
/// tensors. Matches `cast(f32)`, `max_dim`, `exp`, `sum_dim`, `log` and `gather` of Burn's ops.
///
/// # Panics
/// On mismatched shapes or dtypes.
pub fn row_stats(logits: Cube, targets: Cube) -> (Cube, Cube) {
    let (rows, vocab) = dims("row_stats", &logits, &targets);
    let (logits, targets) = (into_contiguous(logits), into_contiguous(targets));
    let client = logits.client.clone();
    let alloc = || {
        empty_device_contiguous_dtype(
            client.clone(),
            logits.device.clone(),
            Shape::new([rows]),
            DType::F32,
        )
    };
    let (lse, loss) = (alloc(), alloc());
    if rows == 0 || vocab == 0 {
        return (lse, loss);
    }
    let nv = vector_width(vocab, logits.dtype);
    let dtype = logits.dtype;
    // SAFETY: one cube per row; vector indices stay below `rows * vocab / nv`, the target read
    // (only for a target >= 0) below `vocab` (callers pass valid targets), `rows` for the
    // outputs; shared memory holds
    // one value per plane.
    unsafe {
        row_stats_kernel::launch_unchecked::<CudaRuntime>(
            &client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(THREADS as u32),
            nv,
            logits.into_tensor_arg(),
            targets.into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            loss.clone().into_tensor_arg(),
            rows as u32,
            (vocab / nv) as u32,
            nv,
            dtype.into(),
        );
    }
    (lse, loss)
}

/// `(exp(logits - lse) - onehot(targets)) * scale[0]`, computed in f32 and rounded to the
/// logits' dtype: the loss's gradient with respect to the logits (`scale` = upstream gradient /
/// scored tokens, a one-element f32 tensor on the device); rows with a negative (ignored)
/// target are zero.
///
/// # Panics
/// On mismatched shapes or dtypes.
pub fn softmax_grad(logits: Cube, lse: Cube, targets: Cube, scale: Cube) -> Cube {
    let (rows, vocab) = dims("softmax_grad", &logits, &targets);
    assert!(
        lse.meta.shape().as_slice() == [rows] && lse.dtype == DType::F32,
        "softmax_grad: lse must be f32 [{rows}], got {:?} {:?}",
        lse.dtype,
        lse.meta.shape()
    );
    assert!(
        scale.meta.num_elements() == 1 && scale.dtype == DType::F32,
        "softmax_grad: scale must be one f32 element"
    );
    let (logits, lse, targets, scale) = (
        into_contiguous(logits),
        into_contiguous(lse),
        into_contiguous(targets),
        into_contiguous(scale),
    );
    let client = logits.client.clone();
    let g = empty_device_contiguous_dtype(
        client.clone(),
        logits.device.clone(),
        logits.meta.shape().clone(),
        logits.dtype,
    );
    if rows == 0 || vocab == 0 {
        return g;
    }
    let nv = vector_width(vocab, logits.dtype);
    let dtype = logits.dtype;
    // SAFETY: one cube per row; vector indices stay below `rows * vocab / nv` for `logits` and
    // `g`, `rows` for `lse` and `targets`; `scale` holds one element.
    unsafe {
        softmax_grad_kernel::launch_unchecked::<CudaRuntime>(
            &client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(THREADS as u32),
            nv,
            logits.into_tensor_arg(),
            lse.into_tensor_arg(),
            targets.into_tensor_arg(),
            scale.into_tensor_arg(),
            g.clone().into_tensor_arg(),
            rows as u32,
            (vocab / nv) as u32,
            nv,
            dtype.into(),
        );
    }
    g
}
