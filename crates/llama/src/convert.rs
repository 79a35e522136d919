//! Offline conversion between sharded checkpoints and Hugging Face directories, on any machine
//! (no GPU, one process), holding one tensor in memory at a time.

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use smp_burn::checkpoint::{
    Checkpointer, FORMAT, FORMAT_VERSION, INDEX_FILE, Index, KINDS, Piece, SavedMesh,
    ShardSnapshot, ShardedCheckpoint, TensorEntry, kind_name, rank_file,
};
use smp_burn::engine::StateKind;

use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};
use crate::hf::{self, SaveDType};

/// What a conversion reads from a checkpoint's trainer state.
#[derive(Deserialize)]
struct SavedModel {
    model: LlamaConfig,
}

/// Writes the weights of the sharded checkpoint in `checkpoint` (a `step-*` directory) as a
/// Hugging Face directory `out` in `dtype`, with the checkpoint's tokenizer: what `transformers`
/// loads. Every block read is verified; one tensor is in memory at a time.
///
/// # Errors
/// A missing, damaged or foreign checkpoint; an `out` holding other files; a write failure.
pub fn sharded_to_hf(checkpoint: &Path, out: &Path, dtype: SaveDType) -> Result<()> {
    let ckpt = ShardedCheckpoint::open(checkpoint)?;
    let state_path = checkpoint.join("trainer_state.json");
    let text = std::fs::read_to_string(&state_path).map_err(|e| LlamaError::io(&state_path, e))?;
    let saved: SavedModel = serde_json::from_str(&text)
        .map_err(|e| LlamaError::checkpoint(&state_path, format!("unreadable: {e}")))?;
    let mut names: Vec<&String> = ckpt.index().tensors.keys().collect();
    names.sort_by_cached_key(|n| hf::natural_key(n));
    let specs = names
        .iter()
        .map(|n| ((*n).clone(), ckpt.index().tensors[*n].shape.clone()))
        .collect();
    let mut export = hf::HfExport::create(out, &saved.model, specs, dtype, 2 << 30)?;
    for name in names {
        let shape = &ckpt.index().tensors[name].shape;
        let numel = shape.iter().product();
        let values = ckpt.read(name, shape, StateKind::Weights, 0..numel)?;
        export.push(name, &values)?;
    }
    let tokenizer = checkpoint.join("tokenizer.json");
    export.finish(tokenizer.exists().then_some(tokenizer.as_path()))
}

/// Writes the Hugging Face model in `hf_dir` as a sharded checkpoint of step 0 under
/// `out_dir/checkpoints` (AdamW moments zero), so that `llama2_train --resume --out-dir
/// out_dir` trains from it. One rank's file; the tokenizer is the directory's `tokenizer.json`.
///
/// # Errors
/// No `config.json`, weights or `tokenizer.json` in `hf_dir`; tensors of other shapes than its
/// `config.json` says; `out_dir` already holding checkpoints; a write failure.
pub fn hf_to_sharded(hf_dir: &Path, out_dir: &Path) -> Result<()> {
    let model = hf::read_hf_config(hf_dir)?;
    let reader = Arc::new(hf::CheckpointReader::open(hf_dir)?);
    hf::check_shapes(
        &crate::model::parameter_shapes(&model),
        &reader.shapes(),
        hf_dir,
    )?;
    // A Hugging Face model carries its tokenizer; an earlier version's checkpoint kept it one
    // level up, beside `model/`.
    let tokenizer = [
        hf_dir.join("tokenizer.json"),
        hf_dir.join("../tokenizer.json"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .unwrap_or_else(|| hf_dir.join("tokenizer.json"));
    let tokenizer = std::fs::read(&tokenizer).map_err(|e| LlamaError::io(&tokenizer, e))?;
    let root = out_dir.join("checkpoints");
    if !smp_burn::checkpoint::committed_checkpoints(&root).is_empty() {
        return Err(LlamaError::Config(format!(
            "{} already holds checkpoints; convert into an empty run directory",
            root.display()
        )));
    }
    let file = rank_file(0, 0);
    let mut snapshot = ShardSnapshot::new(file.clone());
    let mut index = Index {
        format: FORMAT.into(),
        version: FORMAT_VERSION,
        mesh: SavedMesh {
            world: 1,
            replicate: 1,
            shard: 1,
            tensor: 1,
        },
        kinds: KINDS.iter().map(|k| kind_name(*k).to_string()).collect(),
        tensors: Default::default(),
        files: Default::default(),
    };
    // Each tensor is a unit of its own in the one file: `<name>.weights` and its moments.
    for (name, shape) in reader.shapes() {
        let numel: usize = shape.iter().product();
        for kind in KINDS {
            let tensor = format!("{name}.{}", kind_name(kind));
            if kind == StateKind::Weights {
                let (reader, name) = (reader.clone(), name.clone());
                snapshot.push_with(tensor, numel, move || {
                    reader
                        .read(&name, 0..numel)
                        .map_err(|e| smp_burn::SmpError::Usage(e.to_string()))
                });
            } else {
                snapshot.push_with(tensor, numel, move || Ok(vec![0.0; numel]));
            }
        }
        index.tensors.insert(
            name.clone(),
            TensorEntry {
                shape,
                dtype: "F32".into(),
                split_dim: None,
                pieces: vec![Piece {
                    tp_rank: 0,
                    local: [0, numel],
                    file: file.clone(),
                    unit: name,
                    offset: 0,
                }],
            },
        );
    }
    let state = serde_json::json!({
        "step": 0,
        "data_position": crate::data::DataPosition::default(),
        "model": model,
        "converted_from": hf_dir,
    });
    let extras = vec![
        (
            "trainer_state.json".to_string(),
            serde_json::to_vec_pretty(&state).expect("serializable"),
        ),
        ("tokenizer.json".to_string(), tokenizer),
    ];
    let world = collectives::ThreadGroup::new(1, collectives::CommOptions::default())
        .pop()
        .expect("one rank");
    let mut saver = Checkpointer::new(&root, world);
    saver.save_prepared(0, Some(snapshot), Some(index), extras)?;
    saver.finish()?;
    debug_assert!(root.join("step-000000").join(INDEX_FILE).exists());
    Ok(())
}
