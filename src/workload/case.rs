//! Read an oomprobe TOML case file: a workload and the runs expected of it.
//!
//! A case file (`.toml`) is strict: unknown keys, wrong types and missing required fields are
//! errors naming the field and the file. Format:
//! ```toml
//! name = "LLaMA-13B full training on an 80 GB card"   # required
//! description = "..."                                   # optional
//! memory = "80GB"                                       # optional SIZE
//! [workload]       # required: `model` or `params`, and any override key of the CLI
//! model = "llama-13b"
//! [[expect]]       # one or more; each may override workload keys
//! verdict = "oom"  # "oom" | "fits"
//! cause = "model_too_large"   # optional
//! ```
//!
//! Each table is checked as it is read by the `check` the caller passes (`resolve::load_case`
//! resolves it as the command line would), so an error names the table and the file.

use std::path::{Path, PathBuf};

use crate::error::CliError;
use crate::units::parse_size;

use super::args::{merge, WorkloadArgs};
use super::config::{field_err, ConfigError};
use super::Workload;

/// The outcome a case expects of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Oom,
    Fits,
}

/// One `[[expect]]` run of a case.
#[derive(Debug, Clone)]
pub struct Expectation {
    /// The run's workload keys (strings as on the command line), applied over `[workload]`.
    pub overrides: WorkloadArgs,
    pub verdict: Verdict,
    /// diagnose's expected cause (model_too_large | batch_too_large | sequence_too_long |
    /// activations_explode | fits).
    pub cause: Option<String>,
}

/// An oomprobe TOML case file.
#[derive(Debug, Clone)]
pub struct CaseFile {
    pub path: PathBuf,
    pub name: String,
    pub description: Option<String>,
    /// The card's memory in bytes.
    pub memory: Option<u64>,
    /// The `[workload]` keys as command-line arguments.
    pub base: WorkloadArgs,
    /// The resolved `[workload]`.
    pub workload: Workload,
    pub expects: Vec<Expectation>,
}

/// The causes diagnose names (JSON `cause`).
pub const CAUSES: [&str; 5] = [
    "model_too_large",
    "batch_too_large",
    "sequence_too_long",
    "activations_explode",
    "fits",
];

impl CaseFile {
    /// The command-line arguments of expectation `i`: `[workload]` with the run's keys over it.
    pub fn args_for(&self, i: usize) -> Option<WorkloadArgs> {
        let e = self.expects.get(i)?;
        Some(merge(&self.base, &e.overrides))
    }
}

/// The most `[[expect]]` runs a case file may have.
pub const MAX_EXPECTS: usize = 256;

/// Workload keys of a case file and how each is typed.
const STRING_KEYS: [&str; 18] = [
    "precision",
    "optimizer",
    "attention",
    "checkpoint",
    "model",
    "mode",
    "grads",
    "outputs",
    "dropout_mask",
    "step",
    "optimizer_impl",
    "gelu",
    "autocast_device",
    "cuda_modules",
    "float8",
    "head",
    "torch_version",
    "attention_mask",
];
const NUMBER_KEYS: [&str; 16] = [
    "batch",
    "seq",
    "layers",
    "hidden",
    "heads",
    "ffn",
    "vocab",
    "image",
    "params",
    "zero",
    "gpus",
    "kv_heads",
    "experts",
    "experts_per_token",
    "loss_chunk",
    "num_labels",
];

fn set_arg(args: &mut WorkloadArgs, key: &str, v: String) {
    let slot = match key {
        "model" => &mut args.model,
        "batch" => &mut args.batch,
        "seq" => &mut args.seq,
        "layers" => &mut args.layers,
        "hidden" => &mut args.hidden,
        "heads" => &mut args.heads,
        "ffn" => &mut args.ffn,
        "vocab" => &mut args.vocab,
        "image" => &mut args.image,
        "params" => &mut args.params,
        "precision" => &mut args.precision,
        "optimizer" => &mut args.optimizer,
        "attention" => &mut args.attention,
        "checkpoint" => &mut args.checkpoint,
        "dropout" => &mut args.dropout,
        "kv_cache" => &mut args.kv_cache,
        "optimizer_in_backward" => &mut args.optimizer_in_backward,
        "cuda_modules" => &mut args.cuda_modules,
        "float8" => &mut args.float8,
        "loss_chunk" => &mut args.loss_chunk,
        "head" => &mut args.head,
        "torch_version" => &mut args.torch_version,
        "attention_mask" => &mut args.attention_mask,
        "num_labels" => &mut args.num_labels,
        "mode" => &mut args.mode,
        "grads" => &mut args.grads,
        "outputs" => &mut args.outputs,
        "dropout_mask" => &mut args.dropout_mask,
        "step" => &mut args.step,
        "optimizer_impl" => &mut args.optimizer_impl,
        "gelu" => &mut args.gelu,
        "zero" => &mut args.zero,
        "kv_heads" => &mut args.kv_heads,
        "experts" => &mut args.experts,
        "experts_per_token" => &mut args.experts_per_token,
        "autocast_device" => &mut args.autocast_device,
        _ => &mut args.gpus,
    };
    *slot = Some(v);
}

/// Read one workload key of a case file into `args`; `Ok(false)` if `key` is not a workload key.
fn workload_key(
    path: &str,
    field: &str,
    key: &str,
    v: &toml::Value,
    args: &mut WorkloadArgs,
) -> Result<bool, ConfigError> {
    use toml::Value as T;
    if STRING_KEYS.contains(&key) {
        match v {
            T::String(s) => set_arg(args, key, s.clone()),
            other => {
                return Err(field_err(
                    path,
                    field,
                    format!("expected a string, found {}", other.type_str()),
                ))
            }
        }
    } else if NUMBER_KEYS.contains(&key) {
        match v {
            T::Integer(i) if *i > 0 || key == "zero" && *i == 0 => {
                set_arg(args, key, i.to_string())
            }
            T::Integer(i) => {
                return Err(field_err(
                    path,
                    field,
                    format!("must be greater than zero, found {i}"),
                ))
            }
            T::Float(f) if *f >= 1.0 && f.fract() == 0.0 && *f < 1.8e19 => {
                set_arg(args, key, format!("{}", *f as u64))
            }
            T::String(s) => set_arg(args, key, s.clone()),
            other => {
                return Err(field_err(
                    path,
                    field,
                    format!("expected a positive integer, found {}", other.type_str()),
                ))
            }
        }
    } else if matches!(key, "dropout" | "kv_cache" | "optimizer_in_backward") {
        match v {
            T::Boolean(b) => set_arg(args, key, if *b { "on" } else { "off" }.to_string()),
            other => {
                return Err(field_err(
                    path,
                    field,
                    format!("expected true or false, found {}", other.type_str()),
                ))
            }
        }
    } else if key == "tp" || args.parallel.slot(key).is_some() {
        // The layout: numbers, names and on/off as their flags take them.
        let text = match v {
            T::String(s) => s.clone(),
            T::Integer(i) => i.to_string(),
            T::Boolean(b) => if *b { "on" } else { "off" }.to_string(),
            other => {
                return Err(field_err(
                    path,
                    field,
                    format!(
                        "expected a number, a name or a boolean, found {}",
                        other.type_str()
                    ),
                ))
            }
        };
        match args.parallel.slot(key) {
            Some(slot) => *slot = Some(text),
            None => args.serve.tp = Some(text),
        }
    } else {
        return Ok(false);
    }
    Ok(true)
}

/// Read an oomprobe case file; `check` resolves a table's arguments into its workload.
pub fn read_case(
    file: &Path,
    text: &str,
    check: &dyn Fn(&WorkloadArgs) -> Result<Workload, CliError>,
) -> Result<CaseFile, ConfigError> {
    // A failure names the table and the file.
    let check_args = |path: &str, table: &str, args: &WorkloadArgs| {
        check(args).map_err(|e| field_err(path, table, e.to_string()))
    };
    let path = file.display().to_string();
    let path = path.as_str();
    let root: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Syntax {
        path: path.into(),
        format: "TOML",
        msg: e.to_string().lines().next().unwrap_or("").to_string(),
    })?;
    let (name, description, memory) = case_header(path, &root)?;
    let base = case_workload(path, &root)?;
    let workload = check_args(path, "workload", &base)?;
    let list = expect_list(path, &root)?;
    let mut expects = Vec::new();
    for (i, e) in list.iter().enumerate() {
        let expect = read_expect(path, i, e)?;
        check_args(
            path,
            &format!("expect[{i}]"),
            &merge(&base, &expect.overrides),
        )?;
        expects.push(expect);
    }
    Ok(CaseFile {
        path: file.to_path_buf(),
        name,
        description,
        memory,
        base,
        workload,
        expects,
    })
}

/// The top-level keys checked, and the case's name, description and memory.
fn case_header(
    path: &str,
    root: &toml::Table,
) -> Result<(String, Option<String>, Option<u64>), ConfigError> {
    for key in root.keys() {
        if !["name", "description", "memory", "workload", "expect"].contains(&key.as_str()) {
            return Err(field_err(
                path,
                key,
                "unknown key (name, description, memory, [workload], [[expect]])",
            ));
        }
    }
    let string = |key: &str| -> Result<Option<String>, ConfigError> {
        match root.get(key) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(field_err(
                path,
                key,
                format!("expected a string, found {}", v.type_str()),
            )),
        }
    };
    let name = string("name")?.ok_or_else(|| field_err(path, "name", "missing (required)"))?;
    let description = string("description")?;
    let memory = match root.get("memory") {
        None => None,
        Some(toml::Value::String(s)) => {
            Some(parse_size(s).map_err(|e| field_err(path, "memory", e.to_string()))?)
        }
        Some(toml::Value::Integer(i)) if *i > 0 => Some(*i as u64),
        Some(v) => {
            return Err(field_err(
                path,
                "memory",
                format!("expected a SIZE such as \"80GB\", found {}", v.type_str()),
            ))
        }
    };
    Ok((name, description, memory))
}

/// The `[workload]` table as command-line arguments (a model or a parameter count required).
fn case_workload(path: &str, root: &toml::Table) -> Result<WorkloadArgs, ConfigError> {
    let wt = match root.get("workload") {
        None => return Err(field_err(path, "workload", "missing (required table)")),
        Some(toml::Value::Table(t)) => t,
        Some(v) => {
            return Err(field_err(
                path,
                "workload",
                format!("expected a table, found {}", v.type_str()),
            ))
        }
    };
    let mut base = WorkloadArgs::default();
    for (k, v) in wt {
        let field = format!("workload.{k}");
        if !workload_key(path, &field, k, v, &mut base)? {
            return Err(field_err(path, &field, "unknown key"));
        }
    }
    if base.model.is_none() && base.params.is_none() {
        return Err(field_err(
            path,
            "workload.model",
            "missing (required unless workload.params is given)",
        ));
    }
    Ok(base)
}

/// The `[[expect]]` tables: at least one, at most `MAX_EXPECTS`.
fn expect_list<'a>(path: &str, root: &'a toml::Table) -> Result<&'a [toml::Value], ConfigError> {
    let list = match root.get("expect") {
        None => {
            return Err(field_err(
                path,
                "expect",
                "missing: at least one [[expect]] table is required",
            ))
        }
        Some(toml::Value::Array(a)) if !a.is_empty() => a,
        Some(v) => {
            return Err(field_err(
                path,
                "expect",
                format!(
                    "expected one or more [[expect]] tables, found {}",
                    v.type_str()
                ),
            ))
        }
    };
    if list.len() > MAX_EXPECTS {
        return Err(field_err(
            path,
            "expect",
            format!(
                "{} [[expect]] runs; at most {MAX_EXPECTS} (split the case into files)",
                list.len()
            ),
        ));
    }
    Ok(list)
}

/// One `[[expect]]` table: its verdict, cause and workload overrides (resolved by the caller).
fn read_expect(path: &str, i: usize, e: &toml::Value) -> Result<Expectation, ConfigError> {
    let t = e.as_table().ok_or_else(|| {
        field_err(
            path,
            &format!("expect[{i}]"),
            format!("expected a table, found {}", e.type_str()),
        )
    })?;
    let mut overrides = WorkloadArgs::default();
    let mut verdict = None;
    let mut cause = None;
    for (k, v) in t {
        let field = format!("expect[{i}].{k}");
        match (k.as_str(), v) {
            ("verdict", toml::Value::String(s)) => {
                verdict = Some(match s.as_str() {
                    "oom" => Verdict::Oom,
                    "fits" => Verdict::Fits,
                    _ => {
                        return Err(field_err(
                            path,
                            &field,
                            format!("'{s}' is not a verdict (oom, fits)"),
                        ))
                    }
                })
            }
            ("cause", toml::Value::String(s)) => {
                if !CAUSES.contains(&s.as_str()) {
                    return Err(field_err(
                        path,
                        &field,
                        format!("'{s}' is not a cause ({})", CAUSES.join(", ")),
                    ));
                }
                cause = Some(s.clone());
            }
            ("verdict" | "cause", v) => {
                return Err(field_err(
                    path,
                    &field,
                    format!("expected a string, found {}", v.type_str()),
                ))
            }
            _ => {
                if !workload_key(path, &field, k, v, &mut overrides)? {
                    return Err(field_err(path, &field, "unknown key"));
                }
            }
        }
    }
    let verdict = verdict
        .ok_or_else(|| field_err(path, &format!("expect[{i}].verdict"), "missing (required)"))?;
    Ok(Expectation {
        overrides,
        verdict,
        cause,
    })
}
