//! Rotary position embedding (Hugging Face's `rotate_half` layout) forward and backward, and
//! the autodiff op that saves only the tables.
//!
//! Each thread rotates one vector of pairs `(x[j], x[j + d/2])` for several heads at one
//! position, so the tables (shared by every head at a position) are read once per thread, in
//! 16-byte vectors. The backward is the transposed rotation, written for general tables (with
//! Hugging Face's tables, whose two halves are equal, it is the rotation by `-sin`).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::{DType, Shape, Tensor as BurnTensor, TensorPrimitive};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::ops::permute;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::{Cube, ELEMWISE_THREADS, check_float, check_u32, vector_width, wrap};
use crate::cuda::CudaCube;
use crate::cuda::gemm::CudaAutodiff;

/// Heads each thread rotates with one read of the tables.
const ROPE_HEADS_PER_THREAD: usize = 4;

/// Rotary embedding over `x: [batch, heads, seq, d]` (any strides with a unit last one, read in
/// vectors of `nv`; `half_vectors = d / 2 / nv`) with f32 tables `cos`, `sin: [seq, d]`
/// (contiguous, read in vectors of `mv`, which divides `nv`). A thread takes vector `j` of the
/// pairs `(x1, x2) = (x[j..], x[d/2 + j..])` at position `(b, s)` for heads `hg * hpt ..`
/// (clamped to `heads`); `total = batch * seq * head_groups * half_vectors`. Forward
/// `y1 = x1 cos1 - x2 sin1`, `y2 = x2 cos2 + x1 sin2`; backward (the transpose)
/// `y1 = x1 cos1 + x2 sin2`, `y2 = x2 cos2 - x1 sin1`. `out` may have any strides with a unit
/// last one (the others divisible by `nv`), like `x`.
///
/// Why this shape: reading the four table chunks as scalars for one head made most of a
/// thread's loads table traffic (1.2-1.4 TB/s on an H200). Here the tables are read once per
/// thread in 16-byte vectors and reused for `hpt` heads, and all of a thread's `x` loads are
/// issued before any store, so they are in flight together.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel<F: Float, N: Size, M: Size>(
    x: &Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, M>>,
    sin: &Tensor<Vector<f32, M>>,
    out: &mut Tensor<Vector<F, N>>,
    total: u32,
    heads: u32,
    seq: u32,
    half_vectors: u32,
    head_groups: u32,
    #[comptime] nv: usize,
    #[comptime] mv: usize,
    #[comptime] hpt: usize,
    #[comptime] backward: bool,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= total as usize {
        terminate!();
    }
    let hv = half_vectors as usize;
    let j = pos % hv;
    let rest = pos / hv;
    let hg = rest % head_groups as usize;
    let bs = rest / head_groups as usize;
    let s = bs % seq as usize;
    let b = bs / seq as usize;
    let nh = heads as usize;
    // The heads' loads first (raw), so that they are all in flight at once.
    let xb = (b * x.stride(0) + s * x.stride(2)) / nv + j;
    let hs = x.stride(1) / nv;
    let mut x1s = Array::<Vector<F, N>>::new(hpt);
    let mut x2s = Array::<Vector<F, N>>::new(hpt);
    #[unroll]
    for k in 0..hpt {
        let h = hg * hpt + k;
        if h < nh {
            let xi = xb + h * hs;
            x1s[k] = x[xi];
            x2s[k] = x[xi + hv];
        }
    }
    // Table row `s`, elements `j * nv ..` of each half, as `nv / mv` vectors of `mv`.
    let half = hv * nv;
    let tb = (s * 2 * half + j * nv) / mv;
    let th = half / mv;
    let mut c1 = Vector::<f32, N>::empty();
    let mut c2 = Vector::<f32, N>::empty();
    let mut s1 = Vector::<f32, N>::empty();
    let mut s2 = Vector::<f32, N>::empty();
    #[unroll]
    for q in 0..comptime!(nv / mv) {
        let ca = cos[tb + q];
        let cb = cos[tb + th + q];
        let sa = sin[tb + q];
        let sb = sin[tb + th + q];
        #[unroll]
        for l in 0..mv {
            c1[q * mv + l] = ca[l];
            c2[q * mv + l] = cb[l];
            s1[q * mv + l] = sa[l];
            s2[q * mv + l] = sb[l];
        }
    }
    // Output vector of (b, h, s, j), through `out`'s strides (contiguous, or x's dimension
    // order for the backward; see `rope_apply_ordered`).
    let ob = (b * out.stride(0) + s * out.stride(2)) / nv + j;
    let head_vectors = out.stride(1) / nv;
    #[unroll]
    for k in 0..hpt {
        let h = hg * hpt + k;
        if h < nh {
            let x1 = Vector::<f32, N>::cast_from(x1s[k]);
            let x2 = Vector::<f32, N>::cast_from(x2s[k]);
            let oi = ob + h * head_vectors;
            if comptime!(backward) {
                out[oi] = Vector::<F, N>::cast_from(x1 * c1 + x2 * s2);
                out[oi + hv] = Vector::<F, N>::cast_from(x2 * c2 - x1 * s1);
            } else {
                out[oi] = Vector::<F, N>::cast_from(x1 * c1 - x2 * s1);
                out[oi + hv] = Vector::<F, N>::cast_from(x2 * c2 + x1 * s2);
            }
        }
    }
}

/// A kernel's thread count fits its 32-bit `total` argument.
fn check_u32_count(op: &str, n: usize) {
    assert!(
        n < u32::MAX as usize,
        "{op}: {n} threads are too many for 32-bit indexing"
    );
}

/// A rotary table as the kernel reads it: f32, contiguous, `[seq, head_dim]`.
pub fn rope_table<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    check_float("rope table", &t);
    into_contiguous(cast(t, DType::F32))
}

/// Rotary embedding (`backward = false`) or its transpose (`backward = true`, the gradient
/// with respect to the input) of `x: [batch, heads, seq, head_dim]`, with tables from
/// [`rope_table`]. `x` may have any strides; the result is contiguous, in x's dtype.
///
/// # Panics
/// On shapes that do not match or an odd head dim.
pub fn rope_apply<R: CubeRuntime>(
    x: CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    backward: bool,
) -> CubeTensor<R> {
    rope_apply_ordered(x, cos, sin, backward, None)
}

/// The order of the dimensions of a tensor with `strides` from outermost to innermost (largest
/// stride first; ties keep the logical order), when the last dimension is the innermost;
/// `None` otherwise (then a contiguous result is as good as any).
fn dim_order(strides: &[usize]) -> Option<Vec<usize>> {
    let n = strides.len();
    let mut order: Vec<usize> = (0..n).collect();
    // Stable: equal strides (size-1 dimensions) keep their logical order.
    order.sort_by(|&a, &b| strides[b].cmp(&strides[a]));
    (order.last() == Some(&(n - 1))).then_some(order)
}

/// An uninitialized dense tensor of `shape` whose dimensions lie in memory in `order`
/// (outermost first; [`dim_order`]): a contiguous allocation of the permuted shape, viewed back
/// as `shape` by permuting its metadata.
fn empty_ordered<R: CubeRuntime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    shape: &Shape,
    order: &[usize],
    dtype: DType,
) -> CubeTensor<R> {
    let mem_shape = Shape::from(order.iter().map(|&i| shape[i]).collect::<Vec<_>>());
    let t = empty_device_contiguous_dtype(client.clone(), device.clone(), mem_shape, dtype);
    // Memory dimension p holds logical dimension order[p]; logical dimension j is memory
    // dimension inv[j].
    let mut inv = vec![0usize; order.len()];
    for (p, &j) in order.iter().enumerate() {
        inv[j] = p;
    }
    permute(t, &inv)
}

/// [`rope_apply`] with the result's memory order chosen: `like = Some(strides)` gives it the
/// dimension order of a tensor with those strides (dense; contiguous when the last dimension
/// is not the innermost there), `None` a contiguous result.
///
/// Why: the RoPE backward's input `x` is the model's `[B, S, H, D]` projection viewed as
/// `[B, H, S, D]` (swapped strides). A contiguous `dx` makes the gradient's way back
/// (`swap_dims(1, 2)` + `reshape` to `[B, S, H * D]`) a copy kernel per tensor and layer; `dx`
/// in x's order makes it a view.
///
/// # Panics
/// As [`rope_apply`], and if `like` does not have 4 strides.
pub fn rope_apply_ordered<R: CubeRuntime>(
    x: CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    backward: bool,
    like: Option<&[usize]>,
) -> CubeTensor<R> {
    let shape = x.meta.shape().clone();
    assert!(
        shape.num_dims() == 4,
        "rope: x must be [batch, heads, seq, head_dim], got {shape:?}"
    );
    let (heads, seq, d) = (shape[1], shape[2], shape[3]);
    assert!(
        d.is_multiple_of(2)
            && cos.meta.shape().as_slice() == [seq, d]
            && sin.meta.shape().as_slice() == [seq, d]
            && cos.dtype == DType::F32
            && sin.dtype == DType::F32
            && cos.is_contiguous()
            && sin.is_contiguous(),
        "rope: x {shape:?} needs an even head dim and contiguous f32 tables [seq, head_dim] \
         (rope_table), got cos {:?} {:?}, sin {:?} {:?}",
        cos.meta.shape(),
        cos.dtype,
        sin.meta.shape(),
        sin.dtype
    );
    check_float("rope", &x);
    x.assert_is_on_same_device(cos);
    let x = if x.meta.strides()[3] != 1 {
        into_contiguous(x)
    } else {
        x
    };
    check_u32("rope", &x);
    if let Some(like) = like {
        assert!(
            like.len() == 4,
            "rope: `like` needs 4 strides, got {like:?}"
        );
    }
    let out = match like.and_then(dim_order) {
        Some(order) => empty_ordered(&x.client, &x.device, &shape, &order, x.dtype),
        None => empty_device_contiguous_dtype(
            x.client.clone(),
            x.device.clone(),
            shape.clone(),
            x.dtype,
        ),
    };
    let half = d / 2;
    let nv = vector_width(&[&x, &out], half);
    let half_vectors = half / nv;
    let (client, dtype) = (x.client.clone(), x.dtype);
    // Tables in vectors of at most 16 bytes that divide x's vector (so a thread's `nv` angles
    // are whole table vectors); the tables are contiguous, so only their offsets can forbid it.
    let mv = vector_width(&[cos, sin], nv).min(4);
    let head_groups = heads.div_ceil(ROPE_HEADS_PER_THREAD);
    let total = shape[0] * seq * head_groups * half_vectors;
    if total == 0 {
        return out;
    }
    check_u32_count("rope", total);
    let count =
        calculate_cube_count_elemwise(&client, total, CubeDim::new_1d(ELEMWISE_THREADS as u32));
    // SAFETY: the kernel guards `pos < total` and `head < heads`; (batch, position, head) come
    // from the checked shape, the strides from the tensor (all but the last divisible by `nv`,
    // which `vector_width` checked), so every index stays inside `x`, `out` and the tables,
    // whose vectors of `mv` divide `nv` and the table row.
    unsafe {
        rope_kernel::launch_unchecked::<R>(
            &client,
            count,
            CubeDim::new_1d(ELEMWISE_THREADS as u32),
            nv,
            mv,
            x.into_tensor_arg(),
            cos.clone().into_tensor_arg(),
            sin.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            total as u32,
            heads as u32,
            seq as u32,
            half_vectors as u32,
            head_groups as u32,
            nv,
            mv,
            ROPE_HEADS_PER_THREAD,
            backward,
            dtype.into(),
        );
    }
    out
}

#[derive(Debug)]
struct RopeBackward;

impl Backward<CudaCube, 1> for RopeBackward {
    /// The f32 tables and x's strides (`dx` is written in x's dimension order; see
    /// [`rope_apply_ordered`]).
    type State = (Cube, Cube, [usize; 4]);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let dy = grads.consume::<CudaCube>(&ops.node);
        let (cos, sin, x_strides) = ops.state;
        if let Some(node) = node_x {
            let dx = rope_apply_ordered(dy, &cos, &sin, true, Some(&x_strides[..]));
            grads.register::<CudaCube>(node.id, dx);
        }
    }
}

/// Rotary embedding of `x: [batch, heads, seq, head_dim]` through the fused kernels on the
/// autodiff CUDA backend; differentiable in `x` (the tables are constants). Saves only the
/// tables.
pub fn rope_autodiff(
    x: BurnTensor<CudaAutodiff, 4>,
    cos: BurnTensor<CudaCube, 2>,
    sin: BurnTensor<CudaCube, 2>,
) -> BurnTensor<CudaAutodiff, 4> {
    let cos = rope_table(cos.into_primitive().tensor());
    let sin = rope_table(sin.into_primitive().tensor());
    let x = x.into_primitive().tensor();
    let out = match RopeBackward
        .prepare::<NoCheckpointing>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let st = x.primitive.meta.strides();
            let x_strides = [st[0], st[1], st[2], st[3]];
            let y = rope_apply(x.primitive, &cos, &sin, false);
            prep.finish((cos, sin, x_strides), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(rope_apply(x.primitive, &cos, &sin, false)),
    };
    BurnTensor::from_primitive(TensorPrimitive::Float(out))
}

/// [`rope_autodiff`]'s forward on the plain backend.
pub fn rope_plain(
    x: BurnTensor<CudaCube, 4>,
    cos: BurnTensor<CudaCube, 2>,
    sin: BurnTensor<CudaCube, 2>,
) -> BurnTensor<CudaCube, 4> {
    let cos = rope_table(cos.into_primitive().tensor());
    let sin = rope_table(sin.into_primitive().tensor());
    wrap(rope_apply(x.into_primitive().tensor(), &cos, &sin, false))
}
