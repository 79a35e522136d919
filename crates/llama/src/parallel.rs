//! Llama's parallel plan on smp-burn's engine (torchtitan's `parallelize_llama`): the units are
//! the token embedding, each decoder layer and the head ([`crate::model::units`], whose layer
//! types say what tensor parallelism splits); parameters are named as Hugging Face names them,
//! so that seeds, checkpoints and exports agree whatever the layout.

use burn::tensor::backend::AutodiffBackend;
use smp_burn::engine::{AdamW, Engine, EngineBuilder, Init};
use smp_burn::mesh::Mesh;

use crate::config::LlamaConfig;
use crate::error::Result;
use crate::model::{DecoderLayer, Embedding, LmHead, hf_name, init_rule, units};

/// Llama sharded over a mesh by smp-burn's engine.
pub type LlamaEngine<B> = Engine<B, Embedding<B>, DecoderLayer<B>, LmHead<B>>;

/// How a Llama engine is built: where the values come from, the optimizer and clipping.
#[derive(Debug)]
pub struct Build<'a> {
    /// Initial values (a seed, a checkpoint, Hugging Face weights).
    pub init: Init<'a>,
    /// AdamW's hyper-parameters (matrices decay, norms do not).
    pub adamw: AdamW,
    /// Global gradient-norm clipping; `None`: off.
    pub max_grad_norm: Option<f64>,
}

/// Builds the engine for `config` on `mesh`: each rank creates only its own shard of its own
/// tensor-parallel slice of every parameter. Collective over the mesh.
///
/// # Errors
/// A shape the mesh does not split, or a failing initialization source.
pub fn build<B: AutodiffBackend>(
    config: &LlamaConfig,
    mesh: &Mesh<B::InnerBackend>,
    device: &B::Device,
    how: Build<'_>,
) -> Result<LlamaEngine<B>> {
    let units = units::<B>(config, mesh.tp(), device)?;
    Ok(EngineBuilder::new(mesh)
        .names(hf_name)
        .init(how.init)
        .adamw(how.adamw)
        .max_grad_norm(how.max_grad_norm)
        .build(units, device)?)
}

/// Deterministic initialization from a seed, keyed by Hugging Face names: any rank can produce
/// any slice of any parameter, and every layout gets the same model.
pub fn seeded_init(seed: u64) -> Init<'static> {
    Init::seeded_with(seed, |info| init_rule(info.shape))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use collectives::{CommOptions, run_on_threads};
    use smp_burn::ParallelConfig;
    use smp_burn::tp::Placement;

    type B = Autodiff<NdArray<f32>>;

    /// The plan under tensor parallelism 2: q/k/v/gate/up split over their outputs, o/down over
    /// their inputs, the embedding and the LM head over the vocabulary, norms replicated; full
    /// shapes and Hugging Face names as without it.
    #[test]
    fn plan_follows_megatron() {
        let config = LlamaConfig::preset("tiny").unwrap();
        let parallel = ParallelConfig {
            tensor_parallel_degree: 2,
            ..Default::default()
        };
        let plans = run_on_threads(2, CommOptions::default(), |world| {
            let mesh = Mesh::over_host(world, &parallel).unwrap();
            let how = Build {
                init: seeded_init(1),
                adamw: AdamW::default(),
                max_grad_norm: None,
            };
            build::<B>(&config, &mesh, &Default::default(), how)
                .unwrap()
                .plan()
        });
        let plan = &plans[0];
        let placement = |name: &str| {
            plan.iter()
                .find(|p| p.name == name)
                .unwrap_or_else(|| panic!("{name} in the plan"))
                .placement
        };
        let (rows, cols) = (Placement::Split { dim: 0 }, Placement::Split { dim: 1 });
        for p in ["q_proj", "k_proj", "v_proj"] {
            assert_eq!(
                placement(&format!("model.layers.1.self_attn.{p}.weight")),
                rows
            );
        }
        assert_eq!(placement("model.layers.0.self_attn.o_proj.weight"), cols);
        assert_eq!(placement("model.layers.0.mlp.gate_proj.weight"), rows);
        assert_eq!(placement("model.layers.0.mlp.down_proj.weight"), cols);
        assert_eq!(placement("model.embed_tokens.weight"), rows);
        assert_eq!(placement("lm_head.weight"), rows);
        assert_eq!(
            placement("model.layers.0.input_layernorm.weight"),
            Placement::Replicated
        );
        assert_eq!(placement("model.norm.weight"), Placement::Replicated);
        let shapes = crate::model::parameter_shapes(&config);
        assert_eq!(plan.len(), shapes.len());
        for (name, shape) in shapes {
            let entry = plan.iter().find(|p| p.name == name).expect("named as HF");
            assert_eq!(entry.shape, shape, "{name}");
        }
        assert_eq!(plans[0], plans[1], "every rank has the same plan");
    }
}
