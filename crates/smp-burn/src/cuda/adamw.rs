//! AdamW on a flat f32 shard in one CubeCL kernel, and the shard's sum of squares (the gradient
//! norm that clipping needs) in two.
//!
//! Written with Burn's tensor ops, one AdamW step is about twenty elementwise passes over the
//! shard (scale, two moment updates, bias corrections, square root, decay, update) plus the
//! decay mask's fills: on a 7B model's 3.4-billion-element shard (two ranks) that is some 700 GB
//! of memory traffic, 190 ms of a 1.4 s step. The fused kernel reads the weight, gradient and
//! two moments once and writes weight and moments once: 28 bytes per parameter with an f32
//! gradient, in place, four elements per thread (4.1 TB/s on an H200, where one element per
//! thread reached 3.7). It can also write the updated weights in the compute dtype for the next
//! gather (2 more bytes per parameter, sparing a 6-byte cast pass); the gradient may be bf16.
//! With the moments in bf16 ([`crate::optim::MomentDtype::Bf16`]) a step moves 20 bytes per
//! parameter instead of 28 (bf16 gradient and copy).
//!
//! Weight decay applies to matrices only; a shard is a concatenation of parameter pieces, so the
//! caller passes runs of elements that share a decay factor and the kernel is launched once per
//! run (two launches for a Llama layer: its matrices come first, its norms last).
//!
//! The gradient norm went through Burn's `square().sum()`: Burn 0.21's full reduction on CUDA is
//! an atomic `SharedSumKernel` that took 2 ms for a 1.2B model's 51M-element layer shard, 50 ms of
//! a 207 ms step. [`weighted_sq_sum`] reads the shard once with a grid-stride loop and reduces in
//! two launches, deterministically.

// `div_ceil` is not available inside `#[cube]` functions.
#![allow(clippy::manual_div_ceil)]

use crate::optim::RunRates;
use std::ops::Range;

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;

use super::flat::{view, writable};
use super::fused::cube_sum;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

type Cube = CubeTensor<CudaRuntime>;

const THREADS: usize = 256;
/// Most cubes of the first sum-of-squares pass per run: about seven per SM of an H200, enough
/// for the grid-stride loop to keep every SM streaming, few enough that the second pass (one
/// cube) is short.
const SQ_SUM_CUBES: usize = 1024;
/// Elements each thread of the first pass covers at least, so that short runs (norm weights)
/// take one cube instead of many nearly idle ones.
const SQ_SUM_MIN_PER_THREAD: usize = 8;
/// Elements per launch: keeps every index below 2^31 whatever the kernel's index width.
const MAX_CHUNK: usize = 1 << 28;

/// AdamW's hyper-parameters for one step, with the bias corrections already folded in.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    /// Learning rate (each run scales it by its group's `lr_scale`).
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// `1 / (1 - beta1^step)`.
    pub inv_bias1: f32,
    /// `1 / (1 - beta2^step)`.
    pub inv_bias2: f32,
}

/// One thread per vector of `N` elements: the reference update of
/// `fsdp::ShardedUnit::optimizer_step` under AdamW, fused. With `write_copy` it also writes the
/// updated weights in the compute dtype to `copy`, the next forward's all-gather input: a
/// separate cast would read the four-byte weights again (about 1.4 ms of a 1.2B model's step).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel<G: Float, C: Float, M: Float, N: Size>(
    master: &mut Tensor<Vector<f32, N>>,
    exp_avg: &mut Tensor<Vector<M, N>>,
    exp_avg_sq: &mut Tensor<Vector<M, N>>,
    grad: &Tensor<Vector<G, N>>,
    copy: &mut Tensor<Vector<C, N>>,
    grad_scale: &Tensor<f32>,
    lr: f32,
    beta1: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    eps: f32,
    inv_bias1: f32,
    inv_bias2: f32,
    decay: f32,
    len: u32,
    #[comptime] write_copy: bool,
    #[define(G, C, M)] _dtypes: [StorageType; 3],
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        let g = Vector::<f32, N>::cast_from(grad[i]) * Vector::new(grad_scale[0]);
        let m = Vector::<f32, N>::cast_from(exp_avg[i]) * Vector::new(beta1)
            + g * Vector::new(one_minus_beta1);
        let v = Vector::<f32, N>::cast_from(exp_avg_sq[i]) * Vector::new(beta2)
            + g * g * Vector::new(one_minus_beta2);
        // Stored in the moments' dtype (rounded to nearest); this step's update uses the f32
        // values.
        exp_avg[i] = Vector::<M, N>::cast_from(m);
        exp_avg_sq[i] = Vector::<M, N>::cast_from(v);
        let denom = (v * Vector::new(inv_bias2)).sqrt() + Vector::new(eps);
        let p = master[i];
        let updated =
            p - p * Vector::new(decay) - (m * Vector::new(inv_bias1) / denom) * Vector::new(lr);
        master[i] = updated;
        if write_copy {
            copy[i] = Vector::<C, N>::cast_from(updated);
        }
    }
}

/// First pass: cube `c` writes `weight * sum(x[i]^2)` over its grid-stride share of `x` to
/// `partials[first + c]`. With `square = false` it sums `x` itself (the second pass, over the
/// partials).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn sq_sum_kernel<X: Float>(
    x: &Tensor<X>,
    partials: &mut Tensor<f32>,
    len: u32,
    stride: u32,
    first: u32,
    weight: f32,
    #[comptime] square: bool,
    #[define(X)] _dtype: StorageType,
) {
    let mut scratch = SharedMemory::<f32>::new(comptime!(THREADS / 32));
    let (n, s) = (len as usize, stride as usize);
    // Four independent loads per iteration: one dependent load at a time per thread left the
    // loop latency-bound at about 1 TB/s.
    let (mut a0, mut a1, mut a2, mut a3) =
        (f32::new(0.0), f32::new(0.0), f32::new(0.0), f32::new(0.0));
    let mut i = ABSOLUTE_POS;
    while i + s * 3 < n {
        let (v0, v1, v2, v3) = (
            f32::cast_from(x[i]),
            f32::cast_from(x[i + s]),
            f32::cast_from(x[i + s * 2]),
            f32::cast_from(x[i + s * 3]),
        );
        if square {
            a0 += v0 * v0;
            a1 += v1 * v1;
            a2 += v2 * v2;
            a3 += v3 * v3;
        } else {
            a0 += v0;
            a1 += v1;
            a2 += v2;
            a3 += v3;
        }
        i += s * 4;
    }
    while i < n {
        let v = f32::cast_from(x[i]);
        if square {
            a0 += v * v;
        } else {
            a0 += v;
        }
        i += s;
    }
    let total = cube_sum((a0 + a1) + (a2 + a3), &mut scratch);
    if UNIT_POS == 0 {
        partials[first as usize + CUBE_POS] = total * weight;
    }
}

/// `sum_r weight_r * sum(x[range_r]^2)` over `runs` of a contiguous 1-D float tensor (f32,
/// bf16 or f16; summed in f32), as a one-element f32 tensor on the device (no host sync).
/// Elements outside every run do not count.
pub fn weighted_sq_sum(x: Cube, runs: &[(Range<usize>, f32)]) -> Cube {
    weighted_reduce(x, runs, true)
}

/// `sum_r weight_r * sum(x[range_r])` over `runs` of a contiguous 1-D float tensor, as
/// [`weighted_sq_sum`] without the squares: how the partial sums of
/// [`super::flat::pack_with_sq_sums`] become a gradient norm's square.
pub fn weighted_sum(x: Cube, runs: &[(Range<usize>, f32)]) -> Cube {
    weighted_reduce(x, runs, false)
}

fn weighted_reduce(x: Cube, runs: &[(Range<usize>, f32)], square: bool) -> Cube {
    assert!(
        is_float(x.dtype),
        "sum of squares takes a float tensor, got {:?}",
        x.dtype
    );
    let x_dtype = x.dtype;
    let x = if x.is_contiguous_buffer() {
        x
    } else {
        x.copy()
    };
    let total = x.meta.shape()[0];
    let client = x.client.clone();
    // (view, cubes, weight) for every chunk of every run.
    let mut launches = Vec::new();
    for (run, weight) in runs {
        assert!(
            run.end <= total,
            "sum of squares: run {run:?} beyond the tensor's {total} elements"
        );
        let mut start = run.start;
        while start < run.end {
            let end = (start + MAX_CHUNK).min(run.end);
            let cubes = (end - start)
                .div_ceil(THREADS * SQ_SUM_MIN_PER_THREAD)
                .clamp(1, SQ_SUM_CUBES);
            launches.push((view(&x, start..end), cubes, *weight));
            start = end;
        }
    }
    let empty = |len: usize| {
        burn_cubecl::ops::numeric::empty_device_dtype::<CudaRuntime>(
            client.clone(),
            x.device.clone(),
            [len].into(),
            burn::tensor::DType::F32,
        )
    };
    if launches.is_empty() {
        return burn_cubecl::ops::numeric::zeros_client::<CudaRuntime>(
            client.clone(),
            x.device.clone(),
            [1].into(),
            burn::tensor::DType::F32,
        );
    }
    // Every slot is written by exactly one cube, so neither buffer needs a fill.
    let slots: usize = launches.iter().map(|(_, c, _)| c).sum();
    let partials = empty(slots);
    let mut first = 0;
    for (v, cubes, weight) in launches {
        let n = v.meta.shape()[0];
        // SAFETY: the kernel reads `x[i]` for `i < n` only and writes slot `first + CUBE_POS`,
        // below `slots` by construction.
        unsafe {
            sq_sum_kernel::launch_unchecked::<CudaRuntime>(
                &client,
                CubeCount::Static(cubes as u32, 1, 1),
                CubeDim::new_1d(THREADS as u32),
                v.into_tensor_arg(),
                partials.clone().into_tensor_arg(),
                n as u32,
                (cubes * THREADS) as u32,
                first as u32,
                weight,
                square,
                x_dtype.into(),
            );
        }
        first += cubes;
    }
    let out = empty(1);
    // SAFETY: one cube reads the `slots` partials and writes `out[0]`.
    unsafe {
        sq_sum_kernel::launch_unchecked::<CudaRuntime>(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(THREADS as u32),
            partials.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            slots as u32,
            THREADS as u32,
            0,
            1.0,
            false,
            burn::tensor::DType::F32.into(),
        );
    }
    out
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16 | DType::F16)
}

/// Runs AdamW over a shard in place and returns `(master, exp_avg, exp_avg_sq)` and, when
/// `copy_dtype` is given, the updated weights in that dtype (a fresh buffer).
///
/// `runs` lists `(element range, rates)` covering the shard: each run of elements that share a
/// parameter group gets its learning-rate scale and weight decay. `grad_scale` is a one-element
/// f32 tensor (the clipping factor, computed on the device: no host sync). The master weights
/// are f32, the moments both f32 or both bf16; `grad` may be f32, bf16 or f16 (read and
/// widened to f32).
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    master: Cube,
    exp_avg: Cube,
    exp_avg_sq: Cube,
    grad: Cube,
    grad_scale: Cube,
    hp: AdamWStep,
    runs: &[(Range<usize>, RunRates)],
    copy_dtype: Option<DType>,
) -> (Cube, Cube, Cube, Option<Cube>) {
    let len = master.meta.shape()[0];
    for (name, t) in [
        ("exp_avg", &exp_avg),
        ("exp_avg_sq", &exp_avg_sq),
        ("grad", &grad),
    ] {
        assert_eq!(
            t.meta.shape()[0],
            len,
            "fused AdamW: {name} has {} elements, the master shard {len}",
            t.meta.shape()[0]
        );
    }
    for t in [&master, &grad_scale] {
        assert_eq!(
            t.dtype,
            burn::tensor::DType::F32,
            "fused AdamW keeps its master weights in f32"
        );
    }
    let moment_dtype = exp_avg.dtype;
    assert!(
        matches!(moment_dtype, DType::F32 | DType::BF16) && exp_avg_sq.dtype == moment_dtype,
        "fused AdamW keeps both moments in f32 or both in bf16, got {:?} and {:?}",
        exp_avg.dtype,
        exp_avg_sq.dtype
    );
    assert!(
        is_float(grad.dtype),
        "fused AdamW: the gradient must be a float tensor, got {:?}",
        grad.dtype
    );
    let grad_dtype = grad.dtype;
    let master = writable(master);
    let exp_avg = writable(exp_avg);
    let exp_avg_sq = writable(exp_avg_sq);
    let grad = if grad.is_contiguous_buffer() {
        grad
    } else {
        grad.copy()
    };
    let client = master.client.clone();
    let alloc = |n: usize, d: DType| {
        burn_cubecl::ops::numeric::empty_device_contiguous_dtype::<CudaRuntime>(
            client.clone(),
            master.device.clone(),
            [n].into(),
            d,
        )
    };
    let copy = copy_dtype.map(|d| alloc(len, d));
    // Without a copy the kernel still takes a tensor of the copy's type; it is never written,
    // so one small buffer serves every launch.
    let unused = copy.is_none().then(|| alloc(8, DType::F32));
    let copy_dt = copy_dtype.unwrap_or(DType::F32);
    for (run, rates) in runs {
        let lr = hp.lr * rates.lr_scale;
        let decay = lr * rates.weight_decay;
        let mut start = run.start;
        while start < run.end {
            let end = (start + MAX_CHUNK).min(run.end);
            let n = end - start;
            // Every view starts at element `start` of a fresh (aligned) buffer, so a vector width
            // dividing both `start` and `n` keeps every vector aligned.
            let nv = [4, 2, 1]
                .into_iter()
                .find(|w| n.is_multiple_of(*w) && start.is_multiple_of(*w))
                .expect("1 divides everything");
            let vectors = n / nv;
            let copy_arg = match (&copy, &unused) {
                (Some(c), _) => view(c, start..end),
                (None, Some(u)) => u.clone(),
                (None, None) => unreachable!("a copy or the unused buffer exists"),
            };
            // SAFETY: the views hold `n` elements each (shapes checked above; the unused copy
            // is never written) and the kernel guards `i < n / nv`; `grad_scale` has one
            // element.
            unsafe {
                adamw_kernel::launch_unchecked::<CudaRuntime>(
                    &client,
                    CubeCount::Static(vectors.div_ceil(THREADS) as u32, 1, 1),
                    CubeDim::new_1d(THREADS as u32),
                    nv,
                    view(&master, start..end).into_tensor_arg(),
                    view(&exp_avg, start..end).into_tensor_arg(),
                    view(&exp_avg_sq, start..end).into_tensor_arg(),
                    view(&grad, start..end).into_tensor_arg(),
                    copy_arg.into_tensor_arg(),
                    grad_scale.clone().into_tensor_arg(),
                    lr,
                    hp.beta1,
                    hp.beta2,
                    1.0 - hp.beta1,
                    1.0 - hp.beta2,
                    hp.eps,
                    hp.inv_bias1,
                    hp.inv_bias2,
                    decay,
                    vectors as u32,
                    copy.is_some(),
                    [grad_dtype.into(), copy_dt.into(), moment_dtype.into()],
                );
            }
            start = end;
        }
    }
    (master, exp_avg, exp_avg_sq, copy)
}
