//! Gradients that meet at one tensor, summed by the op whose backward runs second.

use std::sync::Arc;

use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;

use super::device::CudaCube;

/// The autodiff tensor type of [`gemm::CudaAutodiff`], named to build the lookup key of
/// [`take_grad_for_accumulation`] (Burn's `AutodiffTensor` is not exported by name).
type AutodiffCudaTensor =
    <burn::backend::Autodiff<CudaCube> as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive;

/// The gradient already registered for parent `parent` of an op, taken out of `grads` as a
/// contiguous buffer of `shape` and `like`'s dtype that the op may add its own contribution
/// into (and then register, which finds the slot empty). Without this, Burn registers the
/// contribution as a new tensor and adds the two in a separate pass: five full-size adds per
/// Llama layer in the backward (the inputs of q/k/v and of gate/up, and the residual stream at
/// both norms).
///
/// `None` when the `accumulate` fast path is off, when that parent takes no gradient or none is
/// registered yet (the op writes a fresh one), and when the registered one has another shape
/// or dtype (left in place; the op registers as usual). A buffer that another tensor still
/// holds is copied first, so the result never depends on whether the add could run in place.
pub(crate) fn take_grad_for_accumulation<S, const N: usize>(
    ops: &burn::backend::autodiff::ops::Ops<S, N>,
    parent: usize,
    grads: &mut burn::backend::autodiff::grads::Gradients,
    like: &CubeTensor<CudaRuntime>,
    shape: &burn::tensor::Shape,
) -> Option<CubeTensor<CudaRuntime>> {
    if !crate::kernel_config::fast_paths().accumulate {
        return None;
    }
    let node = ops.parents[parent].as_ref()?;
    // The container is keyed by the node's id alone; `primitive` only fills the struct.
    let key = AutodiffCudaTensor {
        primitive: like.clone(),
        node: node.clone(),
        rc: Arc::new(node.id),
    };
    let old = grads.remove::<CudaCube>(&key)?;
    if old.meta.shape() != shape || old.dtype != like.dtype {
        grads.register::<CudaCube>(node.id, old);
        return None;
    }
    if old.is_contiguous() && old.can_mut() {
        return Some(old);
    }
    // Contiguous or not, a fresh buffer of its values (`into_contiguous` would return a
    // shared contiguous buffer unchanged).
    let (client, device, dtype) = (old.client.clone(), old.device.clone(), old.dtype);
    let copy = cubecl::std::tensor::into_contiguous(&client, old.binding(), dtype.into());
    Some(CubeTensor::new(
        client,
        copy.handle,
        *copy.metadata,
        device,
        dtype,
    ))
}
