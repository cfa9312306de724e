//! f64 CPU references of every kernel, used by the tests.
