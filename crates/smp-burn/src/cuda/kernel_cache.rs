//! Where CubeCL keeps compiled kernels and autotune results.
//!
//! CubeCL's default is the `target` folder of the working directory, which a user running an
//! installed binary does not have: every run would compile its kernels again (minutes for a
//! Llama block on a fresh machine). We point both caches at the user's cache folder instead,
//! unless the user configured CubeCL with a `cubecl.toml` / `burn.toml` of their own.

use std::path::{Path, PathBuf};

use cubecl::config::cache::CacheConfig;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// `$SMP_BURN_CACHE_DIR`, else `$XDG_CACHE_HOME/smp-burn/cubecl`, else
/// `$HOME/.cache/smp-burn/cubecl`, else `.smp-burn-cache` in the working directory; inside it,
/// one folder per build of smp-burn's sources ([`kernel_cache_build`]).
pub fn kernel_cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("SMP_BURN_CACHE_DIR")
        .or_else(|| {
            var("XDG_CACHE_HOME")
                .or_else(|| var("HOME").map(|h| h.join(".cache")))
                .map(|c| c.join("smp-burn").join("cubecl"))
        })
        .unwrap_or_else(|| PathBuf::from(".smp-burn-cache"))
        .join(kernel_cache_build())
}

/// The cache folder's name for this build: smp-burn's version and a fingerprint of its
/// sources (`build.rs`). CubeCL keys cached PTX by a kernel's type name and settings, not its
/// code, so without this a kernel changed by an edit or an upgrade would load its old PTX.
pub fn kernel_cache_build() -> String {
    format!(
        "{}-{}",
        env!("CARGO_PKG_VERSION"),
        env!("SMP_BURN_SOURCE_FINGERPRINT")
    )
}

/// A CubeCL configuration file in `start` or one of its parents, which CubeCL would read and
/// which then takes precedence over ours.
pub fn user_cubecl_config(start: &Path) -> Option<PathBuf> {
    start.ancestors().find_map(|dir| {
        ["cubecl.toml", "CubeCL.toml", "burn.toml", "Burn.toml"]
            .iter()
            .map(|name| dir.join(name))
            .find(|p| p.is_file())
    })
}

/// Points CubeCL's kernel and autotune caches at [`kernel_cache_dir`] and returns it, or
/// returns the user's own configuration file if there is one (then nothing is changed). Must
/// run before the first CUDA tensor is created; calling it twice is harmless.
pub fn configure_kernel_cache() -> Result<PathBuf, PathBuf> {
    static CONFIGURED: std::sync::OnceLock<Result<PathBuf, PathBuf>> = std::sync::OnceLock::new();
    CONFIGURED
        .get_or_init(|| {
            let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
            if let Some(file) = user_cubecl_config(&cwd) {
                return Err(file);
            }
            let dir = kernel_cache_dir();
            // A cache that cannot be created only costs recompilation; CubeCL reports it.
            let _ = std::fs::create_dir_all(&dir);
            let mut config = CubeClRuntimeConfig::default();
            config.compilation.cache = Some(CacheConfig::File(dir.clone()));
            config.autotune.cache = CacheConfig::File(dir.clone());
            CubeClRuntimeConfig::set(config);
            Ok(dir)
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_config_file_in_a_parent() {
        let root = std::env::temp_dir().join(format!("smp-cache-test-{}", std::process::id()));
        let nested = root.join("a/b");
        std::fs::create_dir_all(&nested).unwrap();
        assert_eq!(user_cubecl_config(&nested), None);
        std::fs::write(root.join("cubecl.toml"), "").unwrap();
        assert_eq!(user_cubecl_config(&nested), Some(root.join("cubecl.toml")));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn cache_dir_is_under_a_cache_folder() {
        let dir = kernel_cache_dir();
        assert_eq!(dir.file_name(), Some(kernel_cache_build().as_ref()));
        let root = dir.parent().expect("the build folder has a parent");
        assert!(
            root.ends_with("smp-burn/cubecl") || std::env::var_os("SMP_BURN_CACHE_DIR").is_some()
        );
    }

    #[test]
    fn cache_build_names_version_and_sources() {
        let build = kernel_cache_build();
        let (version, fingerprint) = build.rsplit_once('-').expect("version-fingerprint");
        assert_eq!(version, env!("CARGO_PKG_VERSION"));
        assert_eq!(fingerprint.len(), 16, "{build}");
        assert!(
            fingerprint.bytes().all(|b| b.is_ascii_hexdigit()),
            "{build}"
        );
    }
}
