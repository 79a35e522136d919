//! Kernels on FSDP's flat buffers.
//!
//! A unit's gradients come out of Burn's autodiff as one tensor per parameter, in the compute
//! dtype (bf16). FSDP needs them as one flat f32 buffer for the reduce-scatter and the shard.
//! With Burn's ops that is a cast per parameter and a `cat` (one slice-assign per parameter):
//! two passes and two launches per parameter, 460 launches and about 14 ms of a 1.2B model's
//! step. [`pack_f32`] writes each gradient straight into its place in the flat buffer, cast on
//! the way: one pass and one launch per parameter.

use std::ops::Range;

use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

type Cube = CubeTensor<CudaRuntime>;

const THREADS: usize = 256;

/// `dst[i] = f32(src[i])` over `len` vectors of `N` elements.
#[cube(launch_unchecked)]
fn cast_into_kernel<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    dst: &mut Tensor<Vector<f32, N>>,
    len: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        dst[i] = Vector::<f32, N>::cast_from(src[i]);
    }
}

/// `dst[i] = 0` over `len` elements (the flat buffer's padding).
#[cube(launch_unchecked)]
fn zero_kernel(dst: &mut Tensor<f32>, len: u32) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        dst[i] = f32::new(0.0);
    }
}

/// A view of elements `range` of a contiguous 1-D f32 tensor, sharing its buffer.
pub(crate) fn view(t: &Cube, range: Range<usize>) -> Cube {
    let total = t.meta.shape()[0];
    let handle = t
        .handle
        .clone()
        .offset_start((range.start * 4) as u64)
        .offset_end(((total - range.end) * 4) as u64);
    CubeTensor::new_contiguous(
        t.client.clone(),
        t.device.clone(),
        [range.len()].into(),
        handle,
        DType::F32,
    )
}

/// The widest vector (up to 8 elements) dividing `len` and `offset`: the destination's start
/// must be aligned to the vector's bytes, and the source (a fresh contiguous buffer) is.
fn width(len: usize, offset: usize) -> usize {
    [8, 4, 2, 1]
        .into_iter()
        .find(|w| len.is_multiple_of(*w) && offset.is_multiple_of(*w))
        .expect("1 divides everything")
}

/// One flat f32 tensor of `total` elements: `pieces` (any float dtype, each 1-D and
/// contiguous or made so) back to back from element 0, zeros after them.
///
/// # Panics
/// If the pieces hold more than `total` elements, or are not on one device.
pub fn pack_f32(pieces: Vec<Cube>, total: usize) -> Cube {
    let first = pieces.first().expect("at least one piece");
    let (client, device) = (first.client.clone(), first.device.clone());
    let used: usize = pieces.iter().map(|p| p.meta.num_elements()).sum();
    assert!(
        used <= total,
        "pack_f32: pieces hold {used} elements, the buffer {total}"
    );
    assert!(
        total < u32::MAX as usize,
        "pack_f32: {total} elements are too many for 32-bit indexing"
    );
    let flat = empty_device_contiguous_dtype(client.clone(), device, [total].into(), DType::F32);
    let mut offset = 0;
    for piece in pieces {
        let piece = into_contiguous(piece);
        let n = piece.meta.num_elements();
        if n == 0 {
            continue;
        }
        let nv = width(n, offset);
        let len = n / nv;
        let dtype = piece.dtype;
        let count = calculate_cube_count_elemwise(&client, len, CubeDim::new_1d(THREADS as u32));
        // SAFETY: the kernel guards `i < len`, the vector count of both the piece and its
        // `n`-element window of the flat buffer.
        unsafe {
            cast_into_kernel::launch_unchecked::<CudaRuntime>(
                &client,
                count,
                CubeDim::new_1d(THREADS as u32),
                nv,
                piece.into_tensor_arg(),
                view(&flat, offset..offset + n).into_tensor_arg(),
                len as u32,
                dtype.into(),
            );
        }
        offset += n;
    }
    if offset < total {
        let n = total - offset;
        let count = calculate_cube_count_elemwise(&client, n, CubeDim::new_1d(THREADS as u32));
        // SAFETY: the kernel guards `i < n`, the padding's length.
        unsafe {
            zero_kernel::launch_unchecked::<CudaRuntime>(
                &client,
                count,
                CubeDim::new_1d(THREADS as u32),
                view(&flat, offset..total).into_tensor_arg(),
                n as u32,
            );
        }
    }
    flat
}
