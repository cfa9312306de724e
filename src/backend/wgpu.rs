//! The wgpu backend: Vulkan, Metal, DX12 and GL adapters with their full limits.
