//! Where each parameter lives under tensor parallelism, and how a rank's slice maps onto the
//! full parameter: the bridge between a model built from rank-local slices and everything that
//! speaks of full parameters (initialization from a seed or a checkpoint, export).

use std::ops::Range;

/// How tensor parallelism places a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Every rank of the group holds all of it (norms, a row-parallel bias, anything not in a
    /// tensor-parallel layer). With sequence parallelism each rank applies it to its own
    /// positions, so its gradient is summed over the group.
    Replicated,
    /// Rank `r` holds the `r`-th of `tp` equal slices along dimension `dim` of the full
    /// parameter.
    Split {
        /// The split dimension.
        dim: usize,
    },
}

impl Placement {
    /// The placement of parameter `name` (its field name, e.g. `weight`) directly inside a
    /// module of type `container` (Burn's visitor form, `Struct:TypeName`), for the layers of
    /// [`super::layers`]; everything else is replicated.
    pub fn of_layer_param(container: &str, name: &str) -> Self {
        match (container.strip_prefix("Struct:").unwrap_or(container), name) {
            ("ColumnParallelLinear", "weight" | "bias") => Placement::Split { dim: 0 },
            ("RowParallelLinear", "weight") => Placement::Split { dim: 1 },
            ("VocabParallelEmbedding", "weight") => Placement::Split { dim: 0 },
            _ => Placement::Replicated,
        }
    }

    /// The full shape of a parameter whose slice on one of `degree` ranks has shape `local`.
    pub fn full_shape(self, local: &[usize], degree: usize) -> Vec<usize> {
        let mut full = local.to_vec();
        if let Placement::Split { dim } = self
            && let Some(d) = full.get_mut(dim)
        {
            *d *= degree;
        }
        full
    }

    /// A short description for plans and logs.
    pub fn describe(self) -> String {
        match self {
            Placement::Replicated => "replicated".into(),
            Placement::Split { dim } => format!("split on dim {dim}"),
        }
    }
}

/// The flat (row-major) ranges of the full parameter that hold elements `range` of rank
/// `rank`'s slice (shape `local`) when split along `dim` over `degree` ranks, in order. A slice
/// is a run of equal blocks in the full tensor: one block per index of the dimensions before
/// `dim`, each contiguous in both, so any element range maps to a few contiguous full ranges.
pub fn slice_ranges(
    local: &[usize],
    dim: usize,
    degree: usize,
    rank: usize,
    range: Range<usize>,
) -> Vec<Range<usize>> {
    // Elements of one block in the slice, and of the corresponding span in the full tensor.
    let inner_local: usize = local[dim..].iter().product();
    if inner_local == 0 {
        return Vec::new();
    }
    let inner_full = inner_local * degree;
    let mut out = Vec::new();
    let mut i = range.start;
    while i < range.end {
        let (block, within) = (i / inner_local, i % inner_local);
        let n = (inner_local - within).min(range.end - i);
        let start = block * inner_full + rank * inner_local + within;
        out.push(start..start + n);
        i += n;
    }
    out
}

/// The full parameter from its `degree` slices (in rank order, each of shape `local`) split
/// along `dim`.
pub fn join_slices(slices: &[&[f32]], local: &[usize], dim: usize) -> Vec<f32> {
    let inner_local: usize = local[dim..].iter().product();
    let blocks: usize = local[..dim].iter().product();
    let mut out = Vec::with_capacity(slices.iter().map(|s| s.len()).sum());
    for b in 0..blocks {
        for s in slices {
            out.extend_from_slice(&s[b * inner_local..(b + 1) * inner_local]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reading any element range of any rank's slice gives that slice's elements of the full
    /// parameter, and joining every rank's slice gives the full parameter back: both split
    /// dimensions of a matrix, the middle of a 3-D tensor, odd degrees and ranges that start
    /// and end mid-row.
    #[test]
    fn slices_read_and_join_exactly() {
        for (full_shape, dims) in [(vec![6, 12], vec![0, 1]), (vec![2, 6, 3], vec![0, 1, 2])] {
            let n_full: usize = full_shape.iter().product();
            let full: Vec<f32> = (0..n_full).map(|i| i as f32).collect();
            for dim in dims {
                for degree in [1, 2, 3] {
                    if full_shape[dim] % degree != 0 {
                        continue;
                    }
                    let mut local = full_shape.clone();
                    local[dim] /= degree;
                    let n: usize = local.iter().product();
                    let read = |rank, r: Range<usize>| -> Vec<f32> {
                        slice_ranges(&local, dim, degree, rank, r)
                            .into_iter()
                            .flat_map(|r| full[r].to_vec())
                            .collect()
                    };
                    let mut slices = Vec::new();
                    for rank in 0..degree {
                        let whole = read(rank, 0..n);
                        // What indexing the full tensor gives.
                        let want: Vec<f32> = (0..n)
                            .map(|i| {
                                let mut rem = i;
                                let mut coords = vec![0; local.len()];
                                for d in (0..local.len()).rev() {
                                    coords[d] = rem % local[d];
                                    rem /= local[d];
                                }
                                coords[dim] += rank * local[dim];
                                coords
                                    .iter()
                                    .zip(&full_shape)
                                    .fold(0, |acc, (c, s)| acc * s + c)
                                    as f32
                            })
                            .collect();
                        assert_eq!(whole, want, "{full_shape:?} dim {dim} degree {degree}");
                        for r in [1..n - 1, 3..n.min(3 + local[local.len() - 1]), n / 2..n] {
                            assert_eq!(read(rank, r.clone()), want[r.clone()].to_vec());
                        }
                        slices.push(whole);
                    }
                    let refs: Vec<&[f32]> = slices.iter().map(Vec::as_slice).collect();
                    assert_eq!(join_slices(&refs, &local, dim), full);
                    let p = Placement::Split { dim };
                    assert_eq!(p.full_shape(&local, degree), full_shape);
                }
            }
        }
    }

    #[test]
    fn layer_types_give_placements() {
        let p = Placement::of_layer_param;
        assert_eq!(
            p("Struct:ColumnParallelLinear", "weight"),
            Placement::Split { dim: 0 }
        );
        assert_eq!(
            p("Struct:ColumnParallelLinear", "bias"),
            Placement::Split { dim: 0 }
        );
        assert_eq!(
            p("Struct:RowParallelLinear", "weight"),
            Placement::Split { dim: 1 }
        );
        assert_eq!(p("Struct:RowParallelLinear", "bias"), Placement::Replicated);
        assert_eq!(
            p("Struct:VocabParallelEmbedding", "weight"),
            Placement::Split { dim: 0 }
        );
        assert_eq!(p("Struct:LayerNorm", "gamma"), Placement::Replicated);
    }
}
