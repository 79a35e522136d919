//! Reference implementations of the transformer ops, written with Burn's stock tensor ops.
//!
//! They define the semantics every fused kernel must match, run on every backend (CPU tests keep
//! them honest in CI), and differentiate through Burn's autodiff. Conventions follow Hugging
//! Face's Llama so that checkpoints and logits carry over unchanged.

use std::any::TypeId;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::{
    Bool, DType, IndexingUpdateOp, Int, Tensor, TensorPrimitive,
    activation::{log_softmax, silu, softmax},
    backend::Backend,
};
use burn_ndarray::NdArray;

/// `x @ w^T` for a weight stored as `[out_features, in_features]` (PyTorch's layout), so
/// Hugging Face weights need no transpose on import or export. On CUDA this runs through
/// cuBLAS (see [`crate::fast`]).
pub fn linear<B: Backend, const D: usize>(x: Tensor<B, D>, weight: Tensor<B, 2>) -> Tensor<B, D> {
    if let Some(y) = crate::fast::linear(&x, &weight) {
        return y;
    }
    x.matmul(weight.transpose().unsqueeze())
}

/// [`linear`] with FP8 GEMMs when the installed [`crate::KernelConfig::fp8`] recipe asks for
/// them and the backend, device, dtypes and shapes allow ([`crate::cuda::fp8`]); otherwise
/// exactly [`linear`]. `layer` names the layer across steps (its weight's id): delayed scaling
/// keeps its amax histories under it. The parallel linear layers of [`crate::tp::layers`] take
/// this path, so a transformer block's projections run in FP8 while the LM head (through
/// [`linear_cross_entropy`]) and everything else keep their dtype, as Transformer Engine's
/// recipes do.
pub fn linear_fp8<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    layer: burn::module::ParamId,
) -> Tensor<B, D> {
    if let Some(y) = crate::fast::linear_fp8(&x, &weight, layer) {
        return y;
    }
    linear(x, weight)
}

/// `weight[ids]`: rows of a `[vocab, dim]` table for `[batch, seq]` token ids. On CUDA with
/// autodiff the table's gradient comes from one deterministic kernel (see [`crate::fast`]).
pub fn embedding<B: Backend>(weight: Tensor<B, 2>, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    if let Some(y) = crate::fast::embedding(&weight, &ids) {
        return y;
    }
    burn::tensor::module::embedding(weight, ids)
}

/// RMSNorm as Llama computes it: the mean square in f32, then scaled by `weight`.
pub fn rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    if let Some(y) = crate::fast::rms_norm(&x, &weight, eps) {
        return y;
    }
    let dtype = x.dtype();
    let x32 = x.cast(DType::F32);
    // `powf_scalar(-0.5)`, not `sqrt().recip()`: Burn's CPU backend computes `recip` with a
    // SIMD estimate (3.7e-4 relative error on AVX2), a power exactly.
    let inv_rms = (x32.clone().square().mean_dim(D - 1) + eps).powf_scalar(-0.5);
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
    if let Some(y) = crate::fast::rope(&x, &cos, &sin) {
        return y;
    }
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
/// Under selective recomputation it keeps its result in a layer's forward and takes it back in
/// the layer's recomputation ([`crate::selective`]).
pub fn causal_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
) -> Tensor<B, 4> {
    if let Some(o) = crate::fast::causal_attention(&q, &k, &v) {
        return o;
    }
    let o = reference_causal_attention(q, k, v);
    // Selective recomputation (see [`crate::selective`]): this path recomputes attention to
    // differentiate it, and takes the value the layer's forward kept.
    if crate::selective::recording() {
        crate::selective::keep(o.clone());
    } else if let Some(kept) = crate::selective::take::<Tensor<B, 4>>() {
        if kept.dims() == o.dims() {
            return kept.detach() + (o.clone() - o.detach());
        }
        crate::selective::mismatch();
    }
    o
}

/// Each key/value head repeated for the `heads / kv_heads` query heads it serves.
fn expand_kv<B: Backend>(t: Tensor<B, 4>, heads: usize) -> Tensor<B, 4> {
    let [batch, kv_heads, seq, head_dim] = t.dims();
    let group = heads / kv_heads;
    if group == 1 {
        return t;
    }
    t.unsqueeze_dim::<5>(2)
        .expand([batch, kv_heads, group, seq, head_dim])
        .reshape([batch, heads, seq, head_dim])
}

/// Causal attention's probabilities in f32, `[batch, heads, seq, seq]`, from `q` and keys
/// already expanded to the query heads.
fn causal_probabilities<B: Backend>(q: Tensor<B, 4>, k: Tensor<B, 4>) -> Tensor<B, 4> {
    let [_, _, seq, head_dim] = q.dims();
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
    softmax(scores + bias.cast(DType::F32).unsqueeze::<4>(), 3)
}

/// Attention and its gradients in f64 on the host: the reference the f32 paths are tested
/// against. Burn's autodiff through `softmax` is no such reference: on some CPUs (an AMD EPYC
/// with AVX2) its input gradient is 2e-4 of the largest off the exact one, where an f32
/// computation of these sizes is within 1e-6.
#[cfg(test)]
pub(crate) mod exact {
    /// `[batch, heads, kv_heads, seq, head_dim]`: `q` and the output gradient have `heads`
    /// heads, `k` and `v` have `kv_heads`, each serving `heads / kv_heads` query heads in turn.
    pub(crate) type Shape = [usize; 5];

    /// `[o, dq, dk, dv]` of softmax attention for the output gradient `d_o`, all row-major
    /// `[batch, heads, seq, head_dim]` (`dk`, `dv` with `kv_heads` heads); query `i` of batch
    /// row `r` sees key `j` where `visible(r, i, j)`, and every query must see one key.
    pub(crate) fn attention(
        [q, k, v, d_o]: [&[f32]; 4],
        [batch, heads, kv_heads, seq, dim]: Shape,
        visible: impl Fn(usize, usize, usize) -> bool,
    ) -> [Vec<f32>; 4] {
        let scale = 1.0 / (dim as f64).sqrt();
        let group = heads / kv_heads;
        let row = |t: &[f32], n: usize, heads: usize, h: usize, i: usize| {
            let at = ((n * heads + h) * seq + i) * dim;
            t[at..at + dim]
                .iter()
                .map(|&x| x as f64)
                .collect::<Vec<f64>>()
        };
        let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
        let mut o = vec![0f64; batch * heads * seq * dim];
        let mut dq = vec![0f64; o.len()];
        let mut dk = vec![0f64; batch * kv_heads * seq * dim];
        let mut dv = vec![0f64; dk.len()];
        for n in 0..batch {
            for h in 0..heads {
                let hk = h / group;
                let keys: Vec<_> = (0..seq).map(|j| row(k, n, kv_heads, hk, j)).collect();
                let values: Vec<_> = (0..seq).map(|j| row(v, n, kv_heads, hk, j)).collect();
                for i in 0..seq {
                    let qi = row(q, n, heads, h, i);
                    let gi = row(d_o, n, heads, h, i);
                    let seen: Vec<usize> = (0..seq).filter(|&j| visible(n, i, j)).collect();
                    assert!(!seen.is_empty(), "query {i} of row {n} sees no key");
                    let scores: Vec<f64> =
                        seen.iter().map(|&j| dot(&qi, &keys[j]) * scale).collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    let p: Vec<f64> = weights.iter().map(|w| w / total).collect();
                    let out = ((n * heads + h) * seq + i) * dim;
                    for (&j, &pj) in seen.iter().zip(&p) {
                        for c in 0..dim {
                            o[out + c] += pj * values[j][c];
                        }
                    }
                    let delta = dot(&gi, &o[out..out + dim]);
                    for (&j, &pj) in seen.iter().zip(&p) {
                        let ds = pj * (dot(&gi, &values[j]) - delta) * scale;
                        let kv_at = ((n * kv_heads + hk) * seq + j) * dim;
                        for c in 0..dim {
                            dq[out + c] += ds * keys[j][c];
                            dk[kv_at + c] += ds * qi[c];
                            dv[kv_at + c] += pj * gi[c];
                        }
                    }
                }
            }
        }
        [o, dq, dk, dv].map(|t| t.into_iter().map(|x| x as f32).collect())
    }
}

/// [`causal_attention`]'s arithmetic alone: no fast path, no selective recomputation.
pub(crate) fn reference_causal_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
) -> Tensor<B, 4> {
    let heads = q.dims()[1];
    let dtype = q.dtype();
    let p = causal_probabilities(q, expand_kv(k, heads));
    p.cast(dtype).matmul(expand_kv(v, heads))
}

/// The gradients `[dq, dk, dv]` of [`reference_causal_attention`] for the output gradient
/// `d_o`, given its output `o`: the flash backward's arithmetic (`dS = P * (dP - rowsum(dO * O))`)
/// with the `seq x seq` probabilities recomputed whole.
pub(crate) fn reference_causal_attention_backward<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    o: Tensor<B, 4>,
    d_o: Tensor<B, 4>,
) -> [Tensor<B, 4>; 3] {
    let [batch, heads, seq, head_dim] = q.dims();
    let kv_heads = k.dims()[1];
    let dtype = q.dtype();
    // Divided as the forward divides the scores (a scalar multiply by the reciprocal rounds
    // differently).
    let root = (head_dim as f64).sqrt();
    let (k, v) = (expand_kv(k, heads), expand_kv(v, heads));
    let p = causal_probabilities(q.clone(), k.clone());
    let dv = p.clone().cast(dtype).swap_dims(2, 3).matmul(d_o.clone());
    let dp = d_o.clone().matmul(v.swap_dims(2, 3)).cast(DType::F32);
    let delta = (d_o.cast(DType::F32) * o.cast(DType::F32)).sum_dim(3);
    let ds = (p * (dp - delta)).cast(dtype);
    let dq = ds.clone().matmul(k) / root;
    let dk = ds.swap_dims(2, 3).matmul(q) / root;
    // A key/value head's gradient is the sum over the query heads it serves.
    let fold = |t: Tensor<B, 4>| {
        if kv_heads == heads {
            return t;
        }
        t.reshape([batch, kv_heads, heads / kv_heads, seq, head_dim])
            .sum_dim(2)
            .reshape([batch, kv_heads, seq, head_dim])
    };
    [dq, fold(dk), fold(dv)]
}

/// [`causal_attention`] inside each document of `documents` (FlashAttention's varlen, a
/// "block-causal" mask): query `i` sees key `j` when `j <= i` and both lie in the same document.
///
/// Each document runs on its own slice of the row (through the flash kernels on CUDA), so the
/// work is the documents' causal triangles, not the row's; without packing this is
/// [`causal_attention`]. Shapes as there; `documents` must describe `[batch, seq]` (checked by
/// the engine before any unit runs). On `Autodiff<NdArray<f32>>` and the CUDA autodiff backends
/// the documents are one autodiff op whose backward writes each document's gradients into one
/// whole-row gradient per input; elsewhere the rows are cut with Burn's `narrow`, whose backward
/// makes a whole-row gradient per document.
pub fn causal_attention_in_documents<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    documents: &crate::documents::Documents,
) -> Tensor<B, 4> {
    if !documents.is_packed() {
        return causal_attention(q, k, v);
    }
    if let Some(o) = crate::fast::causal_attention_in_documents(&q, &k, &v, documents) {
        return o;
    }
    if TypeId::of::<B>() == TypeId::of::<Autodiff<NdArray<f32>>>() {
        return crate::downcast::same(crate::packed_attention::attention_in_documents::<
            NdArray<f32>,
            _,
        >(
            crate::packed_attention::ReferenceKernel,
            crate::downcast::same(q),
            crate::downcast::same(k),
            crate::downcast::same(v),
            documents,
        ));
    }
    let rows = (0..documents.batch())
        .map(|r| {
            let row = |t: &Tensor<B, 4>| t.clone().narrow(0, r, 1);
            let (q, k, v) = (row(&q), row(&k), row(&v));
            let spans: Vec<_> = documents
                .spans(r)
                .map(|s| {
                    let span = |t: &Tensor<B, 4>| t.clone().narrow(2, s.start, s.len());
                    causal_attention(span(&q), span(&k), span(&v))
                })
                .collect();
            Tensor::cat(spans, 2)
        })
        .collect();
    Tensor::cat(rows, 0)
}

/// [`rope`] with each document's positions counted from its start (Hugging Face's packed
/// `position_ids`, Megatron's `reset_position_ids`), so a packed document is encoded as it would
/// be alone. Each of `xs: [batch, heads, seq, head_dim]` (queries and keys, whose head counts may
/// differ) is rotated with the same per-row tables, cut once from `cos`/`sin` ([`rope_tables`],
/// at least as long as the longest document).
pub fn rope_in_documents<B: Backend, const N: usize>(
    xs: [Tensor<B, 4>; N],
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    documents: &crate::documents::Documents,
) -> [Tensor<B, 4>; N] {
    if !documents.is_packed() {
        let seq = documents.seq_len();
        let (cos, sin) = (cos.narrow(0, 0, seq), sin.narrow(0, 0, seq));
        return xs.map(|x| rope(x, cos.clone(), sin.clone()));
    }
    // One table per row, cut from the shared one: a rope launch per row and tensor, whatever
    // the number of documents.
    let table = |t: &Tensor<B, 2>, r: usize| {
        Tensor::cat(
            documents
                .spans(r)
                .map(|s| t.clone().narrow(0, 0, s.len()))
                .collect(),
            0,
        )
    };
    let tables: Vec<_> = (0..documents.batch())
        .map(|r| (table(&cos, r), table(&sin, r)))
        .collect();
    xs.map(|x| {
        let rows = tables
            .iter()
            .enumerate()
            .map(|(r, (cos, sin))| rope(x.clone().narrow(0, r, 1), cos.clone(), sin.clone()))
            .collect();
        Tensor::cat(rows, 0)
    })
}

/// The SwiGLU gate: `silu(gate) * up`.
pub fn swiglu<B: Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    if let Some(y) = crate::fast::swiglu(&gate, &up) {
        return y;
    }
    silu(gate) * up
}

/// The target of a position that is not scored: PyTorch's `ignore_index` default and Hugging
/// Face's label for prompt, padding and cross-document tokens. Such a position adds nothing to
/// the loss or to any gradient, and the mean is over the other positions. The loss functions of
/// this crate treat every negative target alike.
pub const IGNORE_INDEX: i64 = -100;

/// What the losses need to skip ignored targets: the targets with each ignored one replaced by
/// 0 (a row every gather can read), whether each position is scored (f32 1 or 0), and the mean's
/// divisor, the scored count but at least 1, so that a micro-batch with nothing to score has
/// loss 0 and zero gradients rather than NaN. The divisor stays on the device: counting on the
/// host would make it wait for the data.
pub(crate) fn scored_targets<B: Backend>(
    targets: Tensor<B, 1, Int>,
) -> (Tensor<B, 1, Int>, Tensor<B, 1>, Tensor<B, 1>) {
    let scored = targets.clone().greater_equal_elem(0);
    let safe = targets.mask_fill(scored.clone().bool_not(), 0);
    let weight = scored.float().cast(DType::F32);
    let divisor = weight.clone().sum().clamp_min(1.0);
    (safe, weight, divisor)
}

/// Mean cross-entropy of `logits: [tokens, vocab]` against `targets: [tokens]`, with the
/// log-softmax in f32, over the positions whose target is not [`IGNORE_INDEX`].
pub fn cross_entropy<B: Backend>(logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
    let [tokens, _] = logits.dims();
    let (safe, scored, divisor) = scored_targets(targets);
    let logp = log_softmax(logits.cast(DType::F32), 1);
    let picked = logp.gather(1, safe.reshape([tokens, 1])).reshape([tokens]);
    (picked * scored).sum().div(divisor).neg()
}

/// Mean cross-entropy of the logits `x @ weight^T` against `targets`, with `x: [tokens, hidden]`
/// and `weight: [vocab, hidden]` (the LM head); the same value as
/// `cross_entropy(linear(x, weight), targets)`.
///
/// The logits of a Llama batch are its largest activation (4096 tokens x 32000 vocab is 512 MiB
/// in f32, and the reference keeps several such tensors for its backward). Where the backend
/// allows (see [`crate::fast`], switch `loss`), this runs [`linear_cross_entropy_chunked`]
/// instead, which never holds more than one chunk of logits.
pub fn linear_cross_entropy<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
) -> Tensor<B, 1> {
    if let Some(loss) = fast_linear_cross_entropy(&x, &weight, &targets) {
        return loss;
    }
    cross_entropy(linear(x, weight), targets)
}

/// Bytes of logits one chunk of [`linear_cross_entropy_chunked`] may hold by default.
pub const LOSS_CHUNK_BYTES: usize = 256 << 20;

/// Tokens per chunk so that a chunk's f32 logits stay within [`LOSS_CHUNK_BYTES`]; a multiple
/// of 64 where that is possible, so the chunk GEMMs keep tile-friendly shapes.
pub fn default_loss_chunk_tokens(vocab: usize) -> usize {
    loss_chunk_tokens(vocab, 4)
}

/// Tokens per chunk so that a chunk's logits, at `bytes_per_logit` each, stay within
/// [`LOSS_CHUNK_BYTES`] (a multiple of 64 where possible). The fused CUDA softmax
/// ([`crate::cuda::xent`]) never makes an f32 copy of bf16 logits, so its chunks can hold twice
/// the tokens: one chunk for a 4,096-token micro-batch of a 32,000-word vocabulary, which also
/// spares the f32 accumulation of the head's gradient across chunks (a cast and an add over the
/// whole `[vocab, hidden]` matrix per chunk).
pub fn loss_chunk_tokens(vocab: usize, bytes_per_logit: usize) -> usize {
    let tokens = (LOSS_CHUNK_BYTES / (vocab.max(1) * bytes_per_logit.max(1))).max(1);
    if tokens >= 64 {
        tokens / 64 * 64
    } else {
        tokens
    }
}

/// [`linear_cross_entropy`] computed `chunk_tokens` tokens at a time (the last chunk may be
/// shorter), with the log-softmax in f32.
///
/// On `Autodiff<NdArray<f32>>` and `Autodiff<CudaCube>` this is one autodiff op
/// ([`linear_cross_entropy_autodiff`]) that saves only `x`, `weight`, `targets` and the per-token
/// log-sum-exp and recomputes each chunk's logits in the backward. On a backend without
/// autodiff it is the chunked forward alone. On other autodiff backends it is the same chunked
/// forward through their stock differentiable ops: the same values, but the graph keeps every
/// chunk's intermediates (call [`linear_cross_entropy_autodiff`] directly to save the memory).
///
/// # Panics
/// If `chunk_tokens` is 0, or on mismatched shapes.
pub fn linear_cross_entropy_chunked<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    chunk_tokens: usize,
) -> Tensor<B, 1> {
    check_lce_shapes(&x, &weight, &targets, chunk_tokens);
    if let Some(loss) = lce_autodiff(&x, &weight, &targets, chunk_tokens) {
        return loss;
    }
    lce_forward(x, weight, targets, chunk_tokens, false).0
}

fn check_lce_shapes<B: Backend>(
    x: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    targets: &Tensor<B, 1, Int>,
    chunk_tokens: usize,
) {
    let [tokens, hidden] = x.dims();
    let [_, w_hidden] = weight.dims();
    assert!(
        chunk_tokens > 0,
        "linear_cross_entropy: chunk_tokens must be positive"
    );
    assert!(
        hidden == w_hidden && targets.dims() == [tokens],
        "linear_cross_entropy: x {:?}, weight {:?} and targets {:?} do not match \
         ([tokens, hidden], [vocab, hidden], [tokens])",
        x.dims(),
        weight.dims(),
        targets.dims()
    );
}

/// Token ranges of the chunks.
fn chunks(tokens: usize, chunk_tokens: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..tokens)
        .step_by(chunk_tokens)
        .map(move |start| (start, chunk_tokens.min(tokens - start)))
}

/// The sum of a 1-D f32 tensor, the same bits every run: Burn's `sum` adds with atomics on
/// CUDA, in an order that changes between runs, where the two-pass reduction of
/// [`crate::fast::weighted_sum`] serves. Used for the reported losses, so that a
/// deterministic run repeats them exactly.
pub(crate) fn repeatable_sum<B: Backend>(t: Tensor<B, 1>) -> Tensor<B, 1> {
    let [len] = t.dims();
    crate::fast::weighted_sum(&t, &[(0..len, 1.0)]).unwrap_or_else(|| t.sum())
}

/// The chunked forward: the mean loss (`[1]`, f32) and, when `keep_lse`, the per-token
/// log-sum-exp of the logits (`[tokens]`, f32) that the backward needs, and with it the logits
/// themselves when one chunk holds every token (the backward then skips recomputing them).
#[allow(clippy::type_complexity)]
fn lce_forward<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    chunk_tokens: usize,
    keep_lse: bool,
) -> (Tensor<B, 1>, Option<Tensor<B, 1>>, Option<Tensor<B, 2>>) {
    let [tokens, _] = x.dims();
    let (safe, scored, divisor) = scored_targets(targets.clone());
    let single_chunk = tokens <= chunk_tokens;
    let mut kept_logits = None;
    let mut total: Option<Tensor<B, 1>> = None;
    let mut lses = Vec::new();
    for (start, len) in chunks(tokens, chunk_tokens) {
        // The logits in the input dtype (as `linear` returns them), then f32 as the reference.
        let logits = linear(x.clone().narrow(0, start, len), weight.clone());
        if keep_lse && single_chunk {
            kept_logits = Some(logits.clone());
        }
        // The fused kernel reads the targets as they are (an ignored one scores 0).
        let t = targets.clone().narrow(0, start, len);
        let (lse, sum) = match crate::fast::xent_row_stats(&logits, &t) {
            Some((lse, loss)) => (lse, repeatable_sum(loss)),
            None => {
                let logits = logits.cast(DType::F32);
                let t = safe.clone().narrow(0, start, len);
                let picked = logits.clone().gather(1, t.reshape([len, 1])).reshape([len]);
                let max = logits.clone().max_dim(1);
                let lse = ((logits - max.clone()).exp().sum_dim(1).log() + max).reshape([len]);
                let sum = ((lse.clone() - picked) * scored.clone().narrow(0, start, len)).sum();
                (lse, sum)
            }
        };
        total = Some(match total {
            None => sum,
            Some(acc) => acc + sum,
        });
        if keep_lse {
            lses.push(lse);
        }
    }
    let loss = total.expect("at least one token").div(divisor);
    let lse = keep_lse.then(|| {
        if lses.len() == 1 {
            lses.pop().expect("one chunk")
        } else {
            Tensor::cat(lses, 0)
        }
    });
    (loss, lse, kept_logits)
}

/// The chunked backward: recomputes each chunk's logits, forms
/// `g = (softmax - onehot(target)) * grad / scored` in f32 (zero on ignored rows), rounds it to
/// the weight's dtype (as
/// the reference's cast does) and runs the two GEMMs `dx = g W`, `dW += g^T x`. `dW` is summed
/// over chunks in f32 when the weight is of lower precision.
#[allow(clippy::too_many_arguments)]
fn lce_backward<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    lse: Tensor<B, 1>,
    mut kept_logits: Option<Tensor<B, 2>>,
    grad: Tensor<B, 1>,
    chunk_tokens: usize,
    want_dx: bool,
    want_dw: bool,
) -> (Option<Tensor<B, 2>>, Option<Tensor<B, 2>>) {
    let [tokens, _] = x.dims();
    let dtype = weight.dtype();
    let device = x.device();
    let n_chunks = tokens.div_ceil(chunk_tokens);
    let accumulate_f32 = n_chunks > 1 && dtype != DType::F32;
    let (safe, scored, divisor) = scored_targets(targets.clone());
    let scale = (grad.cast(DType::F32) / divisor).reshape([1, 1]);
    let mut dxs = Vec::with_capacity(n_chunks);
    let mut dw: Option<Tensor<B, 2>> = None;
    for (start, len) in chunks(tokens, chunk_tokens) {
        let xc = x.clone().narrow(0, start, len);
        let logits = match kept_logits.take() {
            Some(l) if n_chunks == 1 => l,
            _ => linear(xc.clone(), weight.clone()),
        };
        let lse_c = lse.clone().narrow(0, start, len);
        let t = targets.clone().narrow(0, start, len);
        let fused = (logits.dtype() == dtype)
            .then(|| crate::fast::xent_softmax_grad(&logits, &lse_c, &t, &scale))
            .flatten();
        let g = fused.unwrap_or_else(|| {
            let minus_one = Tensor::<B, 2>::full([len, 1], -1.0, (&device, DType::F32));
            let t = safe.clone().narrow(0, start, len).reshape([len, 1]);
            let row_scale = scored.clone().narrow(0, start, len).reshape([len, 1]) * scale.clone();
            (logits.cast(DType::F32) - lse_c.reshape([len, 1]))
                .exp()
                .scatter(1, t, minus_one, IndexingUpdateOp::Add)
                .mul(row_scale)
                .cast(dtype)
        });
        let (dx_c, dw_c) = linear_grads(g, xc, weight.clone(), want_dx, want_dw);
        if let Some(dx_c) = dx_c {
            dxs.push(dx_c);
        }
        if let Some(dw_c) = dw_c {
            let dw_c = if accumulate_f32 {
                dw_c.cast(DType::F32)
            } else {
                dw_c
            };
            dw = Some(match dw {
                None => dw_c,
                Some(acc) => acc + dw_c,
            });
        }
    }
    let dx = want_dx.then(|| {
        if dxs.len() == 1 {
            dxs.pop().expect("one chunk")
        } else {
            Tensor::cat(dxs, 0)
        }
    });
    let dw = dw.map(|d| if accumulate_f32 { d.cast(dtype) } else { d });
    (dx, dw)
}

/// The input gradients of `y = x w^T` for the upstream `dy`: `dx = dy w` and `dw = dy^T x`, as
/// requested; one ordered cuBLAS batch on CUDA (see [`crate::fast`]).
pub(crate) fn linear_grads<B: Backend>(
    dy: Tensor<B, 2>,
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    want_dx: bool,
    want_dw: bool,
) -> (Option<Tensor<B, 2>>, Option<Tensor<B, 2>>) {
    if let Some(grads) = crate::fast::linear_grads(&dy, &x, &w, want_dx, want_dw) {
        return grads;
    }
    let dx = want_dx.then(|| dy.clone().matmul(w));
    let dw = want_dw.then(|| dy.transpose().matmul(x));
    (dx, dw)
}

fn float_tensor<B: Backend, const D: usize>(p: B::FloatTensorPrimitive) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

#[derive(Debug)]
struct LinearCrossEntropyBackward;

impl<B: Backend> Backward<B, 2> for LinearCrossEntropyBackward {
    /// x, weight, targets, per-token log-sum-exp, the logits when one chunk held every token,
    /// tokens per chunk.
    type State = (
        B::FloatTensorPrimitive,
        B::FloatTensorPrimitive,
        B::IntTensorPrimitive,
        B::FloatTensorPrimitive,
        Option<B::FloatTensorPrimitive>,
        usize,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, w, targets, lse, logits, chunk_tokens) = ops.state;
        let x_dtype = burn::tensor::TensorMetadata::dtype(&x);
        let (dx, dw) = lce_backward::<B>(
            float_tensor(x),
            float_tensor(w),
            Tensor::from_primitive(targets),
            float_tensor(lse),
            logits.map(float_tensor),
            float_tensor(grad),
            chunk_tokens,
            node_x.is_some(),
            node_w.is_some(),
        );
        if let (Some(node), Some(dx)) = (node_x, dx) {
            grads.register::<B>(node.id, dx.cast(x_dtype).into_primitive().tensor());
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            grads.register::<B>(node.id, dw.into_primitive().tensor());
        }
    }
}

/// [`linear_cross_entropy_chunked`] as one op of Burn's autodiff on any backend `B`.
///
/// The forward saves `x`, `weight`, `targets` and the per-token log-sum-exp (f32, 4 bytes a
/// token) instead of the `[tokens, vocab]` logits and probabilities; the backward recomputes one
/// chunk of logits at a time (one more GEMM of the forward's size), so the loss's working memory
/// is one chunk's logits whatever the batch. When one chunk holds every token, the forward keeps
/// that chunk's logits (within the same budget) for the backward instead: the head's backward
/// follows its forward at once in training, so this costs no peak memory and spares the
/// recomputing GEMM (0.7 ms of a 1.2B model's step on an H200).
///
/// # Panics
/// As [`linear_cross_entropy_chunked`].
pub fn linear_cross_entropy_autodiff<B: Backend>(
    x: Tensor<Autodiff<B>, 2>,
    weight: Tensor<Autodiff<B>, 2>,
    targets: Tensor<Autodiff<B>, 1, Int>,
    chunk_tokens: usize,
) -> Tensor<Autodiff<B>, 1> {
    check_lce_shapes(&x, &weight, &targets, chunk_tokens);
    let targets = Tensor::<B, 1, Int>::from_primitive(targets.into_primitive());
    let x = x.into_primitive().tensor();
    let w = weight.into_primitive().tensor();
    let prep = <LinearCrossEntropyBackward as Backward<B, 2>>::prepare::<NoCheckpointing>(
        LinearCrossEntropyBackward,
        [x.node.clone(), w.node.clone()],
    );
    let out = match prep.compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let (loss, lse, logits) = lce_forward(
                float_tensor::<B, 2>(x.primitive.clone()),
                float_tensor::<B, 2>(w.primitive.clone()),
                targets.clone(),
                chunk_tokens,
                true,
            );
            let lse = lse.expect("kept for the backward");
            prep.finish(
                (
                    x.primitive,
                    w.primitive,
                    targets.into_primitive(),
                    lse.into_primitive().tensor(),
                    logits.map(|l| l.into_primitive().tensor()),
                    chunk_tokens,
                ),
                loss.into_primitive().tensor(),
            )
        }
        OpsKind::UnTracked(prep) => {
            let (loss, _, _) = lce_forward(
                float_tensor::<B, 2>(x.primitive),
                float_tensor::<B, 2>(w.primitive),
                targets,
                chunk_tokens,
                false,
            );
            prep.finish(loss.into_primitive().tensor())
        }
    };
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// `linear_cross_entropy` through the chunked loss ([`linear_cross_entropy_chunked`]
/// with [`default_loss_chunk_tokens`], or on CUDA with the fused softmax
/// [`loss_chunk_tokens`] at the logits' own size) on the backends it was checked on: the
/// CUDA backend and `NdArray<f32>`, each with and without autodiff. `None` means "use the
/// reference".
fn fast_linear_cross_entropy<B: Backend>(
    x: &Tensor<B, 2>,
    w: &Tensor<B, 2>,
    targets: &Tensor<B, 1, Int>,
) -> Option<Tensor<B, 1>> {
    let [tokens, _] = x.dims();
    let [vocab, _] = w.dims();
    let b = TypeId::of::<B>();
    let on_ndarray =
        b == TypeId::of::<Autodiff<NdArray<f32>>>() || b == TypeId::of::<NdArray<f32>>();
    let on_cuda = crate::fast::is_cuda::<B>();
    if !crate::fast::fast_paths().loss
        || tokens == 0
        || x.dtype() != w.dtype()
        || !(on_cuda || on_ndarray)
    {
        return None;
    }
    let chunk_tokens = if on_cuda && crate::fast::fast_paths().xent {
        loss_chunk_tokens(vocab, x.dtype().size())
    } else {
        default_loss_chunk_tokens(vocab)
    };
    Some(linear_cross_entropy_chunked(
        x.clone(),
        w.clone(),
        targets.clone(),
        chunk_tokens,
    ))
}

/// The chunked loss as one autodiff op ([`linear_cross_entropy_autodiff`]) when `B` is
/// `Autodiff<I>` for an inner backend `I` we can name: the CUDA backend or `NdArray<f32>`. Rust
/// cannot name the inner backend of an arbitrary `B`, hence the list.
fn lce_autodiff<B: Backend>(
    x: &Tensor<B, 2>,
    w: &Tensor<B, 2>,
    targets: &Tensor<B, 1, Int>,
    chunk_tokens: usize,
) -> Option<Tensor<B, 1>> {
    fn on<B: Backend, I: Backend>(
        x: &Tensor<B, 2>,
        w: &Tensor<B, 2>,
        targets: &Tensor<B, 1, Int>,
        chunk_tokens: usize,
    ) -> Option<Tensor<B, 1>> {
        (TypeId::of::<B>() == TypeId::of::<Autodiff<I>>()).then(|| {
            crate::downcast::same(linear_cross_entropy_autodiff::<I>(
                crate::downcast::same(x.clone()),
                crate::downcast::same(w.clone()),
                crate::downcast::same(targets.clone()),
                chunk_tokens,
            ))
        })
    }
    #[cfg(feature = "cuda")]
    if let Some(loss) = on::<B, crate::cuda::CudaCube>(x, w, targets, chunk_tokens)
        .or_else(|| on::<B, crate::cuda::bridge::FusedCuda>(x, w, targets, chunk_tokens))
    {
        return Some(loss);
    }
    on::<B, NdArray<f32>>(x, w, targets, chunk_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_loss_op_serves_autodiff_ndarray_only() {
        type B = burn_ndarray::NdArray<f32>;
        let dev = Default::default();
        let t = Tensor::<B, 1, Int>::from_ints([0, 2], &dev);
        let x = Tensor::<B, 2>::ones([2, 3], &dev);
        let w = Tensor::<B, 2>::ones([4, 3], &dev);
        // The plain backend has no autodiff op; its chunked forward is called directly.
        assert!(lce_autodiff(&x, &w, &t, 1).is_none());
        type Ad = Autodiff<B>;
        let xa = Tensor::<Ad, 2>::from_inner(x).require_grad();
        let wa = Tensor::<Ad, 2>::from_inner(w).require_grad();
        let ta = Tensor::<Ad, 1, Int>::from_inner(t);
        assert!(lce_autodiff(&xa, &wa, &ta, 1).is_some());
    }
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

    /// Packed attention against the exact block-causal attention (output and the gradients of
    /// q, k and v) and against each document padded into a row of its own.
    #[test]
    fn attention_stays_inside_documents() {
        let dev = Default::default();
        let rand =
            |h| Tensor::<B, 4>::random([2, h, 9, 8], burn::tensor::Distribution::Default, &dev);
        let (q, k, v) = (rand(4), rand(2), rand(2));
        let documents = crate::Documents::from_lengths(9, vec![vec![4, 2, 3], vec![1, 8]]).unwrap();
        let doc_of = |r: usize, i: usize| documents.spans(r).position(|s| s.contains(&i));
        let track = |t: &Tensor<B, 4>| Tensor::<Ad, 4>::from_inner(t.clone()).require_grad();
        let (qa, ka, va) = (track(&q), track(&k), track(&v));
        let got = causal_attention_in_documents(qa.clone(), ka.clone(), va.clone(), &documents);
        // A weighted sum, so every output position's gradient differs.
        let weights = rand(4);
        let grads = (got.clone() * Tensor::from_inner(weights.clone()))
            .sum()
            .backward();
        let want = exact::attention(
            [
                &host(q.clone()),
                &host(k.clone()),
                &host(v.clone()),
                &host(weights),
            ],
            [2, 4, 2, 9, 8],
            |r, i, j| j <= i && doc_of(r, i) == doc_of(r, j),
        );
        let found = [
            host(got),
            host(qa.grad(&grads).unwrap()),
            host(ka.grad(&grads).unwrap()),
            host(va.grad(&grads).unwrap()),
        ];
        // f32 against f64: a few 1e-7 apart. A key of another document seen, or one missed,
        // moves them by 1e-1.
        for ((found, want), name) in found.iter().zip(&want).zip(["o", "dq", "dk", "dv"]) {
            let err = rel_err(found, want);
            assert!(err < 1e-5, "{name}: {err}");
        }
        // Each document alone, at the start of a zero-padded row: causality keeps the padding
        // out of its outputs.
        let packed = causal_attention_in_documents(q.clone(), k.clone(), v.clone(), &documents);
        for r in 0..2 {
            for span in documents.spans(r) {
                let pad = |t: &Tensor<B, 4>| {
                    let doc = t.clone().narrow(0, r, 1).narrow(2, span.start, span.len());
                    let [_, h, _, d] = doc.dims();
                    let zeros = Tensor::<B, 4>::zeros([1, h, 9 - span.len(), d], &dev);
                    Tensor::cat(vec![doc, zeros], 2)
                };
                let alone = causal_attention(pad(&q), pad(&k), pad(&v)).narrow(2, 0, span.len());
                let inside = packed
                    .clone()
                    .narrow(0, r, 1)
                    .narrow(2, span.start, span.len());
                assert!(
                    rel_err(&host(inside), &host(alone)) < 1e-6,
                    "row {r}, {span:?}"
                );
            }
        }
    }

    /// Positions restart at each document: a document's rotation equals its rotation alone.
    #[test]
    fn rope_restarts_in_each_document() {
        let dev = Default::default();
        let x = Tensor::<B, 4>::random([2, 3, 7, 8], burn::tensor::Distribution::Default, &dev);
        let (cos, sin) = rope_tables::<B>(7, 8, 10000.0, &dev);
        let documents = crate::Documents::from_lengths(7, vec![vec![3, 4], vec![7]]).unwrap();
        let [y] = rope_in_documents([x.clone()], cos.clone(), sin.clone(), &documents);
        for r in 0..2 {
            for span in documents.spans(r) {
                let n = span.len();
                let doc = x.clone().narrow(0, r, 1).narrow(2, span.start, n);
                let alone = rope(
                    doc,
                    cos.clone().narrow(0, 0, n),
                    sin.clone().narrow(0, 0, n),
                );
                let inside = y.clone().narrow(0, r, 1).narrow(2, span.start, n);
                assert_eq!(host(inside), host(alone), "row {r}, {span:?}");
            }
        }
        // Not packed: the plain rotation.
        let one = crate::Documents::from_lengths(7, vec![vec![7], vec![7]]).unwrap();
        let plain = rope(x.clone(), cos.clone(), sin.clone());
        let [y] = rope_in_documents([x], cos, sin, &one);
        assert_eq!(host(y), host(plain));
    }

    /// (max |a - b|) / max |b|, with the scale floored at 1 so near-zero references compare
    /// absolutely.
    fn rel_err(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        let scale = b.iter().map(|y| y.abs()).fold(1.0, f32::max);
        diff / scale
    }

    fn host<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
        t.into_data().convert::<f32>().to_vec().unwrap()
    }

    type Ad = burn::backend::Autodiff<B>;

    /// Inputs of an LM-head loss: x `[tokens, hidden]`, weight `[vocab, hidden]`, targets that
    /// cover the vocabulary's first and last ids.
    fn lce_inputs(
        tokens: usize,
        hidden: usize,
        vocab: usize,
    ) -> (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 1, Int>) {
        let dev = Default::default();
        // Fixed values (the backend's RNG is shared by parallel tests, so seeding it would not
        // make them repeatable): a run-to-run tolerance then means the same thing every run.
        let values = |n: usize, seed: u64, scale: f32| {
            let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    ((s % 2001) as f32 / 1000.0 - 1.0) * scale
                })
                .collect();
            v
        };
        let x = Tensor::<B, 2>::from_data(
            TensorData::new(values(tokens * hidden, 1, 1.5), [tokens, hidden]),
            &dev,
        );
        let w = Tensor::<B, 2>::from_data(
            TensorData::new(values(vocab * hidden, 2, 0.8), [vocab, hidden]),
            &dev,
        );
        let mut ids: Vec<i64> = (0..tokens).map(|i| ((i * 7 + 3) % vocab) as i64).collect();
        ids[tokens - 1] = vocab as i64 - 1;
        ids[0] = 0;
        let t = Tensor::<B, 1, Int>::from_ints(ids.as_slice(), &dev);
        (x, w, t)
    }

    /// Loss, dx and dW of `loss_fn` on the autodiff backend, with an upstream gradient of 2.5
    /// (`(loss * 2.5).backward()`) so that the scaling by the incoming gradient is exercised.
    fn loss_and_grads(
        x: &Tensor<B, 2>,
        w: &Tensor<B, 2>,
        t: &Tensor<B, 1, Int>,
        track_x: bool,
        loss_fn: impl Fn(Tensor<Ad, 2>, Tensor<Ad, 2>, Tensor<Ad, 1, Int>) -> Tensor<Ad, 1>,
    ) -> (f32, Option<Vec<f32>>, Vec<f32>) {
        let xa = Tensor::<Ad, 2>::from_inner(x.clone());
        let xa = if track_x { xa.require_grad() } else { xa };
        let wa = Tensor::<Ad, 2>::from_inner(w.clone()).require_grad();
        let loss = loss_fn(xa.clone(), wa.clone(), Tensor::from_inner(t.clone()));
        let value: f32 = loss.clone().inner().into_scalar();
        let grads = (loss * 2.5).backward();
        let dx = track_x.then(|| host(xa.grad(&grads).expect("dx")));
        (value, dx, host(wa.grad(&grads).expect("dw")))
    }

    fn reference_lce<Bk: Backend>(
        x: Tensor<Bk, 2>,
        w: Tensor<Bk, 2>,
        t: Tensor<Bk, 1, Int>,
    ) -> Tensor<Bk, 1> {
        cross_entropy(x.matmul(w.transpose()), t)
    }

    #[test]
    fn linear_cross_entropy_chunked_matches_reference() {
        // Odd token counts, chunks that divide them, do not, and exceed them.
        for (tokens, hidden, vocab) in [(7, 5, 11), (1, 3, 4), (33, 16, 50)] {
            let (x, w, t) = lce_inputs(tokens, hidden, vocab);
            let (want, want_dx, want_dw) = loss_and_grads(&x, &w, &t, true, reference_lce);
            for chunk in [1, 2, 3, tokens, tokens + 5] {
                let (got, got_dx, got_dw) = loss_and_grads(&x, &w, &t, true, |x, w, t| {
                    linear_cross_entropy_chunked(x, w, t, chunk)
                });
                let ctx = format!("tokens {tokens} vocab {vocab} chunk {chunk}");
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{ctx}: loss {got} vs {want}"
                );
                let e_dx = rel_err(&got_dx.unwrap(), want_dx.as_ref().unwrap());
                let e_dw = rel_err(&got_dw, &want_dw);
                assert!(
                    e_dx <= 1e-5 && e_dw <= 1e-5,
                    "{ctx}: dx {e_dx:e} dw {e_dw:e}"
                );
            }
        }
    }

    /// Positions whose target is `IGNORE_INDEX` add nothing: the loss and dW equal those of the
    /// other rows alone, their rows of dx are zero, on the reference and on the chunked op
    /// (chunks that hold only ignored rows included); with every target ignored the loss and
    /// the gradients are 0, not NaN.
    #[test]
    fn ignored_targets_are_left_out_of_the_loss() {
        let (tokens, hidden, vocab) = (11, 6, 13);
        let (x, w, t) = lce_inputs(tokens, hidden, vocab);
        let ignored = [0usize, 4, 5, 10];
        let kept: Vec<i64> = (0..tokens as i64)
            .filter(|i| !ignored.contains(&(*i as usize)))
            .collect();
        let dev = x.device();
        let kept_rows = Tensor::<B, 1, Int>::from_ints(kept.as_slice(), &dev);
        let (want, want_dx, want_dw) = loss_and_grads(
            &x.clone().select(0, kept_rows.clone()),
            &w,
            &t.clone().select(0, kept_rows),
            true,
            reference_lce,
        );
        let want_dx = want_dx.unwrap();
        let mut ids: Vec<i64> = t.into_data().to_vec().unwrap();
        for &i in &ignored {
            ids[i] = IGNORE_INDEX;
        }
        let masked = Tensor::<B, 1, Int>::from_ints(ids.as_slice(), &dev);
        type LossFn =
            Box<dyn Fn(Tensor<Ad, 2>, Tensor<Ad, 2>, Tensor<Ad, 1, Int>) -> Tensor<Ad, 1>>;
        let mut cases: Vec<(String, LossFn)> = vec![("reference".into(), Box::new(reference_lce))];
        for chunk in [1, 2, 3, tokens, tokens + 5] {
            cases.push((
                format!("chunk {chunk}"),
                Box::new(move |x, w, t| linear_cross_entropy_chunked(x, w, t, chunk)),
            ));
        }
        for (name, f) in &cases {
            let (got, got_dx, got_dw) = loss_and_grads(&x, &w, &masked, true, f);
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{name}: loss {got} vs {want}"
            );
            assert!(rel_err(&got_dw, &want_dw) <= 1e-5, "{name}: dW");
            let got_dx = got_dx.unwrap();
            let mut k = 0;
            for (row, got_row) in got_dx.chunks(hidden).enumerate() {
                if ignored.contains(&row) {
                    assert!(got_row.iter().all(|&v| v == 0.0), "{name}: dx row {row}");
                } else {
                    let want_row = &want_dx[k * hidden..(k + 1) * hidden];
                    assert!(rel_err(got_row, want_row) <= 1e-5, "{name}: dx row {row}");
                    k += 1;
                }
            }
            let none = Tensor::<B, 1, Int>::full([tokens], IGNORE_INDEX, &dev);
            let (zero, dx, dw) = loss_and_grads(&x, &w, &none, true, f);
            assert_eq!(zero, 0.0, "{name}: all ignored");
            assert!(
                dx.unwrap().iter().chain(&dw).all(|&v| v == 0.0),
                "{name}: all ignored, gradients"
            );
        }
    }

    #[test]
    fn linear_cross_entropy_weight_only_and_forward_only() {
        let (x, w, t) = lce_inputs(9, 6, 13);
        // Only the weight tracked (the input's gradient is skipped).
        let (want, _, want_dw) = loss_and_grads(&x, &w, &t, false, reference_lce);
        let (got, dx, got_dw) = loss_and_grads(&x, &w, &t, false, |x, w, t| {
            linear_cross_entropy_chunked(x, w, t, 4)
        });
        assert!(dx.is_none());
        assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0));
        assert!(rel_err(&got_dw, &want_dw) <= 1e-5);
        // The plain backend runs the chunked forward alone.
        let plain: f32 =
            linear_cross_entropy_chunked(x.clone(), w.clone(), t.clone(), 2).into_scalar();
        let reference: f32 = reference_lce(x, w, t).into_scalar();
        assert!((plain - reference).abs() <= 1e-5 * reference.abs().max(1.0));
    }

    #[test]
    fn linear_cross_entropy_dispatch_takes_the_chunked_op_on_cpu() {
        // With the default switches, `linear_cross_entropy` on Autodiff<NdArray> runs the
        // chunked op (one chunk here); it must agree with linear + cross_entropy.
        let (x, w, t) = lce_inputs(10, 8, 21);
        let (want, want_dx, want_dw) =
            loss_and_grads(&x, &w, &t, true, |x, w, t| cross_entropy(linear(x, w), t));
        let (got, got_dx, got_dw) = loss_and_grads(&x, &w, &t, true, linear_cross_entropy);
        assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0));
        assert!(rel_err(&got_dx.unwrap(), &want_dx.unwrap()) <= 1e-5);
        assert!(rel_err(&got_dw, &want_dw) <= 1e-5);
    }

    #[test]
    fn default_loss_chunk_keeps_logits_within_budget() {
        for vocab in [1, 1000, 32000, 32003, 128_256, 1 << 30] {
            let c = default_loss_chunk_tokens(vocab);
            assert!(c >= 1);
            assert!(
                c == 1 || c * vocab * 4 <= LOSS_CHUNK_BYTES,
                "vocab {vocab}: {c}"
            );
        }
        assert_eq!(default_loss_chunk_tokens(32000), 2048);
        assert_eq!(loss_chunk_tokens(32000, 2), 4160);
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
