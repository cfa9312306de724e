//! Model ids (`--model ORG/NAME`) resolved to a config.json in the local Hugging Face cache,
//! offline: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`, laid out as
//! `models--ORG--NAME/snapshots/<commit>/config.json` with `refs/<ref>` naming a commit (what
//! `huggingface_hub` writes). A folder holding a config.json works too. Nothing is downloaded.

use std::path::{Path, PathBuf};

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HubError {
    #[error("model '{id}' is not in the local Hugging Face cache (looked in {}); fetch its config with: huggingface-cli download {id} config.json", .looked.display())]
    NotCached { id: String, looked: PathBuf },
    #[error("model '{id}' has no revision '{revision}' in the local cache ({}); cached: {}", .dir.display(), .cached.join(", "))]
    NoRevision {
        id: String,
        revision: String,
        dir: PathBuf,
        cached: Vec<String>,
    },
    #[error("folder '{0}' has no config.json")]
    NoConfig(String),
    #[error("cannot read the cache's ref {}: {why}", .path.display())]
    BadRef { path: PathBuf, why: String },
}

/// The largest ref file read (a ref holds one commit hash: 40 hex digits).
const MAX_REF_BYTES: u64 = 4 << 10;

/// True when `model` names a Hugging Face id or a folder rather than a preset: it has a slash.
pub fn is_id_or_path(model: &str) -> bool {
    model.contains('/') || model.contains(std::path::MAIN_SEPARATOR)
}

/// The hub cache folder the environment selects (`HF_HUB_CACHE`, `HF_HOME/hub`, the default).
pub fn cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = var("HF_HUB_CACHE").or_else(|| var("HUGGINGFACE_HUB_CACHE")) {
        return d;
    }
    if let Some(h) = var("HF_HOME") {
        return h.join("hub");
    }
    let home = var("HOME").unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("huggingface").join("hub")
}

/// The config.json of `model`: a folder's own, or the cached snapshot of an id at `revision`
/// (a ref such as `main` or a commit hash; default: `refs/main`, else the newest snapshot).
pub fn config_path(model: &str, revision: Option<&str>) -> Result<PathBuf, HubError> {
    let as_path = Path::new(model);
    if as_path.is_dir() {
        let c = as_path.join("config.json");
        return if c.is_file() {
            Ok(c)
        } else {
            Err(HubError::NoConfig(model.to_string()))
        };
    }
    let cache = cache_dir();
    let repo = cache.join(format!("models--{}", model.replace('/', "--")));
    let snapshots = repo.join("snapshots");
    let not_cached = || HubError::NotCached {
        id: model.to_string(),
        looked: repo.clone(),
    };
    let mut cached: Vec<(std::time::SystemTime, String)> = std::fs::read_dir(&snapshots)
        .map_err(|_| not_cached())?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("config.json").is_file())
        .map(|e| {
            let t = e
                .metadata()
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            (t, e.file_name().to_string_lossy().into_owned())
        })
        .collect();
    if cached.is_empty() {
        return Err(not_cached());
    }
    cached.sort();
    // A ref that is not there is None; one that is there but cannot be read (a FIFO, a link to
    // a device, a huge file) is an error, not a silent fall back to another snapshot.
    let read_ref = |r: &str| -> Result<Option<String>, HubError> {
        let path = repo.join("refs").join(r);
        if std::fs::symlink_metadata(&path).is_err() {
            return Ok(None);
        }
        crate::input::read_text_capped(&path, MAX_REF_BYTES)
            .map(|s| Some(s.trim().to_string()))
            .map_err(|e| HubError::BadRef {
                path: path.clone(),
                why: e.to_string(),
            })
    };
    let commit = match revision {
        Some(rev) => {
            let c = read_ref(rev)?.unwrap_or_else(|| rev.to_string());
            // A commit may be given by its prefix.
            cached
                .iter()
                .map(|(_, n)| n.clone())
                .find(|n| *n == c || (c.len() >= 7 && n.starts_with(&c)))
                .ok_or_else(|| HubError::NoRevision {
                    id: model.to_string(),
                    revision: rev.to_string(),
                    dir: snapshots.clone(),
                    cached: cached.iter().map(|(_, n)| n.clone()).collect(),
                })?
        }
        None => read_ref("main")?
            .filter(|c| cached.iter().any(|(_, n)| n == c))
            .unwrap_or_else(|| cached.last().map(|(_, n)| n.clone()).unwrap_or_default()),
    };
    Ok(snapshots.join(commit).join("config.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_presets_are_told_apart() {
        assert!(is_id_or_path("Qwen/Qwen2.5-7B"));
        assert!(is_id_or_path("./my-model"));
        assert!(!is_id_or_path("llama3-8b"));
    }
}
