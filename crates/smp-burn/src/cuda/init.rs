//! Seeded normal initialization on the GPU: [`crate::init::normal_values`]'s formula, one thread
//! per element.
//!
//! Every value is a function of its parameter's key and its index (SplitMix64 of the index's
//! Weyl counter, then Box-Muller), so the GPU draws exactly the host's values up to the last
//! bit or two of `log` and `cos`. Drawn on the host, Llama 2 7B's 6.7 billion values took over
//! two minutes of every run's start on an H200 machine; here they take milliseconds and never
//! cross the PCIe bus.

use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;

use crate::init::{COUNTER_STRIDE, SPLITMIX_GAMMA, SPLITMIX_MUL1, SPLITMIX_MUL2};

type Cube = CubeTensor<CudaRuntime>;

const THREADS: usize = 256;

/// SplitMix64's finalizer with its constants passed in (see [`crate::init::SPLITMIX_GAMMA`]).
#[cube]
fn splitmix64(z: u64, gamma: u64, mul1: u64, mul2: u64) -> u64 {
    let mut z = z + gamma;
    z = (z ^ (z >> 30)) * mul1;
    z = (z ^ (z >> 27)) * mul2;
    z ^ (z >> 31)
}

/// Uniform in (0, 1] from the top 24 bits, exact in f32.
#[cube]
fn unit(bits: u64) -> f32 {
    (f32::cast_from(bits >> 40) + 1.0) / 16777216.0
}

/// `out[j] = std * N(key, start + j)` for `j < len`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn normal_kernel(
    out: &mut Tensor<f32>,
    key: u64,
    start: u64,
    stride: u64,
    gamma: u64,
    mul1: u64,
    mul2: u64,
    std: f32,
    len: u32,
) {
    let j = ABSOLUTE_POS;
    if j >= len as usize {
        terminate!();
    }
    let i = start + u64::cast_from(j);
    let r = splitmix64(key ^ (i * stride), gamma, mul1, mul2);
    let u1 = unit(r);
    let u2 = unit(splitmix64(r, gamma, mul1, mul2));
    let z = (-2.0 * u1.ln()).sqrt() * (6.283_185_5 * u2).cos();
    out[j] = z * std;
}

/// Elements `start .. start + len` of the normal draw with key `key` and standard deviation
/// `std`, as a new f32 tensor on `device`.
///
/// # Panics
/// When `len` does not fit 32-bit indexing.
pub fn normal(device: &CudaDevice, key: u64, std: f32, start: usize, len: usize) -> Cube {
    assert!(
        len < u32::MAX as usize,
        "normal initialization: {len} elements in one slice is too many for 32-bit indexing"
    );
    // Every element is written below: no zeroing.
    let out = empty_device_contiguous_dtype::<CudaRuntime>(
        CudaRuntime::client(device),
        device.clone(),
        Shape::new([len]),
        DType::F32,
    );
    if len == 0 {
        return out;
    }
    let dim = CubeDim::new_1d(THREADS as u32);
    let count = calculate_cube_count_elemwise(&out.client, len, dim);
    // SAFETY: one thread per element below `len` writes `out[j]`, a fresh buffer of `len`.
    unsafe {
        normal_kernel::launch_unchecked::<CudaRuntime>(
            &out.client,
            count,
            dim,
            out.clone().into_tensor_arg(),
            key,
            start as u64,
            COUNTER_STRIDE,
            SPLITMIX_GAMMA,
            SPLITMIX_MUL1,
            SPLITMIX_MUL2,
            std,
            len as u32,
        );
    }
    out
}
