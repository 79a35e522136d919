//! Kernels on FSDP's flat buffers.
//!
//! A unit's gradients come out of Burn's autodiff as one tensor per parameter, in the compute
//! dtype (bf16). FSDP needs them as one flat f32 buffer for the reduce-scatter and the shard.
//! With Burn's ops that is a cast per parameter and a `cat` (one slice-assign per parameter):
//! two passes and two launches per parameter, 460 launches and about 14 ms of a 1.2B model's
//! step. [`pack`] writes each gradient straight into its place in the flat buffer, cast on the
//! way: one pass and one launch per parameter. Without a shard group to reduce over, the
//! buffer can stay in the gradients' own dtype ([`pack`] with bf16): half the bytes written
//! here and read by the norm and AdamW, the same values.

use std::ops::Range;

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;

type Cube = CubeTensor<CudaRuntime>;

const THREADS: usize = 256;

/// `dst[i] = O(src[i])` over `len` vectors of `N` elements.
#[cube(launch_unchecked)]
fn cast_into_kernel<F: Float, O: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    dst: &mut Tensor<Vector<O, N>>,
    len: u32,
    #[define(F, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        dst[i] = Vector::<O, N>::cast_from(src[i]);
    }
}

/// `dst[i] = 0` over `len` elements (the flat buffer's padding).
#[cube(launch_unchecked)]
fn zero_kernel<O: Float>(dst: &mut Tensor<O>, len: u32, #[define(O)] _dtype: StorageType) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        dst[i] = O::new(0.0);
    }
}

/// A view of elements `range` of a contiguous 1-D tensor, sharing its buffer.
pub(crate) fn view(t: &Cube, range: Range<usize>) -> Cube {
    let total = t.meta.shape()[0];
    let size = t.dtype.size();
    let handle = t
        .handle
        .clone()
        .offset_start((range.start * size) as u64)
        .offset_end(((total - range.end) * size) as u64);
    CubeTensor::new_contiguous(
        t.client.clone(),
        t.device.clone(),
        [range.len()].into(),
        handle,
        t.dtype,
    )
}

/// A zeroed row-major tensor of `shape`. Burn's `zeros` may pad rows (pitched allocation),
/// which kernels that index `row * width + col` must not be handed.
pub(crate) fn zeros_contiguous(
    client: &ComputeClient<CudaRuntime>,
    device: &CudaDevice,
    shape: Shape,
    dtype: DType,
) -> Cube {
    let n = shape.num_elements();
    let t = empty_device_contiguous_dtype(client.clone(), device.clone(), shape, dtype);
    if n == 0 {
        return t;
    }
    let flat = CubeTensor::new_contiguous(
        client.clone(),
        device.clone(),
        [n].into(),
        t.handle.clone(),
        dtype,
    );
    let count = calculate_cube_count_elemwise(client, n, CubeDim::new_1d(THREADS as u32));
    // SAFETY: the kernel guards `i < n`, the buffer's element count.
    unsafe {
        zero_kernel::launch_unchecked::<CudaRuntime>(
            client,
            count,
            CubeDim::new_1d(THREADS as u32),
            flat.into_tensor_arg(),
            n as u32,
            dtype.into(),
        );
    }
    t
}

/// The widest vector (up to 8 elements) dividing `len` and `offset`: the destination's start
/// must be aligned to the vector's bytes, and the source (a fresh contiguous buffer) is.
fn width(len: usize, offset: usize) -> usize {
    [8, 4, 2, 1]
        .into_iter()
        .find(|w| len.is_multiple_of(*w) && offset.is_multiple_of(*w))
        .expect("1 divides everything")
}

/// One flat tensor of `dtype` (a float type) and `total` elements: `pieces` (any float dtype,
/// each 1-D and contiguous or made so) back to back from element 0, cast on the way, zeros
/// after them.
///
/// # Panics
/// If the pieces hold more than `total` elements, or are not on one device.
pub fn pack(pieces: Vec<Cube>, total: usize, dtype: DType) -> Cube {
    let first = pieces.first().expect("at least one piece");
    let (client, device) = (first.client.clone(), first.device.clone());
    let used: usize = pieces.iter().map(|p| p.meta.num_elements()).sum();
    assert!(
        used <= total,
        "pack: pieces hold {used} elements, the buffer {total}"
    );
    assert!(
        total < u32::MAX as usize,
        "pack: {total} elements are too many for 32-bit indexing"
    );
    let flat = empty_device_contiguous_dtype(client.clone(), device, [total].into(), dtype);
    let mut offset = 0;
    for piece in pieces {
        let piece = into_contiguous(piece);
        let n = piece.meta.num_elements();
        if n == 0 {
            continue;
        }
        let nv = width(n, offset);
        let len = n / nv;
        let src_dtype = piece.dtype;
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
                [src_dtype.into(), dtype.into()],
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
                dtype.into(),
            );
        }
    }
    flat
}
