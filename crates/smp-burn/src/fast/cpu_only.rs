//! The dispatch of a build without the `cuda` feature: no backend has a fast path, so every op
//! takes the reference (the chunked loss on NdArray is dispatched in the parent module).

use burn::tensor::{DType, Int, Tensor, backend::Backend};

use super::{AdamWState, AdamWUpdate};

/// Whether `B` is the backend the CUDA fast paths serve: none is, without the `cuda` feature.
#[allow(clippy::extra_unused_type_parameters)] // the signature of the CUDA build's
pub(crate) fn is_cuda<B: Backend>() -> bool {
    false
}

pub(crate) fn linear<B: Backend, const D: usize>(
    _: &Tensor<B, D>,
    _: &Tensor<B, 2>,
) -> Option<Tensor<B, D>> {
    None
}

pub(crate) fn linear_fp8<B: Backend, const D: usize>(
    _: &Tensor<B, D>,
    _: &Tensor<B, 2>,
    _: burn::module::ParamId,
) -> Option<Tensor<B, D>> {
    if crate::kernel_config::fp8_recipe().enabled() {
        static NOTED: std::sync::Once = std::sync::Once::new();
        NOTED.call_once(|| {
            tracing::warn!(
                "FP8 recipe on, but this build has no CUDA: linear layers compute in their \
                 own dtype"
            )
        });
    }
    None
}

#[allow(clippy::extra_unused_type_parameters)] // the signature of the CUDA build's
pub(crate) fn fp8_weight_copies_kept<B: Backend>() -> bool {
    false
}

pub(crate) fn causal_attention<B: Backend>(
    _: &Tensor<B, 4>,
    _: &Tensor<B, 4>,
    _: &Tensor<B, 4>,
) -> Option<Tensor<B, 4>> {
    None
}

pub(crate) fn causal_attention_in_documents<B: Backend>(
    _: &Tensor<B, 4>,
    _: &Tensor<B, 4>,
    _: &Tensor<B, 4>,
    _: &crate::documents::Documents,
) -> Option<Tensor<B, 4>> {
    None
}

pub(crate) fn normal_init<B: Backend>(
    _: u64,
    _: f32,
    _: std::ops::Range<usize>,
    _: &B::Device,
) -> Option<Tensor<B, 1>> {
    None
}

#[allow(clippy::type_complexity)]
pub(crate) fn linear_grads<B: Backend>(
    _: &Tensor<B, 2>,
    _: &Tensor<B, 2>,
    _: &Tensor<B, 2>,
    _: bool,
    _: bool,
) -> Option<(Option<Tensor<B, 2>>, Option<Tensor<B, 2>>)> {
    None
}

pub(crate) fn rms_norm<B: Backend, const D: usize>(
    _: &Tensor<B, D>,
    _: &Tensor<B, 1>,
    _: f64,
) -> Option<Tensor<B, D>> {
    None
}

pub(crate) fn swiglu<B: Backend, const D: usize>(
    _: &Tensor<B, D>,
    _: &Tensor<B, D>,
) -> Option<Tensor<B, D>> {
    None
}

pub(crate) fn embedding<B: Backend>(
    _: &Tensor<B, 2>,
    _: &Tensor<B, 2, Int>,
) -> Option<Tensor<B, 3>> {
    None
}

pub(crate) fn rope<B: Backend>(
    _: &Tensor<B, 4>,
    _: &Tensor<B, 2>,
    _: &Tensor<B, 2>,
) -> Option<Tensor<B, 4>> {
    None
}

pub(crate) fn xent_row_stats<B: Backend>(
    _: &Tensor<B, 2>,
    _: &Tensor<B, 1, Int>,
) -> Option<(Tensor<B, 1>, Tensor<B, 1>)> {
    None
}

pub(crate) fn xent_softmax_grad<B: Backend>(
    _: &Tensor<B, 2>,
    _: &Tensor<B, 1>,
    _: &Tensor<B, 1, Int>,
    _: &Tensor<B, 2>,
) -> Option<Tensor<B, 2>> {
    None
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw_step<B: Backend>(
    state: AdamWState<B>,
    _: &Tensor<B, 1>,
    _: &Tensor<B, 1>,
    _: &crate::optim::AdamW,
    _: f64,
    _: u64,
    _: &[(std::ops::Range<usize>, crate::optim::RunRates)],
    _: Option<DType>,
) -> Result<AdamWUpdate<B>, AdamWState<B>> {
    Err(state)
}

pub(crate) fn weighted_sq_sum<B: Backend>(
    _: &Tensor<B, 1>,
    _: &[(std::ops::Range<usize>, f32)],
) -> Option<Tensor<B, 1>> {
    None
}

pub(crate) fn pack<B: Backend>(
    pieces: Vec<Tensor<B, 1>>,
    _: usize,
    _: DType,
) -> Result<Tensor<B, 1>, Vec<Tensor<B, 1>>> {
    Err(pieces)
}

#[allow(clippy::type_complexity)]
pub(crate) fn pack_add<B: Backend>(
    pieces: Vec<(usize, Tensor<B, 1>)>,
    acc: Tensor<B, 1>,
) -> Result<Tensor<B, 1>, (Vec<(usize, Tensor<B, 1>)>, Tensor<B, 1>)> {
    Err((pieces, acc))
}

#[allow(clippy::type_complexity)]
pub(crate) fn pack_with_sq_sums<B: Backend>(
    pieces: Vec<Tensor<B, 1>>,
    _: usize,
    _: DType,
) -> Result<(Tensor<B, 1>, Tensor<B, 1>, Vec<std::ops::Range<usize>>), Vec<Tensor<B, 1>>> {
    Err(pieces)
}

pub(crate) fn weighted_sum<B: Backend>(
    _: &Tensor<B, 1>,
    _: &[(std::ops::Range<usize>, f32)],
) -> Option<Tensor<B, 1>> {
    None
}

pub(crate) fn add_weight_grad_into<B: Backend, IB: Backend, const D: usize>(
    _: &Tensor<B, D>,
    _: &Tensor<IB, 1>,
    _: usize,
    _: u64,
) {
}

pub(crate) fn weight_grad_added<B: Backend, const D: usize>(_: &Tensor<B, D>) -> bool {
    false
}

pub(crate) fn forget_weight_grad_targets(_: u64) {}
