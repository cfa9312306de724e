//! ResNet-50 plans from its real layer shapes.
