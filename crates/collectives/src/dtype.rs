//! Element types and the deterministic reduction kernels.

use bytemuck::Pod;
use half::{bf16, f16};

/// Element type of a raw buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// bfloat16 (reduced in f32).
    BF16,
    /// IEEE half (reduced in f32).
    F16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Byte.
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }
}

/// Reduction applied by all-reduce and reduce-scatter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum in rank order.
    Sum,
    /// Sum in rank order divided by the group size (integer division for integers).
    Avg,
    /// Element-wise maximum (NaN wins, so a diverged rank is visible everywhere).
    Max,
}

/// A plain-data element type that collectives can move and reduce.
pub trait Element: Pod + Send + Sync + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(f32 => F32, f64 => F64, bf16 => BF16, f16 => F16, i32 => I32, i64 => I64, u8 => U8);

/// Reduces `parts` (one per rank, in rank order) into `out`, element-wise.
///
/// Contributions are folded strictly in the order given so every rank that runs this on the
/// same inputs gets the same bits. Narrow types accumulate in a wider type and round once.
pub(crate) fn reduce_into(dtype: DType, op: ReduceOp, out: &mut [u8], parts: &[&[u8]]) {
    let n = parts.len();
    match dtype {
        DType::F32 => float::<f32, f32>(op, out, parts, |x| x, |a| a, n as f32),
        DType::F64 => float::<f64, f64>(op, out, parts, |x| x, |a| a, n as f64),
        DType::BF16 => float::<bf16, f32>(op, out, parts, bf16::to_f32, bf16::from_f32, n as f32),
        DType::F16 => float::<f16, f32>(op, out, parts, f16::to_f32, f16::from_f32, n as f32),
        DType::I32 => int::<i32>(op, out, parts, |x| x as i128, |a| a as i32),
        DType::I64 => int::<i64>(op, out, parts, |x| x as i128, |a| a as i64),
        DType::U8 => int::<u8>(op, out, parts, |x| x as i128, |a| a as u8),
    }
}

fn fold<T: Pod, A: Copy>(
    out: &mut [u8],
    parts: &[&[u8]],
    to: impl Fn(T) -> A,
    combine: impl Fn(A, A) -> A,
    finish: impl Fn(A) -> T,
) {
    let typed: Option<Vec<&[T]>> = parts
        .iter()
        .map(|p| bytemuck::try_cast_slice::<u8, T>(p).ok())
        .collect();
    // Typed loops over aligned slices vectorise; buffers from the allocator and from typed
    // callers are normally aligned, so the byte-wise path below is only a fallback.
    if let Some(ps) = typed
        && let Ok(o) = bytemuck::try_cast_slice_mut::<u8, T>(out)
    {
        let mut acc: Vec<A> = ps[0].iter().map(|&x| to(x)).collect();
        for p in &ps[1..] {
            for (a, &x) in acc.iter_mut().zip(p.iter()) {
                *a = combine(*a, to(x));
            }
        }
        for (o, a) in o.iter_mut().zip(acc) {
            *o = finish(a);
        }
        return;
    }
    let sz = std::mem::size_of::<T>();
    let read = |b: &[u8]| to(bytemuck::pod_read_unaligned::<T>(b));
    let mut acc: Vec<A> = parts[0].chunks_exact(sz).map(read).collect();
    for p in &parts[1..] {
        for (a, b) in acc.iter_mut().zip(p.chunks_exact(sz)) {
            *a = combine(*a, read(b));
        }
    }
    for (o, a) in out.chunks_exact_mut(sz).zip(acc) {
        o.copy_from_slice(bytemuck::bytes_of(&finish(a)));
    }
}

fn float<T: Pod, A>(
    op: ReduceOp,
    out: &mut [u8],
    parts: &[&[u8]],
    to: impl Fn(T) -> A,
    from: impl Fn(A) -> T,
    n: A,
) where
    A: Copy + PartialOrd + std::ops::Add<Output = A> + std::ops::Div<Output = A>,
{
    match op {
        ReduceOp::Sum => fold(out, parts, to, |a, b| a + b, from),
        ReduceOp::Avg => fold(out, parts, to, |a, b| a + b, |a| from(a / n)),
        ReduceOp::Max => fold(
            out,
            parts,
            to,
            // `a != a` is NaN: keep a NaN once seen so divergence propagates.
            #[allow(clippy::eq_op)]
            |a, b| {
                if a != a || (b == b && a >= b) { a } else { b }
            },
            from,
        ),
    }
}

fn int<T: Pod>(
    op: ReduceOp,
    out: &mut [u8],
    parts: &[&[u8]],
    to: impl Fn(T) -> i128,
    from: impl Fn(i128) -> T,
) {
    let n = parts.len() as i128;
    match op {
        // i128 cannot overflow for any realistic group size; the final cast wraps like a
        // serial wrapping sum in the element type would.
        ReduceOp::Sum => fold(out, parts, to, |a, b| a + b, from),
        ReduceOp::Avg => fold(out, parts, to, |a, b| a + b, |a| from(a / n)),
        ReduceOp::Max => fold(out, parts, to, |a, b| a.max(b), from),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reduce<T: Element>(op: ReduceOp, parts: &[Vec<T>]) -> Vec<T> {
        let bytes: Vec<&[u8]> = parts.iter().map(|p| bytemuck::cast_slice(p)).collect();
        let mut out = vec![T::zeroed(); parts[0].len()];
        reduce_into(T::DTYPE, op, bytemuck::cast_slice_mut(&mut out), &bytes);
        out
    }

    #[test]
    fn f32_sum_is_serial_rank_order() {
        let parts = vec![vec![1e8f32, 1.0], vec![1.0, 2.0], vec![-1e8, 3.0]];
        let got = reduce(ReduceOp::Sum, &parts);
        assert_eq!(got, vec![(1e8f32 + 1.0) + -1e8, 6.0]);
    }

    #[test]
    fn bf16_accumulates_in_f32() {
        // 256 + 1 + 1 is not representable step by step in bf16 but is after one rounding.
        let parts: Vec<Vec<bf16>> = [256.0, 1.0, 1.0]
            .iter()
            .map(|&x| vec![bf16::from_f32(x)])
            .collect();
        assert_eq!(reduce(ReduceOp::Sum, &parts)[0].to_f32(), 258.0);
        assert_eq!(reduce(ReduceOp::Avg, &parts)[0], bf16::from_f32(86.0));
    }

    #[test]
    fn unaligned_buffers_reduce_like_aligned_ones() {
        let a: Vec<f32> = (0..33).map(|i| i as f32 * 0.1).collect();
        let b: Vec<f32> = (0..33).map(|i| i as f32 * -0.3 + 1.0).collect();
        let want = reduce(ReduceOp::Sum, &[a.clone(), b.clone()]);
        // f32 backing storage makes byte offset 1 certainly misaligned.
        let mut shifted = vec![0f32; 34];
        let shifted: &mut [u8] = bytemuck::cast_slice_mut(&mut shifted);
        shifted[1..=33 * 4].copy_from_slice(bytemuck::cast_slice(&b));
        let mut out = vec![0f32; 34];
        let out: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        reduce_into(
            DType::F32,
            ReduceOp::Sum,
            &mut out[1..=33 * 4],
            &[bytemuck::cast_slice(&a), &shifted[1..=33 * 4]],
        );
        assert_eq!(&out[1..=33 * 4], bytemuck::cast_slice::<f32, u8>(&want));
    }

    #[test]
    fn max_and_ints() {
        let parts = vec![vec![1i32, -5], vec![3, -7]];
        assert_eq!(reduce(ReduceOp::Max, &parts), vec![3, -5]);
        assert_eq!(reduce(ReduceOp::Avg, &parts), vec![2, -6]);
        let bytes = vec![vec![200u8], vec![100u8]];
        assert_eq!(reduce(ReduceOp::Avg, &bytes), vec![150]);
        let nan = vec![vec![f32::NAN, 1.0], vec![2.0, f32::NAN]];
        let m = reduce(ReduceOp::Max, &nan);
        assert!(m[0].is_nan() && m[1].is_nan());
    }
}
