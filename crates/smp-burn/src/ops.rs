//! Reference implementations of the transformer ops, written with Burn's stock tensor ops.
//!
//! They define the semantics every fused kernel must match, run on every backend (CPU tests keep
//! them honest in CI), and differentiate through Burn's autodiff. Conventions follow Hugging
//! Face's Llama so that checkpoints and logits carry over unchanged.

use burn::tensor::{
    Bool, DType, Int, Tensor,
    activation::{log_softmax, silu, softmax},
    backend::Backend,
};

/// `x @ w^T` for a weight stored as `[out_features, in_features]` (PyTorch's layout), so
/// Hugging Face weights need no transpose on import or export. On CUDA this runs through
/// cuBLAS (see [`crate::fast`]).
pub fn linear<B: Backend, const D: usize>(x: Tensor<B, D>, weight: Tensor<B, 2>) -> Tensor<B, D> {
    if let Some(y) = crate::fast::linear(&x, &weight) {
        return y;
    }
    x.matmul(weight.transpose().unsqueeze())
}

/// RMSNorm as Llama computes it: the mean square in f32, then scaled by `weight`.
pub fn rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    let dtype = x.dtype();
    let x32 = x.cast(DType::F32);
    let inv_rms = (x32.clone().square().mean_dim(D - 1) + eps).sqrt().recip();
    (x32 * inv_rms).cast(dtype) * weight.unsqueeze()
}

/// Cosine and sine tables for rotary embeddings, each `[seq_len, head_dim]`, with the frequencies
/// repeated over both halves (Hugging Face's `rotate_half` layout, not interleaved pairs).
pub fn rope_tables<B: Backend>(
    seq_len: usize,
    head_dim: usize,
    theta: f64,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(seq_len * head_dim);
    let mut sin = Vec::with_capacity(seq_len * head_dim);
    for pos in 0..seq_len {
        for j in 0..head_dim {
            // f32 inverse frequencies, as transformers computes them, so logits match closely.
            let inv_freq = 1.0f32 / (theta as f32).powf((2 * (j % half)) as f32 / head_dim as f32);
            let angle = pos as f32 * inv_freq;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let shape = [seq_len, head_dim];
    (
        Tensor::<B, 1>::from_floats(cos.as_slice(), device).reshape(shape),
        Tensor::<B, 1>::from_floats(sin.as_slice(), device).reshape(shape),
    )
}

/// Applies rotary embeddings to `x: [batch, heads, seq, head_dim]` with tables from
/// [`rope_tables`] (sliced to `seq`).
pub fn rope<B: Backend>(x: Tensor<B, 4>, cos: Tensor<B, 2>, sin: Tensor<B, 2>) -> Tensor<B, 4> {
    let [_, _, _, head_dim] = x.dims();
    let half = head_dim / 2;
    let dtype = x.dtype();
    let x1 = x.clone().narrow(3, 0, half);
    let x2 = x.clone().narrow(3, half, half);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    let cos = cos.cast(dtype).unsqueeze::<4>();
    let sin = sin.cast(dtype).unsqueeze::<4>();
    x * cos + rotated * sin
}

/// Causal self-attention with grouped-query heads.
///
/// `q: [batch, heads, seq, head_dim]`, `k`/`v: [batch, kv_heads, seq, head_dim]`; each key/value
/// head serves `heads / kv_heads` query heads. Softmax runs in f32. This path stores the
/// `seq x seq` scores; on CUDA in bf16 the flash kernels run instead (see [`crate::fast`]).
pub fn causal_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
) -> Tensor<B, 4> {
    if let Some(o) = crate::fast::causal_attention(&q, &k, &v) {
        return o;
    }
    let [batch, heads, seq, head_dim] = q.dims();
    let kv_heads = k.dims()[1];
    let group = heads / kv_heads;
    let expand = |t: Tensor<B, 4>| {
        if group == 1 {
            t
        } else {
            t.unsqueeze_dim::<5>(2)
                .expand([batch, kv_heads, group, seq, head_dim])
                .reshape([batch, heads, seq, head_dim])
        }
    };
    let (k, v) = (expand(k), expand(v));
    let dtype = q.dtype();
    let scores = q.matmul(k.swap_dims(2, 3)).cast(DType::F32) / (head_dim as f64).sqrt();
    // Key j is hidden from query i when j > i. Built from index comparisons because Burn's
    // `triu_mask` marks the complement of what its name suggests; applied as an additive bias
    // (-1e30 underflows to 0 in exp) so no row is ever all -inf.
    let device = scores.device();
    let idx = Tensor::<B, 1, Int>::arange(0..seq as i64, &device);
    let future: Tensor<B, 2, Bool> = idx
        .clone()
        .unsqueeze_dim::<2>(0)
        .greater(idx.unsqueeze_dim::<2>(1));
    let bias = Tensor::<B, 2>::zeros([seq, seq], &device).mask_fill(future, -1e30);
    let scores = scores + bias.cast(DType::F32).unsqueeze::<4>();
    softmax(scores, 3).cast(dtype).matmul(v)
}

/// The SwiGLU gate: `silu(gate) * up`.
pub fn swiglu<B: Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    silu(gate) * up
}

/// Mean cross-entropy of `logits: [tokens, vocab]` against `targets: [tokens]`, with the
/// log-softmax in f32.
pub fn cross_entropy<B: Backend>(logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
    let [tokens, _] = logits.dims();
    let logp = log_softmax(logits.cast(DType::F32), 1);
    let picked = logp.gather(1, targets.reshape([tokens, 1]));
    picked.mean().neg()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;
    use burn_ndarray::NdArray;

    type B = NdArray<f32>;

    #[test]
    fn rms_norm_matches_formula() {
        let dev = Default::default();
        let x = Tensor::<B, 2>::from_data(TensorData::from([[1.0f32, 2.0, 3.0, 4.0]]), &dev);
        let w = Tensor::<B, 1>::from_floats([1.0, 1.0, 2.0, 2.0], &dev);
        let y: Vec<f32> = rms_norm(x, w, 1e-6).into_data().to_vec().unwrap();
        let rms = ((1.0f32 + 4.0 + 9.0 + 16.0) / 4.0 + 1e-6).sqrt();
        let want = [1.0 / rms, 2.0 / rms, 6.0 / rms, 8.0 / rms];
        for (a, b) in y.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let dev = Default::default();
        let x = Tensor::<B, 4>::random([1, 2, 5, 8], burn::tensor::Distribution::Default, &dev);
        let (cos, sin) = rope_tables::<B>(5, 8, 10000.0, &dev);
        let y = rope(x.clone(), cos, sin);
        let x0: Vec<f32> = x.clone().narrow(2, 0, 1).into_data().to_vec().unwrap();
        let y0: Vec<f32> = y.clone().narrow(2, 0, 1).into_data().to_vec().unwrap();
        assert_eq!(x0, y0);
        let nx: f32 = x.square().sum().into_scalar();
        let ny: f32 = y.square().sum().into_scalar();
        assert!(
            (nx - ny).abs() < 1e-4 * nx,
            "rotation changed the norm: {nx} vs {ny}"
        );
    }

    #[test]
    fn attention_is_causal() {
        let dev = Default::default();
        let q = Tensor::<B, 4>::random([1, 4, 6, 8], burn::tensor::Distribution::Default, &dev);
        let k = Tensor::<B, 4>::random([1, 2, 6, 8], burn::tensor::Distribution::Default, &dev);
        let v = Tensor::<B, 4>::random([1, 2, 6, 8], burn::tensor::Distribution::Default, &dev);
        let full = causal_attention(q.clone(), k.clone(), v.clone());
        // The first 3 outputs may only depend on the first 3 keys and values.
        let short = causal_attention(q.narrow(2, 0, 3), k.narrow(2, 0, 3), v.narrow(2, 0, 3));
        let a: Vec<f32> = full.narrow(2, 0, 3).into_data().to_vec().unwrap();
        let b: Vec<f32> = short.into_data().to_vec().unwrap();
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-5);
        }
    }

    #[test]
    fn cross_entropy_of_uniform_logits_is_log_vocab() {
        let dev = Default::default();
        let logits = Tensor::<B, 2>::zeros([3, 10], &dev);
        let targets = Tensor::<B, 1, Int>::from_ints([1, 5, 9], &dev);
        let loss: f32 = cross_entropy(logits, targets).into_scalar();
        assert!((loss - 10f32.ln()).abs() < 1e-6);
    }
}
