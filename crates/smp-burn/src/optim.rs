//! Optimizers that step the flat fp32 shards of sharded units, and the parameter groups that
//! give each parameter its weight decay and learning-rate scale.
//!
//! The default is [`AdamW`], fused into one kernel per run of a shard on CUDA. Any Burn
//! optimizer that works tensor by tensor (`burn::optim::SimpleOptimizer`: Adam, AdamW, SGD,
//! ...) steps the shards too through [`BurnOptim`], once per run of elements that share a
//! group: slower, but the user's choice.

use std::any::Any;
use std::sync::Arc;

use burn::optim::SimpleOptimizer;
use burn::tensor::{Tensor, backend::Backend};

use crate::error::SmpError;

/// The optimizer settings of a group of parameters (PyTorch's `param_groups`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Group {
    /// Decoupled weight decay (`p -= lr * weight_decay * p`); 0 for none.
    pub weight_decay: f64,
    /// Factor on the step's learning rate.
    pub lr_scale: f64,
}

impl Group {
    /// Weight decay `weight_decay`, the step's learning rate.
    pub fn decay(weight_decay: f64) -> Self {
        Self {
            weight_decay,
            lr_scale: 1.0,
        }
    }

    /// No weight decay (norms, biases, embeddings in many recipes).
    pub fn no_decay() -> Self {
        Self::decay(0.0)
    }

    /// The same group with the learning rate scaled by `scale`.
    pub fn with_lr_scale(mut self, scale: f64) -> Self {
        self.lr_scale = scale;
        self
    }
}

/// The learning-rate scale and weight decay of one run of a shard, as the fused AdamW kernel
/// takes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunRates {
    /// Factor on the step's learning rate.
    pub lr_scale: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

impl RunRates {
    /// The rates of `group`.
    pub fn of(group: Group) -> Self {
        Self {
            lr_scale: group.lr_scale as f32,
            weight_decay: group.weight_decay as f32,
        }
    }
}

/// AdamW hyper-parameters (PyTorch's semantics: decoupled weight decay `p -= lr * wd * p`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamW {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay of the parameters the default groups decay (matrices); a
    /// parameter group's own `weight_decay` replaces it.
    pub weight_decay: f64,
    /// The dtype both moments are kept in between steps (each step computes in f32).
    #[serde(default)]
    pub moments: MomentDtype,
}

impl Default for AdamW {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            moments: MomentDtype::F32,
        }
    }
}

/// The dtype AdamW keeps its two moments in (Megatron's `--exp-avg-dtype` and
/// `--exp-avg-sq-dtype`, both at once).
///
/// `Bf16` halves the moments' memory (4 bytes per parameter less: 25 GiB for Llama 2 7B on
/// one GPU) and AdamW's memory traffic from 28 to 20 bytes per parameter. Each step reads the
/// moments, updates them in f32, takes the update from the f32 values and stores them rounded
/// to nearest; DeepSeek-V3 was trained with its moments in bf16. On backends without bf16
/// tensors (the CPU's `NdArray`) the moments stay f32 holding bf16-rounded values: what bf16
/// storage holds, without its memory saving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MomentDtype {
    /// Both moments in f32, as PyTorch's AdamW keeps them for f32 parameters.
    #[default]
    F32,
    /// Both moments in bf16.
    Bf16,
}

impl MomentDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

/// An optimizer state of one run of a shard, opaque to the engine.
pub type RunState = Box<dyn Any + Send>;

/// An optimizer that steps a run of a flat fp32 shard whose elements share a [`Group`].
pub trait ShardOptimizer<IB: Backend>: Send + Sync {
    /// The optimizer's name, for logs.
    fn name(&self) -> String;

    /// One step of `param` (f32, 1-D) against `grad` (f32, already clipped) at learning rate
    /// `lr` (the group's scale applied), with the run's state from the previous step (`None`
    /// on the first). Returns the new parameter values and state.
    ///
    /// # Errors
    /// A state of the wrong type (a bug), or whatever the optimizer reports.
    fn step(
        &self,
        lr: f64,
        group: &Group,
        param: Tensor<IB, 1>,
        grad: Tensor<IB, 1>,
        state: Option<RunState>,
    ) -> Result<(Tensor<IB, 1>, Option<RunState>), SmpError>;
}

/// A Burn optimizer stepping shards: `make(group)` builds the optimizer for each group (so that
/// each gets its own weight decay), e.g.
/// `BurnOptim::new(|g| AdamWConfig::new().with_weight_decay(g.weight_decay as f32).build())`.
pub struct BurnOptim<F> {
    make: F,
    name: String,
}

impl<F> BurnOptim<F> {
    /// Wraps `make`; `name` is shown in logs.
    pub fn new(name: impl Into<String>, make: F) -> Self {
        Self {
            make,
            name: name.into(),
        }
    }
}

impl<IB, O, F> ShardOptimizer<IB> for BurnOptim<F>
where
    IB: Backend,
    O: SimpleOptimizer<IB>,
    O::State<1>: Send,
    F: Fn(&Group) -> O + Send + Sync,
{
    fn name(&self) -> String {
        self.name.clone()
    }

    fn step(
        &self,
        lr: f64,
        group: &Group,
        param: Tensor<IB, 1>,
        grad: Tensor<IB, 1>,
        state: Option<RunState>,
    ) -> Result<(Tensor<IB, 1>, Option<RunState>), SmpError> {
        let state = match state {
            None => None,
            Some(s) => Some(*s.downcast::<O::State<1>>().map_err(|_| {
                SmpError::Usage(format!(
                    "optimizer {}: a shard's state is not this optimizer's (was the optimizer \
                     changed after the first step?)",
                    self.name
                ))
            })?),
        };
        let (param, state) = (self.make)(group).step(lr, param, grad, state);
        Ok((param, state.map(|s| Box::new(s) as RunState)))
    }
}

/// The optimizer an engine steps its shards with.
#[derive(Clone)]
pub enum Optimizer<IB: Backend> {
    /// AdamW on fp32 state, fused into one kernel per run on CUDA.
    AdamW(AdamW),
    /// Any [`ShardOptimizer`], e.g. a Burn optimizer through [`BurnOptim`].
    Custom(Arc<dyn ShardOptimizer<IB>>),
}

impl<IB: Backend> std::fmt::Debug for Optimizer<IB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Optimizer::AdamW(a) => write!(f, "AdamW({a:?})"),
            Optimizer::Custom(o) => write!(f, "{}", o.name()),
        }
    }
}

impl<IB: Backend> Default for Optimizer<IB> {
    fn default() -> Self {
        Optimizer::AdamW(AdamW::default())
    }
}
