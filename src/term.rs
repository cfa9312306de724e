//! What a person sees on a terminal: whether to use color (`NO_COLOR`, `CLICOLOR`,
//! `CLICOLOR_FORCE`, a terminal or not), writing a command's output to stdout (`out`), and the
//! probe progress bar (drawn only on a terminal).

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::error::{CliError, CliResult};

/// An output stream a decision is made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn is_terminal(self) -> bool {
        match self {
            Stream::Stdout => std::io::stdout().is_terminal(),
            Stream::Stderr => std::io::stderr().is_terminal(),
        }
    }
}

/// The color decision from the environment (<https://no-color.org>, <https://bixense.com/clicolors>):
/// a non-empty `NO_COLOR` turns color off; else `CLICOLOR_FORCE` (not `0`) turns it on; else
/// `CLICOLOR=0` or `TERM=dumb` turn it off; else color is on where the stream is a terminal.
pub fn color_choice(env: impl Fn(&str) -> Option<String>, is_terminal: bool) -> bool {
    let set = |name: &str| env(name).is_some_and(|v| !v.is_empty());
    if set("NO_COLOR") {
        return false;
    }
    if env("CLICOLOR_FORCE").is_some_and(|v| !v.is_empty() && v != "0") {
        return true;
    }
    if env("CLICOLOR").as_deref() == Some("0") || env("TERM").as_deref() == Some("dumb") {
        return false;
    }
    is_terminal
}

/// Whether table borders may be Unicode box drawing: not for `TERM=dumb`, nor where the locale
/// (`LC_ALL`, else `LC_CTYPE`, else `LANG`) names a character set other than UTF-8 (`C` and
/// `POSIX` are ASCII); an unset locale leaves them on.
pub fn unicode_choice(env: impl Fn(&str) -> Option<String>) -> bool {
    if env("TERM").as_deref() == Some("dumb") {
        return false;
    }
    let locale = ["LC_ALL", "LC_CTYPE", "LANG"]
        .into_iter()
        .find_map(|k| env(k).filter(|v| !v.is_empty()));
    match locale {
        None => true,
        Some(l) => {
            let l = l.to_ascii_lowercase();
            l.contains("utf-8") || l.contains("utf8")
        }
    }
}

/// Whether tables may use Unicode borders, from this process's environment.
pub fn unicode_enabled() -> bool {
    unicode_choice(|k| std::env::var(k).ok())
}

/// Whether output on `stream` may use color, from this process's environment.
pub fn color_enabled(stream: Stream) -> bool {
    color_choice(|k| std::env::var(k).ok(), stream.is_terminal())
}

/// Write to stdout; a closed pipe (`| head`) is not an error.
pub fn out(s: &str) -> CliResult<()> {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    match o.write_all(s.as_bytes()).and_then(|_| o.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CliError::run(format!("cannot write output: {e}")))
        }
        _ => Ok(()),
    }
}

/// A probe session's progress on stderr: elapsed time, the run, the probe count and the value
/// being probed. Drawn only when stderr is a terminal; nothing is animated when it is piped.
pub struct Progress {
    bar: ProgressBar,
    runs: usize,
    run: usize,
    label: String,
    dimension: String,
    last: String,
}

impl Progress {
    /// `device` names the device on the bar; `runs` is how many runs the session makes.
    pub fn new(quiet: bool, device: &str, runs: usize) -> Self {
        let bar = if quiet || !Stream::Stderr.is_terminal() {
            ProgressBar::hidden()
        } else {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            let template = if color_enabled(Stream::Stderr) {
                "{spinner:.cyan} {elapsed_precise} {prefix:.bold} │ {wide_msg}"
            } else {
                "{spinner} {elapsed_precise} {prefix} │ {wide_msg}"
            };
            bar.set_style(
                ProgressStyle::with_template(template)
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            bar.set_prefix(device.to_string());
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        };
        Progress {
            bar,
            runs,
            run: 0,
            label: String::new(),
            dimension: String::new(),
            last: String::new(),
        }
    }

    /// A line above the bar (or on stderr when there is no bar).
    pub fn println(&self, line: &str) {
        if self.bar.is_hidden() {
            eprintln!("{line}");
        } else {
            self.bar.println(line);
        }
    }

    /// The next run begins: `label` is e.g. `seq (naive)`, `dimension` what it varies.
    pub fn start_run(&mut self, label: &str, dimension: &str) {
        self.run += 1;
        self.label = label.to_string();
        self.dimension = dimension.to_string();
        self.last.clear();
        self.bar.set_message(self.status(None));
    }

    /// A probe at `value` has started.
    pub fn probe_started(&self, value: u64) {
        self.bar.set_message(self.status(Some(value)));
    }

    /// A probe at `value` has finished with `outcome` (its name, e.g. `oom`).
    pub fn probe_finished(&mut self, value: u64, outcome: &str) {
        self.bar.inc(1);
        self.last = format!("{}={value} {outcome}", self.dimension);
        self.bar.set_message(self.status(None));
    }

    /// Clear the bar before the results are printed.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }

    fn status(&self, probing: Option<u64>) -> String {
        let mut s = format!(
            "run {}/{} {} │ probe {}",
            self.run,
            self.runs,
            self.label,
            self.bar.position() + u64::from(probing.is_some())
        );
        if let Some(v) = probing {
            s.push_str(&format!(" {}={v}…", self.dimension));
        }
        if !self.last.is_empty() {
            s.push_str(&format!(" │ last {}", self.last));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unicode_borders_follow_the_locale() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(unicode_choice(env(&[])));
        assert!(unicode_choice(env(&[("LANG", "en_US.UTF-8")])));
        assert!(!unicode_choice(env(&[("LANG", "C")])));
        assert!(!unicode_choice(env(&[
            ("LC_ALL", "POSIX"),
            ("LANG", "en_US.UTF-8")
        ])));
        assert!(!unicode_choice(env(&[("TERM", "dumb")])));
    }

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn no_color_wins_over_everything() {
        assert!(!color_choice(env(&[("NO_COLOR", "1")]), true));
        assert!(!color_choice(
            env(&[("NO_COLOR", "1"), ("CLICOLOR_FORCE", "1")]),
            true
        ));
        // An empty NO_COLOR does not count (no-color.org).
        assert!(color_choice(env(&[("NO_COLOR", "")]), true));
    }

    #[test]
    fn terminals_get_color_pipes_do_not_unless_forced() {
        assert!(color_choice(env(&[]), true));
        assert!(!color_choice(env(&[]), false));
        assert!(color_choice(env(&[("CLICOLOR_FORCE", "1")]), false));
        assert!(!color_choice(env(&[("CLICOLOR_FORCE", "0")]), false));
        assert!(!color_choice(env(&[("CLICOLOR", "0")]), true));
        assert!(!color_choice(env(&[("TERM", "dumb")]), true));
    }
}
