//! A GPT-2 style model that shares nothing with Llama (`examples/gpt_train/model.rs`), trained by
//! the engine on 1, 2 and 4 CPU thread-ranks in every layout, must match plain single-process
//! Burn training of the same model (Burn's own autodiff loop and Burn's AdamW); misuse must be
//! an error.
//!
//! Tolerance: f32 throughout. The parallel runs average per-rank means, sum partial products
//! over tensor-parallel ranks and reduce gradients in another order than one process does: the
//! same sums in another order, so results differ by float rounding only. Burn's own LayerNorm
//! is the largest source: on NdArray its input gradient for the same token differs by about
//! 1e-4 (relative) between a batch of 16 and of 32 tokens (measured). Burn's `div` backward
//! multiplies by burn-ndarray's SIMD reciprocal, an estimate (up to 3.7e-4 relative on AVX2
//! CPUs, 6e-5 with AVX-512) for the elements of whole SIMD lanes and exact for the rest, so a
//! tensor cut differently across ranks is rounded differently. AdamW runs with a large epsilon
//! (1e-2) so that this noise in near-zero gradients is not amplified into full-size updates of
//! random sign. We accept 2e-5 relative on losses and 2e-3 on parameters (relative to each
//! tensor's largest magnitude; TP 2 with a chunk-scored head measured 1.05e-3 on an AVX2 CPU);
//! a real bug (a missing reduction, a bias added before the reduction, a wrong slice) moves them
//! by orders of magnitude more.

#[path = "../examples/gpt_train/model.rs"]
#[allow(dead_code)]
mod model;

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_ndarray::NdArray;
use collectives::{CommOptions, Communicator, run_on_threads};
use model::{Block, GptConfig, GptUnits, Head, Stem, gpt_units};
use smp_burn::engine::{
    BlockUnit, Cx, Engine, EngineBuilder, Group, HeadUnit, Init, StateKind, StemUnit, UnitId, Units,
};
use smp_burn::mesh::Mesh;
use smp_burn::optim::{AdamW, BurnOptim};
use smp_burn::tp::TpGroup;
use smp_burn::{Loss, ParallelConfig};

type Cpu = Autodiff<NdArray<f32>>;

const STEPS: usize = 3;
const GLOBAL_BATCH: usize = 4;
const SEQ: usize = 8;
const LR: f64 = 1e-2;
const SEED: u64 = 11;

fn config(tie_embeddings: bool) -> GptConfig {
    GptConfig {
        vocab: 32,
        max_seq: SEQ,
        layers: 2,
        heads: 4,
        d_model: 16,
        tie_embeddings,
    }
}

fn adamw() -> AdamW {
    AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-2,
        weight_decay: 0.1,
        ..AdamW::default()
    }
}

/// Step `step`'s global batch: `[GLOBAL_BATCH, SEQ]` inputs and next-token targets. Each row
/// follows `t -> 5 t + 3 (mod vocab)` from a random start, with an occasional random token, so
/// that there is something to learn in a few steps. About one target in five is
/// `IGNORE_INDEX`, a different number in each row, and at odd steps all of row 1's: the step's
/// loss is the mean over the scored targets of the whole batch, so ranks and micro-batches
/// holding fewer of them (or none) must count for less.
fn global_batch(step: usize, vocab: usize) -> (Vec<i64>, Vec<i64>) {
    let mut x = (step as u64 + 7).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut random = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let v = vocab as u64;
    let rows: Vec<Vec<i64>> = (0..GLOBAL_BATCH)
        .map(|_| {
            let mut t = random() % v;
            (0..=SEQ)
                .map(|_| {
                    let out = t as i64;
                    t = if random() % 8 == 0 {
                        random() % v
                    } else {
                        (5 * t + 3) % v
                    };
                    out
                })
                .collect()
        })
        .collect();
    let inputs = rows.iter().flat_map(|r| r[..SEQ].to_vec()).collect();
    let targets = rows
        .iter()
        .enumerate()
        .flat_map(|(row, r)| {
            r[1..]
                .iter()
                .enumerate()
                .map(|(pos, &t)| {
                    // Not drawn from the data's generator, so the tokens stay as they were.
                    let hash = (step * 131 + row * 17 + pos * 7) % 5;
                    if (row == 1 && step % 2 == 1) || hash == 0 {
                        smp_burn::ops::IGNORE_INDEX
                    } else {
                        t
                    }
                })
                .collect::<Vec<_>>()
        })
        .collect();
    (inputs, targets)
}

/// Rows `rows` of a `[GLOBAL_BATCH, SEQ]` batch as a tensor.
fn rows(values: &[i64], rows: std::ops::Range<usize>) -> Tensor<Cpu, 2, Int> {
    let n = rows.len();
    let v = values[rows.start * SEQ..rows.end * SEQ].to_vec();
    Tensor::from_data(TensorData::new(v, [n, SEQ]), &Default::default())
}

/// What a run ends with.
#[derive(Debug, Clone)]
struct Run {
    losses: Vec<f64>,
    params: Vec<(String, Vec<f32>)>,
}

fn assert_matches(reference: &Run, got: &Run, what: &str) {
    for (step, (a, b)) in reference.losses.iter().zip(&got.losses).enumerate() {
        assert!(
            (a - b).abs() <= 2e-5 * a.abs(),
            "{what}: step {step} loss {b} vs plain Burn {a}"
        );
    }
    assert_eq!(
        reference.params.len(),
        got.params.len(),
        "{what}: parameters"
    );
    for ((na, va), (nb, vb)) in reference.params.iter().zip(&got.params) {
        assert_eq!(na, nb, "{what}");
        let scale = va.iter().fold(0f32, |m, x| m.max(x.abs())) + 1e-12;
        let diff = va
            .iter()
            .zip(vb)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff / scale < 2e-3,
            "{what}: {na} differs from plain Burn by {:.2e} (relative)",
            diff / scale
        );
    }
}

/// Every parameter of plain units by the engine's default names (`stem.wte.weight`, ...),
/// tied ones once.
fn named(units: &GptUnits<Cpu>) -> Vec<(String, Vec<f32>)> {
    struct Collect {
        prefix: String,
        path: Vec<String>,
        seen: std::collections::HashSet<burn::module::ParamId>,
        out: Vec<(String, Vec<f32>)>,
    }
    impl burn::module::ModuleVisitor<Cpu> for Collect {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.into());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Cpu, D>>) {
            if self.seen.insert(p.id) {
                let v = p.val().into_data().to_vec::<f32>().unwrap();
                self.out
                    .push((format!("{}.{}", self.prefix, self.path.join(".")), v));
            }
        }
    }
    let mut c = Collect {
        prefix: String::new(),
        path: Vec::new(),
        seen: Default::default(),
        out: Vec::new(),
    };
    c.prefix = "stem".into();
    units.stem.visit(&mut c);
    for (i, b) in units.blocks.iter().enumerate() {
        c.prefix = format!("blocks.{i}");
        b.visit(&mut c);
    }
    c.prefix = "head".into();
    units.head.visit(&mut c);
    let mut out = c.out;
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Weight decay on every parameter, as Burn's AdamW applies it.
fn decay_all(_: &smp_burn::engine::ParamInfo<'_>) -> Group {
    Group::decay(adamw().weight_decay)
}

/// The model's initial values as plain Burn modules: a one-rank engine's, gathered.
fn initial_units(cfg: GptConfig) -> GptUnits<Cpu> {
    let mesh = Mesh::over_host(single(), &ParallelConfig::default()).unwrap();
    let device = Default::default();
    let units = gpt_units::<Cpu>(&cfg, mesh.tp(), &device).unwrap();
    EngineBuilder::new(&mesh)
        .init(Init::seeded(SEED))
        .build(units, &device)
        .unwrap()
        .gather_units()
        .unwrap()
}

fn single() -> Arc<dyn Communicator> {
    run_on_threads(1, CommOptions::default(), |c| c).remove(0)
}

/// The plain model for Burn's own loop.
#[derive(Module, Debug)]
struct Plain<B: burn::tensor::backend::Backend> {
    stem: Stem<B>,
    blocks: Vec<Block<B>>,
    head: Head<B>,
}

/// Plain single-process Burn training: the whole global batch per step, `loss.backward()`,
/// Burn's AdamW (which decays every parameter).
fn plain_burn(cfg: GptConfig) -> Run {
    let units = initial_units(cfg);
    // Every parameter a fresh leaf, then the head's tied weight the stem's own tensor again.
    struct Leaves;
    impl ModuleMapper<Cpu> for Leaves {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<Cpu, D>>) -> Param<Tensor<Cpu, D>> {
            let id = p.id;
            Param::initialized(id, p.val().detach().require_grad())
        }
    }
    let retie = |mut m: Plain<Cpu>| {
        if m.head.wte.is_some() {
            m.head.wte = Some(m.stem.wte.weight.clone());
        }
        m
    };
    let mut model = retie(
        Plain {
            stem: units.stem,
            blocks: units.blocks,
            head: units.head,
        }
        .map(&mut Leaves),
    );
    let mut optim = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.95)
        .with_epsilon(1e-2)
        .with_weight_decay(0.1)
        .init::<Cpu, Plain<Cpu>>();
    let cx = Cx::new(GLOBAL_BATCH, SEQ, &TpGroup::single()).unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = global_batch(step, cfg.vocab);
        let mut h = model.stem.forward(rows(&x, 0..GLOBAL_BATCH), &cx);
        for b in &model.blocks {
            h = b.forward(h, &(), &cx);
        }
        let loss = model
            .head
            .loss(h, rows(&y, 0..GLOBAL_BATCH), &cx)
            .value()
            .clone();
        losses.push(loss.clone().into_scalar() as f64);
        let grads = loss.backward();
        let grads = GradientsParams::from_grads(grads, &model);
        model = retie(optim.step(LR, model, grads));
    }
    Run {
        losses,
        params: named(&Units {
            stem: model.stem,
            blocks: model.blocks,
            head: model.head,
        }),
    }
}

/// How an engine run is set up.
#[derive(Debug, Clone, Copy)]
struct Layout {
    world: usize,
    sdp: usize,
    tp: usize,
    sequence_parallel: bool,
    checkpointing: bool,
    micro_batches: usize,
}

impl Layout {
    fn new(world: usize, sdp: usize, tp: usize) -> Self {
        Self {
            world,
            sdp,
            tp,
            sequence_parallel: true,
            checkpointing: true,
            micro_batches: 1,
        }
    }
}

/// The engine on `layout.world` thread-ranks; every rank's result.
fn engine_run(
    cfg: GptConfig,
    layout: Layout,
    init: &(dyn Fn() -> Init<'static> + Sync),
) -> Vec<Run> {
    let parallel = ParallelConfig {
        hybrid_shard_degree: layout.sdp,
        tensor_parallel_degree: layout.tp,
        sequence_parallel: layout.sequence_parallel,
        activation_checkpointing: layout.checkpointing,
        ..Default::default()
    };
    run_on_threads(layout.world, CommOptions::default(), |world| {
        let device = Default::default();
        let mesh = Mesh::over_host(world, &parallel).unwrap();
        let units = gpt_units::<Cpu>(&cfg, mesh.tp(), &device).unwrap();
        let mut engine = EngineBuilder::new(&mesh)
            .init(init())
            .adamw(adamw())
            .param_groups(decay_all)
            .build(units, &device)
            .unwrap();
        let run = train(&mut engine, &mesh, layout.micro_batches, cfg.vocab);
        let total: usize = run.params.iter().map(|(_, v)| v.len()).sum();
        assert_eq!(
            total,
            cfg.num_parameters(),
            "gathered parameters, tied ones once"
        );
        run
    })
}

/// `STEPS` steps of this data-parallel rank's rows of each global batch in `micro_batches`
/// micro-batches; the losses and the gathered weights, sorted by name.
fn train<S, K, H>(
    engine: &mut Engine<Cpu, S, K, H>,
    mesh: &Mesh<NdArray<f32>>,
    micro_batches: usize,
    vocab: usize,
) -> Run
where
    S: StemUnit<Cpu>,
    K: BlockUnit<Cpu, Aux = S::Aux>,
    H: HeadUnit<Cpu>,
{
    let per_rank = GLOBAL_BATCH / mesh.dp_size();
    let per_micro = per_rank / micro_batches;
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = global_batch(step, vocab);
        let first = mesh.dp_rank() * per_rank;
        let micro = (0..micro_batches).map(|m| {
            let r = first + m * per_micro..first + (m + 1) * per_micro;
            (rows(&x, r.clone()), rows(&y, r))
        });
        losses.push(engine.train_step(micro, LR).unwrap().loss.into_scalar() as f64);
    }
    let mut params: Vec<(String, Vec<f32>)> = engine
        .gather_named(StateKind::Weights)
        .unwrap()
        .into_iter()
        .map(|(name, _, v)| (name, v))
        .collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    Run { losses, params }
}

fn seeded() -> Init<'static> {
    Init::seeded(SEED)
}

fn check(cfg: GptConfig, layouts: &[Layout]) {
    let reference = plain_burn(cfg);
    assert!(
        reference.losses.last() < reference.losses.first(),
        "the model should learn: {:?}",
        reference.losses
    );
    for layout in layouts {
        for (rank, run) in engine_run(cfg, *layout, &seeded).iter().enumerate() {
            assert_matches(&reference, run, &format!("{layout:?} rank {rank}"));
        }
    }
}

#[test]
fn one_rank_matches_plain_burn() {
    let mut no_ckpt = Layout::new(1, 0, 1);
    no_ckpt.checkpointing = false;
    check(config(true), &[Layout::new(1, 0, 1), no_ckpt]);
    check(config(false), &[Layout::new(1, 0, 1)]);
}

#[test]
fn fsdp_and_hybrid_match_plain_burn() {
    let mut accumulate = Layout::new(2, 0, 1);
    accumulate.micro_batches = 2;
    let mut no_ckpt = Layout::new(4, 2, 1);
    no_ckpt.checkpointing = false;
    check(
        config(true),
        &[
            Layout::new(2, 0, 1),
            Layout::new(4, 2, 1),
            accumulate,
            no_ckpt,
        ],
    );
}

#[test]
fn tensor_parallel_matches_plain_burn() {
    let mut plain_tp = Layout::new(2, 0, 2);
    plain_tp.sequence_parallel = false;
    let mut no_ckpt = Layout::new(2, 0, 2);
    no_ckpt.checkpointing = false;
    check(
        config(true),
        &[
            Layout::new(2, 0, 2),
            plain_tp,
            no_ckpt,
            Layout::new(4, 0, 2),
        ],
    );
    check(config(false), &[Layout::new(4, 2, 2)]);
}

/// A head that scores only its own chunk of the sequence ([`Loss::over_chunk`]) through a
/// replicated LM head, as a model of one's own may: under sequence parallelism each
/// tensor-parallel rank's chunk holds its own number of scored targets.
#[derive(Module, Debug)]
struct ChunkHead<B: burn::tensor::backend::Backend> {
    ln_f: burn::nn::LayerNorm<B>,
    out: burn::nn::Linear<B>,
}

impl<B: burn::tensor::backend::Backend> HeadUnit<B> for ChunkHead<B> {
    fn loss(&self, x: Tensor<B, 3>, targets: Tensor<B, 2, Int>, cx: &Cx) -> Loss<B> {
        let [batch, chunk, _] = x.dims();
        let logits = self.out.forward(self.ln_f.forward(x));
        let vocab = logits.dims()[2];
        Loss::over_chunk(smp_burn::ops::cross_entropy(
            logits.reshape([batch * chunk, vocab]),
            cx.chunk_of(targets).reshape([batch * chunk]),
        ))
    }

    fn logits(&self, x: Tensor<B, 3>, cx: &Cx) -> Tensor<B, 3> {
        self.out.forward(self.ln_f.forward(cx.gather_sequence(x)))
    }
}

/// With a head that scores its own chunk, the step's loss is still the mean over the global
/// batch's scored targets: TP 2 with sequence parallelism (chunks with different numbers of
/// ignored targets), with data parallelism and micro-batches beside it, matches one rank.
#[test]
fn chunk_scored_loss_matches_one_rank() {
    let cfg = config(false);
    let run = |layout: Layout| {
        let parallel = ParallelConfig {
            hybrid_shard_degree: layout.sdp,
            tensor_parallel_degree: layout.tp,
            sequence_parallel: layout.sequence_parallel,
            ..Default::default()
        };
        run_on_threads(layout.world, CommOptions::default(), |world| {
            let device = Default::default();
            let mesh = Mesh::over_host(world, &parallel).unwrap();
            let gpt = gpt_units::<Cpu>(&cfg, mesh.tp(), &device).unwrap();
            let units = Units {
                stem: gpt.stem,
                blocks: gpt.blocks,
                head: ChunkHead {
                    ln_f: burn::nn::LayerNormConfig::new(cfg.d_model).init(&device),
                    out: burn::nn::LinearConfig::new(cfg.d_model, cfg.vocab)
                        .with_bias(false)
                        .init(&device),
                },
            };
            let mut engine = EngineBuilder::new(&mesh)
                .init(seeded())
                .adamw(adamw())
                .build(units, &device)
                .unwrap();
            train(&mut engine, &mesh, layout.micro_batches, cfg.vocab)
        })
    };
    let reference = run(Layout::new(1, 0, 1)).remove(0);
    let mut accumulate = Layout::new(4, 0, 2);
    accumulate.micro_batches = 2;
    for layout in [Layout::new(2, 0, 2), accumulate] {
        for (rank, got) in run(layout).iter().enumerate() {
            assert_matches(
                &reference,
                got,
                &format!("chunk-scored {layout:?} rank {rank}"),
            );
        }
    }
}

/// An initialized model handed to the engine as it is (each rank keeps its shard), and a full
/// one sliced for tensor parallelism, train like the seeded run.
#[test]
fn initialized_models_shard() {
    let cfg = config(true);
    let reference = plain_burn(cfg);
    let parallel = ParallelConfig::default();
    let runs = run_on_threads(2, CommOptions::default(), |world| {
        let device = Default::default();
        let mesh = Mesh::over_host(world, &parallel).unwrap();
        let mut engine = EngineBuilder::new(&mesh)
            .adamw(adamw())
            .param_groups(decay_all)
            .build(initial_units(cfg), &device)
            .unwrap();
        train(&mut engine, &mesh, 1, cfg.vocab)
    });
    for r in &runs {
        assert_matches(&reference, r, "FSDP 2 from initialized units");
    }
    let from_full = || {
        let full = initial_units(cfg);
        Init::from_full_units::<Cpu, _, _, _>(&full).unwrap()
    };
    for layout in [Layout::new(2, 0, 2), Layout::new(4, 0, 2)] {
        for r in engine_run(cfg, layout, &from_full) {
            assert_matches(&reference, &r, &format!("{layout:?} from a full model"));
        }
    }
}

/// A Burn optimizer stepping the shards (Burn's AdamW through `BurnOptim`) trains like the
/// fused AdamW and like plain Burn.
#[test]
fn burn_optimizer_steps_shards() {
    let cfg = config(true);
    let reference = plain_burn(cfg);
    let parallel = ParallelConfig::default();
    let runs = run_on_threads(2, CommOptions::default(), |world| {
        let device = Default::default();
        let mesh = Mesh::over_host(world, &parallel).unwrap();
        let units = gpt_units::<Cpu>(&cfg, mesh.tp(), &device).unwrap();
        let mut engine = EngineBuilder::new(&mesh)
            .init(Init::seeded(SEED))
            .optimizer(BurnOptim::new("Burn AdamW", |g: &Group| {
                AdamWConfig::new()
                    .with_beta_1(0.9)
                    .with_beta_2(0.95)
                    .with_epsilon(1e-2)
                    .with_weight_decay(g.weight_decay as f32)
                    .build()
            }))
            .param_groups(decay_all)
            .build(units, &device)
            .unwrap();
        train(&mut engine, &mesh, 1, cfg.vocab)
    });
    for r in &runs {
        assert_matches(&reference, r, "Burn's AdamW on shards");
    }
}

/// Runs `f` on `world` thread-ranks with a mesh of `parallel`; every rank's result.
fn on_mesh<R: Send>(
    world: usize,
    parallel: &ParallelConfig,
    f: impl Fn(Mesh<NdArray<f32>>) -> R + Sync,
) -> Vec<R> {
    run_on_threads(world, CommOptions::default(), |comm| {
        f(Mesh::over_host(comm, parallel).unwrap())
    })
}

fn tp2() -> ParallelConfig {
    ParallelConfig {
        tensor_parallel_degree: 2,
        ..Default::default()
    }
}

fn one_batch() -> (Tensor<Cpu, 2, Int>, Tensor<Cpu, 2, Int>) {
    let (x, y) = global_batch(0, 32);
    (rows(&x, 0..2), rows(&y, 0..2))
}

/// What the engine must refuse, each with an error that says what and names the values.
#[test]
fn misuse_is_an_error() {
    let cfg = config(true);
    let device = Default::default();
    // A step whose last micro-batch deferred its gradient reduction, and a step without any.
    let errors = on_mesh(2, &ParallelConfig::default(), |mesh| {
        let units = gpt_units::<Cpu>(&cfg, mesh.tp(), &device).unwrap();
        let mut engine = EngineBuilder::new(&mesh)
            .init(Init::seeded(1))
            .build(units, &device)
            .unwrap();
        let none = engine.step(1e-3).unwrap_err().to_string();
        let (x, y) = one_batch();
        engine.forward_backward((x, y), 1.0, false).unwrap();
        (none, engine.step(1e-3).unwrap_err().to_string())
    });
    let (none, deferred) = &errors[0];
    assert!(none.contains("without a forward_backward"), "{none}");
    assert!(deferred.contains("sync = false"), "{deferred}");

    // Layers built without the mesh's group in a tensor-parallel engine.
    let errors = on_mesh(2, &tp2(), |mesh| {
        let units = gpt_units::<Cpu>(&cfg, &TpGroup::single(), &device).unwrap();
        let mut engine = match EngineBuilder::new(&mesh)
            .init(Init::seeded(1))
            .build(units, &device)
        {
            Ok(e) => e,
            Err(e) => return e.to_string(),
        };
        let (x, y) = one_batch();
        engine
            .forward_backward((x, y), 1.0, true)
            .unwrap_err()
            .to_string()
    });
    assert!(
        errors[0].contains("stem.wte.weight")
            && errors[0].contains("degree 1")
            && errors[0].contains("degree is 2"),
        "{}",
        errors[0]
    );

    // A sequence that tensor parallelism cannot split.
    let errors = on_mesh(2, &tp2(), |mesh| {
        let units = gpt_units::<Cpu>(&cfg, mesh.tp(), &device).unwrap();
        let mut engine = EngineBuilder::new(&mesh)
            .init(Init::seeded(1))
            .build(units, &device)
            .unwrap();
        let (x, y) = one_batch();
        let odd = |t: Tensor<Cpu, 2, Int>| t.narrow(1, 0, 7);
        engine
            .forward_backward((odd(x), odd(y)), 1.0, true)
            .unwrap_err()
            .to_string()
    });
    assert!(
        errors[0].contains("sequence length 7") && errors[0].contains("degree 2"),
        "{}",
        errors[0]
    );

    // Degrees the model's shape does not split.
    let e = gpt_units::<Cpu>(
        &GptConfig {
            heads: 3,
            d_model: 12,
            ..cfg
        },
        &on_mesh(2, &tp2(), |m| m.tp().clone())[0],
        &device,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("heads 3") && e.contains("degree 2"), "{e}");
}

/// A plain model (no tensor-parallel layers) for the misuse cases of the stem and the plan.
mod plain {
    use burn::module::Module;
    use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
    use burn::tensor::{Int, Tensor, backend::Backend};
    use smp_burn::engine::{BlockUnit, Cx, HeadUnit, StemUnit, Units};
    use smp_burn::{Loss, ops};

    /// A stem that forgets to take its chunk of the sequence.
    #[derive(Module, Debug)]
    pub struct WholeSequenceStem<B: Backend> {
        pub emb: Embedding<B>,
    }
    impl<B: Backend> StemUnit<B> for WholeSequenceStem<B> {
        type Aux = ();
        fn aux(&self, _: &Cx, _: &B::Device) {}
        fn forward(&self, ids: Tensor<B, 2, Int>, _: &Cx) -> Tensor<B, 3> {
            self.emb.forward(ids)
        }
    }
    #[derive(Module, Debug)]
    pub struct Block<B: Backend> {
        pub mlp: Linear<B>,
    }
    impl<B: Backend> BlockUnit<B> for Block<B> {
        type Aux = ();
        fn forward(&self, x: Tensor<B, 3>, _: &(), _: &Cx) -> Tensor<B, 3> {
            x.clone() + self.mlp.forward(x)
        }
    }
    #[derive(Module, Debug)]
    pub struct Head<B: Backend> {
        pub out: Linear<B>,
    }
    impl<B: Backend> HeadUnit<B> for Head<B> {
        fn loss(&self, x: Tensor<B, 3>, targets: Tensor<B, 2, Int>, cx: &Cx) -> Loss<B> {
            let [b, s, _] = x.dims();
            let logits = self.out.forward(x).reshape([b * s, 32]);
            Loss::over_chunk(ops::cross_entropy(
                logits,
                cx.chunk_of(targets).reshape([b * s]),
            ))
        }
        fn logits(&self, x: Tensor<B, 3>, cx: &Cx) -> Tensor<B, 3> {
            self.out.forward(cx.gather_sequence(x))
        }
    }

    /// The model, initialized with Burn's own initializers (`blocks` of them).
    pub fn units<B: Backend>(
        blocks: usize,
        device: &B::Device,
    ) -> Units<WholeSequenceStem<B>, Block<B>, Head<B>> {
        Units {
            stem: WholeSequenceStem {
                emb: EmbeddingConfig::new(32, 8).init(device),
            },
            blocks: (0..blocks)
                .map(|_| Block {
                    mlp: LinearConfig::new(8, 8).init(device),
                })
                .collect(),
            head: Head {
                out: LinearConfig::new(8, 32).init(device),
            },
        }
    }
}

/// Misuse around the plan and the initial values.
#[test]
fn plan_and_values_misuse_is_an_error() {
    let device = Default::default();
    // Tensor parallelism for a model without tensor-parallel layers.
    let errors = on_mesh(2, &tp2(), |mesh| {
        EngineBuilder::new(&mesh)
            .init(Init::seeded(1))
            .build(plain::units::<Cpu>(1, &device), &device)
            .unwrap_err()
            .to_string()
    });
    assert!(
        errors[0].contains("tensor_parallel_degree 2") && errors[0].contains("no tensor-parallel"),
        "{}",
        errors[0]
    );
    // Ranks that build different models (one block on rank 0, two on rank 1).
    let errors = on_mesh(2, &ParallelConfig::default(), |mesh| {
        let units = plain::units::<Cpu>(1 + mesh.rank(), &device);
        EngineBuilder::new(&mesh)
            .init(Init::seeded(1))
            .build(units, &device)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    });
    assert!(errors[0].contains("another model"), "{}", errors[0]);
    // Ranks whose own initialized values differ (Burn's initializers, unseeded).
    let errors = on_mesh(2, &ParallelConfig::default(), |mesh| {
        let units = plain::units::<Cpu>(1, &device);
        // Reading them makes Burn initialize them, each rank with its own random draw.
        EngineBuilder::new(&mesh)
            .build(units, &device)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    });
    assert!(
        errors[0].contains("different initial values"),
        "{}",
        errors[0]
    );
    // Under sequence parallelism, a stem that returns every position: named with the chunk.
    let sp = ParallelConfig {
        tensor_parallel_degree: 2,
        ..Default::default()
    };
    let errors = on_mesh(2, &sp, |mesh| {
        let units = plain::units::<Cpu>(1, &device);
        // One parameter declared split so that the plan is accepted; the stem is the misuse.
        let split = |_: UnitId, path: &str| {
            (path == "out.weight").then_some(smp_burn::tp::Placement::Split { dim: 1 })
        };
        let mut engine = match EngineBuilder::new(&mesh)
            .init(Init::seeded(1))
            .placements(split)
            .build(units, &device)
        {
            Ok(e) => e,
            Err(e) => return e.to_string(),
        };
        let (x, y) = one_batch();
        engine
            .forward_backward((x, y), 1.0, true)
            .unwrap_err()
            .to_string()
    });
    assert!(
        errors[0].contains("the stem") && errors[0].contains("chunk_of"),
        "{}",
        errors[0]
    );
}
