//! SwiGLU, `silu(gate) * up`: forward and backward kernels, each one elementwise pass in f32,
//! and the autodiff op that saves only the two inputs (which the reference keeps too).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::{Tensor as BurnTensor, TensorPrimitive};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::{Cube, ELEMWISE_THREADS, check_float, check_u32, vector_width, wrap};
use crate::cuda::CudaCube;
use crate::cuda::gemm::CudaAutodiff;

/// `out = silu(gate) * up`, elementwise over contiguous tensors read in vectors (`len` vectors).
#[cube(launch_unchecked)]
fn swiglu_fwd_kernel<F: Float, N: Size>(
    gate: &Tensor<Vector<F, N>>,
    up: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    len: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        let g = Vector::<f32, N>::cast_from(gate[i]);
        let u = Vector::<f32, N>::cast_from(up[i]);
        let one = Vector::<f32, N>::new(f32::new(1.0));
        let sig = one / (one + (Vector::<f32, N>::new(f32::new(0.0)) - g).exp());
        out[i] = Vector::<F, N>::cast_from(g * sig * u);
    }
}

/// SwiGLU backward: `dgate = dout * up * s * (1 + gate * (1 - s))` with `s = sigmoid(gate)`,
/// `dup = dout * silu(gate)`, in f32, one pass.
#[cube(launch_unchecked)]
fn swiglu_bwd_kernel<F: Float, N: Size>(
    gate: &Tensor<Vector<F, N>>,
    up: &Tensor<Vector<F, N>>,
    d_out: &Tensor<Vector<F, N>>,
    d_gate: &mut Tensor<Vector<F, N>>,
    d_up: &mut Tensor<Vector<F, N>>,
    len: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        let g = Vector::<f32, N>::cast_from(gate[i]);
        let u = Vector::<f32, N>::cast_from(up[i]);
        let d = Vector::<f32, N>::cast_from(d_out[i]);
        let one = Vector::<f32, N>::new(f32::new(1.0));
        let sig = one / (one + (Vector::<f32, N>::new(f32::new(0.0)) - g).exp());
        let silu = g * sig;
        d_gate[i] = Vector::<F, N>::cast_from(d * u * sig * (one + g * (one - sig)));
        d_up[i] = Vector::<F, N>::cast_from(d * silu);
    }
}

fn check_same<R: CubeRuntime>(op: &str, a: &CubeTensor<R>, b: &CubeTensor<R>) {
    assert!(
        a.meta.shape() == b.meta.shape() && a.dtype == b.dtype,
        "{op}: operands differ: {:?} {:?} vs {:?} {:?}",
        a.meta.shape(),
        a.dtype,
        b.meta.shape(),
        b.dtype
    );
    check_float(op, a);
    a.assert_is_on_same_device(b);
}

/// Vector width, vector count and launch grid of an elementwise kernel over contiguous tensors.
fn elementwise_launch<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> (usize, usize, CubeCount) {
    let shape = tensors[0].meta.shape();
    let last = shape[shape.num_dims() - 1];
    let nv = vector_width(tensors, last);
    let len = shape.num_elements() / nv;
    let count = calculate_cube_count_elemwise(
        &tensors[0].client,
        len,
        CubeDim::new_1d(ELEMWISE_THREADS as u32),
    );
    (nv, len, count)
}

/// `silu(gate) * up` in one pass (f32 arithmetic, one rounding to the inputs' dtype).
///
/// # Panics
/// On mismatched shapes or dtypes.
pub fn swiglu_forward<R: CubeRuntime>(gate: CubeTensor<R>, up: CubeTensor<R>) -> CubeTensor<R> {
    check_same("swiglu", &gate, &up);
    let (gate, up) = (into_contiguous(gate), into_contiguous(up));
    check_u32("swiglu", &gate);
    let out = empty_device_contiguous_dtype(
        gate.client.clone(),
        gate.device.clone(),
        gate.meta.shape().clone(),
        gate.dtype,
    );
    let (nv, len, count) = elementwise_launch(&[&gate, &up, &out]);
    if len == 0 {
        return out;
    }
    let (client, dtype) = (gate.client.clone(), gate.dtype);
    // SAFETY: the kernel guards `i < len`, the vector count of every (contiguous) operand.
    unsafe {
        swiglu_fwd_kernel::launch_unchecked::<R>(
            &client,
            count,
            CubeDim::new_1d(ELEMWISE_THREADS as u32),
            nv,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            len as u32,
            dtype.into(),
        );
    }
    out
}

/// The gradients `(dgate, dup)` of [`swiglu_forward`] for the upstream `d_out`, in one pass.
///
/// # Panics
/// On mismatched shapes or dtypes.
pub fn swiglu_backward<R: CubeRuntime>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    d_out: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    check_same("swiglu backward", &gate, &up);
    check_same("swiglu backward", &gate, &d_out);
    let (gate, up, d_out) = (
        into_contiguous(gate),
        into_contiguous(up),
        into_contiguous(d_out),
    );
    check_u32("swiglu backward", &gate);
    let alloc = || {
        empty_device_contiguous_dtype(
            gate.client.clone(),
            gate.device.clone(),
            gate.meta.shape().clone(),
            gate.dtype,
        )
    };
    let (d_gate, d_up) = (alloc(), alloc());
    let (nv, len, count) = elementwise_launch(&[&gate, &up, &d_out, &d_gate, &d_up]);
    if len == 0 {
        return (d_gate, d_up);
    }
    let (client, dtype) = (gate.client.clone(), gate.dtype);
    // SAFETY: as swiglu_forward.
    unsafe {
        swiglu_bwd_kernel::launch_unchecked::<R>(
            &client,
            count,
            CubeDim::new_1d(ELEMWISE_THREADS as u32),
            nv,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            d_out.into_tensor_arg(),
            d_gate.clone().into_tensor_arg(),
            d_up.clone().into_tensor_arg(),
            len as u32,
            dtype.into(),
        );
    }
    (d_gate, d_up)
}

#[derive(Debug)]
struct SwigluBackward;

impl Backward<CudaCube, 2> for SwigluBackward {
    /// gate, up.
    type State = (Cube, Cube);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_gate, node_up] = ops.parents;
        let d_out = grads.consume::<CudaCube>(&ops.node);
        let (gate, up) = ops.state;
        let (d_gate, d_up) = swiglu_backward(gate, up, d_out);
        if let Some(node) = node_gate {
            grads.register::<CudaCube>(node.id, d_gate);
        }
        if let Some(node) = node_up {
            grads.register::<CudaCube>(node.id, d_up);
        }
    }
}

/// `silu(gate) * up` through the fused kernels on the autodiff CUDA backend; differentiable in
/// both. Saves the two inputs (which the reference keeps too) and nothing else.
pub fn swiglu_autodiff<const D: usize>(
    gate: BurnTensor<CudaAutodiff, D>,
    up: BurnTensor<CudaAutodiff, D>,
) -> BurnTensor<CudaAutodiff, D> {
    let gate = gate.into_primitive().tensor();
    let up = up.into_primitive().tensor();
    let out = match SwigluBackward
        .prepare::<NoCheckpointing>([gate.node.clone(), up.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = swiglu_forward(gate.primitive.clone(), up.primitive.clone());
            prep.finish((gate.primitive, up.primitive), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(swiglu_forward(gate.primitive, up.primitive)),
    };
    BurnTensor::from_primitive(TensorPrimitive::Float(out))
}

/// [`swiglu_autodiff`]'s forward on the plain backend.
pub fn swiglu_plain<const D: usize>(
    gate: BurnTensor<CudaCube, D>,
    up: BurnTensor<CudaCube, D>,
) -> BurnTensor<CudaCube, D> {
    wrap(swiglu_forward(
        gate.into_primitive().tensor(),
        up.into_primitive().tensor(),
    ))
}
