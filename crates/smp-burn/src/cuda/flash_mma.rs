//! [`FlashVariant::Mma`](super::FlashVariant::Mma): causal flash attention on tensor cores with
//! register-resident scores, through CubeCL's manual MMA API (`cmma::MmaDefinition`, lowered to
//! PTX `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}` and `ldmatrix`).
//!
//! Why: the `Cmma` variant uses `wmma` fragments, whose element layout is unspecified, so every
//! score block goes to shared memory for the softmax and comes back as `P`. Here the layout is
//! the documented one of `mma.sync`, so the softmax runs on the accumulator registers and `P`
//! feeds the next product without touching shared memory (FlashAttention-2's structure).
//!
//! # Fragment layouts (m16n8k16, per lane; `g = lane / 4`, `t = lane % 4`)
//!
//! These follow the PTX ISA ("Matrix Fragments for mma.m16n8k16") and CubeCL's
//! `position_of_nth` table for CUDA (`cubecl-cpp`'s `CudaMmaProcessor`), which agree:
//! - accumulator (16 x 8, f32): `Array<Vector<f32, 2>>` of 2; vector 0 holds row `g`,
//!   columns `2t, 2t + 1`; vector 1 holds row `g + 8`, the same columns.
//! - A (16 x 16): `Array<Vector<F, 2>>` of 4: (row `g`, k `2t..`), (row `g + 8`, k `2t..`),
//!   (row `g`, k `2t + 8..`), (row `g + 8`, k `2t + 8..`).
//! - B (16 x 8): `Array<Vector<F, 2>>` of 2: (k `2t..`, column `g`), (k `2t + 8..`, column `g`).
//!
//! Consequences used below:
//! - `ldmatrix.x4` gives lane `l` one register per 8x8 matrix `i` (row addresses from lanes
//!   `8i .. 8i + 8`), holding row `g`, columns `2t, 2t + 1` of that matrix (with `.trans`:
//!   column `g`, rows `2t, 2t + 1`). So Q (A operand, row-major) is one x4 load with lane `l`
//!   pointing at row `l % 16`, column `8 * (l / 16)`; K (B operand of `Q K^T`, stored as
//!   `[key][d]`) is one x4 load per pair of key n-tiles with lane `l` pointing at key
//!   `l % 8 + 8 * (l / 16)`, column `8 * ((l / 8) % 2)`; V (B operand of `P V`, stored as
//!   `[key][d]`) is one transposed x4 load per pair of d n-tiles, addressed like Q.
//! - The accumulators of two adjacent key n-tiles `2j`, `2j + 1` are, vector for vector, the A
//!   fragment of keys `16j .. 16j + 16`: `P` is rounded to the input dtype in registers and used
//!   directly as the A operand of `P V`.
//! - A row of the score block lives in the 4 lanes of one quad (`lane / 4` equal), so the row
//!   max and sum need two `plane_shuffle_xor` steps (masks 1 and 2).
//!
//! [`mma_fragment_probe`] runs exactly these helpers on small integer matrices so that a wrong
//! layout assumption is reported as such (`flash_check` runs it before the Mma checks).
//!
//! # Forward kernel
//!
//! One cube per (query block, query head, batch) with `warps` warps; warp `w` owns `16 *
//! m_tiles` query rows. Q is staged once in shared memory (re-read with `ldmatrix` per key
//! block; keeping it in registers would cost 32 registers per 16 rows at hd 128), K and V blocks
//! of [`MMA_KEYS`] keys are staged per iteration. With `m_tiles == 1` the next K/V block is
//! loaded into registers while the current one is in use (as the Cmma kernels do); with
//! `m_tiles == 2` the accumulators need those registers, so staging is synchronous. Per lane,
//! the registers hold O (`m_tiles * d / 2` f32), S/P (`m_tiles * 32` f32), the running max and
//! sum of its 2 rows per m-tile, and the fragments in flight. The softmax is the usual online
//! one (rescale O and the sum by `exp(m_old - m_new)`), except that a warp skips the rescale of
//! O in blocks where none of its rows' maxima grew by more than a slack (`RescalePolicy`: a
//! stale maximum cancels in the final division); scores are masked with a finite `-1e30` only
//! in the warps whose rows a block crosses (a warp-uniform choice between two copies of the
//! block code), and warps whose rows are all above a key block skip it.
//!
//! The `-cp` tilings ([`MmaTiling::cp_async`], `flash_fwd_mma_cp`) copy K/V with `cp.async`
//! into a double buffer instead (the backward's `-cp` mechanism, same helpers): no staging
//! registers, one cube barrier per key block, the next block in flight at `m_tiles = 2` too.
//! Both kernels run the same per-block code (`fwd_block`), so their results are identical.
//!
//! The `-wg` / `-wgd` tilings ([`MmaTiling::wgmma`], `flash_fwd_wgmma`, sm_90) issue both
//! products as Hopper's warpgroup MMA instead (`super::super::wgmma`): two warpgroups of 64
//! rows, 128-key blocks, Q/K/V copied into 128-byte-swizzled shared memory that the `wgmma`s
//! read through descriptors, and the same softmax (`fwd_softmax`) on accumulators of the same
//! fragment layout. `-wgd` lets the warpgroups drift apart behind per-buffer mbarriers, so that
//! one's softmax overlaps the other's MMAs; it is the head-dim-128 default where it runs.
//!
//! # Backward
//!
//! `delta = rowsum(dO * O)` comes from the shared kernel in `flash.rs`. Then, shaped by
//! [`MmaBwdTiling`]:
//!
//! - dK/dV kernel: one cube per (key block of `16 * warps` keys, kv head, batch); warp `w` owns
//!   16 keys, whose K and V rows stay in shared memory for the whole cube. It loops over the
//!   query heads of the GQA group and the query blocks of `inner` rows from the causal start
//!   (Q, dO, lse and delta staged per block). Per block and warp, everything is computed
//!   transposed (FlashAttention-2's choice), so that no operand needs a transpose: `S^T = K Q^T`
//!   and `dP^T = V dO^T` come out of `mma_abt_strip` with keys as rows (K and V are the A
//!   operands, Q and dO the B operands exactly as K is in the forward); then
//!   `P^T = exp(S^T * scale - lse)` (lse, delta per column, from shared memory; the causal
//!   mask sets `P` to 0) and `dS^T = P^T (dP^T - delta)` are formed in the accumulator
//!   registers; then `dV += P^T dO`
//!   and `dK += dS^T Q` through `mma_pv_strip`, the accumulators of `P^T`/`dS^T` being A
//!   fragments as `P` is in the forward and dO/Q being B operands through transposed loads as
//!   V is in the forward. dK and dV (f32, `d / 2` registers each per lane at hd 128) are
//!   written once at the end, dK times `scale`. Queries past the end get `lse = 1e30`, hence
//!   `P = 0`.
//! - dQ, [`MmaDq::Atomic`] (FlashAttention-2's scheme): in the same loop, each warp stores its
//!   `dS^T` rows to shared memory as they lie (`store_acc_pairs`, keys by queries, pitch
//!   `inner + 8`), and after a barrier the cube computes the block's `dQ += dS K` (`inner x d`)
//!   as one tile per warp (`mma_atb_acc`: the stored `dS^T` read with transposed `ldmatrix`
//!   is the A operand `dS`, K the B operand as V is in the forward) and adds it to an f32
//!   `[B, Hq, S, D]` buffer with `atomicAdd` of f32 pairs (sm_90); an element-wise kernel
//!   then writes `dq = acc * scale` in the input dtype. 5 products per block pair; dQ's f32
//!   summation order varies between runs.
//! - dQ, [`MmaDq::Split`]: a separate kernel shaped like the forward (a cube per query block
//!   of `16 * warps` rows, K/V blocks of [`MMA_KEYS`] keys prefetched into registers): `S` and
//!   `dP = dO V^T` by `mma_abt_strip`, `dS = P (dP - delta)` in registers, `dQ += dS K` by
//!   `mma_pv_strip` with K as the "V". 7 products per block pair; deterministic.
//!
//! Layout facts beyond the forward's: only the transposed `ldmatrix` of a stored accumulator
//! tile as an A operand (`mma_atb_acc`); the probe checks it (`t = s^T v`).
//!
//! Staging of the inner loops ([`MmaBwdPipe`], the `-pf` / `-cp` suffixes of a tiling's name)
//! and the `delta` kernel (`-vd`) are further knobs. `-pf` and `-cp` compute the same values
//! in the same order as the plain `*-split` tiling of the same shape (they only move data
//! differently); `-vd` sums `delta` in another f32 order:
//! - `-pf`: the dK/dV kernel loads the next query block's Q, dO, lse and delta into registers
//!   right after the barrier that publishes the current one (the forward's K/V scheme), so the
//!   global loads overlap the current block's four products.
//! - `-cp`: both kernels copy their streamed tiles with `cp.async` into the other half of a
//!   double buffer (`flash_bwd_dkdv_mma_cp`, `flash_bwd_dq_mma_cp`); a cube `mbarrier`
//!   (`commit_copy_async` + `arrive_and_wait`) is the one barrier per block.
//! - `-vd`: `delta` by `flash_delta_wide` (8 lanes per row, 16-byte loads, shuffle reduction)
//!   instead of `flash.rs`'s one thread per row.

// Kernel code is expanded by `#[cube]`, which has no `div_ceil` on runtime integers.
#![allow(clippy::manual_div_ceil)]

use std::sync::Mutex;

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::MmaConfig;
use cubecl::ir::{BarrierLevel, ElemType, FloatKind, OpaqueType};
use cubecl::prelude::barrier::{Barrier, copy_async};
use cubecl::prelude::*;

use super::super::wgmma::{
    SWIZZLE_128B, WGMMA_BUILT, wgmma_commit_group, wgmma_descriptor, wgmma_descriptor_at,
    wgmma_fence, wgmma_fence_operands, wgmma_rs, wgmma_ss, wgmma_wait_group,
};
use super::{FlashLayout, load_tile_regs, stage_tile, store_tile_regs, vector_width};

/// Keys per block of the Mma forward's inner loop.
pub const MMA_KEYS: usize = 64;

/// Keys per block of the warpgroup-MMA forward: the `n` of its `m64nNk16` score product.
pub const WGMMA_KEYS: usize = 128;

/// Warps per cube and 16-row m-tiles per warp of the Mma forward, and how it stages K/V: a cube
/// covers `16 * warps * m_tiles` query rows.
///
/// More rows per warp (`m_tiles = 2`) halves the shared-memory reads of K and V per FLOP but
/// doubles the accumulator registers and turns off the register prefetch of the next K/V block;
/// more warps per cube share one staged K/V block between more rows. `cp_async` (the `-cp`
/// suffix) replaces the staging by `cp.async` double buffering (`flash_fwd_mma_cp`). Which is
/// fastest is a measurement, hence the knob (`SMP_BURN_FLASH_MMA_TILING`, [`set_mma_tiling`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaTiling {
    /// Warps per cube: 4 or 8.
    pub warps: usize,
    /// 16-row tiles per warp: 1 or 2.
    pub m_tiles: usize,
    /// K/V blocks copied by `cp.async` into a double buffer, one cube barrier per block
    /// (the backward's [`MmaBwdPipe::Async`] mechanism), instead of a register prefetch
    /// (`m_tiles = 1`) or synchronous staging (`m_tiles = 2`) between two barriers.
    pub cp_async: bool,
    /// Keys per K/V block: [`MMA_KEYS`], or 32 with `cp_async` (the `-k32` suffix). Why 32:
    /// the score and probability registers of a block halve (64 fewer per lane at
    /// `m_tiles = 2`), where the 64-key forward sits at 255 registers and spills (session 9,
    /// call DB), at the cost of twice the barriers and row reductions per key.
    pub keys: usize,
    /// Hopper's warpgroup MMA (`flash_fwd_wgmma`, the `-wg` tiling [`MmaTiling::WGMMA`]): two
    /// warpgroups of 64 query rows, 128-key blocks, both products by `wgmma` with K and V read
    /// from swizzled shared memory (sm_90 and the workspace's vendored CubeCL).
    pub wgmma: bool,
    /// With `wgmma`: the two warpgroups share the K/V buffers through per-buffer mbarriers
    /// instead of one cube barrier per block, so that they drift apart and one's softmax
    /// overlaps the other's MMAs (`-wgd`, [`MmaTiling::WGMMA_DECOUPLED`]).
    pub decoupled: bool,
}

impl MmaTiling {
    /// 8 warps of 2 x 16 rows (256 query rows per cube), K/V by `cp.async`: the fastest forward
    /// on an H200 (session 4 call W, causal hd 128): 219 TFLOP/s at S = 4096 and 262 at 16384,
    /// where the register-prefetching 8x1 (the previous default) gives 170-176 / 190 and the
    /// other `-cp` tilings 191-209 at 4096. With the unmasked block copy (session 9 call DG):
    /// 245 / 294 TFLOP/s, against PyTorch's flash forward 263 / 333 in the same call. With the
    /// rescale skip (session 13 call EH): 285 / 340 (PyTorch 256 / 333); FA2's own shape, 4x2-cp
    /// (two cubes per SM), stays 2-12 % slower (call EF).
    pub const DEFAULT: MmaTiling = MmaTiling::new(8, 2, true);

    /// The default at head dim 64 (the 1b preset's): 4 warps of 2 x 16 rows with `cp.async`,
    /// 207 TFLOP/s causal at S = 4096 on an H200 where [`MmaTiling::DEFAULT`] gives 195 and the
    /// other tilings 132-197 (session 6 call BA, `flash_check --head-dim 64`; PyTorch's flash
    /// forward 220 in the same call). Half the head dim halves the work per staged K/V block,
    /// so smaller cubes (more of them per SM) hide the copies better. Session 9 call DG: 223
    /// TFLOP/s at 4096 (PyTorch 218) and 278 at 16384 (PyTorch 298).
    pub const DEFAULT_HD64: MmaTiling = MmaTiling::new(4, 2, true);

    /// The warpgroup-MMA forward (`8x1-wg`): 8 warps as two warpgroups of 64 rows (128 query
    /// rows per cube), 128 keys per block, Q, K and V by `cp.async` into 128-byte-swizzled
    /// shared memory that `wgmma` reads directly.
    pub const WGMMA: MmaTiling = MmaTiling {
        warps: 8,
        m_tiles: 1,
        cp_async: true,
        keys: WGMMA_KEYS,
        wgmma: true,
        decoupled: false,
    };

    /// [`MmaTiling::WGMMA`] with the warpgroups decoupled (`8x1-wgd`): per-buffer full and
    /// empty mbarriers instead of a cube barrier per block.
    pub const WGMMA_DECOUPLED: MmaTiling = MmaTiling {
        decoupled: true,
        ..Self::WGMMA
    };

    /// The default for `head_dim` where the device and build run `wgmma` or not
    /// ([`wgmma_supported`]): [`MmaTiling::DEFAULT_HD64`] at 64 (the warpgroup kernel ties it
    /// at S 4k and loses 4 % at B8, session 18 call GD), [`MmaTiling::WGMMA_DECOUPLED`] at 128
    /// with `wgmma` (430-477 TFLOP/s where `8x2-cp` gives 297-361, call GD), else
    /// [`MmaTiling::DEFAULT`].
    pub fn default_for(head_dim: usize, wgmma: bool) -> MmaTiling {
        match head_dim {
            64 => Self::DEFAULT_HD64,
            128 if wgmma => Self::WGMMA_DECOUPLED,
            _ => Self::DEFAULT,
        }
    }

    /// Every supported tiling, for checks and benchmarks; the `cp.async` ones last (as in
    /// [`MmaBwdTiling::ALL`], so that a failure there leaves the others' results printed).
    pub const ALL: [MmaTiling; 14] = [
        MmaTiling::new(4, 1, false),
        MmaTiling::new(8, 1, false),
        MmaTiling::new(4, 2, false),
        MmaTiling::new(8, 2, false),
        MmaTiling::new(4, 1, true),
        MmaTiling::new(8, 1, true),
        MmaTiling::new(4, 2, true),
        MmaTiling::new(8, 2, true),
        MmaTiling::new(4, 1, true).with_keys(32),
        MmaTiling::new(8, 1, true).with_keys(32),
        MmaTiling::new(4, 2, true).with_keys(32),
        MmaTiling::new(8, 2, true).with_keys(32),
        MmaTiling::WGMMA,
        MmaTiling::WGMMA_DECOUPLED,
    ];

    const fn new(warps: usize, m_tiles: usize, cp_async: bool) -> Self {
        MmaTiling {
            warps,
            m_tiles,
            cp_async,
            keys: MMA_KEYS,
            wgmma: false,
            decoupled: false,
        }
    }

    const fn with_keys(self, keys: usize) -> Self {
        MmaTiling { keys, ..self }
    }

    /// Query rows per cube.
    pub fn rows(&self) -> usize {
        16 * self.warps * self.m_tiles
    }

    /// Parses `WARPSxMTILES[-cp[-k32]]`, e.g. `4x1`, `8x1-cp` or `4x2-cp-k32`, or `8x1-wg` /
    /// `8x1-wgd` ([`MmaTiling::WGMMA`], [`MmaTiling::WGMMA_DECOUPLED`]); `None` for anything
    /// unsupported.
    pub fn parse(s: &str) -> Option<MmaTiling> {
        let s = s.trim();
        match s {
            "8x1-wg" => return Some(Self::WGMMA),
            "8x1-wgd" => return Some(Self::WGMMA_DECOUPLED),
            _ => {}
        }
        let (s, keys) = match s.strip_suffix("-k32") {
            Some(rest) => (rest, 32),
            None => (s, MMA_KEYS),
        };
        let (shape, cp_async) = match s.strip_suffix("-cp") {
            Some(shape) => (shape, true),
            None => (s, false),
        };
        let (w, m) = shape.split_once('x')?;
        let tiling = MmaTiling::new(w.parse().ok()?, m.parse().ok()?, cp_async).with_keys(keys);
        Self::ALL.contains(&tiling).then_some(tiling)
    }
}

impl std::fmt::Display for MmaTiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.wgmma {
            let d = if self.decoupled { "d" } else { "" };
            return write!(f, "{}x{}-wg{d}", self.warps, self.m_tiles);
        }
        let cp = if self.cp_async { "-cp" } else { "" };
        write!(f, "{}x{}{cp}", self.warps, self.m_tiles)?;
        if self.keys != MMA_KEYS {
            write!(f, "-k{}", self.keys)?;
        }
        Ok(())
    }
}

/// Process-wide override of the tiling; `None` means "from the environment".
static TILING_OVERRIDE: Mutex<Option<MmaTiling>> = Mutex::new(None);

/// The tiling the Mma forward launches with at `head_dim`: the last [`set_mma_tiling`], else
/// `SMP_BURN_FLASH_MMA_TILING` (`4x1`, `8x1`, `4x2` or `8x2`, each optionally with `-cp` or
/// `-cp-k32`, e.g. `8x1-cp`; or `8x1-wg` / `8x1-wgd`), else [`MmaTiling::default_for`] the
/// head dim and whether the device runs `wgmma` ([`wgmma_supported`]; the launch also needs
/// 16-byte aligned rows for it).
///
/// # Panics
/// If the environment variable is set to something else (a silent fallback would make a
/// benchmark measure the wrong kernel).
pub fn mma_tiling(head_dim: usize, wgmma: bool) -> MmaTiling {
    if let Some(t) = *TILING_OVERRIDE.lock().unwrap_or_else(|e| e.into_inner()) {
        return t;
    }
    match std::env::var("SMP_BURN_FLASH_MMA_TILING") {
        Ok(s) => MmaTiling::parse(&s).unwrap_or_else(|| {
            panic!(
                "SMP_BURN_FLASH_MMA_TILING={s:?}: expected one of 4x1, 8x1, 4x2, 8x2, \
                 optionally with -cp or -cp-k32 (e.g. 8x1-cp, 4x2-cp-k32), 8x1-wg or 8x1-wgd"
            )
        }),
        Err(_) => MmaTiling::default_for(head_dim, wgmma),
    }
}

/// Overrides the Mma tiling for this process (`None`: back to the environment / default).
pub fn set_mma_tiling(tiling: Option<MmaTiling>) {
    *TILING_OVERRIDE.lock().unwrap_or_else(|e| e.into_inner()) = tiling;
}

/// Where the Mma backward computes dQ.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MmaDq {
    /// Inside the dK/dV kernel, FlashAttention-2's scheme: each cube writes its `dS` block to
    /// shared memory once, multiplies it by its K block and adds the partial dQ to an f32
    /// buffer with atomics (then one element-wise pass scales and rounds it). 5 matrix
    /// products per (key block, query block) pair instead of 7; dQ is not bitwise
    /// reproducible (the order of the f32 additions varies between runs). Each lane adds its
    /// f32 column pairs with one 8-byte atomic, so it needs sm_90 or later (call DS: +13-18 %
    /// over two scalar atomics). The default at head dim 128 ([`MmaBwdTiling::DEFAULT_HD128`]).
    Atomic,
    /// A separate kernel per query block that recomputes `S` and `dP` (the Cmma backward's
    /// decomposition): 7 products, no atomics, deterministic.
    Split,
}

/// How the Mma backward moves the tiles of its inner loop (Q, dO, lse and delta in the dK/dV
/// kernel; K and V in the separate dQ kernel) from global to shared memory.
///
/// Why: with 8 warps the dK/dV kernel runs one cube per SM (dK and dV take 128 registers per
/// lane), so while the cube waits for a synchronously staged Q/dO block no other warp hides the
/// global-memory latency; at 32-query blocks that wait is a large share of an iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MmaBwdPipe {
    /// Each block is loaded and stored to shared memory between two barriers (the original
    /// kernels; the dQ kernel already prefetches K/V into registers).
    Sync,
    /// The dK/dV kernel loads the next Q/dO block (and its lse/delta) into registers right
    /// after the barrier, so that the loads are in flight during the current block's products
    /// (the forward's scheme; costs `inner * d / (32 * warps)` 32-bit registers per lane for
    /// the bf16 Q and dO, 16 at 8x32 and hd 128). The dQ kernel is unchanged.
    Prefetch,
    /// `cp.async` (global to shared without registers) into a second shared buffer, completion
    /// tracked by a cube `mbarrier` (`Barrier::commit_copy_async` + `arrive_and_wait`): one
    /// barrier per block instead of two, no staging registers, the next block's copy in flight
    /// during the current block's products. Both the dK/dV kernel (Q/dO/lse/delta) and the dQ
    /// kernel (K/V) use it; with [`MmaDq::Atomic`] there is no dQ kernel: the per-warp dK/dV
    /// kernel runs each block's fused dQ one block late to keep one barrier per block, the
    /// warp grid ([`MmaBwdTiling::warp_grid`]) has a second barrier for its `P^T`/`dS^T`
    /// exchange and runs the dQ behind it.
    Async,
}

/// Shape of the Mma backward: the dK/dV kernel has `warps` warps of 16 keys each and walks
/// the queries in blocks of `inner`; `dq` picks the dQ scheme, `pipe` how the inner loop's
/// tiles are staged, `wide_delta` the `delta = rowsum(dO * O)` kernel. The separate dQ kernel
/// ([`MmaDq::Split`]) uses `warps` warps of 16 query rows and key blocks of [`MMA_KEYS`].
///
/// Why a knob: the dK/dV kernel keeps dK and dV (`d / 2` f32 each per lane at hd 128, i.e.
/// 128 registers) plus `S^T` and `dP^T` (`inner / 2` f32 each) in registers, so `inner` trades
/// register pressure (spills) against per-block overhead, and 4 warps fit two cubes per SM
/// where 8 warps share one staged Q/dO block between more keys. Which wins is a measurement
/// (`SMP_BURN_FLASH_MMA_BWD_TILING`, [`set_mma_bwd_tiling`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaBwdTiling {
    /// Warps per cube: 4 or 8 (keys per cube of the dK/dV kernel: `16 * warps`).
    pub warps: usize,
    /// Queries per inner block of the dK/dV kernel: 32 or 64.
    pub inner: usize,
    /// Where dQ is computed.
    pub dq: MmaDq,
    /// How the inner loops stage their tiles.
    pub pipe: MmaBwdPipe,
    /// `delta` by a warp-cooperative kernel (a few lanes per row, 16-byte loads, shuffle
    /// reduction; `launch_delta_wide`) instead of one thread per row.
    pub wide_delta: bool,
    /// The dK/dV kernel tiles its warps as FlashAttention-2 does (the `-wg` suffix; with
    /// [`MmaDq::Atomic`] and [`MmaBwdPipe::Async`] only): warp `w` computes the scores of 32 keys
    /// (group `w / 2`) by half the block's queries (`w % 2`) and then dK/dV of the same 32 keys
    /// by half the head dim, exchanging `P^T` and `dS^T` through shared memory, instead of 16
    /// keys by all queries and all columns. Why: the per-warp layout reads every Q and dO tile
    /// from shared memory twice per warp, and the kernel is bound by shared-memory bandwidth
    /// (session 14, calls EV-EW); the grid needs about a fifth fewer shared loads per block at
    /// the cost of a second cube barrier.
    pub warp_grid: bool,
    /// Hopper's warpgroup MMA (`flash_bwd_dkdv_wgmma`, the `-wgmma` suffix,
    /// [`MmaBwdTiling::WGMMA`]; head dim 128, sm_90 and the workspace's vendored CubeCL).
    pub wgmma: bool,
}

impl MmaBwdTiling {
    /// 4 warps (64 keys per cube), 64-query blocks, dQ by the separate kernel, tiles staged with
    /// `cp.async`, the warp-cooperative delta: the fastest measured on an H200 (hd 128, causal,
    /// `flash_check`, session 4 call T): 189 TFLOP/s at S=4096 and 203 at 16384, where the
    /// synchronously staged 8x32-split (the previous default) gives 134 / 151, its register
    /// prefetch `-pf` 148 at 4096 and 8x64-split-cp-vd 185 / 209. Deterministic (no atomics),
    /// so also the choice wherever determinism is asked for (`SMP_BURN_DETERMINISTIC=1`) or
    /// f32-pair atomics are missing. Session 11 call DV, head dim 64: 187 / 200 TFLOP/s at S
    /// 4096 / 16384, where the atomic tilings give 149-175 / 169-202.
    pub const DEFAULT: MmaBwdTiling =
        MmaBwdTiling::new(4, 64, MmaDq::Split).with(MmaBwdPipe::Async, true);

    /// The default at head dim 128 and above (Llama 2 7B's) where the device adds f32 pairs
    /// atomically (sm_90): 8 warps (128 keys per cube), 64-query blocks, dQ fused by atomics
    /// (5 products per block pair instead of 7), `cp.async`, the warp-cooperative delta, and
    /// FlashAttention-2's warp grid ([`MmaBwdTiling::warp_grid`]). Session 11 call DV (per-warp
    /// layout): 203 / 241 TFLOP/s at S 4096 / 16384 (B 8 at 4096: 217) where
    /// [`MmaBwdTiling::DEFAULT`] gives 196 / 211 (198). Session 15 call FC, B1 S 4096 / 16384:
    /// 230-231 / 269-270 with the warp grid against 219-220 / 257 for the per-warp
    /// `8x64-atomic-cp-vd` (B2 S 16384: 265-266 against 256-258). Not bitwise reproducible (the
    /// order of dQ's f32 additions varies), as PyTorch's flash backward.
    pub const DEFAULT_HD128: MmaBwdTiling = MmaBwdTiling::new(8, 64, MmaDq::Atomic)
        .with(MmaBwdPipe::Async, true)
        .with_warp_grid();

    /// The default at head dim 64 (the 1b preset's) where the device adds f32 pairs atomically:
    /// the per-warp `8x64-atomic-cp-vd` (dQ fused by atomics, deferred by a block). Session 15
    /// call FD: backward 185 / 228 TFLOP/s at B1 S 4096 / 16384 (B2 S 16384: 230) where the
    /// split [`MmaBwdTiling::DEFAULT`] gives 182 / 202 (202) and the warp grid 186 / 220 (222);
    /// the 1b preset 1.9 % faster end to end (48,551 against 47,643 tok/s).
    pub const DEFAULT_HD64: MmaBwdTiling =
        MmaBwdTiling::new(8, 64, MmaDq::Atomic).with(MmaBwdPipe::Async, true);

    /// The warpgroup-MMA dK/dV kernel (`8x64-atomic-cp-vd-wgmma`, `flash_bwd_dkdv_wgmma`): two
    /// warpgroups of 64 keys (128 per cube), 64-query blocks, every product a `wgmma`, dQ added
    /// by one bulk reduction per row. Head dim 64 or 128 with 16-byte rows only; elsewhere the
    /// default runs in its place ([`backward_tiling`]). The default at head dim 128 where it
    /// runs: 333 / 378 TFLOP/s at B8 S 4k / B2 S 16k where [`MmaBwdTiling::DEFAULT_HD128`]
    /// gives 258 / 290 (session 19, calls GI and GK).
    pub const WGMMA: MmaBwdTiling = MmaBwdTiling {
        wgmma: true,
        ..MmaBwdTiling::new(8, 64, MmaDq::Atomic).with(MmaBwdPipe::Async, true)
    };

    /// The default for `head_dim` on a device that does (`pair_atomics`) or does not add f32
    /// pairs atomically, and does or does not run the warpgroup kernel (`wgmma`,
    /// [`wgmma_backward_supported`]): with pair atomics and unless `SMP_BURN_DETERMINISTIC=1`,
    /// [`MmaBwdTiling::WGMMA`] at 128 with `wgmma`, else [`MmaBwdTiling::DEFAULT_HD128`] at 128
    /// and above and [`MmaBwdTiling::DEFAULT_HD64`] at 64; else [`MmaBwdTiling::DEFAULT`].
    pub fn default_for(head_dim: usize, pair_atomics: bool, wgmma: bool) -> MmaBwdTiling {
        if !pair_atomics || deterministic() {
            Self::DEFAULT
        } else if head_dim == 128 && wgmma {
            Self::WGMMA
        } else if head_dim >= 128 {
            Self::DEFAULT_HD128
        } else if head_dim == 64 {
            Self::DEFAULT_HD64
        } else {
            Self::DEFAULT
        }
    }

    /// Every supported backward tiling, for checks and benchmarks: the eight original ones,
    /// then the staging/delta variants (the riskier `cp.async` ones last, so that a failure
    /// there leaves the others' results printed).
    pub const ALL: [MmaBwdTiling; 23] = [
        MmaBwdTiling::new(8, 64, MmaDq::Atomic),
        MmaBwdTiling::new(4, 64, MmaDq::Atomic),
        MmaBwdTiling::new(8, 32, MmaDq::Atomic),
        MmaBwdTiling::new(4, 32, MmaDq::Atomic),
        MmaBwdTiling::new(8, 64, MmaDq::Split),
        MmaBwdTiling::new(4, 64, MmaDq::Split),
        MmaBwdTiling::new(8, 32, MmaDq::Split),
        MmaBwdTiling::new(4, 32, MmaDq::Split),
        MmaBwdTiling::new(8, 32, MmaDq::Split).with(MmaBwdPipe::Sync, true),
        MmaBwdTiling::new(8, 32, MmaDq::Split).with(MmaBwdPipe::Prefetch, true),
        MmaBwdTiling::new(8, 64, MmaDq::Split).with(MmaBwdPipe::Prefetch, true),
        MmaBwdTiling::new(4, 32, MmaDq::Split).with(MmaBwdPipe::Prefetch, true),
        MmaBwdTiling::new(8, 32, MmaDq::Split).with(MmaBwdPipe::Async, true),
        MmaBwdTiling::new(8, 64, MmaDq::Split).with(MmaBwdPipe::Async, true),
        MmaBwdTiling::new(4, 64, MmaDq::Split).with(MmaBwdPipe::Async, true),
        MmaBwdTiling::new(4, 32, MmaDq::Atomic).with(MmaBwdPipe::Async, true),
        MmaBwdTiling::new(8, 32, MmaDq::Atomic).with(MmaBwdPipe::Async, true),
        MmaBwdTiling::new(4, 64, MmaDq::Atomic).with(MmaBwdPipe::Async, true),
        MmaBwdTiling::new(8, 64, MmaDq::Atomic).with(MmaBwdPipe::Async, true),
        MmaBwdTiling::new(4, 64, MmaDq::Atomic)
            .with(MmaBwdPipe::Async, true)
            .with_warp_grid(),
        MmaBwdTiling::new(8, 32, MmaDq::Atomic)
            .with(MmaBwdPipe::Async, true)
            .with_warp_grid(),
        MmaBwdTiling::new(8, 64, MmaDq::Atomic)
            .with(MmaBwdPipe::Async, true)
            .with_warp_grid(),
        MmaBwdTiling::WGMMA,
    ];

    const fn new(warps: usize, inner: usize, dq: MmaDq) -> Self {
        MmaBwdTiling {
            warps,
            inner,
            dq,
            pipe: MmaBwdPipe::Sync,
            wide_delta: false,
            warp_grid: false,
            wgmma: false,
        }
    }

    const fn with(self, pipe: MmaBwdPipe, wide_delta: bool) -> Self {
        MmaBwdTiling {
            pipe,
            wide_delta,
            ..self
        }
    }

    const fn with_warp_grid(self) -> Self {
        MmaBwdTiling {
            warp_grid: true,
            ..self
        }
    }

    /// Keys per cube of the dK/dV kernel.
    pub fn keys(&self) -> usize {
        16 * self.warps
    }

    /// Parses `WARPSxINNER-DQ[-pf|-cp][-vd][-wg]` with DQ `atomic` or `split`, e.g.
    /// `8x64-atomic`, `8x32-split-cp-vd` or `8x64-atomic-cp-vd-wg`; `None` for anything not in
    /// [`MmaBwdTiling::ALL`].
    pub fn parse(s: &str) -> Option<MmaBwdTiling> {
        let mut parts = s.trim().split('-');
        let (w, i) = parts.next()?.split_once('x')?;
        let dq = match parts.next()? {
            "atomic" => MmaDq::Atomic,
            "split" => MmaDq::Split,
            _ => return None,
        };
        let mut tiling = MmaBwdTiling::new(w.parse().ok()?, i.parse().ok()?, dq);
        for flag in parts {
            match flag {
                "pf" if tiling.pipe == MmaBwdPipe::Sync && !tiling.wide_delta => {
                    tiling.pipe = MmaBwdPipe::Prefetch
                }
                "cp" if tiling.pipe == MmaBwdPipe::Sync && !tiling.wide_delta => {
                    tiling.pipe = MmaBwdPipe::Async
                }
                "vd" if !tiling.wide_delta => tiling.wide_delta = true,
                "wg" if !tiling.warp_grid && !tiling.wgmma => tiling.warp_grid = true,
                "wgmma" if !tiling.warp_grid && !tiling.wgmma => tiling.wgmma = true,
                _ => return None,
            }
        }
        Self::ALL.contains(&tiling).then_some(tiling)
    }
}

impl std::fmt::Display for MmaBwdTiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dq = match self.dq {
            MmaDq::Atomic => "atomic",
            MmaDq::Split => "split",
        };
        let pipe = match self.pipe {
            MmaBwdPipe::Sync => "",
            MmaBwdPipe::Prefetch => "-pf",
            MmaBwdPipe::Async => "-cp",
        };
        let delta = if self.wide_delta { "-vd" } else { "" };
        let grid = if self.warp_grid { "-wg" } else { "" };
        let wgmma = if self.wgmma { "-wgmma" } else { "" };
        write!(
            f,
            "{}x{}-{dq}{pipe}{delta}{grid}{wgmma}",
            self.warps, self.inner
        )
    }
}

/// Process-wide override of the backward tiling; `None` means "from the environment".
static BWD_TILING_OVERRIDE: Mutex<Option<MmaBwdTiling>> = Mutex::new(None);

/// Process-wide override of [`deterministic`]; `None` means "from the environment".
static DETERMINISTIC_OVERRIDE: Mutex<Option<bool>> = Mutex::new(None);

/// Asks for bitwise reproducible kernels (`Some(true)`), allows the faster non-deterministic
/// ones (`Some(false)`), or defers to `SMP_BURN_DETERMINISTIC` (`None`), for this process; the
/// trainer's `--deterministic` sets it before the first step.
pub fn set_deterministic(on: Option<bool>) {
    *DETERMINISTIC_OVERRIDE
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = on;
}

/// Whether the user asked for bitwise reproducible kernels ([`set_deterministic`], else
/// `SMP_BURN_DETERMINISTIC=1` or `true`, read once): then the attention backward keeps its
/// deterministic split dQ at every head dim. Every other kernel of the project is
/// deterministic anyway.
///
/// # Panics
/// If the variable holds anything but `1`, `0`, `true`, `false` or nothing: a misspelt value
/// must not leave a run silently non-reproducible.
pub fn deterministic() -> bool {
    if let Some(on) = *DETERMINISTIC_OVERRIDE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
    {
        return on;
    }
    static DETERMINISTIC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DETERMINISTIC.get_or_init(|| env_switch("SMP_BURN_DETERMINISTIC", false))
}

/// Whether the `cp.async` dK/dV kernel with fused dQ defers each block's `dQ = dS K` to the
/// next block: the `dS^T` tile is double-buffered and read after the next block's barrier, so
/// one cube barrier per block remains instead of two (all 8 warps of the only cube on an SM
/// wait at each). On unless `SMP_BURN_FLASH_DEFER_DQ=0` (read once; for measuring the
/// difference).
///
/// # Panics
/// If the variable holds anything but `1`, `0`, `true`, `false` or nothing.
fn defer_fused_dq() -> bool {
    static DEFER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DEFER.get_or_init(|| env_switch("SMP_BURN_FLASH_DEFER_DQ", true))
}

/// How the forward rescales a warp's output accumulators (`O *= exp(m_old - m_new)`, 128
/// multiplies per lane and block at hd 128 with two m-tiles) when a row's running maximum
/// grows. With `skip` the warp votes and skips the multiplies in blocks where no row's maximum
/// moved: exact, as every factor is then 1, and late in a long row almost no maximum grows
/// (+6 % on the hd-128 forward, session 13 call EF). `slack` (natural-log units) also keeps a
/// maximum stale while a new one exceeds it by at most that much, as FlashAttention-4 does, so
/// that fewer blocks rescale (another +3-4 %, call EG); the probabilities then reach
/// `exp(slack)` (about 3,000 at the default 8) before the final division by the row sum, which
/// carries the same maximum and cancels it, and `lse = m + ln(l)` stays the same value.
#[derive(Clone, Copy, Debug, PartialEq)]
struct RescalePolicy {
    /// Skip the multiplies where no row's maximum moved.
    skip: bool,
    /// How far a maximum may grow and stay stale (only read with `skip`).
    slack: f32,
}

/// The forward's default rescale slack: `exp(8)` keeps the stale-maximum probabilities far
/// inside f32 and bf16 range while almost every block after the first few skips its rescale.
const DEFAULT_RESCALE_SLACK: f32 = 8.0;

/// The [`RescalePolicy`] from `SMP_BURN_FLASH_SKIP_RESCALE` (`0` turns the skip off; default
/// on) and `SMP_BURN_FLASH_RESCALE_SLACK` (a number from 0 to 20, 0 for the exact skip;
/// default [`DEFAULT_RESCALE_SLACK`]), read once.
///
/// # Panics
/// If either variable holds anything else (a silent fallback would make a benchmark measure
/// the wrong kernel).
fn rescale_policy() -> RescalePolicy {
    static POLICY: std::sync::OnceLock<RescalePolicy> = std::sync::OnceLock::new();
    *POLICY.get_or_init(|| {
        let skip = env_switch("SMP_BURN_FLASH_SKIP_RESCALE", true);
        let slack = match std::env::var("SMP_BURN_FLASH_RESCALE_SLACK") {
            Err(_) => DEFAULT_RESCALE_SLACK,
            Ok(value) => parse_slack(&value).unwrap_or_else(|| {
                panic!("SMP_BURN_FLASH_RESCALE_SLACK={value:?}: expected a number from 0 to 20")
            }),
        };
        RescalePolicy { skip, slack }
    })
}

/// A rescale slack from 0 to 20 (`exp(20)` is far inside f32's range); `None` otherwise.
fn parse_slack(value: &str) -> Option<f32> {
    let slack: f32 = value.trim().parse().ok()?;
    (0.0..=20.0).contains(&slack).then_some(slack)
}

/// The on/off environment variable `name` ([`parse_switch`]), `unset` where it is not set.
///
/// # Panics
/// If it holds anything else, naming the variable and its value: a silent fallback would
/// leave a run or a benchmark on the wrong kernel.
fn env_switch(name: &str, unset: bool) -> bool {
    match std::env::var(name) {
        Err(_) => unset,
        Ok(value) => parse_switch(&value)
            .unwrap_or_else(|| panic!("{name}={value:?}: expected 1 / true or 0 / false")),
    }
}

/// An on/off environment value: `1` / `true` on, `0` / `false` / empty off (any case,
/// surrounding blanks ignored); `None` for anything else.
fn parse_switch(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" => Some(true),
        "" | "0" | "false" => Some(false),
        _ => None,
    }
}

/// The tiling the Mma backward launches with at `head_dim` on a device with or without f32-pair
/// atomics ([`pair_atomics_supported`]): the last [`set_mma_bwd_tiling`], else
/// `SMP_BURN_FLASH_MMA_BWD_TILING` (e.g. `8x64-atomic`, `4x32-split`; see
/// [`MmaBwdTiling::ALL`]), else [`MmaBwdTiling::default_for`].
///
/// # Panics
/// If the environment variable is set to something else (as [`mma_tiling`]).
pub fn mma_bwd_tiling(head_dim: usize, pair_atomics: bool, wgmma: bool) -> MmaBwdTiling {
    if let Some(t) = *BWD_TILING_OVERRIDE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
    {
        return t;
    }
    match std::env::var("SMP_BURN_FLASH_MMA_BWD_TILING") {
        Ok(s) => MmaBwdTiling::parse(&s).unwrap_or_else(|| {
            panic!(
                "SMP_BURN_FLASH_MMA_BWD_TILING={s:?}: expected {{4,8}}x{{32,64}}-{{atomic,split}}, \
                 e.g. 8x64-atomic, or one of the -pf/-cp/-vd tilings of MmaBwdTiling::ALL"
            )
        }),
        Err(_) => MmaBwdTiling::default_for(head_dim, pair_atomics, wgmma),
    }
}

/// Overrides the Mma backward tiling for this process (`None`: back to the environment /
/// default).
pub fn set_mma_bwd_tiling(tiling: Option<MmaBwdTiling>) {
    *BWD_TILING_OVERRIDE
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = tiling;
}

/// Whether the device has `mma.sync` m16n8k16 with `dtype` inputs and f32 accumulators, and
/// `ldmatrix` for `dtype` (CUDA sm_80 and later).
pub fn mma_supported<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType) -> bool {
    let elem = match dtype {
        DType::BF16 => ElemType::Float(FloatKind::BF16),
        DType::F16 => ElemType::Float(FloatKind::F16),
        _ => return false,
    };
    let features = client.features();
    features.matmul.mma.contains(&MmaConfig {
        a_type: elem.into(),
        b_type: elem.into(),
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: 16,
        n: 8,
        k: 16,
    }) && features.matmul.ldmatrix.contains(&elem.into())
}

// ------------------------------------------------------------------------------------------
// Fragment helpers (device side). One warp each; `lane` is UNIT_POS_PLANE.
// ------------------------------------------------------------------------------------------

/// `ldmatrix.x4` (optionally `.trans`) from a shared tile of `nv`-element vectors: the 16-byte
/// row this lane supplies starts at element `base + offset`, both multiples of `nv`. Why two
/// parts: callers pass the lane's runtime offset, the same for every call of an unrolled loop,
/// as `base` and the loop's part as the comptime `offset`, so each load's index is one
/// loop-invariant value plus a constant, which the compiler folds into the instruction's
/// immediate. A single runtime `(base + offset) / nv` cost a shift and address arithmetic per
/// load (call DF: about 500 integer instructions per block pair in the dK/dV kernel).
#[cube]
fn ldsm_x4<F: Float, N: Size>(
    smem: &SharedMemory<Vector<F, N>>,
    base: usize,
    #[comptime] offset: usize,
    #[comptime] nv: usize,
    #[comptime] trans: bool,
) -> Array<Vector<F, Const<2>>> {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let start = base / nv + comptime!(offset / nv);
    let len = comptime!(8 / nv);
    def.load_matrix::<Vector<F, N>, Const<2>>(
        &smem.slice(start, start + len),
        cmma::MatrixIdent::A,
        4usize,
        trans,
    )
}

/// Registers `first` and `first + 1` of an x4 load: one B fragment.
#[cube]
fn frag_pair<F: Float>(
    x4: &Array<Vector<F, Const<2>>>,
    #[comptime] first: usize,
) -> Array<Vector<F, Const<2>>> {
    let mut out = Array::<Vector<F, Const<2>>>::new(2usize);
    out[0] = x4[first];
    out[1] = x4[comptime!(first + 1)];
    out
}

/// `n` f32 accumulator fragments (16 x 8 each) set to zero.
#[cube]
fn zero_frags(#[comptime] n: usize) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let mut frags = Sequence::<Array<Vector<f32, Const<2>>>>::new();
    #[unroll]
    for _i in 0..n {
        let mut a = Array::<Vector<f32, Const<2>>>::new(2usize);
        a[0] = Vector::new(f32::new(0.0));
        a[1] = Vector::new(f32::new(0.0));
        frags.push(a);
    }
    frags
}

/// `S = A B^T` for one warp: `A` is `16 * m_tiles` rows of a row-major shared tile starting at
/// row `a_row0` (pitch `ldt`), `B` the `8 * n_tiles` rows of another starting at row `b_row0`
/// (a multiple of 8: 0, or the second half of a double buffer), both
/// `16 * k_steps` columns wide. Fragment `mt * n_tiles + nt` of `s` receives rows
/// `16 mt .. 16 mt + 16`, columns (rows of B) `8 nt .. 8 nt + 8`; its previous content is
/// overwritten. `n_tiles` must be even.
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_abt_strip<F: Float, N: Size>(
    a: &SharedMemory<Vector<F, N>>,
    a_row0: usize,
    b: &SharedMemory<Vector<F, N>>,
    b_row0: usize,
    s: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    lane: usize,
    #[comptime] m_tiles: usize,
    #[comptime] n_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    #[unroll]
    for i in 0..comptime!(m_tiles * n_tiles) {
        let acc = s.index_mut(i);
        acc[0] = Vector::new(f32::new(0.0));
        acc[1] = Vector::new(f32::new(0.0));
    }
    // A: lane l supplies row l % 16, column 8 (l / 16) of the 16x16 sub-tile.
    let a_row = lane % 16;
    let a_col = (lane / 16) * 8;
    // B (rows of the B tile are the n dimension): lane l supplies row l % 8 + 8 (l / 16),
    // column 8 ((l / 8) % 2): matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
    // (n 8-15, k 8-15) = b0, b1 of n-tile 2j, then b0, b1 of n-tile 2j + 1.
    let b_row = lane % 8 + (lane / 16) * 8;
    let b_col = ((lane / 8) % 2) * 8;
    let a_base = (a_row0 + a_row) * ldt + a_col;
    let b_base = (b_row0 + b_row) * ldt + b_col;
    #[unroll]
    for kk in 0..k_steps {
        let mut a_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for mt in 0..m_tiles {
            a_frags.push(ldsm_x4::<F, N>(
                a,
                a_base,
                comptime!(16 * mt * ldt + 16 * kk),
                nv,
                false,
            ));
        }
        #[unroll]
        for np in 0..comptime!(n_tiles / 2) {
            let b4 = ldsm_x4::<F, N>(b, b_base, comptime!(16 * np * ldt + 16 * kk), nv, false);
            let b_lo = frag_pair::<F>(&b4, 0usize);
            let b_hi = frag_pair::<F>(&b4, 2usize);
            #[unroll]
            for mt in 0..m_tiles {
                let af = a_frags.index(mt);
                def.execute_inplace(af, &b_lo, s.index_mut(comptime!(mt * n_tiles + 2 * np)));
                def.execute_inplace(af, &b_hi, s.index_mut(comptime!(mt * n_tiles + 2 * np + 1)));
            }
        }
    }
}

/// `O += P V` for one warp: `p` holds the probabilities of `16 * m_tiles` rows by
/// `8 * n_tiles` keys in accumulator order (`((mt * n_tiles + nt) * 2 + h) * 2 + e` is
/// element `e` of vector `h` of fragment (mt, nt)); `V` is a row-major shared tile `[key][d]`
/// (pitch `ldt`) whose key 0 is row `v_row0` (a multiple of 8). Fragment `mt * d_tiles + dt` of `o` accumulates rows of m-tile `mt`,
/// columns `8 dt .. 8 dt + 8`. P is rounded to `F` here (as in FlashAttention-2).
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_pv_strip<F: Float, N: Size>(
    p: &Array<f32>,
    v: &SharedMemory<Vector<F, N>>,
    v_row0: usize,
    o: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    lane: usize,
    #[comptime] m_tiles: usize,
    #[comptime] n_tiles: usize,
    #[comptime] d_tiles: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    // Transposed V loads: lane l supplies key row l % 16, column 8 (l / 16): matrices (keys
    // 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15) = b0, b1 of
    // d-tile 2j, then b0, b1 of d-tile 2j + 1.
    let v_row = lane % 16;
    let v_col = (lane / 16) * 8;
    let v_base = (v_row0 + v_row) * ldt + v_col;
    #[unroll]
    for kk in 0..comptime!(n_tiles / 2) {
        // A fragment of keys 16 kk .. 16 kk + 16 = accumulators of key n-tiles 2kk, 2kk + 1:
        // (n-tile 2kk, row g), (2kk, row g + 8), (2kk + 1, row g), (2kk + 1, row g + 8).
        let mut p_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for mt in 0..m_tiles {
            p_frags.push(p_fragment::<F>(p, mt, kk, n_tiles));
        }
        #[unroll]
        for dp in 0..comptime!(d_tiles / 2) {
            let b4 = ldsm_x4::<F, N>(v, v_base, comptime!(16 * kk * ldt + 16 * dp), nv, true);
            let b_lo = frag_pair::<F>(&b4, 0usize);
            let b_hi = frag_pair::<F>(&b4, 2usize);
            #[unroll]
            for mt in 0..m_tiles {
                let pf = p_frags.index(mt);
                def.execute_inplace(pf, &b_lo, o.index_mut(comptime!(mt * d_tiles + 2 * dp)));
                def.execute_inplace(pf, &b_hi, o.index_mut(comptime!(mt * d_tiles + 2 * dp + 1)));
            }
        }
    }
}

/// The A fragment (`m16n8k16`, four pairs) of m-tile `mt` and keys `16 kk .. 16 kk + 16` of
/// the probabilities `p` (accumulator order, `n_tiles` key tiles), rounded to `F`: the
/// accumulators of key tiles `2 kk` and `2 kk + 1` are, in that order, rows g, g + 8 of the A
/// operand's first and second 8 columns.
#[cube]
fn p_fragment<F: Float>(
    p: &Array<f32>,
    #[comptime] mt: usize,
    #[comptime] kk: usize,
    #[comptime] n_tiles: usize,
) -> Array<Vector<F, Const<2>>> {
    let mut pa = Array::<Vector<F, Const<2>>>::new(4usize);
    #[unroll]
    for j in 0..4usize {
        let base = comptime!(((mt * n_tiles + 2 * kk + j / 2) * 2 + j % 2) * 2);
        let mut pv = Vector::<F, Const<2>>::empty();
        pv[0] = F::cast_from(p[base]);
        pv[1] = F::cast_from(p[comptime!(base + 1)]);
        pa[j] = pv;
    }
    pa
}

/// Writes one warp's `16 * m_tiles x 8 * n_tiles` block, held in accumulator order in `vals`
/// (as `p` of [`mma_pv_strip`]), rounded to `F`, into rows `row0 ..` of a shared tile of
/// element pairs with pitch `ld` elements, from column `c_lo` on (the lane's accumulator column
/// plus the block's first column): each lane stores its two adjacent columns as one 32-bit
/// word (bank-conflict-free when `ld` is 8 modulo 16, as `inner + 8` is: the 8 rows of a store
/// then start on banks 4 apart).
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_acc_pairs<F: Float>(
    vals: &Array<f32>,
    dst: &mut SharedMemory<Vector<F, Const<2>>>,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    #[comptime] n_tiles: usize,
    #[comptime] ld: usize,
    #[comptime] m_tiles: usize,
) {
    #[unroll]
    for hh in 0..2usize {
        let mut r = r_lo;
        if hh == 1 {
            r = r_hi;
        }
        // In pairs: `c_lo` and `ld` are even (see `ldsm_x4` for why the constant is split off).
        let base = ((row0 + r) * ld + c_lo) / 2;
        #[unroll]
        for mt in 0..m_tiles {
            #[unroll]
            for nt in 0..n_tiles {
                let idx = comptime!(((mt * n_tiles + nt) * 2 + hh) * 2);
                let mut pair = Vector::<F, Const<2>>::empty();
                pair[0] = F::cast_from(vals[idx]);
                pair[1] = F::cast_from(vals[comptime!(idx + 1)]);
                dst[base + comptime!((16 * mt * ld + 8 * nt) / 2)] = pair;
            }
        }
    }
}

/// `acc += X^T B` for one warp, where `X` is stored `[k][m]` (pitch `ldx`, element pairs) and
/// the product takes its columns `m0 .. m0 + 16 * m_tiles` (so `X^T` gives `m_tiles` 16-row A
/// operands), `B` is a row-major `[k][n]` tile (pitch `ldb`) read from column `b_col0` on; `k`
/// runs over `16 * k_steps` rows of both. Fragment `mt * n_tiles + nt` of `acc` receives rows
/// `16 mt ..` and columns `b_col0 + 8 nt ..`. `n_tiles` must be even. Two m-tiles share each
/// loaded B fragment, so a warp's shared-memory reads per product fall by a fifth at `n_tiles`
/// 4 against one m-tile at 8. This is how the dK/dV kernel forms `dQ = dS K` from its `dS^T`
/// (stored as it lies in the accumulators: keys by queries) without a transposing store.
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_atb_acc<F: Float, NX: Size, N: Size>(
    x: &SharedMemory<Vector<F, NX>>,
    m0: usize,
    b: &SharedMemory<Vector<F, N>>,
    b_col0: usize,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    lane: usize,
    #[comptime] m_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] n_tiles: usize,
    #[comptime] ldx: usize,
    #[comptime] nvx: usize,
    #[comptime] ldb: usize,
    #[comptime] nvb: usize,
) {
    // Transposed loads of X: lane l supplies k row l % 8 + 8 (l / 16), m column 8 ((l / 8) %
    // 2): stored blocks (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15),
    // which transposed are a0 (m 0-7, k 0-7), a1 (m 8-15, k 0-7), a2 (m 0-7, k 8-15), a3
    // (m 8-15, k 8-15) of the A fragment.
    let x_base = (lane % 8 + (lane / 16) * 8) * ldx + m0 + ((lane / 8) % 2) * 8;
    mma_acc_core::<F, NX, N>(
        x, x_base, b, 0usize, b_col0, acc, lane, true, m_tiles, k_steps, n_tiles, ldx, nvx, ldb,
        nvb,
    );
}

/// `acc += A B` for one warp, where `A` is a row-major `[m][k]` shared tile of element pairs
/// (pitch `lda`) whose rows `a_row0 .. a_row0 + 16 * m_tiles` the product takes, and `B` a
/// row-major `[k][n]` tile (pitch `ldb`) read from row `b_row0` and column `b_col0` on; `k`
/// runs over `16 * k_steps` columns of A and rows of B. Fragment `mt * n_tiles + nt` of `acc`
/// receives rows `16 mt ..` and columns `b_col0 + 8 nt ..`. `n_tiles` must be even. The
/// warp-grid dK/dV kernel forms `dV += P^T dO` and `dK += dS^T Q` this way from the `P^T` and
/// `dS^T` tiles its warps share: A by plain `ldmatrix` (as in [`mma_abt_strip`]), B by
/// transposed ones (as V in [`mma_pv_strip`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_ab_acc<F: Float, NA: Size, N: Size>(
    a: &SharedMemory<Vector<F, NA>>,
    a_row0: usize,
    b: &SharedMemory<Vector<F, N>>,
    b_row0: usize,
    b_col0: usize,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    lane: usize,
    #[comptime] m_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] n_tiles: usize,
    #[comptime] lda: usize,
    #[comptime] nva: usize,
    #[comptime] ldb: usize,
    #[comptime] nvb: usize,
) {
    // Plain loads of A, as in `mma_abt_strip`.
    let a_base = (a_row0 + lane % 16) * lda + (lane / 16) * 8;
    mma_acc_core::<F, NA, N>(
        a, a_base, b, b_row0, b_col0, acc, lane, false, m_tiles, k_steps, n_tiles, lda, nva, ldb,
        nvb,
    );
}

/// The loop of [`mma_atb_acc`] and [`mma_ab_acc`]: `acc += A B` with this lane's `ldmatrix`
/// row of A at `a_base` (transposed loads of a `[k][m]` tile with `a_trans`, plain loads of an
/// `[m][k]` tile without) and B a row-major `[k][n]` tile read from row `b_row0`, column
/// `b_col0` on by transposed loads (lane l supplies k row l % 16, column 8 (l / 16), as V in
/// [`mma_pv_strip`]). Two m-tiles share each loaded B fragment.
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_acc_core<F: Float, NA: Size, N: Size>(
    a: &SharedMemory<Vector<F, NA>>,
    a_base: usize,
    b: &SharedMemory<Vector<F, N>>,
    b_row0: usize,
    b_col0: usize,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    lane: usize,
    #[comptime] a_trans: bool,
    #[comptime] m_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] n_tiles: usize,
    #[comptime] lda: usize,
    #[comptime] nva: usize,
    #[comptime] ldb: usize,
    #[comptime] nvb: usize,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let b_base = (b_row0 + lane % 16) * ldb + b_col0 + (lane / 16) * 8;
    #[unroll]
    for kk in 0..k_steps {
        let mut a_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for mt in 0..m_tiles {
            let offset = comptime!(if a_trans {
                16 * kk * lda + 16 * mt
            } else {
                16 * mt * lda + 16 * kk
            });
            a_frags.push(ldsm_x4::<F, NA>(a, a_base, offset, nva, a_trans));
        }
        #[unroll]
        for np in 0..comptime!(n_tiles / 2) {
            let b4 = ldsm_x4::<F, N>(b, b_base, comptime!(16 * kk * ldb + 16 * np), nvb, true);
            let b_lo = frag_pair::<F>(&b4, 0usize);
            let b_hi = frag_pair::<F>(&b4, 2usize);
            #[unroll]
            for mt in 0..m_tiles {
                let af = a_frags.index(mt);
                def.execute_inplace(af, &b_lo, acc.index_mut(comptime!(mt * n_tiles + 2 * np)));
                def.execute_inplace(
                    af,
                    &b_hi,
                    acc.index_mut(comptime!(mt * n_tiles + 2 * np + 1)),
                );
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------

/// `2^x` through `__powf(2, x)` (CubeCL has no `exp2`). The forward keeps its scores, maxima
/// and slack in log2 units for it (the launch scales them by log2(e)), as FlashAttention does,
/// and runs 4-5 % faster than with `exp` (session 14 call EU, deterministic builds). Why is not
/// settled: the PTX holds as many `ex2.approx.f32` as with `exp`, none of them `.ftz` (call
/// EQ), plus 4 `lg2.approx` outside the loop; the SASS of the two has not been compared. The
/// backward's version gained nothing (call ES) and is not applied.
#[cube]
fn exp2(x: f32) -> f32 {
    f32::new(2.0).powf(x)
}

/// ln(2), to turn the forward's log2-unit maximum into the natural-log `lse`.
const LN_2: f32 = std::f32::consts::LN_2;

/// One key block of the forward kernels for one warp's `16 * m_tiles` query rows (first row
/// `row0`, row `wrow` of `qs`): `S = Q K^T`, the online softmax ([`fwd_softmax`]), then
/// `O += P V`. The block's first key is `k0`; its K and V rows start at row `krow0` of `ks` and
/// `vs` (0, or the second half of a double buffer). Shared by [`flash_fwd_mma`] and
/// `flash_fwd_mma_cp`, which only differ in how the K/V tiles get to shared memory.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fwd_block<F: Float, N: Size>(
    qs: &SharedMemory<Vector<F, N>>,
    ks: &SharedMemory<Vector<F, N>>,
    vs: &SharedMemory<Vector<F, N>>,
    krow0: usize,
    k0: usize,
    wrow: usize,
    row0: usize,
    lane: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    rescale_slack: f32,
    s_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    m_run: &mut Array<f32>,
    l_run: &mut Array<f32>,
    o_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] m_tiles: usize,
    #[comptime] n_tiles: usize,
    #[comptime] d_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] causal_mask: bool,
    #[comptime] skip_rescale: bool,
) {
    mma_abt_strip::<F, N>(
        qs, wrow, ks, krow0, s_acc, lane, m_tiles, n_tiles, k_steps, ldt, nv,
    );
    fwd_softmax(
        s_acc,
        p,
        m_run,
        l_run,
        o_acc,
        k0,
        row0,
        r_lo,
        r_hi,
        c_lo,
        scale,
        rescale_slack,
        m_tiles,
        n_tiles,
        d_tiles,
        causal_mask,
        skip_rescale,
    );
    mma_pv_strip::<F, N>(
        p, vs, krow0, o_acc, lane, m_tiles, n_tiles, d_tiles, ldt, nv,
    );
}

/// The online softmax of one key block for one warp's `16 * m_tiles` query rows (first row
/// `row0`), on the scores `s_acc` (in accumulator order, keys from `k0`): writes the block's
/// probabilities to `p` (as [`mma_pv_strip`] takes them), updates the running maxima `m_run`
/// (log2 units) and partial sums `l_run`, and rescales `o_acc` where a maximum grew. The causal
/// mask only on blocks that reach past the warp's first row, and only compiled in with
/// `causal_mask`, which the kernels leave off for blocks no row of the warp reaches past.
/// Shared by the `mma.sync` and the `wgmma` forwards, whose accumulators have the same layout.
#[cube]
// `if comptime!(..) { if runtime {..} }` stays nested: the outer branch is resolved at
// expansion, the inner one is emitted.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn fwd_softmax(
    s_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    m_run: &mut Array<f32>,
    l_run: &mut Array<f32>,
    o_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    k0: usize,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    rescale_slack: f32,
    #[comptime] m_tiles: usize,
    #[comptime] n_tiles: usize,
    #[comptime] d_tiles: usize,
    #[comptime] causal_mask: bool,
    #[comptime] skip_rescale: bool,
) {
    // With `skip_rescale`, each row's factor waits here until the warp knows whether any of
    // its rows found a larger maximum (late in a long row almost none does), or one larger by
    // more than `rescale_slack`.
    let mut alphas = Array::<f32>::new(comptime!(2 * m_tiles));
    let mut grew = false;
    // Only blocks that reach past this warp's first row need the causal mask.
    let masked = k0 + comptime!(8 * n_tiles) > row0 + 1;
    #[unroll]
    for mt in 0..m_tiles {
        #[unroll]
        for hh in 0..2usize {
            let mut r = r_lo;
            if hh == 1 {
                r = r_hi;
            }
            let row = row0 + 16 * mt + r;
            let si = comptime!(mt * 2 + hh);
            // Raw scores of this row (scale > 0, so the max commutes with it).
            let mut mx = f32::new(-1.0e30);
            #[unroll]
            for nt in 0..n_tiles {
                let frag = s_acc.index(comptime!(mt * n_tiles + nt));
                let pair = frag[hh];
                #[unroll]
                for e in 0..2usize {
                    let mut sv = pair[e];
                    if comptime!(causal_mask) {
                        if masked {
                            let key = k0 + 8 * nt + c_lo + e;
                            if key > row {
                                sv = f32::new(-1.0e30);
                            }
                        }
                    }
                    p[comptime!(((mt * n_tiles + nt) * 2 + hh) * 2 + e)] = sv;
                    mx = f32::max(mx, sv);
                }
            }
            mx = f32::max(mx, plane_shuffle_xor(mx, 1u32));
            mx = f32::max(mx, plane_shuffle_xor(mx, 2u32));
            let m_old = m_run[si];
            let mut m_new = f32::max(m_old, mx * scale);
            if comptime!(skip_rescale) {
                // A maximum that grew by at most the slack stays stale: the row's
                // probabilities may then reach `exp(slack)`, harmless in f32 and exact once
                // divided by the row sum, which carries the same maximum.
                if m_new <= m_old + rescale_slack {
                    m_new = m_old;
                }
            }
            let alpha = exp2(m_old - m_new);
            m_run[si] = m_new;
            let mut lsum = f32::new(0.0);
            #[unroll]
            for j in 0..comptime!(2 * n_tiles) {
                let idx = comptime!(((mt * n_tiles + j / 2) * 2 + hh) * 2 + j % 2);
                let pe = exp2(p[idx] * scale - m_new);
                p[idx] = pe;
                lsum += pe;
            }
            l_run[si] = l_run[si] * alpha + lsum;
            if comptime!(skip_rescale) {
                alphas[si] = alpha;
                if m_new > m_old {
                    grew = true;
                }
            } else {
                let alpha_v = Vector::<f32, Const<2>>::new(alpha);
                #[unroll]
                for dt in 0..d_tiles {
                    let frag = o_acc.index_mut(comptime!(mt * d_tiles + dt));
                    frag[hh] = frag[hh] * alpha_v;
                }
            }
        }
    }
    if comptime!(skip_rescale) {
        // Warp-uniform: where no row's maximum moved every factor is exactly 1 (`exp(0)`), so
        // skipping the multiplies changes no value.
        if plane_any(grew) {
            #[unroll]
            for mt in 0..m_tiles {
                #[unroll]
                for hh in 0..2usize {
                    let alpha_v = Vector::<f32, Const<2>>::new(alphas[comptime!(mt * 2 + hh)]);
                    #[unroll]
                    for dt in 0..d_tiles {
                        let frag = o_acc.index_mut(comptime!(mt * d_tiles + dt));
                        frag[hh] = frag[hh] * alpha_v;
                    }
                }
            }
        }
    }
}

/// The end of the forward kernels: finishes the row sums across each quad (every lane summed
/// only its own columns), then writes this warp's rows of `o` (`O / l`, through `o`'s strides,
/// so any layout with a unit last stride and even row strides works) and `lse = m + ln(l)`,
/// for rows before `seq`. Each lane's two adjacent columns go out as one 4-byte store: half
/// the store instructions of element-wise writes, at the end of every cube.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_fwd_out<F: Float>(
    o: &mut Tensor<Vector<F, Const<2>>>,
    lse: &mut Tensor<f32>,
    o_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    m_run: &Array<f32>,
    l_run: &mut Array<f32>,
    b: usize,
    h: usize,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    seq: usize,
    #[comptime] m_tiles: usize,
    #[comptime] d_tiles: usize,
) {
    #[unroll]
    for i in 0..comptime!(2 * m_tiles) {
        let l = l_run[i];
        let l = l + plane_shuffle_xor(l, 1u32);
        l_run[i] = l + plane_shuffle_xor(l, 2u32);
    }
    let o_base = b * o.stride(0) + h * o.stride(1);
    let lse_base = b * lse.stride(0) + h * lse.stride(1);
    #[unroll]
    for mt in 0..m_tiles {
        #[unroll]
        for hh in 0..2usize {
            let mut r = r_lo;
            if hh == 1 {
                r = r_hi;
            }
            let row = row0 + 16 * mt + r;
            let si = comptime!(mt * 2 + hh);
            if row < seq {
                let l = l_run[si];
                let inv = f32::new(1.0) / l;
                // In pairs: `c_lo` and the strides are even.
                let ob = (o_base + row * o.stride(2) + c_lo) / 2;
                #[unroll]
                for dt in 0..d_tiles {
                    let frag = o_acc.index(comptime!(mt * d_tiles + dt));
                    let pair = frag[hh];
                    let mut out = Vector::<F, Const<2>>::empty();
                    out[0] = F::cast_from(pair[0] * inv);
                    out[1] = F::cast_from(pair[1] * inv);
                    o[ob + comptime!(4 * dt)] = out;
                }
                if c_lo == 0 {
                    // The maximum is in log2 units (see `fwd_block`).
                    lse[lse_base + row * lse.stride(2)] = m_run[si] * LN_2 + l.ln();
                }
            }
        }
    }
}

/// Forward, manual MMA. Cube = (query head, query block from the last, batch); `32 * warps`
/// threads; see the module doc.
#[cube(launch_unchecked, fast_math = FastMath::all())]
// `if comptime!(..) { if runtime {..} }` stays nested: the outer branch is resolved at
// expansion, the inner one is emitted.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn flash_fwd_mma<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    o: &mut Tensor<Vector<F, Const<2>>>,
    lse: &mut Tensor<f32>,
    scale: f32,
    rescale_slack: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] warps: usize,
    #[comptime] m_tiles: usize,
    #[comptime] skip_rescale: bool,
    #[define(F)] _dtype: StorageType,
) {
    let rows_w = comptime!(16 * m_tiles);
    let bq = comptime!(16 * m_tiles * warps);
    let bk = comptime!(MMA_KEYS);
    let nthreads = comptime!(32 * warps);
    let ldt = comptime!(d + 8);
    let n_tiles = comptime!(MMA_KEYS / 8);
    let d_tiles = comptime!(d / 8);
    let k_steps = comptime!(d / 16);
    let prefetch = comptime!(m_tiles == 1);
    let kv_regs = comptime!(MMA_KEYS * d / nv / (32 * warps));

    let seq = seq_len as usize;
    let h = CUBE_POS_X as usize;
    let qb = n_blocks as usize - 1 - CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let hk = h / group as usize;
    let warp = UNIT_POS as usize / 32;
    let lane = UNIT_POS_PLANE as usize;
    let q0 = qb * bq;
    // This warp's first row, within the block and absolute.
    let wrow = warp * rows_w;
    let row0 = q0 + wrow;

    // Where this lane's accumulator elements sit: elements 0/1 in row r_lo, 2/3 in row r_hi,
    // columns c_lo and c_lo + 1 (CubeCL's table; the module doc derives the values).
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let q_base = (b * q.stride(0) + h * q.stride(1)) / nv;
    let k_base = (b * k.stride(0) + hk * k.stride(1)) / nv;
    let v_base = (b * v.stride(0) + hk * v.stride(1)) / nv;
    let k_rs = k.stride(2) / nv;
    let v_rs = v.stride(2) / nv;

    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * ldt / nv), 128usize);
    let mut ks =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(MMA_KEYS * ldt / nv), 128usize);
    let mut vs =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(MMA_KEYS * ldt / nv), 128usize);

    stage_tile::<F, N>(
        q,
        q_base,
        q.stride(2) / nv,
        q0,
        seq,
        &mut qs,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );

    let mut o_acc = zero_frags(comptime!(m_tiles * d / 8));
    let mut s_acc = zero_frags(comptime!(m_tiles * MMA_KEYS / 8));
    let mut p = Array::<f32>::new(comptime!(m_tiles * MMA_KEYS / 2));
    // Running max (of scaled scores) and this lane's partial running sum, per (m-tile, half).
    let mut m_run = Array::<f32>::new(comptime!(2 * m_tiles));
    let mut l_run = Array::<f32>::new(comptime!(2 * m_tiles));
    #[unroll]
    for i in 0..comptime!(2 * m_tiles) {
        m_run[i] = f32::new(-1.0e30);
        l_run[i] = f32::new(0.0);
    }

    let mut q_end = q0 + bq;
    if seq < q_end {
        q_end = seq;
    }
    let n_kb = (q_end + bk - 1) / bk;

    let mut k_regs = Array::<Vector<F, N>>::new(kv_regs);
    let mut v_regs = Array::<Vector<F, N>>::new(kv_regs);
    if comptime!(prefetch) {
        load_tile_regs::<F, N>(k, k_base, k_rs, 0, seq, &mut k_regs, bk, d, nv, nthreads);
        load_tile_regs::<F, N>(v, v_base, v_rs, 0, seq, &mut v_regs, bk, d, nv, nthreads);
    }

    for kb in 0..n_kb {
        let k0 = kb * bk;
        sync_cube();
        if comptime!(prefetch) {
            store_tile_regs::<F, N>(&k_regs, &mut ks, bk, d, ldt, nv, nthreads);
            store_tile_regs::<F, N>(&v_regs, &mut vs, bk, d, ldt, nv, nthreads);
        } else {
            stage_tile::<F, N>(k, k_base, k_rs, k0, seq, &mut ks, bk, d, ldt, nv, nthreads);
            stage_tile::<F, N>(v, v_base, v_rs, k0, seq, &mut vs, bk, d, ldt, nv, nthreads);
        }
        sync_cube();
        if comptime!(prefetch) {
            if kb + 1 < n_kb {
                load_tile_regs::<F, N>(
                    k,
                    k_base,
                    k_rs,
                    k0 + bk,
                    seq,
                    &mut k_regs,
                    bk,
                    d,
                    nv,
                    nthreads,
                );
                load_tile_regs::<F, N>(
                    v,
                    v_base,
                    v_rs,
                    k0 + bk,
                    seq,
                    &mut v_regs,
                    bk,
                    d,
                    nv,
                    nthreads,
                );
            }
        }

        // Blocks that end at or before the warp's first query (all but the last few of a
        // long row) need no causal mask: a copy of the block code without the mask's compares
        // and selects, which the compiler otherwise predicates into every block (call DF's
        // SASS: 64 ISETP + 64 FSEL per lane and block). Decided per warp (the condition is
        // warp-uniform), so that in the cube's diagonal blocks only the warp whose rows the
        // block crosses pays for the mask.
        if k0 + bk <= row0 + 1 {
            fwd_block::<F, N>(
                &qs,
                &ks,
                &vs,
                0usize,
                k0,
                wrow,
                row0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                rescale_slack,
                &mut s_acc,
                &mut p,
                &mut m_run,
                &mut l_run,
                &mut o_acc,
                m_tiles,
                n_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                false,
                skip_rescale,
            );
        } else if k0 < row0 + rows_w {
            // Warps whose rows all precede the block see none of its keys (warp-uniform).
            fwd_block::<F, N>(
                &qs,
                &ks,
                &vs,
                0usize,
                k0,
                wrow,
                row0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                rescale_slack,
                &mut s_acc,
                &mut p,
                &mut m_run,
                &mut l_run,
                &mut o_acc,
                m_tiles,
                n_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                true,
                skip_rescale,
            );
        }
    }

    write_fwd_out::<F>(
        o, lse, &o_acc, &m_run, &mut l_run, b, h, row0, r_lo, r_hi, c_lo, seq, m_tiles, d_tiles,
    );
}

/// Forward with `cp.async` double buffering of the K/V tiles ([`MmaTiling::cp_async`]): the
/// work of [`flash_fwd_mma`] (same `fwd_block`, same values in the same order), but Q and
/// the first K/V block are copied by `cp.async` ([`copy_tile_async`]) and each later K/V
/// block into the other half of two-block tiles, as `flash_bwd_dq_mma_cp` does: after the
/// barrier that makes block `i` visible (which every thread reaches only once done with block
/// `i - 1`, the previous user of the other half), the copies of block `i + 1` are issued, then
/// block `i` is computed. One cube barrier per block instead of two, no staging registers
/// (the register prefetch costs 32 per lane at 8 warps, hd 128), and the next block's loads
/// are in flight during the whole current block, also at `m_tiles = 2`, where the plain
/// kernel stages synchronously. Costs one more K/V block of shared memory (34 KiB at hd 128).
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
fn flash_fwd_mma_cp<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    o: &mut Tensor<Vector<F, Const<2>>>,
    lse: &mut Tensor<f32>,
    scale: f32,
    rescale_slack: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] warps: usize,
    #[comptime] m_tiles: usize,
    #[comptime] keys: usize,
    #[comptime] skip_rescale: bool,
    #[define(F)] _dtype: StorageType,
) {
    let rows_w = comptime!(16 * m_tiles);
    let bq = comptime!(16 * m_tiles * warps);
    let bk = comptime!(keys);
    let nthreads = comptime!(32 * warps);
    let ldt = comptime!(d + 8);
    let n_tiles = comptime!(keys / 8);
    let d_tiles = comptime!(d / 8);
    let k_steps = comptime!(d / 16);

    let seq = seq_len as usize;
    let h = CUBE_POS_X as usize;
    let qb = n_blocks as usize - 1 - CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let hk = h / group as usize;
    let warp = UNIT_POS as usize / 32;
    let lane = UNIT_POS_PLANE as usize;
    let q0 = qb * bq;
    let wrow = warp * rows_w;
    let row0 = q0 + wrow;

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let k_base = (b * k.stride(0) + hk * k.stride(1)) / nv;
    let v_base = (b * v.stride(0) + hk * v.stride(1)) / nv;
    let k_rs = k.stride(2) / nv;
    let v_rs = v.stride(2) / nv;

    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * ldt / nv), 128usize);
    // Two halves of `keys` rows each.
    let mut ks =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * keys * ldt / nv), 128usize);
    let mut vs =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * keys * ldt / nv), 128usize);

    // One phase per key block; created before any copy is issued.
    let bar = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    // Q and the first K/V block go together: the first barrier covers all three.
    copy_tile_async::<F, N>(
        q,
        (b * q.stride(0) + h * q.stride(1)) / nv,
        q.stride(2) / nv,
        q0,
        seq,
        &mut qs,
        0usize,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );
    copy_kv_async::<F, N>(
        k, v, k_base, v_base, k_rs, v_rs, 0usize, seq, &mut ks, &mut vs, 0usize, bk, d, ldt, nv,
        nthreads,
    );

    let mut o_acc = zero_frags(comptime!(m_tiles * d / 8));
    let mut s_acc = zero_frags(comptime!(m_tiles * keys / 8));
    let mut p = Array::<f32>::new(comptime!(m_tiles * keys / 2));
    let mut m_run = Array::<f32>::new(comptime!(2 * m_tiles));
    let mut l_run = Array::<f32>::new(comptime!(2 * m_tiles));
    #[unroll]
    for i in 0..comptime!(2 * m_tiles) {
        m_run[i] = f32::new(-1.0e30);
        l_run[i] = f32::new(0.0);
    }

    let mut q_end = q0 + bq;
    if seq < q_end {
        q_end = seq;
    }
    let n_kb = (q_end + bk - 1) / bk;

    for kb in 0..n_kb {
        let k0 = kb * bk;
        let krow0 = (kb % 2) * bk;
        bar.commit_copy_async();
        bar.arrive_and_wait();
        if kb + 1 < n_kb {
            let nrow0 = bk - krow0;
            copy_kv_async::<F, N>(
                k,
                v,
                k_base,
                v_base,
                k_rs,
                v_rs,
                k0 + bk,
                seq,
                &mut ks,
                &mut vs,
                nrow0,
                bk,
                d,
                ldt,
                nv,
                nthreads,
            );
        }
        // Blocks that end at or before the warp's first query (all but the last few of a
        // long row) need no causal mask: a copy of the block code without the mask's compares
        // and selects, which the compiler otherwise predicates into every block (call DF's
        // SASS: 64 ISETP + 64 FSEL per lane and block). Decided per warp (the condition is
        // warp-uniform), so that in the cube's diagonal blocks only the warp whose rows the
        // block crosses pays for the mask.
        if k0 + bk <= row0 + 1 {
            fwd_block::<F, N>(
                &qs,
                &ks,
                &vs,
                krow0,
                k0,
                wrow,
                row0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                rescale_slack,
                &mut s_acc,
                &mut p,
                &mut m_run,
                &mut l_run,
                &mut o_acc,
                m_tiles,
                n_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                false,
                skip_rescale,
            );
        } else if k0 < row0 + rows_w {
            // Warps whose rows all precede the block see none of its keys (warp-uniform).
            fwd_block::<F, N>(
                &qs,
                &ks,
                &vs,
                krow0,
                k0,
                wrow,
                row0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                rescale_slack,
                &mut s_acc,
                &mut p,
                &mut m_run,
                &mut l_run,
                &mut o_acc,
                m_tiles,
                n_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                true,
                skip_rescale,
            );
        }
    }

    write_fwd_out::<F>(
        o, lse, &o_acc, &m_run, &mut l_run, b, h, row0, r_lo, r_hi, c_lo, seq, m_tiles, d_tiles,
    );
}

/// Position, in 16-byte chunks, of chunk `c` of row `r` of a `rows`-row tile in the layout
/// `wgmma` reads with the 128-byte swizzle ([`super::super::wgmma::SWIZZLE_128B`]): 64-element
/// column blocks one after the other (`rows` 128-byte rows each), and within a row the chunk
/// index XOR the row's position in its 8-row atom. Why swizzled: a warpgroup's tensor cores
/// read 8 rows of one 16-byte column at a time, which this spreads over all 32 banks.
#[cube]
fn sw128_chunk(r: usize, c: usize, #[comptime] rows: usize) -> usize {
    (c / 8) * comptime!(rows * 8) + r * 8 + ((c % 8) ^ (r % 8))
}

/// [`copy_tile_async`] into the swizzled layout of [`sw128_chunk`], one 16-byte `cp.async`
/// per chunk (`N` = 8 two-byte elements): rows `row0 .. row0 + rows` of one head into the tile
/// that starts at chunk `dst0` of `dst`; rows at or past `seq` zero-filled.
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_tile_swizzled<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    base_v: usize,
    stride_v: usize,
    row0: usize,
    seq: usize,
    dst: &mut SharedMemory<Vector<F, N>>,
    dst0: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] nthreads: usize,
) {
    let t = UNIT_POS as usize;
    let chunks = comptime!(d / 8);
    let per_thread = comptime!(rows * d / 8 / nthreads);
    #[unroll]
    for i in 0..per_thread {
        let e = i * nthreads + t;
        let r = e / chunks;
        let c = e % chunks;
        let gr = row0 + r;
        let di = dst0 + sw128_chunk(r, c, rows);
        if gr < seq {
            let si = base_v + gr * stride_v + c;
            copy_async::<Vector<F, N>>(
                &src.slice(si, si + 1),
                &mut dst.slice_mut(di, di + 1),
                8u32,
            );
        } else {
            dst[di] = Vector::new(F::new(0.0));
        }
    }
}

/// [`copy_tile_swizzled`] of the K and V rows `key0 .. key0 + keys` of one kv head into the
/// tiles that start at chunk `dst0` of `ks` and `vs`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_kv_swizzled<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    k_base: usize,
    v_base: usize,
    k_rs: usize,
    v_rs: usize,
    key0: usize,
    seq: usize,
    ks: &mut SharedMemory<Vector<F, N>>,
    vs: &mut SharedMemory<Vector<F, N>>,
    dst0: usize,
    #[comptime] keys: usize,
    #[comptime] d: usize,
    #[comptime] nthreads: usize,
) {
    copy_tile_swizzled::<F, N>(k, k_base, k_rs, key0, seq, ks, dst0, keys, d, nthreads);
    copy_tile_swizzled::<F, N>(v, v_base, v_rs, key0, seq, vs, dst0, keys, d, nthreads);
}

/// `n` accumulator fragments left uninitialized: a `wgmma` that overwrites them (scale-d 0)
/// comes first, and fresh arrays per block keep the compiler from carrying the previous
/// block's values across the loop (the `wgmma`'s operands are read-write).
#[cube]
fn fresh_frags(#[comptime] n: usize) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let mut frags = Sequence::<Array<Vector<f32, Const<2>>>>::new();
    #[unroll]
    for _i in 0..n {
        frags.push(Array::<Vector<f32, Const<2>>>::new(2usize));
    }
    frags
}

/// Issues this warpgroup's `S = Q K^T` for one key block as `d / 16` `wgmma`s reading both
/// operands from the swizzled tiles (`q_wg`: the chunk of the warpgroup's first Q row; `kv0`:
/// the block's K tile) into fresh accumulators, and commits them as one group. Nothing waits.
#[cube]
fn wg_scores<F: Float, N: Size>(
    qs: &SharedMemory<Vector<F, N>>,
    ks: &SharedMemory<Vector<F, N>>,
    q_wg: usize,
    kv0: usize,
    #[comptime] d: usize,
    #[comptime] keys: usize,
) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let bq = comptime!(WGMMA_ROWS);
    let mut s_acc = fresh_frags(comptime!(keys / 8));
    let desc_a0 = wgmma_descriptor(qs, q_wg, 16u32, 1024u32, SWIZZLE_128B);
    let desc_b0 = wgmma_descriptor(ks, kv0, 16u32, 1024u32, SWIZZLE_128B);
    wgmma_fence();
    #[unroll]
    for kk in 0..comptime!(d / 16) {
        // Step kk: 16 columns = 32 bytes into 64-column block kk / 4. K-major operands ignore
        // the leading offset under a swizzle; 8-row atoms are 1024 bytes apart.
        let desc_a = wgmma_descriptor_at(desc_a0, comptime!((kk / 4) * bq * 8 + (kk % 4) * 2));
        let desc_b = wgmma_descriptor_at(desc_b0, comptime!((kk / 4) * keys * 8 + (kk % 4) * 2));
        wgmma_ss::<F>(
            &mut s_acc,
            desc_a,
            desc_b,
            comptime!(keys as u32),
            0u32,
            0u32,
            comptime!(if kk == 0 { 0u32 } else { 1u32 }),
        );
    }
    wgmma_commit_group();
    s_acc
}

/// [`fwd_softmax`] of one warp's 16 rows on a `wgmma` score block, with the causal mask only
/// where the block reaches past the warp's first row (decided per warp: no `wgmma` inside).
#[cube]
#[allow(clippy::too_many_arguments)]
fn wg_softmax(
    s_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    m_run: &mut Array<f32>,
    l_run: &mut Array<f32>,
    o_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    k0: usize,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    rescale_slack: f32,
    #[comptime] d: usize,
    #[comptime] keys: usize,
    #[comptime] skip_rescale: bool,
) {
    let n_tiles = comptime!(keys / 8);
    let d_tiles = comptime!(d / 8);
    if k0 + keys <= row0 + 1 {
        fwd_softmax(
            s_acc,
            p,
            m_run,
            l_run,
            o_acc,
            k0,
            row0,
            r_lo,
            r_hi,
            c_lo,
            scale,
            rescale_slack,
            1usize,
            n_tiles,
            d_tiles,
            false,
            skip_rescale,
        );
    } else {
        fwd_softmax(
            s_acc,
            p,
            m_run,
            l_run,
            o_acc,
            k0,
            row0,
            r_lo,
            r_hi,
            c_lo,
            scale,
            rescale_slack,
            1usize,
            n_tiles,
            d_tiles,
            true,
            skip_rescale,
        );
    }
}

/// Issues one warpgroup's `acc += A B` over `rows` rows of a `rows`-row swizzled tile and
/// commits it as one group: A from registers (`a_frags`, the warp's fragments, 16 rows of the
/// contraction each: the forward's P, the backward's `P^T` or `dS^T`), B the tile at chunk
/// `b0` read transposed (V, dO or Q: `O += P V`, `dV += P^T dO`, `dK += dS^T Q`), `d` wide.
/// Nothing waits; `a_frags` must live until the group completes.
#[cube]
fn wgmma_rs_block<F: Float, N: Size>(
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    a_frags: &Sequence<Array<Vector<F, Const<2>>>>,
    b: &SharedMemory<Vector<F, N>>,
    b0: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
) {
    let desc_b0 = wgmma_descriptor(b, b0, comptime!(rows as u32 * 128), 1024u32, SWIZZLE_128B);
    wgmma_fence();
    #[unroll]
    for kk in 0..comptime!(rows / 16) {
        // Rows 16 kk .. 16 kk + 16: two 8-row atoms, 2 KiB into each 64-column block, the
        // blocks `rows` rows (leading offset) apart.
        let desc_b = wgmma_descriptor_at(desc_b0, comptime!(kk * 128));
        wgmma_rs::<F>(
            acc,
            a_frags.index(kk),
            desc_b,
            comptime!(d as u32),
            1u32,
            1u32,
        );
    }
    wgmma_commit_group();
}

/// Issues this warpgroup's `O += P V` for one key block: P (the warp's probabilities, rounded
/// to `F`) from registers, V (tile at chunk `kv0`) read transposed from shared memory; commits
/// one group. Nothing waits; `p`'s fragments must live until the group completes.
#[cube]
fn wg_pv<F: Float, N: Size>(
    p: &Array<f32>,
    vs: &SharedMemory<Vector<F, N>>,
    kv0: usize,
    o_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] d: usize,
    #[comptime] keys: usize,
) {
    let mut p_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
    #[unroll]
    for kk in 0..comptime!(keys / 16) {
        p_frags.push(p_fragment::<F>(p, 0usize, kk, comptime!(keys / 8)));
    }
    wgmma_fence_operands(o_acc);
    wgmma_rs_block::<F, N>(o_acc, &p_frags, vs, kv0, keys, d);
}

/// The rest of one key block for this warpgroup once its scores are issued: waits for them,
/// runs [`wg_softmax`], issues [`wg_pv`] (V tile at chunk `kv0`) and waits for it, so that
/// the block's buffers are free and `o_acc` is current when this returns. Waited for at once:
/// leaving `P V` running behind the next block's scores cost 10-20 % (session 18 call GE),
/// the `P` registers it reads then having to live on.
#[cube]
#[allow(clippy::too_many_arguments)]
fn wg_finish_block<F: Float, N: Size>(
    s_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    m_run: &mut Array<f32>,
    l_run: &mut Array<f32>,
    o_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    vs: &SharedMemory<Vector<F, N>>,
    kv0: usize,
    k0: usize,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    rescale_slack: f32,
    #[comptime] d: usize,
    #[comptime] keys: usize,
    #[comptime] skip_rescale: bool,
) {
    wgmma_wait_group(0u32);
    wgmma_fence_operands(s_acc);
    wg_softmax(
        s_acc,
        p,
        m_run,
        l_run,
        o_acc,
        k0,
        row0,
        r_lo,
        r_hi,
        c_lo,
        scale,
        rescale_slack,
        d,
        keys,
        skip_rescale,
    );
    wg_pv::<F, N>(p, vs, kv0, o_acc, d, keys);
    wgmma_wait_group(0u32);
    wgmma_fence_operands(o_acc);
}

/// Query rows per cube of the warpgroup-MMA forward: two warpgroups of 64.
const WGMMA_ROWS: usize = 128;

/// Forward on Hopper's warpgroup MMA ([`MmaTiling::WGMMA`], [`MmaTiling::WGMMA_DECOUPLED`]).
/// Cube = (query head, query block from the last, batch), 256 threads = two warpgroups of 64
/// query rows. Q (once) and each 128-key K/V block go by 16-byte `cp.async` into
/// 128-byte-swizzled shared memory, double buffered; each warpgroup issues `S = Q K^T` as
/// `d / 16` `wgmma`s reading both operands from shared memory ([`wg_scores`]), waits, runs the
/// online softmax of the `mma.sync` kernels on its registers (same fragment layout,
/// [`wg_softmax`]), and issues `O += P V` ([`wg_pv`]). `N` must be 8 (16-byte chunks).
///
/// How the two warpgroups share the K/V buffers:
/// - lockstep (`decoupled` off): one cube barrier per block, as in `flash_fwd_mma_cp`. Both
///   warpgroups then run their softmax at the same time, and the tensor cores idle meanwhile.
/// - `decoupled`: a "full" and an "empty" mbarrier per buffer. Every thread copies its share
///   of block `kb + 1` once block `kb - 1` has been released by both warpgroups (empty), after
///   issuing its block-`kb` scores; a warpgroup waits only for the block it needs (full) and
///   releases it after its `P V`. So one warpgroup can run up to about a block ahead of the
///   other, and its softmax overlaps the other's `wgmma`s (FlashAttention-3's ping-pong, here
///   left to the warp schedulers).
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn flash_fwd_wgmma<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    o: &mut Tensor<Vector<F, Const<2>>>,
    lse: &mut Tensor<f32>,
    scale: f32,
    rescale_slack: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[comptime] keys: usize,
    #[comptime] skip_rescale: bool,
    #[comptime] decoupled: bool,
    #[define(F)] _dtype: StorageType,
) {
    let bq = comptime!(WGMMA_ROWS);
    let nthreads = comptime!(256usize);
    let chunks = comptime!(d / 8);
    let d_tiles = comptime!(d / 8);
    let kv_tile = comptime!(keys * d / 8);

    let seq = seq_len as usize;
    let h = CUBE_POS_X as usize;
    let qb = n_blocks as usize - 1 - CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let hk = h / group as usize;
    let warp = UNIT_POS as usize / 32;
    let lane = UNIT_POS_PLANE as usize;
    let q0 = qb * bq;
    let row0 = q0 + 16 * warp;
    // This warpgroup's 64 rows of Q: chunk offset of its first 8-row atom.
    let q_wg = (warp / 4) * 512;

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let k_base = (b * k.stride(0) + hk * k.stride(1)) / 8;
    let v_base = (b * v.stride(0) + hk * v.stride(1)) / 8;
    let k_rs = k.stride(2) / 8;
    let v_rs = v.stride(2) / 8;

    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * chunks), 1024usize);
    let mut ks = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * kv_tile), 1024usize);
    let mut vs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * kv_tile), 1024usize);

    // Lockstep: `full0` is the one cube barrier. Decoupled: buffer i is filled behind `full_i`
    // and released behind `empty_i`, every thread arriving on each once per use.
    let full0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let full1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let empty0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let empty1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    copy_tile_swizzled::<F, N>(
        q,
        (b * q.stride(0) + h * q.stride(1)) / 8,
        q.stride(2) / 8,
        q0,
        seq,
        &mut qs,
        0usize,
        bq,
        d,
        nthreads,
    );
    copy_kv_swizzled::<F, N>(
        k, v, k_base, v_base, k_rs, v_rs, 0usize, seq, &mut ks, &mut vs, 0usize, keys, d, nthreads,
    );
    if comptime!(decoupled) {
        full0.commit_copy_async();
        let _filled = full0.arrive();
    }

    let mut o_acc = zero_frags(d_tiles);
    let mut p = Array::<f32>::new(comptime!(keys / 2));
    let mut m_run = Array::<f32>::new(2usize);
    let mut l_run = Array::<f32>::new(2usize);
    #[unroll]
    for i in 0..2usize {
        m_run[i] = f32::new(-1.0e30);
        l_run[i] = f32::new(0.0);
    }

    let mut q_end = q0 + bq;
    if seq < q_end {
        q_end = seq;
    }
    // `keys` = `bq` and blocks aligned: every block starts at or before every row of the cube,
    // so no warpgroup ever skips one.
    let n_kb = (q_end + keys - 1) / keys;

    for kb in 0..n_kb {
        let k0 = kb * keys;
        let stage = kb % 2;
        let kv0 = stage * kv_tile;
        let next = kv_tile - kv0;
        // Block kb's buffer is full: decoupled, each thread waits for it alone; lockstep, all
        // threads meet at the one barrier.
        if comptime!(decoupled) {
            let phase = ((kb / 2) % 2) as u32;
            if stage == 0 {
                full0.wait_parity(phase);
            } else {
                full1.wait_parity(phase);
            }
        } else {
            full0.commit_copy_async();
            full0.arrive_and_wait();
        }
        // `cp.async` wrote through the generic proxy, `wgmma` reads through the async one.
        sync_async_proxy_shared();
        if comptime!(!decoupled) {
            sync_cube();
        }
        let mut s_acc = wg_scores::<F, N>(&qs, &ks, q_wg, kv0, d, keys);
        if kb + 1 < n_kb {
            // Decoupled, the other buffer held block kb - 1: both warpgroups must be done with
            // it (lockstep, the barrier above saw to that).
            if comptime!(decoupled) {
                if kb >= 1 {
                    let released = (((kb - 1) / 2) % 2) as u32;
                    if stage == 0 {
                        empty1.wait_parity(released);
                    } else {
                        empty0.wait_parity(released);
                    }
                }
            }
            copy_kv_swizzled::<F, N>(
                k,
                v,
                k_base,
                v_base,
                k_rs,
                v_rs,
                k0 + keys,
                seq,
                &mut ks,
                &mut vs,
                next,
                keys,
                d,
                nthreads,
            );
            if comptime!(decoupled) {
                if stage == 0 {
                    full1.commit_copy_async();
                    let _filled = full1.arrive();
                } else {
                    full0.commit_copy_async();
                    let _filled = full0.arrive();
                }
            }
        }
        wg_finish_block::<F, N>(
            &mut s_acc,
            &mut p,
            &mut m_run,
            &mut l_run,
            &mut o_acc,
            &vs,
            kv0,
            k0,
            row0,
            r_lo,
            r_hi,
            c_lo,
            scale,
            rescale_slack,
            d,
            keys,
            skip_rescale,
        );
        if comptime!(decoupled) {
            if stage == 0 {
                let _released = empty0.arrive();
            } else {
                let _released = empty1.arrive();
            }
        }
    }

    write_fwd_out::<F>(
        o, lse, &o_acc, &m_run, &mut l_run, b, h, row0, r_lo, r_hi, c_lo, seq, 1usize, d_tiles,
    );
}

/// Launches the Mma forward into `o`, `lse` (allocated by the caller with the usual shapes;
/// `o` may have any strides with a unit last one, e.g. the `[B, S, H, D]` memory order of
/// `flash.rs`'s `FlashLayout::Bshd`).
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    o: &CubeTensor<R>,
    lse: &CubeTensor<R>,
    scale: f32,
    heads_q: usize,
    batch: usize,
    seq: usize,
    head_dim: usize,
    group: usize,
) {
    assert!(
        scale > 0.0,
        "flash attention (Mma): the softmax scale must be positive, got {scale}"
    );
    let client = q.client.clone();
    let dtype = q.dtype;
    let nv = vector_width(&[&q, &k, &v]);
    // The warpgroup kernel copies 16-byte chunks: its default needs rows in 8-element units.
    let tiling = mma_tiling(head_dim, nv == 8 && wgmma_supported(&client));
    let o_elem_bytes = o.dtype.size() as u64;
    assert!(
        o.meta.strides()[..3].iter().all(|s| s.is_multiple_of(2))
            && o.handle
                .offset_start
                .unwrap_or(0)
                .is_multiple_of(2 * o_elem_bytes),
        "flash attention (Mma): the output is written in element pairs, so its strides {:?} \
         must be even and its offset ({:?} bytes) a multiple of two elements",
        o.meta.strides(),
        o.handle.offset_start
    );
    // cp.async copies 4, 8 or 16 bytes: 2-byte elements need vectors of 2 or more (always the
    // case for contiguous inputs); narrower ones fall back to the plain kernel, as the
    // backward does.
    let async_copy = tiling.cp_async && nv >= 2;
    if async_copy {
        assert!(
            mma_async_supported(&client),
            "flash attention (Mma): {tiling} needs cp.async and cube barriers (sm_80+)"
        );
    }
    let RescalePolicy {
        skip: skip_rescale,
        slack: rescale_slack,
    } = rescale_policy();
    // The kernels work in log2 units (`exp2`): scores and slack scaled by log2(e).
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let rescale_slack = rescale_slack * std::f32::consts::LOG2_E;
    let n_blocks = seq.div_ceil(tiling.rows()) as u32;
    if tiling.wgmma {
        assert!(
            wgmma_supported(&client),
            "flash attention (Mma): {tiling} needs wgmma (sm_90+ and the workspace's vendored \
             CubeCL crates)"
        );
        assert!(
            nv == 8 && matches!(head_dim, 64 | 128),
            "flash attention (Mma): {tiling} copies 16-byte chunks of head dim 64 or 128; got \
             vectors of {nv} elements at head dim {head_dim}"
        );
        let count = CubeCount::Static(heads_q as u32, n_blocks, batch as u32);
        // SAFETY: as below; the swizzled tiles are 1024-byte aligned and every chunk index
        // stays inside them (`sw128_chunk` permutes chunks within an 8-row atom).
        unsafe {
            flash_fwd_wgmma::launch_unchecked::<R>(
                &client,
                count,
                CubeDim::new_1d(256),
                nv,
                q.into_tensor_arg(),
                k.into_tensor_arg(),
                v.into_tensor_arg(),
                o.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                scale_log2,
                rescale_slack,
                seq as u32,
                group as u32,
                n_blocks,
                head_dim,
                tiling.keys,
                skip_rescale,
                tiling.decoupled,
                dtype.into(),
            );
        }
        return;
    }
    let count = CubeCount::Static(heads_q as u32, n_blocks, batch as u32);
    let dim = CubeDim::new_1d(32 * tiling.warps as u32);
    // SAFETY: global reads are guarded by `seq` (rows past it are zero-filled in shared
    // memory), writes by `row < seq`; shared indices stay inside the comptime-sized tiles
    // (ldmatrix rows are 16-byte aligned: pitches of d + 8 elements, columns multiples of 8).
    // The cp.async copies are `2 * nv` bytes at `nv`-aligned global offsets (`vector_width`)
    // and 16-byte aligned shared rows; `o`'s pair writes are aligned (asserted above).
    unsafe {
        if async_copy {
            flash_fwd_mma_cp::launch_unchecked::<R>(
                &client,
                count,
                dim,
                nv,
                q.into_tensor_arg(),
                k.into_tensor_arg(),
                v.into_tensor_arg(),
                o.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                scale_log2,
                rescale_slack,
                seq as u32,
                group as u32,
                n_blocks,
                head_dim,
                nv,
                tiling.warps,
                tiling.m_tiles,
                tiling.keys,
                skip_rescale,
                dtype.into(),
            );
        } else {
            flash_fwd_mma::launch_unchecked::<R>(
                &client,
                count,
                dim,
                nv,
                q.into_tensor_arg(),
                k.into_tensor_arg(),
                v.into_tensor_arg(),
                o.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                scale_log2,
                rescale_slack,
                seq as u32,
                group as u32,
                n_blocks,
                head_dim,
                nv,
                tiling.warps,
                tiling.m_tiles,
                skip_rescale,
                dtype.into(),
            );
        }
    }
}

// ------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------

/// lse and delta of query `qi` of head `h` as the dK/dV kernel stages them, in a pair: past
/// the end `lse = 1e30` (so `P = exp(s - 1e30) = 0` there) and `delta = 0`.
#[cube]
fn bwd_row_stats(
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    b: usize,
    h: usize,
    qi: usize,
    seq: usize,
) -> Vector<f32, Const<2>> {
    let mut out = Vector::<f32, Const<2>>::empty();
    out[0] = f32::new(1.0e30);
    out[1] = f32::new(0.0);
    if qi < seq {
        out[0] = lse[b * lse.stride(0) + h * lse.stride(1) + qi * lse.stride(2)];
        out[1] = delta[b * delta.stride(0) + h * delta.stride(1) + qi * delta.stride(2)];
    }
    out
}

/// [`copy_tile_async`] of the same key rows of K and V (one head each) into their shared
/// tiles: the forward and the dQ kernel stage both for every key block.
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_kv_async<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    k_base: usize,
    v_base: usize,
    k_stride: usize,
    v_stride: usize,
    row0: usize,
    seq: usize,
    ks: &mut SharedMemory<Vector<F, N>>,
    vs: &mut SharedMemory<Vector<F, N>>,
    dst_row0: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ld: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    copy_tile_async::<F, N>(
        k, k_base, k_stride, row0, seq, ks, dst_row0, rows, d, ld, nv, nthreads,
    );
    copy_tile_async::<F, N>(
        v, v_base, v_stride, row0, seq, vs, dst_row0, rows, d, ld, nv, nthreads,
    );
}

/// [`stage_tile`] through `cp.async`: issues the copies of rows `row0 .. row0 + rows` (all `d`
/// columns, `nv` elements per copy, `2 * nv` bytes) of one head into rows `dst_row0 ..` of a
/// shared tile of pitch `ld` elements, and zero-fills rows at or past `seq` with ordinary
/// stores. Nothing waits here: the data is there after the caller's
/// `commit_copy_async` + `arrive_and_wait` on a cube barrier (which also orders the stores).
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_tile_async<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    base_v: usize,
    stride_v: usize,
    row0: usize,
    seq: usize,
    dst: &mut SharedMemory<Vector<F, N>>,
    dst_row0: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ld: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    let t = UNIT_POS as usize;
    let dv = comptime!(d / nv);
    let ldv = comptime!(ld / nv);
    let per_thread = comptime!(rows * d / nv / nthreads);
    let width = comptime!(nv as u32);
    #[unroll]
    for i in 0..per_thread {
        let e = i * nthreads + t;
        let r = e / dv;
        let cv = e % dv;
        let gr = row0 + r;
        let di = (dst_row0 + r) * ldv + cv;
        if gr < seq {
            let si = base_v + gr * stride_v + cv;
            copy_async::<Vector<F, N>>(
                &src.slice(si, si + 1),
                &mut dst.slice_mut(di, di + 1),
                width,
            );
        } else {
            dst[di] = Vector::new(F::new(0.0));
        }
    }
}

/// Issues the asynchronous copies of the dK/dV kernel's query block at `q0` of head `h`, batch
/// `b`: Q and dO rows into rows `qrow0 ..` of `qs` and `dos`, lse and delta into
/// `lse_s[qrow0 ..]`, `delta_s[qrow0 ..]` (4-byte `cp.async`), with [`bwd_row_stats`]'s values
/// past the end. The strides come from the tensors' metadata: session 15 passed them
/// as scalar kernel arguments instead (the compiler reloads `stride()` in the loop, call FB's
/// SASS: about 18 loads per block), which saved the loads but no time, as they hit L1 (call
/// FC).
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_qdo_async<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    qs: &mut SharedMemory<Vector<F, N>>,
    dos: &mut SharedMemory<Vector<F, N>>,
    lse_s: &mut SharedMemory<f32>,
    delta_s: &mut SharedMemory<f32>,
    b: usize,
    h: usize,
    q0: usize,
    seq: usize,
    qrow0: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    let q_off = (b * q.stride(0) + h * q.stride(1)) / nv;
    let q_rs = q.stride(2) / nv;
    let do_off = (b * d_o.stride(0) + h * d_o.stride(1)) / nv;
    let do_rs = d_o.stride(2) / nv;
    let lse_off = b * lse.stride(0) + h * lse.stride(1);
    let lse_rs = lse.stride(2);
    let delta_off = b * delta.stride(0) + h * delta.stride(1);
    let delta_rs = delta.stride(2);
    copy_tile_async::<F, N>(q, q_off, q_rs, q0, seq, qs, qrow0, bq, d, ldt, nv, nthreads);
    copy_tile_async::<F, N>(
        d_o, do_off, do_rs, q0, seq, dos, qrow0, bq, d, ldt, nv, nthreads,
    );
    let t = UNIT_POS as usize;
    let one = comptime!(1u32);
    if t < bq {
        let qi = q0 + t;
        let si = qrow0 + t;
        if qi < seq {
            let li = lse_off + qi * lse_rs;
            let di = delta_off + qi * delta_rs;
            copy_async::<f32>(
                &lse.slice(li, li + 1),
                &mut lse_s.slice_mut(si, si + 1),
                one,
            );
            copy_async::<f32>(
                &delta.slice(di, di + 1),
                &mut delta_s.slice_mut(si, si + 1),
                one,
            );
        } else {
            lse_s[si] = f32::new(1.0e30);
            delta_s[si] = f32::new(0.0);
        }
    }
}

/// Loads this thread's share of the dK/dV kernel's query block at `q0` of head `h` (Q and dO
/// rows) into registers, for [`store_tile_regs`] into `qs` / `dos` one block later.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_qdo_regs<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    b: usize,
    h: usize,
    q0: usize,
    seq: usize,
    q_regs: &mut Array<Vector<F, N>>,
    do_regs: &mut Array<Vector<F, N>>,
    #[comptime] bq: usize,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    load_tile_regs::<F, N>(
        q,
        (b * q.stride(0) + h * q.stride(1)) / nv,
        q.stride(2) / nv,
        q0,
        seq,
        q_regs,
        bq,
        d,
        nv,
        nthreads,
    );
    load_tile_regs::<F, N>(
        d_o,
        (b * d_o.stride(0) + h * d_o.stride(1)) / nv,
        d_o.stride(2) / nv,
        q0,
        seq,
        do_regs,
        bq,
        d,
        nv,
        nthreads,
    );
}

/// One query block of the dK/dV kernels for one warp's 16 keys (first key `wk0`, row `wrow`
/// of `ks`/`vs`; see the module doc): `S^T = K Q^T` and `dP^T = V dO^T`, then `P^T` and
/// `dS^T` into `p` and `ds` (accumulator order), then `dV += P^T dO` and `dK += dS^T Q`. The
/// block's first query is `q0`; its Q and dO rows start at row `qrow0` of `qs` and `dos`, its
/// lse and delta at `lse_s[qrow0]`, `delta_s[qrow0]` (`qrow0` is 0, or the second half of a
/// double buffer).
#[cube]
// The comptime `causal_mask` branch stays nested around the runtime one (see `fwd_block`).
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn dkdv_block<F: Float, N: Size>(
    ks: &SharedMemory<Vector<F, N>>,
    vs: &SharedMemory<Vector<F, N>>,
    qs: &SharedMemory<Vector<F, N>>,
    dos: &SharedMemory<Vector<F, N>>,
    lse_s: &SharedMemory<f32>,
    delta_s: &SharedMemory<f32>,
    qrow0: usize,
    q0: usize,
    wrow: usize,
    wk0: usize,
    lane: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    s_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    dp_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    ds: &mut Array<f32>,
    dk_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    dv_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] q_tiles: usize,
    #[comptime] d_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] causal_mask: bool,
) {
    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys: rows are keys, columns
    // queries, in the accumulator layout.
    mma_abt_strip::<F, N>(
        ks, wrow, qs, qrow0, s_acc, lane, 1usize, q_tiles, k_steps, ldt, nv,
    );
    mma_abt_strip::<F, N>(
        vs, wrow, dos, qrow0, dp_acc, lane, 1usize, q_tiles, k_steps, ldt, nv,
    );
    // Only blocks where some key follows some query need the causal mask.
    let masked = wk0 + 15 > q0;
    let key_lo = wk0 + r_lo;
    let key_hi = wk0 + r_hi;
    #[unroll]
    for nt in 0..q_tiles {
        let s_frag = s_acc.index(nt);
        let dp_frag = dp_acc.index(nt);
        #[unroll]
        for e in 0..2usize {
            let ql = 8 * nt + c_lo + e;
            let qi = q0 + ql;
            let lse_q = lse_s[qrow0 + ql];
            let delta_q = delta_s[qrow0 + ql];
            #[unroll]
            for hh2 in 0..2usize {
                let mut key = key_lo;
                if hh2 == 1 {
                    key = key_hi;
                }
                let s_pair = s_frag[hh2];
                let dp_pair = dp_frag[hh2];
                let mut pe = (s_pair[e] * scale - lse_q).exp();
                if comptime!(causal_mask) {
                    if masked && key > qi {
                        pe = f32::new(0.0);
                    }
                }
                let idx = comptime!((nt * 2 + hh2) * 2 + e);
                p[idx] = pe;
                ds[idx] = pe * (dp_pair[e] - delta_q);
            }
        }
    }
    // dV += P^T dO and dK += dS^T Q: the accumulators are the A operands.
    mma_pv_strip::<F, N>(
        p, dos, qrow0, dv_acc, lane, 1usize, q_tiles, d_tiles, ldt, nv,
    );
    mma_pv_strip::<F, N>(
        ds, qs, qrow0, dk_acc, lane, 1usize, q_tiles, d_tiles, ldt, nv,
    );
}

/// Writes one warp's dK (times `scale`) and dV rows for keys `wk0 ..` (those before `seq`):
/// each lane its two columns per d-tile of its two key rows per m-tile, `d_tiles` d-tiles from
/// column `col0` on.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_dkdv<F: Float>(
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dk_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    dv_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    b: usize,
    hk: usize,
    wk0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    col0: usize,
    seq: usize,
    scale: f32,
    #[comptime] d_tiles: usize,
    #[comptime] m_tiles: usize,
) {
    let dk_base = b * dk.stride(0) + hk * dk.stride(1);
    let dv_base = b * dv.stride(0) + hk * dv.stride(1);
    #[unroll]
    for mt in 0..m_tiles {
        #[unroll]
        for hh2 in 0..2usize {
            let mut r = r_lo;
            if hh2 == 1 {
                r = r_hi;
            }
            let key = wk0 + 16 * mt + r;
            if key < seq {
                let kr = dk_base + key * dk.stride(2) + col0 + c_lo;
                let vr = dv_base + key * dv.stride(2) + col0 + c_lo;
                #[unroll]
                for dt in 0..d_tiles {
                    let kp = dk_acc.index(comptime!(mt * d_tiles + dt))[hh2];
                    let vp = dv_acc.index(comptime!(mt * d_tiles + dt))[hh2];
                    dk[kr + 8 * dt] = F::cast_from(kp[0] * scale);
                    dk[kr + 8 * dt + 1] = F::cast_from(kp[1] * scale);
                    dv[vr + 8 * dt] = F::cast_from(vp[0]);
                    dv[vr + 8 * dt + 1] = F::cast_from(vp[1]);
                }
            }
        }
    }
}

/// `t[b, h, row]` for this lane's two accumulator rows `row0 + r_lo`, `row0 + r_hi` (0 past
/// the end: with zero Q and dO there, `dS = exp(0) * (0 - 0) = 0`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn lane_rows_f32(
    t: &Tensor<f32>,
    b: usize,
    h: usize,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    seq: usize,
) -> Array<f32> {
    let mut out = Array::<f32>::new(2usize);
    #[unroll]
    for hh in 0..2usize {
        let mut r = r_lo;
        if hh == 1 {
            r = r_hi;
        }
        let row = row0 + r;
        let mut val = f32::new(0.0);
        if row < seq {
            val = t[b * t.stride(0) + h * t.stride(1) + row * t.stride(2)];
        }
        out[hh] = val;
    }
    out
}

/// One key block of the dQ kernels for one warp's 16 query rows (first row `row0`, row `wrow`
/// of `qs`/`dos`): `S = Q K^T` and `dP = dO V^T`, `dS = P (dP - delta)` in registers
/// (`lse_r`, `delta_r`: this lane's two rows), then `dQ += dS K` with dS straight from the
/// accumulators as the A operand and K through transposed loads, as V in the forward. The
/// block's first key is `k0`; its K and V rows start at row `krow0` of `ks` and `vs`.
#[cube]
// The comptime `causal_mask` branch stays nested around the runtime one (see `fwd_block`).
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn dq_block<F: Float, N: Size>(
    qs: &SharedMemory<Vector<F, N>>,
    dos: &SharedMemory<Vector<F, N>>,
    ks: &SharedMemory<Vector<F, N>>,
    vs: &SharedMemory<Vector<F, N>>,
    krow0: usize,
    k0: usize,
    wrow: usize,
    row0: usize,
    lane: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    lse_r: &Array<f32>,
    delta_r: &Array<f32>,
    scale: f32,
    s_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    dp_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    ds: &mut Array<f32>,
    dq_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] n_tiles: usize,
    #[comptime] d_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] causal_mask: bool,
) {
    mma_abt_strip::<F, N>(
        qs, wrow, ks, krow0, s_acc, lane, 1usize, n_tiles, k_steps, ldt, nv,
    );
    mma_abt_strip::<F, N>(
        dos, wrow, vs, krow0, dp_acc, lane, 1usize, n_tiles, k_steps, ldt, nv,
    );
    // Only blocks that reach past this warp's first row need the causal mask.
    let masked = k0 + comptime!(8 * n_tiles) > row0 + 1;
    #[unroll]
    for hh in 0..2usize {
        let mut r = r_lo;
        if hh == 1 {
            r = r_hi;
        }
        let row = row0 + r;
        let lse_v = lse_r[hh];
        let delta_v = delta_r[hh];
        #[unroll]
        for nt in 0..n_tiles {
            let s_pair = s_acc.index(nt)[hh];
            let dp_pair = dp_acc.index(nt)[hh];
            #[unroll]
            for e in 0..2usize {
                let mut pe = (s_pair[e] * scale - lse_v).exp();
                if comptime!(causal_mask) {
                    if masked {
                        let key = k0 + 8 * nt + c_lo + e;
                        if key > row {
                            pe = f32::new(0.0);
                        }
                    }
                }
                ds[comptime!((nt * 2 + hh) * 2 + e)] = pe * (dp_pair[e] - delta_v);
            }
        }
    }
    mma_pv_strip::<F, N>(
        ds, ks, krow0, dq_acc, lane, 1usize, n_tiles, d_tiles, ldt, nv,
    );
}

/// Writes one warp's dQ rows (`row0 + r_lo`, `row0 + r_hi`, those before `seq`) times
/// `scale` from the accumulators.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_dq<F: Float>(
    dq_out: &mut Tensor<F>,
    dq_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    b: usize,
    h: usize,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    seq: usize,
    scale: f32,
    #[comptime] d_tiles: usize,
) {
    let dq_base = b * dq_out.stride(0) + h * dq_out.stride(1);
    #[unroll]
    for hh in 0..2usize {
        let mut r = r_lo;
        if hh == 1 {
            r = r_hi;
        }
        let row = row0 + r;
        if row < seq {
            let rb = dq_base + row * dq_out.stride(2) + c_lo;
            #[unroll]
            for dt in 0..d_tiles {
                let pair = dq_acc.index(dt)[hh];
                dq_out[rb + 8 * dt] = F::cast_from(pair[0] * scale);
                dq_out[rb + 8 * dt + 1] = F::cast_from(pair[1] * scale);
            }
        }
    }
}

/// dK and dV (and with `fused`, dQ through f32 atomics), manual MMA. Cube = (kv head, key
/// block, batch) with `32 * warps` threads; warp `w` owns keys `16 w .. 16 w + 16` of the block.
/// Loops over the query heads of the GQA group and the query blocks of `bq` rows from the
/// causal start; see the module doc. With `prefetch` ([`MmaBwdPipe::Prefetch`]) the next
/// block's Q, dO, lse and delta are loaded into registers while the current block is in use.
#[cube(launch_unchecked, fast_math = FastMath::all())]
// `if comptime!(..) { if runtime {..} }` stays nested: the outer branch is resolved at
// expansion, the inner one is emitted.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn flash_bwd_dkdv_mma<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, Const<2>>>>,
    scale: f32,
    seq_len: u32,
    group: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] warps: usize,
    #[comptime] bq: usize,
    #[comptime] fused: bool,
    #[comptime] prefetch: bool,
    #[define(F)] _dtype: StorageType,
) {
    let bk = comptime!(16 * warps);
    let nthreads = comptime!(32 * warps);
    let ldt = comptime!(d + 8);
    let q_tiles = comptime!(bq / 8);
    let d_tiles = comptime!(d / 8);
    let k_steps = comptime!(d / 16);
    // The fused dQ's dS^T tile (`fused_dq_block`): pitch `bq + 8`, in element pairs.
    let dss_len = comptime!(if fused { bk * (bq + 8) / 2 } else { 4 });
    // Registers per thread for one prefetched Q or dO block (1 when not prefetching).
    let pf_regs = comptime!(if prefetch { bq * d / nv / nthreads } else { 1 });

    let seq = seq_len as usize;
    let hk = CUBE_POS_X as usize;
    let kb = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let grp = group as usize;
    let t = UNIT_POS as usize;
    let warp = t / 32;
    let lane = UNIT_POS_PLANE as usize;
    let k0 = kb * bk;
    let wrow = warp * 16;
    // This warp's first key.
    let wk0 = k0 + wrow;

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let mut ks = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bk * ldt / nv), 128usize);
    let mut vs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bk * ldt / nv), 128usize);
    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * ldt / nv), 128usize);
    let mut dos = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * ldt / nv), 128usize);
    let mut dss = SharedMemory::<Vector<F, Const<2>>>::new_aligned(dss_len, 128usize);
    let mut lse_s = SharedMemory::<f32>::new(bq);
    let mut delta_s = SharedMemory::<f32>::new(bq);

    let k_base = (b * k.stride(0) + hk * k.stride(1)) / nv;
    let v_base = (b * v.stride(0) + hk * v.stride(1)) / nv;
    stage_tile::<F, N>(
        k,
        k_base,
        k.stride(2) / nv,
        k0,
        seq,
        &mut ks,
        bk,
        d,
        ldt,
        nv,
        nthreads,
    );
    stage_tile::<F, N>(
        v,
        v_base,
        v.stride(2) / nv,
        k0,
        seq,
        &mut vs,
        bk,
        d,
        ldt,
        nv,
        nthreads,
    );
    let q_rs = q.stride(2) / nv;
    let do_rs = d_o.stride(2) / nv;

    let mut dk_acc = zero_frags(d_tiles);
    let mut dv_acc = zero_frags(d_tiles);
    let mut s_acc = zero_frags(q_tiles);
    let mut dp_acc = zero_frags(q_tiles);
    // P^T and dS^T of this warp's keys in accumulator order (see `mma_pv_strip`).
    let mut p = Array::<f32>::new(comptime!(q_tiles * 4));
    let mut ds = Array::<f32>::new(comptime!(q_tiles * 4));
    #[unroll]
    for i in 0..comptime!(q_tiles * 4) {
        p[i] = f32::new(0.0);
        ds[i] = f32::new(0.0);
    }

    let n_qb = (seq + bq - 1) / bq;
    // Queries before k0 see none of this block's keys (bk is a multiple of bq).
    let qb_start = k0 / bq;
    let h_first = hk * grp;

    // The prefetched block: Q and dO rows, and (threads t < bq) lse and delta of query t.
    let mut q_regs = Array::<Vector<F, N>>::new(pf_regs);
    let mut do_regs = Array::<Vector<F, N>>::new(pf_regs);
    let mut stats = Vector::<f32, Const<2>>::empty();
    if comptime!(prefetch) {
        let q0 = qb_start * bq;
        load_qdo_regs::<F, N>(
            q,
            d_o,
            b,
            h_first,
            q0,
            seq,
            &mut q_regs,
            &mut do_regs,
            bq,
            d,
            nv,
            nthreads,
        );
        if t < bq {
            stats = bwd_row_stats(lse, delta, b, h_first, q0 + t, seq);
        }
    }

    for hh in 0..grp {
        let h = h_first + hh;
        let q_base = (b * q.stride(0) + h * q.stride(1)) / nv;
        let do_base = (b * d_o.stride(0) + h * d_o.stride(1)) / nv;
        for qb in qb_start..n_qb {
            let q0 = qb * bq;
            sync_cube();
            if comptime!(prefetch) {
                store_tile_regs::<F, N>(&q_regs, &mut qs, bq, d, ldt, nv, nthreads);
                store_tile_regs::<F, N>(&do_regs, &mut dos, bq, d, ldt, nv, nthreads);
            } else {
                stage_tile::<F, N>(q, q_base, q_rs, q0, seq, &mut qs, bq, d, ldt, nv, nthreads);
                stage_tile::<F, N>(
                    d_o, do_base, do_rs, q0, seq, &mut dos, bq, d, ldt, nv, nthreads,
                );
                if t < bq {
                    stats = bwd_row_stats(lse, delta, b, h, q0 + t, seq);
                }
            }
            if t < bq {
                lse_s[t] = stats[0];
                delta_s[t] = stats[1];
            }
            sync_cube();
            if comptime!(prefetch) {
                // The next block: this head's next query block, else the next head's first.
                let mut nq0 = q0 + bq;
                let mut nh = h;
                if qb + 1 == n_qb {
                    nq0 = qb_start * bq;
                    nh = h + 1;
                }
                if nh < h_first + grp {
                    load_qdo_regs::<F, N>(
                        q,
                        d_o,
                        b,
                        nh,
                        nq0,
                        seq,
                        &mut q_regs,
                        &mut do_regs,
                        bq,
                        d,
                        nv,
                        nthreads,
                    );
                    if t < bq {
                        stats = bwd_row_stats(lse, delta, b, nh, nq0 + t, seq);
                    }
                }
            }

            // No key of the warp follows the block's first query: no causal mask (decided per
            // warp, see the forward).
            // Otherwise, warps whose keys all follow the block's last query see none of it
            // (warp-uniform).
            if wk0 + 16 <= q0 + 1 {
                dkdv_block::<F, N>(
                    &ks,
                    &vs,
                    &qs,
                    &dos,
                    &lse_s,
                    &delta_s,
                    0usize,
                    q0,
                    wrow,
                    wk0,
                    lane,
                    r_lo,
                    r_hi,
                    c_lo,
                    scale,
                    &mut s_acc,
                    &mut dp_acc,
                    &mut p,
                    &mut ds,
                    &mut dk_acc,
                    &mut dv_acc,
                    q_tiles,
                    d_tiles,
                    k_steps,
                    ldt,
                    nv,
                    false,
                );
            } else if wk0 < q0 + bq {
                dkdv_block::<F, N>(
                    &ks,
                    &vs,
                    &qs,
                    &dos,
                    &lse_s,
                    &delta_s,
                    0usize,
                    q0,
                    wrow,
                    wk0,
                    lane,
                    r_lo,
                    r_hi,
                    c_lo,
                    scale,
                    &mut s_acc,
                    &mut dp_acc,
                    &mut p,
                    &mut ds,
                    &mut dk_acc,
                    &mut dv_acc,
                    q_tiles,
                    d_tiles,
                    k_steps,
                    ldt,
                    nv,
                    true,
                );
            } else {
                // Inactive warps contribute zero rows to the block's dS (fused dQ).
                #[unroll]
                for i in 0..comptime!(q_tiles * 4) {
                    ds[i] = f32::new(0.0);
                }
            }

            if comptime!(fused) {
                fused_dq_block::<F, N>(
                    &ds, &mut dss, &ks, dq_acc, b, h, q0, seq, warp, wrow, lane, r_lo, r_hi, c_lo,
                    warps, bq, d, ldt, nv,
                );
            }
        }
    }

    write_dkdv::<F>(
        dk, dv, &dk_acc, &dv_acc, b, hk, wk0, r_lo, r_hi, c_lo, 0usize, seq, scale, d_tiles, 1usize,
    );
}

/// The fused dQ of one (key block, query block) pair ([`MmaDq::Atomic`], FlashAttention-2's
/// scheme): every warp stores its `dS^T` rows (keys by queries, as they lie in the
/// accumulators) to `dss`, then after a cube barrier each warp forms one `16 x d / wpm` tile of
/// the block's `dQ = dS K` (`bq x d`, `wpm = warps / (bq / 16)` warps per 16 query rows) and
/// adds it to the f32 buffer with atomics. The caller's next barrier must come before `dss` is
/// written again. Shared by [`flash_bwd_dkdv_mma`] and `flash_bwd_dkdv_mma_cp`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fused_dq_block<F: Float, N: Size>(
    ds: &Array<f32>,
    dss: &mut SharedMemory<Vector<F, Const<2>>>,
    ks: &SharedMemory<Vector<F, N>>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, Const<2>>>>,
    b: usize,
    h: usize,
    q0: usize,
    seq: usize,
    warp: usize,
    wrow: usize,
    lane: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    #[comptime] warps: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
) {
    store_acc_pairs::<F>(
        ds,
        dss,
        wrow,
        r_lo,
        r_hi,
        c_lo,
        comptime!(bq / 8),
        comptime!(bq + 8),
        1usize,
    );
    sync_cube();
    // Unused without `bulk`.
    let mut no_dqs = SharedMemory::<Vector<f32, Const<2>>>::new(2usize);
    fused_dq_apply::<F, N>(
        dss,
        0usize,
        ks,
        dq_acc,
        &mut no_dqs,
        b,
        h,
        0usize,
        q0,
        seq,
        warp,
        lane,
        r_lo,
        r_hi,
        c_lo,
        warps,
        bq,
        d,
        ldt,
        nv,
        1usize,
        false,
    );
}

/// Offset (in f32 pairs) of the chunk of query block `q0 / bq` of head `h`, batch `b`, in the
/// bulk dQ's accumulator ([`dq_chunk_pos`]): chunks of `bq x d` f32 per (batch, head, query
/// block), in that order.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dq_chunk_offset(
    b: usize,
    h: usize,
    q0: usize,
    heads_q: usize,
    n_qb: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
) -> usize {
    ((b * heads_q + h) * n_qb + q0 / bq) * comptime!(bq * d / 2)
}

/// Where element (`row`, `col`) of a query block's `bq x d` dQ lies in its chunk of the bulk
/// accumulator (f32 units): the order in which [`fused_dq_apply`]'s warps hold it, so that
/// they store it to shared memory without bank conflicts and add it with one bulk reduction
/// each. Warp `w = (row / 16 mt) * wpm + col / cw` owns `16 mt x cw` (`wpm = warps / (bq /
/// 16 mt)`, `cw = d / wpm`) as `mt x cw / 8` fragments `f`, each two halves `hh` (rows `r` and
/// `r + 8`) of 32 lanes' pairs: position `w * 16 mt cw + (f * 64 + hh * 32 + lane) * 2 + e`.
#[cube]
fn dq_chunk_pos(
    row: usize,
    col: usize,
    #[comptime] warps: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
    #[comptime] mt: usize,
) -> usize {
    let wpm = comptime!(warps / (bq / (16 * mt)));
    let cw = comptime!(d / wpm);
    let warp = (row / comptime!(16 * mt)) * wpm + col / cw;
    let m = (row % comptime!(16 * mt)) / 16;
    let hh = (row % 16) / 8;
    let lane = (row % 8) * 4 + (col % 8) / 2;
    let f = m * comptime!(cw / 8) + (col % cw) / 8;
    warp * comptime!(16 * mt * cw) + (f * 64 + hh * 32 + lane) * 2 + col % 2
}

/// Whether this build can issue Hopper's bulk asynchronous reduction
/// ([`bulk_reduce_add_f32`]): with the workspace's `vendor/cubecl-ir` and `vendor/cubecl-cpp`,
/// which add the operation (`build.rs` detects them); not with upstream CubeCL 0.10.
pub const BULK_REDUCE_BUILT: bool = cfg!(cubecl_bulk_reduce);

/// Adds `bytes` bytes of f32 from `src` (from element `src_offset`) into `dst` (from element
/// `dst_offset`), offsets in units of each buffer's own item type, by one
/// `cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32` (sm_90). Why: the adds happen
/// in L2 on behalf of the copy engine, so the issuing warp neither waits for atomics to read
/// their registers nor spends an instruction per pair (session 16, call FI: the grid kernel's
/// pair atomics cost a fifth of the backward). One thread issues it; the writes to `src` must
/// first be made visible to the async proxy (`sync_async_proxy_shared` by the writers, then a
/// barrier among them), and `src` must not be written again before `tma_group_commit` and
/// `tma_group_wait_read`. Addresses and `bytes` must be multiples of 16.
#[allow(unused_variables)]
pub(super) fn bulk_reduce_add_f32<S: CubePrimitive, G: CubePrimitive>(
    src: &SharedMemory<S>,
    src_offset: usize,
    dst: &mut Tensor<G>,
    dst_offset: usize,
    bytes: u32,
) {
    panic!("cube functions run only inside kernels")
}

/// The expansion of [`bulk_reduce_add_f32`] (CubeCL's frontend convention: a module of the
/// function's name with an `expand`).
pub(super) mod bulk_reduce_add_f32 {
    use cubecl::prelude::*;

    /// Registers the operation; see [`super::bulk_reduce_add_f32`].
    ///
    /// # Panics
    /// In a build without the vendored CubeCL crates ([`super::BULK_REDUCE_BUILT`] false), where
    /// no kernel is launched with the bulk dQ.
    pub fn expand<S: CubePrimitive, G: CubePrimitive>(
        scope: &mut Scope,
        src: NativeExpand<SharedMemory<S>>,
        src_offset: NativeExpand<usize>,
        dst: NativeExpand<Tensor<G>>,
        dst_offset: NativeExpand<usize>,
        bytes: NativeExpand<u32>,
    ) {
        #[cfg(cubecl_bulk_reduce)]
        scope.register(cubecl::ir::Instruction::new(
            cubecl::ir::TmaOps::BulkReduceAddF32 {
                source: *src.expand,
                offset_source: *src_offset.expand,
                offset_out: *dst_offset.expand,
                bytes: *bytes.expand,
            },
            *dst.expand,
        ));
        #[cfg(not(cubecl_bulk_reduce))]
        {
            let _ = (scope, src, src_offset, dst, dst_offset, bytes);
            panic!(
                "bulk_reduce_add_f32 needs the workspace's vendor/cubecl-ir and vendor/cubecl-cpp"
            );
        }
    }
}

/// The second half of [`fused_dq_block`]: each warp forms its `16 * mt x d / wpm` tile of `dQ =
/// dS K` from the `dS^T` tile whose first key row is row `dss_row0` of `dss` (0, or `bk` for
/// the second half of a double buffer), all of whose rows the caller has made visible with a
/// cube barrier, and adds it to `dq_acc` (query head `h` of `heads_q`, batch `b`) with f32-pair
/// atomics.
///
/// With `bulk`, `dq_acc` is in the chunked fragment order of [`dq_chunk_pos`] instead (one
/// dimension, no rows): the warp stores its tile to its part of `dqs` (`bq x d` f32 for the
/// cube) and adds it with one [`bulk_reduce_add_f32`]. The warp's previous reduction must have
/// read `dqs` by then: its lane 0 waits for that first (a block's work later, it has; call FM:
/// the wait costs nothing). The kernel must `tma_group_wait_read(0)` before it ends.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fused_dq_apply<F: Float, N: Size>(
    dss: &SharedMemory<Vector<F, Const<2>>>,
    dss_row0: usize,
    ks: &SharedMemory<Vector<F, N>>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, Const<2>>>>,
    dqs: &mut SharedMemory<Vector<f32, Const<2>>>,
    b: usize,
    h: usize,
    heads_q: usize,
    q0: usize,
    seq: usize,
    warp: usize,
    lane: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    #[comptime] warps: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] mt: usize,
    #[comptime] bulk: bool,
) {
    // Pitch of the dS^T tile (elements): 8 mod 16, so stores and ldmatrix rows hit distinct
    // banks.
    let ldd = comptime!(bq + 8);
    // Warps split the block's `bq x d` dQ into `bq / (16 * mt)` row groups of `16 * mt` rows
    // and `wpm` column slices of `cw` (two m-tiles when that leaves each warp at least two
    // n-tiles, [`dq_m_tiles`]: fewer shared-memory reads per product, see `mma_atb_acc`).
    let wpm = comptime!(warps / (bq / (16 * mt)));
    let cw = comptime!(d / wpm);
    let mq = warp / wpm;
    let c0 = (warp % wpm) * cw;
    let mut dq_frags = zero_frags(comptime!(mt * cw / 8));
    // The half's row offset folds into the column offset: the tile is addressed row * ldd + col.
    mma_atb_acc::<F, Const<2>, N>(
        dss,
        dss_row0 * ldd + 16 * mt * mq,
        ks,
        c0,
        &mut dq_frags,
        lane,
        mt,
        warps,
        comptime!(cw / 8),
        ldd,
        2usize,
        ldt,
        nv,
    );
    if comptime!(bulk) {
        // The warp's part of the chunk: its fragments in order, each as two halves of 32
        // lanes' pairs, so that every store is 256 contiguous bytes (no bank conflicts).
        let frags = comptime!(mt * cw / 8);
        let wbase = warp * comptime!(frags * 64);
        if lane == 0 {
            tma_group_wait_read(0u32);
        }
        sync_plane();
        #[unroll]
        for f in 0..frags {
            #[unroll]
            for hh in 0..2usize {
                dqs[wbase + comptime!(f * 64 + hh * 32) + lane] = dq_frags.index(f)[hh];
            }
        }
        sync_async_proxy_shared();
        sync_plane();
        if lane == 0 {
            let chunk = dq_chunk_offset(b, h, q0, heads_q, (seq + bq - 1) / bq, bq, d);
            bulk_reduce_add_f32(
                dqs,
                wbase,
                dq_acc,
                chunk + wbase,
                comptime!(frags as u32 * 64 * 8),
            );
            tma_group_commit();
        }
    } else {
        let dq_off = b * dq_acc.stride(0) + h * dq_acc.stride(1);
        let dq_rs = dq_acc.stride(2);
        fused_dq_atomics(
            &dq_frags, dq_acc, dq_off, dq_rs, q0, seq, mq, c0, r_lo, r_hi, c_lo, cw, mt,
        );
    }
}

/// The f32-pair atomics of [`fused_dq_apply`] without `bulk`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fused_dq_atomics(
    dq_frags: &Sequence<Array<Vector<f32, Const<2>>>>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, Const<2>>>>,
    dq_off: usize,
    dq_rs: usize,
    q0: usize,
    seq: usize,
    mq: usize,
    c0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    #[comptime] cw: usize,
    #[comptime] mt: usize,
) {
    #[unroll]
    for m in 0..mt {
        #[unroll]
        for hh in 0..2usize {
            let mut r = r_lo;
            if hh == 1 {
                r = r_hi;
            }
            let row = q0 + 16 * mt * mq + 16 * m + r;
            if row < seq {
                let rb = dq_off + row * dq_rs + c0 + c_lo;
                #[unroll]
                for j in 0..comptime!(cw / 8) {
                    let pair = dq_frags.index(comptime!(m * (cw / 8) + j))[hh];
                    // One 8-byte atomic per column pair (sm_90 adds f32 pairs natively): half
                    // the atomics of two scalar adds. `rb` is even (even `c0 + c_lo`, even
                    // strides).
                    dq_acc[(rb + 8 * j) / 2].fetch_add(pair);
                }
            }
        }
    }
}

/// M-tiles per warp of the deferred fused dQ (`fused_dq_apply`; a comptime launch argument, so
/// that cached kernels follow the variable): 2 when the block's `bq` rows split into
/// whole 32-row groups and each warp keeps at least two 8-column n-tiles, unless
/// `SMP_BURN_FLASH_DQ_MTILES=1` (read once; for measuring the difference).
///
/// # Panics
/// If the variable holds anything but `1` or `2`.
fn dq_m_tiles(warps: usize, bq: usize, d: usize) -> usize {
    static ONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let one = *ONE.get_or_init(|| match std::env::var("SMP_BURN_FLASH_DQ_MTILES") {
        Err(_) => false,
        Ok(v) => match v.trim() {
            "1" => true,
            "2" => false,
            other => panic!("SMP_BURN_FLASH_DQ_MTILES={other:?}: expected 1 or 2"),
        },
    });
    if one { 1 } else { dq_m_tiles_for(warps, bq, d) }
}

/// [`dq_m_tiles`] without the override: the shape rule alone.
fn dq_m_tiles_for(warps: usize, bq: usize, d: usize) -> usize {
    let fits =
        bq.is_multiple_of(32) && warps.is_multiple_of(bq / 32) && d / (warps / (bq / 32)) >= 16;
    if fits { 2 } else { 1 }
}

/// Stages the cube's K and V rows `k0 .. k0 + bk` of kv head `hk`, batch `b`, into `ks` and
/// `vs` (a synchronous copy: they stay for the whole cube, and the first block's barrier orders
/// it before their reads). Shared by the `cp.async` dK/dV kernels.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_kv<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    ks: &mut SharedMemory<Vector<F, N>>,
    vs: &mut SharedMemory<Vector<F, N>>,
    b: usize,
    hk: usize,
    k0: usize,
    seq: usize,
    #[comptime] bk: usize,
    #[comptime] d: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    stage_tile::<F, N>(
        k,
        (b * k.stride(0) + hk * k.stride(1)) / nv,
        k.stride(2) / nv,
        k0,
        seq,
        ks,
        bk,
        d,
        ldt,
        nv,
        nthreads,
    );
    stage_tile::<F, N>(
        v,
        (b * v.stride(0) + hk * v.stride(1)) / nv,
        v.stride(2) / nv,
        k0,
        seq,
        vs,
        bk,
        d,
        ldt,
        nv,
        nthreads,
    );
}

/// dK and dV with `cp.async` double buffering ([`MmaBwdPipe::Async`]), and with `fused` dQ by
/// atomics as well ([`MmaDq::Atomic`]). The work of [`flash_bwd_dkdv_mma`], but the query blocks (over the
/// GQA group's heads, flattened into one loop) go through two halves of the Q, dO, lse and
/// delta tiles: after the barrier that makes block `i` visible (and that every warp reaches
/// only once done with block `i - 1`), the copies of block `i + 1` into the other half are
/// issued, then block `i` is computed. One cube barrier per block, no staging registers. With
/// `defer_dq` ([`defer_fused_dq`]) the fused dQ keeps that: block `i`'s `dS^T` goes to one of
/// two tiles and its `dQ = dS K` runs after block `i + 1`'s barrier (the last one after a final
/// barrier); without it, [`fused_dq_block`] adds a second barrier per block. Session 12 call
/// DY: deferring is 2-3 % faster at hd 128 (S 16k 243 -> 248 TFLOP/s, B8 S 4k 217 -> 223).
#[cube(launch_unchecked, fast_math = FastMath::all())]
// `if comptime!(..) { if runtime {..} }` stays nested (see `flash_bwd_dkdv_mma`).
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn flash_bwd_dkdv_mma_cp<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, Const<2>>>>,
    scale: f32,
    seq_len: u32,
    group: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] warps: usize,
    #[comptime] bq: usize,
    #[comptime] fused: bool,
    #[comptime] defer_dq: bool,
    #[comptime] dq_mt: usize,
    #[comptime] bulk_dq: bool,
    #[define(F)] _dtype: StorageType,
) {
    let bk = comptime!(16 * warps);
    let nthreads = comptime!(32 * warps);
    let ldt = comptime!(d + 8);
    let q_tiles = comptime!(bq / 8);
    let d_tiles = comptime!(d / 8);
    let k_steps = comptime!(d / 16);

    let seq = seq_len as usize;
    let hk = CUBE_POS_X as usize;
    let kb = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let grp = group as usize;
    let warp = UNIT_POS as usize / 32;
    let lane = UNIT_POS_PLANE as usize;
    let k0 = kb * bk;
    let wrow = warp * 16;
    let wk0 = k0 + wrow;

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let mut ks = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bk * ldt / nv), 128usize);
    let mut vs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bk * ldt / nv), 128usize);
    // Two halves of bq rows each.
    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * bq * ldt / nv), 128usize);
    let mut dos = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * bq * ldt / nv), 128usize);
    let mut lse_s = SharedMemory::<f32>::new(comptime!(2 * bq));
    let mut delta_s = SharedMemory::<f32>::new(comptime!(2 * bq));
    // The fused dQ's dS^T tile (`fused_dq_block`): pitch `bq + 8`, in element pairs; two of
    // them with `defer_dq`.
    let dss_tiles = comptime!(if defer_dq { 2 } else { 1 });
    let mut dss = SharedMemory::<Vector<F, Const<2>>>::new_aligned(
        comptime!(if fused {
            dss_tiles * bk * (bq + 8) / 2
        } else {
            4
        }),
        128usize,
    );
    // The bulk dQ's staging tile (`fused_dq_apply`, deferred dQ only): `bq x d` f32.
    let mut dqs = SharedMemory::<Vector<f32, Const<2>>>::new_aligned(
        comptime!(if bulk_dq { bq * d / 2 } else { 2 }),
        128usize,
    );
    let heads_q = CUBE_COUNT_X as usize * grp;

    // K and V stay for the whole cube: a synchronous copy, ordered before the first block's
    // reads by the barrier below.
    stage_kv::<F, N>(
        k, v, &mut ks, &mut vs, b, hk, k0, seq, bk, d, ldt, nv, nthreads,
    );
    // Every thread arrives once per block (and its cp.async completions once more, through
    // commit_copy_async), so one phase of the barrier is one block.
    let bar = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

    let mut dk_acc = zero_frags(d_tiles);
    let mut dv_acc = zero_frags(d_tiles);
    let mut s_acc = zero_frags(q_tiles);
    let mut dp_acc = zero_frags(q_tiles);
    let mut p = Array::<f32>::new(comptime!(q_tiles * 4));
    let mut ds = Array::<f32>::new(comptime!(q_tiles * 4));

    let n_qb = (seq + bq - 1) / bq;
    let qb_start = k0 / bq;
    let n_blk = n_qb - qb_start;
    let n_it = grp * n_blk;
    let h_first = hk * grp;
    copy_qdo_async::<F, N>(
        q,
        d_o,
        lse,
        delta,
        &mut qs,
        &mut dos,
        &mut lse_s,
        &mut delta_s,
        b,
        h_first,
        qb_start * bq,
        seq,
        0usize,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );
    // The block whose dQ is still owed (`defer_dq`): its first query and its head.
    let mut owed_q0 = 0usize;
    let mut owed_h = 0usize;
    // Iteration `it` is query block `blk` of head `h_first + h_off`, kept as counters: `it /
    // n_blk` and `it % n_blk` by a runtime divisor cost some 15 instructions each per block
    // (call EL's SASS: three integer divisions in the loop).
    let mut blk = 0usize;
    let mut h_off = 0usize;
    for it in 0..n_it {
        let q0 = (qb_start + blk) * bq;
        let h = h_first + h_off;
        let qrow0 = (it % 2) * bq;
        bar.commit_copy_async();
        bar.arrive_and_wait();
        let mut next_blk = blk + 1;
        let mut next_h_off = h_off;
        if next_blk == n_blk {
            next_blk = 0;
            next_h_off += 1;
        }
        let nx = it + 1;
        if nx < n_it {
            copy_qdo_async::<F, N>(
                q,
                d_o,
                lse,
                delta,
                &mut qs,
                &mut dos,
                &mut lse_s,
                &mut delta_s,
                b,
                h_first + next_h_off,
                (qb_start + next_blk) * bq,
                seq,
                bq - qrow0,
                bq,
                d,
                ldt,
                nv,
                nthreads,
            );
        }
        if comptime!(fused && defer_dq) {
            // The previous block's dS^T, stored by every warp before this block's barrier.
            if it > 0 {
                fused_dq_apply::<F, N>(
                    &dss,
                    ((it + 1) % 2) * bk,
                    &ks,
                    dq_acc,
                    &mut dqs,
                    b,
                    owed_h,
                    heads_q,
                    owed_q0,
                    seq,
                    warp,
                    lane,
                    r_lo,
                    r_hi,
                    c_lo,
                    warps,
                    bq,
                    d,
                    ldt,
                    nv,
                    dq_mt,
                    bulk_dq,
                );
            }
        }
        // No key of the warp follows the block's first query: no causal mask (decided per
        // warp, see the forward).
        if wk0 + 16 <= q0 + 1 {
            dkdv_block::<F, N>(
                &ks,
                &vs,
                &qs,
                &dos,
                &lse_s,
                &delta_s,
                qrow0,
                q0,
                wrow,
                wk0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut p,
                &mut ds,
                &mut dk_acc,
                &mut dv_acc,
                q_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                false,
            );
        } else if wk0 < q0 + bq {
            dkdv_block::<F, N>(
                &ks,
                &vs,
                &qs,
                &dos,
                &lse_s,
                &delta_s,
                qrow0,
                q0,
                wrow,
                wk0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut p,
                &mut ds,
                &mut dk_acc,
                &mut dv_acc,
                q_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                true,
            );
        } else if comptime!(fused) {
            // Inactive warps contribute zero rows to the block's dS.
            #[unroll]
            for i in 0..comptime!(q_tiles * 4) {
                ds[i] = f32::new(0.0);
            }
        }
        if comptime!(fused && defer_dq) {
            // Written to this block's half; read after the next barrier (above, or after the
            // loop), rewritten two blocks later, after the barrier that follows those reads.
            store_acc_pairs::<F>(
                &ds,
                &mut dss,
                (it % 2) * bk + wrow,
                r_lo,
                r_hi,
                c_lo,
                comptime!(bq / 8),
                comptime!(bq + 8),
                1usize,
            );
            owed_q0 = q0;
            owed_h = h;
        } else if comptime!(fused) {
            // The next iteration's barrier orders these reads of `dss` before its rewrite.
            fused_dq_block::<F, N>(
                &ds, &mut dss, &ks, dq_acc, b, h, q0, seq, warp, wrow, lane, r_lo, r_hi, c_lo,
                warps, bq, d, ldt, nv,
            );
        }
        blk = next_blk;
        h_off = next_h_off;
    }
    if comptime!(fused && defer_dq) {
        if n_it > 0 {
            sync_cube();
            fused_dq_apply::<F, N>(
                &dss,
                ((n_it + 1) % 2) * bk,
                &ks,
                dq_acc,
                &mut dqs,
                b,
                owed_h,
                heads_q,
                owed_q0,
                seq,
                warp,
                lane,
                r_lo,
                r_hi,
                c_lo,
                warps,
                bq,
                d,
                ldt,
                nv,
                dq_mt,
                bulk_dq,
            );
        }
    }

    if comptime!(bulk_dq) {
        // The last reductions read `dqs` until they are done with it; their writes to global
        // memory complete before the kernel does (CUTLASS's TMA-store epilogues wait the same
        // way). Not `tma_group_wait`: CubeCL 0.10 emits it as a libcu++ function that CUDA
        // 13's does not have.
        if lane == 0 {
            tma_group_wait_read(0u32);
        }
    }

    write_dkdv::<F>(
        dk, dv, &dk_acc, &dv_acc, b, hk, wk0, r_lo, r_hi, c_lo, 0usize, seq, scale, d_tiles, 1usize,
    );
}

/// The scores of one query block for one warp of the warp-grid dK/dV kernel
/// ([`flash_bwd_dkdv_mma_grid`]): `S^T = K Q^T` and `dP^T = V dO^T` for its 32 keys (rows
/// `krow ..` of `ks`/`vs`, first key `wk0`) by its `bq / 2` queries (columns `qcol ..` of the
/// block, whose first query is `q0` and whose Q/dO rows start at row `qrow0` of `qs`/`dos`),
/// then `P^T` and `dS^T` on the accumulators, stored to rows `krow ..`, columns `qcol ..` of
/// the shared `pts` and `dss` tiles (pitch `bq + 8`) for the cube's products.
#[cube]
// The comptime `causal_mask` branch stays nested around the runtime one (see `fwd_block`).
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn dkdv_grid_scores<F: Float, N: Size>(
    ks: &SharedMemory<Vector<F, N>>,
    vs: &SharedMemory<Vector<F, N>>,
    qs: &SharedMemory<Vector<F, N>>,
    dos: &SharedMemory<Vector<F, N>>,
    lse_s: &SharedMemory<f32>,
    delta_s: &SharedMemory<f32>,
    pts: &mut SharedMemory<Vector<F, Const<2>>>,
    dss: &mut SharedMemory<Vector<F, Const<2>>>,
    qrow0: usize,
    q0: usize,
    krow: usize,
    wk0: usize,
    qcol: usize,
    lane: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    s_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    dp_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    ds: &mut Array<f32>,
    #[comptime] q_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] ldp: usize,
    #[comptime] causal_mask: bool,
) {
    mma_abt_strip::<F, N>(
        ks,
        krow,
        qs,
        qrow0 + qcol,
        s_acc,
        lane,
        2usize,
        q_tiles,
        k_steps,
        ldt,
        nv,
    );
    mma_abt_strip::<F, N>(
        vs,
        krow,
        dos,
        qrow0 + qcol,
        dp_acc,
        lane,
        2usize,
        q_tiles,
        k_steps,
        ldt,
        nv,
    );
    #[unroll]
    for nt in 0..q_tiles {
        #[unroll]
        for e in 0..2usize {
            let ql = qcol + 8 * nt + c_lo + e;
            let qi = q0 + ql;
            let lse_q = lse_s[qrow0 + ql];
            let delta_q = delta_s[qrow0 + ql];
            #[unroll]
            for mt in 0..2usize {
                let s_frag = s_acc.index(comptime!(mt * q_tiles + nt));
                let dp_frag = dp_acc.index(comptime!(mt * q_tiles + nt));
                #[unroll]
                for hh2 in 0..2usize {
                    let mut key = wk0 + 16 * mt + r_lo;
                    if hh2 == 1 {
                        key = wk0 + 16 * mt + r_hi;
                    }
                    let s_pair = s_frag[hh2];
                    let dp_pair = dp_frag[hh2];
                    let mut pe = (s_pair[e] * scale - lse_q).exp();
                    if comptime!(causal_mask) {
                        if key > qi {
                            pe = f32::new(0.0);
                        }
                    }
                    let idx = comptime!(((mt * q_tiles + nt) * 2 + hh2) * 2 + e);
                    p[idx] = pe;
                    ds[idx] = pe * (dp_pair[e] - delta_q);
                }
            }
        }
    }
    store_acc_pairs::<F>(p, pts, krow, r_lo, r_hi, qcol + c_lo, q_tiles, ldp, 2usize);
    store_acc_pairs::<F>(ds, dss, krow, r_lo, r_hi, qcol + c_lo, q_tiles, ldp, 2usize);
}

/// dK and dV with FlashAttention-2's warp grid ([`MmaBwdTiling::warp_grid`]), `cp.async`
/// double buffering of Q/dO/lse/delta as [`flash_bwd_dkdv_mma_cp`], and the fused dQ by
/// atomics. Why: the per-warp layout of [`flash_bwd_dkdv_mma_cp`] (16 keys by all `bq`
/// queries per warp) reads all of Q and dO from shared memory twice per warp, and that kernel
/// is bound by shared-memory bandwidth (session 14 calls EV-EW: L1/TEX 80 %, tensor pipe 39 %).
/// Here warp `w` owns key group `w / 2` (32 keys) and query half `w % 2` for the scores, and
/// the same 32 keys by column half `w % 2` of dK and dV. The warps exchange `P^T` and `dS^T`
/// through shared memory (`pts`, `dss`), which costs a second cube barrier per block: per
/// block, barrier (Q/dO of this block visible, the previous block's reads done), issue the
/// next block's copies, scores ([`dkdv_grid_scores`]), barrier, `dV += P^T dO` and
/// `dK += dS^T Q` ([`mma_ab_acc`]), then the block's `dQ = dS K` ([`fused_dq_apply`]) from
/// the same `dss`, which the next block rewrites only after its first barrier. Session 15
/// (calls FA, FC): deferring the dQ by a block, so that the products wait only for their key
/// group's two warps (an mbarrier per group) instead of the second cube barrier, ran 2-4 %
/// slower.
#[cube(launch_unchecked, fast_math = FastMath::all())]
// `if comptime!(..) { if runtime {..} }` stays nested (see `flash_bwd_dkdv_mma`).
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn flash_bwd_dkdv_mma_grid<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, Const<2>>>>,
    scale: f32,
    seq_len: u32,
    group: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] warps: usize,
    #[comptime] bq: usize,
    #[comptime] dq_mt: usize,
    #[comptime] bulk_dq: bool,
    #[define(F)] _dtype: StorageType,
) {
    let bk = comptime!(16 * warps);
    let nthreads = comptime!(32 * warps);
    let ldt = comptime!(d + 8);
    // Pitch of the P^T and dS^T tiles: 8 mod 16 elements, so stores and ldmatrix rows hit
    // distinct banks (as the fused dQ's tile).
    let ldp = comptime!(bq + 8);
    // Query n-tiles of a warp's S^T (its half of the block's queries).
    let q_tiles = comptime!(bq / 16);
    // Column n-tiles of a warp's dK/dV (its half of the head dim).
    let d_tiles = comptime!(d / 16);
    let k_steps = comptime!(d / 16);
    let bq_steps = comptime!(bq / 16);

    let seq = seq_len as usize;
    let hk = CUBE_POS_X as usize;
    let kb = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let grp = group as usize;
    let warp = UNIT_POS as usize / 32;
    let lane = UNIT_POS_PLANE as usize;
    let k0 = kb * bk;
    let krow = (warp / 2) * 32;
    let wk0 = k0 + krow;
    let qcol = (warp % 2) * comptime!(bq / 2);
    let col0 = (warp % 2) * comptime!(d / 2);

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let mut ks = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bk * ldt / nv), 128usize);
    let mut vs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bk * ldt / nv), 128usize);
    // Two halves of bq rows each.
    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * bq * ldt / nv), 128usize);
    let mut dos = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * bq * ldt / nv), 128usize);
    let mut lse_s = SharedMemory::<f32>::new(comptime!(2 * bq));
    let mut delta_s = SharedMemory::<f32>::new(comptime!(2 * bq));
    let mut pts =
        SharedMemory::<Vector<F, Const<2>>>::new_aligned(comptime!(bk * ldp / 2), 128usize);
    let mut dss =
        SharedMemory::<Vector<F, Const<2>>>::new_aligned(comptime!(bk * ldp / 2), 128usize);
    // The bulk dQ's staging tile (`fused_dq_apply`): the block's `bq x d` f32.
    let mut dqs = SharedMemory::<Vector<f32, Const<2>>>::new_aligned(
        comptime!(if bulk_dq { bq * d / 2 } else { 2 }),
        128usize,
    );
    let heads_q = CUBE_COUNT_X as usize * grp;

    stage_kv::<F, N>(
        k, v, &mut ks, &mut vs, b, hk, k0, seq, bk, d, ldt, nv, nthreads,
    );
    // One phase per block, as in `flash_bwd_dkdv_mma_cp`.
    let bar = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

    let mut dk_acc = zero_frags(comptime!(2 * d_tiles));
    let mut dv_acc = zero_frags(comptime!(2 * d_tiles));
    let mut s_acc = zero_frags(comptime!(2 * q_tiles));
    let mut dp_acc = zero_frags(comptime!(2 * q_tiles));
    let mut p = Array::<f32>::new(comptime!(2 * q_tiles * 4));
    let mut ds = Array::<f32>::new(comptime!(2 * q_tiles * 4));

    let n_qb = (seq + bq - 1) / bq;
    let qb_start = k0 / bq;
    let n_blk = n_qb - qb_start;
    let n_it = grp * n_blk;
    let h_first = hk * grp;
    copy_qdo_async::<F, N>(
        q,
        d_o,
        lse,
        delta,
        &mut qs,
        &mut dos,
        &mut lse_s,
        &mut delta_s,
        b,
        h_first,
        qb_start * bq,
        seq,
        0usize,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );
    // Query block `blk` of head `h_first + h_off`, as counters (see `flash_bwd_dkdv_mma_cp`).
    let mut blk = 0usize;
    let mut h_off = 0usize;
    for it in 0..n_it {
        let q0 = (qb_start + blk) * bq;
        let h = h_first + h_off;
        let qrow0 = (it % 2) * bq;
        bar.commit_copy_async();
        bar.arrive_and_wait();
        let mut next_blk = blk + 1;
        let mut next_h_off = h_off;
        if next_blk == n_blk {
            next_blk = 0;
            next_h_off += 1;
        }
        let nx = it + 1;
        if nx < n_it {
            copy_qdo_async::<F, N>(
                q,
                d_o,
                lse,
                delta,
                &mut qs,
                &mut dos,
                &mut lse_s,
                &mut delta_s,
                b,
                h_first + next_h_off,
                (qb_start + next_blk) * bq,
                seq,
                bq - qrow0,
                bq,
                d,
                ldt,
                nv,
                nthreads,
            );
        }
        // The warp's first query; the mask only where one of its keys follows it.
        let wq0 = q0 + qcol;
        if wk0 + 32 <= wq0 + 1 {
            dkdv_grid_scores::<F, N>(
                &ks,
                &vs,
                &qs,
                &dos,
                &lse_s,
                &delta_s,
                &mut pts,
                &mut dss,
                qrow0,
                q0,
                krow,
                wk0,
                qcol,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut p,
                &mut ds,
                q_tiles,
                k_steps,
                ldt,
                nv,
                ldp,
                false,
            );
        } else if wk0 < wq0 + comptime!(bq / 2) {
            dkdv_grid_scores::<F, N>(
                &ks,
                &vs,
                &qs,
                &dos,
                &lse_s,
                &delta_s,
                &mut pts,
                &mut dss,
                qrow0,
                q0,
                krow,
                wk0,
                qcol,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut p,
                &mut ds,
                q_tiles,
                k_steps,
                ldt,
                nv,
                ldp,
                true,
            );
        } else {
            // Every key follows every query of the warp's half: zero rows for the products
            // of the other warps that read them.
            #[unroll]
            for i in 0..comptime!(2 * q_tiles * 4) {
                p[i] = f32::new(0.0);
            }
            store_acc_pairs::<F>(
                &p,
                &mut pts,
                krow,
                r_lo,
                r_hi,
                qcol + c_lo,
                q_tiles,
                ldp,
                2usize,
            );
            store_acc_pairs::<F>(
                &p,
                &mut dss,
                krow,
                r_lo,
                r_hi,
                qcol + c_lo,
                q_tiles,
                ldp,
                2usize,
            );
        }
        sync_cube();
        // Skipped where every key of the group follows every query of the block (all of its
        // P^T and dS^T rows are zero).
        if wk0 < q0 + bq {
            mma_ab_acc::<F, Const<2>, N>(
                &pts,
                krow,
                &dos,
                qrow0,
                col0,
                &mut dv_acc,
                lane,
                2usize,
                bq_steps,
                d_tiles,
                ldp,
                2usize,
                ldt,
                nv,
            );
            mma_ab_acc::<F, Const<2>, N>(
                &dss,
                krow,
                &qs,
                qrow0,
                col0,
                &mut dk_acc,
                lane,
                2usize,
                bq_steps,
                d_tiles,
                ldp,
                2usize,
                ldt,
                nv,
            );
        }
        fused_dq_apply::<F, N>(
            &dss, 0usize, &ks, dq_acc, &mut dqs, b, h, heads_q, q0, seq, warp, lane, r_lo, r_hi,
            c_lo, warps, bq, d, ldt, nv, dq_mt, bulk_dq,
        );
        blk = next_blk;
        h_off = next_h_off;
    }
    if comptime!(bulk_dq) {
        // The last reductions read `dqs` until they are done with it; their writes to global
        // memory complete before the kernel does (CUTLASS's TMA-store epilogues wait the same
        // way). Not `tma_group_wait`: CubeCL 0.10 emits it as a libcu++ function that CUDA
        // 13's does not have.
        if lane == 0 {
            tma_group_wait_read(0u32);
        }
    }

    write_dkdv::<F>(
        dk, dv, &dk_acc, &dv_acc, b, hk, wk0, r_lo, r_hi, c_lo, col0, seq, scale, d_tiles, 2usize,
    );
}

/// Query rows per block of the warpgroup-MMA dK/dV kernel: the `n` of its `S^T` and `dP^T`.
const WGMMA_BWD_QROWS: usize = 64;

/// Keys per cube of the warpgroup-MMA dK/dV kernel: two warpgroups of 64.
pub const WGMMA_BWD_KEYS: usize = 128;

/// Pitch, in f32 pairs, of the warpgroup dK/dV kernel's dQ staging rows at head dim `d`: 8 f32
/// more than a row, so that the 8-byte stores of a half-warp (4 rows, 4 pairs each) cover the
/// 32 banks once (rows 8 banks apart at d 64 and 128), and every row still starts 16 bytes
/// aligned for its bulk reduction.
const fn wgmma_bwd_dq_pitch(d: usize) -> usize {
    d / 2 + 4
}

/// Issues the copies of one query block for [`flash_bwd_dkdv_wgmma`]: Q and dO rows `q0 ..
/// q0 + 64` of head `h` into the swizzled tiles at chunk `dst0` of `qs` / `dos`, and lse and
/// delta into `lse_s` / `delta_s` from `stat0` ([`bwd_row_stats`]'s values past the end).
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_qdo_swizzled<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    qs: &mut SharedMemory<Vector<F, N>>,
    dos: &mut SharedMemory<Vector<F, N>>,
    lse_s: &mut SharedMemory<f32>,
    delta_s: &mut SharedMemory<f32>,
    b: usize,
    h: usize,
    q0: usize,
    seq: usize,
    dst0: usize,
    stat0: usize,
    #[comptime] d: usize,
) {
    let rows = comptime!(WGMMA_BWD_QROWS);
    copy_kv_swizzled::<F, N>(
        q,
        d_o,
        (b * q.stride(0) + h * q.stride(1)) / 8,
        (b * d_o.stride(0) + h * d_o.stride(1)) / 8,
        q.stride(2) / 8,
        d_o.stride(2) / 8,
        q0,
        seq,
        qs,
        dos,
        dst0,
        rows,
        d,
        256usize,
    );
    let t = UNIT_POS as usize;
    if t < rows {
        let qi = q0 + t;
        let si = stat0 + t;
        if qi < seq {
            let li = b * lse.stride(0) + h * lse.stride(1) + qi * lse.stride(2);
            let di = b * delta.stride(0) + h * delta.stride(1) + qi * delta.stride(2);
            copy_async::<f32>(
                &lse.slice(li, li + 1),
                &mut lse_s.slice_mut(si, si + 1),
                1u32,
            );
            copy_async::<f32>(
                &delta.slice(di, di + 1),
                &mut delta_s.slice_mut(si, si + 1),
                1u32,
            );
        } else {
            lse_s[si] = f32::new(1.0e30);
            delta_s[si] = f32::new(0.0);
        }
    }
}

/// Issues one warpgroup's `acc = A B^T` for the warpgroup-MMA dK/dV kernel and commits it as
/// one group: A the warpgroup's 64 rows of the 128-row K or V tile (`a_wg`: chunk of its
/// first row), B the 64-row Q or dO tile at chunk `b0`, both K-major and swizzled, contracted
/// over the head dim (`S^T = K Q^T`, `dP^T = V dO^T`). Nothing waits.
#[cube]
fn wgmma_bwd_scores<F: Float, N: Size>(
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    a: &SharedMemory<Vector<F, N>>,
    b: &SharedMemory<Vector<F, N>>,
    a_wg: usize,
    b0: usize,
    #[comptime] d: usize,
) {
    let bk = comptime!(WGMMA_BWD_KEYS);
    let bq = comptime!(WGMMA_BWD_QROWS);
    let desc_a0 = wgmma_descriptor(a, a_wg, 16u32, 1024u32, SWIZZLE_128B);
    let desc_b0 = wgmma_descriptor(b, b0, 16u32, 1024u32, SWIZZLE_128B);
    wgmma_fence();
    #[unroll]
    for kk in 0..comptime!(d / 16) {
        // Step kk: 16 columns = 32 bytes into 64-column block kk / 4 (as `wg_scores`).
        let desc_a = wgmma_descriptor_at(desc_a0, comptime!((kk / 4) * bk * 8 + (kk % 4) * 2));
        let desc_b = wgmma_descriptor_at(desc_b0, comptime!((kk / 4) * bq * 8 + (kk % 4) * 2));
        wgmma_ss::<F>(
            acc,
            desc_a,
            desc_b,
            comptime!(bq as u32),
            0u32,
            0u32,
            comptime!(if kk == 0 { 0u32 } else { 1u32 }),
        );
    }
    wgmma_commit_group();
}

/// `P^T = exp(S^T scale - lse)` of one warp's 16 keys (from `wk0`) and a block's queries (from
/// `q0`, their lse from `lse_s[stat0 ..]`) into `p`, in accumulator order; with `masked`, 0
/// where the key follows the query.
#[cube]
#[allow(clippy::too_many_arguments)]
fn wgmma_bwd_probs(
    s_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    lse_s: &SharedMemory<f32>,
    stat0: usize,
    q0: usize,
    wk0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    #[comptime] q_tiles: usize,
    #[comptime] masked: bool,
) {
    #[unroll]
    for nt in 0..q_tiles {
        #[unroll]
        for e in 0..2usize {
            let ql = 8 * nt + c_lo + e;
            let lse_q = lse_s[stat0 + ql];
            let s_frag = s_acc.index(nt);
            #[unroll]
            for hh in 0..2usize {
                let mut pe = (s_frag[hh][e] * scale - lse_q).exp();
                if comptime!(masked) {
                    let mut key = wk0 + r_lo;
                    if hh == 1 {
                        key = wk0 + r_hi;
                    }
                    if key > q0 + ql {
                        pe = f32::new(0.0);
                    }
                }
                p[comptime!((nt * 2 + hh) * 2 + e)] = pe;
            }
        }
    }
}

/// Adds the staged dQ rows of query block `q0 ..` of head `h` (f32 pair rows of `dqs`, pitch
/// [`wgmma_bwd_dq_pitch`]) to `dq_acc` (dq's layout): one bulk reduction per row before
/// `seq`, issued by the first 64 threads and committed as one group each (their
/// `tma_group_wait_read` frees the rows).
#[cube]
#[allow(clippy::too_many_arguments)]
fn reduce_dq_rows(
    dqs: &SharedMemory<Vector<f32, Const<2>>>,
    dq_acc: &mut Tensor<f32>,
    b: usize,
    h: usize,
    q0: usize,
    seq: usize,
    #[comptime] d: usize,
) {
    let t = UNIT_POS as usize;
    if t < comptime!(WGMMA_BWD_QROWS) {
        let qi = q0 + t;
        if qi < seq {
            let dst = b * dq_acc.stride(0) + h * dq_acc.stride(1) + qi * dq_acc.stride(2);
            bulk_reduce_add_f32(
                dqs,
                t * comptime!(wgmma_bwd_dq_pitch(d)),
                dq_acc,
                dst,
                comptime!(d as u32 * 4),
            );
        }
        tma_group_commit();
    }
}

/// dK and dV (and dQ through bulk reductions) on Hopper's warpgroup MMA, head dim 64 or 128. Cube =
/// (kv head, block of 128 keys, batch), 256 threads = two warpgroups, warpgroup `w` owning keys
/// `64 w .. 64 w + 64` of the block. K and V are copied once into swizzled shared memory; the
/// query blocks of 64 rows (every query head of the GQA group, from the causal start) are
/// double buffered with `cp.async`. Per query block and warpgroup, each product one `wgmma`
/// group, so that the tensor cores run while the warpgroup's threads do the elementwise work:
/// - `S^T = K Q^T`, then `dP^T = V dO^T` (`m64n64k16`, both operands from shared memory);
/// - once `S^T` is done, `P^T = exp(S^T scale - lse)` (0 where the key follows the query);
/// - `dV += P^T dO` (`m64nDk16`, `P^T` from registers as the forward's P, dO read
///   transposed as the forward's V), issued before `dS^T = P^T (dP^T - delta)` is computed;
/// - `dS^T` to shared memory (bf16, swizzled `[key][query]`), a cube barrier, then the block's
///   `dQ = dS K` (`m64n(D/2)k16`: warpgroup `w` the head-dim half `w`, A = `dS^T` read transposed,
///   B = K read transposed) and `dK += dS^T Q`;
/// - once dQ is done (dK still running), dQ staged as f32 rows, which the next block's first
///   barrier publishes and one bulk reduction per row adds to `dq_acc` (f32, dq's layout).
///
/// Two cube barriers per block: the first both lands the block's copies and publishes the
/// previous block's dQ rows, the second publishes `dS^T`.
///
/// Why this shape: FlashAttention-3's backward (two consumer warpgroups of 64 keys, 64-query
/// blocks). Registers at head dim 128: dK and dV 64 f32 each, `S^T` and `dP^T` 32 each, dQ 32.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
fn flash_bwd_dkdv_wgmma<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dq_acc: &mut Tensor<f32>,
    scale: f32,
    seq_len: u32,
    group: u32,
    #[comptime] d: usize,
    #[define(F)] _dtype: StorageType,
) {
    let bk = comptime!(WGMMA_BWD_KEYS);
    let bq = comptime!(WGMMA_BWD_QROWS);
    let pitch = comptime!(wgmma_bwd_dq_pitch(d));
    let kv_tile = comptime!(bk * d / 8);
    let q_tile = comptime!(bq * d / 8);
    let q_tiles = comptime!(bq / 8);
    let d_tiles = comptime!(d / 8);

    let seq = seq_len as usize;
    let hk = CUBE_POS_X as usize;
    let k0 = CUBE_POS_Y as usize * bk;
    let b = CUBE_POS_Z as usize;
    let grp = group as usize;
    let warp = UNIT_POS as usize / 32;
    let wg = warp / 4;
    let lane = UNIT_POS_PLANE as usize;
    let t = UNIT_POS as usize;
    // This warp's first key, and its warpgroup's first K/V row (chunk offset of its atom).
    let wk0 = k0 + 16 * warp;
    let kv_wg = sw128_chunk(64 * wg, 0usize, bk);
    // Chunk offset of head-dim column `d / 2` (the second dQ half's first) in row 0 of K.
    let dq_half_chunks = sw128_chunk(0usize, comptime!(d / 16), bk);

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let mut ks = SharedMemory::<Vector<F, N>>::new_aligned(kv_tile, 1024usize);
    let mut vs = SharedMemory::<Vector<F, N>>::new_aligned(kv_tile, 1024usize);
    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * q_tile), 1024usize);
    let mut dos = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * q_tile), 1024usize);
    // dS^T as bf16 pairs, `[key][query]` in the swizzled layout (64 queries = one 128-byte
    // column block).
    let mut dss =
        SharedMemory::<Vector<F, Const<2>>>::new_aligned(comptime!(bk * bq / 2), 1024usize);
    let mut dqs =
        SharedMemory::<Vector<f32, Const<2>>>::new_aligned(comptime!(bq * pitch), 128usize);
    let mut lse_s = SharedMemory::<f32>::new(comptime!(2 * bq));
    let mut delta_s = SharedMemory::<f32>::new(comptime!(2 * bq));

    let bar = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let k_base = (b * k.stride(0) + hk * k.stride(1)) / 8;
    let v_base = (b * v.stride(0) + hk * v.stride(1)) / 8;
    copy_kv_swizzled::<F, N>(
        k,
        v,
        k_base,
        v_base,
        k.stride(2) / 8,
        v.stride(2) / 8,
        k0,
        seq,
        &mut ks,
        &mut vs,
        0usize,
        bk,
        d,
        256usize,
    );

    let n_qb = (seq + bq - 1) / bq;
    let qb_start = k0 / bq;
    let n_blk = n_qb - qb_start;
    let n_it = grp * n_blk;
    let h_first = hk * grp;
    copy_qdo_swizzled::<F, N>(
        q,
        d_o,
        lse,
        delta,
        &mut qs,
        &mut dos,
        &mut lse_s,
        &mut delta_s,
        b,
        h_first,
        qb_start * bq,
        seq,
        0usize,
        0usize,
        d,
    );

    let mut dk_acc = zero_frags(d_tiles);
    let mut dv_acc = zero_frags(d_tiles);
    let mut p = Array::<f32>::new(comptime!(bq / 2));
    let mut ds = Array::<f32>::new(comptime!(bq / 2));

    let mut blk = 0usize;
    let mut h_off = 0usize;
    // The previous block's dQ rows, staged in `dqs` and added at the next block's first
    // barrier (which is also the one the copies of that block wait at).
    let mut staged_q0 = 0usize;
    let mut staged_h = 0usize;
    for it in 0..n_it {
        let q0 = (qb_start + blk) * bq;
        let h = h_first + h_off;
        let buf = it % 2;
        let q_off = buf * q_tile;
        let stat0 = buf * bq;
        // The previous block's dK reads its Q buffer, which the prefetch below refills.
        wgmma_wait_group(0u32);
        wgmma_fence_operands(&mut dk_acc);
        // One barrier: this block's copies have landed and the previous block's dQ rows are
        // staged (each thread fenced its staging stores before arriving).
        bar.commit_copy_async();
        bar.arrive_and_wait();
        // `cp.async` wrote through the generic proxy, `wgmma` reads through the async one.
        sync_async_proxy_shared();
        if it > 0 {
            reduce_dq_rows(&dqs, dq_acc, b, staged_h, staged_q0, seq, d);
        }
        let mut next_blk = blk + 1;
        let mut next_h_off = h_off;
        if next_blk == n_blk {
            next_blk = 0;
            next_h_off += 1;
        }
        if it + 1 < n_it {
            copy_qdo_swizzled::<F, N>(
                q,
                d_o,
                lse,
                delta,
                &mut qs,
                &mut dos,
                &mut lse_s,
                &mut delta_s,
                b,
                h_first + next_h_off,
                (qb_start + next_blk) * bq,
                seq,
                q_tile - q_off,
                bq - stat0,
                d,
            );
        }

        // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys, one group each, so that
        // P is computed while dP^T is still running.
        let mut s_acc = fresh_frags(q_tiles);
        let mut dp_acc = fresh_frags(q_tiles);
        wgmma_bwd_scores::<F, N>(&mut s_acc, &ks, &qs, kv_wg, q_off, d);
        wgmma_bwd_scores::<F, N>(&mut dp_acc, &vs, &dos, kv_wg, q_off, d);
        wgmma_wait_group(1u32);
        wgmma_fence_operands(&mut s_acc);

        // P^T: rows are this warp's keys, columns the block's queries (0 where the key
        // follows the query, and for query rows past `seq`, whose lse is huge). The causal
        // mask only where the warp's last key passes the block's first query.
        if wk0 + 16 <= q0 + 1 {
            wgmma_bwd_probs(
                &s_acc, &mut p, &lse_s, stat0, q0, wk0, r_lo, r_hi, c_lo, scale, q_tiles, false,
            );
        } else {
            wgmma_bwd_probs(
                &s_acc, &mut p, &lse_s, stat0, q0, wk0, r_lo, r_hi, c_lo, scale, q_tiles, true,
            );
        }

        // dV += P^T dO (P^T from registers, dO read transposed) runs during dS^T.
        let mut p_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for kk in 0..comptime!(bq / 16) {
            p_frags.push(p_fragment::<F>(&p, 0usize, kk, q_tiles));
        }
        wgmma_fence_operands(&mut dv_acc);
        wgmma_rs_block::<F, N>(&mut dv_acc, &p_frags, &dos, q_off, bq, d);
        wgmma_wait_group(1u32);
        wgmma_fence_operands(&mut dp_acc);

        // dS^T = P^T (dP^T - delta).
        #[unroll]
        for nt in 0..q_tiles {
            #[unroll]
            for e in 0..2usize {
                let delta_q = delta_s[stat0 + 8 * nt + c_lo + e];
                let dp_frag = dp_acc.index(nt);
                #[unroll]
                for hh in 0..2usize {
                    let idx = comptime!((nt * 2 + hh) * 2 + e);
                    ds[idx] = p[idx] * (dp_frag[hh][e] - delta_q);
                }
            }
        }
        let mut ds_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for kk in 0..comptime!(bq / 16) {
            ds_frags.push(p_fragment::<F>(&ds, 0usize, kk, q_tiles));
        }

        // dS^T to shared memory from its A fragments (already rounded; pair j of fragment
        // kk is query tile 2 kk + j / 2, row lo or hi by j % 2), as 4-byte stores.
        let key_lo = 16 * warp + r_lo;
        let key_hi = 16 * warp + r_hi;
        #[unroll]
        for kk in 0..comptime!(bq / 16) {
            let frag = ds_frags.index(kk);
            #[unroll]
            for j in 0..4usize {
                let mut key = key_lo;
                if comptime!(j % 2 == 1) {
                    key = key_hi;
                }
                let nt = comptime!(2 * kk + j / 2);
                dss[sw128_chunk(key, nt, bk) * 4 + c_lo / 2] = frag[j];
            }
        }
        // The previous block's reductions must have read the staging rows before they are
        // written again below; the barrier after this publishes dS^T to both warpgroups.
        if t < bq {
            tma_group_wait_read(0u32);
        }
        sync_async_proxy_shared();
        sync_cube();

        // dQ = dS K for head-dim half `wg` (A = dS^T `[key][query]` read transposed, B = K
        // `[key][d]` read transposed, 16 keys per step), then dK += dS^T Q, which runs on
        // while dQ is staged.
        let mut dq_acc_w = fresh_frags(comptime!(d / 16));
        // Head-dim half `wg` starts `d / 2` columns in: a column block of its own at d 128,
        // 64 bytes into the one block at d 64.
        let desc_ds0 = wgmma_descriptor(
            &dss,
            0usize,
            comptime!(bk as u32 * 128),
            1024u32,
            SWIZZLE_128B,
        );
        let desc_k0 = wgmma_descriptor(
            &ks,
            wg * dq_half_chunks,
            comptime!(bk as u32 * 128),
            1024u32,
            SWIZZLE_128B,
        );
        wgmma_fence();
        #[unroll]
        for kk in 0..comptime!(bk / 16) {
            // Keys 16 kk .. 16 kk + 16: 2 KiB into `dS^T` and into K's column block.
            let desc_ds = wgmma_descriptor_at(desc_ds0, comptime!(kk * 128));
            let desc_k = wgmma_descriptor_at(desc_k0, comptime!(kk * 128));
            wgmma_ss::<F>(
                &mut dq_acc_w,
                desc_ds,
                desc_k,
                comptime!(d as u32 / 2),
                1u32,
                1u32,
                comptime!(if kk == 0 { 0u32 } else { 1u32 }),
            );
        }
        wgmma_commit_group();
        wgmma_fence_operands(&mut dk_acc);
        wgmma_rs_block::<F, N>(&mut dk_acc, &ds_frags, &qs, q_off, bq, d);
        wgmma_wait_group(1u32);
        wgmma_fence_operands(&mut dq_acc_w);
        wgmma_fence_operands(&mut dv_acc);

        // Stage this warpgroup's dQ half as f32 rows for the next barrier's reductions.
        let qrow_lo = 16 * (warp % 4) + r_lo;
        let qrow_hi = 16 * (warp % 4) + r_hi;
        #[unroll]
        for dt in 0..comptime!(d / 16) {
            let pair = wg * comptime!(d / 4) + 4 * dt + c_lo / 2;
            let frag = dq_acc_w.index(dt);
            dqs[qrow_lo * pitch + pair] = frag[0];
            dqs[qrow_hi * pitch + pair] = frag[1];
        }
        sync_async_proxy_shared();
        staged_q0 = q0;
        staged_h = h;
        blk = next_blk;
        h_off = next_h_off;
    }
    wgmma_wait_group(0u32);
    wgmma_fence_operands(&mut dk_acc);
    sync_cube();
    reduce_dq_rows(&dqs, dq_acc, b, staged_h, staged_q0, seq, d);
    if t < bq {
        tma_group_wait_read(0u32);
    }

    write_dkdv::<F>(
        dk, dv, &dk_acc, &dv_acc, b, hk, wk0, r_lo, r_hi, c_lo, 0usize, seq, scale, d_tiles, 1usize,
    );
}

/// dQ, manual MMA (the [`MmaDq::Split`] scheme). Cube = (query head, query block from the
/// last, batch); `32 * warps` threads, warp `w` owns query rows `16 w .. 16 w + 16`. The
/// forward's structure with `dS = P (dP - delta)` in place of the softmax: S and dP in
/// registers, dS used as the A operand of `dS K` ([`dq_block`]); the next K/V block is loaded
/// into registers while the current one is in use.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
fn flash_bwd_dq_mma<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq_out: &mut Tensor<F>,
    scale: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] warps: usize,
    #[define(F)] _dtype: StorageType,
) {
    let bq = comptime!(16 * warps);
    let bk = comptime!(MMA_KEYS);
    let nthreads = comptime!(32 * warps);
    let ldt = comptime!(d + 8);
    let n_tiles = comptime!(MMA_KEYS / 8);
    let d_tiles = comptime!(d / 8);
    let k_steps = comptime!(d / 16);
    let kv_regs = comptime!(MMA_KEYS * d / nv / (32 * warps));

    let seq = seq_len as usize;
    let h = CUBE_POS_X as usize;
    let qb = n_blocks as usize - 1 - CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let hk = h / group as usize;
    let warp = UNIT_POS as usize / 32;
    let lane = UNIT_POS_PLANE as usize;
    let q0 = qb * bq;
    let wrow = warp * 16;
    let row0 = q0 + wrow;

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let q_base = (b * q.stride(0) + h * q.stride(1)) / nv;
    let do_base = (b * d_o.stride(0) + h * d_o.stride(1)) / nv;
    let k_base = (b * k.stride(0) + hk * k.stride(1)) / nv;
    let v_base = (b * v.stride(0) + hk * v.stride(1)) / nv;
    let k_rs = k.stride(2) / nv;
    let v_rs = v.stride(2) / nv;

    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * ldt / nv), 128usize);
    let mut dos = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * ldt / nv), 128usize);
    let mut ks =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(MMA_KEYS * ldt / nv), 128usize);
    let mut vs =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(MMA_KEYS * ldt / nv), 128usize);

    stage_tile::<F, N>(
        q,
        q_base,
        q.stride(2) / nv,
        q0,
        seq,
        &mut qs,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );
    stage_tile::<F, N>(
        d_o,
        do_base,
        d_o.stride(2) / nv,
        q0,
        seq,
        &mut dos,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );

    let lse_r = lane_rows_f32(lse, b, h, row0, r_lo, r_hi, seq);
    let delta_r = lane_rows_f32(delta, b, h, row0, r_lo, r_hi, seq);

    let mut dq_acc = zero_frags(d_tiles);
    let mut s_acc = zero_frags(n_tiles);
    let mut dp_acc = zero_frags(n_tiles);
    let mut ds = Array::<f32>::new(comptime!(MMA_KEYS / 2));

    let mut q_end = q0 + bq;
    if seq < q_end {
        q_end = seq;
    }
    let n_kb = (q_end + bk - 1) / bk;

    let mut k_regs = Array::<Vector<F, N>>::new(kv_regs);
    let mut v_regs = Array::<Vector<F, N>>::new(kv_regs);
    load_tile_regs::<F, N>(k, k_base, k_rs, 0, seq, &mut k_regs, bk, d, nv, nthreads);
    load_tile_regs::<F, N>(v, v_base, v_rs, 0, seq, &mut v_regs, bk, d, nv, nthreads);

    for kb in 0..n_kb {
        let k0 = kb * bk;
        sync_cube();
        store_tile_regs::<F, N>(&k_regs, &mut ks, bk, d, ldt, nv, nthreads);
        store_tile_regs::<F, N>(&v_regs, &mut vs, bk, d, ldt, nv, nthreads);
        sync_cube();
        if kb + 1 < n_kb {
            load_tile_regs::<F, N>(
                k,
                k_base,
                k_rs,
                k0 + bk,
                seq,
                &mut k_regs,
                bk,
                d,
                nv,
                nthreads,
            );
            load_tile_regs::<F, N>(
                v,
                v_base,
                v_rs,
                k0 + bk,
                seq,
                &mut v_regs,
                bk,
                d,
                nv,
                nthreads,
            );
        }

        // No row of the warp precedes the block's last key: no causal mask (decided per warp,
        // see the forward). Otherwise, warps whose rows all precede the block see none of its
        // keys (warp-uniform).
        if k0 + bk <= row0 + 1 {
            dq_block::<F, N>(
                &qs,
                &dos,
                &ks,
                &vs,
                0usize,
                k0,
                wrow,
                row0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                &lse_r,
                &delta_r,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut ds,
                &mut dq_acc,
                n_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                false,
            );
        } else if k0 < row0 + 16 {
            dq_block::<F, N>(
                &qs,
                &dos,
                &ks,
                &vs,
                0usize,
                k0,
                wrow,
                row0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                &lse_r,
                &delta_r,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut ds,
                &mut dq_acc,
                n_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                true,
            );
        }
    }

    write_dq::<F>(
        dq_out, &dq_acc, b, h, row0, r_lo, r_hi, c_lo, seq, scale, d_tiles,
    );
}

/// dQ with `cp.async` double buffering ([`MmaBwdPipe::Async`]): [`flash_bwd_dq_mma`]'s work,
/// but Q and dO and the K/V blocks are copied by `cp.async` (no staging registers, which the
/// register prefetch spends 32 of per lane at hd 128), K/V into two halves of their tiles:
/// after the barrier that makes block `i` visible (and that every warp reaches only once done
/// with block `i - 1`), the copy of block `i + 1` into the other half is issued, then block
/// `i` is computed. One cube barrier per block instead of two.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
fn flash_bwd_dq_mma_cp<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq_out: &mut Tensor<F>,
    scale: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] warps: usize,
    #[define(F)] _dtype: StorageType,
) {
    let bq = comptime!(16 * warps);
    let bk = comptime!(MMA_KEYS);
    let nthreads = comptime!(32 * warps);
    let ldt = comptime!(d + 8);
    let n_tiles = comptime!(MMA_KEYS / 8);
    let d_tiles = comptime!(d / 8);
    let k_steps = comptime!(d / 16);

    let seq = seq_len as usize;
    let h = CUBE_POS_X as usize;
    let qb = n_blocks as usize - 1 - CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let hk = h / group as usize;
    let warp = UNIT_POS as usize / 32;
    let lane = UNIT_POS_PLANE as usize;
    let q0 = qb * bq;
    let wrow = warp * 16;
    let row0 = q0 + wrow;

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let k_base = (b * k.stride(0) + hk * k.stride(1)) / nv;
    let v_base = (b * v.stride(0) + hk * v.stride(1)) / nv;
    let k_rs = k.stride(2) / nv;
    let v_rs = v.stride(2) / nv;

    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * ldt / nv), 128usize);
    let mut dos = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * ldt / nv), 128usize);
    // Two halves of MMA_KEYS rows each.
    let mut ks =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * MMA_KEYS * ldt / nv), 128usize);
    let mut vs =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * MMA_KEYS * ldt / nv), 128usize);

    // One phase per key block (see flash_bwd_dkdv_mma_cp); created before any copy is issued.
    let bar = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    // Q, dO and the first K/V block go together: the first barrier covers all four.
    copy_tile_async::<F, N>(
        q,
        (b * q.stride(0) + h * q.stride(1)) / nv,
        q.stride(2) / nv,
        q0,
        seq,
        &mut qs,
        0usize,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );
    copy_tile_async::<F, N>(
        d_o,
        (b * d_o.stride(0) + h * d_o.stride(1)) / nv,
        d_o.stride(2) / nv,
        q0,
        seq,
        &mut dos,
        0usize,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );
    copy_kv_async::<F, N>(
        k, v, k_base, v_base, k_rs, v_rs, 0usize, seq, &mut ks, &mut vs, 0usize, bk, d, ldt, nv,
        nthreads,
    );

    let lse_r = lane_rows_f32(lse, b, h, row0, r_lo, r_hi, seq);
    let delta_r = lane_rows_f32(delta, b, h, row0, r_lo, r_hi, seq);

    let mut dq_acc = zero_frags(d_tiles);
    let mut s_acc = zero_frags(n_tiles);
    let mut dp_acc = zero_frags(n_tiles);
    let mut ds = Array::<f32>::new(comptime!(MMA_KEYS / 2));

    let mut q_end = q0 + bq;
    if seq < q_end {
        q_end = seq;
    }
    let n_kb = (q_end + bk - 1) / bk;

    for kb in 0..n_kb {
        let k0 = kb * bk;
        let krow0 = (kb % 2) * bk;
        bar.commit_copy_async();
        bar.arrive_and_wait();
        if kb + 1 < n_kb {
            let nrow0 = bk - krow0;
            copy_kv_async::<F, N>(
                k,
                v,
                k_base,
                v_base,
                k_rs,
                v_rs,
                k0 + bk,
                seq,
                &mut ks,
                &mut vs,
                nrow0,
                bk,
                d,
                ldt,
                nv,
                nthreads,
            );
        }
        // No row of the warp precedes the block's last key: no causal mask (decided per warp,
        // see the forward).
        if k0 + bk <= row0 + 1 {
            dq_block::<F, N>(
                &qs,
                &dos,
                &ks,
                &vs,
                krow0,
                k0,
                wrow,
                row0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                &lse_r,
                &delta_r,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut ds,
                &mut dq_acc,
                n_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                false,
            );
        } else if k0 < row0 + 16 {
            dq_block::<F, N>(
                &qs,
                &dos,
                &ks,
                &vs,
                krow0,
                k0,
                wrow,
                row0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                &lse_r,
                &delta_r,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut ds,
                &mut dq_acc,
                n_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                true,
            );
        }
    }

    write_dq::<F>(
        dq_out, &dq_acc, b, h, row0, r_lo, r_hi, c_lo, seq, scale, d_tiles,
    );
}

/// `delta = rowsum(dO * O)` in f32 with `tpr` adjacent lanes per row
/// ([`MmaBwdTiling::wide_delta`]): each lane reads `d / nv / tpr` vectors of `nv` elements of
/// O and dO (16-byte loads at `nv = 8`; a row's lanes read it contiguously, so a warp's loads
/// coalesce, where one thread per row strides by a whole row), then the row's lanes add their
/// partial sums with `plane_shuffle_xor`. Lanes past the last row take part in the shuffles
/// with zeros.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_delta_wide<F: Float, N: Size>(
    o: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    delta: &mut Tensor<f32>,
    seq_len: u32,
    heads: u32,
    total_rows: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] tpr: usize,
    #[define(F)] _dtype: StorageType,
) {
    let per_lane = comptime!(d / nv / tpr);
    let pos = ABSOLUTE_POS / tpr;
    let sub = UNIT_POS as usize % tpr;
    let in_range = pos < total_rows as usize;
    let seq = seq_len as usize;
    let i = pos % seq;
    let bh = pos / seq;
    let h = bh % heads as usize;
    let b = bh / heads as usize;
    let mut acc = f32::new(0.0);
    if in_range {
        let ob = (b * o.stride(0) + h * o.stride(1) + i * o.stride(2)) / nv;
        let gb = (b * d_o.stride(0) + h * d_o.stride(1) + i * d_o.stride(2)) / nv;
        #[unroll]
        for j in 0..per_lane {
            let c = j * tpr + sub;
            let ov = o[ob + c];
            let gv = d_o[gb + c];
            #[unroll]
            for e in 0..nv {
                acc += f32::cast_from(ov[e]) * f32::cast_from(gv[e]);
            }
        }
    }
    #[unroll]
    for step in 0..comptime!(tpr.trailing_zeros() as usize) {
        acc += plane_shuffle_xor(acc, comptime!(1u32 << step));
    }
    if in_range && sub == 0 {
        delta[b * delta.stride(0) + h * delta.stride(1) + i * delta.stride(2)] = acc;
    }
}

/// Threads per cube of `flash_delta_wide`.
const DELTA_WIDE_THREADS: usize = 256;

/// Lanes per row of `flash_delta_wide`: 8 (two 16-byte vectors each at hd 128), fewer when a
/// row has fewer vectors.
const DELTA_WIDE_LANES: usize = 8;

/// Launches `flash_delta_wide`: `delta [B, Hq, S]` (f32) `= rowsum(d_o * o)` for `o`, `d_o`
/// of `shape` `[B, Hq, S, D]` (last dimension contiguous, as `flash.rs` prepares them).
pub(super) fn launch_delta_wide<R: CubeRuntime>(
    o: CubeTensor<R>,
    d_o: &CubeTensor<R>,
    delta: &CubeTensor<R>,
    shape: [usize; 4],
) {
    let [batch, heads, seq, head_dim] = shape;
    let nv = vector_width(&[&o, d_o]);
    let vectors = head_dim / nv;
    assert!(
        vectors.is_power_of_two(),
        "flash attention (Mma) delta: {head_dim} columns in vectors of {nv}"
    );
    let tpr = vectors.min(DELTA_WIDE_LANES);
    let total_rows = batch * heads * seq;
    assert!(
        total_rows * tpr <= u32::MAX as usize,
        "flash attention backward: too many rows ({total_rows})"
    );
    let client = o.client.clone();
    let dtype = o.dtype;
    // SAFETY: reads are guarded by `pos < total_rows` and stay within a row of `head_dim`
    // elements (`per_lane * tpr * nv = head_dim`); the write by the same guard.
    unsafe {
        flash_delta_wide::launch_unchecked::<R>(
            &client,
            CubeCount::Static((total_rows * tpr).div_ceil(DELTA_WIDE_THREADS) as u32, 1, 1),
            CubeDim::new_1d(DELTA_WIDE_THREADS as u32),
            nv,
            o.into_tensor_arg(),
            d_o.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            seq as u32,
            heads as u32,
            total_rows as u32,
            head_dim,
            nv,
            tpr,
            dtype.into(),
        );
    }
}

/// Whether the device runs the [`MmaBwdPipe::Async`] kernels: `cp.async` and cube-level
/// barriers (CUDA sm_80 and later).
pub fn mma_async_supported<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    let features = client.features();
    features.copy_async && features.supports_type(OpaqueType::Barrier(BarrierLevel::Cube))
}

/// Whether this build and device run the warpgroup-MMA forward ([`MmaTiling::WGMMA`]): the
/// vendored CubeCL crates ([`WGMMA_BUILT`]) and sm_90 or later (TMA, which arrived with
/// `wgmma`, stands for the architecture here).
pub fn wgmma_supported<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    WGMMA_BUILT
        && mma_async_supported(client)
        && client
            .properties()
            .features
            .tma
            .contains(cubecl::ir::features::Tma::Base)
}

/// Whether the warpgroup-MMA backward ([`MmaBwdTiling::WGMMA`]) runs on `client` for inputs
/// read in vectors of `nv` elements: `wgmma` ([`wgmma_supported`]), the bulk reduction
/// ([`BULK_REDUCE_BUILT`]) and 16-byte rows (`nv` 8), which its swizzled copies take whole.
pub fn wgmma_backward_supported<R: CubeRuntime>(client: &ComputeClient<R>, nv: usize) -> bool {
    nv == 8 && BULK_REDUCE_BUILT && wgmma_supported(client)
}

/// The backward tiling that runs at `head_dim` on `client` for inputs read in vectors of `nv`
/// ([`mma_bwd_tiling`]): where a warpgroup tiling was asked for (by `SMP_BURN_FLASH_MMA_BWD_TILING`
/// or [`set_mma_bwd_tiling`]) but cannot run (another head dim, narrower rows, no `wgmma`), the
/// default for that case instead. Why not an error: a check or a model with several head dims
/// asks for one tiling for all of them, as the forward's.
pub(super) fn backward_tiling<R: CubeRuntime>(
    client: &ComputeClient<R>,
    head_dim: usize,
    nv: usize,
) -> MmaBwdTiling {
    let pair_atomics = pair_atomics_supported(client);
    let wgmma = wgmma_backward_supported(client, nv);
    let tiling = mma_bwd_tiling(head_dim, pair_atomics, wgmma);
    if tiling.wgmma && !(matches!(head_dim, 64 | 128) && wgmma) {
        MmaBwdTiling::default_for(head_dim, pair_atomics, false)
    } else {
        tiling
    }
}

/// Whether the device adds pairs of f32 atomically in global memory (CUDA sm_90 and later), as
/// the [`MmaDq::Atomic`] tilings do.
pub fn pair_atomics_supported<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    let pair = cubecl::ir::Type::new(cubecl::ir::StorageType::Atomic(ElemType::Float(
        FloatKind::F32,
    )))
    .with_vector_size(2);
    client
        .properties()
        .atomic_type_usage(pair)
        .contains(cubecl::ir::features::AtomicUsage::Add)
}

/// `dq = dq_acc * scale` rounded to `F`, element-wise over the flat buffers of `len` vectors
/// of `N` (dense, with the same strides, so any shared layout): the last step of the
/// [`MmaDq::Atomic`] scheme with the pair atomics.
#[cube(launch_unchecked)]
fn flash_dq_convert<F: Float, N: Size>(
    dq_acc: &Tensor<Vector<f32, N>>,
    dq: &mut Tensor<Vector<F, N>>,
    scale: f32,
    len: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        dq[i] = Vector::<F, N>::cast_from(dq_acc[i] * Vector::new(scale));
    }
}

/// `dq = dq_acc * scale` rounded to `F` from the bulk dQ's chunked accumulator
/// ([`dq_chunk_pos`]; its rows past `seq` are padding and skipped), one thread per vector of
/// `nv` adjacent columns of one row of `dq` (`[B, H, S, D]` through its strides, `len`
/// vectors). Why vectors: a row's 8 columns from a multiple of 8 lie next to each other in the
/// chunk, so a thread reads them with `nv / mv` loads of `mv` f32 and writes one vector, and
/// the index arithmetic (divisions by the runtime `seq` and `heads`) is paid once per vector.
/// One thread per element ran at 1.0 TB/s, compute-bound on that arithmetic: 0.79 ms, 5.5 % of
/// the hd-128 backward at B8 S 4k (session 17, call FT).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_dq_convert_chunks<F: Float, N: Size, M: Size>(
    dq_acc: &Tensor<Vector<f32, M>>,
    dq: &mut Tensor<Vector<F, N>>,
    scale: f32,
    len: u32,
    heads: u32,
    seq_len: u32,
    #[comptime] warps: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
    #[comptime] mt: usize,
    #[comptime] nv: usize,
    #[comptime] mv: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        let seq = seq_len as usize;
        let vectors = comptime!(d / nv);
        let col = (i % vectors) * nv;
        let t = i / vectors;
        let row = t % seq;
        let bh = t / seq;
        let h = bh % heads as usize;
        let b = bh / heads as usize;
        let n_qb = (seq + bq - 1) / bq;
        let src = ((bh * n_qb + row / bq) * comptime!(bq * d)
            + dq_chunk_pos(row % bq, col, warps, bq, d, mt))
            / mv;
        let mut out = Vector::<F, N>::empty();
        #[unroll]
        for j in 0..comptime!(nv / mv) {
            let a = dq_acc[src + j];
            #[unroll]
            for e in 0..mv {
                out[j * mv + e] = F::cast_from(a[e] * scale);
            }
        }
        dq[(b * dq.stride(0) + h * dq.stride(1) + row * dq.stride(2) + col) / nv] = out;
    }
}

/// Environment variable that turns the bulk dQ reduction off (`0`; `1`, the default, uses it
/// where [`bulk_dq_supported`]); for measuring the difference.
pub const FLASH_BULK_DQ_ENV: &str = "SMP_BURN_FLASH_BULK_DQ";

/// Whether the atomic-dQ backward kernels can add dQ by bulk reductions
/// ([`bulk_reduce_add_f32`]): this build has the operation ([`BULK_REDUCE_BUILT`]) and the
/// device Hopper's copy engine (TMA, sm_90+).
pub fn bulk_dq_supported<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    BULK_REDUCE_BUILT
        && client
            .properties()
            .features
            .tma
            .contains(cubecl::ir::features::Tma::Base)
}

/// Whether the backward with `tiling` adds its dQ by bulk reductions, where `supported`
/// ([`bulk_dq_supported`], or for a log without a CubeCL client: [`BULK_REDUCE_BUILT`] and
/// sm_90+): the tilings whose dQ tiles span whole chunks (the warp grid, or the `cp.async`
/// kernel's deferred dQ), unless [`FLASH_BULK_DQ_ENV`] is `0` (read once). The launch and the
/// trainer's log both ask this.
///
/// # Panics
/// If the variable holds anything but `1`, `0`, `true`, `false` or nothing.
pub fn bulk_dq_used(tiling: MmaBwdTiling, supported: bool) -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let wanted = *WANTED.get_or_init(|| env_switch(FLASH_BULK_DQ_ENV, true));
    // The warpgroup kernel adds its dQ rows by bulk reductions of its own, into dq's layout.
    let whole_chunks = tiling.dq == MmaDq::Atomic
        && tiling.pipe == MmaBwdPipe::Async
        && !tiling.wgmma
        && (tiling.warp_grid || defer_fused_dq());
    supported && wanted && whole_chunks
}

/// Threads per cube of [`flash_dq_convert`].
const CONVERT_THREADS: usize = 256;

/// Launches the Mma backward: writes `dq`, `dk`, `dv` (allocated by the caller in `layout`; the
/// kernels write through their strides) from the forward's inputs, `d_o`, `lse` and
/// `delta = rowsum(dO * O)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    d_o: CubeTensor<R>,
    lse: CubeTensor<R>,
    delta: CubeTensor<R>,
    dq: &CubeTensor<R>,
    dk: &CubeTensor<R>,
    dv: &CubeTensor<R>,
    scale: f32,
    shape: [usize; 4],
    heads_kv: usize,
    layout: FlashLayout,
) {
    let [batch, heads_q, seq, head_dim] = shape;
    let group = heads_q / heads_kv;
    let client = q.client.clone();
    let device = q.device.clone();
    let dtype = q.dtype;
    let nv = vector_width(&[&q, &k, &v, &d_o]);
    let tiling = backward_tiling(&client, head_dim, nv);
    let fused = tiling.dq == MmaDq::Atomic;
    if fused {
        assert!(
            pair_atomics_supported(&client),
            "flash attention backward (Mma): {tiling} adds f32 pairs atomically, which needs \
             sm_90 or later; use a -split tiling"
        );
    }
    // cp.async copies 4, 8 or 16 bytes: 2-byte elements need vectors of 2 or more (always the
    // case for contiguous inputs); narrower ones fall back to the register prefetch.
    let async_copy = tiling.pipe == MmaBwdPipe::Async && nv >= 2;
    let prefetch =
        tiling.pipe == MmaBwdPipe::Prefetch || (tiling.pipe == MmaBwdPipe::Async && nv < 2);
    if async_copy {
        assert!(
            mma_async_supported(&client),
            "flash attention backward (Mma): {tiling} needs cp.async and cube barriers (sm_80+)"
        );
    }
    let n_kblocks = seq.div_ceil(tiling.keys()) as u32;
    // The bulk dQ (`fused_dq_apply`) needs the warp grid or the deferred dQ of the `cp.async`
    // kernel, whose dQ tiles span whole chunks.
    let defer_dq = fused && async_copy && !tiling.warp_grid && defer_fused_dq();
    let bulk_dq = async_copy && bulk_dq_used(tiling, bulk_dq_supported(&client));
    let dq_mt = if tiling.warp_grid || defer_dq {
        dq_m_tiles(tiling.warps, tiling.inner, head_dim)
    } else {
        1
    };
    // The f32 dQ accumulator of the fused scheme; a 1-element placeholder otherwise (the
    // kernel's comptime `fused` removes every access to it). In dq's layout: both are dense
    // with the same strides, so `flash_dq_convert`'s flat index `i` is the same element in
    // both.
    let dq_acc = if bulk_dq {
        // Chunks of `bq x d` per (batch, head, query block), rows past `seq` included.
        let chunks = batch * heads_q * seq.div_ceil(tiling.inner);
        zeros_client::<R>(
            client.clone(),
            device.clone(),
            Shape::new([chunks * tiling.inner * head_dim]),
            DType::F32,
        )
    } else if fused {
        layout.alloc([batch, heads_q, seq, head_dim], |shape| {
            zeros_client::<R>(client.clone(), device.clone(), shape, DType::F32)
        })
    } else {
        empty_device_contiguous_dtype::<R>(
            client.clone(),
            device.clone(),
            Shape::new([1usize]),
            DType::F32,
        )
    };
    let dim = CubeDim::new_1d(32 * tiling.warps as u32);
    let count_kv = CubeCount::Static(heads_kv as u32, n_kblocks, batch as u32);
    // SAFETY: global reads are guarded by `seq` (rows past it are zero-filled in shared
    // memory), writes and atomics by `row < seq` / `key < seq`; shared indices stay inside the
    // comptime-sized tiles (ldmatrix rows are 16-byte aligned: pitches of d + 8 and inner + 8
    // elements, columns multiples of 8). The cp.async copies are `2 * nv` bytes at
    // `nv`-aligned global offsets (`vector_width`) and 16-byte aligned shared rows.
    if tiling.wgmma {
        assert!(
            wgmma_backward_supported(&client, nv) && matches!(head_dim, 64 | 128),
            "flash attention backward (Mma): {tiling} needs wgmma and the bulk reduction (sm_90+ \
             and the workspace's vendored CubeCL), 16-byte rows and head dim 64 or 128; got \
             vectors of {nv} at head dim {head_dim}"
        );
        // SAFETY: as below; the swizzled tiles are 1024-byte aligned and `sw128_chunk` stays
        // inside them; each bulk reduction adds one dQ row (4 d bytes) at a 16-byte aligned
        // address of `dq_acc` (dq's layout, rows < seq only).
        unsafe {
            flash_bwd_dkdv_wgmma::launch_unchecked::<R>(
                &client,
                count_kv,
                dim,
                nv,
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                d_o.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                dk.clone().into_tensor_arg(),
                dv.clone().into_tensor_arg(),
                dq_acc.clone().into_tensor_arg(),
                scale,
                seq as u32,
                group as u32,
                head_dim,
                dtype.into(),
            );
        }
    } else if async_copy && tiling.warp_grid && fused {
        // SAFETY: as below; the P^T and dS^T tiles are indexed inside their comptime sizes
        // (rows of the cube's keys, columns of one query block).
        unsafe {
            flash_bwd_dkdv_mma_grid::launch_unchecked::<R>(
                &client,
                count_kv,
                dim,
                nv,
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                d_o.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                dk.clone().into_tensor_arg(),
                dv.clone().into_tensor_arg(),
                dq_acc.clone().into_tensor_arg(),
                scale,
                seq as u32,
                group as u32,
                head_dim,
                nv,
                tiling.warps,
                tiling.inner,
                dq_mt,
                bulk_dq,
                dtype.into(),
            );
        }
    } else if async_copy {
        // The fused dQ of the `cp.async` kernel runs one block late (`defer_fused_dq`).
        unsafe {
            flash_bwd_dkdv_mma_cp::launch_unchecked::<R>(
                &client,
                count_kv,
                dim,
                nv,
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                d_o.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                dk.clone().into_tensor_arg(),
                dv.clone().into_tensor_arg(),
                dq_acc.clone().into_tensor_arg(),
                scale,
                seq as u32,
                group as u32,
                head_dim,
                nv,
                tiling.warps,
                tiling.inner,
                fused,
                defer_dq,
                dq_mt,
                bulk_dq,
                dtype.into(),
            );
        }
    } else {
        unsafe {
            flash_bwd_dkdv_mma::launch_unchecked::<R>(
                &client,
                count_kv,
                dim,
                nv,
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                d_o.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                dk.clone().into_tensor_arg(),
                dv.clone().into_tensor_arg(),
                dq_acc.clone().into_tensor_arg(),
                scale,
                seq as u32,
                group as u32,
                head_dim,
                nv,
                tiling.warps,
                tiling.inner,
                fused,
                prefetch,
                dtype.into(),
            );
        }
    }
    if fused {
        let len = batch * heads_q * seq * head_dim;
        assert!(
            len <= u32::MAX as usize,
            "flash attention backward (Mma): dQ too large ({len} elements)"
        );
        if bulk_dq {
            // A row's columns are adjacent in the chunk only within 8 (`dq_chunk_pos`).
            let nv = vector_width(&[dq]).min(8);
            let mv = nv.min(4);
            let vectors = len / nv;
            // SAFETY: `dq_acc` holds every chunk of `dq`'s (batch, head, query block), so
            // `dq_chunk_pos` stays inside it (its `nv` columns from a multiple of `nv` are
            // adjacent there, `mv`-aligned); `dq` is written through its strides (multiples of
            // `nv`, `vector_width`) for the `vectors` vectors of its shape; the kernel guards
            // `i < vectors`.
            unsafe {
                flash_dq_convert_chunks::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(vectors.div_ceil(CONVERT_THREADS) as u32, 1, 1),
                    CubeDim::new_1d(CONVERT_THREADS as u32),
                    nv,
                    mv,
                    dq_acc.into_tensor_arg(),
                    dq.clone().into_tensor_arg(),
                    scale,
                    vectors as u32,
                    heads_q as u32,
                    seq as u32,
                    tiling.warps,
                    tiling.inner,
                    head_dim,
                    dq_mt,
                    nv,
                    mv,
                    dtype.into(),
                );
            }
            return;
        }
        // 16-byte f32 loads at most.
        let nv = vector_width(&[dq]).min(4);
        let vectors = len / nv;
        // SAFETY: both tensors are dense buffers of `len` elements with the same strides (see
        // `dq_acc`), multiples of `nv` (`vector_width`); the kernel guards `i < vectors`.
        unsafe {
            flash_dq_convert::launch_unchecked::<R>(
                &client,
                CubeCount::Static(vectors.div_ceil(CONVERT_THREADS) as u32, 1, 1),
                CubeDim::new_1d(CONVERT_THREADS as u32),
                nv,
                dq_acc.into_tensor_arg(),
                dq.clone().into_tensor_arg(),
                scale,
                vectors as u32,
                dtype.into(),
            );
        }
    } else {
        let n_qblocks = seq.div_ceil(16 * tiling.warps) as u32;
        let count_q = CubeCount::Static(heads_q as u32, n_qblocks, batch as u32);
        // SAFETY: as for the dK/dV kernels.
        unsafe {
            if async_copy {
                flash_bwd_dq_mma_cp::launch_unchecked::<R>(
                    &client,
                    count_q,
                    dim,
                    nv,
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    d_o.into_tensor_arg(),
                    lse.into_tensor_arg(),
                    delta.into_tensor_arg(),
                    dq.clone().into_tensor_arg(),
                    scale,
                    seq as u32,
                    group as u32,
                    n_qblocks,
                    head_dim,
                    nv,
                    tiling.warps,
                    dtype.into(),
                );
            } else {
                flash_bwd_dq_mma::launch_unchecked::<R>(
                    &client,
                    count_q,
                    dim,
                    nv,
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    d_o.into_tensor_arg(),
                    lse.into_tensor_arg(),
                    delta.into_tensor_arg(),
                    dq.clone().into_tensor_arg(),
                    scale,
                    seq as u32,
                    group as u32,
                    n_qblocks,
                    head_dim,
                    nv,
                    tiling.warps,
                    dtype.into(),
                );
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Fragment probe
// ------------------------------------------------------------------------------------------

/// One warp runs the Mma kernels' fragment helpers on 16x16 inputs: `s = a k^T` through
/// [`mma_abt_strip`] (two key n-tiles), then `o = s v` through [`mma_pv_strip`] with `s` as
/// `P`, and `t = s^T v` the way the fused backward forms `dQ = dS K` from `dS^T`: `s` stored
/// as it lies through [`store_acc_pairs`], then [`mma_atb_acc`] (transposed `ldmatrix` of the
/// stored tile as the A operand). All written out through the accumulator layout the kernels
/// use for their outputs.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn mma_probe_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    s_out: &mut Tensor<f32>,
    o_out: &mut Tensor<f32>,
    t_out: &mut Tensor<f32>,
    pos_out: &mut Tensor<u32>,
    #[define(F)] _dtype: StorageType,
) {
    let ldt = comptime!(24usize);
    let lane = UNIT_POS_PLANE as usize;
    let mut as_ = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(16usize * 24), 128usize);
    let mut ks = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(16usize * 24), 128usize);
    let mut vs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(16usize * 24), 128usize);
    stage_tile::<F, N>(
        a, 0usize, 16usize, 0usize, 16usize, &mut as_, 16usize, 16usize, ldt, 1usize, 32usize,
    );
    stage_tile::<F, N>(
        k, 0usize, 16usize, 0usize, 16usize, &mut ks, 16usize, 16usize, ldt, 1usize, 32usize,
    );
    stage_tile::<F, N>(
        v, 0usize, 16usize, 0usize, 16usize, &mut vs, 16usize, 16usize, ldt, 1usize, 32usize,
    );
    sync_cube();

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    // The quad reductions assume r_lo = lane / 4, r_hi = r_lo + 8, c_lo = 2 (lane % 4).
    pos_out[lane * 3] = r_lo;
    pos_out[lane * 3 + 1] = r_hi;
    pos_out[lane * 3 + 2] = c_lo;

    let mut s_acc = zero_frags(2usize);
    mma_abt_strip::<F, N>(
        &as_, 0usize, &ks, 0usize, &mut s_acc, lane, 1usize, 2usize, 1usize, ldt, 1usize,
    );
    let mut p = Array::<f32>::new(8usize);
    #[unroll]
    for nt in 0..2usize {
        let frag = s_acc.index(nt);
        #[unroll]
        for hh in 0..2usize {
            let pair = frag[hh];
            let mut r = r_lo as usize;
            if hh == 1 {
                r = r_hi as usize;
            }
            #[unroll]
            for e in 0..2usize {
                let val = pair[e];
                p[comptime!((nt * 2 + hh) * 2 + e)] = val;
                s_out[r * 16 + 8 * nt + c_lo as usize + e] = val;
            }
        }
    }
    let mut o_acc = zero_frags(2usize);
    mma_pv_strip::<F, N>(
        &p, &vs, 0usize, &mut o_acc, lane, 1usize, 2usize, 2usize, ldt, 1usize,
    );
    #[unroll]
    for dt in 0..2usize {
        let frag = o_acc.index(dt);
        #[unroll]
        for hh in 0..2usize {
            let pair = frag[hh];
            let mut r = r_lo as usize;
            if hh == 1 {
                r = r_hi as usize;
            }
            #[unroll]
            for e in 0..2usize {
                o_out[r * 16 + 8 * dt + c_lo as usize + e] = pair[e];
            }
        }
    }

    // t = s^T v: s (rows m, columns k of the product) stored as it lies, read back transposed.
    let mut xs =
        SharedMemory::<Vector<F, Const<2>>>::new_aligned(comptime!(16usize * 24 / 2), 128usize);
    store_acc_pairs::<F>(
        &p,
        &mut xs,
        0usize,
        r_lo as usize,
        r_hi as usize,
        c_lo as usize,
        2usize,
        ldt,
        1usize,
    );
    sync_cube();
    let mut t_acc = zero_frags(2usize);
    mma_atb_acc::<F, Const<2>, N>(
        &xs, 0usize, &vs, 0usize, &mut t_acc, lane, 1usize, 1usize, 2usize, ldt, 2usize, ldt,
        1usize,
    );
    #[unroll]
    for dt in 0..2usize {
        let frag = t_acc.index(dt);
        #[unroll]
        for hh in 0..2usize {
            let pair = frag[hh];
            let mut r = r_lo as usize;
            if hh == 1 {
                r = r_hi as usize;
            }
            #[unroll]
            for e in 0..2usize {
                t_out[r * 16 + 8 * dt + c_lo as usize + e] = pair[e];
            }
        }
    }
}

/// Runs the Mma fragment helpers on 16x16 bf16/f16 matrices `a`, `k`, `v` (contiguous,
/// `[16, 16]`) and returns `(s, o, t, pos)`: `s = a k^T`, `o = s v` and `t = s^T v` in f32
/// (with `s` rounded to the input dtype first, as `P` and `dS` are in the kernels; `t` goes
/// through shared memory and transposed `ldmatrix` as the fused backward's `dQ = dS K` does),
/// and `pos [32, 3]` (u32): per lane, the row
/// of its accumulator elements 0/1, the row of elements 2/3, and the column of element 0, as
/// CubeCL's `position_of_nth` reports them (expected `lane / 4`, `lane / 4 + 8`,
/// `2 (lane % 4)`, which the row reductions rely on). With small integer inputs every value is
/// exact, so any difference from the host product means a fragment-layout assumption is wrong.
pub fn mma_fragment_probe<R: CubeRuntime>(
    a: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    for (name, t) in [("a", &a), ("k", &k), ("v", &v)] {
        let shape = t.meta.shape();
        assert!(
            shape.num_dims() == 2 && shape[0] == 16 && shape[1] == 16 && t.is_contiguous(),
            "mma_fragment_probe: {name} must be a contiguous [16, 16] tensor, got {shape:?}"
        );
    }
    assert!(
        mma_supported(&a.client, a.dtype),
        "mma_fragment_probe: no m16n8k16 mma/ldmatrix for {:?} on this device",
        a.dtype
    );
    let client = a.client.clone();
    let device = a.device.clone();
    let dtype = a.dtype;
    let out = || {
        empty_device_contiguous_dtype::<R>(
            client.clone(),
            device.clone(),
            [16usize, 16].into(),
            DType::F32,
        )
    };
    let (s, o, t) = (out(), out(), out());
    let pos = empty_device_contiguous_dtype::<R>(
        client.clone(),
        device.clone(),
        [32usize, 3].into(),
        DType::U32,
    );
    // SAFETY: fixed 16x16 shapes checked above; one warp.
    unsafe {
        mma_probe_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(32),
            1,
            a.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            s.clone().into_tensor_arg(),
            o.clone().into_tensor_arg(),
            t.clone().into_tensor_arg(),
            pos.clone().into_tensor_arg(),
            dtype.into(),
        );
    }
    (s, o, t, pos)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `SMP_BURN_FLASH_MMA_BWD_TILING` and `flash_check --mma-bwd-tiling` take the printed
    /// names, so every listed tiling must read back as itself.
    #[test]
    fn backward_tiling_names_round_trip() {
        for tiling in MmaBwdTiling::ALL {
            assert_eq!(MmaBwdTiling::parse(&tiling.to_string()), Some(tiling));
        }
        let fused = MmaBwdTiling::parse("8x64-atomic-cp-vd").expect("listed");
        assert_eq!(
            (fused.dq, fused.pipe, fused.wide_delta),
            (MmaDq::Atomic, MmaBwdPipe::Async, true)
        );
        assert_eq!(MmaBwdTiling::parse("8x64-atomic-vd-cp"), None);
        assert_eq!(MmaBwdTiling::parse("2x64-split"), None);
        let grid = MmaBwdTiling::parse("8x64-atomic-cp-vd-wg").expect("listed");
        assert!(grid.warp_grid && !fused.warp_grid);
        assert_eq!(grid.to_string(), "8x64-atomic-cp-vd-wg");
        // The warp grid exists only with the fused dQ and cp.async.
        assert_eq!(MmaBwdTiling::parse("8x64-split-cp-vd-wg"), None);
        assert_eq!(MmaBwdTiling::parse("8x64-atomic-wg"), None);
    }

    /// The bulk dQ runs only where supported, and only for the tilings whose warps own whole
    /// chunks: the defaults of both head dims, not the split ones.
    #[test]
    fn bulk_dq_only_for_whole_chunk_tilings() {
        for tiling in MmaBwdTiling::ALL {
            assert!(!bulk_dq_used(tiling, false), "{tiling}");
        }
        assert!(bulk_dq_used(MmaBwdTiling::DEFAULT_HD128, true));
        assert!(bulk_dq_used(MmaBwdTiling::DEFAULT_HD64, true));
        assert!(!bulk_dq_used(MmaBwdTiling::DEFAULT, true));
        let split = MmaBwdTiling::parse("4x64-split-cp-vd").expect("listed");
        assert!(!bulk_dq_used(split, true));
    }

    /// Where the workspace vendors cubecl-ir, smp-burn must have been built against it (its
    /// `[patch.crates-io]` entry): otherwise the flash backward falls back to the f32-pair
    /// atomics (4-6 % slower, session 16, call FJ) and the hd-128 forward to `mma.sync`
    /// (20-30 % slower, session 18, call GD) without a word.
    #[test]
    fn workspace_build_has_the_bulk_reduction_and_wgmma() {
        let vendored = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../vendor/cubecl-ir")
            .is_dir();
        assert!(
            !vendored || (BULK_REDUCE_BUILT && WGMMA_BUILT),
            "vendor/cubecl-ir exists but smp-burn was built against another cubecl-ir (is its \
             [patch.crates-io] entry in the workspace Cargo.toml?)"
        );
    }

    /// The slack bounds the stale-maximum probabilities by `exp(slack)`, so only values that
    /// keep them far inside f32 pass; anything else must be refused, not clamped.
    #[test]
    fn rescale_slack_reads_only_safe_values() {
        assert_eq!(parse_slack("0"), Some(0.0));
        assert_eq!(parse_slack(" 5.5 "), Some(5.5));
        assert_eq!(parse_slack("20"), Some(20.0));
        for bad in ["-1", "20.5", "inf", "NaN", "eight", ""] {
            assert_eq!(parse_slack(bad), None, "{bad:?}");
        }
        assert!(
            DEFAULT_RESCALE_SLACK.exp() * 65_536.0 * 1e4 < f32::MAX,
            "a row of 64k keys at the default slack must stay finite"
        );
    }

    #[test]
    fn forward_tiling_names_round_trip() {
        for tiling in MmaTiling::ALL {
            assert_eq!(MmaTiling::parse(&tiling.to_string()), Some(tiling));
        }
        let short = MmaTiling::parse("4x2-cp-k32").expect("listed");
        assert_eq!((short.warps, short.m_tiles, short.keys), (4, 2, 32));
        assert!(short.cp_async);
        // 32-key blocks exist only with the cp.async pipeline.
        assert_eq!(MmaTiling::parse("4x2-k32"), None);
        assert_eq!(MmaTiling::parse("4x2-cp-k16"), None);
        // The warpgroup kernels exist in one shape each.
        assert_eq!(
            MmaTiling::parse("8x1-wgd"),
            Some(MmaTiling::WGMMA_DECOUPLED)
        );
        assert_eq!(MmaTiling::parse("4x1-wg"), None);
        assert_eq!(MmaTiling::parse("8x1-cp-wg"), None);
    }

    /// The forward's default follows the head dim and whether `wgmma` runs (call GD): the
    /// warpgroup kernel only at head dim 128, where it is 20-30 % faster.
    #[test]
    fn forward_default_by_head_dim_and_device() {
        assert_eq!(MmaTiling::default_for(64, true), MmaTiling::DEFAULT_HD64);
        assert_eq!(MmaTiling::default_for(64, false), MmaTiling::DEFAULT_HD64);
        assert_eq!(
            MmaTiling::default_for(128, true),
            MmaTiling::WGMMA_DECOUPLED
        );
        assert_eq!(MmaTiling::default_for(128, false), MmaTiling::DEFAULT);
        assert_eq!(MmaTiling::default_for(96, true), MmaTiling::DEFAULT);
        assert_eq!(MmaTiling::WGMMA_DECOUPLED.rows(), WGMMA_ROWS);
    }

    /// The backward's default follows the head dim and the device (calls DV, GL), and the
    /// determinism switch reads only clear values.
    #[test]
    fn backward_default_by_head_dim_and_device() {
        if std::env::var_os("SMP_BURN_DETERMINISTIC").is_some() {
            return;
        }
        // (head dim, pair atomics, wgmma backward) -> default.
        for (head_dim, pair_atomics, wgmma, expected) in [
            (128, true, true, MmaBwdTiling::WGMMA),
            (128, true, false, MmaBwdTiling::DEFAULT_HD128),
            (128, false, true, MmaBwdTiling::DEFAULT),
            (128, false, false, MmaBwdTiling::DEFAULT),
            (256, true, true, MmaBwdTiling::DEFAULT_HD128),
            (64, true, true, MmaBwdTiling::DEFAULT_HD64),
            (64, true, false, MmaBwdTiling::DEFAULT_HD64),
            (64, false, false, MmaBwdTiling::DEFAULT),
            (96, true, true, MmaBwdTiling::DEFAULT),
        ] {
            assert_eq!(
                MmaBwdTiling::default_for(head_dim, pair_atomics, wgmma),
                expected,
                "head dim {head_dim}, pair atomics {pair_atomics}, wgmma {wgmma}"
            );
        }
        assert_eq!(MmaBwdTiling::DEFAULT_HD128.dq, MmaDq::Atomic);
        assert_eq!(MmaBwdTiling::DEFAULT.dq, MmaDq::Split);
        for (value, parsed) in [
            ("1", Some(true)),
            (" TRUE ", Some(true)),
            ("0", Some(false)),
            ("", Some(false)),
            ("false", Some(false)),
            ("yes", None),
            ("2", None),
        ] {
            assert_eq!(parse_switch(value), parsed, "{value:?}");
        }
    }

    /// Every atomic tiling splits its fused dQ into whole warps' slices of an even number of
    /// n-tiles at both head dims, with two m-tiles where call EA measured them (8x64, hd 128).
    #[test]
    fn fused_dq_slices_fit_every_atomic_tiling() {
        assert_eq!(dq_m_tiles_for(8, 64, 128), 2);
        assert_eq!(dq_m_tiles_for(8, 32, 64), 1);
        for t in MmaBwdTiling::ALL.iter().filter(|t| t.dq == MmaDq::Atomic) {
            for d in [64, 128] {
                let mt = dq_m_tiles_for(t.warps, t.inner, d);
                let groups = t.inner / (16 * mt);
                assert_eq!(t.warps % groups, 0, "{t} d {d}");
                let cols = d / (t.warps / groups);
                assert_eq!(cols % 16, 0, "{t} d {d}: {cols} columns per warp");
            }
        }
    }
}
