//! The tests share one process and its threads run at once. Most do not mind what runs beside
//! them; two kinds do: a test that keeps every core busy on purpose (`search::under_load`) and
//! a test that asserts how long something took. The first takes `every_core()`, the second
//! `timed()`: timed tests run beside each other, never beside the loaded machine.

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static LOAD: RwLock<()> = RwLock::new(());

/// Held while a test asserts on wall time.
pub fn timed() -> RwLockReadGuard<'static, ()> {
    // A test that panicked while holding the lock poisons it; the lock guards no data.
    LOAD.read().unwrap_or_else(|e| e.into_inner())
}

/// Held while a test keeps every core busy.
pub fn every_core() -> RwLockWriteGuard<'static, ()> {
    LOAD.write().unwrap_or_else(|e| e.into_inner())
}
