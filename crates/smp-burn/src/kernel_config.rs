//! Every kernel tunable in one typed value: which fast paths run, whether the kernels must be
//! bitwise reproducible, which flash-attention tiling runs, where compiled kernels are cached.
//!
//! The defaults are chosen by the device at each launch (a tiling left at `None` means "the
//! fastest this device and head dim run"), so most programs never touch this. A program sets it
//! with [`KernelConfig::install`]; a user without code access sets it through one environment
//! variable, [`KERNELS_ENV`], read once when nothing was installed:
//!
//! ```text
//! SMP_BURN_KERNELS="deterministic,fast=gemm+attention,flash_forward=mma-8x2,cache_dir=/tmp/k"
//! SMP_BURN_KERNELS="fp8=tensorwise"
//! ```
//!
//! Items are separated by commas; `fast` takes `all`, `none` or fast-path names joined by `+`
//! ([`FastPaths::parse`]); an unknown item or value is an error that names it.

use std::path::PathBuf;
use std::sync::RwLock;

use serde::Deserialize;

use std::sync::atomic::{AtomicU8, AtomicU16, Ordering};

use crate::error::SmpError;
use crate::fp8::Fp8Recipe;

/// The environment variable [`KernelConfig::from_env`] reads.
pub const KERNELS_ENV: &str = "SMP_BURN_KERNELS";

/// The flash-attention forward kernel and its tiling.
///
/// Each is the default somewhere: [`FlashForward::Wgmma`] at head dim 64 and 128 on sm_90
/// (Hopper's warpgroup MMA), [`FlashForward::Mma8x2`] at head dim 128 elsewhere (sm_80 and
/// later), [`FlashForward::Mma4x2`] at head dim 64 elsewhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlashForward {
    /// `mma.sync`, 8 warps of 2 x 16 query rows, K/V double-buffered by `cp.async`.
    Mma8x2,
    /// `mma.sync`, 4 warps of 2 x 16 query rows, K/V double-buffered by `cp.async`.
    Mma4x2,
    /// Warpgroup MMA (sm_90): two decoupled warpgroups of 64 query rows, 128-key blocks.
    Wgmma,
}

impl FlashForward {
    /// Every forward kernel, in [`Self::name`] order.
    pub const ALL: [FlashForward; 3] = [Self::Mma8x2, Self::Mma4x2, Self::Wgmma];

    /// The name [`Self::parse`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Mma8x2 => "mma-8x2",
            Self::Mma4x2 => "mma-4x2",
            Self::Wgmma => "wgmma",
        }
    }

    /// Parses [`Self::name`]'s output.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == s.trim())
    }
}

/// The flash-attention backward kernels and their tiling.
///
/// [`FlashBackward::Split`] is the only deterministic one (dQ by its own kernel, no atomics):
/// the default where determinism is asked for and on devices without f32-pair atomics (sm_80).
/// The others add dQ with atomics, as FlashAttention-2 does: [`FlashBackward::Wgmma`] at head
/// dim 128 on sm_90, [`FlashBackward::AtomicGrid`] at head dim 128 on sm_90 builds without
/// the vendored CubeCL's warpgroup MMA, [`FlashBackward::Atomic`] at head dim 64.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlashBackward {
    /// 4 warps of 16 keys, 64-query blocks, dQ by a separate kernel: deterministic.
    Split,
    /// 8 warps of 16 keys, 64-query blocks, dQ fused by f32-pair atomics.
    Atomic,
    /// As [`FlashBackward::Atomic`] with FlashAttention-2's warp grid (32 keys by half the
    /// queries per warp), which reads fewer shared-memory tiles.
    AtomicGrid,
    /// Warpgroup MMA (sm_90): two warpgroups of 64 keys, dQ by bulk reductions.
    Wgmma,
}

impl FlashBackward {
    /// Every backward kernel, in [`Self::name`] order.
    pub const ALL: [FlashBackward; 4] = [Self::Split, Self::Atomic, Self::AtomicGrid, Self::Wgmma];

    /// The name [`Self::parse`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Split => "split",
            Self::Atomic => "atomic",
            Self::AtomicGrid => "atomic-grid",
            Self::Wgmma => "wgmma",
        }
    }

    /// Parses [`Self::name`]'s output.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == s.trim())
    }

    /// Whether two runs give the same dQ bit for bit.
    pub fn deterministic(self) -> bool {
        self == Self::Split
    }
}

/// Which fast paths are on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastPaths {
    /// Linear layers through cuBLAS.
    pub gemm: bool,
    /// Causal attention through the flash kernels (bf16/f16, head dim 64 or 128).
    pub attention: bool,
    /// RMSNorm through the fused kernels (forward and backward).
    pub norm: bool,
    /// Rotary embeddings through the fused kernels.
    pub rope: bool,
    /// The SwiGLU gate through the fused kernels.
    pub swiglu: bool,
    /// `ops::linear_cross_entropy` through the chunked LM-head loss (CUDA and NdArray).
    pub loss: bool,
    /// FSDP's AdamW step as one kernel per shard run ([`crate::cuda::adamw`]).
    pub adamw: bool,
    /// FSDP's gradients packed into the flat buffer by one cast-and-copy kernel per parameter
    /// ([`crate::cuda::flat`]) instead of a cast and a `cat`.
    pub flat: bool,
    /// The LM-head loss's softmax statistics and logit gradient through the fused kernels of
    /// [`crate::cuda::xent`] (inside the chunked loss, on CUDA).
    pub xent: bool,
    /// The token embedding's gradient through one deterministic kernel
    /// ([`crate::cuda::embedding`]) instead of Burn's `select_assign`, which ran one thread per
    /// column over every token (1.6 ms per 1.2B-model step on an H200).
    pub embed: bool,
    /// Gradients that meet at one tensor (an input shared by q/k/v or by gate/up, the residual
    /// stream at each norm) are summed by the op whose backward runs second, in its own output
    /// pass (cuBLAS `beta = 1`, the RMSNorm backward kernel) instead of a separate add of Burn's
    /// autodiff (`cuda::accumulate`). Over the micro-batches of an accumulation step, a weight's
    /// gradient GEMM also adds straight into FSDP's f32 gradient sum (Megatron's
    /// gradient-accumulation fusion) instead of writing a gradient that is added after.
    pub accumulate: bool,
    /// Seeded normal initialization drawn on the GPU by one kernel per parameter slice
    /// ([`crate::cuda::init`]), the same counter-based formula as [`crate::init::init_values`],
    /// instead of on the host and copied over (over two minutes for Llama 2 7B).
    pub init: bool,
}

/// The path names [`FastPaths::parse`] accepts, in bit order.
const NAMES: [&str; 12] = [
    "gemm",
    "attention",
    "norm",
    "rope",
    "swiglu",
    "loss",
    "adamw",
    "flat",
    "xent",
    "embed",
    "accumulate",
    "init",
];

impl FastPaths {
    /// Every fast path on.
    pub const ALL: Self = Self {
        gemm: true,
        attention: true,
        norm: true,
        rope: true,
        swiglu: true,
        loss: true,
        adamw: true,
        flat: true,
        xent: true,
        embed: true,
        accumulate: true,
        init: true,
    };
    /// Only the reference ops.
    pub const NONE: Self = Self {
        gemm: false,
        attention: false,
        norm: false,
        rope: false,
        swiglu: false,
        loss: false,
        adamw: false,
        flat: false,
        xent: false,
        embed: false,
        accumulate: false,
        init: false,
    };

    /// Parses `all`, `none` or a comma list of path names (`gemm`, `attention`, `norm`,
    /// `rope`, `swiglu`, `loss`, `adamw`, `flat`, `xent`, `embed`, `accumulate`, `init`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "" | "all" => return Ok(Self::ALL),
            "none" => return Ok(Self::NONE),
            _ => {}
        }
        let mut p = Self::NONE;
        for name in s.split(',').map(str::trim) {
            let flag = match name {
                "gemm" => &mut p.gemm,
                "attention" => &mut p.attention,
                "norm" => &mut p.norm,
                "rope" => &mut p.rope,
                "swiglu" => &mut p.swiglu,
                "loss" => &mut p.loss,
                "adamw" => &mut p.adamw,
                "flat" => &mut p.flat,
                "xent" => &mut p.xent,
                "embed" => &mut p.embed,
                "accumulate" => &mut p.accumulate,
                "init" => &mut p.init,
                other => {
                    return Err(format!(
                        "unknown fast path {other:?} (known: {}; or all / none)",
                        NAMES.join(", ")
                    ));
                }
            };
            *flag = true;
        }
        Ok(p)
    }

    fn flags(self) -> [bool; 12] {
        [
            self.gemm,
            self.attention,
            self.norm,
            self.rope,
            self.swiglu,
            self.loss,
            self.adamw,
            self.flat,
            self.xent,
            self.embed,
            self.accumulate,
            self.init,
        ]
    }

    /// Bit 0 marks "set"; bit `i + 1` is flag `i` of [`Self::flags`].
    fn bits(self) -> u16 {
        self.flags()
            .iter()
            .enumerate()
            .fold(1, |b, (i, &on)| b | (on as u16) << (i + 1))
    }

    fn from_bits(b: u16) -> Self {
        let on = |i: usize| b & (1 << (i + 1)) != 0;
        Self {
            gemm: on(0),
            attention: on(1),
            norm: on(2),
            rope: on(3),
            swiglu: on(4),
            loss: on(5),
            adamw: on(6),
            flat: on(7),
            xent: on(8),
            embed: on(9),
            accumulate: on(10),
            init: on(11),
        }
    }
}

/// [`KernelConfig::fast_paths`] as bits, read on every op
/// without a lock; 0 = not yet read.
static FLAGS: AtomicU16 = AtomicU16::new(0);

/// The fast paths in force: [`KernelConfig::current`]'s, without taking its lock.
pub fn fast_paths() -> FastPaths {
    let b = FLAGS.load(Ordering::Relaxed);
    if b != 0 {
        return FastPaths::from_bits(b);
    }
    KernelConfig::current().fast_paths
}

/// [`KernelConfig::fp8`] as its index in [`Fp8Recipe::ALL`] plus one; 0 = not yet read.
static FP8: AtomicU8 = AtomicU8::new(0);

/// The FP8 recipe in force: [`KernelConfig::current`]'s, without taking its lock.
pub fn fp8_recipe() -> Fp8Recipe {
    match FP8.load(Ordering::Relaxed) {
        0 => KernelConfig::current().fp8,
        i => Fp8Recipe::ALL[usize::from(i) - 1],
    }
}

/// Called whenever the configuration in force changes.
fn cache_fast_paths(c: &KernelConfig) {
    FLAGS.store(c.fast_paths.bits(), Ordering::Relaxed);
    let fp8 = Fp8Recipe::ALL.iter().position(|r| *r == c.fp8).unwrap_or(0);
    FP8.store(fp8 as u8 + 1, Ordering::Relaxed);
}

/// Every kernel tunable; see the [module documentation](self).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(try_from = "KernelConfigToml")]
pub struct KernelConfig {
    /// Which fast paths replace Burn's reference ops on CUDA (all by default).
    pub fast_paths: FastPaths,
    /// Bitwise reproducible kernels: the attention backward takes [`FlashBackward::Split`].
    /// Every other kernel is deterministic anyway.
    pub deterministic: bool,
    /// The flash forward; `None`: the fastest for the device and head dim.
    pub flash_forward: Option<FlashForward>,
    /// The flash backward; `None`: the fastest for the device and head dim (deterministic when
    /// [`Self::deterministic`] is set).
    pub flash_backward: Option<FlashBackward>,
    /// Where compiled kernels are cached; `None`: `$XDG_CACHE_HOME/smp-burn/cubecl`, else
    /// `$HOME/.cache/smp-burn/cubecl`.
    pub cache_dir: Option<PathBuf>,
    /// The FP8 recipe of the parallel linear layers ([`crate::fp8`]); off by default.
    pub fp8: Fp8Recipe,
}

impl Default for KernelConfig {
    fn default() -> Self {
        Self {
            fast_paths: FastPaths::ALL,
            deterministic: false,
            flash_forward: None,
            flash_backward: None,
            cache_dir: None,
            fp8: Fp8Recipe::Off,
        }
    }
}

/// The TOML form: the same keys as [`KERNELS_ENV`]'s items (`fast = "gemm+attention"`).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct KernelConfigToml {
    fast: Option<String>,
    deterministic: bool,
    flash_forward: Option<String>,
    flash_backward: Option<String>,
    cache_dir: Option<PathBuf>,
    fp8: Option<String>,
}

impl TryFrom<KernelConfigToml> for KernelConfig {
    type Error = SmpError;

    fn try_from(t: KernelConfigToml) -> Result<Self, SmpError> {
        let mut c = KernelConfig {
            deterministic: t.deterministic,
            cache_dir: t.cache_dir,
            ..Default::default()
        };
        if let Some(fast) = t.fast {
            c.set("fast", &fast)?;
        }
        if let Some(f) = t.flash_forward {
            c.set("flash_forward", &f)?;
        }
        if let Some(b) = t.flash_backward {
            c.set("flash_backward", &b)?;
        }
        if let Some(r) = t.fp8 {
            c.set("fp8", &r)?;
        }
        c.validate()?;
        Ok(c)
    }
}

/// The installed configuration; `None` until [`KernelConfig::install`] or the first read.
static CURRENT: RwLock<Option<KernelConfig>> = RwLock::new(None);

impl KernelConfig {
    /// The defaults with [`KERNELS_ENV`]'s items applied (the defaults where it is unset).
    pub fn from_env() -> Result<Self, SmpError> {
        match std::env::var(KERNELS_ENV) {
            Ok(spec) => Self::parse(&spec).map_err(|e| {
                SmpError::Config(format!("{KERNELS_ENV}={spec:?}: {}", strip_prefix(&e)))
            }),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(e) => Err(SmpError::Config(format!("{KERNELS_ENV}: {e}"))),
        }
    }

    /// The defaults with the comma-separated items of `spec` applied: `deterministic` (or
    /// `deterministic=false`), `fast=all|none|name+name..`, `flash_forward=NAME`,
    /// `flash_backward=NAME`, `cache_dir=PATH`, `fp8=off|tensorwise`.
    pub fn parse(spec: &str) -> Result<Self, SmpError> {
        let mut c = Self::default();
        for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (key, value) = match item.split_once('=') {
                Some((k, v)) => (k.trim(), v.trim()),
                None => (item, "true"),
            };
            c.set(key, value)?;
        }
        c.validate()?;
        Ok(c)
    }

    /// Sets one item by its [`Self::parse`] key.
    fn set(&mut self, key: &str, value: &str) -> Result<(), SmpError> {
        let bad =
            |expected: String| SmpError::Config(format!("{key}={value:?}: expected {expected}"));
        match key {
            "deterministic" => {
                self.deterministic = match value.to_ascii_lowercase().as_str() {
                    "1" | "true" => true,
                    "0" | "false" => false,
                    _ => return Err(bad("true or false".into())),
                }
            }
            "fast" => {
                self.fast_paths =
                    FastPaths::parse(&value.replace('+', ",")).map_err(|e| bad(e.to_string()))?
            }
            "flash_forward" => {
                self.flash_forward = Some(
                    FlashForward::parse(value)
                        .ok_or_else(|| bad(one_of(FlashForward::ALL.iter().map(|t| t.name()))))?,
                )
            }
            "flash_backward" => {
                self.flash_backward = Some(
                    FlashBackward::parse(value)
                        .ok_or_else(|| bad(one_of(FlashBackward::ALL.iter().map(|t| t.name()))))?,
                )
            }
            "cache_dir" if !value.is_empty() => self.cache_dir = Some(PathBuf::from(value)),
            "cache_dir" => return Err(bad("a directory".into())),
            "fp8" => {
                self.fp8 = Fp8Recipe::parse(value)
                    .ok_or_else(|| bad(one_of(Fp8Recipe::ALL.iter().map(|r| r.name()))))?
            }
            other => {
                return Err(SmpError::Config(format!(
                    "unknown kernel setting {other:?} (known: deterministic, fast, \
                     flash_forward, flash_backward, cache_dir, fp8)"
                )));
            }
        }
        Ok(())
    }

    /// Refuses settings that contradict each other.
    pub fn validate(&self) -> Result<(), SmpError> {
        match self.flash_backward {
            Some(b) if self.deterministic && !b.deterministic() => Err(SmpError::Config(format!(
                "deterministic kernels with flash_backward={}: only {} is deterministic",
                b.name(),
                FlashBackward::Split.name()
            ))),
            _ => Ok(()),
        }
    }

    /// Makes this the configuration of every later kernel launch in the process. Kernels
    /// already compiled stay cached; `cache_dir` only takes effect before the first CUDA
    /// tensor is created.
    pub fn install(self) -> Result<(), SmpError> {
        self.validate()?;
        cache_fast_paths(&self);
        *CURRENT.write().unwrap_or_else(|e| e.into_inner()) = Some(self);
        Ok(())
    }

    /// The configuration in force: the last [`Self::install`]ed, else [`Self::from_env`]
    /// (read once).
    ///
    /// # Panics
    /// If nothing was installed and [`KERNELS_ENV`] is malformed: a program that wants an
    /// error instead calls [`Self::from_env`] and installs the result before its first kernel,
    /// as the trainer does. A silent fallback would run other kernels than the user asked for.
    pub fn current() -> KernelConfig {
        if let Some(c) = CURRENT.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
            return c.clone();
        }
        let mut slot = CURRENT.write().unwrap_or_else(|e| e.into_inner());
        let c = slot.get_or_insert_with(|| Self::from_env().unwrap_or_else(|e| panic!("{e}")));
        cache_fast_paths(c);
        c.clone()
    }

    /// Changes the configuration in force through `f` (for a program that sets one knob, such
    /// as a benchmark switching fast paths between measurements).
    pub fn update(f: impl FnOnce(&mut KernelConfig)) -> Result<(), SmpError> {
        let mut c = Self::current();
        f(&mut c);
        c.install()
    }
}

/// "one of a, b or c".
fn one_of<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let names: Vec<_> = names.collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("one of {} or {last}", rest.join(", ")),
        Some((last, _)) => (*last).to_string(),
        None => String::new(),
    }
}

/// An [`SmpError::Config`]'s message without its "invalid parallel configuration" prefix.
fn strip_prefix(e: &SmpError) -> String {
    match e {
        SmpError::Config(m) => m.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_switches() {
        assert_eq!(FastPaths::parse("all").unwrap(), FastPaths::ALL);
        assert_eq!(FastPaths::parse("none").unwrap(), FastPaths::NONE);
        assert_eq!(
            FastPaths::parse(
                "gemm, attention,norm,rope,swiglu,loss,adamw,flat,xent,embed,accumulate,init"
            )
            .unwrap(),
            FastPaths::ALL
        );
        let only_gemm = FastPaths::parse("gemm").unwrap();
        assert!(only_gemm.gemm && !only_gemm.attention && !only_gemm.loss);
        assert_eq!(FastPaths::from_bits(only_gemm.bits()), only_gemm);
        let some = FastPaths::parse("norm,loss").unwrap();
        assert_eq!(
            some,
            FastPaths {
                norm: true,
                loss: true,
                ..FastPaths::NONE
            }
        );
        // Every single switch survives the round trip through the atomic's bits.
        for name in NAMES {
            let p = FastPaths::parse(name).unwrap();
            assert_eq!(p.flags().iter().filter(|&&on| on).count(), 1, "{name}");
            assert_eq!(FastPaths::from_bits(p.bits()), p, "{name}");
        }
        for p in [FastPaths::ALL, FastPaths::NONE] {
            assert_eq!(FastPaths::from_bits(p.bits()), p);
        }
        let e = FastPaths::parse("gemm,flash2").unwrap_err();
        assert!(e.contains("flash2") && e.contains("swiglu"), "{e}");
    }

    #[test]
    fn parses_every_item() {
        let c = KernelConfig::parse(
            "deterministic, fast=gemm+attention, flash_forward=mma-4x2, \
             flash_backward=split, cache_dir=/tmp/k, fp8=tensorwise",
        )
        .unwrap();
        assert!(c.deterministic);
        assert!(c.fast_paths.gemm && c.fast_paths.attention && !c.fast_paths.norm);
        assert_eq!(c.flash_forward, Some(FlashForward::Mma4x2));
        assert_eq!(c.flash_backward, Some(FlashBackward::Split));
        assert_eq!(c.cache_dir, Some(PathBuf::from("/tmp/k")));
        assert_eq!(c.fp8, Fp8Recipe::Tensorwise);
        assert_eq!(KernelConfig::parse("").unwrap(), KernelConfig::default());
        for t in FlashForward::ALL {
            assert_eq!(FlashForward::parse(t.name()), Some(t));
        }
        for t in FlashBackward::ALL {
            assert_eq!(FlashBackward::parse(t.name()), Some(t));
        }
    }

    #[test]
    fn bad_items_are_named() {
        let msg = |s: &str| KernelConfig::parse(s).unwrap_err().to_string();
        let e = msg("flash_forward=8x2");
        assert!(e.contains("\"8x2\"") && e.contains("mma-8x2"), "{e}");
        let e = msg("fast=gemm+flash2");
        assert!(e.contains("flash2"), "{e}");
        let e = msg("determinstic");
        assert!(
            e.contains("determinstic") && e.contains("deterministic"),
            "{e}"
        );
        let e = msg("fp8=e4m3");
        assert!(e.contains("e4m3") && e.contains("tensorwise"), "{e}");
        let e = msg("deterministic=maybe");
        assert!(e.contains("maybe"), "{e}");
        let e = msg("deterministic,flash_backward=atomic");
        assert!(e.contains("atomic") && e.contains("split"), "{e}");
    }

    #[test]
    fn toml_form_uses_the_same_keys() {
        let c: KernelConfig =
            toml::from_str("deterministic = true\nfast = \"none\"\nflash_forward = \"wgmma\"")
                .unwrap();
        assert!(c.deterministic && c.fast_paths == FastPaths::NONE);
        assert_eq!(c.flash_forward, Some(FlashForward::Wgmma));
        let e = toml::from_str::<KernelConfig>("fsat = \"none\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("fsat"), "{e}");
        let e = toml::from_str::<KernelConfig>("flash_backward = \"grid\"").unwrap_err();
        assert!(e.to_string().contains("grid"), "{e}");
    }
}
