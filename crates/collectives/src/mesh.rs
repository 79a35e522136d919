//! Named multi-dimensional arrangement of the world's ranks.

use std::sync::Arc;

use crate::comm::Communicator;
use crate::error::{CommError, Result};

/// The world's ranks laid out on named axes, with one sub-communicator per axis.
///
/// Axes are listed outermost first and the innermost axis varies fastest in the rank, so
/// `[("replicate", 2), ("shard", 2)]` puts ranks `{0, 1}` and `{2, 3}` in the same shard
/// groups and `{0, 2}`, `{1, 3}` in the same replicate groups.
#[derive(Debug, Clone)]
pub struct DeviceMesh {
    world: Arc<dyn Communicator>,
    names: Vec<String>,
    degrees: Vec<usize>,
    coords: Vec<usize>,
    groups: Vec<Arc<dyn Communicator>>,
}

impl DeviceMesh {
    /// Builds the mesh; collective over `world` (every rank calls it with the same axes).
    pub fn new(world: Arc<dyn Communicator>, axes: &[(&str, usize)]) -> Result<DeviceMesh> {
        let described = || {
            axes.iter()
                .map(|(n, d)| format!("{n}={d}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if axes.is_empty() {
            return Err(CommError::mesh("a mesh needs at least one axis"));
        }
        for (i, (name, degree)) in axes.iter().enumerate() {
            if *degree == 0 {
                return Err(CommError::mesh(format!(
                    "axis '{name}' has degree 0 in [{}]",
                    described()
                )));
            }
            if axes[..i].iter().any(|(n, _)| n == name) {
                return Err(CommError::mesh(format!(
                    "axis name '{name}' appears more than once in [{}]",
                    described()
                )));
            }
        }
        let product: usize = axes.iter().map(|(_, d)| d).product();
        if product != world.world_size() {
            return Err(CommError::mesh(format!(
                "the product of the axis degrees [{}] is {product}, but the world size is {}",
                described(),
                world.world_size()
            )));
        }
        let degrees: Vec<usize> = axes.iter().map(|(_, d)| *d).collect();
        let mut strides = vec![1usize; axes.len()];
        for i in (0..axes.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * degrees[i + 1];
        }
        let rank = world.rank();
        let coords: Vec<usize> = (0..axes.len())
            .map(|i| rank / strides[i] % degrees[i])
            .collect();
        let mut groups = Vec::with_capacity(axes.len());
        for (i, (name, degree)) in axes.iter().enumerate() {
            // Every world rank makes these splits in the same order, which is what keeps the
            // derived group ids consistent without exchanging messages.
            let base = rank - coords[i] * strides[i];
            let members: Vec<usize> = (0..*degree).map(|k| base + k * strides[i]).collect();
            groups.push(world.split(name, &members)?);
        }
        Ok(DeviceMesh {
            world,
            names: axes.iter().map(|(n, _)| n.to_string()).collect(),
            degrees,
            coords,
            groups,
        })
    }

    fn index(&self, name: &str) -> Result<usize> {
        self.names.iter().position(|n| n == name).ok_or_else(|| {
            CommError::mesh(format!(
                "unknown mesh axis '{name}'; the mesh has axes {:?}",
                self.names
            ))
        })
    }

    /// Communicator of the ranks that share every coordinate except `name`'s.
    pub fn axis(&self, name: &str) -> Result<Arc<dyn Communicator>> {
        Ok(self.groups[self.index(name)?].clone())
    }

    /// Communicator over several axes at once (e.g. `["replicate", "shard"]` for data
    /// parallelism across both): the ranks that share every coordinate of the OTHER axes,
    /// in rank order, named like `replicate+shard`.
    ///
    /// Collective over the world: every rank calls it with the same names in the same order
    /// (it splits the world communicator).
    pub fn flatten(&self, names: &[&str]) -> Result<Arc<dyn Communicator>> {
        let idx: Vec<usize> = names.iter().map(|n| self.index(n)).collect::<Result<_>>()?;
        let n = self.names.len();
        let mut strides = vec![1usize; n];
        for i in (0..n.saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.degrees[i + 1];
        }
        let rank = self.world.rank();
        let members: Vec<usize> = (0..self.world.world_size())
            .filter(|&r| {
                (0..n)
                    .all(|i| idx.contains(&i) || r / strides[i] % self.degrees[i] == self.coords[i])
            })
            .collect();
        debug_assert!(members.contains(&rank));
        self.world.split(&names.join("+"), &members)
    }

    /// This rank's coordinate along `name`.
    ///
    /// # Panics
    /// If the mesh has no such axis (a programming error; [`DeviceMesh::axis`] reports it
    /// as an error instead).
    pub fn coord(&self, name: &str) -> usize {
        match self.index(name) {
            Ok(i) => self.coords[i],
            Err(e) => panic!("{e}"),
        }
    }

    /// Number of ranks along `name`.
    ///
    /// # Panics
    /// If the mesh has no such axis.
    pub fn degree(&self, name: &str) -> usize {
        match self.index(name) {
            Ok(i) => self.degrees[i],
            Err(e) => panic!("{e}"),
        }
    }

    /// Whether the mesh has an axis called `name`.
    pub fn has_axis(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// The world communicator the mesh was built from.
    pub fn world(&self) -> &Arc<dyn Communicator> {
        &self.world
    }

    /// Axis names, outermost first.
    pub fn axis_names(&self) -> Vec<&str> {
        self.names.iter().map(String::as_str).collect()
    }
}
