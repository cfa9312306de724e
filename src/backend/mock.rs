//! A host-memory backend with a set capacity, for fast deterministic tests.
