//! Causal flash attention (forward and backward) as CubeCL kernels on Burn's `CubeTensor`s.
//!
//! Why our own kernels: Burn 0.21's attention keeps the full `S x S` score matrix for the
//! backward (95 GB at S = 4096 for a 1.2B Llama, where PyTorch needs 30 GB) and its forward
//! runs at 39 TFLOP/s on an H200; these run at 280-480 TFLOP/s there.
//!
//! # Interface
//!
//! `q [B, Hq, S, D]`, `k`, `v [B, Hkv, S, D]` with `Hq % Hkv == 0` (grouped-query attention:
//! query head `h` reads kv head `h / (Hq / Hkv)`), `D` in {64, 128}, bf16 or f16, any `S >= 1`,
//! causal (query `i` sees keys `j <= i`). The last dimension must be contiguous; the other
//! strides are read from the tensors, so pitched or sliced inputs work. Every `[B, H, S, D]`
//! result (`o`, `dq`, `dk`, `dv`) is allocated in `[B, S, H, D]` memory order and returned as
//! a `[B, H, S, D]` view: the model projects to `[B, S, H * D]`, views it as `[B, H, S, D]`
//! with `reshape` + `swap_dims(1, 2)`, and after attention goes back with `swap_dims(1, 2)` +
//! `reshape`, which is then free instead of a copy kernel per layer (about 47 us each at the
//! 1B shape on an H200).
//!
//! The kernels need `mma.sync` m16n8k16 and `cp.async` (CUDA sm_80 and later,
//! [`mma_supported`]); callers take the reference attention elsewhere.
//!
//! # Algorithm (FlashAttention-2)
//!
//! - forward: one cube per (block of query rows, query head, batch); it walks the key blocks
//!   up to the causal limit with an online softmax (running max `m`, running sum `l`, an f32
//!   output accumulator) and writes `o` and `lse = m + ln(l)` (f32, of the scaled scores).
//! - backward: `delta = rowsum(dO * O)` (f32), then a cube per (key block, kv head, batch)
//!   that loops over the query heads of its group and the query blocks from the causal start
//!   and accumulates `dK`, `dV` on chip (written once, no atomics). dQ either comes from a
//!   separate kernel per query block (deterministic), or is added by the dK/dV cubes to an f32
//!   accumulator with atomics or bulk reductions (fewer products, not bitwise reproducible),
//!   then scaled and rounded by an element-wise pass. `P = exp(s * scale - lse)` is recomputed
//!   from `lse` instead of being stored.
//!
//! Scores, probabilities and output stay in registers: the products run as `mma.sync`
//! m16n8k16, whose fragment layout is documented, so the softmax runs on the accumulators and
//! `P` feeds the next product directly (`fragments`). On Hopper, the head-dim-128 defaults
//! issue the products as warpgroup MMA instead (`wgmma`, reading shared memory through
//! descriptors, asynchronous).
//!
//! Masking uses a finite `-1e30` and forces masked probabilities to exactly 0, so rows with no
//! visible key yet never produce NaN; padded rows and keys (past `S`) are zero-filled in shared
//! memory so that `0 * garbage` cannot happen.
//!
//! # Kernels
//!
//! [`FlashForward`] and [`FlashBackward`] name the kernels; [`KernelConfig`] picks them, by
//! default the fastest for the device and head dim ([`default_forward`], [`default_backward`],
//! chosen in `select`).
//!
//! - forward, `mma.sync` (`fwd_mma`): [`FlashForward::Mma8x2`], [`FlashForward::Mma4x2`].
//! - forward, warpgroup MMA (`fwd_wgmma`): [`FlashForward::Wgmma`].
//! - backward dK/dV, `mma.sync` (`bwd_mma`): [`FlashBackward::Split`] and
//!   [`FlashBackward::Atomic`] (per-warp layout), [`FlashBackward::AtomicGrid`] (warp grid).
//! - backward dK/dV, warpgroup MMA (`bwd_wgmma`): [`FlashBackward::Wgmma`].
//! - dQ and the element-wise kernels (`dq`): the split dQ kernel, the fused dQ's atomics and
//!   bulk reductions, the f32-to-dtype conversion of dQ, `delta`.

// Kernel code is expanded by `#[cube]`, which has no `div_ceil` on runtime integers.
#![allow(clippy::manual_div_ceil)]

mod bwd_mma;
mod bwd_wgmma;
mod dq;
mod fragments;
mod fwd_mma;
mod fwd_wgmma;
mod select;
mod tiles;
mod wgmma;

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::ops::permute;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

pub use dq::BULK_REDUCE_BUILT;
pub use fragments::mma_fragment_probe;
pub use select::{
    backward_supported, bulk_dq_supported, current_kernels, default_backward, default_forward,
    forward_supported, mma_async_supported, mma_supported, pair_atomics_supported,
    wgmma_backward_supported, wgmma_supported,
};
pub use wgmma::WGMMA_BUILT;

pub(crate) use select::choose_backward;

use crate::{FlashBackward, FlashForward, KernelConfig};

/// The forward's rescale slack (natural-log units): a warp skips the rescale of its output
/// accumulators (`O *= exp(m_old - m_new)`, 128 multiplies per lane and block at hd 128 with two
/// m-tiles) in blocks where no row's running maximum grew by more than this. Exact where no
/// maximum moved (every factor is then 1), which late in a long row is almost every block
/// (+6 % on the hd-128 forward); with the slack, as FlashAttention-4 does, fewer blocks
/// rescale (another +3-4 %). The probabilities then reach `exp(8)`, about 3,000, before the
/// final division by the row sum, which carries the same maximum and cancels it; `lse = m +
/// ln(l)` stays the same value.
const RESCALE_SLACK: f32 = 8.0;

/// The fewest rows of any kernel's query or key block: the grid's y dimension counts them.
const MIN_BLOCK_ROWS: usize = 64;

/// The validated sizes of one attention call.
#[derive(Clone, Copy, Debug)]
struct Dims {
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq: usize,
    head_dim: usize,
}

impl Dims {
    /// Query heads per kv head.
    fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }
}

/// Sequences from this length on run the warpgroup kernels with their blocks (query blocks in
/// the forward, key blocks in the backward) fastest in the grid and the head next, as
/// FlashAttention-3's schedulers do: the cubes running at once then share one head's K/V
/// (forward), or its Q, dO and dQ accumulator (backward), in L2. On an H200 at head dim 128,
/// batch 1, that made the forward 1.03-1.04x and the backward 1.00-1.05x faster at S = 16k,
/// 1.09-1.10x and 1.06-1.07x at 32k, but both 8-10 % slower at 4k (hd 64: 5 %), where heads
/// fastest runs every head's longest blocks first and the waves end evenly; at 8k still 1-3 %
/// slower (H100).
const BLOCKS_FASTEST_FROM_SEQ: usize = 16384;

/// The grid of a warpgroup kernel with one cube per (head, block, batch), and whether the blocks
/// are its X (fastest) coordinate; see [`BLOCKS_FASTEST_FROM_SEQ`].
fn head_block_grid(heads: usize, blocks: usize, batch: usize, seq: usize) -> (CubeCount, bool) {
    let blocks_fastest = seq >= BLOCKS_FASTEST_FROM_SEQ;
    let (x, y) = if blocks_fastest {
        (blocks, heads)
    } else {
        (heads, blocks)
    };
    (
        CubeCount::Static(x as u32, y as u32, batch as u32),
        blocks_fastest,
    )
}

fn dims4(name: &str, t: &CubeTensor<impl CubeRuntime>) -> [usize; 4] {
    let shape = t.meta.shape();
    assert!(
        shape.num_dims() == 4,
        "flash attention: {name} must be [B, H, S, D], got shape {:?}",
        shape
    );
    [shape[0], shape[1], shape[2], shape[3]]
}

/// Checks q/k/v against each other and the kernels' limits; panics with the shapes otherwise.
fn check_qkv<R: CubeRuntime>(q: &CubeTensor<R>, k: &CubeTensor<R>, v: &CubeTensor<R>) -> Dims {
    let [b, hq, s, d] = dims4("q", q);
    let kd = dims4("k", k);
    let vd = dims4("v", v);
    let ctx = || format!("q {:?}, k {:?}, v {:?}", [b, hq, s, d], kd, vd);
    assert!(
        kd == vd,
        "flash attention: k and v shapes differ ({})",
        ctx()
    );
    assert!(
        kd[0] == b && kd[2] == s && kd[3] == d,
        "flash attention: k/v must be [B, Hkv, S, D] with q's B, S and D ({})",
        ctx()
    );
    let hkv = kd[1];
    assert!(
        hkv > 0 && hq > 0 && hq % hkv == 0,
        "flash attention: query heads must be a multiple of kv heads ({})",
        ctx()
    );
    assert!(
        s >= 1 && b >= 1,
        "flash attention: empty batch or sequence ({})",
        ctx()
    );
    assert!(
        d == 64 || d == 128,
        "flash attention: head dim must be 64 or 128 ({})",
        ctx()
    );
    assert!(
        q.dtype == k.dtype && q.dtype == v.dtype,
        "flash attention: q, k, v dtypes differ ({:?}, {:?}, {:?})",
        q.dtype,
        k.dtype,
        v.dtype
    );
    assert!(
        mma_supported(&q.client, q.dtype),
        "flash attention: {:?} inputs on a device without mma.sync m16n8k16 and ldmatrix for \
         them (the kernels need bf16 or f16 and sm_80+)",
        q.dtype
    );
    q.assert_is_on_same_device(k);
    q.assert_is_on_same_device(v);
    // The grid puts query heads on x and blocks on y (at most 65535).
    assert!(
        s.div_ceil(MIN_BLOCK_ROWS) <= 65_535 && b <= 65_535,
        "flash attention: sequence or batch too large for the launch grid ({})",
        ctx()
    );
    Dims {
        batch: b,
        heads_q: hq,
        heads_kv: hkv,
        seq: s,
        head_dim: d,
    }
}

/// What the kernels read: a unit stride on the last dimension, 32-bit offsets, and (for the
/// `[B, H, S, D]` inputs, `rows`) rows that `cp.async` can copy in element pairs at least. A
/// tensor that is none of these is copied to a contiguous one first, which is all of them.
fn prepare<R: CubeRuntime>(name: &str, t: CubeTensor<R>, rows: bool) -> CubeTensor<R> {
    let unit_last = t.meta.strides()[t.meta.num_dims() - 1] == 1;
    let t = if !unit_last || (rows && vector_width(&[&t]) < 2) {
        into_contiguous(t)
    } else {
        t
    };
    assert!(
        t.required_address_type() == AddressType::U32,
        "flash attention: {name} {:?} is too large for 32-bit indexing",
        t.meta.shape()
    );
    t
}

/// Widest vector (8, 4, 2 or 1 elements) in which the kernels can read all of `tensors`
/// (`[B, H, S, D]`): 16-byte loads and copies instead of 2-byte ones, when every row start is
/// aligned for them.
fn vector_width<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> usize {
    [8usize, 4, 2]
        .into_iter()
        .find(|&w| {
            tensors.iter().all(|t| {
                let strides = t.meta.strides();
                let bytes = (w * t.dtype.size()) as u64;
                t.meta.shape()[3] % w == 0
                    && (0..3).all(|i| strides[i] % w == 0)
                    && t.handle.offset_start.unwrap_or(0) % bytes == 0
            })
        })
        .unwrap_or(1)
}

/// A tensor of logical shape `[B, H, S, D]` in `[B, S, H, D]` memory order (strides
/// `[S H D, D, H D, 1]`): `alloc` allocates a contiguous tensor of the shape it is given, which
/// is then viewed as `[B, H, S, D]` by permuting its metadata.
fn alloc_bshd<R: CubeRuntime>(
    shape: [usize; 4],
    alloc: impl FnOnce(Shape) -> CubeTensor<R>,
) -> CubeTensor<R> {
    let [b, h, s, d] = shape;
    permute(alloc(Shape::new([b, s, h, d])), &[0, 2, 1, 3])
}

/// Causal flash attention forward with the kernel of [`KernelConfig::current`] (by default the
/// fastest for the device and head dim).
///
/// Returns `(o, lse)`: `o [B, Hq, S, D]` in q's dtype (`[B, S, H, D]` memory order, see the
/// [module documentation](self)) and `lse [B, Hq, S]` (contiguous) in f32, the log-sum-exp of
/// the scaled scores per query row, which the backward needs instead of the `S x S`
/// probabilities. `scale` (positive) is usually `1 / sqrt(D)`.
///
/// # Panics
/// On inputs outside the [interface](self#interface), and where the configured kernel cannot
/// run on the device.
pub fn flash_forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    forward(KernelConfig::current().flash_forward, q, k, v, scale)
}

/// [`flash_forward`] with `kernel`, whatever the configuration says, so that the kernels can be
/// checked and timed one by one.
pub fn flash_forward_with<R: CubeRuntime>(
    kernel: FlashForward,
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    forward(Some(kernel), q, k, v, scale)
}

/// The forward with `asked`, else the device's default.
fn forward<R: CubeRuntime>(
    asked: Option<FlashForward>,
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let dims = check_qkv(&q, &k, &v);
    assert!(
        scale > 0.0,
        "flash attention: the softmax scale must be positive, got {scale}"
    );
    let (q, k, v) = (
        prepare("q", q, true),
        prepare("k", k, true),
        prepare("v", v, true),
    );
    let client = q.client.clone();
    let device = q.device.clone();
    let dtype = q.dtype;
    let Dims {
        batch,
        heads_q,
        seq,
        head_dim,
        ..
    } = dims;
    let nv = vector_width(&[&q, &k, &v]);
    let kernel = select::forward_kernel(&client, asked, head_dim, nv);
    select::assert_forward_runs(&client, kernel);

    let o = alloc_bshd([batch, heads_q, seq, head_dim], |shape| {
        empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), shape, dtype)
    });
    let lse = empty_device_contiguous_dtype::<R>(
        client.clone(),
        device,
        Shape::new([batch, heads_q, seq]),
        DType::F32,
    );
    // The kernels work in log2 units (`exp2`): scores and slack scaled by log2(e).
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let slack_log2 = RESCALE_SLACK * std::f32::consts::LOG2_E;
    match kernel {
        FlashForward::Mma8x2 => {
            fwd_mma::launch(q, k, v, &o, &lse, scale_log2, slack_log2, dims, nv, 8, 2)
        }
        FlashForward::Mma4x2 => {
            fwd_mma::launch(q, k, v, &o, &lse, scale_log2, slack_log2, dims, nv, 4, 2)
        }
        FlashForward::Wgmma => {
            fwd_wgmma::launch(q, k, v, &o, &lse, scale_log2, slack_log2, dims, nv)
        }
    }
    (o, lse)
}

/// Causal flash attention backward with the kernels of [`KernelConfig::current`] (by default
/// the fastest for the device and head dim; the deterministic ones where
/// [`KernelConfig::deterministic`] is set or the device adds no f32 pairs atomically).
///
/// Takes the forward's inputs, its outputs `o` and `lse`, and `d_o` (the gradient of `o`);
/// returns `(dq, dk, dv)` in the inputs' dtype (`[B, S, H, D]` memory order), `dk`/`dv`
/// summed over the query heads that share a kv head. Recomputes the probabilities from `lse`
/// instead of storing them.
///
/// # Panics
/// As [`flash_forward`], and where `o`, `lse` or `d_o` do not match the inputs.
#[allow(clippy::too_many_arguments)]
pub fn flash_backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    o: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_o: CubeTensor<R>,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let config = KernelConfig::current();
    backward(
        config.flash_backward,
        config.deterministic,
        [q, k, v, o, lse, d_o],
        scale,
    )
}

/// [`flash_backward`] with `kernel`, whatever the configuration says. The backward only needs
/// `o` and `lse`, which every forward produces alike, so forward and backward kernels can be
/// mixed. [`FlashBackward::Wgmma`] on inputs it cannot take whole (another head dim, rows not
/// 16-byte aligned) runs the default without it instead: a check asks for one kernel for all
/// its shapes.
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_with<R: CubeRuntime>(
    kernel: FlashBackward,
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    o: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_o: CubeTensor<R>,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let deterministic = KernelConfig::current().deterministic;
    backward(Some(kernel), deterministic, [q, k, v, o, lse, d_o], scale)
}

/// The prepared tensors of one backward call, as the dK/dV and dQ launches take them.
struct BwdArgs<R: CubeRuntime> {
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    d_o: CubeTensor<R>,
    lse: CubeTensor<R>,
    delta: CubeTensor<R>,
    dk: CubeTensor<R>,
    dv: CubeTensor<R>,
    scale: f32,
    dims: Dims,
    /// The vector width of q, k, v and d_o ([`vector_width`]).
    nv: usize,
}

/// The backward with `asked`, else the device's default.
fn backward<R: CubeRuntime>(
    asked: Option<FlashBackward>,
    deterministic: bool,
    [q, k, v, o, lse, d_o]: [CubeTensor<R>; 6],
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let dims = check_qkv(&q, &k, &v);
    let Dims {
        batch,
        heads_q,
        heads_kv,
        seq,
        head_dim,
    } = dims;
    let q_shape = [batch, heads_q, seq, head_dim];
    assert!(
        dims4("o", &o) == q_shape && dims4("d_o", &d_o) == q_shape,
        "flash attention backward: o {:?} and d_o {:?} must have q's shape {:?}",
        o.meta.shape(),
        d_o.meta.shape(),
        q_shape
    );
    assert!(
        o.dtype == q.dtype && d_o.dtype == q.dtype,
        "flash attention backward: o ({:?}) and d_o ({:?}) must have q's dtype {:?}",
        o.dtype,
        d_o.dtype,
        q.dtype
    );
    let lse_shape = lse.meta.shape();
    assert!(
        lse_shape.num_dims() == 3
            && [lse_shape[0], lse_shape[1], lse_shape[2]] == [batch, heads_q, seq]
            && lse.dtype == DType::F32,
        "flash attention backward: lse must be f32 [B, Hq, S] = {:?}, got {:?} {:?}",
        [batch, heads_q, seq],
        lse_shape,
        lse.dtype
    );
    q.assert_is_on_same_device(&o);
    q.assert_is_on_same_device(&d_o);
    q.assert_is_on_same_device(&lse);
    let total_rows = batch * heads_q * seq;
    assert!(
        total_rows <= u32::MAX as usize,
        "flash attention backward: too many rows ({total_rows})"
    );

    let (q, k, v) = (
        prepare("q", q, true),
        prepare("k", k, true),
        prepare("v", v, true),
    );
    let (o, d_o) = (prepare("o", o, true), prepare("d_o", d_o, true));
    let lse = prepare("lse", lse, false);
    let client = q.client.clone();
    let device = q.device.clone();
    let dtype = q.dtype;
    let nv = vector_width(&[&q, &k, &v, &d_o]);
    let kernel = select::backward_kernel(&client, asked, deterministic, head_dim, nv);
    select::assert_backward_runs(&client, kernel);

    let delta = empty_device_contiguous_dtype::<R>(
        client.clone(),
        device.clone(),
        Shape::new([batch, heads_q, seq]),
        DType::F32,
    );
    let alloc =
        |shape| empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), shape, dtype);
    let dq = alloc_bshd(q_shape, alloc);
    let dk = alloc_bshd([batch, heads_kv, seq, head_dim], alloc);
    let dv = alloc_bshd([batch, heads_kv, seq, head_dim], alloc);
    dq::launch_delta(o, &d_o, &delta, q_shape);

    let args = BwdArgs {
        q,
        k,
        v,
        d_o,
        lse,
        delta,
        dk: dk.clone(),
        dv: dv.clone(),
        scale,
        dims,
        nv,
    };
    // The f32 dQ accumulator of the fused dQ: in the bulk reductions' chunks (`dq_chunk_pos`),
    // or, for the f32-pair atomics, dq's layout (dense with dq's strides, so that the
    // conversion's flat index `i` is the same element in both).
    let zeros = |shape| zeros_client::<R>(client.clone(), device.clone(), shape, DType::F32);
    match kernel {
        FlashBackward::Split => {
            bwd_mma::launch_per_warp(&args, None, 4, false);
            dq::launch_split(&args, &dq, 4);
        }
        FlashBackward::Atomic | FlashBackward::AtomicGrid => {
            let (warps, bq) = (8, 64);
            let bulk = bulk_dq_supported(&client);
            let dq_acc = if bulk {
                // Chunks of `bq x d` per (batch, head, query block), rows past `seq` included.
                let chunks = batch * heads_q * seq.div_ceil(bq);
                zeros(Shape::new([chunks * bq * head_dim]))
            } else {
                alloc_bshd(q_shape, zeros)
            };
            if kernel == FlashBackward::Atomic {
                bwd_mma::launch_per_warp(&args, Some(&dq_acc), warps, bulk);
            } else {
                bwd_mma::launch_grid(&args, &dq_acc, warps, bulk);
            }
            if bulk {
                let m_tiles = dq::dq_m_tiles(warps, bq, head_dim);
                dq::launch_convert_chunks(dq_acc, &dq, scale, dims, warps, bq, m_tiles);
            } else {
                dq::launch_convert(dq_acc, &dq, scale, dims);
            }
        }
        FlashBackward::Wgmma => {
            let (warps, bq, m_tiles) = bwd_wgmma::DQ_CHUNKS;
            let chunks = batch * heads_q * seq.div_ceil(bq);
            let dq_acc = zeros(Shape::new([chunks * bq * head_dim]));
            bwd_wgmma::launch(&args, &dq_acc);
            dq::launch_convert_chunks(dq_acc, &dq, scale, dims, warps, bq, m_tiles);
        }
    }
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stale-maximum probabilities reach `exp(RESCALE_SLACK)` before the final division: a
    /// row of 64k keys must keep its sum far inside f32.
    #[test]
    fn rescale_slack_keeps_row_sums_finite() {
        assert!(RESCALE_SLACK.exp() * 65_536.0 * 1e4 < f32::MAX);
    }

    /// The kernels read the block and the head from the grid's X and Y as the flag says; a
    /// grid built the other way round would run every cube on a wrong tile.
    #[test]
    fn grid_puts_blocks_fastest_only_from_the_threshold() {
        let dims = |c: CubeCount| match c {
            CubeCount::Static(x, y, z) => (x, y, z),
            CubeCount::Dynamic(_) => panic!("the attention grids are static"),
        };
        let (short, blocks_fastest) = head_block_grid(32, 16, 2, BLOCKS_FASTEST_FROM_SEQ - 1);
        assert!(!blocks_fastest);
        assert_eq!(dims(short), (32, 16, 2));
        let (long, blocks_fastest) = head_block_grid(8, 256, 1, BLOCKS_FASTEST_FROM_SEQ);
        assert!(blocks_fastest);
        assert_eq!(dims(long), (256, 8, 1));
        let (long, _) = head_block_grid(8, 256, 1, 32_768);
        assert_eq!(dims(long), (256, 8, 1));
    }
}
