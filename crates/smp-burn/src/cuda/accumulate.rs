//! Gradients that meet at one tensor, summed by the op whose backward runs second; and weight
//! gradients added by their GEMM straight into FSDP's f32 gradient sum over micro-batches.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::NodeId;

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

/// Where a weight's gradient GEMM adds its result: elements `offset..offset + numel` of an f32
/// flat gradient sum, owned by the FSDP unit `owner`.
struct WeightGradTarget {
    sum: CubeTensor<CudaRuntime>,
    offset: usize,
    numel: usize,
    owner: u64,
    added: bool,
}

/// The weights (autodiff leaves, by node) whose gradient GEMMs add into a gradient sum instead
/// of returning a gradient. Keyed by node id, which is unique in the process, so ranks on
/// threads share the map without meeting in it.
static WEIGHT_GRAD_TARGETS: Mutex<Option<HashMap<NodeId, WeightGradTarget>>> = Mutex::new(None);

fn targets<T>(f: impl FnOnce(&mut HashMap<NodeId, WeightGradTarget>) -> T) -> T {
    let mut guard = WEIGHT_GRAD_TARGETS
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    f(guard.get_or_insert_with(HashMap::new))
}

/// Makes the gradient GEMM of the weight at `node` add its result into elements `offset..` of
/// `sum` (f32, contiguous), Megatron's gradient-accumulation fusion: the GEMM's epilogue reads
/// and writes the f32 sum (8 bytes per parameter) where writing a bf16 gradient and adding it
/// in a pass of its own moved 12. [`weight_grad_added`] tells whether it did.
pub(crate) fn add_weight_grad_into(
    node: NodeId,
    sum: CubeTensor<CudaRuntime>,
    offset: usize,
    numel: usize,
    owner: u64,
) {
    targets(|t| {
        t.insert(
            node,
            WeightGradTarget {
                sum,
                offset,
                numel,
                owner,
                added: false,
            },
        )
    });
}

/// The f32 buffer (a view of `numel` elements) the gradient GEMM of the weight at `node` adds
/// into, if [`add_weight_grad_into`] registered one of that size; noted as added.
pub(crate) fn weight_grad_target(node: NodeId, numel: usize) -> Option<CubeTensor<CudaRuntime>> {
    if !crate::kernel_config::fast_paths().accumulate {
        return None;
    }
    targets(|t| {
        let target = t.get_mut(&node).filter(|t| t.numel == numel)?;
        target.added = true;
        Some(super::flat::view(
            &target.sum,
            target.offset..target.offset + numel,
        ))
    })
}

/// Whether a GEMM added the gradient of the weight at `node` into its sum; forgets the target.
pub(crate) fn weight_grad_added(node: NodeId) -> bool {
    targets(|t| t.remove(&node).is_some_and(|target| target.added))
}

/// Forgets every target of unit `owner`, so that none keeps its gradient sum alive (a step
/// that stopped before its backward leaves some behind).
pub(crate) fn forget_weight_grad_targets(owner: u64) {
    targets(|t| t.retain(|_, target| target.owner != owner));
}
