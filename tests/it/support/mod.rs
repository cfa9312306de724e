//! Helpers the integration tests share: the binary and its adapter check (`adapter`), the
//! kernel checks run on both backends (`kernel_checks`), checks on exported formats
//! (`formats`), the CLI fuzzers' bounded run and case count (`fuzz`), a workload from flags
//! (`flags`), the line after the fit
//! headline (`output`), and the lock that keeps wall-time assertions away from a test that
//! loads every core (`load`).

pub mod adapter;
pub mod flags;
pub mod formats;
pub mod fuzz;
pub mod kernel_checks;
pub mod load;
pub mod output;
