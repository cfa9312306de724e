//! The JSON contract: serde of [`ProbeReport`], pretty-printed with a trailing newline.

use super::model::ProbeReport;
use super::ReportError;

/// `probe --json` and `--out FILE.json`: the report as pretty JSON.
pub fn render(report: &ProbeReport) -> Result<String, ReportError> {
    let mut s = serde_json::to_string_pretty(report)?;
    s.push('\n');
    Ok(s)
}
