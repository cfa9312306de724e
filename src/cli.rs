//! The command line (contract in README.md): clap definitions only; parsing into checked,
//! typed options happens in `resolve` (the workload flags, `workload::args`) and the command
//! modules.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::help;
use crate::scenario::Scenario;

#[derive(Debug, Parser)]
#[command(
    name = "oomprobe",
    version,
    about = "Find the real out-of-memory boundary of deep-learning workloads on the GPU at hand",
    long_about = "oomprobe allocates the tensors a training step holds at its peak, runs real compute \
kernels over them (WGSL through wgpu, or CUDA through cudarc) and scales batch, sequence or \
parameter count until allocation fails. Each empirical boundary is printed beside the analytic \
prediction from the same plan."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// List every adapter wgpu (and CUDA) can see, with memory and buffer limits.
    #[command(after_help = help::DEVICES)]
    Devices(DevicesArgs),
    /// Memory breakdown of a workload by role; with --memory, the predicted max per scenario.
    #[command(after_help = help::ESTIMATE)]
    Estimate(EstimateArgs),
    /// Find the real out-of-memory boundary on this device: the largest batch, sequence or
    /// parameter count that fits, measured, beside the prediction.
    #[command(after_help = help::PROBE)]
    Probe(ProbeArgs),
    /// Why a workload runs out of memory (model, batch, sequence or stored activations), what
    /// each remedy buys, and the ways out: combinations of changes that fit, by estimated cost.
    #[command(after_help = help::DIAGNOSE)]
    Diagnose(DiagnoseArgs),
    /// Put several probe result files side by side.
    #[command(after_help = help::COMPARE)]
    Compare(CompareArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) on stdout.
    #[command(after_help = help::COMPLETIONS)]
    Completions(CompletionsArgs),
    /// Print the man page (roff) on stdout, or write a page per command into a directory.
    #[command(after_help = help::MAN)]
    Man(ManArgs),
    /// Internal: run one probe in this process and print its result as one JSON line.
    #[command(name = "probe-child", hide = true)]
    ProbeChild(ProbeChildArgs),
}

#[derive(Debug, Args)]
pub struct DevicesArgs {
    /// Print JSON (an array of devices) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A PyTorch memory snapshot instead of a workload (docs/snapshots.md).
#[derive(Debug, Args, Clone, Default)]
pub struct SnapshotArgs {
    /// A PyTorch memory snapshot (torch.cuda.memory._dump_snapshot). Twice, with --batch-of:
    /// the same job at two batch sizes, scaled to any batch (a third checks the scaling).
    #[arg(long, value_name = "FILE", allow_hyphen_values = true)]
    pub snapshot: Vec<PathBuf>,
    /// The batch size of each --snapshot, in order: e.g. 1,2 (or 1,2,3).
    #[arg(long, value_name = "A,B", allow_hyphen_values = true)]
    pub batch_of: Option<String>,
    /// What one replayed allocation is: the driver segments PyTorch's allocator asked for
    /// (default) or the tensor blocks the program asked the allocator for.
    #[arg(long, value_enum)]
    pub granularity: Option<crate::snapshot::Granularity>,
    /// Which device of the snapshot to read: N (cuda:N) or all (default: every device that
    /// holds memory or history, the one that recorded an OOM first).
    #[arg(long, value_name = "N|all", allow_hyphen_values = true)]
    pub snapshot_device: Option<String>,
    /// Replay a trace that cannot have happened (a double free, overlapping segments, more
    /// allocated than reserved) with a warning, instead of refusing the file.
    #[arg(long)]
    pub lenient: bool,
}

#[derive(Debug, Args)]
pub struct EstimateArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub snapshot: SnapshotArgs,
    /// Write the step's timeline as a PyTorch memory snapshot (for PyTorch's memory viewer).
    #[arg(long, value_name = "FILE", allow_hyphen_values = true)]
    pub export_snapshot: Option<PathBuf>,
    /// Draw the predicted step into FILE.svg or FILE.html: live bytes stacked by role over the
    /// step's events, PyTorch's reserved curve, the card's usable line and the peak.
    #[arg(long, value_name = "FILE", allow_hyphen_values = true)]
    pub out: Option<PathBuf>,
    /// Device memory to predict boundaries against, e.g. 40GiB, 80GB, 512MiB: raw bytes for
    /// the tensors and for PyTorch's caching allocator (nothing outside it is subtracted).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub memory: Option<String>,
    /// PyTorch's caching allocator settings, in PYTORCH_CUDA_ALLOC_CONF syntax (e.g.
    /// expandable_segments:True,max_split_size_mb:128); default: PYTORCH_ALLOC_CONF or
    /// PYTORCH_CUDA_ALLOC_CONF when set, else PyTorch's defaults.
    #[arg(long, value_name = "CONF", allow_hyphen_values = true)]
    pub alloc_conf: Option<String>,
    /// Bytes the process holds outside PyTorch's allocator on the card (CUDA context, cuBLAS
    /// and cuDNN workspaces, NCCL), subtracted from --memory for the allocator's boundaries.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub non_pytorch: Option<String>,
    /// A card from the table (its memory as CUDA reports it and what lives outside PyTorch on
    /// it): `--gpu rtx4090`, `--gpu list` for the table, `--gpu all` for the max on each.
    #[arg(long, value_name = "NAME", conflicts_with = "memory")]
    pub gpu: Option<String>,
    /// Consecutive steps of these sequence lengths through one caching allocator (batches of
    /// varying length): `512,2048,1024` or `@FILE` (lengths separated by commas, spaces or new
    /// lines; at most 4096, each within --seq's limit).
    #[arg(long, value_name = "LIST|@FILE", allow_hyphen_values = true)]
    pub seq_lengths: Option<String>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DiagnoseArgs {
    /// Read the out-of-memory messages in FILE (a log, a traceback, a pasted issue; `-` for
    /// stdin) and say what caused each. With a workload, also check the message against it.
    #[arg(long, value_name = "FILE", allow_hyphen_values = true)]
    pub oom: Option<String>,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub snapshot: SnapshotArgs,
    /// Device memory (default: the GPU detected here; with --snapshot, the card the snapshot
    /// recorded its OOM on: reserved + free at that moment).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub memory: Option<String>,
    /// A card from the table (`estimate --gpu list`): its memory as CUDA reports it, less what
    /// lives outside PyTorch on it (with --gpus, one NCCL communicator per process group).
    #[arg(long, value_name = "CARD", allow_hyphen_values = true)]
    pub gpu: Option<String>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ComputeMode {
    /// Run the plan's real kernels (default on GPUs).
    Full,
    /// Write and verify every byte only (default on CPU adapters).
    Touch,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SearchArg {
    /// Measure the capacity at each probe and invert the plan's bytes to the boundary.
    Measure,
    /// Fit or fail only: gallop from the prediction, bisect, confirm the pair once more.
    Gallop,
}

pub use crate::report::OutputFormat;

#[derive(Debug, Args, Clone)]
pub struct DeviceSelect {
    /// auto | vulkan | metal | dx12 | gl | cuda
    #[arg(
        long,
        value_name = "B",
        default_value = "auto",
        allow_hyphen_values = true
    )]
    pub backend: String,
    /// Device index as `devices` lists it (the CUDA ordinal with --backend cuda), or `all` to
    /// probe every GPU of the machine (a child per device) and compare the results.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub device: Option<String>,
    /// Where tensors go: pytorch (into segments taken and split as PyTorch's caching allocator
    /// does, so the boundary includes its rounding and fragmentation; the default on CUDA) or
    /// direct (one buffer per tensor chunk; the default elsewhere).
    #[arg(long, value_enum, value_name = "A")]
    pub allocator: Option<crate::backend::pooled::AllocatorMode>,
    /// PyTorch's caching allocator settings for --allocator pytorch, in PYTORCH_CUDA_ALLOC_CONF
    /// syntax; default: PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF when set.
    #[arg(long, value_name = "CONF", allow_hyphen_values = true)]
    pub alloc_conf: Option<String>,
}

impl DeviceSelect {
    /// `--allocator` and `--alloc-conf` as given.
    pub fn allocator(&self) -> crate::backend::pooled::AllocatorPick {
        crate::backend::pooled::AllocatorPick {
            mode: self.allocator,
            conf: self.alloc_conf.clone(),
        }
    }
}

#[derive(Debug, Args)]
pub struct ProbeArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub snapshot: SnapshotArgs,
    /// Scenarios to run (repeatable). Default: the whole suite.
    #[arg(long, value_enum)]
    pub scenario: Vec<Scenario>,
    #[command(flatten)]
    pub device: DeviceSelect,
    /// Emulate a smaller card: every byte requested from the driver counts against SIZE.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub budget: Option<String>,
    /// Run one probe at this value of the scenario's dimension and report its outcome.
    #[arg(long, value_name = "X", allow_hyphen_values = true)]
    pub at: Option<String>,
    /// Run probes in this process instead of a child per probe (gives up crash, kill and hang
    /// protection: a crash at the edge ends the whole run).
    #[arg(long)]
    pub no_isolate: bool,
    /// full (run the plan's kernels) or touch (write and verify every byte).
    #[arg(long, value_enum)]
    pub compute: Option<ComputeMode>,
    /// How the boundary is searched: measure (default: each probe measures the capacity, the
    /// plan's bytes invert it to the boundary) or gallop (fit/fail only: gallop and bisect).
    #[arg(long, value_enum, default_value_t = SearchArg::Measure)]
    pub search: SearchArg,
    /// Per-probe time limit in seconds (isolated probes only). Default: sized from the probe's
    /// bytes and the slowest fill rate seen so far, at least 60 s.
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true)]
    pub timeout: Option<String>,
    #[arg(long)]
    pub json: bool,
    /// Write results as they arrive (format from the extension unless --format says otherwise).
    #[arg(long, value_name = "FILE", allow_hyphen_values = true)]
    pub out: Option<PathBuf>,
    #[arg(long, value_enum)]
    pub format: Option<OutputFormat>,
    /// Every column in the terminal table (bytes at the boundary, fill, throughput, the first
    /// failure and why); the default shows the ones that fit 100 columns.
    #[arg(long)]
    pub wide: bool,
    /// Use a --budget above the host memory a CPU adapter has (otherwise capped there).
    #[arg(long)]
    pub force: bool,
    /// After each search, probe max_fit and first_fail N more times in fresh children; a
    /// max_fit that fails steps down [2 on real OOM, 0 under --budget or a first run's cap].
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub repeat: Option<String>,
    /// No progress bar on stderr.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Probe result files (JSON written by `probe --json` or `--out`).
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
    #[arg(long, value_enum)]
    pub format: Option<OutputFormat>,
    #[arg(long, value_name = "FILE", allow_hyphen_values = true)]
    pub out: Option<PathBuf>,
    /// Head the table's columns by the files' full labels (default `[1]`, `[2]`, ..., named in
    /// the legend above the table).
    #[arg(long)]
    pub wide: bool,
}

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Debug, Args)]
pub struct ManArgs {
    /// Write oomprobe.1 and a page per command (oomprobe-probe.1, ...) into this directory.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ProbeChildArgs {
    /// The probe to run, as JSON (a `probe::ChildRequest`).
    #[arg(long)]
    pub request: String,
}

/// One line for a clap error (bad usage): the message with what it lists (a missing argument,
/// the valid values), without clap's usage block and tips; no subcommand names the commands.
pub fn one_line_error(e: &clap::Error) -> String {
    use clap::error::ErrorKind;
    if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        let cmd = <Cli as clap::CommandFactory>::command();
        let names: Vec<&str> = cmd
            .get_subcommands()
            .filter(|c| !c.is_hide_set())
            .map(|c| c.get_name())
            .collect();
        return format!(
            "missing command: one of {} (oomprobe --help describes them)",
            names.join(", ")
        );
    }
    let text = e.to_string();
    let mut parts: Vec<&str> = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with("Usage:") || line.starts_with("For more information") {
            break;
        }
        if line.is_empty() || line.starts_with("tip:") {
            continue;
        }
        parts.push(line.trim_start_matches("error: "));
    }
    let msg = parts.join(" ");
    if msg.is_empty() {
        "bad usage (oomprobe --help)".to_string()
    } else {
        msg
    }
}

pub use crate::workload::args::WorkloadArgs;
pub use crate::workload::serve::ServeArgs;
