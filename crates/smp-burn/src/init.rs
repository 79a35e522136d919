//! Counter-based parameter initialization.
//!
//! Every value is a pure function of `(seed, parameter name, flat index)`, so any slice of a
//! parameter can be produced without producing the rest. That is what lets each rank build only
//! its own shard (SMP's delayed parameter initialization) and still get exactly the values an
//! unsharded model from the same seed would have.

use std::ops::Range;

/// How a parameter's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum InitRule {
    /// Normal with mean 0 and the given standard deviation (Llama's linear and embedding init).
    Normal {
        /// Standard deviation.
        std: f32,
    },
    /// A constant (RMSNorm weights start at 1).
    Constant(f32),
}

/// The constants of SplitMix64, shared with the device kernel ([`crate::cuda::init`]), which
/// takes them as arguments: CUDA C++ reads an unsuffixed decimal literal above `i64::MAX` as
/// an error or a signed value, depending on the compiler.
pub(crate) const SPLITMIX_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
pub(crate) const SPLITMIX_MUL1: u64 = 0xBF58_476D_1CE4_E5B9;
pub(crate) const SPLITMIX_MUL2: u64 = 0x94D0_49BB_1331_11EB;
/// An element's counter is its index times this odd constant (a Weyl sequence), so that nearby
/// indices of nearby keys do not collide.
pub(crate) const COUNTER_STRIDE: u64 = 0xD1B5_4A32_D192_ED03;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(SPLITMIX_GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(SPLITMIX_MUL1);
    z = (z ^ (z >> 27)).wrapping_mul(SPLITMIX_MUL2);
    z ^ (z >> 31)
}

/// A stable 64-bit key for a parameter name (FNV-1a), independent of Rust's randomized hasher.
fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Uniform in (0, 1], from the top 24 bits so the result is exact in f32.
fn unit(bits: u64) -> f32 {
    ((bits >> 40) as f32 + 1.0) / (1u64 << 24) as f32
}

/// The key of parameter `name`'s normal draw under `seed`: [`init_values`] of a
/// [`InitRule::Normal`] parameter is [`normal_values`] of this key.
pub fn normal_key(seed: u64, name: &str) -> u64 {
    splitmix64(seed ^ splitmix64(name_key(name)))
}

/// Element `i` of the standard normal draw with key `key`: Box-Muller on two independent
/// draws of the element's own counter.
fn standard_normal(key: u64, i: u64) -> f32 {
    let r = splitmix64(key ^ i.wrapping_mul(COUNTER_STRIDE));
    let u1 = unit(r);
    let u2 = unit(splitmix64(r));
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

/// The values of elements `range` (flat, row-major) of parameter `name` under `rule`.
pub fn init_values(seed: u64, name: &str, rule: InitRule, range: Range<usize>) -> Vec<f32> {
    match rule {
        InitRule::Constant(c) => vec![c; range.len()],
        InitRule::Normal { std } => normal_values(normal_key(seed, name), std, range),
    }
}

/// Elements `range` of the normal draw with key `key` ([`normal_key`]) and standard deviation
/// `std`.
///
/// Large ranges are drawn on all cores: a 1.2B-parameter model takes about a minute on one
/// core (a logarithm, a square root and a cosine per value), and every rank pays it at start-up.
pub fn normal_values(key: u64, std: f32, range: Range<usize>) -> Vec<f32> {
    let draw = |i: usize| standard_normal(key, i as u64) * std;
    const PARALLEL_FROM: usize = 1 << 20;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if range.len() < PARALLEL_FROM || threads == 1 {
        return range.map(draw).collect();
    }
    let mut out = vec![0.0f32; range.len()];
    let chunk = range.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (c, part) in out.chunks_mut(chunk).enumerate() {
            let start = range.start + c * chunk;
            s.spawn(move || {
                for (j, v) in part.iter_mut().enumerate() {
                    *v = draw(start + j);
                }
            });
        }
    });
    out
}

/// A parameter slice's initial values as an initializer gives them: drawn (or read) on the
/// host, or a normal draw described by its key, which a GPU can draw where the values are
/// needed (Llama 2 7B's 6.7 billion draws take minutes on a host's cores and milliseconds on
/// the GPU).
#[derive(Debug, Clone, PartialEq)]
pub enum InitSlice {
    /// The values themselves.
    Values(Vec<f32>),
    /// [`normal_values`]`(key, std, start..start + n)` for a slice of `n` elements: `start`
    /// is where the slice begins in the whole parameter (a tensor-parallel rank's slice starts
    /// past the other ranks').
    Normal {
        /// [`normal_key`] of the parameter.
        key: u64,
        /// Standard deviation.
        std: f32,
        /// Index of the slice's first element in the whole parameter's draw.
        start: usize,
    },
}

impl From<Vec<f32>> for InitSlice {
    fn from(values: Vec<f32>) -> Self {
        InitSlice::Values(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_agree_with_the_whole() {
        let rule = InitRule::Normal { std: 0.02 };
        let whole = init_values(7, "model.layers.0.mlp.up_proj.weight", rule, 0..1000);
        let part = init_values(7, "model.layers.0.mlp.up_proj.weight", rule, 300..700);
        assert_eq!(&whole[300..700], part.as_slice());
    }

    #[test]
    fn parallel_draw_matches_piecewise_serial_draws() {
        // 3M values take the multi-threaded path; the serial path draws each small slice.
        let rule = InitRule::Normal { std: 1.0 };
        let name = "model.embed_tokens.weight";
        let big = init_values(3, name, rule, 5..3_000_005);
        for start in [5usize, 1_234_567, 2_999_000] {
            let small = init_values(3, name, rule, start..start + 1000);
            assert_eq!(&big[start - 5..start - 5 + 1000], small.as_slice());
        }
    }

    #[test]
    fn statistics_and_independence() {
        let rule = InitRule::Normal { std: 0.02 };
        let v = init_values(1, "w", rule, 0..200_000);
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        assert!(mean.abs() < 2e-4, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 2e-4, "std {}", var.sqrt());
        assert_ne!(
            init_values(1, "w", rule, 0..8),
            init_values(1, "v", rule, 0..8)
        );
        assert_ne!(
            init_values(1, "w", rule, 0..8),
            init_values(2, "w", rule, 0..8)
        );
    }
}
