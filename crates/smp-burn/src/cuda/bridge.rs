//! One way into the CUDA kernels for both backends whose tensors are CubeCL CUDA buffers: the
//! plain [`CudaCube`] and Burn's default CUDA backend, [`FusedCuda`] (`burn::backend::Cuda`,
//! CubeCL under Burn's fusion layer).
//!
//! A fast path is written once, as a function of CubeCL buffers, and handed to
//! [`CubeInner::run`]. On [`CudaCube`] it runs at once. Under fusion it is registered as a
//! custom operation in fusion's stream: fusion's queue stays lazy (no drain), its fused
//! elementwise kernels run before and after it in order, and the function runs on fusion's
//! device thread with the caller's CubeCL stream, so it is ordered with every other kernel
//! exactly as on the plain backend.

use std::any::TypeId;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape};
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cuda::CudaDevice;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};
use cubecl::cuda::CudaRuntime;

use super::device::CudaCube;

/// A CubeCL CUDA buffer: what every kernel takes and returns.
pub type Cube = CubeTensor<CudaRuntime>;

/// Burn's default CUDA backend, `burn::backend::Cuda`: [`CudaCube`] under the fusion layer.
pub type FusedCuda = Fusion<CudaCube>;

/// An input of a fast path: a float or an int tensor of the backend.
pub enum Arg<B: Backend> {
    /// A float tensor.
    Float(B::FloatTensorPrimitive),
    /// An int tensor (token ids, targets).
    Int(B::IntTensorPrimitive),
}

/// A fast path as a function of CubeCL buffers: the inputs in order, the outputs in the order
/// and with the shapes and dtypes declared to [`CubeInner::run`].
pub type CubeFn = Arc<dyn Fn(Vec<Cube>) -> Vec<Cube> + Send + Sync>;

/// The backends the CUDA fast paths serve: [`CudaCube`] and [`FusedCuda`]. Sealed: a backend
/// outside this list takes the reference ops (and the log says so once for a CUDA one).
pub trait CubeInner: Backend<Device = CudaDevice> + sealed::Sealed {
    /// Runs `f` on the buffers behind `args`; returns its outputs, which must have the shapes
    /// and dtypes of `outputs`. `name` labels the operation in fusion's stream.
    fn run(
        name: &'static str,
        args: Vec<Arg<Self>>,
        outputs: Vec<(Shape, DType)>,
        f: CubeFn,
    ) -> Vec<Self::FloatTensorPrimitive>;

    /// The plain buffer behind a float tensor of [`CudaCube`]; `None` under fusion, whose
    /// buffers exist only inside its stream.
    fn as_cube(t: &Self::FloatTensorPrimitive) -> Option<&Cube>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::CudaCube {}
    impl Sealed for super::FusedCuda {}
}

impl CubeInner for CudaCube {
    fn run(
        _name: &'static str,
        args: Vec<Arg<Self>>,
        _outputs: Vec<(Shape, DType)>,
        f: CubeFn,
    ) -> Vec<Cube> {
        let inputs = args
            .into_iter()
            .map(|a| match a {
                Arg::Float(t) | Arg::Int(t) => t,
            })
            .collect();
        f(inputs)
    }

    fn as_cube(t: &Cube) -> Option<&Cube> {
        Some(t)
    }
}

type FusionRt = FusionCubeRuntime<CudaRuntime>;

/// A fast path queued in fusion's stream.
struct CubeOp {
    desc: CustomOpIr,
    int_inputs: Vec<bool>,
    f: CubeFn,
}

impl std::fmt::Debug for CubeOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CubeOp").field("desc", &self.desc).finish()
    }
}

impl Operation<FusionRt> for CubeOp {
    fn execute(&self, handles: &mut HandleContainer<<FusionRt as FusionRuntime>::FusionHandle>) {
        let inputs = self
            .desc
            .inputs
            .iter()
            .zip(&self.int_inputs)
            .map(|(ir, &int)| match int {
                true => handles.get_int_tensor::<CudaCube>(ir),
                false => handles.get_float_tensor::<CudaCube>(ir),
            })
            .collect();
        let outputs = (self.f)(inputs);
        assert_eq!(
            outputs.len(),
            self.desc.outputs.len(),
            "{}: the kernel returned {} tensors, {} were declared",
            self.desc.id,
            outputs.len(),
            self.desc.outputs.len()
        );
        for (ir, t) in self.desc.outputs.iter().zip(outputs) {
            assert!(
                *t.meta.shape() == ir.shape && t.dtype == ir.dtype,
                "{}: the kernel returned {:?} {:?} where {:?} {:?} was declared",
                self.desc.id,
                t.meta.shape(),
                t.dtype,
                ir.shape,
                ir.dtype
            );
            handles.register_float_tensor::<CudaCube>(&ir.id, t);
        }
    }
}

impl CubeInner for FusedCuda {
    fn run(
        name: &'static str,
        args: Vec<Arg<Self>>,
        outputs: Vec<(Shape, DType)>,
        f: CubeFn,
    ) -> Vec<FusionTensor<FusionRt>> {
        let tensors: Vec<(FusionTensor<FusionRt>, bool)> = args
            .into_iter()
            .map(|a| match a {
                Arg::Float(t) => (t, false),
                Arg::Int(t) => (t, true),
            })
            .collect();
        let client = tensors
            .first()
            .map(|(t, _)| t.client.clone())
            .expect("a fast path has an input");
        let streams = OperationStreams::with_inputs(tensors.iter().map(|(t, _)| t));
        let int_inputs = tensors.iter().map(|(_, int)| *int).collect();
        let inputs: Vec<TensorIr> = tensors.into_iter().map(|(t, _)| t.into_ir()).collect();
        let outputs: Vec<TensorIr> = outputs
            .into_iter()
            .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
            .collect();
        let desc = CustomOpIr::new(name, &inputs, &outputs);
        client.register(
            streams,
            OperationIr::Custom(desc.clone()),
            CubeOp {
                desc,
                int_inputs,
                f,
            },
        )
    }

    fn as_cube(_: &FusionTensor<FusionRt>) -> Option<&Cube> {
        None
    }
}

/// Which of the served backends `B` is, with or without autodiff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Served {
    /// [`CudaCube`].
    Cube,
    /// [`FusedCuda`].
    Fused,
    /// `Autodiff<CudaCube>`.
    CubeAutodiff,
    /// `Autodiff<FusedCuda>`.
    FusedAutodiff,
}

/// Which served backend `B` is; `None` for any other.
pub(crate) fn served<B: Backend>() -> Option<Served> {
    use burn::backend::Autodiff;
    let b = TypeId::of::<B>();
    [
        (TypeId::of::<CudaCube>(), Served::Cube),
        (TypeId::of::<FusedCuda>(), Served::Fused),
        (TypeId::of::<Autodiff<CudaCube>>(), Served::CubeAutodiff),
        (TypeId::of::<Autodiff<FusedCuda>>(), Served::FusedAutodiff),
    ]
    .into_iter()
    .find_map(|(id, s)| (id == b).then_some(s))
}
