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

use super::fused::cube_sum;

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

/// As [`cast_into_kernel`], and cube `c` writes the sum of the squares of the values it stored
/// to `partials[first + c]`: the gradient norm's share of this piece, without reading the
/// packed buffer again.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn cast_into_sq_kernel<F: Float, O: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    dst: &mut Tensor<Vector<O, N>>,
    partials: &mut Tensor<f32>,
    len: u32,
    first: u32,
    #[comptime] nv: usize,
    #[define(F, O)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    let mut sq = f32::new(0.0);
    if i < len as usize {
        let stored = Vector::<O, N>::cast_from(src[i]);
        dst[i] = stored;
        let v = Vector::<f32, N>::cast_from(stored);
        #[unroll]
        for k in 0..nv {
            sq += v[k] * v[k];
        }
    }
    let mut scratch = SharedMemory::<f32>::new(comptime!(THREADS / 32));
    let total = cube_sum(sq, &mut scratch);
    if UNIT_POS == 0 {
        partials[first as usize + CUBE_POS] = total;
    }
}

/// `dst[i] += f32(src[i])` over `len` vectors of `N` elements.
#[cube(launch_unchecked)]
fn add_into_kernel<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    dst: &mut Tensor<Vector<f32, N>>,
    len: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        dst[i] = dst[i] + Vector::<f32, N>::cast_from(src[i]);
    }
}

/// `dst[i] = 0` over `len` vectors (the flat buffer's padding, a zeroed table).
#[cube(launch_unchecked)]
fn zero_kernel<O: Float, N: Size>(
    dst: &mut Tensor<Vector<O, N>>,
    len: u32,
    #[define(O)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        dst[i] = Vector::new(O::new(0.0));
    }
}

/// Zeroes the contiguous 1-D tensor `t`, which starts `offset` elements into an aligned buffer
/// (the widest vector dividing both is used).
fn fill_zero(client: &ComputeClient<CudaRuntime>, t: Cube, offset: usize) {
    let n = t.meta.num_elements();
    if n == 0 {
        return;
    }
    let nv = width(n, offset);
    let len = n / nv;
    let dtype = t.dtype;
    let count = calculate_cube_count_elemwise(client, len, CubeDim::new_1d(THREADS as u32));
    // SAFETY: the kernel guards `i < len`, the tensor's vector count.
    unsafe {
        zero_kernel::launch_unchecked::<CudaRuntime>(
            client,
            count,
            CubeDim::new_1d(THREADS as u32),
            nv,
            t.into_tensor_arg(),
            len as u32,
            dtype.into(),
        );
    }
}

/// A buffer a kernel may overwrite: `t` itself when nothing else holds it, else a copy (a
/// checkpoint writer or a gather in flight may still read the old values).
pub(crate) fn writable(t: Cube) -> Cube {
    if t.can_mut() && t.is_contiguous_buffer() {
        t
    } else {
        t.copy()
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
    fill_zero(client, flat, 0);
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
    pack_impl(pieces, total, dtype, false).0
}

/// `acc` (a flat f32 buffer, as [`pack`] made it) with each piece (any float dtype, 1-D) added
/// element by element from its offset: gradient accumulation over micro-batches in one pass
/// per piece (read the piece and the sum, write the sum: 10 bytes per bf16 gradient, where
/// packing into a fresh f32 buffer and adding the two reads and writes 18). In place when
/// nothing else holds `acc`, else into a copy; elements outside the pieces keep their values
/// (the gradients a GEMM already added, [`super::accumulate::add_weight_grad_into`]).
///
/// # Panics
/// If `acc` is not f32, a piece reaches past it, or they are not on one device.
pub fn pack_add(pieces: Vec<(usize, Cube)>, acc: Cube) -> Cube {
    assert_eq!(acc.dtype, DType::F32, "pack_add: the sum must be f32");
    let total = acc.meta.num_elements();
    assert!(
        total < u32::MAX as usize,
        "pack_add: {total} elements are too many for 32-bit indexing"
    );
    for (offset, piece) in &pieces {
        let n = piece.meta.num_elements();
        assert!(
            offset + n <= total,
            "pack_add: a piece of {n} elements at {offset} reaches past the sum's {total}"
        );
    }
    let acc = writable(acc);
    let client = acc.client.clone();
    for (offset, piece) in pieces {
        let piece = into_contiguous(piece);
        let n = piece.meta.num_elements();
        if n == 0 {
            continue;
        }
        let nv = width(n, offset);
        let len = n / nv;
        let src_dtype = piece.dtype;
        let dim = CubeDim::new_1d(THREADS as u32);
        // SAFETY: the kernel guards `i < len`, the vector count of both the piece and its
        // `n`-element window of the sum.
        unsafe {
            add_into_kernel::launch_unchecked::<CudaRuntime>(
                &client,
                calculate_cube_count_elemwise(&client, len, dim),
                dim,
                nv,
                piece.into_tensor_arg(),
                view(&acc, offset..offset + n).into_tensor_arg(),
                len as u32,
                src_dtype.into(),
            );
        }
    }
    acc
}

/// Per-piece sums of squares as [`pack_with_sq_sums`] leaves them: the f32 partials and, for
/// each piece in order, its range of them (empty for an empty piece).
pub type SqPartials = (Cube, Vec<Range<usize>>);

/// [`pack`], and the sum of the squares of each piece's packed values as a range of f32 partial
/// sums (one per cube): the gradient norm's input, computed while the values pass through
/// instead of in a second pass over the flat buffer. Reduce a range with
/// [`super::adamw::weighted_sum`].
///
/// # Panics
/// As [`pack`].
pub fn pack_with_sq_sums(pieces: Vec<Cube>, total: usize, dtype: DType) -> (Cube, SqPartials) {
    let (flat, sq) = pack_impl(pieces, total, dtype, true);
    (flat, sq.expect("asked for"))
}

/// For pieces of `sizes` elements packed back to back: each piece's (vector width, vectors),
/// its range of partial sums (one per cube) and the number of partial sums.
#[allow(clippy::type_complexity)]
fn piece_plan(sizes: &[usize]) -> (Vec<(usize, usize)>, Vec<Range<usize>>, usize) {
    let mut offset = 0;
    let mut shapes = Vec::with_capacity(sizes.len());
    let mut ranges = Vec::with_capacity(sizes.len());
    let mut slots = 0;
    for &n in sizes {
        let nv = width(n, offset);
        let cubes = (n / nv).div_ceil(THREADS);
        shapes.push((nv, n / nv));
        ranges.push(slots..slots + cubes);
        slots += cubes;
        offset += n;
    }
    (shapes, ranges, slots)
}

/// The ranges of partial sums [`pack_with_sq_sums`] gives pieces of `sizes` elements, and
/// their count (its partials tensor holds at least one element), known before it runs.
pub fn sq_partial_ranges(sizes: &[usize]) -> (Vec<Range<usize>>, usize) {
    let (_, ranges, slots) = piece_plan(sizes);
    (ranges, slots)
}

fn pack_impl(
    pieces: Vec<Cube>,
    total: usize,
    dtype: DType,
    with_sq: bool,
) -> (Cube, Option<SqPartials>) {
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
    let flat = empty_device_contiguous_dtype(client.clone(), device.clone(), [total].into(), dtype);
    let sizes: Vec<usize> = pieces.iter().map(|p| p.meta.num_elements()).collect();
    let (shapes, ranges, slots) = piece_plan(&sizes);
    // Every slot is written by exactly one cube.
    let partials = with_sq.then(|| {
        empty_device_contiguous_dtype(client.clone(), device, [slots.max(1)].into(), DType::F32)
    });
    let mut offset = 0;
    for ((piece, (nv, len)), range) in pieces.into_iter().zip(shapes).zip(&ranges) {
        let piece = into_contiguous(piece);
        let n = piece.meta.num_elements();
        if n == 0 {
            continue;
        }
        let src_dtype = piece.dtype;
        let dst = view(&flat, offset..offset + n).into_tensor_arg();
        let dim = CubeDim::new_1d(THREADS as u32);
        // SAFETY: the kernels guard `i < len`, the vector count of both the piece and its
        // `n`-element window of the flat buffer; the partials kernel writes slot
        // `range.start + CUBE_POS`, inside the piece's range by construction.
        unsafe {
            match &partials {
                None => cast_into_kernel::launch_unchecked::<CudaRuntime>(
                    &client,
                    calculate_cube_count_elemwise(&client, len, dim),
                    dim,
                    nv,
                    piece.into_tensor_arg(),
                    dst,
                    len as u32,
                    [src_dtype.into(), dtype.into()],
                ),
                Some(p) => cast_into_sq_kernel::launch_unchecked::<CudaRuntime>(
                    &client,
                    CubeCount::Static(range.len() as u32, 1, 1),
                    dim,
                    nv,
                    piece.into_tensor_arg(),
                    dst,
                    p.clone().into_tensor_arg(),
                    len as u32,
                    range.start as u32,
                    nv,
                    [src_dtype.into(), dtype.into()],
                ),
            }
        }
        offset += n;
    }
    if offset < total {
        fill_zero(&client, view(&flat, offset..total), offset);
    }
    (flat, partials.map(|p| (p, ranges)))
}
