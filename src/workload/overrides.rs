//! Apply command-line overrides to a workload, with checked parsing (exit 2 on bad input).
