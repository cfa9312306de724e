//! The four OOM scenarios of the seed document and the dimension each one varies.

use serde::{Deserialize, Serialize};

/// Contract names: params | batch | seq | activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    /// Model too large: vary the parameter count.
    Params,
    /// Batch too large: vary the batch size.
    Batch,
    /// Sequence too long: vary the sequence length.
    Seq,
    /// Activation explosion: vary the batch of a deep stack and report the activation share.
    Activations,
}

impl Scenario {
    pub const ALL: [Scenario; 4] = [
        Scenario::Params,
        Scenario::Batch,
        Scenario::Seq,
        Scenario::Activations,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Params => "params",
            Scenario::Batch => "batch",
            Scenario::Seq => "seq",
            Scenario::Activations => "activations",
        }
    }

    /// The dimension the scenario varies (the `dimension` JSON field).
    pub fn dimension(self) -> &'static str {
        match self {
            Scenario::Params => "params",
            Scenario::Batch | Scenario::Activations => "batch",
            Scenario::Seq => "seq",
        }
    }
}
