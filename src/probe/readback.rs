//! What a read-back that disagrees with what the probe wrote means: lost work (nothing read
//! back, or zeros where a pattern was written, possibly OOM or the watchdog, as Metal reports
//! a command buffer aborted for either) or corruption (wrong words, as GL under an address-space
//! limit returns at the memory edge). Both are `verify_failed`: an outcome of that probe, which
//! the runner retries in a fresh child, never a failure of the run. The detail tells them apart.

use crate::ops::words::{Checksum, VerifyResult};
use crate::report::Outcome;

/// The detail every `verify_failed` starts with.
pub const VERIFY_FAILED: &str = "verify failed: possible OOM/watchdog";

/// The outcome of a verify of `tensor` (`expected` words) that did not pass. `zeros` tells
/// whether the tensor's words read back as all zeros (a checksum of 0 over every word).
pub fn verify_failure(
    tensor: &str,
    expected: u64,
    v: VerifyResult,
    zeros: Option<bool>,
) -> (Outcome, String) {
    if v.words_seen == 0 && expected > 0 {
        return (
            Outcome::VerifyFailed,
            format!(
                "{VERIFY_FAILED}: the verify pass over tensor {tensor} never ran (0 of \
                 {expected} words seen)"
            ),
        );
    }
    if zeros == Some(true) {
        return (
            Outcome::VerifyFailed,
            format!(
                "{VERIFY_FAILED}: tensor {tensor} read back as zeros ({} of {expected} words \
                 differ from the pattern written)",
                v.mismatches
            ),
        );
    }
    (
        Outcome::VerifyFailed,
        format!(
            "{VERIFY_FAILED}: tensor {tensor} read back wrong ({} of {expected} words seen, {} \
             mismatches): the adapter corrupted what was written",
            v.words_seen, v.mismatches
        ),
    )
}

/// Whether a checksum over every word of a tensor says they are all zero.
pub fn all_zero(c: &Checksum, expected: u64) -> bool {
    c.sum == 0 && c.words == expected
}

/// The failure of a checksum read-back of `tensor` that did not cover its `expected` words
/// (`None` when it did).
pub fn checksum_failure(tensor: &str, expected: u64, c: &Checksum) -> Option<(Outcome, String)> {
    if c.words == expected {
        return None;
    }
    Some(if c.words == 0 {
        (
            Outcome::VerifyFailed,
            format!(
                "{VERIFY_FAILED}: the checksum pass over tensor {tensor} never ran (0 of \
                 {expected} words seen)"
            ),
        )
    } else {
        (
            Outcome::VerifyFailed,
            format!(
                "{VERIFY_FAILED}: the checksum over tensor {tensor} covered {} of {expected} \
                 words",
                c.words
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wrong_read_back_is_verify_failed_and_says_which_kind() {
        let none = VerifyResult {
            words_seen: 0,
            mismatches: 0,
        };
        assert_eq!(verify_failure("t", 8, none, None).0, Outcome::VerifyFailed);
        let all = VerifyResult {
            words_seen: 8,
            mismatches: 8,
        };
        let (o, d) = verify_failure("t", 8, all, Some(true));
        assert_eq!(o, Outcome::VerifyFailed);
        assert!(d.starts_with(VERIFY_FAILED), "{d}");
        assert!(d.contains("zeros"), "{d}");
        let (o, d) = verify_failure("t", 8, all, Some(false));
        assert_eq!(o, Outcome::VerifyFailed);
        assert!(d.contains("corrupted"), "{d}");
        let one = VerifyResult {
            words_seen: 8,
            mismatches: 1,
        };
        let (o, d) = verify_failure("t", 8, one, None);
        assert_eq!(o, Outcome::VerifyFailed);
        assert!(d.contains("1 mismatches"), "{d}");
    }

    #[test]
    fn a_checksum_that_saw_nothing_is_verify_failed() {
        let c = Checksum { sum: 0, words: 0 };
        assert_eq!(
            checksum_failure("t", 8, &c).unwrap().0,
            Outcome::VerifyFailed
        );
        assert!(checksum_failure("t", 8, &Checksum { sum: 5, words: 8 }).is_none());
        assert_eq!(
            checksum_failure("t", 8, &Checksum { sum: 5, words: 4 })
                .unwrap()
                .0,
            Outcome::VerifyFailed
        );
        assert!(all_zero(&Checksum { sum: 0, words: 8 }, 8));
        assert!(!all_zero(&Checksum { sum: 0, words: 4 }, 8));
    }
}
