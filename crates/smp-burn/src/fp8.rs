//! FP8 training of linear layers: the recipes, the two formats and their rounding, and the
//! scaling rules that the CUDA kernels ([`crate::cuda::fp8`]) implement on the device.
//!
//! With a recipe on, the linear layers of [`crate::tp::layers`] (a transformer block's
//! projections) compute their three GEMMs in FP8 on Hopper and Ada GPUs, as Transformer Engine
//! does: activations and weights in E4M3, gradients in E5M2, each tensor scaled so that its
//! largest magnitude lands on the format's largest finite value, fp32 accumulation, outputs in
//! the compute dtype (bf16). Master weights, the optimizer, the embedding and the LM head are
//! untouched. The Rust functions here are the reference the kernels are checked against.

use std::collections::VecDeque;

/// How FP8 linear layers choose their scales.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Fp8Recipe {
    /// No FP8: linear layers compute in the compute dtype.
    #[default]
    Off,
    /// Current scaling: each tensor's scale comes from its own amax, read by a pass over it
    /// just before the cast (torchao's default float8 recipe, TE's `Float8CurrentScaling`).
    Tensorwise,
    /// Delayed scaling (Transformer Engine's default, `DelayedScaling` with the `max`
    /// algorithm): each layer keeps, per tensor, the amaxes of its last 16 casts
    /// ([`AmaxHistory`]) on the device; a cast takes its scale from their maximum and measures
    /// its own amax in the same pass, so no separate amax pass is read. The first cast of each
    /// tensor measures its amax first (a scale of 1 would flush small gradients to zero).
    Delayed,
}

impl Fp8Recipe {
    /// Every recipe, in [`Self::name`] order.
    pub const ALL: [Fp8Recipe; 3] = [Self::Off, Self::Tensorwise, Self::Delayed];

    /// The name [`Self::parse`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Tensorwise => "tensorwise",
            Self::Delayed => "delayed",
        }
    }

    /// Parses [`Self::name`]'s output.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.name() == s.trim())
    }

    /// Whether linear layers run in FP8.
    pub fn enabled(self) -> bool {
        self != Self::Off
    }
}

/// The two FP8 formats of OCP's specification that Hopper's tensor cores take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, no infinities (`E4M3FN`): activations and weights.
    E4M3,
    /// 5 exponent bits, 2 mantissa bits: gradients, whose range matters more than precision.
    E5M2,
}

impl Fp8Format {
    /// The largest finite magnitude.
    pub fn max(self) -> f32 {
        match self {
            Self::E4M3 => 448.0,
            Self::E5M2 => 57344.0,
        }
    }

    fn mantissa_bits(self) -> i32 {
        match self {
            Self::E4M3 => 3,
            Self::E5M2 => 2,
        }
    }

    fn bias(self) -> i32 {
        match self {
            Self::E4M3 => 7,
            Self::E5M2 => 15,
        }
    }

    /// `x` rounded to the nearest value of the format (ties to even), saturated to
    /// `±`[`Self::max`] as the kernels' `cvt.rn.satfinite` does; NaN stays NaN.
    pub fn round(self, x: f32) -> f32 {
        if x.is_nan() {
            return x;
        }
        let a = x.abs();
        let min_normal_exp = 1 - self.bias();
        let exp = if a == 0.0 {
            min_normal_exp
        } else {
            (a.log2().floor() as i32).max(min_normal_exp)
        };
        // Below the smallest normal, the step is the subnormals' fixed one.
        let step = (2.0f64).powi(exp - self.mantissa_bits());
        let rounded = ((a as f64 / step).round_ties_even() * step) as f32;
        rounded.min(self.max()).copysign(x)
    }

    /// The value of the byte `code` (what the GEMMs read): sign, exponent, mantissa, with
    /// subnormals; `None` for NaN codes (and E5M2's infinities).
    pub fn decode(self, code: u8) -> Option<f32> {
        let m_bits = self.mantissa_bits() as u32;
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let exp = ((code & 0x7f) >> m_bits) as i32;
        let mant = (code & ((1 << m_bits) - 1)) as i32;
        let max_exp = (1 << (7 - m_bits)) - 1;
        match self {
            Self::E4M3 if exp == max_exp && mant == (1 << m_bits) - 1 => return None,
            Self::E5M2 if exp == max_exp => return None,
            _ => {}
        }
        let scale = (1i32 << m_bits) as f64;
        let value = if exp == 0 {
            (mant as f64 / scale) * 2f64.powi(1 - self.bias())
        } else {
            (1.0 + mant as f64 / scale) * 2f64.powi(exp - self.bias())
        };
        Some(sign * value as f32)
    }
}

/// The factor a tensor of largest magnitude `amax` is multiplied by before its cast to
/// `format`, so that `amax` lands on the format's largest finite value. An all-zero tensor
/// keeps scale 1; a non-finite amax gives NaN, so that an overflow upstream reaches the loss
/// (and the trainer's guard) as it would without FP8, instead of being saturated away.
pub fn scale_for(amax: f32, format: Fp8Format) -> f32 {
    if amax == 0.0 {
        1.0
    } else if !amax.is_finite() {
        f32::NAN
    } else {
        format.max() / amax
    }
}

/// `x` as an FP8 GEMM sees it: scaled, rounded to `format`, and scaled back.
pub fn quantize(x: f32, scale: f32, format: Fp8Format) -> f32 {
    format.round(x * scale) / scale
}

/// A window of recent amaxes of one tensor, as Transformer Engine's delayed scaling keeps them:
/// the scale of the next cast comes from the largest amax of the window.
#[derive(Clone, Debug)]
pub struct AmaxHistory {
    len: usize,
    values: VecDeque<f32>,
}

impl AmaxHistory {
    /// An empty window of `len` amaxes (at least one).
    pub fn new(len: usize) -> Self {
        Self {
            len: len.max(1),
            values: VecDeque::new(),
        }
    }

    /// Records the amax of the latest cast, forgetting the oldest beyond the window.
    pub fn push(&mut self, amax: f32) {
        if self.values.len() == self.len {
            self.values.pop_front();
        }
        self.values.push_back(amax);
    }

    /// The largest amax of the window (0 when empty); a non-finite one wins, so that an
    /// overflow is not forgotten until it leaves the window.
    pub fn amax(&self) -> f32 {
        self.values.iter().fold(0.0f32, |m, &v| {
            if !v.is_finite() || !m.is_finite() {
                f32::INFINITY
            } else {
                m.max(v)
            }
        })
    }

    /// The scale of the next cast to `format`.
    pub fn scale(&self, format: Fp8Format) -> f32 {
        scale_for(self.amax(), format)
    }
}

/// The tensor dimensions the FP8 GEMMs take: cuBLASLt's FP8 kernels want every dimension and
/// leading dimension a multiple of 16. Other shapes stay in the compute dtype.
pub fn fp8_shape_supported(rows: usize, inner: usize, cols: usize) -> bool {
    [rows, inner, cols].iter().all(|&d| d > 0 && d % 16 == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_known_values() {
        let e4 = Fp8Format::E4M3;
        // Exact values survive; the grid between 1 and 2 has step 1/8.
        for v in [0.0, 1.0, 1.125, 1.875, 448.0, -3.5, 0.015625] {
            assert_eq!(e4.round(v), v, "{v}");
        }
        assert_eq!(e4.round(1.0625), 1.0, "tie to even");
        assert_eq!(e4.round(1.1875), 1.25, "tie to even");
        assert_eq!(e4.round(1.07), 1.125);
        // Saturation instead of NaN/inf beyond the largest finite value.
        assert_eq!(e4.round(460.0), 448.0);
        assert_eq!(e4.round(-1e9), -448.0);
        assert!(e4.round(f32::NAN).is_nan());
        // Subnormals: the smallest is 2^-9; half of it rounds to even (zero).
        assert_eq!(e4.round(2f32.powi(-9)), 2f32.powi(-9));
        assert_eq!(e4.round(2f32.powi(-10)), 0.0);
        assert_eq!(e4.round(3.0 * 2f32.powi(-10)), 2.0 * 2f32.powi(-9));
        let e5 = Fp8Format::E5M2;
        assert_eq!(e5.round(57344.0), 57344.0);
        assert_eq!(e5.round(1e6), 57344.0);
        assert_eq!(e5.round(1.125), 1.0, "E5M2 has step 1/4 at 1: tie to even");
        assert_eq!(e5.round(1.2), 1.25);
        assert_eq!(e5.round(2f32.powi(-16)), 2f32.powi(-16));
    }

    #[test]
    fn every_code_decodes_to_a_fixed_point_of_rounding() {
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let mut finite = 0;
            let mut largest = 0.0f32;
            for code in 0..=255u8 {
                if let Some(v) = format.decode(code) {
                    assert_eq!(format.round(v), v, "{format:?} code {code:#04x} = {v}");
                    largest = largest.max(v.abs());
                    finite += 1;
                }
            }
            assert_eq!(largest, format.max(), "{format:?}");
            // E4M3: two NaN codes; E5M2: 2 x (3 NaN + 1 infinity).
            let expected = match format {
                Fp8Format::E4M3 => 254,
                Fp8Format::E5M2 => 248,
            };
            assert_eq!(finite, expected, "{format:?}");
        }
        assert_eq!(Fp8Format::E4M3.decode(0x7e), Some(448.0));
        assert_eq!(Fp8Format::E4M3.decode(0x01), Some(2f32.powi(-9)));
        assert_eq!(Fp8Format::E5M2.decode(0x3c), Some(1.0));
    }

    #[test]
    fn scales_put_amax_on_the_largest_value() {
        let s = scale_for(3.5, Fp8Format::E4M3);
        assert_eq!(Fp8Format::E4M3.round(3.5 * s), 448.0);
        assert_eq!(scale_for(0.0, Fp8Format::E4M3), 1.0);
        assert!(scale_for(f32::INFINITY, Fp8Format::E5M2).is_nan());
        assert!(scale_for(f32::NAN, Fp8Format::E4M3).is_nan());
        // Quantization error of a scaled value: at most half a step, 1/16 relative in E4M3.
        for x in [0.3f32, -1.7, 2.9, 3.5] {
            let q = quantize(x, s, Fp8Format::E4M3);
            assert!((q - x).abs() <= x.abs() / 16.0 + 1e-7, "{x} -> {q}");
        }
    }

    #[test]
    fn amax_history_keeps_the_window_maximum() {
        let mut h = AmaxHistory::new(3);
        assert_eq!(h.amax(), 0.0);
        assert_eq!(h.scale(Fp8Format::E4M3), 1.0);
        for v in [1.0, 4.0, 2.0] {
            h.push(v);
        }
        assert_eq!(h.amax(), 4.0);
        h.push(0.5); // 1.0 leaves
        assert_eq!(h.amax(), 4.0);
        h.push(0.5);
        h.push(0.5); // 4.0 and 2.0 left
        assert_eq!(h.amax(), 0.5);
        assert_eq!(h.scale(Fp8Format::E4M3), 896.0);
        h.push(f32::INFINITY);
        assert!(
            h.scale(Fp8Format::E4M3).is_nan(),
            "an overflow is not saturated away"
        );
        for _ in 0..3 {
            h.push(1.0);
        }
        assert_eq!(h.amax(), 1.0, "the overflow left the window");
    }

    #[test]
    fn recipes_parse_by_name() {
        for r in Fp8Recipe::ALL {
            assert_eq!(Fp8Recipe::parse(r.name()), Some(r));
        }
        assert_eq!(Fp8Recipe::parse("delayed-ish"), None);
        assert!(!Fp8Recipe::Off.enabled() && Fp8Recipe::Tensorwise.enabled());
        assert!(Fp8Recipe::Delayed.enabled());
        assert!(fp8_shape_supported(4096, 4096, 11008));
        assert!(!fp8_shape_supported(4096, 4096, 11000));
    }
}
