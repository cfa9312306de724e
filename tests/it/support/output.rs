//! Reading `estimate`'s and `diagnose`'s text: the fit headline (issue 47) comes first when the
//! card's memory is known, and the workload's line after it.

/// Whether `line` is the fit headline.
pub fn is_headline(line: &str) -> bool {
    line.starts_with("fits: ") || line.starts_with("does not fit")
}

/// The first line that is not the fit headline: the workload's.
pub fn workload_line(text: &str) -> &str {
    text.lines().find(|l| !is_headline(l)).unwrap_or("")
}
