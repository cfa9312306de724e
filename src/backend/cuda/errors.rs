//! Driver errors as the backend reports them: their names and text, and whether one means
//! out of memory, a lost context, or something else.

use cudarc::driver::result::DriverError;

/// "CUDA_ERROR_OUT_OF_MEMORY (out of memory)".
pub(super) fn err_text(e: DriverError) -> String {
    let name = err_name(e);
    match e.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

pub(super) fn err_name(e: DriverError) -> String {
    e.error_name()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("CUresult {}", e.0 as i32))
}

/// How a driver error is reported above the trait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    OutOfMemory,
    /// A sticky error: the context is unusable from now on.
    Lost,
    Other,
}

pub(super) fn classify(e: DriverError) -> Class {
    classify_name(&err_name(e))
}

pub(super) fn classify_name(name: &str) -> Class {
    const LOST: &[&str] = &[
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA_ERROR_LAUNCH_FAILED",
        "CUDA_ERROR_LAUNCH_TIMEOUT",
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "CUDA_ERROR_INVALID_PC",
        "CUDA_ERROR_ASSERT",
        "CUDA_ERROR_ECC_UNCORRECTABLE",
        "CUDA_ERROR_NVLINK_UNCORRECTABLE",
        "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "CUDA_ERROR_DEVICE_UNAVAILABLE",
        "CUDA_ERROR_DEINITIALIZED",
    ];
    if name == "CUDA_ERROR_OUT_OF_MEMORY" {
        Class::OutOfMemory
    } else if LOST.contains(&name) {
        Class::Lost
    } else {
        Class::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_classified() {
        assert_eq!(
            classify_name("CUDA_ERROR_OUT_OF_MEMORY"),
            Class::OutOfMemory
        );
        assert_eq!(classify_name("CUDA_ERROR_ILLEGAL_ADDRESS"), Class::Lost);
        assert_eq!(
            classify_name("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"),
            Class::Other
        );
        assert_eq!(classify_name("CUDA_ERROR_INVALID_VALUE"), Class::Other);
    }
}
