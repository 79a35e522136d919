//! Linear layers through cuBLAS on Burn's own CUDA buffers, inside Burn's autodiff.
//!
//! Burn 0.21's CubeCL matmul reaches 185-217 TFLOP/s on Llama shapes where cuBLAS reaches
//! 724-809 on the same H200 (DESIGN.md), and the GEMMs are three quarters of a transformer's
//! FLOPs. Here the forward `y = x w^T` and both backward GEMMs (`dx = dy w`, `dw = dy^T x`) run
//! through `cublasGemmEx` (bf16 or f32 inputs, f32 accumulation, output in the input dtype) on a
//! stream of our own, ordered with Burn's kernels by context events (no host wait; see
//! [`StreamBridge`]). Each thread keeps one cuBLAS handle and bridge per device, because a
//! cuBLAS handle must not be used from two threads at once and threads-as-ranks drive one GPU
//! each.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::{DType as BurnDType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cublas::{CudaBlas, result as cbr, sys as cbs};

use super::{CudaCube, StreamBridge, cuda_err};
use crate::error::SmpError;

/// The autodiff backend the fast path serves.
pub type CudaAutodiff = Autodiff<CudaCube>;

struct GemmEngine {
    bridge: StreamBridge,
    blas: CudaBlas,
}

thread_local! {
    static ENGINES: RefCell<HashMap<usize, Rc<GemmEngine>>> = RefCell::new(HashMap::new());
}

fn engine(device: usize) -> Result<Rc<GemmEngine>, SmpError> {
    ENGINES.with(|m| {
        if let Some(e) = m.borrow().get(&device) {
            return Ok(e.clone());
        }
        let bridge = StreamBridge::new(device)?;
        let blas =
            CudaBlas::new(bridge.cuda_stream().clone()).map_err(|e| cuda_err("cublasCreate", e))?;
        let e = Rc::new(GemmEngine { bridge, blas });
        m.borrow_mut().insert(device, e.clone());
        Ok(e)
    })
}

fn cublas_dtype(d: BurnDType) -> Option<cbs::cudaDataType> {
    match d {
        BurnDType::BF16 => Some(cbs::cudaDataType_t::CUDA_R_16BF),
        BurnDType::F16 => Some(cbs::cudaDataType_t::CUDA_R_16F),
        BurnDType::F32 => Some(cbs::cudaDataType_t::CUDA_R_32F),
        _ => None,
    }
}

/// Whether cuBLAS takes these operands as they are (same float dtype, one cuBLAS supports).
pub fn supports(x: BurnDType, w: BurnDType) -> bool {
    x == w && cublas_dtype(x).is_some()
}

/// One column-major GEMM `C[m,n] = op(A) op(B)`, described on pointers into pinned buffers.
struct GemmCall {
    trans_a: bool,
    trans_b: bool,
    m: usize,
    n: usize,
    k: usize,
    a: (u64, usize),
    b: (u64, usize),
    c: (u64, usize),
}

/// Runs `calls` on the engine's stream after every Burn kernel queued so far, and makes Burn's
/// later kernels wait for them. `pins` keep the buffers from being reused until then.
fn run_ordered(
    device: usize,
    dtype: BurnDType,
    calls: &[GemmCall],
    pins: Vec<Box<dyn std::any::Any>>,
) -> Result<(), SmpError> {
    let e = engine(device)?;
    let dt = cublas_dtype(dtype)
        .ok_or_else(|| SmpError::Cuda(format!("cuBLAS linear: unsupported dtype {dtype:?}")))?;
    let op = |t: bool| {
        if t {
            cbs::cublasOperation_t::CUBLAS_OP_T
        } else {
            cbs::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    e.bridge.burn_to_comm()?;
    for c in calls {
        let dim = |v: usize| {
            i32::try_from(v).map_err(|_| SmpError::Cuda(format!("GEMM dimension {v} exceeds i32")))
        };
        // SAFETY: the pointers come from pinned, live allocations of at least the sizes the
        // leading dimensions and extents describe (checked by the callers' shape logic), on
        // `device`, whose context the bridge made current; the stream is the handle's own.
        unsafe {
            cbr::gemm_ex(
                *e.blas.handle(),
                op(c.trans_a),
                op(c.trans_b),
                dim(c.m)?,
                dim(c.n)?,
                dim(c.k)?,
                (&alpha as *const f32).cast(),
                c.a.0 as *const _,
                dt,
                dim(c.a.1)?,
                c.b.0 as *const _,
                dt,
                dim(c.b.1)?,
                (&beta as *const f32).cast(),
                c.c.0 as *mut _,
                dt,
                dim(c.c.1)?,
                cbs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cbs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .map_err(|err| cuda_err("cublasGemmEx", err))?;
        }
    }
    e.bridge.comm_to_burn()?;
    drop(pins);
    Ok(())
}

/// Device pointer of a contiguous CubeCL tensor, with the pin that keeps it alive.
fn pin(t: &CubeTensor<CudaRuntime>) -> Result<(u64, Box<dyn std::any::Any>), SmpError> {
    let r = t
        .client
        .get_resource(t.handle.clone())
        .map_err(|e| cuda_err("pinning a Burn buffer (get_resource)", e))?;
    Ok((r.resource().ptr, Box::new(r)))
}

/// Rows (product of the leading dimensions) and columns (the last) of a tensor.
fn rows_cols(shape: &Shape) -> (usize, usize) {
    let dims = shape.as_slice();
    let cols = *dims.last().unwrap_or(&1);
    let rows = dims[..dims.len().saturating_sub(1)].iter().product();
    (rows, cols)
}

fn check_dtype(what: &str, a: &CubeTensor<CudaRuntime>, b: &CubeTensor<CudaRuntime>) {
    assert!(
        supports(a.dtype, b.dtype),
        "cuBLAS {what}: operands must share a float dtype cuBLAS supports, got {:?} and {:?}",
        a.dtype,
        b.dtype
    );
}

/// `y = x w^T` with `x: [..., k]` and `w: [n, k]` (PyTorch's layout); `y: [..., n]`.
///
/// # Panics
/// On mismatched shapes or dtypes (an autodiff op has no error channel) and on CUDA errors,
/// naming the values.
pub fn linear_forward(
    x: CubeTensor<CudaRuntime>,
    w: CubeTensor<CudaRuntime>,
) -> CubeTensor<CudaRuntime> {
    check_dtype("linear", &x, &w);
    let (x, w) = (into_contiguous(x), into_contiguous(w));
    let (m, k) = rows_cols(x.meta.shape());
    let [n, kw] = w.meta.shape().dims::<2>();
    assert_eq!(
        k,
        kw,
        "linear: input {:?} does not match weight {:?}",
        x.meta.shape(),
        w.meta.shape()
    );
    let mut out_dims = x.meta.shape().as_slice().to_vec();
    *out_dims.last_mut().expect("input has a dimension") = n;
    let y = empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::from(out_dims),
        x.dtype,
    );
    if m * n * k > 0 {
        let ((xp, g1), (wp, g2), (yp, g3)) = (pin(&x).unwrap(), pin(&w).unwrap(), pin(&y).unwrap());
        // Row-major y[m,n] is column-major y^T[n,m] = w[n,k] (stored as w^T, k x n) ^T · x^T.
        let call = GemmCall {
            trans_a: true,
            trans_b: false,
            m: n,
            n: m,
            k,
            a: (wp, k),
            b: (xp, k),
            c: (yp, n),
        };
        run_ordered(x.device.index, x.dtype, &[call], vec![g1, g2, g3])
            .unwrap_or_else(|e| panic!("cuBLAS linear forward [{m} x {k}] x [{n} x {k}]^T: {e}"));
    }
    y
}

/// The two backward GEMMs of [`linear_forward`]: `dx = dy w` (when `w` is given) and
/// `dw = dy^T x` (when `x` is given), in one ordered batch.
///
/// # Panics
/// As [`linear_forward`].
pub fn linear_backward(
    dy: CubeTensor<CudaRuntime>,
    x: Option<CubeTensor<CudaRuntime>>,
    w: Option<CubeTensor<CudaRuntime>>,
    x_shape: &Shape,
) -> (
    Option<CubeTensor<CudaRuntime>>,
    Option<CubeTensor<CudaRuntime>>,
) {
    let dy = into_contiguous(dy);
    let (m, n) = rows_cols(dy.meta.shape());
    let (_, k) = rows_cols(x_shape);
    let mut pins: Vec<Box<dyn std::any::Any>> = Vec::new();
    let mut calls = Vec::new();
    let (dyp, g) = pin(&dy).unwrap();
    pins.push(g);
    let alloc = |shape: Shape| {
        empty_device_contiguous_dtype(dy.client.clone(), dy.device.clone(), shape, dy.dtype)
    };
    let dx = w.map(|w| {
        check_dtype("linear backward (dx)", &dy, &w);
        let w = into_contiguous(w);
        let dx = alloc(x_shape.clone());
        let ((wp, g1), (dxp, g2)) = (pin(&w).unwrap(), pin(&dx).unwrap());
        pins.extend([g1, g2]);
        // dx^T (k x m, column-major) = w^T (k x n, stored as w) · dy^T (n x m, stored as dy).
        calls.push(GemmCall {
            trans_a: false,
            trans_b: false,
            m: k,
            n: m,
            k: n,
            a: (wp, k),
            b: (dyp, n),
            c: (dxp, k),
        });
        dx
    });
    let dw = x.map(|x| {
        check_dtype("linear backward (dw)", &dy, &x);
        let x = into_contiguous(x);
        let dw = alloc(Shape::from(vec![n, k]));
        let ((xp, g1), (dwp, g2)) = (pin(&x).unwrap(), pin(&dw).unwrap());
        pins.extend([g1, g2]);
        // dw^T (k x n, column-major) = x^T (k x m, stored as x) · dy (m x n, stored as dy^T).
        calls.push(GemmCall {
            trans_a: false,
            trans_b: true,
            m: k,
            n,
            k: m,
            a: (xp, k),
            b: (dyp, n),
            c: (dwp, k),
        });
        dw
    });
    if m * n * k > 0 {
        run_ordered(dy.device.index, dy.dtype, &calls, pins)
            .unwrap_or_else(|e| panic!("cuBLAS linear backward [{m} x {n}] (k = {k}): {e}"));
    }
    (dx, dw)
}

#[derive(Debug)]
struct LinearBackward;

impl Backward<CudaCube, 2> for LinearBackward {
    /// Checkpointed input (needed for dw), checkpointed weight (needed for dx), input shape.
    type State = (Option<NodeId>, Option<NodeId>, Shape);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_w] = ops.parents;
        let dy = grads.consume::<CudaCube>(&ops.node);
        let (x_id, w_id, x_shape) = ops.state;
        let x = x_id.map(|id| checkpointer.retrieve_node_output::<CubeTensor<CudaRuntime>>(id));
        let w = w_id.map(|id| checkpointer.retrieve_node_output::<CubeTensor<CudaRuntime>>(id));
        let (dx, dw) = linear_backward(dy, x, w, &x_shape);
        if let (Some(node), Some(dx)) = (node_x, dx) {
            grads.register::<CudaCube>(node.id, dx);
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            grads.register::<CudaCube>(node.id, dw);
        }
    }
}

/// `x w^T` through cuBLAS on the autodiff CUDA backend; differentiable in both operands.
pub fn linear_autodiff<const D: usize>(
    x: Tensor<CudaAutodiff, D>,
    w: Tensor<CudaAutodiff, 2>,
) -> Tensor<CudaAutodiff, D> {
    let x = x.into_primitive().tensor();
    let w = w.into_primitive().tensor();
    let (x_tracked, w_tracked) = (x.is_tracked(), w.is_tracked());
    let x_shape = x.primitive.meta.shape().clone();
    let out = match LinearBackward
        .prepare::<NoCheckpointing>([x.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let x_state = w_tracked.then(|| prep.checkpoint(&x));
            let w_state = x_tracked.then(|| prep.checkpoint(&w));
            let y = linear_forward(x.primitive, w.primitive);
            prep.finish((x_state, w_state, x_shape), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(linear_forward(x.primitive, w.primitive)),
    };
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// `x w^T` through cuBLAS on the plain CUDA backend (evaluation, sampling).
pub fn linear_plain<const D: usize>(
    x: Tensor<CudaCube, D>,
    w: Tensor<CudaCube, 2>,
) -> Tensor<CudaCube, D> {
    let y = linear_forward(x.into_primitive().tensor(), w.into_primitive().tensor());
    Tensor::from_primitive(TensorPrimitive::Float(y))
}
