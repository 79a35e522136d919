//! Causal attention inside packed documents as one autodiff op.
//!
//! Cutting `q`, `k` and `v` into documents with Burn's `narrow` makes each cut's backward a
//! zero tensor of the whole row with the document's gradient written into it, which the graph
//! then adds to the gradient so far: per layer, three whole-row allocations and passes per
//! document, and several whole-row gradients alive at once (at 12 documents per 32k row of
//! Llama 2 7B, 8 GiB more at the peak than the same rows unpacked). This op keeps the documents
//! out of the graph: its backward writes each document's gradients into one whole-row gradient
//! per input, in place. Each document's attention is a [`DocumentKernel`]: the flash kernels on
//! CUDA, the reference arithmetic elsewhere.

use std::fmt::Debug;
use std::ops::Range;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::documents::Documents;
use crate::selective;

/// One document's causal attention on the inner backend `I` (shapes as
/// [`crate::ops::causal_attention`]'s, the batch and sequence cut to the document).
pub(crate) trait DocumentKernel<I: Backend>: Clone + Send + Sync + Debug + 'static {
    /// The output, and what the backward needs besides `q`, `k`, `v` and the output (the flash
    /// kernels' per-row log-sum-exp, `[batch, heads, seq]` in f32), if anything.
    fn forward(
        &self,
        q: Tensor<I, 4>,
        k: Tensor<I, 4>,
        v: Tensor<I, 4>,
    ) -> (Tensor<I, 4>, Option<Tensor<I, 3>>);

    /// `[dq, dk, dv]` for the output gradient `d_o`.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        q: Tensor<I, 4>,
        k: Tensor<I, 4>,
        v: Tensor<I, 4>,
        o: Tensor<I, 4>,
        stats: Option<Tensor<I, 3>>,
        d_o: Tensor<I, 4>,
    ) -> [Tensor<I, 4>; 3];
}

/// The reference arithmetic ([`crate::ops::reference_causal_attention`] and its backward), for
/// any backend.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReferenceKernel;

impl<I: Backend> DocumentKernel<I> for ReferenceKernel {
    fn forward(
        &self,
        q: Tensor<I, 4>,
        k: Tensor<I, 4>,
        v: Tensor<I, 4>,
    ) -> (Tensor<I, 4>, Option<Tensor<I, 3>>) {
        (crate::ops::reference_causal_attention(q, k, v), None)
    }

    fn backward(
        &self,
        q: Tensor<I, 4>,
        k: Tensor<I, 4>,
        v: Tensor<I, 4>,
        o: Tensor<I, 4>,
        _stats: Option<Tensor<I, 3>>,
        d_o: Tensor<I, 4>,
    ) -> [Tensor<I, 4>; 3] {
        crate::ops::reference_causal_attention_backward(q, k, v, o, d_o)
    }
}

/// Document `span` of row `row` of a `[batch, heads, seq, ..]` tensor.
fn cut<I: Backend, const D: usize>(
    t: &Tensor<I, D>,
    row: usize,
    span: &Range<usize>,
) -> Tensor<I, D> {
    t.clone()
        .narrow(0, row, 1)
        .narrow(2, span.start, span.len())
}

/// Concatenates along `dim`, without a copy for a single part.
fn join<I: Backend, const D: usize>(mut parts: Vec<Tensor<I, D>>, dim: usize) -> Tensor<I, D> {
    if parts.len() == 1 {
        return parts.pop().expect("one part");
    }
    Tensor::cat(parts, dim)
}

/// Every document's attention, joined into whole rows: the output and the statistics.
fn forward_all<I: Backend, K: DocumentKernel<I>>(
    kernel: &K,
    q: &Tensor<I, 4>,
    k: &Tensor<I, 4>,
    v: &Tensor<I, 4>,
    documents: &Documents,
) -> (Tensor<I, 4>, Option<Tensor<I, 3>>) {
    let mut rows = Vec::with_capacity(documents.batch());
    let mut row_stats = Vec::with_capacity(documents.batch());
    for r in 0..documents.batch() {
        let (outputs, stats): (Vec<_>, Vec<_>) = documents
            .spans(r)
            .map(|s| kernel.forward(cut(q, r, &s), cut(k, r, &s), cut(v, r, &s)))
            .unzip();
        rows.push(join(outputs, 2));
        row_stats.push(
            stats
                .into_iter()
                .collect::<Option<Vec<_>>>()
                .map(|s| join(s, 2)),
        );
    }
    let stats = row_stats
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .map(|s| join(s, 0));
    (join(rows, 0), stats)
}

/// What a selectively recomputed layer keeps of this op: the output and the statistics.
type Kept<I> = (Tensor<I, 4>, Option<Tensor<I, 3>>);

#[derive(Debug)]
struct DocumentsAttentionBackward<K>(K);

impl<I: Backend, K: DocumentKernel<I>> Backward<I, 3> for DocumentsAttentionBackward<K> {
    #[allow(clippy::type_complexity)]
    type State = (
        Tensor<I, 4>,
        Tensor<I, 4>,
        Tensor<I, 4>,
        Tensor<I, 4>,
        Option<Tensor<I, 3>>,
        Documents,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents;
        let d_o =
            Tensor::<I, 4>::from_primitive(TensorPrimitive::Float(grads.consume::<I>(&ops.node)));
        let (q, k, v, o, stats, documents) = ops.state;
        // Zeros only to give the buffers their shape: every element is written once, by the
        // document that holds it, in place (the buffers have no other holder).
        let mut dq = q.zeros_like();
        let mut dk = k.zeros_like();
        let mut dv = v.zeros_like();
        for r in 0..documents.batch() {
            for s in documents.spans(r) {
                let [gq, gk, gv] = self.0.backward(
                    cut(&q, r, &s),
                    cut(&k, r, &s),
                    cut(&v, r, &s),
                    cut(&o, r, &s),
                    stats.as_ref().map(|t| cut(t, r, &s)),
                    cut(&d_o, r, &s),
                );
                let place = |t: Tensor<I, 4>, g: Tensor<I, 4>| {
                    let [_, heads, _, head_dim] = t.dims();
                    t.slice_assign([r..r + 1, 0..heads, s.clone(), 0..head_dim], g)
                };
                dq = place(dq, gq);
                dk = place(dk, gk);
                dv = place(dv, gv);
            }
        }
        for (node, grad) in [node_q, node_k, node_v].into_iter().zip([dq, dk, dv]) {
            if let Some(node) = node {
                grads.register::<I>(node.id, grad.into_primitive().tensor());
            }
        }
    }
}

/// Causal attention inside each document of `documents`, each document through `kernel`, as one
/// op of `Autodiff<I>`. Under selective recomputation ([`crate::selective`]) a layer's forward
/// keeps the output and statistics, and its recomputation takes them back instead of running the
/// documents' forward again.
pub(crate) fn attention_in_documents<I: Backend, K: DocumentKernel<I>>(
    kernel: K,
    q: Tensor<Autodiff<I>, 4>,
    k: Tensor<Autodiff<I>, 4>,
    v: Tensor<Autodiff<I>, 4>,
    documents: &Documents,
) -> Tensor<Autodiff<I>, 4> {
    let (q, k, v) = (
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
    );
    let inner =
        |p: I::FloatTensorPrimitive| Tensor::<I, 4>::from_primitive(TensorPrimitive::Float(p));
    let (qi, ki, vi) = (
        inner(q.primitive.clone()),
        inner(k.primitive.clone()),
        inner(v.primitive.clone()),
    );
    let out = match DocumentsAttentionBackward(kernel.clone())
        .prepare::<NoCheckpointing>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let kept = selective::take::<Kept<I>>().filter(|(o, _)| {
                let fits = o.dims() == qi.dims();
                if !fits {
                    selective::mismatch();
                }
                fits
            });
            let (o, stats) = kept.unwrap_or_else(|| forward_all(&kernel, &qi, &ki, &vi, documents));
            let primitive = o.clone().into_primitive().tensor();
            prep.finish((qi, ki, vi, o, stats, documents.clone()), primitive)
        }
        OpsKind::UnTracked(prep) => {
            let (o, stats) = forward_all(&kernel, &qi, &ki, &vi, documents);
            if selective::recording() {
                selective::keep::<Kept<I>>((o.clone(), stats));
            }
            prep.finish(o.into_primitive().tensor())
        }
    };
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;
    use burn_ndarray::NdArray;

    type B = NdArray<f32>;
    type Ad = Autodiff<B>;

    fn host<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().unwrap()
    }

    fn max_rel_err(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    /// The explicit backward the documents op runs on the CPU equals the exact gradients, with
    /// grouped and with one-to-one key/value heads: f32 against f64, a few 1e-7 of the largest
    /// gradient apart (a missing term or a wrong scale is off by 1e-1 or more).
    #[test]
    fn reference_backward_matches_exact_gradients() {
        let dev = Default::default();
        for kv_heads in [2, 4] {
            let rand =
                |h| Tensor::<B, 4>::random([2, h, 7, 8], Distribution::Normal(0.0, 1.0), &dev);
            let (q, k, v, d_o) = (rand(4), rand(kv_heads), rand(kv_heads), rand(4));
            let [o, dq, dk, dv] = crate::ops::exact::attention(
                [
                    &host(q.clone()),
                    &host(k.clone()),
                    &host(v.clone()),
                    &host(d_o.clone()),
                ],
                [2, 4, kv_heads, 7, 8],
                |_, i, j| j <= i,
            );
            let out = crate::ops::reference_causal_attention(q.clone(), k.clone(), v.clone());
            assert!(max_rel_err(&host(out.clone()), &o) < 1e-5);
            let got = crate::ops::reference_causal_attention_backward(q, k, v, out, d_o);
            for (g, want, name) in [
                (&got[0], &dq, "q"),
                (&got[1], &dk, "k"),
                (&got[2], &dv, "v"),
            ] {
                let err = max_rel_err(&host(g.clone()), want);
                assert!(err < 1e-5, "d{name} with {kv_heads} kv heads: {err}");
            }
        }
    }

    /// The op's gradients add to what other uses of the same inputs contribute, and an input
    /// without a gradient is left alone: against the exact gradients of attention inside the
    /// documents plus those of q's own square.
    #[test]
    fn gradients_add_to_other_uses() {
        let dev = Default::default();
        let rand = |h| Tensor::<B, 4>::random([2, h, 9, 8], Distribution::Normal(0.0, 1.0), &dev);
        let (q, k, v) = (rand(4), rand(2), rand(2));
        let weights = Tensor::<B, 4>::random([2, 4, 9, 8], Distribution::Default, &dev);
        let documents = Documents::from_lengths(9, vec![vec![1, 5, 3], vec![9]]).unwrap();
        let qa = Tensor::<Ad, 4>::from_inner(q.clone()).require_grad();
        let ka = Tensor::<Ad, 4>::from_inner(k.clone());
        let va = Tensor::<Ad, 4>::from_inner(v.clone()).require_grad();
        let o = attention_in_documents(
            ReferenceKernel,
            qa.clone(),
            ka.clone(),
            va.clone(),
            &documents,
        );
        // q is used again outside attention: its gradients must add.
        let loss =
            (o * Tensor::from_inner(weights.clone())).sum() + (qa.clone() * qa.clone()).sum();
        let grads = loss.backward();
        assert!(ka.grad(&grads).is_none());
        let doc_of = |r: usize, i: usize| documents.spans(r).position(|s| s.contains(&i));
        let [_, dq, _, dv] = crate::ops::exact::attention(
            [&host(q.clone()), &host(k), &host(v), &host(weights)],
            [2, 4, 2, 9, 8],
            |r, i, j| j <= i && doc_of(r, i) == doc_of(r, j),
        );
        let dq: Vec<f32> = dq.iter().zip(host(q)).map(|(g, x)| g + 2.0 * x).collect();
        let dq_err = max_rel_err(&host(qa.grad(&grads).unwrap()), &dq);
        let dv_err = max_rel_err(&host(va.grad(&grads).unwrap()), &dv);
        assert!(dq_err < 1e-5 && dv_err < 1e-5, "dq {dq_err}, dv {dv_err}");
    }
}
