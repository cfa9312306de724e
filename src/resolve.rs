//! The command line and config files into a checked Workload: the base a `--config` file, a
//! Hugging Face model or a preset gives, the overrides applied (`workload::overrides`), then the
//! planner's checks (`plan::build::validate`, and for a config.json whether its sizes overflow the
//! plan together). Every error is a `CliError::Usage` naming the flag or the file's field. A case
//! file's tables are resolved as they are read, so case files are loaded here too.
//!
//! This sits above `plan`: `workload` holds the model and its readers and never calls the planner.

use std::path::Path;

use crate::error::CliError;
use crate::plan::build::{validate, PlanError};
use crate::plan::Plan;
use crate::workload::args::WorkloadArgs;
use crate::workload::case::{read_case, CaseFile};
use crate::workload::config::{field_err, is_case_path, read_text, ConfigError};
use crate::workload::flags::usage;
use crate::workload::overrides::{self, Resolved};
use crate::workload::{hf, hub, presets, Workload};

/// Resolve the workload of `args`, with warnings: the base (`--config FILE`, a Hugging Face
/// config.json or an oomprobe case file; else `--model`; else `--params` alone, a bare "dense"
/// parameter count; else the caller's default preset), then every override
/// (`workload::overrides::apply`), then the shape checked as a whole (`plan::build::validate`).
pub fn resolve(args: &WorkloadArgs, default_preset: &str) -> Result<Resolved, CliError> {
    let w = if let Some(path) = &args.config {
        if args.model.is_some() {
            return Err(CliError::usage(
                "--model and --config cannot be used together",
            ));
        }
        match load_config(path).map_err(|e| CliError::usage(e.to_string()))? {
            LoadedConfig::Hf(w) => *w,
            LoadedConfig::Case(c) => c.workload.clone(),
        }
    } else if let Some(m) = args.model.as_deref().filter(|m| hub::is_id_or_path(m)) {
        // A Hugging Face id (from the local cache, offline) or a folder with a config.json.
        let path = hub::config_path(m, args.revision.as_deref()).map_err(|e| usage("model", e))?;
        match load_config(&path).map_err(|e| CliError::usage(e.to_string()))? {
            LoadedConfig::Hf(w) => {
                let mut w = *w;
                w.name = m.trim_end_matches('/').to_string();
                w
            }
            LoadedConfig::Case(c) => c.workload.clone(),
        }
    } else if let Some(m) = &args.model {
        presets::get(m).map_err(|e| usage("model", e))?
    } else if args.params.is_some() {
        presets::get("dense").map_err(|e| usage("model", e))?
    } else {
        presets::get(default_preset).map_err(|e| usage("model", e))?
    };
    if args.revision.is_some() && !args.model.as_deref().is_some_and(hub::is_id_or_path) {
        return Err(usage(
            "revision",
            "goes with --model ORG/NAME (a model in the local Hugging Face cache)",
        ));
    }
    let name = w.name.clone();
    let r = overrides::apply(args, w)?;
    validate(&r.workload).map_err(|e| CliError::usage(format!("invalid workload {name}: {e}")))?;
    Ok(r)
}

/// Resolve the workload and print its warnings to stderr (`log::warn`).
pub fn resolve_workload(args: &WorkloadArgs, default_preset: &str) -> Result<Workload, CliError> {
    let r = resolve(args, default_preset)?;
    for w in &r.warnings {
        log::warn!("{w}");
    }
    Ok(r.workload)
}

/// What a config file holds.
#[derive(Debug, Clone)]
pub enum LoadedConfig {
    /// A Hugging Face config.json.
    Hf(Box<Workload>),
    /// An oomprobe case file.
    Case(Box<CaseFile>),
}

/// Load a config.json (any extension but `.toml`) or a case file (`.toml`).
pub fn load_config(path: &Path) -> Result<LoadedConfig, ConfigError> {
    let text = read_text(path)?;
    if is_case_path(path) {
        return load_case(path, &text).map(|c| LoadedConfig::Case(Box::new(c)));
    }
    let p = path.display().to_string();
    let (w, fields) = hf::read(&p, &text)?;
    // Sizes each within their limit can still overflow together: name the fields.
    if let Err(e @ PlanError::Overflow { .. }) = Plan::for_workload(&w) {
        return Err(field_err(&p, &fields, format!("together too large: {e}")));
    }
    Ok(LoadedConfig::Hf(Box::new(w)))
}

/// Read an oomprobe case file, each table resolved as the command line would be.
pub fn load_case(file: &Path, text: &str) -> Result<CaseFile, ConfigError> {
    read_case(file, text, &|args| {
        resolve(args, "gpt2").map(|r| r.workload)
    })
}

// The case file's type is `workload::case`'s; resolving one of its runs is this module's job.
impl CaseFile {
    /// The resolved workload of expectation `i`.
    pub fn workload_for(&self, i: usize) -> Result<Workload, CliError> {
        let args = self.args_for(i).ok_or_else(|| {
            CliError::usage(format!("case '{}' has no expectation {i}", self.name))
        })?;
        resolve(&args, "gpt2").map(|r| r.workload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Arch, Checkpoint};

    fn args() -> WorkloadArgs {
        WorkloadArgs::default()
    }

    #[test]
    fn overrides_apply_and_check() {
        let mut a = args();
        a.model = Some("gpt2".into());
        a.batch = Some("8".into());
        a.seq = Some("2048".into());
        a.checkpoint = Some("every:4".into());
        let r = resolve(&a, "gpt2").unwrap();
        assert_eq!(r.workload.batch, 8);
        assert_eq!(r.workload.seq, 2048);
        assert_eq!(r.workload.checkpoint, Checkpoint::Every(4));
        assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);

        let mut a = args();
        a.heads = Some("7".into());
        let e = resolve(&a, "gpt2").unwrap_err().to_string();
        assert!(e.contains("heads (7) must divide hidden (768)"), "{e}");

        let mut a = args();
        a.checkpoint = Some("every:0".into());
        let e = resolve(&a, "gpt2").unwrap_err().to_string();
        assert!(e.starts_with("--checkpoint"), "{e}");

        let mut a = args();
        a.batch = Some("0".into());
        assert!(resolve(&a, "gpt2")
            .unwrap_err()
            .to_string()
            .starts_with("--batch"));

        let mut a = args();
        a.model = Some("resnet50".into());
        a.seq = Some("10".into());
        assert!(resolve(&a, "gpt2")
            .unwrap_err()
            .to_string()
            .starts_with("--seq"));

        let mut a = args();
        a.params = Some("7B".into());
        let r = resolve(&a, "gpt2").unwrap();
        assert_eq!(r.workload.arch, Arch::Dense);
        assert_eq!(r.workload.params, Some(7_000_000_000));
    }

    #[test]
    fn vit_image_sets_tokens() {
        let mut a = args();
        a.model = Some("vit-b16".into());
        a.image = Some("384".into());
        assert_eq!(resolve(&a, "gpt2").unwrap().workload.seq, 577);
    }

    const CASE: &str = r#"
name = "LLaMA-13B full training on an 80 GB card"
memory = "80GB"
[workload]
model = "llama-13b"
precision = "mixed"
optimizer = "adam"
batch = 1
seq = 2048
[[expect]]
verdict = "oom"
cause = "model_too_large"
[[expect]]
batch = 8
seq = 512
dropout = false
verdict = "fits"
"#;

    #[test]
    fn case_file_parses() {
        let c = load_case(Path::new("c.toml"), CASE).unwrap();
        assert_eq!(c.memory, Some(80_000_000_000));
        assert_eq!(c.expects.len(), 2);
        assert_eq!(c.expects[0].cause.as_deref(), Some("model_too_large"));
        let w1 = c.workload_for(1).unwrap();
        assert_eq!((w1.batch, w1.seq), (8, 512));
        assert_eq!(c.workload_for(0).unwrap().seq, 2048);
    }

    #[test]
    fn case_file_errors_name_the_field() {
        let bad = CASE.replace("batch = 8", "batchh = 8");
        let e = load_case(Path::new("c.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("expect[1].batchh") && e.contains("c.toml"),
            "{e}"
        );
        let bad = CASE.replace("batch = 1\n", "batch = \"x\"\n");
        let e = load_case(Path::new("c.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("'workload'") && e.contains("--batch"), "{e}");
        let bad = CASE.replace("seq = 2048", "seq = true");
        let e = load_case(Path::new("c.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("workload.seq"), "{e}");
        let bad = CASE.replace("name = ", "title = ");
        let e = load_case(Path::new("c.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("'title'"), "{e}");
        let bad = CASE.replace("verdict = \"oom\"\n", "");
        let e = load_case(Path::new("c.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expect[0].verdict"), "{e}");
    }
}
