//! Results and their exporters: one module per format, all reading the same model.

pub mod model;

pub use model::*;
