//! Checks smp-burn's flash-attention kernels against Burn's own attention in f32, then times
//! them.
//!
//! First a fragment probe runs the kernels' register-layout helpers on exact small-integer
//! 16x16 products (S = QK^T, O = PV, and T = S^T V through the fused dQ's transposed
//! shared-memory path), so that a wrong layout assumption shows up as
//! `mma fragment probe: FAIL` rather than as noise in attention errors.
//!
//! Check: random bf16 inputs on CUDA device 0, odd shapes included (S = 1 to 1024, GQA and
//! MHA, head dim 64 and 128, a "sharp" case with q scaled by 20 so that row maxima jump
//! between key blocks, and inputs in the model's `[B, S, H, D]` order viewed as `[B, H, S, D]`).
//! The reference runs on the same GPU in f32 from the same bf16-rounded values with Burn's
//! tensor ops: scores = q k^T * scale, causal mask, softmax, @ v, and its gradients through
//! Burn's autodiff (GQA heads expanded, so dK/dV sum over the query heads of a kv head). Every
//! forward and backward kernel the device runs (`smp_burn::FlashForward`,
//! `smp_burn::FlashBackward`) is compared on O, lse, dQ, dK and dV: max abs error and relative
//! error (max |a - b| / max |b|); it fails (exit 1) above 2e-2, unless the max abs error is
//! below 1e-4 (a reference that is zero up to rounding, e.g. dQ and dK at S = 1). Packed
//! documents (`documents` lines) run as training runs them, through
//! `smp_burn::ops::causal_attention_in_documents` and Burn's autodiff, against the reference
//! with a block-causal mask.
//!
//! Bench: causal, `--batch` (1), `--heads` (32 query and kv heads), `--head-dim` (128), each
//! length of `--seq` (4096 and 16384); forward and backward TFLOP/s of every kernel (forward
//! 4*B*H*S*S*D/2 FLOPs, backward 2.5x that), timed between device syncs.
//!
//! Flags: `--quick` (fewer shapes, S = 4096 only), `--no-check`, `--no-bench`,
//! `--forward NAME,..` and `--backward NAME,..` (only those kernels), `--iters N` (10),
//! `--head-dim 64|128`, `--seq L1,L2,..`, `--batch N`, `--heads N`.
//! Lines starting `RESULT|` are for machines: `RESULT|probe|tensor|max_abs|ok`,
//! `RESULT|check|kernel|shape|tensor|max_abs|rel|ok` and
//! `RESULT|bench|kernel|B<batch>|S|ms|tflops`.

use std::time::Instant;

use burn::backend::Autodiff;
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Distribution, Int, Tensor, TensorData, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use cubecl::Runtime;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use smp_burn::cuda::CudaCube as G;
use smp_burn::cuda::flash::{
    backward_supported, current_kernels, flash_backward_with, flash_forward_with,
    forward_supported, mma_fragment_probe, mma_supported,
};
use smp_burn::{Documents, FlashBackward, FlashForward};

type Ct = CubeTensor<CudaRuntime>;

struct Args {
    quick: bool,
    check: bool,
    bench: bool,
    forward: Vec<FlashForward>,
    backward: Vec<FlashBackward>,
    iters: usize,
    head_dim: usize,
    seq: Option<Vec<usize>>,
    batch: usize,
    heads: usize,
}

const USAGE: &str = "usage: flash_check [--quick] [--no-check] [--no-bench] [--forward NAME,..] \
[--backward NAME,..] [--iters N] [--head-dim 64|128] [--seq L1,L2,..] [--batch N] [--heads N]  \
(see the file's doc comment)";

/// A comma-separated list of positive numbers, or of kernel names `parse` takes.
fn list<T>(flag: &str, value: &str, parse: impl Fn(&str) -> Option<T>) -> Result<Vec<T>, String> {
    value
        .split(',')
        .map(|v| parse(v.trim()).ok_or(format!("{flag}: cannot use {v:?}")))
        .collect()
}

fn positive(v: &str) -> Option<usize> {
    v.parse().ok().filter(|&n| n > 0)
}

fn parse_args(argv: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        quick: false,
        check: true,
        bench: true,
        forward: FlashForward::ALL.to_vec(),
        backward: FlashBackward::ALL.to_vec(),
        iters: 10,
        head_dim: 128,
        seq: None,
        batch: 1,
        heads: 32,
    };
    let mut it = argv.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let one = |v: String| positive(&v).ok_or(format!("{flag}: cannot use {v:?}"));
        match flag.as_str() {
            "--quick" => a.quick = true,
            "--no-check" => a.check = false,
            "--no-bench" => a.bench = false,
            "--forward" => a.forward = list(&flag, &value()?, FlashForward::parse)?,
            "--backward" => a.backward = list(&flag, &value()?, FlashBackward::parse)?,
            "--iters" => a.iters = one(value()?)?,
            "--head-dim" => {
                a.head_dim = Some(one(value()?)?)
                    .filter(|d| matches!(d, 64 | 128))
                    .ok_or("--head-dim takes 64 or 128")?
            }
            "--seq" => a.seq = Some(list(&flag, &value()?, positive)?),
            "--batch" => a.batch = one(value()?)?,
            "--heads" => a.heads = one(value()?)?,
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    Ok(a)
}

fn prim<const D: usize>(t: Tensor<G, D>) -> Ct {
    t.into_primitive().tensor()
}

fn wrap<const D: usize>(t: Ct) -> Tensor<G, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// GPU tensor (any float dtype) -> host f32 values.
fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32)
        .into_data()
        .to_vec::<f32>()
        .expect("f32 data")
}

/// (max |a - b|, max |a - b| / max |b|); NaN anywhere counts as an infinite error.
fn errors(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let (mut diff, mut scale) = (0.0f32, 0.0f32);
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

/// Causal attention and its gradients in f32 with Burn's ops on the GPU: `[o, lse, dq, dk, dv]`
/// for the upstream gradient `d_o`; with `documents`, only inside each document.
fn reference(
    q: &Tensor<G, 4>,
    k: &Tensor<G, 4>,
    v: &Tensor<G, 4>,
    d_o: &Tensor<G, 4>,
    documents: Option<&Documents>,
) -> [Vec<f32>; 5] {
    type A = Autodiff<G>;
    let [b, hq, s, d] = q.dims();
    let hkv = k.dims()[1];
    let dev = q.device();
    let leaf =
        |t: &Tensor<G, 4>| Tensor::<A, 4>::from_inner(t.clone().cast(DType::F32)).require_grad();
    let (qa, ka, va) = (leaf(q), leaf(k), leaf(v));
    // Query head h reads kv head h / (hq / hkv).
    let expand = |t: Tensor<A, 4>| {
        t.unsqueeze_dim::<5>(2)
            .expand([b, hkv, hq / hkv, s, d])
            .reshape([b, hq, s, d])
    };
    // Key j is hidden from query i of row r when it follows i or lies in another document.
    let doc =
        |r: usize, i: usize| documents.and_then(|ds| ds.spans(r).position(|sp| sp.contains(&i)));
    let hidden: Vec<bool> = (0..b)
        .flat_map(|r| (0..s).flat_map(move |i| (0..s).map(move |j| (r, i, j))))
        .map(|(r, i, j)| j > i || doc(r, i) != doc(r, j))
        .collect();
    let hidden = Tensor::<A, 4, Bool>::from_data(TensorData::new(hidden, [b, 1, s, s]), &dev);
    let scores = qa
        .clone()
        .matmul(expand(ka.clone()).swap_dims(2, 3))
        .mul_scalar(1.0 / (d as f64).sqrt())
        .mask_fill(hidden.expand([b, hq, s, s]), -1.0e30);
    let plain = scores.clone().inner();
    let max = plain.clone().max_dim(3);
    let lse = (plain - max.clone()).exp().sum_dim(3).log() + max;
    let o = softmax(scores, 3).matmul(expand(va.clone()));
    let grads = (o.clone() * Tensor::<A, 4>::from_inner(d_o.clone().cast(DType::F32)))
        .sum()
        .backward();
    let grad = |t: &Tensor<A, 4>| host(t.grad(&grads).expect("gradient"));
    [host(o.inner()), host(lse), grad(&qa), grad(&ka), grad(&va)]
}

/// Prints one comparison; returns whether it passed.
fn report(kernel: &str, shape: &str, name: &str, got: &[f32], want: &[f32]) -> bool {
    let (abs, rel) = errors(got, want);
    let ok = rel <= 2e-2 || abs <= 1e-4;
    println!(
        "{} {kernel:18} {shape:28} {name:3}: max_abs {abs:.3e} rel {rel:.3e}{}",
        if ok { "ok  " } else { "FAIL" },
        if ok { "" } else { "  <-- exceeds 2e-2" }
    );
    println!("RESULT|check|{kernel}|{shape}|{name}|{abs:e}|{rel:e}|{ok}");
    ok
}

/// Whether a `[B, H, S, D]` result lies in `[B, S, H, D]` memory order, as the kernels promise.
fn bshd(t: &Ct) -> bool {
    let sh = t.meta.shape();
    let want = [sh[2] * sh[1] * sh[3], sh[3], sh[1] * sh[3], 1];
    (0..4).all(|i| sh[i] == 1 || t.meta.strides()[i] == want[i])
}

/// Every kernel asked for on one shape; returns the number of failed comparisons.
fn check_shape(
    dev: &CudaDevice,
    args: &Args,
    (b, hq, hkv, s, d, gain): (usize, usize, usize, usize, usize, f32),
    view: bool,
) -> usize {
    // With `view`, inputs are [b, s, h, d] tensors viewed as [b, h, s, d] (the model's
    // reshape + swap_dims).
    let rnd = |h: usize, gain: f32| {
        let t = |shape| Tensor::<G, 4>::random(shape, Distribution::Normal(0.0, 1.0), dev) * gain;
        if view {
            t([b, s, h, d]).cast(DType::BF16).swap_dims(1, 2)
        } else {
            t([b, h, s, d]).cast(DType::BF16)
        }
    };
    let (q, k, v, d_o) = (rnd(hq, gain), rnd(hkv, 1.0), rnd(hkv, 1.0), rnd(hq, 1.0));
    let [o_ref, lse_ref, dq_ref, dk_ref, dv_ref] = reference(&q, &k, &v, &d_o, None);
    let scale = 1.0 / (d as f32).sqrt();
    let shape = format!(
        "B{b}_Hq{hq}_Hkv{hkv}_S{s}_D{d}{}{}",
        if gain == 1.0 {
            String::new()
        } else {
            format!("_q*{gain}")
        },
        if view { "_in-bshd" } else { "" }
    );
    let mut failed = 0;
    let mut saved = None;
    let layout = |kernel: &str, ts: &[&Ct]| {
        let ok = ts.iter().all(|t| bshd(t));
        if !ok {
            println!("FAIL {kernel:18} {shape:28}: outputs not in [B, S, H, D] memory order");
            println!("RESULT|check|{kernel}|{shape}|layout|0|0|false");
        }
        usize::from(!ok)
    };
    for &kernel in &args.forward {
        let (o, lse) = flash_forward_with(
            kernel,
            prim(q.clone()),
            prim(k.clone()),
            prim(v.clone()),
            scale,
        );
        failed += layout(kernel.name(), &[&o]);
        failed += usize::from(!report(
            kernel.name(),
            &shape,
            "O",
            &host(wrap::<4>(o.clone())),
            &o_ref,
        ));
        failed += usize::from(!report(
            kernel.name(),
            &shape,
            "lse",
            &host(wrap::<3>(lse.clone())),
            &lse_ref,
        ));
        saved.get_or_insert((o, lse));
    }
    let Some((o, lse)) = saved else { return failed };
    for &kernel in &args.backward {
        let (dq, dk, dv) = flash_backward_with(
            kernel,
            prim(q.clone()),
            prim(k.clone()),
            prim(v.clone()),
            o.clone(),
            lse.clone(),
            prim(d_o.clone()),
            scale,
        );
        failed += layout(kernel.name(), &[&dq, &dk, &dv]);
        for (name, got, want) in [
            ("dQ", dq, &dq_ref),
            ("dK", dk, &dk_ref),
            ("dV", dv, &dv_ref),
        ] {
            failed += usize::from(!report(
                kernel.name(),
                &shape,
                name,
                &host(wrap::<4>(got)),
                want,
            ));
        }
    }
    failed
}

/// Packed documents as training runs them (`ops::causal_attention_in_documents`: the default
/// flash kernels on each document's slice of its row, under Burn's autodiff) against the
/// block-causal reference; returns the number of failed comparisons.
fn check_documents(dev: &CudaDevice) -> usize {
    type A = Autodiff<G>;
    let mut failed = 0;
    // Documents of 1 token, lengths off every block size, a row with a single document.
    let cases: [(usize, usize, usize, Vec<Vec<usize>>); 2] = [
        (4, 2, 128, vec![vec![100, 37, 163], vec![300]]),
        (4, 4, 64, vec![vec![1, 511, 512]]),
    ];
    for (hq, hkv, d, rows) in cases {
        let (b, s) = (rows.len(), rows[0].iter().sum::<usize>());
        let shape = format!("B{b}_Hq{hq}_Hkv{hkv}_S{s}_D{d}_docs{rows:?}").replace(' ', "");
        let documents = Documents::from_lengths(s, rows).expect("documents");
        let rnd = |h: usize| {
            Tensor::<G, 4>::random([b, h, s, d], Distribution::Normal(0.0, 1.0), dev)
                .cast(DType::BF16)
        };
        let (q, k, v, d_o) = (rnd(hq), rnd(hkv), rnd(hkv), rnd(hq));
        let [o_ref, _, dq_ref, dk_ref, dv_ref] = reference(&q, &k, &v, &d_o, Some(&documents));
        let leaf = |t: &Tensor<G, 4>| Tensor::<A, 4>::from_inner(t.clone()).require_grad();
        let (qa, ka, va) = (leaf(&q), leaf(&k), leaf(&v));
        let o = smp_burn::ops::causal_attention_in_documents(
            qa.clone(),
            ka.clone(),
            va.clone(),
            &documents,
        );
        let grads = (o.clone() * Tensor::<A, 4>::from_inner(d_o))
            .sum()
            .backward();
        let grad = |t: &Tensor<A, 4>| host(t.grad(&grads).expect("gradient"));
        for (name, got, want) in [
            ("O", host(o.inner()), &o_ref),
            ("dQ", grad(&qa), &dq_ref),
            ("dK", grad(&ka), &dk_ref),
            ("dV", grad(&va), &dv_ref),
        ] {
            failed += usize::from(!report("documents", &shape, name, &got, want));
        }
    }
    failed
}

/// Runs the fragment helpers on exact small-integer products and compares with the host.
fn mma_probe(dev: &CudaDevice) -> bool {
    // Small integers: products and sums stay exact in bf16 (|s| <= 16 * 3 * 2 = 96) and f32.
    let fill = |f: fn(usize) -> usize, m: usize, c: f32| -> Vec<f32> {
        (0..256).map(|i| (f(i) % m) as f32 - c).collect()
    };
    let a = fill(|i| i / 16 * 3 + i % 16 * 5, 7, 3.0);
    let k = fill(|i| i / 16 * 2 + i % 16, 5, 2.0);
    let v = fill(|i| i / 16 + i % 16 * 3, 5, 2.0);
    let gpu = |x: &[f32]| {
        prim(
            Tensor::<G, 2>::from_data(TensorData::new(x.to_vec(), [16, 16]), dev).cast(DType::BF16),
        )
    };
    let (s, o, t, pos) = mma_fragment_probe(gpu(&a), gpu(&k), gpu(&v));
    let (s, o, t) = (host(wrap::<2>(s)), host(wrap::<2>(o)), host(wrap::<2>(t)));
    let pos: Vec<u32> = Tensor::<G, 2, Int>::from_primitive(pos)
        .into_data()
        .convert::<u32>()
        .to_vec()
        .expect("u32 data");
    // s = a k^T, o = s v, t = s^T v.
    let product = |x: &dyn Fn(usize, usize) -> f32, y: &dyn Fn(usize, usize) -> f32| -> Vec<f32> {
        (0..256)
            .map(|e| (0..16).map(|c| x(e / 16, c) * y(c, e % 16)).sum())
            .collect()
    };
    let s_ref = product(&|i, c| a[i * 16 + c], &|c, j| k[j * 16 + c]);
    let o_ref = product(&|i, c| s_ref[i * 16 + c], &|c, j| v[c * 16 + j]);
    let t_ref = product(&|i, c| s_ref[c * 16 + i], &|c, j| v[c * 16 + j]);
    let pos_want: Vec<u32> = (0..32u32)
        .flat_map(|l| [l / 4, l / 4 + 8, 2 * (l % 4)])
        .collect();
    let mut ok = pos == pos_want;
    println!(
        "{} mma fragment probe accumulator positions{}",
        if ok { "ok  " } else { "FAIL" },
        if ok {
            String::new()
        } else {
            format!("  <-- got {pos:?}, the row reductions assume {pos_want:?}")
        }
    );
    println!("RESULT|probe|positions|{}|{ok}", u8::from(!ok));
    for (name, got, want) in [
        ("S=QK^T", &s, &s_ref),
        ("O=PV", &o, &o_ref),
        ("T=S^TV(smem,ldmatrix.trans)", &t, &t_ref),
    ] {
        let (abs, _) = errors(got, want);
        let good = abs == 0.0;
        ok &= good;
        let first = (0..256).find(|&i| got[i] != want[i]).map(|i| {
            format!(
                "  <-- first mismatch [{},{}]: got {} want {}",
                i / 16,
                i % 16,
                got[i],
                want[i]
            )
        });
        println!(
            "{} mma fragment probe {name}: max_abs {abs:.3e}{}",
            if good { "ok  " } else { "FAIL" },
            first.unwrap_or_default()
        );
        println!("RESULT|probe|{name}|{abs:e}|{good}");
    }
    ok
}

fn sync(dev: &CudaDevice) {
    <G as Backend>::sync(dev).expect("device sync");
}

/// Mean seconds per call of `f` over `iters` calls after two warm-up calls.
fn time<T>(dev: &CudaDevice, iters: usize, mut f: impl FnMut() -> T) -> f64 {
    for _ in 0..2 {
        drop(f());
    }
    sync(dev);
    let start = Instant::now();
    for _ in 0..iters {
        drop(f());
    }
    sync(dev);
    start.elapsed().as_secs_f64() / iters as f64
}

/// Times every kernel asked for at one sequence length.
fn bench(dev: &CudaDevice, args: &Args, s: usize) {
    let (b, h, d) = (args.batch, args.heads, args.head_dim);
    let scale = 1.0 / (d as f32).sqrt();
    let rnd = || {
        prim(
            Tensor::<G, 4>::random([b, h, s, d], Distribution::Normal(0.0, 1.0), dev)
                .cast(DType::BF16),
        )
    };
    let (q, k, v, d_o) = (rnd(), rnd(), rnd(), rnd());
    let fwd_flops = 4.0 * (b * h) as f64 * (s * s * d) as f64 / 2.0;
    let line = |pass: &str, name: &str, secs: f64, flops: f64| {
        let tflops = flops / secs / 1e12;
        println!(
            "bench {pass} {name:12} causal B{b} H{h} D{d} S{s:6}: {:8.3} ms {tflops:7.1} TFLOP/s",
            secs * 1e3
        );
        println!(
            "RESULT|bench|{pass}-{name}|B{b}|{s}|{:.4}|{tflops:.2}",
            secs * 1e3
        );
    };
    let mut saved = None;
    for &kernel in &args.forward {
        let fwd = || flash_forward_with(kernel, q.clone(), k.clone(), v.clone(), scale);
        line("fwd", kernel.name(), time(dev, args.iters, fwd), fwd_flops);
        saved.get_or_insert_with(fwd);
    }
    let Some((o, lse)) = saved else { return };
    for &kernel in &args.backward {
        let bwd = || {
            flash_backward_with(
                kernel,
                q.clone(),
                k.clone(),
                v.clone(),
                o.clone(),
                lse.clone(),
                d_o.clone(),
                scale,
            )
        };
        line(
            "bwd",
            kernel.name(),
            time(dev, args.iters, bwd),
            2.5 * fwd_flops,
        );
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return;
    }
    let mut args = parse_args(argv).unwrap_or_else(|e| {
        eprintln!("flash_check: {e}\n{USAGE}");
        std::process::exit(2);
    });
    // Keeps the compiled kernels in the user's cache folder, as the trainer does.
    let _ = smp_burn::cuda::configure_kernel_cache();
    let dev = CudaDevice::new(0);
    let client = CudaRuntime::client(&dev);
    if !mma_supported(&client, DType::BF16) {
        eprintln!(
            "flash_check: this device has no bf16 mma.sync m16n8k16 (sm_80+): no flash kernel \
             runs here"
        );
        std::process::exit(2);
    }
    let skipped: Vec<&str> = args
        .forward
        .iter()
        .filter(|&&f| !forward_supported(&client, f))
        .map(|f| f.name())
        .chain(
            args.backward
                .iter()
                .filter(|&&b| !backward_supported(&client, b))
                .map(|b| b.name()),
        )
        .collect();
    if !skipped.is_empty() {
        println!(
            "flash_check: this device or build does not run {}: skipped",
            skipped.join(", ")
        );
    }
    args.forward.retain(|&f| forward_supported(&client, f));
    args.backward.retain(|&b| backward_supported(&client, b));
    for d in [64, 128] {
        let (f, b) = current_kernels(&client, d);
        println!(
            "flash_check: defaults here at head dim {d}: forward {}, backward {}",
            f.name(),
            b.name()
        );
    }

    let mut failures = 0usize;
    if args.check {
        failures += usize::from(!mma_probe(&dev));
        // (B, Hq, Hkv, S, D, gain on q): odd lengths, GQA and MHA, both head dims; a gain of 20
        // makes the softmax sharp, so row maxima jump by more than the forward's rescale slack.
        let mut shapes = vec![
            (1, 4, 2, 1, 64, 1.0),
            (2, 4, 2, 77, 64, 1.0),
            (1, 4, 2, 200, 128, 1.0),
            (1, 4, 4, 129, 128, 1.0),
            (2, 4, 1, 65, 64, 1.0),
            (1, 4, 2, 300, 64, 20.0),
        ];
        if !args.quick {
            shapes.extend([
                (1, 4, 2, 1000, 128, 1.0),
                (1, 4, 2, 1024, 128, 1.0),
                (1, 4, 2, 1024, 64, 1.0),
                (1, 2, 2, 333, 128, 1.0),
                (1, 4, 2, 1024, 128, 20.0),
            ]);
        }
        for (i, &shape) in shapes.iter().enumerate() {
            failures += check_shape(&dev, &args, shape, i % 2 == 1);
        }
        failures += check_documents(&dev);
        if failures == 0 {
            println!("flash_check: all checks passed");
        } else {
            println!("flash_check: {failures} check(s) FAILED (see FAIL lines above)");
        }
    }
    if args.bench {
        let lens = match &args.seq {
            Some(l) => l.clone(),
            None if args.quick => vec![4096],
            None => vec![4096, 16384],
        };
        for s in lens {
            bench(&dev, &args, s);
        }
    }
    if failures > 0 {
        std::process::exit(1);
    }
}
