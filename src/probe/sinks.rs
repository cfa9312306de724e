//! The sinks a probe session feeds: the progress bar on stderr and the `--out` file rewritten
//! as each probe ends.

use std::path::PathBuf;

use crate::cli::OutputFormat;
use crate::error::{CliError, CliResult};
use crate::report::{self, ProbeReport};
use crate::term::Progress;

use super::session::{SessionEvent, Sink};

/// `--out FILE`: the report so far, rewritten atomically at every run start and probe end, so
/// a stopped session leaves a file that says which run was in progress.
pub struct OutFile {
    path: PathBuf,
    format: OutputFormat,
}

impl OutFile {
    /// None for `--out -` (stdout gets the report once, at the end).
    pub fn new(path: PathBuf, format: OutputFormat) -> Option<Self> {
        (!report::is_stdout(&path)).then_some(OutFile { path, format })
    }

    fn write(&self, report: &ProbeReport) -> CliResult<()> {
        let text = report::render(report, self.format).map_err(|e| CliError::run(e.to_string()))?;
        report::write_atomically(&self.path, &text)
            .map_err(|e| CliError::run(format!("cannot write {}: {e}", self.path.display())))
    }
}

impl Sink for OutFile {
    fn event(&mut self, event: &SessionEvent<'_>) -> CliResult<()> {
        match event {
            SessionEvent::RunStarted { report, .. } | SessionEvent::Finished { report } => {
                self.write(report)
            }
            // A failed rewrite half way keeps the run going: the next one may succeed, and the
            // last one is checked.
            SessionEvent::ProbeFinished { report, .. } => {
                let _ = self.write(report);
                Ok(())
            }
            SessionEvent::ProbeStarted { .. } => Ok(()),
        }
    }
}

impl Sink for Progress {
    fn event(&mut self, event: &SessionEvent<'_>) -> CliResult<()> {
        match event {
            SessionEvent::RunStarted { spec, .. } => {
                let label = match spec.variant.as_deref() {
                    Some(v) if !v.is_empty() => format!("{} ({v})", spec.scenario.name()),
                    _ => spec.scenario.name().to_string(),
                };
                self.start_run(&label, spec.scenario.dimension());
            }
            SessionEvent::ProbeStarted { value } => self.probe_started(*value),
            SessionEvent::ProbeFinished { record, .. } => {
                self.probe_finished(record.value, record.outcome.name())
            }
            SessionEvent::Finished { .. } => self.finish(),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stdout_is_not_a_file_sink() {
        assert!(OutFile::new(PathBuf::from("-"), OutputFormat::Json).is_none());
        assert!(OutFile::new(PathBuf::from("r.json"), OutputFormat::Json).is_some());
    }
}
