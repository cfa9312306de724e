//! Analytic estimate: the breakdown by role and the exact predicted max of each scenario.
