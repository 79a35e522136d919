//! Where CubeCL keeps compiled kernels and autotune results.
//!
//! CubeCL's default is the `target` folder of the working directory, which a user running an
//! installed binary does not have: every run would compile its kernels again (minutes for a
//! Llama block on a fresh machine). We point both caches at the user's cache folder instead,
//! unless the user configured CubeCL with a `cubecl.toml` / `burn.toml` of their own.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use cubecl::config::cache::CacheConfig;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// [`KernelConfig::cache_dir`](crate::KernelConfig::cache_dir), else
/// `$XDG_CACHE_HOME/smp-burn/cubecl`, else
/// `$HOME/.cache/smp-burn/cubecl`, else `.smp-burn-cache` in the working directory; inside it,
/// one folder per build of smp-burn's sources ([`kernel_cache_build`]).
pub fn kernel_cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    crate::KernelConfig::current()
        .cache_dir
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
        env!("KERNEL_SOURCE_FINGERPRINT")
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
            mark_used(&dir);
            let pruned = prune_stale_builds(&dir, STALE_BUILD_AGE);
            if pruned > 0 {
                tracing::info!(
                    "removed {pruned} kernel cache folder(s) of other smp-burn builds unused for \
                     {} days, beside {}",
                    STALE_BUILD_AGE.as_secs() / 86_400,
                    dir.display()
                );
            }
            let mut config = CubeClRuntimeConfig::default();
            config.compilation.cache = Some(CacheConfig::File(dir.clone()));
            config.autotune.cache = CacheConfig::File(dir.clone());
            CubeClRuntimeConfig::set(config);
            Ok(dir)
        })
        .clone()
}

/// How long another build's cache folder may go unused before [`configure_kernel_cache`]
/// removes it: each edit or upgrade of smp-burn starts a new folder, and kernels of a build
/// nobody has run for a month are not worth their disk space.
const STALE_BUILD_AGE: Duration = Duration::from_secs(30 * 86_400);

/// The file whose modification time says when a build folder was last used.
const LAST_USED: &str = "last-used";

/// Records that this build's cache folder is in use (see [`prune_stale_builds`]).
fn mark_used(build_dir: &Path) {
    let _ = std::fs::write(build_dir.join(LAST_USED), b"");
}

/// Whether `name` is a build folder's name as [`kernel_cache_build`] makes them: a version,
/// `-`, and 16 hex digits. Nothing else in the cache folder is ever removed.
fn is_build_folder_name(name: &str) -> bool {
    name.rsplit_once('-').is_some_and(|(version, fingerprint)| {
        version.starts_with(|c: char| c.is_ascii_digit())
            && fingerprint.len() == 16
            && fingerprint.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

/// Removes the build folders beside `build_dir` (other builds of smp-burn) whose last use is
/// older than `max_age`, and returns how many it removed. Failures (a folder another process
/// is removing, no permission) are skipped: they only cost disk space.
fn prune_stale_builds(build_dir: &Path, max_age: Duration) -> usize {
    let (Some(root), Some(own)) = (build_dir.parent(), build_dir.file_name()) else {
        return 0;
    };
    let Ok(entries) = std::fs::read_dir(root) else {
        return 0;
    };
    let now = SystemTime::now();
    let mut removed = 0;
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == own || !path.is_dir() || !name.to_str().is_some_and(is_build_folder_name) {
            continue;
        }
        let last_used = std::fs::metadata(path.join(LAST_USED))
            .or_else(|_| entry.metadata())
            .and_then(|m| m.modified());
        let stale = last_used
            .ok()
            .and_then(|t| now.duration_since(t).ok())
            .is_some_and(|age| age > max_age);
        if stale && std::fs::remove_dir_all(&path).is_ok() {
            removed += 1;
        }
    }
    removed
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
            root.ends_with("smp-burn/cubecl") || crate::KernelConfig::current().cache_dir.is_some()
        );
    }

    #[test]
    fn prunes_only_other_builds_unused_for_long() {
        let root = std::env::temp_dir().join(format!("smp-cache-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let build = |name: &str, days_ago: u64| {
            let dir = root.join(name);
            std::fs::create_dir_all(dir.join("cuda")).unwrap();
            mark_used(&dir);
            let when = SystemTime::now() - Duration::from_secs(days_ago * 86_400);
            std::fs::File::options()
                .write(true)
                .open(dir.join(LAST_USED))
                .unwrap()
                .set_modified(when)
                .unwrap();
            dir
        };
        let own = build("0.1.0-00000000000000aa", 90);
        let stale = build("0.1.0-00000000000000bb", 31);
        let recent = build("0.2.0-00000000000000cc", 2);
        let not_ours = build("notes", 90);
        assert_eq!(prune_stale_builds(&own, STALE_BUILD_AGE), 1);
        assert!(
            own.is_dir(),
            "the running build's folder is kept, however old"
        );
        assert!(!stale.exists());
        assert!(recent.is_dir());
        assert!(
            not_ours.is_dir(),
            "only folders named like builds are removed"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn build_folder_names() {
        assert!(is_build_folder_name(&kernel_cache_build()));
        assert!(is_build_folder_name("0.1.0-rc.1-0123456789abcdef"));
        assert!(!is_build_folder_name("cuda"));
        assert!(!is_build_folder_name("0.1.0-0123"));
        assert!(!is_build_folder_name("v-0123456789abcdef"));
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
