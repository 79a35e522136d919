//! Fingerprints the crate's sources for the kernel cache.
//!
//! CubeCL keys its on-disk PTX cache by a kernel's type name and launch settings, not by its
//! code, and namespaces it by CubeCL's version only. A kernel edited in smp-burn (or changed by
//! an upgrade) would load the PTX of its previous version from the cache: stale code, and with
//! changed parameters, wrong memory accesses. `KERNEL_SOURCE_FINGERPRINT` names the cache
//! folder after the sources instead (see `cuda::kernel_cache`), and after the workspace's
//! `Cargo.lock` where there is one, so that a Burn upgrade under the same CubeCL version does
//! not reuse Burn's old kernels either (a published smp-burn pins Burn exactly, so there its
//! version covers that).

use std::path::{Path, PathBuf};

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// 64-bit FNV-1a: stable across Rust versions and platforms, unlike std's hashers.
fn fnv1a(hash: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *hash ^= u64::from(*b);
        *hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
}

fn main() {
    let src = Path::new("src");
    println!("cargo:rerun-if-changed=src");
    let mut files = Vec::new();
    collect(src, &mut files);
    files.sort();
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for file in &files {
        let rel = file.strip_prefix(src).unwrap_or(file);
        fnv1a(&mut hash, rel.to_string_lossy().as_bytes());
        fnv1a(&mut hash, &[0]);
        fnv1a(&mut hash, &std::fs::read(file).unwrap_or_default());
        fnv1a(&mut hash, &[0]);
    }
    let lock = Path::new("../../Cargo.lock");
    if lock.is_file() {
        println!("cargo:rerun-if-changed=../../Cargo.lock");
        fnv1a(&mut hash, &std::fs::read(lock).unwrap_or_default());
    }
    // The vendored CubeCL crates' sources, where the workspace has them: an edit to their code
    // generation changes kernels as much as an edit here.
    let vendor = Path::new("../../vendor");
    if vendor.is_dir() {
        println!("cargo:rerun-if-changed=../../vendor");
        let mut files = Vec::new();
        collect(vendor, &mut files);
        files.sort();
        for file in &files {
            fnv1a(&mut hash, &std::fs::read(file).unwrap_or_default());
        }
    }
    println!("cargo:rustc-env=KERNEL_SOURCE_FINGERPRINT={hash:016x}");
    // The vendored CubeCL crates announce what they add (`links` metadata); upstream's do not.
    cfg_from_dep(
        "cubecl_bulk_reduce",
        "DEP_CUBECL_IR_SMP_BURN_BULK_REDUCE_ADD_F32",
    );
    cfg_from_dep("cubecl_wgmma", "DEP_CUBECL_IR_SMP_BURN_WGMMA");
    cfg_from_dep(
        "cubecl_launch_stream",
        "DEP_CUBECL_CUDA_SMP_BURN_LAUNCH_STREAM",
    );
}

/// Sets `cfg(name)` where a direct dependency's build script exported the metadata that cargo
/// passes here as `dep_var`.
fn cfg_from_dep(name: &str, dep_var: &str) {
    println!("cargo:rustc-check-cfg=cfg({name})");
    println!("cargo:rerun-if-env-changed={dep_var}");
    if std::env::var_os(dep_var).is_some() {
        println!("cargo:rustc-cfg={name}");
    }
}
