//! Probes: execute a plan on a Backend and classify the outcome; run each in a child process.

pub mod child;
