//! The parallel configuration, SMP-style, and its validation against the world.

use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};

use crate::error::SmpError;

/// Floating-point precision of a tensor class in mixed-precision training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// 32-bit IEEE float.
    #[default]
    F32,
    /// bfloat16: f32's range with 8 bits of mantissa.
    Bf16,
}

impl Precision {
    /// Burn's dtype for this precision.
    pub fn dtype(self) -> FloatDType {
        match self {
            Precision::F32 => FloatDType::F32,
            Precision::Bf16 => FloatDType::BF16,
        }
    }
}

/// What to parallelize and how, in SageMaker SMP v2's vocabulary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ParallelConfig {
    /// Ranks a parameter is sharded across. 0 or the data-parallel world means full sharding
    /// (ZeRO-3); `k` shards inside groups of `k` ranks and replicates across the groups.
    pub hybrid_shard_degree: usize,
    /// Ranks a layer is split across (Megatron-style tensor parallelism); 1 = off.
    pub tensor_parallel_degree: usize,
    /// Dtype parameters are gathered and computed in (bf16 on GPUs, f32 on CPU).
    pub param_dtype: Precision,
    /// Dtype gradients are reduced in.
    pub reduce_dtype: Precision,
    /// Recompute each unit's forward in its backward instead of keeping its activations and
    /// gathered parameters: memory of one unit instead of all of them.
    pub activation_checkpointing: bool,
    /// With activation checkpointing on, how many decoder layers recompute their forward,
    /// counted from the first (Megatron's `--recompute-method block`); `None` means all. Each
    /// layer left out keeps its activations (about 0.6 GiB for Llama 2 7B at 4,096 tokens) and
    /// is not run twice, so a model that almost fits trains faster with only some layers
    /// recomputed.
    pub checkpointed_layers: Option<usize>,
    /// Recomputed layers also keep their attention's output and softmax statistics, and their
    /// recomputation runs everything but attention's forward ([`crate::selective`]): about
    /// 40 % of a layer's recomputation saved at S=32,768 with Llama 2 7B's widths, for one
    /// more `seq x hidden` tensor per recomputed layer (which stays on the device under
    /// activation offloading). Only the flash-attention path saves time; the reference path
    /// recomputes attention to differentiate it.
    pub selective_recompute: bool,
    /// Move the input each recomputed layer keeps to host memory after its forward and bring
    /// it back shortly before its backward (SMP v2's `sm_activation_offloading`). Needs
    /// activation checkpointing: only recomputed layers keep a single tensor worth moving.
    /// Results are bit for bit those without offloading.
    pub activation_offloading: bool,
    /// With offloading, how many layers ahead of its use the backward starts bringing a layer's
    /// input back (SMP's `activation_loading_horizon`; at least 1). Each costs one layer input
    /// of device memory.
    pub activation_loading_horizon: usize,
    /// With tensor parallelism, split the residual stream between split regions along the
    /// sequence (Megatron's sequence parallelism: norms, residuals and saved block inputs take
    /// `1 / tp` of the memory, and the collectives are all-gathers and reduce-scatters); without
    /// it every rank of the group holds the whole sequence and the row-parallel outputs are
    /// all-reduced.
    pub sequence_parallel: bool,
    /// Units whose all-gather is started ahead of use: 0 = gather each unit when it runs; 1 =
    /// start the next unit's gather before the current unit's compute is queued, so that on
    /// CUDA the two run side by side. 1 also overlaps the backward's other direction: a unit's
    /// gradient reduce-scatter runs beside the previous unit's backward (one pending at a
    /// time). Deeper prefetch is not supported. The default is 1 (as PyTorch FSDP2's implicit
    /// prefetch): it holds one more unit's gathered parameters and made 7B on 2 H200s 5-6 %
    /// faster.
    pub prefetch_depth: usize,
    /// Reduce the gradients after every micro-batch instead of only after the last one (SMP's
    /// and DeepSpeed's accumulation; FSDP2 with `set_requires_gradient_sync(True)` throughout).
    /// Each micro-batch then pays a gradient reduction, but no rank holds the full unsharded
    /// f32 gradient between micro-batches, which a large model sharded over many GPUs cannot
    /// afford (Llama 2 70B: 280 GB). `Engine::forward_backward` (and so `train_step`) reduces
    /// every micro-batch then, whatever its `sync` says.
    pub reduce_every_micro_batch: bool,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            hybrid_shard_degree: 0,
            tensor_parallel_degree: 1,
            param_dtype: Precision::F32,
            reduce_dtype: Precision::F32,
            activation_checkpointing: true,
            checkpointed_layers: None,
            selective_recompute: false,
            activation_offloading: false,
            activation_loading_horizon: 2,
            sequence_parallel: true,
            prefetch_depth: 1,
            reduce_every_micro_batch: false,
        }
    }
}

impl ParallelConfig {
    /// Which layers recompute their forward, from `activation_checkpointing` and
    /// `checkpointed_layers`.
    pub fn checkpointing(&self) -> ActivationCheckpointing {
        match (self.activation_checkpointing, self.checkpointed_layers) {
            (false, _) => ActivationCheckpointing::Off,
            (true, None) => ActivationCheckpointing::All,
            (true, Some(n)) => ActivationCheckpointing::FirstLayers(n),
        }
    }

    /// The loading horizon when activation offloading is on, `None` when it is off.
    pub fn offloading_horizon(&self) -> Option<usize> {
        self.activation_offloading
            .then_some(self.activation_loading_horizon)
    }
}

/// Checks an activation-offloading loading horizon: the backward must bring back at least the
/// layer it is about to run.
///
/// # Errors
/// A horizon of 0, named in the message.
pub fn check_loading_horizon(horizon: usize) -> Result<(), SmpError> {
    if horizon == 0 {
        return Err(SmpError::Config(
            "activation_loading_horizon 0: the backward must load at least the layer it is about \
             to run (1 or more)"
                .into(),
        ));
    }
    Ok(())
}

/// Which of a model's repeated blocks (decoder layers) keep only their input in the forward and
/// recompute the rest in the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationCheckpointing {
    /// Every layer keeps its activations.
    Off,
    /// Every layer recomputes.
    All,
    /// The first `n` layers recompute, the others keep their activations (all of them when `n`
    /// is at least the number of layers).
    FirstLayers(usize),
}

impl ActivationCheckpointing {
    /// Whether layer `index` (from 0) recomputes.
    pub fn recomputes(self, index: usize) -> bool {
        match self {
            Self::Off => false,
            Self::All => true,
            Self::FirstLayers(n) => index < n,
        }
    }

    /// How many of `layers` layers recompute.
    pub fn recomputed_layers(self, layers: usize) -> usize {
        match self {
            Self::Off => 0,
            Self::All => layers,
            Self::FirstLayers(n) => n.min(layers),
        }
    }
}

impl From<bool> for ActivationCheckpointing {
    /// `true` recomputes every layer, `false` none.
    fn from(on: bool) -> Self {
        if on { Self::All } else { Self::Off }
    }
}

/// The degrees of the device mesh, validated against the world size (torchtitan's
/// `ParallelDims`): `world = replicate * shard * tensor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    /// Total ranks.
    pub world: usize,
    /// Replica groups (hybrid sharding); 1 with full sharding.
    pub replicate: usize,
    /// Ranks a parameter shard group spans.
    pub shard: usize,
    /// Tensor-parallel degree.
    pub tensor: usize,
}

impl ParallelDims {
    /// Checks every degree against `world` and returns the mesh shape.
    pub fn new(config: &ParallelConfig, world: usize) -> Result<Self, SmpError> {
        let tp = config.tensor_parallel_degree.max(1);
        if world == 0 {
            return Err(SmpError::Config("world size must be at least 1".into()));
        }
        if !world.is_multiple_of(tp) {
            return Err(SmpError::Config(format!(
                "tensor_parallel_degree {tp} does not divide the world size {world}"
            )));
        }
        if config.prefetch_depth > 1 {
            return Err(SmpError::Config(format!(
                "prefetch_depth {}: only 0 (off) and 1 (the next unit) are supported",
                config.prefetch_depth
            )));
        }
        if config.activation_offloading {
            if !config.activation_checkpointing || config.checkpointed_layers == Some(0) {
                return Err(SmpError::Config(format!(
                    "activation_offloading needs activation checkpointing: it moves the input \
                     each recomputed layer keeps (activation_checkpointing {}, \
                     checkpointed_layers {:?})",
                    config.activation_checkpointing, config.checkpointed_layers
                )));
            }
            check_loading_horizon(config.activation_loading_horizon)?;
        }
        let dp = world / tp;
        let shard = match config.hybrid_shard_degree {
            0 => dp,
            k if dp.is_multiple_of(k) => k,
            k => {
                return Err(SmpError::Config(format!(
                    "hybrid_shard_degree {k} does not divide the data-parallel size {dp} \
                     (world size {world} / tensor_parallel_degree {tp})"
                )));
            }
        };
        Ok(Self {
            world,
            replicate: dp / shard,
            shard,
            tensor: tp,
        })
    }

    /// The mesh axes, outermost first, in the form `collectives::DeviceMesh::new` takes.
    pub fn mesh_axes(&self) -> [(&'static str, usize); 3] {
        [
            ("replicate", self.replicate),
            ("shard", self.shard),
            ("tensor", self.tensor),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_deeper_than_one_is_rejected() {
        let c = ParallelConfig {
            prefetch_depth: 2,
            ..Default::default()
        };
        let e = ParallelDims::new(&c, 2).unwrap_err().to_string();
        assert!(e.contains("prefetch_depth 2"), "{e}");
    }

    fn cfg(sdp: usize, tp: usize) -> ParallelConfig {
        ParallelConfig {
            hybrid_shard_degree: sdp,
            tensor_parallel_degree: tp,
            ..Default::default()
        }
    }

    #[test]
    fn full_and_hybrid_sharding() {
        let d = ParallelDims::new(&cfg(0, 1), 8).unwrap();
        assert_eq!((d.replicate, d.shard, d.tensor), (1, 8, 1));
        let d = ParallelDims::new(&cfg(2, 1), 8).unwrap();
        assert_eq!((d.replicate, d.shard, d.tensor), (4, 2, 1));
        let d = ParallelDims::new(&cfg(2, 2), 8).unwrap();
        assert_eq!((d.replicate, d.shard, d.tensor), (2, 2, 2));
    }

    #[test]
    fn offloading_needs_checkpointing_and_a_horizon() {
        let off = |checkpointing: bool, layers: Option<usize>, horizon: usize| ParallelConfig {
            activation_checkpointing: checkpointing,
            checkpointed_layers: layers,
            activation_offloading: true,
            activation_loading_horizon: horizon,
            ..Default::default()
        };
        assert!(ParallelDims::new(&off(true, None, 2), 2).is_ok());
        assert!(ParallelDims::new(&off(true, Some(3), 1), 2).is_ok());
        assert_eq!(off(true, None, 3).offloading_horizon(), Some(3));
        assert_eq!(ParallelConfig::default().offloading_horizon(), None);
        let e = ParallelDims::new(&off(false, None, 2), 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("activation_checkpointing false"), "{e}");
        let e = ParallelDims::new(&off(true, Some(0), 2), 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("checkpointed_layers Some(0)"), "{e}");
        let e = ParallelDims::new(&off(true, None, 0), 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("activation_loading_horizon 0"), "{e}");
    }

    #[test]
    fn degrees_that_do_not_divide_are_named() {
        let e = ParallelDims::new(&cfg(3, 1), 8).unwrap_err().to_string();
        assert!(
            e.contains("hybrid_shard_degree 3") && e.contains("8"),
            "{e}"
        );
        let e = ParallelDims::new(&cfg(0, 3), 8).unwrap_err().to_string();
        assert!(
            e.contains("tensor_parallel_degree 3") && e.contains("world size 8"),
            "{e}"
        );
    }
}
