//! Checks smp-burn's fused kernels (RMSNorm, SwiGLU, RoPE and the chunked LM-head loss) against
//! the reference ops, then measures their bandwidth and the loss's memory, on CUDA device 0.
//!
//! `fused_check [check] [bench] [mem] [norm] [--quick] [--iters N]` (default: the first three
//! parts; `norm` times the RMSNorm backward alone at widths 2048, 4096 and 5120).
//!
//! **check**: for each op, fresh random inputs of several shapes (odd sizes included), run
//! through `Autodiff<CudaCube>` twice: with every fast path on (the fused op) and with that op's
//! fast path off (the reference op; cuBLAS GEMMs stay on in both, so the loss comparison
//! isolates the loss). Compared: the forward output and every input gradient of
//! `sum(y * g)` for a random upstream `g` (for the loss: `loss * 1.7`). The plain-backend
//! forward (no autodiff) is checked too. Errors: max |fast - ref| and that over max |ref|.
//! Bounds (relative to max |ref|):
//! - f32: 1e-4. Both paths compute in f32; they differ only in the order of sums (warp
//!   shuffles, chunked GEMMs), a few f32 ulps even over 4097-term sums.
//! - bf16 outputs and gradients: 1e-2 (~2^-7, two bf16 ulps at the top of the range). Each path
//!   rounds its result to bf16 once (2^-9 relative) and the reference also rounds intermediates
//!   (silu(gate), x * cos, dy * weight) to bf16, so they may land one or two ulps apart.
//! - bf16 sums over rows, tokens or the vocabulary (RMSNorm dweight, loss dW and dx): 2e-2. On
//!   an H200 the loss's dx at vocab 32003 came out 1.10e-2 from the reference (9.2e-3 from the
//!   f32 truth, where the reference itself is 6.5e-3 off). A 4097-term sum of
//!   bf16-rounded products, ordered differently (per-block partials; per-chunk GEMM results
//!   rounded to bf16 before the f32 sum), drifts by a few ulps more than an elementwise result.
//! - the loss value itself (an f32 scalar from the same bf16 logits): 1e-3 in bf16, since a
//!   chunk's GEMM may take another cuBLAS algorithm than the full one and round a few logits
//!   differently.
//!
//! For bf16 the reference is also run in f32 on the same (bf16-rounded) inputs, as ground
//! truth; a bf16 case that misses its bound still passes (`PASS*`) when the fused path is at
//! least as close to the f32 truth as the bf16 reference is (then the reference's own bf16
//! intermediates are what differs).
//!
//! **bench**: bf16 at Llama-7B shapes (4096 tokens, hidden 4096, intermediate 11008, 32 heads x
//! 128): each fused kernel alone (forward, backward) timed between device syncs over N
//! iterations, its effective bandwidth (bytes the op must read and write / time; RMSNorm's
//! partial sums are overhead and not counted), a CubeCL copy kernel moving the same number of
//! bytes (half read, half written: the achievable roofline), and the reference op's forward on
//! the plain backend; then forward + backward through autodiff (`sum(y * g).backward()`, the
//! same harness for both) for the fused and the reference op.
//!
//! **mem**: the LM-head loss at 4096 tokens, hidden 4096, vocab 32000, bf16, forward + backward
//! through autodiff, fused vs reference: time, CubeCL pool bytes in use after the forward
//! (what the graph keeps) and the pool's reserved bytes before and after (its high-water mark,
//! reset by `memory_cleanup` before each run): the peak.
//!
//! Machine-readable lines:
//! `CHECK|op|dtype|shape|tensor|max_abs|max_rel|bound|fast_vs_f32|ref_vs_f32|PASS`,
//! `BW|op|dir|layout|MB|fused_ms|fused_GB/s|copy_GB/s|ref_ms|ref_GB/s`,
//! `STEP|op|layout|fused_fwd+bwd_ms|ref_fwd+bwd_ms|speedup`,
//! `MEM|variant|ms|in_use_after_fwd_MiB|reserved_before_MiB|reserved_after_MiB|peak_growth_MiB`.

use std::time::Instant;

use burn::backend::Autodiff;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorData, backend::Backend};
use cubecl::Runtime;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::CubeDim;
use smp_burn::KernelConfig;
use smp_burn::cuda::CudaCube;
use smp_burn::cuda::fused;
use smp_burn::fast::FastPaths;
use smp_burn::ops;

type G = CudaCube;
type Ad = Autodiff<G>;
type Named = Vec<(&'static str, Vec<f32>)>;

const EPS: f64 = 1e-5;

fn device() -> CudaDevice {
    CudaDevice::new(0)
}

fn sync() {
    G::sync(&device()).expect("device sync");
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .expect("f32 data")
}

fn randn<const D: usize>(shape: [usize; D], mean: f64, std: f64) -> Tensor<G, D> {
    Tensor::random(shape, Distribution::Normal(mean, std), &device())
}

/// Makes `p` the fast paths of every later op.
fn set_fast_paths(p: FastPaths) {
    KernelConfig::update(|c| c.fast_paths = p).expect("a valid kernel configuration");
}

/// Everything but the named op's fast path on (the reference run), or everything on.
fn paths(fast: bool, off: fn(&mut FastPaths)) -> FastPaths {
    let mut p = FastPaths::ALL;
    if !fast {
        off(&mut p);
    }
    p
}

// ------------------------------------------------------------------------------------------
// check
// ------------------------------------------------------------------------------------------

/// (max |a - b|, max |a - b| / max |b|); a NaN counts as an infinite error.
fn errors(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let mut diff = 0.0f32;
    let mut scale = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        let d = (x - y).abs();
        diff = if d.is_nan() {
            f32::INFINITY
        } else {
            diff.max(d)
        };
        scale = scale.max(y.abs());
    }
    (diff, diff / scale.max(f32::MIN_POSITIVE))
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        _ => "other",
    }
}

/// Prints one CHECK line per tensor; returns whether all passed. `truth` (bf16 runs only) is
/// the reference in f32 on the same rounded inputs.
fn report(
    op: &str,
    dtype: DType,
    shape: &str,
    fast: &Named,
    reference: &Named,
    truth: Option<&Named>,
    bound: impl Fn(&str) -> f32,
) -> bool {
    let mut ok = true;
    for ((name, f), (_, r)) in fast.iter().zip(reference) {
        let (abs, rel) = errors(f, r);
        let tol = bound(name);
        let (fast_truth, ref_truth) = match truth {
            Some(t) => {
                let t = &t.iter().find(|(n, _)| n == name).expect("same tensors").1;
                (errors(f, t).1, errors(r, t).1)
            }
            None => (f32::NAN, f32::NAN),
        };
        let verdict = if rel <= tol {
            "PASS"
        } else if truth.is_some() && fast_truth <= ref_truth {
            "PASS*"
        } else {
            "FAIL"
        };
        ok &= verdict != "FAIL";
        println!(
            "CHECK|{op}|{}|{shape}|{name}|{abs:.3e}|{rel:.3e}|{tol:.0e}|{fast_truth:.3e}|{ref_truth:.3e}|{verdict}",
            dtype_name(dtype)
        );
    }
    ok
}

/// Runs `case` with the fused path, the reference in `dtype`, and (bf16) the reference in f32;
/// reports and returns whether every tensor passed.
fn compare(
    op: &str,
    dtype: DType,
    shape: &str,
    off: fn(&mut FastPaths),
    bound: impl Fn(&str) -> f32,
    case: impl Fn(DType, bool) -> Named,
) -> bool {
    set_fast_paths(paths(true, off));
    let fast = case(dtype, true);
    set_fast_paths(paths(false, off));
    let reference = case(dtype, false);
    let truth = (dtype != DType::F32).then(|| case(DType::F32, false));
    set_fast_paths(FastPaths::ALL);
    report(op, dtype, shape, &fast, &reference, truth.as_ref(), bound)
}

fn tol_f32_or(dtype: DType, bf16: f32) -> f32 {
    if dtype == DType::F32 { 1e-4 } else { bf16 }
}

fn check_rms_norm(quick: bool) -> bool {
    let mut ok = true;
    let rows: &[usize] = if quick { &[1, 4097] } else { &[1, 7, 4097] };
    for dtype in [DType::BF16, DType::F32] {
        for &r in rows {
            for h in [4096, 5120, 1000] {
                // [batch, seq, hidden] as the model calls it; rows = batch * seq.
                let x = randn([1, r, h], 0.0, 1.0);
                let w = randn([h], 1.0, 0.1);
                let g = randn([1, r, h], 0.0, 1.0);
                let case = |d: DType, _fast: bool| -> Named {
                    let xa =
                        Tensor::<Ad, 3>::from_inner(x.clone().cast(dtype).cast(d)).require_grad();
                    let wa =
                        Tensor::<Ad, 1>::from_inner(w.clone().cast(dtype).cast(d)).require_grad();
                    let y = ops::rms_norm(xa.clone(), wa.clone(), EPS);
                    // A residual stream beside the norm, as in a decoder layer: its gradient
                    // reaches x first and the norm's backward adds into it, in place (bf16) or
                    // into a copy (f32: the add passes the buffer to `skip` too, which must
                    // keep its own gradient unchanged).
                    let skip = Tensor::<Ad, 3>::from_inner(x.clone().cast(d) * 0.0).require_grad();
                    let residual = if dtype == DType::BF16 {
                        xa.clone()
                    } else {
                        xa.clone() + skip.clone()
                    };
                    let grads = ((y.clone().cast(DType::F32) * Tensor::from_inner(g.clone()))
                        .sum()
                        + (residual.cast(DType::F32) * Tensor::from_inner(g.clone() * 0.5)).sum())
                    .backward();
                    let dskip = skip.grad(&grads).map(host).unwrap_or_default();
                    let plain = ops::rms_norm(
                        x.clone().cast(dtype).cast(d),
                        w.clone().cast(dtype).cast(d),
                        EPS,
                    );
                    vec![
                        ("y", host(y.inner())),
                        ("y_plain", host(plain)),
                        ("dx", host(xa.grad(&grads).expect("dx"))),
                        ("dweight", host(wa.grad(&grads).expect("dweight"))),
                        ("dskip", dskip),
                    ]
                };
                ok &= compare(
                    "rms_norm",
                    dtype,
                    &format!("rows{r}_h{h}"),
                    |p| p.norm = false,
                    |name| tol_f32_or(dtype, if name == "dweight" { 2e-2 } else { 1e-2 }),
                    case,
                );
            }
        }
    }
    ok
}

fn check_swiglu(quick: bool) -> bool {
    let mut ok = true;
    let shapes: &[[usize; 3]] = if quick {
        &[[1, 7, 1000], [1, 4096, 11008]]
    } else {
        &[
            [1, 1, 11008],
            [1, 7, 1000],
            [2, 4097, 1001],
            [1, 4096, 11008],
        ]
    };
    for dtype in [DType::BF16, DType::F32] {
        for &shape in shapes {
            // Gates wide enough to reach both tails of the sigmoid.
            let gate = randn(shape, 0.0, 3.0);
            let up = randn(shape, 0.0, 1.0);
            let g = randn(shape, 0.0, 1.0);
            let case = |d: DType, _fast: bool| -> Named {
                let ga =
                    Tensor::<Ad, 3>::from_inner(gate.clone().cast(dtype).cast(d)).require_grad();
                let ua = Tensor::<Ad, 3>::from_inner(up.clone().cast(dtype).cast(d)).require_grad();
                let y = ops::swiglu(ga.clone(), ua.clone());
                let grads = (y.clone().cast(DType::F32) * Tensor::from_inner(g.clone()))
                    .sum()
                    .backward();
                let plain = ops::swiglu(
                    gate.clone().cast(dtype).cast(d),
                    up.clone().cast(dtype).cast(d),
                );
                vec![
                    ("y", host(y.inner())),
                    ("y_plain", host(plain)),
                    ("dgate", host(ga.grad(&grads).expect("dgate"))),
                    ("dup", host(ua.grad(&grads).expect("dup"))),
                ]
            };
            ok &= compare(
                "swiglu",
                dtype,
                &format!("{}x{}x{}", shape[0], shape[1], shape[2]),
                |p| p.swiglu = false,
                |_| tol_f32_or(dtype, 1e-2),
                case,
            );
        }
    }
    ok
}

fn check_rope(quick: bool) -> bool {
    let mut ok = true;
    // (batch, heads, seq, head_dim, the model's strided layout)
    let shapes: &[(usize, usize, usize, usize, bool)] = if quick {
        &[(2, 3, 7, 64, true), (1, 32, 4097, 128, true)]
    } else {
        &[
            (1, 1, 1, 128, false),
            (2, 3, 7, 64, true),
            (1, 4, 33, 6, false),
            (2, 8, 129, 128, false),
            // Heads not a multiple of the 4 a thread rotates; grouped-query k.
            (1, 5, 17, 32, true),
            (2, 8, 65, 128, true),
            (1, 32, 4097, 128, true),
        ]
    };
    for dtype in [DType::BF16, DType::F32] {
        for &(b, h, s, d, strided) in shapes {
            let (cos, sin) = ops::rope_tables::<G>(s, d, 10000.0, &device());
            // Strided: [b, s, h, d] swapped to [b, h, s, d], as the model's reshape + swap_dims.
            let x = if strided {
                randn([b, s, h, d], 0.0, 1.0)
            } else {
                randn([b, h, s, d], 0.0, 1.0)
            };
            let g = randn([b, h, s, d], 0.0, 1.0);
            let case = |dt: DType, fast: bool| -> Named {
                let xa = Tensor::<Ad, 4>::from_inner(x.clone().cast(dtype).cast(dt)).require_grad();
                let view = |t: Tensor<Ad, 4>| if strided { t.swap_dims(1, 2) } else { t };
                let y = ops::rope(
                    view(xa.clone()),
                    Tensor::from_inner(cos.clone()),
                    Tensor::from_inner(sin.clone()),
                );
                let grads = (y.clone().cast(DType::F32) * Tensor::from_inner(g.clone()))
                    .sum()
                    .backward();
                let dx = xa.grad(&grads).expect("dx");
                // The fused backward writes dx in x's order, so the gradient of the
                // [b, s, h, d] leaf comes back through swap_dims without a copy: contiguous.
                if fast && strided {
                    let prim = dx.clone().into_primitive().tensor();
                    assert!(
                        prim.is_contiguous(),
                        "rope: dx of the strided case not in x's order: shape {:?} strides {:?}",
                        prim.meta.shape(),
                        prim.meta.strides()
                    );
                }
                let xp = x.clone().cast(dtype).cast(dt);
                let xp = if strided { xp.swap_dims(1, 2) } else { xp };
                let plain = ops::rope(xp, cos.clone(), sin.clone());
                vec![
                    ("y", host(y.inner())),
                    ("y_plain", host(plain)),
                    ("dx", host(dx)),
                ]
            };
            ok &= compare(
                "rope",
                dtype,
                &format!(
                    "b{b}_h{h}_s{s}_d{d}{}",
                    if strided { "_strided" } else { "" }
                ),
                |p| p.rope = false,
                |_| tol_f32_or(dtype, 1e-2),
                case,
            );
        }
    }
    ok
}

/// Targets in `[0, vocab)` from a fixed LCG, with the first and last ids present; with
/// `ignored`, every seventh (from the second) is `IGNORE_INDEX`.
fn targets(tokens: usize, vocab: usize, ignored: bool) -> Tensor<G, 1, Int> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut ids: Vec<i64> = (0..tokens)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 33) % vocab as u64) as i64
        })
        .collect();
    ids[0] = 0;
    ids[tokens - 1] = vocab as i64 - 1;
    if ignored {
        for id in ids.iter_mut().skip(1).step_by(7) {
            *id = ops::IGNORE_INDEX;
        }
    }
    Tensor::from_data(TensorData::new(ids, [tokens]), &device())
}

fn check_loss(quick: bool) -> bool {
    let mut ok = true;
    // (tokens, hidden, vocab, forced chunk): None = the default chunking (2048 tokens for
    // these vocabularies, so 4095/4096 tokens take two chunks, the second partial or whole).
    let shapes: &[(usize, usize, usize, Option<usize>)] = if quick {
        &[(7, 64, 1000, None), (4095, 4096, 32003, None)]
    } else {
        &[
            (7, 64, 1000, None),
            (1000, 512, 5000, Some(300)),
            (4096, 4096, 32000, None),
            (4095, 4096, 32003, None),
        ]
    };
    for (dtype, ignored) in [
        (DType::BF16, false),
        (DType::F32, false),
        (DType::BF16, true),
        (DType::F32, true),
    ] {
        for &(tokens, hidden, vocab, chunk) in shapes {
            let x = randn([tokens, hidden], 0.0, 1.0);
            let w = randn([vocab, hidden], 0.0, 0.02);
            let t = targets(tokens, vocab, ignored);
            let case = |d: DType, fast: bool| -> Named {
                let xa = Tensor::<Ad, 2>::from_inner(x.clone().cast(dtype).cast(d)).require_grad();
                let wa = Tensor::<Ad, 2>::from_inner(w.clone().cast(dtype).cast(d)).require_grad();
                let ta = Tensor::<Ad, 1, Int>::from_inner(t.clone());
                let loss = match (fast, chunk) {
                    (true, Some(c)) => {
                        ops::linear_cross_entropy_chunked(xa.clone(), wa.clone(), ta, c)
                    }
                    _ => ops::linear_cross_entropy(xa.clone(), wa.clone(), ta),
                };
                let grads = (loss.clone() * 1.7).backward();
                let plain = match (fast, chunk) {
                    (true, Some(c)) => ops::linear_cross_entropy_chunked(
                        x.clone().cast(dtype).cast(d),
                        w.clone().cast(dtype).cast(d),
                        t.clone(),
                        c,
                    ),
                    _ => ops::linear_cross_entropy(
                        x.clone().cast(dtype).cast(d),
                        w.clone().cast(dtype).cast(d),
                        t.clone(),
                    ),
                };
                vec![
                    ("loss", host(loss.inner())),
                    ("loss_plain", host(plain)),
                    ("dx", host(xa.grad(&grads).expect("dx"))),
                    ("dW", host(wa.grad(&grads).expect("dW"))),
                ]
            };
            let shape = match chunk {
                Some(c) => format!("t{tokens}_h{hidden}_v{vocab}_chunk{c}"),
                None => format!("t{tokens}_h{hidden}_v{vocab}"),
            };
            let shape = if ignored {
                format!("{shape}_ignoring_1_in_7")
            } else {
                shape
            };
            ok &= compare(
                "linear_cross_entropy",
                dtype,
                &shape,
                |p| p.loss = false,
                |name| {
                    tol_f32_or(
                        dtype,
                        match name {
                            "loss" | "loss_plain" => 1e-3,
                            // dx = (softmax - onehot) W is a sum over the vocabulary, as long
                            // as dW's over tokens: the same bound.
                            "dW" | "dx" => 2e-2,
                            _ => 1e-2,
                        },
                    )
                },
                case,
            );
        }
    }
    ok
}

// ------------------------------------------------------------------------------------------
// bench
// ------------------------------------------------------------------------------------------

/// Milliseconds per call of `f` over `iters` calls (after 3 warm-up calls), between syncs.
fn time_ms(iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    sync();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    sync();
    t.elapsed().as_secs_f64() * 1e3 / iters as f64
}

/// The copy kernel, apart from Burn's `Tensor`, whose name it shares with CubeCL's.
mod copy {
    use cubecl::prelude::*;

    /// `dst = src`, 16 bytes a thread: what a bandwidth-bound kernel can reach.
    #[cube(launch_unchecked)]
    pub fn copy_kernel<N: Size>(
        src: &Tensor<Vector<f32, N>>,
        dst: &mut Tensor<Vector<f32, N>>,
        len: u32,
    ) {
        let i = ABSOLUTE_POS;
        if i < len as usize {
            dst[i] = src[i];
        }
    }
}

/// Milliseconds of a device-to-device copy that reads `bytes / 2` and writes `bytes / 2`.
fn copy_ms(bytes: usize, iters: usize) -> f64 {
    let n = (bytes / 8).next_multiple_of(4);
    let src = Tensor::<G, 1>::zeros([n], &device())
        .into_primitive()
        .tensor();
    let dst = Tensor::<G, 1>::zeros([n], &device())
        .into_primitive()
        .tensor();
    let client = src.client.clone();
    let len = n / 4;
    let dim = CubeDim::new_1d(256);
    let count = cubecl::calculate_cube_count_elemwise(&client, len, dim);
    time_ms(iters, || {
        // SAFETY: `len` vectors of 4 f32 in both buffers; the kernel guards `i < len`.
        unsafe {
            copy::copy_kernel::launch_unchecked::<CudaRuntime>(
                &client,
                count.clone(),
                dim,
                4,
                src.clone().into_tensor_arg(),
                dst.clone().into_tensor_arg(),
                len as u32,
            );
        }
    })
}

fn gbps(bytes: usize, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9
}

fn bw_line(
    op: &str,
    dir: &str,
    layout: &str,
    bytes: usize,
    fused_ms: f64,
    ref_ms: Option<f64>,
    iters: usize,
) {
    let copy = copy_ms(bytes, iters);
    let (ref_ms_s, ref_gb) = match ref_ms {
        Some(r) => (format!("{r:.4}"), format!("{:.1}", gbps(bytes, r))),
        None => ("-".to_string(), "-".to_string()),
    };
    println!(
        "{op:9} {dir:3} {layout:10} {:8.1} MB: fused {fused_ms:8.4} ms {:7.1} GB/s | copy {:7.1} GB/s | reference {ref_ms_s} ms",
        bytes as f64 / 1e6,
        gbps(bytes, fused_ms),
        gbps(bytes, copy),
    );
    println!(
        "BW|{op}|{dir}|{layout}|{:.1}|{fused_ms:.4}|{:.1}|{:.1}|{ref_ms_s}|{ref_gb}",
        bytes as f64 / 1e6,
        gbps(bytes, fused_ms),
        gbps(bytes, copy),
    );
}

fn step_line(op: &str, layout: &str, fused_ms: f64, ref_ms: f64) {
    println!(
        "{op:9} fwd+bwd {layout:10} through autodiff: fused {fused_ms:8.4} ms, reference {ref_ms:8.4} ms ({:.2}x)",
        ref_ms / fused_ms
    );
    println!(
        "STEP|{op}|{layout}|{fused_ms:.4}|{ref_ms:.4}|{:.2}",
        ref_ms / fused_ms
    );
}

/// Forward + backward through autodiff of `op` on leaves made from `inputs`, with the upstream
/// `g`, timed with the given fast paths.
fn step_ms<const D: usize>(
    iters: usize,
    p: FastPaths,
    g: &Tensor<G, D>,
    op: impl Fn() -> Tensor<Ad, D>,
) -> f64 {
    set_fast_paths(p);
    let ms = time_ms(iters, || {
        let y = op();
        let _ = (y * Tensor::from_inner(g.clone())).sum().backward();
    });
    set_fast_paths(FastPaths::ALL);
    ms
}

fn bench(iters: usize) {
    let (tokens, hidden, inter, heads, hd) = (4096usize, 4096usize, 11008usize, 32usize, 128usize);
    let bf = DType::BF16;
    let e = 2usize; // bytes per bf16 element
    let off = |f: fn(&mut FastPaths)| paths(false, f);
    println!(
        "bench: bf16, {tokens} tokens, hidden {hidden}, intermediate {inter}, {heads} heads x {hd}; \
         {iters} iterations between syncs"
    );

    // RMSNorm.
    let x = randn([tokens, hidden], 0.0, 1.0).cast(bf);
    let w = randn([hidden], 1.0, 0.1).cast(bf);
    let dy = randn([tokens, hidden], 0.0, 1.0).cast(bf);
    let (xp, wp, dyp) = (
        x.clone().into_primitive().tensor(),
        w.clone().into_primitive().tensor(),
        dy.clone().into_primitive().tensor(),
    );
    let fwd = time_ms(iters, || {
        let _ = fused::rms_norm_forward(xp.clone(), wp.clone(), EPS);
    });
    set_fast_paths(off(|p| p.norm = false));
    let ref_fwd = time_ms(iters, || {
        let _ = ops::rms_norm(x.clone(), w.clone(), EPS);
    });
    set_fast_paths(FastPaths::ALL);
    let act = tokens * hidden * e;
    bw_line(
        "rms_norm",
        "fwd",
        "-",
        2 * act + hidden * e + tokens * 4,
        fwd,
        Some(ref_fwd),
        iters,
    );
    let (_, inv) = fused::rms_norm_forward(xp.clone(), wp.clone(), EPS);
    let bwd = time_ms(iters, || {
        let _ =
            fused::rms_norm_backward(xp.clone(), wp.clone(), inv.clone(), dyp.clone(), true, None);
    });
    bw_line(
        "rms_norm",
        "bwd",
        "-",
        3 * act + 2 * hidden * e + tokens * 4,
        bwd,
        None,
        iters,
    );
    // Adding into the residual stream's gradient: `fused_check norm`.
    let g = randn([tokens, hidden], 0.0, 1.0).cast(bf);
    let leaf = |t: &Tensor<G, 2>| Tensor::<Ad, 2>::from_inner(t.clone()).require_grad();
    let run = || {
        ops::rms_norm(
            leaf(&x),
            Tensor::<Ad, 1>::from_inner(w.clone()).require_grad(),
            EPS,
        )
    };
    let f = step_ms(iters, FastPaths::ALL, &g, run);
    let r = step_ms(iters, off(|p| p.norm = false), &g, run);
    step_line("rms_norm", "-", f, r);

    // SwiGLU.
    let gate = randn([tokens, inter], 0.0, 2.0).cast(bf);
    let up = randn([tokens, inter], 0.0, 1.0).cast(bf);
    let dout = randn([tokens, inter], 0.0, 1.0).cast(bf);
    let (gp, up_p, dp) = (
        gate.clone().into_primitive().tensor(),
        up.clone().into_primitive().tensor(),
        dout.clone().into_primitive().tensor(),
    );
    let act = tokens * inter * e;
    let fwd = time_ms(iters, || {
        let _ = fused::swiglu_forward(gp.clone(), up_p.clone());
    });
    set_fast_paths(off(|p| p.swiglu = false));
    let ref_fwd = time_ms(iters, || {
        let _ = ops::swiglu(gate.clone(), up.clone());
    });
    set_fast_paths(FastPaths::ALL);
    bw_line("swiglu", "fwd", "-", 3 * act, fwd, Some(ref_fwd), iters);
    let bwd = time_ms(iters, || {
        let _ = fused::swiglu_backward(gp.clone(), up_p.clone(), dp.clone());
    });
    bw_line("swiglu", "bwd", "-", 5 * act, bwd, None, iters);
    let run = || ops::swiglu(leaf(&gate), leaf(&up));
    let f = step_ms(iters, FastPaths::ALL, &dout, run);
    let r = step_ms(iters, off(|p| p.swiglu = false), &dout, run);
    step_line("swiglu", "-", f, r);

    // RoPE on q: contiguous [1, 32, 4096, 128], and the model's strided view of [1, 4096, 32, 128].
    let (cos, sin) = ops::rope_tables::<G>(tokens, hd, 10000.0, &device());
    let cos_t = fused::rope_table(cos.clone().into_primitive().tensor());
    let sin_t = fused::rope_table(sin.clone().into_primitive().tensor());
    let act = tokens * heads * hd * e;
    let tables = 2 * tokens * hd * 4;
    let g = randn([1, heads, tokens, hd], 0.0, 1.0).cast(bf);
    for strided in [false, true] {
        let layout = if strided { "strided" } else { "contiguous" };
        let base = if strided {
            randn([1, tokens, heads, hd], 0.0, 1.0).cast(bf)
        } else {
            randn([1, heads, tokens, hd], 0.0, 1.0).cast(bf)
        };
        let view = |t: Tensor<G, 4>| if strided { t.swap_dims(1, 2) } else { t };
        let q = view(base.clone());
        let qp = q.clone().into_primitive().tensor();
        set_fast_paths(off(|p| p.rope = false));
        let ref_fwd = time_ms(iters, || {
            let _ = ops::rope(q.clone(), cos.clone(), sin.clone());
        });
        set_fast_paths(FastPaths::ALL);
        let fwd = time_ms(iters, || {
            let _ = fused::rope_apply(qp.clone(), &cos_t, &sin_t, false);
        });
        bw_line(
            "rope",
            "fwd",
            layout,
            2 * act + tables,
            fwd,
            Some(ref_fwd),
            iters,
        );
        if !strided {
            // The backward's input is the upstream gradient, contiguous in either layout.
            let gp = g.clone().into_primitive().tensor();
            let bwd = time_ms(iters, || {
                let _ = fused::rope_apply(gp.clone(), &cos_t, &sin_t, true);
            });
            bw_line("rope", "bwd", layout, 2 * act + tables, bwd, None, iters);
        }
        let run = || {
            let xa = Tensor::<Ad, 4>::from_inner(base.clone()).require_grad();
            let xa = if strided { xa.swap_dims(1, 2) } else { xa };
            ops::rope(
                xa,
                Tensor::from_inner(cos.clone()),
                Tensor::from_inner(sin.clone()),
            )
        };
        let f = step_ms(iters, FastPaths::ALL, &g, run);
        let r = step_ms(iters, off(|p| p.rope = false), &g, run);
        step_line("rope", layout, f, r);
    }
}

// ------------------------------------------------------------------------------------------
// mem
// ------------------------------------------------------------------------------------------

/// The RMSNorm backward alone at the Llama widths (1b: 2048, 7B: 4096, 13B: 5120), plain and
/// adding into a gradient (fast path `accumulate`).
fn bench_norm_bwd(iters: usize) {
    let tokens = 4096usize;
    let bf = DType::BF16;
    for hidden in [2048usize, 4096, 5120] {
        let x = randn([tokens, hidden], 0.0, 1.0).cast(bf);
        let w = randn([hidden], 1.0, 0.1).cast(bf);
        let dy = randn([tokens, hidden], 0.0, 1.0).cast(bf);
        let acc = randn([tokens, hidden], 0.0, 1.0).cast(bf);
        let (xp, wp, dyp) = (
            x.into_primitive().tensor(),
            w.into_primitive().tensor(),
            dy.into_primitive().tensor(),
        );
        let acc = acc.into_primitive().tensor();
        let (_, inv) = fused::rms_norm_forward(xp.clone(), wp.clone(), EPS);
        let act = tokens * hidden * 2;
        for (name, into) in [("rms_norm_bwd", None), ("rms_norm_bwd_acc", Some(acc))] {
            let ms = time_ms(iters, || {
                let _ = fused::rms_norm_backward(
                    xp.clone(),
                    wp.clone(),
                    inv.clone(),
                    dyp.clone(),
                    true,
                    into.clone(),
                );
            });
            let reads = if into.is_some() { 4 } else { 3 };
            bw_line(
                &format!("{name}_h{hidden}"),
                "bwd",
                "-",
                reads * act + 2 * hidden * 2 + tokens * 4,
                ms,
                None,
                iters,
            );
        }
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn mem(iters: usize) {
    let (tokens, hidden, vocab) = (4096usize, 4096usize, 32000usize);
    let client = CudaRuntime::client(&device());
    let x = randn([tokens, hidden], 0.0, 1.0).cast(DType::BF16);
    let w = randn([vocab, hidden], 0.0, 0.02).cast(DType::BF16);
    let t = targets(tokens, vocab, false);
    println!(
        "mem: LM-head loss, {tokens} tokens, hidden {hidden}, vocab {vocab}, bf16, forward + backward"
    );
    let run = |fused: bool| -> f64 {
        set_fast_paths(if fused {
            FastPaths::ALL
        } else {
            paths(false, |p| p.loss = false)
        });
        let step = || {
            let xa = Tensor::<Ad, 2>::from_inner(x.clone()).require_grad();
            let wa = Tensor::<Ad, 2>::from_inner(w.clone()).require_grad();
            let loss = ops::linear_cross_entropy(xa, wa, Tensor::from_inner(t.clone()));
            (loss.clone(), loss.backward())
        };
        // Warm up (kernel compilation, cuBLAS handles), then measure from a cleaned pool.
        drop(step());
        sync();
        client.memory_cleanup();
        sync();
        let before = client.memory_usage().expect("memory usage");
        let xa = Tensor::<Ad, 2>::from_inner(x.clone()).require_grad();
        let wa = Tensor::<Ad, 2>::from_inner(w.clone()).require_grad();
        let loss = ops::linear_cross_entropy(xa, wa, Tensor::from_inner(t.clone()));
        sync();
        let after_fwd = client.memory_usage().expect("memory usage");
        let grads = loss.backward();
        sync();
        let after = client.memory_usage().expect("memory usage");
        drop(grads);
        let ms = time_ms(iters, || drop(step()));
        let name = if fused { "fused" } else { "reference" };
        println!(
            "{name:9}: {ms:8.3} ms fwd+bwd; pool in use after forward {:8.1} MiB (before {:8.1}); \
             reserved {:8.1} -> {:8.1} MiB (peak growth {:8.1} MiB)",
            mib(after_fwd.bytes_in_use),
            mib(before.bytes_in_use),
            mib(before.bytes_reserved),
            mib(after.bytes_reserved),
            mib(after.bytes_reserved.saturating_sub(before.bytes_reserved)),
        );
        println!(
            "MEM|{name}|{ms:.3}|{:.1}|{:.1}|{:.1}|{:.1}",
            mib(after_fwd.bytes_in_use.saturating_sub(before.bytes_in_use)),
            mib(before.bytes_reserved),
            mib(after.bytes_reserved),
            mib(after.bytes_reserved.saturating_sub(before.bytes_reserved)),
        );
        set_fast_paths(FastPaths::ALL);
        ms
    };
    let f = run(true);
    let r = run(false);
    println!("mem: fused is {:.2}x the reference's speed", r / f);
}

fn main() {
    let _ = smp_burn::cuda::configure_kernel_cache();
    let mut parts = Vec::new();
    let mut quick = false;
    let mut iters = 20usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "check" | "bench" | "mem" | "norm" => parts.push(a),
            "--quick" => quick = true,
            "--iters" => {
                iters = args
                    .next()
                    .and_then(|s| s.parse().ok())
                    .expect("--iters needs a number")
            }
            other => {
                eprintln!(
                    "unknown argument {other:?}: use check, bench, mem, norm, --quick, --iters N"
                );
                std::process::exit(2);
            }
        }
    }
    if parts.is_empty() {
        parts = vec!["check".into(), "bench".into(), "mem".into()];
    }
    let mut ok = true;
    for p in &parts {
        match p.as_str() {
            "check" => {
                let results = [
                    ("rms_norm", check_rms_norm(quick)),
                    ("swiglu", check_swiglu(quick)),
                    ("rope", check_rope(quick)),
                    ("linear_cross_entropy", check_loss(quick)),
                ];
                for (op, pass) in results {
                    println!("check {op}: {}", if pass { "all passed" } else { "FAILED" });
                    ok &= pass;
                }
            }
            "bench" => bench(iters),
            "norm" => bench_norm_bwd(iters),
            "mem" => mem(iters.min(10)),
            _ => unreachable!(),
        }
    }
    if !ok {
        eprintln!("fused_check: some checks FAILED (see FAIL lines)");
        std::process::exit(1);
    }
}
