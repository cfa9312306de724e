//! `oomprobe completions SHELL` and `oomprobe man`: shell completions and man pages generated
//! from the clap definitions, so they never drift from the real command line.

use std::io::Write;

use clap::CommandFactory;

use crate::cli::{Cli, CompletionsArgs, ManArgs};
use crate::error::{CliError, CliResult};

pub fn completions(args: &CompletionsArgs) -> CliResult<()> {
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut visible_commands(), "oomprobe", &mut script);
    print_bytes(&script, "completions")
}

/// The command line without its hidden subcommands (clap_complete would offer `probe-child`).
fn visible_commands() -> clap::Command {
    let full = Cli::command();
    let subs: Vec<clap::Command> = full
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    let mut cmd = clap::Command::new("oomprobe")
        .version(env!("CARGO_PKG_VERSION"))
        .subcommands(subs);
    if let Some(about) = full.get_about() {
        cmd = cmd.about(about.clone());
    }
    cmd
}

pub fn man(args: &ManArgs) -> CliResult<()> {
    let cmd = Cli::command();
    match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .and_then(|()| clap_mangen::generate_to(cmd, dir))
                .map_err(|e| {
                    CliError::run(format!("cannot write man pages to {}: {e}", dir.display()))
                })?;
            eprintln!("oomprobe: man pages written to {}", dir.display());
            Ok(())
        }
        None => {
            let mut page = Vec::new();
            clap_mangen::Man::new(cmd)
                .render(&mut page)
                .map_err(|e| CliError::run(format!("cannot render the man page: {e}")))?;
            print_bytes(&page, "the man page")
        }
    }
}

/// Write to stdout; a reader that stops early (`| head`) is not an error.
fn print_bytes(bytes: &[u8], what: &str) -> CliResult<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CliError::run(format!("cannot write {what}: {e}")))
        }
        _ => Ok(()),
    }
}
