//! Enumerate devices across backends and open one by --backend/--device.
