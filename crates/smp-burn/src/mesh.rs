//! The device mesh: which ranks shard, replicate and split with which (torchtitan's
//! `ParallelDims` plus its sub-meshes), as one object, so that no code does rank arithmetic.
//!
//! The axes are `replicate x shard x tensor`, tensor innermost (as `collectives::DeviceMesh`
//! lays them out): the ranks of a tensor-parallel group are neighbours (on one machine, where
//! their frequent collectives are fast), and ranks with the same tensor index form the
//! data-parallel groups.

use std::sync::Arc;

use burn::tensor::{Tensor, backend::Backend};
use collectives::{Communicator, DeviceMesh};

use crate::comm::{HostTensorComm, TensorComm};
use crate::config::{ParallelConfig, ParallelDims};
use crate::error::SmpError;
use crate::fsdp::FsdpContext;
use crate::tp::{TpContext, TpGroup};

/// Makes the collectives of one mesh axis from its host communicator: NCCL on GPUs, host
/// memory elsewhere (see [`Mesh::new`]).
pub type TensorCommFactory<'a, IB> =
    dyn FnMut(Arc<dyn Communicator>) -> Result<Arc<dyn TensorComm<IB>>, SmpError> + 'a;

/// One rank's place in the mesh a [`ParallelConfig`] asks for, with the collectives of each
/// axis on the inner backend `IB`.
#[derive(Debug, Clone)]
pub struct Mesh<IB: Backend> {
    world: Arc<dyn Communicator>,
    config: ParallelConfig,
    dims: ParallelDims,
    fsdp: FsdpContext<IB>,
    tp: TpGroup,
    tp_context: Option<TpContext<IB>>,
}

impl<IB: Backend> Mesh<IB> {
    /// Validates `config` against `world`'s size and lays the world out as its mesh, wrapping
    /// each axis' host communicator with `tensor_comm`: the shard axis, the replicate axis,
    /// then (tensor parallelism) the tensor axis. Every rank creates them in this order, so
    /// communicators whose creation is collective (NCCL) never wait on each other. Collective
    /// over `world`.
    ///
    /// # Errors
    /// Degrees that do not fit the world (named in the message), or a failed communicator.
    pub fn new(
        world: Arc<dyn Communicator>,
        config: &ParallelConfig,
        tensor_comm: &mut TensorCommFactory<'_, IB>,
    ) -> Result<Self, SmpError> {
        let dims = ParallelDims::new(config, world.world_size())?;
        let mesh = DeviceMesh::new(world.clone(), &dims.mesh_axes())?;
        let shard = tensor_comm(mesh.axis("shard")?)?;
        let replicate = tensor_comm(mesh.axis("replicate")?)?;
        let tp_context = if dims.tensor > 1 {
            let comm = tensor_comm(mesh.axis("tensor")?)?;
            Some(TpContext::new(comm, config.sequence_parallel))
        } else {
            None
        };
        let tp = match &tp_context {
            Some(ctx) => TpGroup::new(ctx.clone()),
            None => TpGroup::single(),
        };
        Ok(Self {
            fsdp: FsdpContext::new(shard, Some(replicate), config),
            config: config.clone(),
            dims,
            world,
            tp,
            tp_context,
        })
    }

    /// [`Mesh::new`] with every collective through host memory: CPU thread-ranks
    /// (`collectives::run_on_threads`) or processes over TCP, on any backend.
    pub fn over_host(
        world: Arc<dyn Communicator>,
        config: &ParallelConfig,
    ) -> Result<Self, SmpError> {
        Self::new(world, config, &mut |host| {
            Ok(Arc::new(HostTensorComm::new(host)) as Arc<dyn TensorComm<IB>>)
        })
    }

    /// This rank in the whole world.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// Ranks in the whole world.
    pub fn world_size(&self) -> usize {
        self.world.world_size()
    }

    /// The host communicator of the whole world (small control messages).
    pub fn world(&self) -> &Arc<dyn Communicator> {
        &self.world
    }

    /// The configuration the mesh was laid out for.
    pub fn config(&self) -> &ParallelConfig {
        &self.config
    }

    /// The degrees of the axes.
    pub fn dims(&self) -> ParallelDims {
        self.dims
    }

    /// This rank's index among the data-parallel ranks: which slice of each global batch it
    /// reads. The ranks of a tensor-parallel group share it (they read the same rows).
    pub fn dp_rank(&self) -> usize {
        self.world.rank() / self.dims.tensor
    }

    /// Data-parallel ranks (replicas x shards): how many slices a global batch is cut into.
    pub fn dp_size(&self) -> usize {
        self.world.world_size() / self.dims.tensor
    }

    /// The tensor-parallel group the model's layers are built with ([`TpGroup::single`]
    /// without tensor parallelism).
    pub fn tp(&self) -> &TpGroup {
        &self.tp
    }

    /// The tensor-parallel context on `IB` (degree > 1 only).
    pub fn tp_context(&self) -> Option<&TpContext<IB>> {
        self.tp_context.as_ref()
    }

    /// The sharding context: the shard and replica groups and the precision of gathers and
    /// reductions.
    pub fn fsdp(&self) -> &FsdpContext<IB> {
        &self.fsdp
    }

    /// Mean of `value` over every data-parallel rank (for logging a loss each rank computed on
    /// its own data).
    pub fn mean_over_data_parallel(&self, value: Tensor<IB, 1>) -> Result<Tensor<IB, 1>, SmpError> {
        self.fsdp.mean_over_data_parallel(value)
    }
}

/// The mesh `config` asks for with NCCL collectives on CUDA device `gpu` (groups of one rank
/// need none). Collective over `world`.
///
/// # Errors
/// Degrees that do not fit the world, or an NCCL communicator that cannot be created.
#[cfg(feature = "cuda")]
pub fn nccl_mesh<B: crate::cuda::CudaTensors>(
    world: Arc<dyn Communicator>,
    config: &ParallelConfig,
    gpu: usize,
) -> Result<Mesh<B>, SmpError> {
    Mesh::new(world, config, &mut |host| {
        Ok(if host.world_size() == 1 {
            Arc::new(HostTensorComm::new(host)) as Arc<dyn TensorComm<B>>
        } else {
            Arc::new(crate::cuda::CudaTensorComm::new(host.as_ref(), gpu)?)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ndarray::NdArray;
    use collectives::{CommOptions, run_on_threads};

    /// Eight ranks as 2 replicas x 2 shards x 2 tensor: tensor-parallel peers are neighbours
    /// and share a data-parallel rank; bad degrees are named.
    #[test]
    fn ranks_are_laid_out_tensor_innermost() {
        let config = ParallelConfig {
            hybrid_shard_degree: 2,
            tensor_parallel_degree: 2,
            ..Default::default()
        };
        let got = run_on_threads(8, CommOptions::default(), |world| {
            let mesh = Mesh::<NdArray<f32>>::over_host(world, &config).unwrap();
            (
                mesh.rank(),
                mesh.dp_rank(),
                mesh.dp_size(),
                mesh.tp().rank(),
                mesh.tp().degree(),
                mesh.fsdp().shard.rank(),
            )
        });
        for (rank, dp, dp_size, tp_rank, tp, shard_rank) in got {
            assert_eq!((dp, dp_size, tp_rank, tp), (rank / 2, 4, rank % 2, 2));
            assert_eq!(shard_rank, (rank / 2) % 2);
        }
        let bad = ParallelConfig {
            tensor_parallel_degree: 3,
            ..Default::default()
        };
        let errors = run_on_threads(2, CommOptions::default(), |world| {
            Mesh::<NdArray<f32>>::over_host(world, &bad)
                .unwrap_err()
                .to_string()
        });
        assert!(
            errors[0].contains("tensor_parallel_degree 3"),
            "{}",
            errors[0]
        );
    }
}
