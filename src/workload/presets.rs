//! Model presets with their published shapes.
