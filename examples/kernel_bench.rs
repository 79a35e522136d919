//! Checks and times smp-burn's fast CUDA paths against their references.
//!
//! `kernel_bench check`: every fast op against the reference op on fresh random inputs (forward
//! and gradients), odd shapes included; exits non-zero on a miss.
//! `kernel_bench attention`: only the attention part of `check`.
//! `kernel_bench accumulate`: an FSDP unit's weight gradient summed over micro-batches by its
//! GEMMs, against an f64 host sum (also part of `check`).
//! `kernel_bench xent`: only the LM-head loss part of `check` (fused softmax kernels against
//! Burn's ops), with the time of each.
//! `kernel_bench embed`: only the embedding-gradient part of `check` (one kernel against Burn's
//! `select_assign`), with the time of each.
//! `kernel_bench init`: only the seeded-initialization part of `check` (the GPU's draw against
//! the host's, value by value), with the time of each.
//! `kernel_bench adamw`: the fused AdamW and gradient-norm (weighted sum of squares) checks, then
//! their bandwidth against the Burn-ops versions.
//! `kernel_bench offload`: activation offloading (`smp_burn::offload`): the values must come back
//! bit for bit (bf16 and f32, odd shapes), then device-to-host and host-to-device GB/s for a
//! Llama 2 7B layer input at S=4096 (32 MiB of bf16), and how long the host waits in `settle`
//! when the copy is queued behind half a second of GEMMs (it should not wait for them: the copy is
//! waited for a layer later in training, when the queue has moved on).
//! `kernel_bench gemm`: linear-layer GEMM TFLOP/s at the Llama 1B and 7B shapes, three ways in
//! one process: our cuBLAS linear on Burn tensors (ordering included), Burn's stock matmul, and
//! cuBLAS called directly on raw buffers (the goal: ours at least 95 % of direct).
//! Run `python3 scripts/torch_gemm.py` beside it for PyTorch's figure at the same shapes.
//! `kernel_bench fp8`: the FP8 linear layer (`ops::linear_fp8` under the `tensorwise` recipe)
//! checked against an emulation on the host (inputs scaled and rounded to E4M3 / E5M2 by
//! `smp_burn::fp8`'s rounding model, then multiplied in f32) and against the bf16 linear, for
//! the forward, `dx` and `dw`; then its TFLOP/s beside the bf16 linear's at the Llama 1B and 7B
//! shapes (forward, and forward + backward).
//! `kernel_bench gemm-fb`: where the time of `gemm`'s forward + backward column goes, at the 1B
//! MLP shape: host time to build the forward (and the `sum`), host time inside `backward()`, and
//! the wait for the device after it, with and without the `sum` (a backward from a tensor seeds
//! its gradient with ones).

use std::time::Instant;

use burn::backend::Autodiff;
use burn::tensor::{DType, Distribution, Tensor, TensorPrimitive, backend::Backend};
use cudarc::cublas::{CudaBlas, result as cbr, sys as cbs};
use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut};
use half::bf16;
use smp_burn::cuda::CudaCube;
use smp_burn::cuda::adamw::{AdamWStep, adamw_step, weighted_sq_sum};
use smp_burn::fast::FastPaths;
use smp_burn::ops;
use smp_burn::optim::RunRates;

type B = CudaCube;
type Ad = Autodiff<B>;

fn device() -> burn_cuda::CudaDevice {
    burn_cuda::CudaDevice::new(0)
}

type Cpu = burn::backend::NdArray<f32>;

/// max |a - b| / max |b|, on the host. The scale is floored at 1e-3 because some exact results
/// are zero (attention's dq and dk at sequence length 1: softmax over one key has no gradient),
/// where the reference holds 0 and ours f32 rounding noise; inputs are N(0, 1), so any real
/// error shows far above that floor.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0f32, f32::max);
    diff / scale.max(1e-3)
}

fn host<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap()
}

/// `y = linear(x, w)` and the gradients of `sum(y * r) - sum(linear(x, w) * r) / 2` on any
/// backend, with x and w in `dtype`. The second linear shares the input as q/k/v do: its
/// backward runs first, and the first one's `dx` is added into its gradient by the GEMM.
fn linear_grads<Bk: Backend>(
    x: &Tensor<Bk, 3>,
    w: &Tensor<Bk, 2>,
    r: &Tensor<Bk, 3>,
    dtype: DType,
) -> [Vec<f32>; 3] {
    let xa = Tensor::<Autodiff<Bk>, 3>::from_inner(x.clone().cast(dtype)).require_grad();
    let wa = Tensor::<Autodiff<Bk>, 2>::from_inner(w.clone().cast(dtype)).require_grad();
    let y = ops::linear(xa.clone(), wa.clone());
    let second = ops::linear(xa.clone(), wa.clone());
    let loss = (y.clone().cast(DType::F32) * Tensor::from_inner(r.clone())).sum()
        - (second.cast(DType::F32) * Tensor::from_inner(r.clone() * 0.5)).sum();
    let g = loss.backward();
    [
        host(y.inner()),
        host(xa.grad(&g).expect("dx")),
        host(wa.grad(&g).expect("dw")),
    ]
}

/// Our cuBLAS linear (forward, dx, dw) against the f32 reference on the CPU (NdArray) from the
/// same rounded inputs. The reference runs on the host because Burn's CUDA matmul computes f32
/// in TF32 (a 10-bit mantissa: 3e-4 relative error even with one term), which would hide an
/// f32 error of ours.
fn check() -> bool {
    let dev = device();
    let cpu = Default::default();
    let mut ok = true;
    // (batch, rows, in, out): odd sizes, a single element, and Llama-1B shapes.
    let shapes = [
        (1, 1, 1, 1),
        (1, 3, 5, 7),
        (2, 77, 130, 65),
        (1, 512, 2048, 2048),
        (1, 4096, 2048, 5632),
    ];
    // bf16: the output is rounded to 8 bits of mantissa (2^-9 relative), so 2e-2 of the
    // largest value leaves room for accumulated rounding; f32 (strict FP32 accumulation in
    // cuBLAS): summation order only.
    for (dtype, tol) in [(DType::BF16, 2e-2f32), (DType::F32, 1e-5)] {
        for &(b, m, k, n) in &shapes {
            // Drawn and rounded to `dtype` on the GPU (NdArray has no bf16), then copied to
            // the CPU for the reference.
            let x = Tensor::<B, 3>::random([b, m, k], Distribution::Normal(0.0, 1.0), &dev)
                .cast(dtype)
                .cast(DType::F32);
            let w = Tensor::<B, 2>::random([n, k], Distribution::Normal(0.0, 0.05), &dev)
                .cast(dtype)
                .cast(DType::F32);
            let r = Tensor::<B, 3>::random([b, m, n], Distribution::Normal(0.0, 1.0), &dev);
            let to_cpu3 = |t: &Tensor<B, 3>| Tensor::<Cpu, 3>::from_data(t.to_data(), &cpu);
            let wc = Tensor::<Cpu, 2>::from_data(w.to_data(), &cpu);
            let reference = linear_grads(&to_cpu3(&x), &wc, &to_cpu3(&r), DType::F32);
            smp_burn::KernelConfig::update(|c| c.fast_paths = FastPaths::ALL).unwrap();
            let ours = linear_grads(&x, &w, &r, dtype);
            let e: Vec<f32> = (0..3).map(|i| rel_err(&ours[i], &reference[i])).collect();
            let pass = e.iter().all(|&v| v <= tol);
            ok &= pass;
            println!(
                "linear {dtype:?} x[{b},{m},{k}] w[{n},{k}]: rel err y {:.2e} dx {:.2e} dw {:.2e} \
                 (tolerance {tol:.0e}) {}",
                e[0],
                e[1],
                e[2],
                if pass { "ok" } else { "FAIL" }
            );
        }
    }
    ok
}

/// The LM-head loss (`ops::linear_cross_entropy`, chunked) with the fused softmax kernels
/// (fast path `xent`) against the same loss through Burn's ops, on the same GPU from the same
/// inputs: the loss and both gradients, then the time of forward + backward each way.
fn check_xent() -> bool {
    let dev = device();
    let mut ok = true;
    // (tokens, hidden, vocab, dtype): odd vocabularies (vector width 1 and 8), a single token,
    // and the 1b shape (two 2,048-token chunks of a 32,000 vocabulary).
    let cases = [
        (1, 64, 7, DType::F32),
        (3, 64, 1001, DType::F32),
        (257, 128, 1000, DType::BF16),
        (77, 64, 32000, DType::F32),
        (4096, 2048, 32000, DType::BF16),
    ];
    for (tokens, hidden, vocab, dtype) in cases {
        let x = Tensor::<B, 2>::random([tokens, hidden], Distribution::Normal(0.0, 1.0), &dev)
            .cast(dtype);
        let w = Tensor::<B, 2>::random([vocab, hidden], Distribution::Normal(0.0, 0.05), &dev)
            .cast(dtype);
        let targets = Tensor::<B, 1, burn::tensor::Int>::random(
            [tokens],
            Distribution::Uniform(0.0, (vocab - 1) as f64),
            &dev,
        );
        // The loss and both gradients, left on the device.
        let run = |xent: bool| {
            smp_burn::KernelConfig::update(|c| {
                c.fast_paths = FastPaths {
                    xent,
                    ..FastPaths::ALL
                }
            })
            .unwrap();
            let xa = Tensor::<Ad, 2>::from_inner(x.clone()).require_grad();
            let wa = Tensor::<Ad, 2>::from_inner(w.clone()).require_grad();
            let targets = Tensor::from_inner(targets.clone());
            let loss = ops::linear_cross_entropy(xa.clone(), wa.clone(), targets);
            let g = loss.backward();
            let (dx, dw) = (xa.grad(&g).expect("dx"), wa.grad(&g).expect("dw"));
            (loss.inner(), dx, dw)
        };
        let on_host = |(loss, dx, dw): (Tensor<B, 1>, Tensor<B, 2>, Tensor<B, 2>)| {
            [host(loss), host(dx), host(dw)]
        };
        let (ours, reference) = (on_host(run(true)), on_host(run(false)));
        let e: Vec<f32> = (0..3).map(|i| rel_err(&ours[i], &reference[i])).collect();
        // The same f32 arithmetic in another order (sums over the vocabulary), then rounded
        // to the dtype for the gradients: bf16's 2^-9, with room for a rounding flip; f32:
        // summation order only.
        let tol = if dtype == DType::BF16 { 1e-2 } else { 1e-5 };
        let pass = e.iter().all(|&v| v <= tol);
        ok &= pass;
        let ms = |xent: bool| {
            time(5, || {
                let _ = run(xent);
            }) * 1e3
        };
        let (t_ours, t_ref) = (ms(true), ms(false));
        println!(
            "xent {dtype:?} x[{tokens},{hidden}] w[{vocab},{hidden}]: loss {:.5} vs {:.5}, rel err \
             loss {:.2e} dx {:.2e} dw {:.2e} (tolerance {tol:.0e}) {}; fwd+bwd {t_ours:.2} ms \
             fused, {t_ref:.2} ms Burn ops",
            ours[0][0],
            reference[0][0],
            e[0],
            e[1],
            e[2],
            if pass { "ok" } else { "FAIL" }
        );
    }
    smp_burn::KernelConfig::update(|c| c.fast_paths = FastPaths::ALL).unwrap();
    ok
}

/// The embedding's table gradient through [`smp_burn::cuda::embedding`] (fast path `embed`)
/// and through Burn's `select_assign`, each against the sum computed on the host in f64 from
/// the same ids and upstream gradient; ids drawn from a small range so that tokens repeat (and
/// from the whole table for the 1b shape). Only ours must pass; Burn's error is printed beside
/// it (it adds in the table's dtype, so bf16 rows with many repeats drift).
fn check_embedding() -> bool {
    let dev = device();
    let mut ok = true;
    // (tokens, dim, vocab, ids drawn below, dtype): repeats, odd widths, the 1b shape.
    let cases = [
        (1, 8, 5, 5, DType::F32),
        (77, 24, 300, 7, DType::F32),
        (257, 100, 1000, 1000, DType::BF16),
        (4096, 2048, 32000, 2048, DType::BF16),
        (4096, 2048, 32000, 32000, DType::BF16),
    ];
    for (tokens, dim, vocab, draw, dtype) in cases {
        let w =
            Tensor::<B, 2>::random([vocab, dim], Distribution::Normal(0.0, 1.0), &dev).cast(dtype);
        let ids = Tensor::<B, 2, burn::tensor::Int>::random(
            [1, tokens],
            Distribution::Uniform(0.0, draw as f64),
            &dev,
        );
        let r = Tensor::<B, 3>::random([1, tokens, dim], Distribution::Normal(0.0, 1.0), &dev)
            .cast(dtype);
        let run = |embed: bool| {
            smp_burn::KernelConfig::update(|c| {
                c.fast_paths = FastPaths {
                    embed,
                    ..FastPaths::ALL
                }
            })
            .unwrap();
            let wa = Tensor::<Ad, 2>::from_inner(w.clone()).require_grad();
            let y = ops::embedding(wa.clone(), Tensor::from_inner(ids.clone()));
            let g = (y * Tensor::from_inner(r.clone())).sum().backward();
            wa.grad(&g).expect("dw")
        };
        let (ours, burn) = (host(run(true)), host(run(false)));
        let (hid, hr): (Vec<i64>, Vec<f32>) = (
            ids.clone().into_data().convert::<i64>().to_vec().unwrap(),
            host(r.clone()),
        );
        let mut exact = vec![0f64; vocab * dim];
        for (t, &id) in hid.iter().enumerate() {
            for c in 0..dim {
                exact[id as usize * dim + c] += hr[t * dim + c] as f64;
            }
        }
        let exact: Vec<f32> = exact.into_iter().map(|v| v as f32).collect();
        let (e, e_burn) = (rel_err(&ours, &exact), rel_err(&burn, &exact));
        // Summed in f32 in token order, rounded once to the dtype: f32 rounding of a few
        // terms, or half a bf16 step (2^-9) plus that.
        let tol = if dtype == DType::BF16 { 5e-3 } else { 1e-5 };
        let pass = e <= tol;
        ok &= pass;
        let ms = |embed: bool| {
            time(5, || {
                let _ = run(embed);
            }) * 1e3
        };
        let (t_ours, t_ref) = (ms(true), ms(false));
        println!(
            "embed {dtype:?} ids[{tokens}] < {draw} table[{vocab},{dim}]: dw rel err {e:.2e} \
             (tolerance {tol:.0e}) {} (select_assign {e_burn:.2e}); fwd+bwd {t_ours:.3} ms \
             ours, {t_ref:.3} ms select_assign",
            if pass { "ok" } else { "FAIL" }
        );
    }
    smp_burn::KernelConfig::update(|c| c.fast_paths = FastPaths::ALL).unwrap();
    ok
}

/// Flash attention through the autodiff op (the path the model takes) against the reference
/// attention on the same GPU in f32 from the same bf16-rounded inputs: output and the three
/// input gradients of `sum(o * r)`.
fn check_attention() -> bool {
    let dev = device();
    let mut ok = true;
    // (batch, q heads, kv heads, seq, head dim): GQA, odd lengths, both head dims.
    for (b, hq, hkv, s, d) in [
        (1, 4, 2, 1, 64),
        (2, 4, 2, 77, 64),
        (1, 8, 8, 200, 128),
        (1, 8, 2, 1024, 128),
    ] {
        let rnd = |shape: [usize; 4]| {
            Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), &dev)
                .cast(DType::BF16)
                .cast(DType::F32)
        };
        let (q, k, v) = (rnd([b, hq, s, d]), rnd([b, hkv, s, d]), rnd([b, hkv, s, d]));
        let r = Tensor::<B, 4>::random([b, hq, s, d], Distribution::Normal(0.0, 1.0), &dev);
        let run = |dtype: DType, fast: bool| -> [Vec<f32>; 4] {
            smp_burn::KernelConfig::update(|c| {
                c.fast_paths = if fast {
                    FastPaths::ALL
                } else {
                    FastPaths::NONE
                }
            })
            .unwrap();
            let leaf = |t: &Tensor<B, 4>| {
                Tensor::<Ad, 4>::from_inner(t.clone().cast(dtype)).require_grad()
            };
            let (qa, ka, va) = (leaf(&q), leaf(&k), leaf(&v));
            let o = ops::causal_attention(qa.clone(), ka.clone(), va.clone());
            let g = (o.clone().cast(DType::F32) * Tensor::from_inner(r.clone()))
                .sum()
                .backward();
            let out = [
                host(o.inner()),
                host(qa.grad(&g).expect("dq")),
                host(ka.grad(&g).expect("dk")),
                host(va.grad(&g).expect("dv")),
            ];
            smp_burn::KernelConfig::update(|c| c.fast_paths = FastPaths::ALL).unwrap();
            out
        };
        let ours = run(DType::BF16, true);
        let reference = run(DType::F32, false);
        let e: Vec<f32> = (0..4).map(|i| rel_err(&ours[i], &reference[i])).collect();
        // bf16 inputs and outputs, probabilities rounded to bf16 before P V (as flash-attention
        // 2 does): 2e-2 of the largest value (of 1e-3 where the reference is all zero).
        let tol = 2e-2;
        let pass = e.iter().all(|&v| v <= tol);
        ok &= pass;
        println!(
            "attention bf16 b{b} hq{hq} hkv{hkv} s{s} d{d}: rel err o {:.2e} dq {:.2e} dk {:.2e} dv {:.2e} {}",
            e[0],
            e[1],
            e[2],
            e[3],
            if pass { "ok" } else { "FAIL" }
        );
    }
    ok
}

/// The reference AdamW update (what `fsdp::ShardedUnit::adamw_step` computes with Burn ops) on
/// the host in f64, for one element.
fn adamw_ref(p: f32, g: f32, m: f32, v: f32, hp: &AdamWStep, rates: &RunRates) -> [f32; 3] {
    let (p, g, m, v) = (p as f64, g as f64, m as f64, v as f64);
    let (b1, b2) = (hp.beta1 as f64, hp.beta2 as f64);
    let m = m * b1 + g * (1.0 - b1);
    let v = v * b2 + g * g * (1.0 - b2);
    let denom = (v * hp.inv_bias2 as f64).sqrt() + hp.eps as f64;
    let lr = hp.lr as f64 * rates.lr_scale as f64;
    let decay = lr * rates.weight_decay as f64;
    let p = p - p * decay - m * hp.inv_bias1 as f64 / denom * lr;
    [p as f32, m as f32, v as f32]
}

fn adamw_hp(step: i32) -> AdamWStep {
    let (beta1, beta2) = (0.9f32, 0.95f32);
    AdamWStep {
        lr: 3e-4,
        beta1,
        beta2,
        eps: 1e-8,
        inv_bias1: 1.0 / (1.0 - beta1.powi(step)),
        inv_bias2: 1.0 / (1.0 - beta2.powi(step)),
    }
}

/// A run's rates: weight decay 0.1 where it decays, and a learning-rate scale.
fn rates(decays: bool, lr_scale: f32) -> RunRates {
    RunRates {
        lr_scale,
        weight_decay: if decays { 0.1 } else { 0.0 },
    }
}

/// The fused AdamW kernel against the f64 host reference on random state, odd lengths and
/// several decay runs, with a clipping factor read from the device; f32 and bf16 gradients,
/// f32 and bf16 moments.
fn check_adamw() -> bool {
    let dev = device();
    let mut ok = true;
    for case in [
        (1usize, vec![(0..1, rates(true, 1.0))]),
        (
            1000,
            vec![(0..600, rates(true, 1.0)), (600..1000, rates(false, 0.5))],
        ),
        (
            4097,
            vec![
                (0..7, rates(false, 1.0)),
                (7..4000, rates(true, 2.0)),
                (4000..4097, rates(false, 1.0)),
            ],
        ),
    ]
    .into_iter()
    .flat_map(|case| {
        [
            (case.clone(), DType::F32, DType::F32),
            (case.clone(), DType::BF16, DType::F32),
            (case, DType::BF16, DType::BF16),
        ]
    }) {
        let ((len, runs), grad_dtype, moment_dtype) = case;
        let rnd = |scale: f32| {
            Tensor::<B, 1>::random([len], Distribution::Normal(0.0, scale as f64), &dev)
        };
        // The reference reads the gradient as the kernel does: rounded to its dtype.
        let (p, g, m) = (
            rnd(1.0),
            rnd(1.0).cast(grad_dtype),
            rnd(0.1).cast(moment_dtype),
        );
        let v = rnd(0.01).abs().cast(moment_dtype);
        let scale = Tensor::<B, 1>::from_floats([0.5], &dev);
        let hp = adamw_hp(3);
        let h = |t: &Tensor<B, 1>| host(t.clone());
        let (hp_, hg, hm, hv) = (h(&p), h(&g), h(&m), h(&v));
        let prim = |t: &Tensor<B, 1>| t.clone().into_primitive().tensor();
        // The bf16-gradient cases also ask for the bf16 copy of the updated weights.
        let copy_dtype = (grad_dtype == DType::BF16).then_some(DType::BF16);
        let (np, nm, nv, copy) = adamw_step(
            prim(&p).copy(),
            prim(&m).copy(),
            prim(&v).copy(),
            prim(&g),
            prim(&scale),
            hp,
            &runs,
            copy_dtype,
        );
        let float = |c| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(c));
        // The copy must be the updated master rounded to bf16, bit for bit.
        let copy_ok = match copy {
            None => copy_dtype.is_none(),
            Some(c) => {
                let want = host(float(np.clone()).cast(DType::BF16));
                let got = host(float(c));
                got.len() == want.len()
                    && got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
            }
        };
        let back = |c| host(float(c).cast(DType::F32));
        let got = [back(np), back(nm), back(nv)];
        let mut want = [vec![0f32; len], vec![0f32; len], vec![0f32; len]];
        for (r, run_rates) in &runs {
            for i in r.clone() {
                let w = adamw_ref(hp_[i], hg[i] * 0.5, hm[i], hv[i], &hp, run_rates);
                for k in 0..3 {
                    want[k][i] = w[k];
                }
            }
        }
        let e: Vec<f32> = (0..3).map(|k| rel_err(&got[k], &want[k])).collect();
        // f32 arithmetic against f64: a few ulps of the largest value. Moments stored in bf16
        // are rounded to nearest: half a bf16 ulp, up to 2^-8 of the value (H100: 2.0e-3 to
        // 3.0e-3). The weights' update takes them before rounding, so the master stays within
        // f32's tolerance.
        let moment_tolerance = if moment_dtype == DType::BF16 {
            4e-3
        } else {
            1e-5
        };
        let pass = e[0] <= 1e-5 && e[1..].iter().all(|&x| x <= moment_tolerance) && copy_ok;
        ok &= pass;
        println!(
            "adamw grad {grad_dtype:?} moments {moment_dtype:?} len {len} runs {}: rel err master {:.2e} exp_avg {:.2e} exp_avg_sq {:.2e} (tolerance 1e-5, moments {moment_tolerance:.0e}), copy {} {}",
            runs.len(),
            e[0],
            e[1],
            e[2],
            match copy_dtype {
                Some(_) if copy_ok => "bf16 bitwise",
                Some(_) => "WRONG",
                None => "none",
            },
            if pass { "ok" } else { "FAIL" }
        );
    }
    ok
}

/// Fused AdamW against the Burn-ops reference (the same formula as
/// `fsdp::ShardedUnit::adamw_step`'s fallback) on a 7B-on-two-GPUs-sized shard slice.
fn bench_adamw() {
    let dev = device();
    let n = 1usize << 28;
    let rnd = || Tensor::<B, 1>::random([n], Distribution::Normal(0.0, 0.01), &dev);
    let g = rnd();
    let scale = Tensor::<B, 1>::from_floats([1.0], &dev);
    let hp = adamw_hp(10);
    let runs = [
        (0..n - 4096, rates(true, 1.0)),
        (n - 4096..n, rates(false, 1.0)),
    ];
    let prim = |t: Tensor<B, 1>| t.into_primitive().tensor();
    // Moved in and out by value so that every buffer is uniquely held and updated in place,
    // as in training (a second handle would make the kernel copy first).
    let mut state = Some((prim(rnd()), prim(rnd()), prim(rnd().abs())));
    let fused_with = |state: &mut Option<_>, copy_dtype: Option<DType>| {
        time(10, || {
            let (a, b, c) = state.take().expect("state is put back after each call");
            let (a, b, c, _copy) = adamw_step(
                a,
                b,
                c,
                prim(g.clone()),
                prim(scale.clone()),
                hp,
                &runs,
                copy_dtype,
            );
            *state = Some((a, b, c));
        })
    };
    let fused = fused_with(&mut state, None);
    let fused_copy = fused_with(&mut state, Some(DType::BF16));
    // The moments in bf16, with the copy: 22 bytes per parameter.
    let mut state = state.map(|(a, b, c)| {
        let bf16 =
            |t| prim(Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t)).cast(DType::BF16));
        (a, bf16(b), bf16(c))
    });
    let fused_bf16_moments = fused_with(&mut state, Some(DType::BF16));
    drop(state);
    let (mut p, mut m, mut v) = (rnd(), rnd(), rnd().abs());
    let mask = Tensor::cat(
        vec![
            Tensor::<B, 1>::ones([n - 4096], &dev),
            Tensor::<B, 1>::zeros([4096], &dev),
        ],
        0,
    );
    let (b1, b2) = (hp.beta1 as f64, hp.beta2 as f64);
    let reference = time(5, || {
        let gg = g.clone() * scale.clone();
        m = m.clone() * b1 + gg.clone() * (1.0 - b1);
        v = v.clone() * b2 + gg.square() * (1.0 - b2);
        let denom = (v.clone() * hp.inv_bias2 as f64).sqrt() + hp.eps as f64;
        let update = m.clone() * hp.inv_bias1 as f64 / denom;
        let decayed = p.clone() - p.clone() * mask.clone() * (hp.lr * 0.1) as f64;
        p = decayed - update * hp.lr as f64;
    });
    let bytes = 28.0 * n as f64;
    println!(
        "adamw {n} f32 params: fused {:.3} ms ({:.0} GB/s effective, 28 B/param), with the bf16 \
         copy {:.3} ms ({:.0} GB/s, 30 B/param), bf16 moments and the copy {:.3} ms ({:.0} GB/s, \
         22 B/param), Burn ops {:.3} ms ({:.1}x)",
        fused * 1e3,
        bytes / fused / 1e9,
        fused_copy * 1e3,
        30.0 * n as f64 / fused_copy / 1e9,
        fused_bf16_moments * 1e3,
        22.0 * n as f64 / fused_bf16_moments / 1e9,
        reference * 1e3,
        reference / fused
    );
}

/// The weighted sum of squares against an f64 host sum: odd lengths, several runs with their
/// own weights, elements outside every run, and a length over one cube's grid-stride share.
fn check_sq_sum() -> bool {
    let dev = device();
    let mut ok = true;
    for case in [
        (1usize, vec![(0..1, 1.0f32)]),
        (1000, vec![(0..600, 1.0), (600..1000, 0.25)]),
        (4097, vec![(7..4000, 1.0), (4000..4097, 0.5)]),
        (
            3_000_001,
            vec![(0..2_999_000, 1.0), (2_999_000..3_000_001, 0.5)],
        ),
        (10, vec![]),
    ]
    .into_iter()
    .flat_map(|case| [(case.clone(), DType::F32), (case, DType::BF16)])
    {
        let ((len, runs), dtype) = case;
        let x = Tensor::<B, 1>::random([len], Distribution::Normal(0.0, 1.0), &dev).cast(dtype);
        let hx = host(x.clone());
        let want: f64 = runs
            .iter()
            .map(|(r, w)| {
                *w as f64
                    * hx[r.clone()]
                        .iter()
                        .map(|&v| (v as f64).powi(2))
                        .sum::<f64>()
            })
            .sum();
        let got = host(Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(
            weighted_sq_sum(x.into_primitive().tensor(), &runs),
        )))[0] as f64;
        let err = (got - want).abs() / want.max(1e-30);
        // f32 partial sums over up to millions of terms: a few 1e-7 per level of the tree.
        let pass = if runs.is_empty() {
            got == 0.0
        } else {
            err <= 1e-5
        };
        ok &= pass;
        println!(
            "sq_sum {dtype:?} len {len} runs {}: {got:.6e} against {want:.6e}, rel err {err:.2e} (tolerance 1e-5) {}",
            runs.len(),
            if pass { "ok" } else { "FAIL" }
        );
    }
    ok
}

/// A linear layer behind an elementwise scale: the scale's gradient comes from Burn's autodiff,
/// the matrix's from the linear layer's GEMM. The backend generic must be named `B`: Burn's
/// `derive(Module)` finds parameters only through a generic of that name.
#[derive(burn::module::Module, Debug)]
struct ScaledLinear<B: Backend> {
    weight: burn::module::Param<Tensor<B, 2>>,
    scale: burn::module::Param<Tensor<B, 1>>,
}

/// Gradient accumulation over micro-batches through an FSDP unit: from the second micro-batch
/// on, the weight's gradient GEMM adds straight into the unit's f32 sum. Both ways (the
/// `accumulate` fast path on and off) against the host's exact sum of `g_i^T x_i` over bf16
/// inputs in which only the first micro-batch's gradient is rounded to bf16 (it is computed
/// before there is a sum to add into, in the compute dtype): the fused path must match it to
/// 1e-4 of its largest value, allowing one bf16 step of that first gradient where cuBLAS's f32
/// sum rounds to the other neighbour, and its RMS error must be at least 4x smaller than that of
/// the path that rounds every micro-batch's gradient, which shows the GEMMs added into the sum.
/// The scale's gradient (packed and added as before) must agree between the two within bf16
/// rounding (1e-2).
fn check_grad_accumulation() -> bool {
    use burn::module::Initializer;
    use smp_burn::fsdp::{FsdpContext, ShardedUnit};
    let (tokens, k, n, micro_batches) = (256usize, 512usize, 384usize, 4usize);
    let dev = device();
    let inputs: Vec<(Tensor<B, 2>, Tensor<B, 2>)> = (0..micro_batches)
        .map(|_| {
            let x = Tensor::<B, 2>::random([tokens, k], Distribution::Normal(0.0, 1.0), &dev);
            let g = Tensor::<B, 2>::random([tokens, n], Distribution::Normal(0.0, 1.0), &dev);
            (x.cast(DType::BF16), g.cast(DType::BF16))
        })
        .collect();
    // Each micro-batch's g_i^T x_i in f64 from the bf16 values (the scale starts at 1: x * 1 is
    // exact); the first rounded to bf16 as the GEMM writes it, the rest summed exactly.
    let products: Vec<Vec<f64>> = inputs
        .iter()
        .map(|(x, g)| {
            let (x, g) = (host(x.clone()), host(g.clone()));
            let mut dw = vec![0f64; n * k];
            for t in 0..tokens {
                for r in 0..n {
                    let gv = g[t * n + r] as f64;
                    let row = &mut dw[r * k..(r + 1) * k];
                    for (w, xv) in row.iter_mut().zip(&x[t * k..(t + 1) * k]) {
                        *w += gv * *xv as f64;
                    }
                }
            }
            dw
        })
        .collect();
    let first: Vec<f64> = products[0]
        .iter()
        .map(|v| bf16::from_f64(*v).to_f64())
        .collect();
    let want: Vec<f64> = (0..n * k)
        .map(|e| first[e] + products[1..].iter().map(|p| p[e]).sum::<f64>())
        .collect();
    let mut results = Vec::new();
    for fused in [true, false] {
        smp_burn::KernelConfig::update(|c| c.fast_paths.accumulate = fused)
            .expect("a valid configuration");
        let out = collectives::run_on_threads(1, Default::default(), |comm| {
            let config = smp_burn::ParallelConfig {
                param_dtype: smp_burn::config::Precision::Bf16,
                ..Default::default()
            };
            let ctx = FsdpContext::<B>::new(
                std::sync::Arc::new(smp_burn::HostTensorComm::new(comm)),
                None,
                &config,
            );
            let template = ScaledLinear::<Ad> {
                weight: Initializer::Zeros.init([n, k], &dev),
                scale: Initializer::Ones.init([k], &dev),
            };
            let init = |p: &smp_burn::fsdp::FlatParam, range: std::ops::Range<usize>| {
                let rule = if p.shape.len() == 2 {
                    smp_burn::init::InitRule::Normal { std: 0.02 }
                } else {
                    smp_burn::init::InitRule::Constant(1.0)
                };
                smp_burn::init::init_values(0, &p.name, rule, range)
            };
            let mut unit = ShardedUnit::<Ad, _>::new("layer", template, &ctx, &dev, init).unwrap();
            for (i, (x, g)) in inputs.iter().enumerate() {
                let layer = unit.gather(&ctx, true).unwrap();
                let x = Tensor::<Ad, 2>::from_inner(x.clone());
                let scaled = x * layer.scale.val().unsqueeze_dim(0);
                let y = ops::linear(scaled, layer.weight.val());
                let loss = (y * Tensor::<Ad, 2>::from_inner(g.clone())).sum();
                let grads = loss.backward();
                let defer = i + 1 < micro_batches;
                unit.accumulate_grads(&layer, &grads, &ctx, defer).unwrap();
            }
            host(unit.grad_shard().expect("accumulated"))
        });
        results.push(out.into_iter().next().expect("one rank"));
    }
    smp_burn::KernelConfig::update(|c| c.fast_paths.accumulate = true).expect("valid");
    if let Some(short) = results.iter().find(|r| r.len() < n * k + k) {
        println!(
            "gradient accumulation: FAIL, the gradient shard holds {} elements where the layout \
             has {}",
            short.len(),
            n * k + k
        );
        return false;
    }
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    // The largest error beyond one bf16 step of the first gradient (cuBLAS rounds its f32 sum,
    // which can land on the other side of a rounding boundary than the exact value), and the
    // RMS error, both relative to the largest value.
    let worst = |got: &[f32]| {
        (got[..n * k].iter().zip(&want).zip(&first))
            .map(|((g, w), f)| ((*g as f64 - w).abs() - f.abs() * 2f64.powi(-7)).max(0.0))
            .fold(0f64, f64::max)
            / scale
    };
    let rms = |got: &[f32]| {
        let sq: f64 = (got[..n * k].iter().zip(&want))
            .map(|(g, w)| (*g as f64 - w).powi(2))
            .sum();
        (sq / (n * k) as f64).sqrt() / scale
    };
    let (fused, fused_rms, unfused_rms) = (worst(&results[0]), rms(&results[0]), rms(&results[1]));
    let scale_diff = rel_err(&results[0][n * k..n * k + k], &results[1][n * k..n * k + k]);
    let pass = fused <= 1e-4 && fused_rms * 4.0 <= unfused_rms && scale_diff <= 1e-2;
    println!(
        "gradient accumulation over {micro_batches} micro-batches, weight [{n}, {k}]: GEMM into \
         the f32 sum rel err {fused:.2e} beyond a bf16 step of the first gradient (bound 1e-4), \
         RMS {fused_rms:.2e} against {unfused_rms:.2e} with bf16 gradients added (at least 4x); \
         scale gradient {scale_diff:.2e} apart (bound 1e-2): {}",
        if pass { "ok" } else { "FAIL" }
    );
    pass
}

/// Gradient packing into the flat buffer (f32, and bf16 for unsharded units) against `cast` + `cat`: bf16 and f32 pieces, odd
/// lengths (so the vector width changes from piece to piece), padding after them.
fn check_pack() -> bool {
    let dev = device();
    let mut ok = true;
    for case in [
        (vec![7usize], 7usize),
        (vec![16, 3, 8, 1, 4096], 4200),
        (vec![2048 * 5632, 2048, 77], 2048 * 5632 + 2048 + 80),
    ]
    .into_iter()
    .flat_map(|case| [(case.clone(), DType::F32), (case, DType::BF16)])
    {
        let ((lens, total), dtype) = case;
        let pieces: Vec<Tensor<B, 1>> = lens
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                let t = Tensor::<B, 1>::random([n], Distribution::Normal(0.0, 1.0), &dev);
                if k % 2 == 0 { t.cast(DType::BF16) } else { t }
            })
            .collect();
        let mut want: Vec<Tensor<B, 1>> = pieces.iter().map(|p| p.clone().cast(dtype)).collect();
        let used: usize = lens.iter().sum();
        // Burn cannot launch on an empty tensor, so padding only where there is some.
        if total > used {
            want.push(Tensor::<B, 1>::zeros([total - used], &dev).cast(dtype));
        }
        let want = host(Tensor::cat(want, 0));
        let prims = || -> Vec<_> {
            pieces
                .iter()
                .map(|p| p.clone().into_primitive().tensor())
                .collect()
        };
        let float = |c| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(c));
        let got = host(float(smp_burn::cuda::flat::pack(prims(), total, dtype)));
        let (flat_sq, (partials, ranges)) =
            smp_burn::cuda::flat::pack_with_sq_sums(prims(), total, dtype);
        let got_sq = host(float(flat_sq));
        // A cast is exact: the packed buffer must equal cast + cat bit for bit, with or
        // without the sums of squares.
        let same = |g: &[f32], w: &[f32]| {
            g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits())
        };
        let pass_pack = same(&got, &want) && same(&got_sq, &want);
        // Each piece's sum of squares (of its packed values) against an f64 host sum.
        let mut sq_err = 0f64;
        let mut start = 0;
        for (n, range) in lens.iter().zip(&ranges) {
            let exact: f64 = want[start..start + n]
                .iter()
                .map(|&v| (v as f64).powi(2))
                .sum();
            let sum =
                smp_burn::cuda::adamw::weighted_sum(partials.clone(), &[(range.clone(), 1.0)]);
            let got = host(float(sum))[0] as f64;
            sq_err = sq_err.max((got - exact).abs() / exact.max(1e-30));
            start += n;
        }
        // Accumulation over micro-batches: the same pieces added into the packed f32 buffer at
        // their offsets, once while another handle holds it (so into a copy) and once in place;
        // each sum is one f32 addition, so bitwise the host's. Then every piece but the first,
        // as when a GEMM already added the first: its elements must keep their values.
        let mut pass_add = true;
        if dtype == DType::F32 {
            let offsets: Vec<usize> = lens
                .iter()
                .scan(0, |end, n| {
                    *end += n;
                    Some(*end - n)
                })
                .collect();
            let at_offsets = || -> Vec<_> { offsets.iter().copied().zip(prims()).collect() };
            let want_sum: Vec<f32> = want.iter().map(|v| v + v).collect();
            let acc = smp_burn::cuda::flat::pack(prims(), total, dtype);
            let shared = acc.clone();
            let into_copy = host(float(smp_burn::cuda::flat::pack_add(at_offsets(), acc)));
            let untouched = host(float(shared.clone()));
            let in_place = host(float(smp_burn::cuda::flat::pack_add(at_offsets(), shared)));
            let acc = smp_burn::cuda::flat::pack(prims(), total, dtype);
            let skipped = host(float(smp_burn::cuda::flat::pack_add(
                at_offsets().split_off(1),
                acc,
            )));
            let mut want_skipped = want_sum.clone();
            want_skipped[..lens[0]].copy_from_slice(&want[..lens[0]]);
            pass_add = same(&into_copy, &want_sum)
                && same(&untouched, &want)
                && same(&in_place, &want_sum)
                && same(&skipped, &want_skipped);
            println!(
                "pack_add pieces {:?} into {total} f32 (copied, in place, the first skipped): {}",
                lens,
                if pass_add { "ok (bitwise)" } else { "FAIL" }
            );
        }
        // f32 partial sums over up to millions of terms, as `check_sq_sum`.
        let pass = pass_pack && pass_add && sq_err <= 1e-5;
        ok &= pass;
        println!(
            "pack pieces {:?} into {total} {dtype:?}: {}; sums of squares rel err {sq_err:.2e} \
             (tolerance 1e-5) {}",
            lens,
            if pass_pack { "ok (bitwise)" } else { "FAIL" },
            if sq_err <= 1e-5 { "ok" } else { "FAIL" }
        );
    }
    ok
}

/// The gradient-norm reduction against Burn's `square().sum()` on a 1.2B model's layer shard
/// (51M elements), the size the trainer reduces once per unit and step.
fn bench_sq_sum() {
    let dev = device();
    let n = 51_000_000usize;
    let x = Tensor::<B, 1>::random([n], Distribution::Normal(0.0, 1.0), &dev);
    let runs = [(0..n, 1.0f32)];
    let fused = time(20, || {
        let _ = weighted_sq_sum(x.clone().into_primitive().tensor(), &runs);
    });
    let reference = time(5, || {
        let _ = x.clone().square().sum();
    });
    println!(
        "sq_sum {n} f32: fused {:.3} ms ({:.0} GB/s), Burn square().sum() {:.3} ms ({:.1}x)",
        fused * 1e3,
        4.0 * n as f64 / fused / 1e9,
        reference * 1e3,
        reference / fused
    );
}

/// `kernel_bench offload`: round trips bit for bit, then the copies' bandwidth.
fn offload() -> bool {
    use smp_burn::offload::offload as to_host;
    let dev = device();
    let mut ok = true;
    for (dtype, shape) in [
        (DType::BF16, [3, 77, 129]),
        (DType::F32, [2, 5, 1001]),
        (DType::BF16, [1, 4096, 4096]),
    ] {
        let t = Tensor::<B, 3>::random(shape, Distribution::Normal(0.0, 1.0), &dev).cast(dtype);
        let mut host = to_host(t.clone()).expect("offload");
        host.settle().expect("settle");
        let back = host.reload().expect("reload");
        let same = back.dtype() == dtype
            && back.dims() == shape
            && back.into_data().as_bytes() == t.into_data().as_bytes();
        println!(
            "offload {dtype:?} {shape:?}: round trip {}",
            if same { "bitwise equal" } else { "FAILED" }
        );
        ok &= same;
    }
    let x = Tensor::<B, 3>::random([1, 4096, 4096], Distribution::Normal(0.0, 1.0), &dev)
        .cast(DType::BF16);
    let bytes = 4096.0 * 4096.0 * 2.0;
    let d2h = time(20, || {
        let mut host = to_host(x.clone()).expect("offload");
        host.settle().expect("settle");
    });
    let mut host = to_host(x.clone()).expect("offload");
    host.settle().expect("settle");
    let mut hosts: Vec<_> = (0..20)
        .map(|_| {
            let mut h = to_host(x.clone()).expect("offload");
            h.settle().expect("settle");
            h
        })
        .collect();
    // Not `time`: its warm-up calls would use the offloaded copies up.
    B::sync(&dev).unwrap();
    let t = Instant::now();
    let n = hosts.len();
    for h in hosts.drain(..) {
        drop(h.reload().expect("reload"));
    }
    B::sync(&dev).unwrap();
    let h2d = t.elapsed().as_secs_f64() / n as f64;
    drop(host);
    // Queue about half a second of GEMMs (Burn's matmul), then the copy: `offload` must return
    // at once, and `settle` waits for the GEMMs (the training loop settles a layer later).
    let a = Tensor::<B, 2>::random([8192, 8192], Distribution::Default, &dev).cast(DType::BF16);
    B::sync(&dev).unwrap();
    let t0 = Instant::now();
    for _ in 0..100 {
        let _ = a.clone().matmul(a.clone());
    }
    let queued = t0.elapsed();
    let t1 = Instant::now();
    let mut pending = to_host(x.clone()).expect("offload");
    let issue = t1.elapsed();
    pending.settle().expect("settle");
    let waited = t1.elapsed();
    println!(
        "offload 32 MiB bf16: device-to-host {:.3} ms ({:.1} GB/s, offload + settle), \
         host-to-device {:.3} ms ({:.1} GB/s, reload); behind {:.0} ms of queued GEMMs: \
         offload returned in {:.3} ms, settle after {:.0} ms",
        d2h * 1e3,
        bytes / d2h / 1e9,
        h2d * 1e3,
        bytes / h2d / 1e9,
        queued.as_secs_f64() * 1e3,
        issue.as_secs_f64() * 1e3,
        waited.as_secs_f64() * 1e3,
    );
    ok
}

/// Seeded initialization drawn on the GPU (`smp_burn::cuda::init`) against the host's draw
/// (`smp_burn::init::normal_values`), value by value: one element, a slice past 2^32 (the
/// 64-bit counter), 3M values at an odd start; then both draws' time for 100M values (half a
/// Llama 2 7B layer).
fn check_init() -> bool {
    let dev = device();
    let mut ok = true;
    let key = smp_burn::init::normal_key(1234, "model.layers.0.mlp.up_proj.weight");
    let draw = |std: f32, start: usize, len: usize| {
        let t = smp_burn::cuda::init::normal(&dev, key, std, start, len);
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t))
    };
    for (start, len, std) in [
        (0usize, 1usize, 0.02f32),
        (0, 4097, 0.02),
        (12_345, 3_000_001, 1.0),
        ((1usize << 32) + 7, 100_000, 0.02),
    ] {
        let gpu = host(draw(std, start, len));
        let cpu = smp_burn::init::normal_values(key, std, start..start + len);
        let worst = gpu
            .iter()
            .zip(&cpu)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        // `log`, `sqrt` and `cos` of CUDA and of the host's libm differ in the last bit or two:
        // a few 1e-7 of a value of at most 5.6 standard deviations.
        let tol = 4e-6 * std;
        let pass = gpu.len() == len && worst <= tol;
        ok &= pass;
        println!(
            "init normal(std {std}) elements {start}..{}: max |gpu - host| {worst:.2e} \
             (tolerance {tol:.0e}) {}",
            start + len,
            if pass { "ok" } else { "FAIL" }
        );
    }
    let n = 100_000_000;
    let gpu_s = time(5, || {
        let _ = draw(0.02, 0, n);
    });
    let t = Instant::now();
    let _ = smp_burn::init::normal_values(key, 0.02, 0..n);
    let host_s = t.elapsed().as_secs_f64();
    println!(
        "init normal: {n} values in {:.2} ms on the GPU, {:.0} ms on the host's {} threads",
        gpu_s * 1e3,
        host_s * 1e3,
        std::thread::available_parallelism().map_or(1, |p| p.get())
    );
    ok
}

/// Mean seconds per call of `f` over `iters` calls issued back to back and one device sync.
fn time(iters: usize, f: impl FnMut()) -> f64 {
    time_and_issue(iters, f).0
}

/// As [`time`], and also the seconds per call the host took to issue the calls (before the
/// final sync): under the device time per call, any gap to a faster reference is on the GPU.
fn time_and_issue(iters: usize, mut f: impl FnMut()) -> (f64, f64) {
    for _ in 0..3 {
        f();
    }
    B::sync(&device()).unwrap();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    let issued = t.elapsed().as_secs_f64();
    B::sync(&device()).unwrap();
    (
        t.elapsed().as_secs_f64() / iters as f64,
        issued / iters as f64,
    )
}

/// `x` scaled by its amax's scale, rounded to `format` and scaled back, as an FP8 GEMM reads it.
fn fp8_emulated(x: &[f32], format: smp_burn::fp8::Fp8Format) -> Vec<f32> {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = smp_burn::fp8::scale_for(amax, format);
    x.iter()
        .map(|&v| smp_burn::fp8::quantize(v, scale, format))
        .collect()
}

/// ||a - b|| / ||b||.
fn rms_err(a: &[f32], b: &[f32]) -> f32 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n.max(1e-30)).sqrt() as f32
}

/// The FP8 linear against its host emulation and against bf16 (see the module docs). Two
/// layers share the input, as q/k/v do, so the second's `dx` is added into the first's by the
/// FP8 GEMM (`beta = 1`).
fn check_fp8() -> bool {
    use smp_burn::fp8::{Fp8Format, Fp8Recipe};
    let dev = device();
    if !smp_burn::cuda::fp8::fp8_capable(0) {
        println!("fp8: device 0 has no FP8 tensor cores; skipped");
        return true;
    }
    let cpu = Default::default();
    let mut ok = true;
    let grads = |x: &Tensor<B, 3>,
                 w: &Tensor<B, 2>,
                 r: &Tensor<B, 3>,
                 recipe: Fp8Recipe,
                 layers: [burn::module::ParamId; 2]| {
        smp_burn::KernelConfig::update(|c| c.fp8 = recipe).unwrap();
        let xa = Tensor::<Ad, 3>::from_inner(x.clone()).require_grad();
        let wa = Tensor::<Ad, 2>::from_inner(w.clone()).require_grad();
        let y = ops::linear_fp8(xa.clone(), wa.clone(), layers[0]);
        let second = ops::linear_fp8(xa.clone(), wa.clone(), layers[1]);
        let loss = (y.clone().cast(DType::F32) * Tensor::from_inner(r.clone())).sum()
            - (second.cast(DType::F32) * Tensor::from_inner(r.clone() * 0.5)).sum();
        let g = loss.backward();
        let out = [
            host(y.inner()),
            host(xa.grad(&g).expect("dx")),
            host(wa.grad(&g).expect("dw")),
        ];
        smp_burn::KernelConfig::update(|c| c.fp8 = Fp8Recipe::Off).unwrap();
        out
    };
    // Against the emulation: the GEMMs see exactly the emulated operands, so what remains is
    // fp32 accumulation order (fast accumulation in the forward) and the bf16 output's rounding:
    // 2e-2 of the largest value, as for the bf16 linear. Against bf16: FP8's own error, about
    // 2^-4 / sqrt(3) relative per E4M3 operand and twice that for E5M2 gradients, so 0.06 of
    // the norm for the forward and 0.12 for the gradients.
    for (b, m, k, n) in [
        (1, 16, 16, 16),
        (2, 80, 144, 48),
        (1, 512, 2048, 2048),
        (1, 1024, 4096, 11008),
    ] {
        let x = Tensor::<B, 3>::random([b, m, k], Distribution::Normal(0.0, 1.0), &dev)
            .cast(DType::BF16);
        let w =
            Tensor::<B, 2>::random([n, k], Distribution::Normal(0.0, 0.05), &dev).cast(DType::BF16);
        let r = Tensor::<B, 3>::random([b, m, n], Distribution::Normal(0.0, 1.0), &dev)
            .cast(DType::BF16)
            .cast(DType::F32);
        let fresh = || [burn::module::ParamId::new(), burn::module::ParamId::new()];
        let bf16 = grads(&x, &w, &r, Fp8Recipe::Off, fresh());
        // Delayed scaling twice on the same layers: first from a measured amax, then from the
        // history (the same amax again, measured inside the previous casts), so both runs
        // must match the current-scaling emulation.
        let delayed = fresh();
        let runs = [
            (
                "tensorwise",
                grads(&x, &w, &r, Fp8Recipe::Tensorwise, fresh()),
            ),
            // The backward casting the weight again, as where a memory planner turns the
            // forward's weight copies off.
            ("tensorwise, weight cast again", {
                smp_burn::cuda::fp8::keep_weight_copies(false);
                let g = grads(&x, &w, &r, Fp8Recipe::Tensorwise, fresh());
                smp_burn::cuda::fp8::keep_weight_copies(true);
                g
            }),
            (
                "delayed 1st",
                grads(&x, &w, &r, Fp8Recipe::Delayed, delayed),
            ),
            (
                "delayed 2nd",
                grads(&x, &w, &r, Fp8Recipe::Delayed, delayed),
            ),
        ];
        // The emulation on the host: y = q4(x) q4(w)^T, dx = q5(r / 2) q4(w) (the two layers'
        // upstreams r and -r / 2 sum to r / 2; each is cast with its own scale, and halving is
        // exact in both formats), dw = q5(r / 2)^T q4(x) likewise.
        let (xh, wh, rh) = (host(x.clone()), host(w.clone()), host(r.clone()));
        let (xq, wq) = (
            fp8_emulated(&xh, Fp8Format::E4M3),
            fp8_emulated(&wh, Fp8Format::E4M3),
        );
        let rq = fp8_emulated(&rh, Fp8Format::E5M2);
        let t2 = |v: Vec<f32>, r: usize, c: usize| {
            Tensor::<Cpu, 2>::from_data(burn::tensor::TensorData::new(v, [r, c]), &cpu)
        };
        let (xc, wc, rc) = (t2(xq, b * m, k), t2(wq, n, k), t2(rq, b * m, n));
        let emulated = [
            host(xc.clone().matmul(wc.clone().transpose())),
            host(rc.clone().matmul(wc) * 0.5),
            host(rc.transpose().matmul(xc) * 0.5),
        ];
        let names = ["y", "dx", "dw"];
        for (recipe, ours) in &runs {
            for i in 0..3 {
                let e_emul = rel_err(&ours[i], &emulated[i]);
                let e_bf16 = rms_err(&ours[i], &bf16[i]);
                let bf16_bound = if i == 0 { 0.06 } else { 0.12 };
                let pass = e_emul <= 2e-2 && e_bf16 <= bf16_bound;
                ok &= pass;
                println!(
                    "fp8 {recipe} x[{b},{m},{k}] w[{n},{k}] {}: max err vs emulation \
                     {e_emul:.2e} (bound 2e-2), norm err vs bf16 {e_bf16:.3} (bound \
                     {bf16_bound}) {}",
                    names[i],
                    if pass { "ok" } else { "FAIL" }
                );
            }
        }
    }
    ok
}

/// `(tokens, in, out)` of the linear layers of Llama 1B (hidden 2048, ffn 5632) and 7B (hidden
/// 4096, ffn 11008) at 4096 tokens, and a large square GEMM.
const LLAMA_GEMM_SHAPES: [(usize, usize, usize); 7] = [
    (4096, 2048, 2048),
    (4096, 2048, 5632),
    (4096, 5632, 2048),
    (4096, 4096, 4096),
    (4096, 4096, 11008),
    (4096, 11008, 4096),
    (8192, 8192, 8192),
];

/// FP8 against bf16 linear layers at the Llama shapes: TFLOP/s of the forward and of
/// forward + backward (three GEMMs plus, for FP8, the amax and cast passes).
fn bench_fp8() {
    use smp_burn::fp8::Fp8Recipe;
    let dev = device();
    if !smp_burn::cuda::fp8::fp8_capable(0) {
        println!("fp8: device 0 has no FP8 tensor cores; skipped");
        return;
    }
    println!(
        "{:<24} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7}",
        "tokens x in -> out",
        "bf16 fwd",
        "tw fwd",
        "dl fwd",
        "bf16 f+b",
        "tw f+b",
        "dl f+b",
        "tw x",
        "dl x"
    );
    for (m, k, n) in LLAMA_GEMM_SHAPES {
        let flop = 2.0 * (m * n * k) as f64;
        let x = Tensor::<B, 2>::random([m, k], Distribution::Default, &dev).cast(DType::BF16);
        let w =
            Tensor::<B, 2>::random([n, k], Distribution::Normal(0.0, 0.02), &dev).cast(DType::BF16);
        let mut row = Vec::new();
        for recipe in [Fp8Recipe::Off, Fp8Recipe::Tensorwise, Fp8Recipe::Delayed] {
            smp_burn::KernelConfig::update(|c| c.fp8 = recipe).unwrap();
            let layer = burn::module::ParamId::new();
            let fwd = time(20, || {
                let _ = ops::linear_fp8(x.clone(), w.clone(), layer);
            });
            let xa = Tensor::<Ad, 2>::from_inner(x.clone()).require_grad();
            let wa = Tensor::<Ad, 2>::from_inner(w.clone()).require_grad();
            let fb = time(10, || {
                let _ = ops::linear_fp8(xa.clone(), wa.clone(), layer).backward();
            });
            row.push((flop / fwd / 1e12, 3.0 * flop / fb / 1e12));
        }
        smp_burn::KernelConfig::update(|c| c.fp8 = Fp8Recipe::Off).unwrap();
        println!(
            "{:<24} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>7.2} {:>7.2}",
            format!("{m} x {k} -> {n}"),
            row[0].0,
            row[1].0,
            row[2].0,
            row[0].1,
            row[1].1,
            row[2].1,
            row[1].1 / row[0].1,
            row[2].1 / row[0].1
        );
    }
    println!(
        "(TFLOP/s; tw = FP8 tensorwise, dl = FP8 delayed; f+b = forward + dx + dw, casts \
         included; x = f+b against bf16)"
    );
}

fn gemm() {
    let dev = device();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let blas = CudaBlas::new(stream.clone()).unwrap();
    println!(
        "{:<28} {:>10} {:>10} {:>10} {:>10} {:>8} {:>12}",
        "shape (tokens x in -> out)",
        "ours fwd",
        "ours f+b",
        "burn fwd",
        "cuBLAS",
        "ours/cB",
        "issue us/call"
    );
    for (m, k, n) in LLAMA_GEMM_SHAPES {
        let flop = 2.0 * (m * n * k) as f64;
        let x = Tensor::<B, 2>::random([m, k], Distribution::Default, &dev).cast(DType::BF16);
        let w = Tensor::<B, 2>::random([n, k], Distribution::Default, &dev).cast(DType::BF16);
        smp_burn::KernelConfig::update(|c| c.fast_paths = FastPaths::ALL).unwrap();
        // With the host's issue time: under the device time per call, any gap to the direct
        // call is on the GPU (the stream crossings), not in the host.
        let (ours, issue) = time_and_issue(20, || {
            let _ = ops::linear(x.clone(), w.clone());
        });
        let xa = Tensor::<Ad, 2>::from_inner(x.clone()).require_grad();
        let wa = Tensor::<Ad, 2>::from_inner(w.clone()).require_grad();
        // Seeded with ones, not through `sum()`: Burn's full reduction of a bf16 tensor this
        // size takes ~0.9 ms on an H200 (3 cubes), four times the GEMMs.
        let ours_fb = time(10, || {
            let y = ops::linear(xa.clone(), wa.clone());
            let _ = y.backward();
        });
        smp_burn::KernelConfig::update(|c| c.fast_paths = FastPaths::NONE).unwrap();
        let wt = w.clone().transpose();
        let burn = time(10, || {
            let _ = x.clone().matmul(wt.clone());
        });
        smp_burn::KernelConfig::update(|c| c.fast_paths = FastPaths::ALL).unwrap();
        // cuBLAS directly on raw buffers, same GEMM (y^T = w x^T in column-major terms).
        let a = stream.alloc_zeros::<bf16>(m * k).unwrap();
        let bw = stream.alloc_zeros::<bf16>(n * k).unwrap();
        let mut c = stream.alloc_zeros::<bf16>(m * n).unwrap();
        let direct = {
            let (alpha, beta) = (1.0f32, 0.0f32);
            let mut call = || {
                let (ap, _ga) = a.device_ptr(&stream);
                let (bp, _gb) = bw.device_ptr(&stream);
                let (cp, _gc) = c.device_ptr_mut(&stream);
                // SAFETY: buffers of the sizes the dimensions describe, on the handle's stream.
                unsafe {
                    cbr::gemm_ex(
                        *blas.handle(),
                        cbs::cublasOperation_t::CUBLAS_OP_T,
                        cbs::cublasOperation_t::CUBLAS_OP_N,
                        n as i32,
                        m as i32,
                        k as i32,
                        (&alpha as *const f32).cast(),
                        bp as *const _,
                        cbs::cudaDataType_t::CUDA_R_16BF,
                        k as i32,
                        ap as *const _,
                        cbs::cudaDataType_t::CUDA_R_16BF,
                        k as i32,
                        (&beta as *const f32).cast(),
                        cp as *mut _,
                        cbs::cudaDataType_t::CUDA_R_16BF,
                        n as i32,
                        cbs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cbs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                    .unwrap();
                }
            };
            for _ in 0..3 {
                call();
            }
            stream.synchronize().unwrap();
            let t = Instant::now();
            for _ in 0..20 {
                call();
            }
            stream.synchronize().unwrap();
            t.elapsed().as_secs_f64() / 20.0
        };
        let tf = |s: f64, f: f64| f / s / 1e12;
        println!(
            "{:<28} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>7.1}% {:>12.1}",
            format!("{m} x {k} -> {n}"),
            tf(ours, flop),
            tf(ours_fb, 3.0 * flop),
            tf(burn, flop),
            tf(direct, flop),
            100.0 * direct / ours,
            issue * 1e6
        );
    }
    println!("(TFLOP/s; bf16 inputs, f32 accumulation, bf16 output; 'f+b' = forward + dx + dw)");
}

/// `gemm`'s forward + backward at one shape, split into host phases (see the module doc).
fn gemm_fb() {
    let dev = device();
    let (m, k, n) = (4096usize, 2048usize, 5632usize);
    let flop = 6.0 * (m * n * k) as f64;
    let x = Tensor::<B, 2>::random([m, k], Distribution::Default, &dev).cast(DType::BF16);
    let w = Tensor::<B, 2>::random([n, k], Distribution::Default, &dev).cast(DType::BF16);
    let xa = Tensor::<Ad, 2>::from_inner(x).require_grad();
    let wa = Tensor::<Ad, 2>::from_inner(w).require_grad();
    smp_burn::KernelConfig::update(|c| c.fast_paths = FastPaths::ALL).unwrap();
    for with_sum in [true, false] {
        let iters = 10;
        let (mut build, mut backward, mut wait) = (0.0, 0.0, 0.0);
        for i in 0..iters + 3 {
            B::sync(&dev).unwrap();
            let t0 = Instant::now();
            let y = ops::linear(xa.clone(), wa.clone());
            let (grads, t1, t2) = if with_sum {
                let s = y.sum();
                let t1 = Instant::now();
                let g = s.backward();
                (g, t1, Instant::now())
            } else {
                let t1 = Instant::now();
                let g = y.backward();
                (g, t1, Instant::now())
            };
            B::sync(&dev).unwrap();
            let t3 = Instant::now();
            drop(grads);
            if i >= 3 {
                build += (t1 - t0).as_secs_f64();
                backward += (t2 - t1).as_secs_f64();
                wait += (t3 - t2).as_secs_f64();
            }
        }
        let per = |s: f64| s / iters as f64 * 1e3;
        println!(
            "gemm-fb {m} x {k} -> {n}, {}: forward built {:.3} ms, backward() {:.3} ms, \
             device wait {:.3} ms; {:.1} TFLOP/s",
            if with_sum {
                "y.sum().backward()"
            } else {
                "y.backward()"
            },
            per(build),
            per(backward),
            per(wait),
            flop / ((build + backward + wait) / iters as f64) / 1e12,
        );
    }
}

fn main() {
    let _ = smp_burn::cuda::configure_kernel_cache();
    let what: Vec<String> = std::env::args().skip(1).collect();
    let what = if what.is_empty() {
        vec!["check".to_string(), "gemm".to_string()]
    } else {
        what
    };
    const PARTS: [&str; 11] = [
        "check",
        "accumulate",
        "init",
        "fp8",
        "xent",
        "embed",
        "adamw",
        "attention",
        "offload",
        "gemm",
        "gemm-fb",
    ];
    // All parts are checked before any runs: a typo at the end must not cost a run's minutes.
    if let Some(bad) = what.iter().find(|w| !PARTS.contains(&w.as_str())) {
        eprintln!(
            "kernel_bench: unknown part {bad:?}: use one or more of {}",
            PARTS.join(", ")
        );
        std::process::exit(2);
    }
    let mut ok = true;
    for w in &what {
        match w.as_str() {
            "check" => {
                ok &= check();
                ok &= check_attention();
                ok &= check_adamw();
                ok &= check_sq_sum();
                ok &= check_pack();
                ok &= check_xent();
                ok &= check_embedding();
                ok &= check_init();
                ok &= check_grad_accumulation();
            }
            "init" => ok &= check_init(),
            "xent" => ok &= check_xent(),
            "embed" => ok &= check_embedding(),
            "adamw" => {
                ok &= check_adamw();
                ok &= check_sq_sum();
                ok &= check_pack();
                bench_adamw();
                bench_sq_sum();
            }
            "attention" => ok &= check_attention(),
            "accumulate" => ok &= check_grad_accumulation(),
            "offload" => ok &= offload(),
            "fp8" => {
                ok &= check_fp8();
                bench_fp8();
            }
            "gemm" => gemm(),
            "gemm-fb" => gemm_fb(),
            _ => unreachable!("checked against PARTS above"),
        }
    }
    if !ok {
        eprintln!("kernel_bench: some checks FAILED");
        std::process::exit(1);
    }
}
