//! Checks smp-burn's flash-attention kernels against a plain f32 reference, then times them.
//!
//! Check: random bf16 inputs on CUDA device 0, every kernel variant (`plain`; `cmma` where the
//! device has bf16 `wmma`; `mma` where it has `mma.sync` m16n8k16 + `ldmatrix`), odd shapes
//! included; the reference runs in f32 on the CPU
//! (Burn's ndarray backend) on the same bf16-rounded values: scores = q k^T * scale, causal
//! mask, softmax, @ v; gradients by the explicit formulas dP = dO V^T,
//! dS = P * (dP - rowsum(dO * O)), dQ = dS K * scale, dK = dS^T Q * scale, dV = P^T dO, with
//! GQA summing dK/dV over the query heads that share a kv head. Prints max abs and relative
//! error (max |a - b| / max |b|) of O, lse, dQ, dK, dV; fails (exit 1) above 2e-2 (bf16) or
//! 1e-3 (the f32 run of the plain variant), unless the max abs error is below 1e-4 (a
//! reference that is zero up to rounding, e.g. dQ and dK at S = 1).
//!
//! Bench: causal, B=1, 32 q and 32 kv heads, hd 128 (`--head-dim 64`: the 1b preset's), S = 4096
//! and 16384 (`--lens 4096,8192`: others; `--batch N`: another batch, `--batch micro`:
//! `torch_micro.py`'s, 8 at S=4096 and 2 at 16384); forward, backward and fwd+bwd TFLOP/s
//! (forward 4*B*H*S*S*D/2, backward 2.5x that; fwd+bwd is `torch_micro.py`'s `sdpa_fwd_bwd`),
//! timed between device syncs.
//!
//! The shapes include S = 1, 65, 77, 129, 200, 300, 333, 1000, 1024, GQA (4 q heads on 2 or 1
//! kv heads) and MHA, hd 64 and 128, and a "sharp" case with q scaled by 20 so that row maxima
//! jump between key blocks and the cmma forward's lazy-rescale path runs.
//!
//! The `mma` variant is labelled `mma[WxM,BWD]` with its forward tiling (W warps per cube, M
//! 16-row tiles per warp, suffix `-cp` for `cp.async` double buffering of K/V; see
//! `flash::MmaTiling`) and its backward tiling BWD (`WxI-atomic` or
//! `WxI-split`: W warps of 16 keys, inner query blocks of I, dQ by atomics in the dK/dV kernel
//! or by a separate kernel; suffixes `-pf` (next Q/dO block prefetched into registers), `-cp`
//! (`cp.async` double buffering in both backward kernels) and `-vd` (warp-cooperative `delta`
//! kernel); see `flash::MmaBwdTiling`). It runs once per forward tiling (with
//! the default backward tiling, or the first one asked for) and once per further backward
//! tiling (with the default forward tiling, or the first asked for), so every tiling asked for
//! is checked and benchmarked. Before its checks, a fragment probe runs the Mma kernels'
//! register-layout helpers on exact small-integer 16x16 products (S = QK^T, O = PV, and
//! T = S^T V through the fused backward's transposed shared-memory path), so that a wrong
//! layout assumption shows up as `mma fragment probe: FAIL` rather than as noise in attention
//! errors.
//!
//! Flags: `--quick` (fewer shapes, S=4096 only), `--no-bench`, `--no-check`,
//! `--variant plain|cmma|mma` (only that one), `--mma-tiling 4x1|8x1|4x2|8x2[-cp]|8x1-wg[d]|all` (default
//! all; or a comma-separated list), `--mma-bwd-tiling {4,8}x{32,64}-{atomic,split}[-pf|-cp][-vd]|all` (default all; the
//! names `MmaBwdTiling::ALL` lists, printed by an unknown name), `--iters N` (timed
//! iterations, default 10), `--head-dim 64|128` and `--lens L1,L2,..` (bench shapes).
//! Lines starting `RESULT|` are for machines:
//! `RESULT|check|variant|dtype|shape|tensor|max_abs|rel|ok`,
//! `RESULT|probe|mma|tensor|max_abs|ok` and
//! `RESULT|bench|variant|B<batch>|S|fwd_ms|fwd_tflops|bwd_ms|bwd_tflops|fwd_bwd_tflops`.

use std::time::Instant;

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Distribution, Int, Tensor, TensorData, TensorPrimitive};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::Runtime;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use smp_burn::cuda::flash::{
    FlashLayout, FlashVariant, MmaBwdTiling, MmaTiling, cmma_supported, flash_backward_with,
    flash_forward_with, flash_layout, mma_bwd_tiling, mma_fragment_probe, mma_supported,
    mma_tiling, pair_atomics_supported, set_flash_layout, set_mma_bwd_tiling, set_mma_tiling,
    wgmma_backward_supported, wgmma_supported,
};

type G = CubeBackend<CudaRuntime, f32, i32, u8>;
type C = NdArray<f32>;
type Ct = CubeTensor<CudaRuntime>;

struct Args {
    quick: bool,
    bench: bool,
    check: bool,
    variant: Option<FlashVariant>,
    /// Mma forward tilings to check and bench.
    tilings: Vec<MmaTiling>,
    /// Mma backward tilings to check and bench.
    bwd_tilings: Vec<MmaBwdTiling>,
    iters: usize,
    /// Head dim of the bench shapes (the checks cover 64 and 128 either way).
    bench_head_dim: usize,
    /// Sequence lengths of the bench; `None`: 4096 and 16384 (4096 with `--quick`).
    bench_lens: Option<Vec<usize>>,
    /// Batch of the bench shapes; `None`: `torch_micro.py`'s, `max(1, 32768 / S)`.
    bench_batch: Option<usize>,
}

/// The flags, for `--help` and after a bad one.
const USAGE: &str = "usage: flash_check [--quick] [--no-bench] [--no-check] [--variant plain|cmma|mma] \
[--mma-tiling LIST|all] [--mma-bwd-tiling LIST|all] [--iters N] [--head-dim 64|128] \
[--lens L1,L2,..] [--batch N|micro]  (see the file's doc comment)";

/// The command line as [`Args`]; `Err` names the flag and the value it could not use.
fn parse_args(argv: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        quick: false,
        bench: true,
        check: true,
        variant: None,
        tilings: MmaTiling::ALL.to_vec(),
        bwd_tilings: MmaBwdTiling::ALL.to_vec(),
        iters: 10,
        bench_head_dim: 128,
        bench_lens: None,
        bench_batch: Some(1),
    };
    let mut it = argv.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--quick" => a.quick = true,
            "--no-bench" => a.bench = false,
            "--no-check" => a.check = false,
            "--variant" => {
                let name = value()?;
                a.variant = Some(
                    FlashVariant::parse(&name)
                        .ok_or(format!("--variant takes plain, cmma or mma, got {name:?}"))?,
                )
            }
            "--mma-tiling" => {
                let list = value()?;
                a.tilings = if list == "all" {
                    MmaTiling::ALL.to_vec()
                } else {
                    list.split(',')
                        .map(|t| {
                            MmaTiling::parse(t).ok_or(format!(
                                "--mma-tiling takes 4x1, 8x1, 4x2, 8x2 (each optionally -cp or \
                                 -cp-k32), a comma-separated list of them, or all, got {t:?}"
                            ))
                        })
                        .collect::<Result<_, _>>()?
                }
            }
            "--mma-bwd-tiling" => {
                let list = value()?;
                a.bwd_tilings = if list == "all" {
                    MmaBwdTiling::ALL.to_vec()
                } else {
                    list.split(',')
                        .map(|t| {
                            MmaBwdTiling::parse(t).ok_or_else(|| {
                                let names: Vec<String> =
                                    MmaBwdTiling::ALL.iter().map(|t| t.to_string()).collect();
                                format!(
                                    "--mma-bwd-tiling takes one or more (comma-separated) of {} \
                                     or all, got {t:?}",
                                    names.join(", ")
                                )
                            })
                        })
                        .collect::<Result<_, _>>()?
                }
            }
            "--iters" => {
                let n = value()?;
                a.iters = n
                    .parse()
                    .ok()
                    .filter(|&n: &usize| n > 0)
                    .ok_or(format!("--iters takes a positive number, got {n:?}"))?
            }
            "--head-dim" => {
                let d = value()?;
                a.bench_head_dim = d
                    .parse()
                    .ok()
                    .filter(|d| *d == 64 || *d == 128)
                    .ok_or(format!("--head-dim takes 64 or 128, got {d:?}"))?
            }
            "--lens" => {
                let list = value()?;
                a.bench_lens = Some(
                    list.split(',')
                        .map(|l| l.parse().ok().filter(|&l: &usize| l > 0))
                        .collect::<Option<_>>()
                        .ok_or(format!(
                            "--lens takes comma-separated positive lengths, e.g. 4096,16384, \
                             got {list:?}"
                        ))?,
                )
            }
            "--batch" => {
                let n = value()?;
                a.bench_batch = match n.as_str() {
                    "micro" => None,
                    n => Some(n.parse().ok().filter(|&b: &usize| b > 0).ok_or(format!(
                        "--batch takes a positive number or micro, got {n:?}"
                    ))?),
                }
            }
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
fn host<const D: usize>(t: Tensor<G, D>) -> Vec<f32> {
    t.cast(DType::F32)
        .into_data()
        .to_vec::<f32>()
        .expect("f32 data")
}

/// GPU tensor -> CPU reference tensor in f32, same values.
fn to_cpu<const D: usize>(t: &Tensor<G, D>) -> Tensor<C, D> {
    let data: TensorData = t.clone().cast(DType::F32).into_data();
    Tensor::from_data(data.convert::<f32>(), &Default::default())
}

/// Reference outputs, all f32 on the CPU: (o, lse, dq, dk, dv).
struct Reference {
    o: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

fn reference(
    q: Tensor<C, 4>,
    k: Tensor<C, 4>,
    v: Tensor<C, 4>,
    d_o: Tensor<C, 4>,
    scale: f32,
) -> Reference {
    let dev = Default::default();
    let [b, hq, s, d] = q.dims();
    let hkv = k.dims()[1];
    let group = hq / hkv;
    // [B, Hkv, S, D] -> [B, Hq, S, D], query head h reading kv head h / group.
    let rep = |t: Tensor<C, 4>| {
        t.reshape([b, hkv, 1, s, d])
            .repeat_dim(2, group)
            .reshape([b, hq, s, d])
    };
    let kr = rep(k);
    let vr = rep(v);

    let idx = Tensor::<C, 1, Int>::arange(0..s as i64, &dev);
    let rows = idx.clone().reshape([s, 1]).repeat_dim(1, s);
    let cols = idx.reshape([1, s]).repeat_dim(0, s);
    let masked: Tensor<C, 2, Bool> = cols.greater(rows); // key j > query i
    let masked = masked.reshape([1, 1, s, s]).expand([b, hq, s, s]);

    let scores = q
        .clone()
        .matmul(kr.clone().swap_dims(2, 3))
        .mul_scalar(scale)
        .mask_fill(masked, -1.0e30);
    let mx = scores.clone().max_dim(3);
    let e = (scores - mx.clone()).exp();
    let sum = e.clone().sum_dim(3);
    let p = e / sum.clone();
    let lse = (mx + sum.log()).reshape([b, hq, s]);
    let o = p.clone().matmul(vr.clone());

    let delta = (d_o.clone() * o.clone()).sum_dim(3);
    let dp = d_o.clone().matmul(vr.swap_dims(2, 3));
    let ds = p.clone() * (dp - delta);
    let dq = ds.clone().matmul(kr).mul_scalar(scale);
    let dk_rep = ds.swap_dims(2, 3).matmul(q).mul_scalar(scale);
    let dv_rep = p.swap_dims(2, 3).matmul(d_o);
    let fold = |t: Tensor<C, 4>| {
        t.reshape([b, hkv, group, s, d])
            .sum_dim(2)
            .reshape([b, hkv, s, d])
    };
    let vec = |t: Tensor<C, 4>| t.into_data().to_vec::<f32>().expect("f32");
    Reference {
        o: vec(o),
        lse: lse.into_data().to_vec::<f32>().expect("f32"),
        dq: vec(dq),
        dk: vec(fold(dk_rep)),
        dv: vec(fold(dv_rep)),
    }
}

/// (max |a - b|, max |a - b| / max |b|); NaN anywhere counts as an infinite error.
fn errors(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let mut diff = 0.0f32;
    let mut scale = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        let dd = (x - y).abs();
        diff = if dd.is_nan() {
            f32::INFINITY
        } else {
            diff.max(dd)
        };
        scale = scale.max(y.abs());
    }
    (diff, diff / scale.max(f32::MIN_POSITIVE))
}

/// Whether the device adds f32 pairs atomically (set once in `main`): the default backward
/// tiling depends on it.
static PAIR_ATOMICS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Whether the device runs the warpgroup-MMA forward (`flash::wgmma_supported`), set once in
/// `main`: the forward's default at head dim 128 depends on it.
static WGMMA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Whether the device runs the warpgroup-MMA backward on 16-byte rows
/// (`flash::wgmma_backward_supported`), set once in `main`: the backward's default at head dim
/// 128 depends on it.
static WGMMA_BWD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// The label of a variant in the output: `plain`, `cmma`, or `mma[WxM,BWD]` with the Mma
/// forward and backward tilings currently set (the forward's default depends on the head dim).
fn variant_name(v: FlashVariant, head_dim: usize) -> String {
    let pair_atomics = *PAIR_ATOMICS.get().unwrap_or(&false);
    let name = match v {
        FlashVariant::Mma => format!(
            "mma[{},{}]",
            mma_tiling(head_dim, *WGMMA.get().unwrap_or(&false)),
            mma_bwd_tiling(head_dim, pair_atomics, *WGMMA_BWD.get().unwrap_or(&false))
        ),
        other => other.name().to_string(),
    };
    format!("{name}/{}", flash_layout().name())
}

/// Whether `t` (logical `[B, H, S, D]`) lies in memory in `layout`'s order.
fn in_layout(t: &Ct, layout: FlashLayout) -> bool {
    let sh = t.meta.shape();
    let (h, s, d) = (sh[1], sh[2], sh[3]);
    let want = match layout {
        FlashLayout::Bhsd => [h * s * d, s * d, d, 1],
        FlashLayout::Bshd => [s * h * d, d, h * d, 1],
    };
    // Size-1 dimensions may carry any stride.
    (0..4).all(|i| sh[i] == 1 || t.meta.strides()[i] == want[i])
}

/// Runs the Mma fragment helpers on exact small-integer products and compares with the host.
/// A failure here means a register-layout assumption of the Mma kernels is wrong.
fn mma_probe(dev: &CudaDevice) -> bool {
    // Small integers: products and sums stay exact in bf16 (|s| <= 16 * 3 * 2 = 96) and f32.
    let a: Vec<f32> = (0..256)
        .map(|i| ((i / 16 * 3 + i % 16 * 5) % 7) as f32 - 3.0)
        .collect();
    let k: Vec<f32> = (0..256)
        .map(|i| ((i / 16 * 2 + i % 16) % 5) as f32 - 2.0)
        .collect();
    let v: Vec<f32> = (0..256)
        .map(|i| ((i / 16 + i % 16 * 3) % 5) as f32 - 2.0)
        .collect();
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
        .to_vec::<u32>()
        .expect("u32 data");
    // s = a k^T, o = s v, t = s^T v.
    let mut s_ref = vec![0f32; 256];
    let mut o_ref = vec![0f32; 256];
    let mut t_ref = vec![0f32; 256];
    for i in 0..16 {
        for j in 0..16 {
            s_ref[i * 16 + j] = (0..16).map(|c| a[i * 16 + c] * k[j * 16 + c]).sum();
        }
    }
    for i in 0..16 {
        for j in 0..16 {
            o_ref[i * 16 + j] = (0..16).map(|c| s_ref[i * 16 + c] * v[c * 16 + j]).sum();
            t_ref[i * 16 + j] = (0..16).map(|c| s_ref[c * 16 + i] * v[c * 16 + j]).sum();
        }
    }
    let mut ok = true;
    let pos_want: Vec<u32> = (0..32u32)
        .flat_map(|l| [l / 4, l / 4 + 8, 2 * (l % 4)])
        .collect();
    let pos_ok = pos == pos_want;
    ok &= pos_ok;
    println!(
        "{} mma fragment probe accumulator positions (row lo, row hi, col) per lane{}",
        if pos_ok { "ok  " } else { "FAIL" },
        if pos_ok {
            String::new()
        } else {
            format!("  <-- got {pos:?}, the row reductions assume {pos_want:?}")
        }
    );
    println!(
        "RESULT|probe|mma|positions|{}|{pos_ok}",
        if pos_ok { 0 } else { 1 }
    );
    for (name, got, want) in [
        ("S=QK^T", &s, &s_ref),
        ("O=PV", &o, &o_ref),
        ("T=S^TV(smem,ldmatrix.trans)", &t, &t_ref),
    ] {
        let (abs, _) = errors(got, want);
        let good = abs == 0.0;
        ok &= good;
        println!(
            "{} mma fragment probe {name}: max_abs {abs:.3e}{}",
            if good { "ok  " } else { "FAIL" },
            if good {
                String::new()
            } else {
                let bad: Vec<String> = (0..256)
                    .filter(|&i| got[i] != want[i])
                    .take(8)
                    .map(|i| format!("[{},{}] got {} want {}", i / 16, i % 16, got[i], want[i]))
                    .collect();
                format!(
                    "  <-- layout assumption wrong; first mismatches: {}",
                    bad.join(", ")
                )
            }
        );
        println!("RESULT|probe|mma|{name}|{abs:e}|{good}");
    }
    ok
}

/// One shape, one variant, one dtype; returns whether every tensor passed.
#[allow(clippy::too_many_arguments)]
fn check_case(
    dev: &CudaDevice,
    variant: FlashVariant,
    dtype: DType,
    b: usize,
    hq: usize,
    hkv: usize,
    s: usize,
    d: usize,
    q_gain: f32,
    bshd_inputs: bool,
) -> bool {
    let tol = if dtype == DType::F32 { 1e-3 } else { 2e-2 };
    let scale = 1.0 / (d as f32).sqrt();
    // With `bshd_inputs`, every input is a [b, s, h, d] tensor viewed as [b, h, s, d] (the
    // model's reshape + swap_dims; the flash backward's d_o arrives so under FlashLayout::Bshd).
    let rnd = |h: usize, gain: f32| {
        // The view last: elementwise ops may return contiguous results.
        if bshd_inputs {
            (Tensor::<G, 4>::random([b, s, h, d], Distribution::Normal(0.0, 1.0), dev) * gain)
                .cast(dtype)
                .swap_dims(1, 2)
        } else {
            (Tensor::<G, 4>::random([b, h, s, d], Distribution::Normal(0.0, 1.0), dev) * gain)
                .cast(dtype)
        }
    };
    let q = rnd(hq, q_gain);
    let (k, v, d_o) = (rnd(hkv, 1.0), rnd(hkv, 1.0), rnd(hq, 1.0));
    let want = reference(to_cpu(&q), to_cpu(&k), to_cpu(&v), to_cpu(&d_o), scale);

    let (o, lse) = flash_forward_with(
        variant,
        prim(q.clone()),
        prim(k.clone()),
        prim(v.clone()),
        scale,
    );
    let (dq, dk, dv) = flash_backward_with(
        variant,
        prim(q),
        prim(k),
        prim(v),
        o.clone(),
        lse.clone(),
        prim(d_o),
        scale,
    );
    let layout = flash_layout();
    let layout_ok = [&o, &dq, &dk, &dv].iter().all(|t| in_layout(t, layout));
    let got = [
        ("O", host(wrap::<4>(o)), &want.o),
        ("lse", host(wrap::<3>(lse)), &want.lse),
        ("dQ", host(wrap::<4>(dq)), &want.dq),
        ("dK", host(wrap::<4>(dk)), &want.dk),
        ("dV", host(wrap::<4>(dv)), &want.dv),
    ];
    let shape = if q_gain == 1.0 {
        format!("B{b}_Hq{hq}_Hkv{hkv}_S{s}_D{d}")
    } else {
        format!("B{b}_Hq{hq}_Hkv{hkv}_S{s}_D{d}_q*{q_gain}")
    };
    let shape = if bshd_inputs {
        format!("{shape}_in-bshd")
    } else {
        shape
    };
    let dname = format!("{dtype:?}").to_lowercase();
    let mut all_ok = layout_ok;
    if !layout_ok {
        println!(
            "FAIL {:26} {dname:4} {shape:26}: outputs not in the {} memory order",
            variant_name(variant, d),
            layout.name()
        );
        println!(
            "RESULT|check|{}|{dname}|{shape}|layout|0|0|false",
            variant_name(variant, d)
        );
    }
    for (name, a, r) in got {
        let (abs, rel) = errors(&a, r);
        // An absolute floor for references that are zero up to rounding (S = 1: dS = 0, so
        // dQ = dK = 0 and the relative error is noise over noise).
        let ok = rel <= tol || abs <= 1e-4;
        all_ok &= ok;
        println!(
            "{} {:26} {:4} {:26} {:3}: max_abs {:.3e} rel {:.3e}{}",
            if ok { "ok  " } else { "FAIL" },
            variant_name(variant, d),
            dname,
            shape,
            name,
            abs,
            rel,
            if !ok {
                format!("  <-- exceeds {tol:.0e}")
            } else if rel > tol {
                "  (reference ~0: passed on max_abs <= 1e-4)".to_string()
            } else {
                String::new()
            }
        );
        println!(
            "RESULT|check|{}|{dname}|{shape}|{name}|{abs:e}|{rel:e}|{ok}",
            variant_name(variant, d)
        );
    }
    all_ok
}

fn sync(dev: &CudaDevice) {
    <G as Backend>::sync(dev).expect("device sync");
}

/// Forward and backward TFLOP/s at one sequence length.
/// Times one (batch, sequence length, head dim) shape of `variant`.
fn bench_case(
    dev: &CudaDevice,
    variant: FlashVariant,
    (b, s, d): (usize, usize, usize),
    iters: usize,
) {
    let h = 32usize;
    let scale = 1.0 / (d as f32).sqrt();
    let rnd = || {
        prim(
            Tensor::<G, 4>::random([b, h, s, d], Distribution::Normal(0.0, 1.0), dev)
                .cast(DType::BF16),
        )
    };
    let (q, k, v, d_o) = (rnd(), rnd(), rnd(), rnd());
    let fwd = || flash_forward_with(variant, q.clone(), k.clone(), v.clone(), scale);

    let warmup = 2;
    let mut last = None;
    for _ in 0..warmup {
        last = Some(fwd());
    }
    sync(dev);
    let t = Instant::now();
    for _ in 0..iters {
        last = Some(fwd());
    }
    sync(dev);
    let fwd_s = t.elapsed().as_secs_f64() / iters as f64;
    let (o, lse) = last.expect("forward ran");

    let bwd = || {
        flash_backward_with(
            variant,
            q.clone(),
            k.clone(),
            v.clone(),
            o.clone(),
            lse.clone(),
            d_o.clone(),
            scale,
        )
    };
    for _ in 0..warmup {
        drop(bwd());
    }
    sync(dev);
    let t = Instant::now();
    for _ in 0..iters {
        drop(bwd());
    }
    sync(dev);
    let bwd_s = t.elapsed().as_secs_f64() / iters as f64;

    let fwd_flops = 4.0 * (b * h) as f64 * (s as f64) * (s as f64) * d as f64 / 2.0;
    let bwd_flops = 2.5 * fwd_flops;
    let (ft, bt) = (fwd_flops / fwd_s / 1e12, bwd_flops / bwd_s / 1e12);
    // torch_micro.py's `sdpa_fwd_bwd` figure: 3.5x the forward's FLOPs over both passes.
    let fbt = (fwd_flops + bwd_flops) / (fwd_s + bwd_s) / 1e12;
    println!(
        "bench {:26} causal B{b} H{h} D{d} S{s:6}: fwd {:8.3} ms {:7.1} TFLOP/s | bwd ({} kernels) {:8.3} ms {:7.1} TFLOP/s | fwd+bwd {:7.1} TFLOP/s",
        variant_name(variant, d),
        fwd_s * 1e3,
        ft,
        variant.name(),
        bwd_s * 1e3,
        bt,
        fbt
    );
    println!(
        "RESULT|bench|{}|B{b}|{s}|{:.4}|{ft:.2}|{:.4}|{bt:.2}|{fbt:.2}",
        variant_name(variant, d),
        fwd_s * 1e3,
        bwd_s * 1e3
    );
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return;
    }
    let args = parse_args(argv).unwrap_or_else(|e| {
        eprintln!("flash_check: {e}\n{USAGE}");
        std::process::exit(2);
    });
    // Keeps the compiled kernels (and their PTX, for `scripts/gpu/ptx_dump.py`) in the user's
    // cache folder, as the trainer does.
    let _ = smp_burn::cuda::configure_kernel_cache();
    let dev = CudaDevice::new(0);
    let client = CudaRuntime::client(&dev);
    let _ = PAIR_ATOMICS.set(pair_atomics_supported(&client));
    let wgmma = wgmma_supported(&client);
    let _ = WGMMA.set(wgmma);
    let mut args = args;
    if !wgmma {
        let (kept, skipped): (Vec<MmaTiling>, Vec<MmaTiling>) =
            args.tilings.iter().partition(|t| !t.wgmma);
        if !skipped.is_empty() {
            println!(
                "flash_check: skipping {}: this device or build has no wgmma (sm_90 and the \
                 workspace's vendored CubeCL)",
                skipped
                    .iter()
                    .map(|t| t.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        if kept.is_empty() {
            eprintln!("flash_check: no forward tiling asked for runs here");
            std::process::exit(2);
        }
        args.tilings = kept;
    }
    let wgmma_bwd = wgmma_backward_supported(&client, 8);
    let _ = WGMMA_BWD.set(wgmma_bwd);
    if !wgmma_bwd && args.bwd_tilings.iter().any(|t| t.wgmma) {
        println!(
            "flash_check: skipping the warpgroup backward tilings: this device or build has no \
             wgmma or no bulk reduction"
        );
        args.bwd_tilings.retain(|t| !t.wgmma);
        if args.bwd_tilings.is_empty() {
            eprintln!("flash_check: no backward tiling asked for runs here");
            std::process::exit(2);
        }
    }
    let has_cmma = cmma_supported(&client, DType::BF16);
    let has_mma = mma_supported(&client, DType::BF16);
    println!(
        "flash_check: cmma (bf16 wmma) supported: {has_cmma}; mma (bf16 mma.sync m16n8k16 + \
         ldmatrix) supported: {has_mma}"
    );

    let variants: Vec<FlashVariant> = match args.variant {
        Some(v) => vec![v],
        None => [FlashVariant::Plain, FlashVariant::Cmma, FlashVariant::Mma]
            .into_iter()
            .filter(|v| v.supported(&client, DType::BF16))
            .collect(),
    };
    // (variant, Mma forward and backward tilings to set first): the Mma variant once per
    // forward tiling with the default backward one, then once per further backward tiling with
    // the default forward one ("default": the built-in one if asked for, else the first asked
    // for), so that each tiling is measured without multiplying the runs.
    let fwd_default = if args.tilings.contains(&MmaTiling::DEFAULT) {
        MmaTiling::DEFAULT
    } else {
        args.tilings[0]
    };
    let bwd_default = if args.bwd_tilings.contains(&MmaBwdTiling::DEFAULT) {
        MmaBwdTiling::DEFAULT
    } else {
        args.bwd_tilings[0]
    };
    let runs: Vec<(FlashVariant, Option<(MmaTiling, MmaBwdTiling)>)> = variants
        .iter()
        .flat_map(|&v| match v {
            FlashVariant::Mma => args
                .tilings
                .iter()
                .map(|&t| (v, Some((t, bwd_default))))
                .chain(
                    args.bwd_tilings
                        .iter()
                        .filter(|&&bt| bt != bwd_default)
                        .map(|&bt| (v, Some((fwd_default, bt)))),
                )
                .collect(),
            _ => vec![(v, None)],
        })
        .collect();
    let set_tilings = |tilings: Option<(MmaTiling, MmaBwdTiling)>| {
        if let Some((t, bt)) = tilings {
            set_mma_tiling(Some(t));
            set_mma_bwd_tiling(Some(bt));
        }
    };

    let mut failures = 0usize;
    if args.check {
        // (B, Hq, Hkv, S, D, gain on q). A gain of 20 makes the softmax sharp (scores with a
        // standard deviation of ~20), so row maxima jump by more than the forward's lazy
        // rescaling threshold and its rescale path runs.
        let mut shapes = vec![
            (1, 4, 2, 1, 64, 1.0),
            (2, 4, 2, 77, 64, 1.0),
            (1, 4, 2, 200, 128, 1.0),
            (1, 4, 4, 129, 128, 1.0),
            (2, 4, 1, 65, 64, 1.0),
            (1, 4, 2, 300, 64, 20.0),
        ];
        if !args.quick {
            shapes.push((1, 4, 2, 1000, 128, 1.0));
            shapes.push((1, 4, 2, 1024, 128, 1.0));
            shapes.push((1, 4, 2, 1024, 64, 1.0));
            shapes.push((1, 2, 2, 333, 128, 1.0));
            shapes.push((1, 4, 2, 1024, 128, 20.0));
        }
        if variants.contains(&FlashVariant::Mma) && !mma_probe(&dev) {
            failures += 1;
        }
        // Every run in both output layouts (FlashLayout, SMP_BURN_FLASH_LAYOUT); under Bshd
        // every other shape takes its inputs in the model's [b, s, h, d] order too.
        for layout in [FlashLayout::Bshd, FlashLayout::Bhsd] {
            set_flash_layout(Some(layout));
            let bshd = layout == FlashLayout::Bshd;
            for &(variant, tilings) in &runs {
                set_tilings(tilings);
                for (i, &(b, hq, hkv, s, d, gain)) in shapes.iter().enumerate() {
                    let view = bshd && i % 2 == 1;
                    if !check_case(&dev, variant, DType::BF16, b, hq, hkv, s, d, gain, view) {
                        failures += 1;
                    }
                }
            }
            if variants.contains(&FlashVariant::Plain) {
                // The plain kernels also take f32; this isolates kernel logic from bf16
                // rounding.
                for &(b, hq, hkv, s, d) in &[(2, 4, 2, 77, 64), (1, 4, 2, 200, 128)] {
                    let (v, f) = (FlashVariant::Plain, DType::F32);
                    if !check_case(&dev, v, f, b, hq, hkv, s, d, 1.0, bshd) {
                        failures += 1;
                    }
                }
            }
        }
        set_flash_layout(None);
        if failures == 0 {
            println!("flash_check: all checks passed");
        } else {
            println!("flash_check: {failures} case(s) FAILED (see FAIL lines above)");
        }
    }

    if args.bench {
        let lens: &[usize] = match &args.bench_lens {
            Some(l) => l,
            None if args.quick => &[4096],
            None => &[4096, 16384],
        };
        for &(variant, tilings) in &runs {
            set_tilings(tilings);
            for &s in lens {
                // The plain kernels are ~10x slower; fewer iterations keep the run short.
                let iters = if variant == FlashVariant::Plain {
                    args.iters.min(3)
                } else {
                    args.iters
                };
                let batch = args.bench_batch.unwrap_or((32768 / s).max(1));
                bench_case(&dev, variant, (batch, s, args.bench_head_dim), iters);
            }
        }
    }

    if failures > 0 {
        std::process::exit(1);
    }
}
