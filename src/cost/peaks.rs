//! What a card can do per second: its dense 16-bit and fp32 tensor peaks (the vendors'
//! datasheets, without structured sparsity) and its links (NVLink per GPU, PCIe). Every figure
//! is cited in docs/src/validation.md ("The cost model").

/// One card's peaks, keyed by the card table's id (`crate::alloc::cards`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Peak {
    pub id: &'static str,
    /// Dense bf16/fp16 tensor-core FLOP/s with fp32 accumulation.
    pub half: f64,
    /// Dense fp32 FLOP/s (no TF32).
    pub fp32: f64,
    /// GPU-to-GPU bandwidth in one direction, bytes/s: NVLink within a node, else PCIe.
    pub link: f64,
    /// Host-to-device bandwidth in one direction, bytes/s (PCIe).
    pub pcie: f64,
    /// The card's generation, which sets the fraction of peak that training reaches.
    pub arch: &'static str,
    pub source: &'static str,
}

const T: f64 = 1e12;
const GB: f64 = 1e9;
/// PCIe 4.0 ×16: 32 GB/s per direction raw; 5.0: 64.
const PCIE4: f64 = 32.0 * GB;
const PCIE5: f64 = 64.0 * GB;

/// The A100 SXM (40 and 80 GB alike).
const A100: Peak = Peak {
    id: "a100-40gb",
    half: 312.0 * T,
    fp32: 19.5 * T,
    link: 300.0 * GB,
    pcie: PCIE4,
    arch: "Ampere",
    source: "NVIDIA A100 datasheet: BF16 312 TFLOPS dense, FP32 19.5; NVLink 3 600 GB/s both ways",
};

/// The H100 SXM5 (the H200 has the same compute and NVLink).
const H100_SXM: Peak = Peak {
    id: "h100-sxm",
    half: 989.4 * T,
    fp32: 66.9 * T,
    link: 450.0 * GB,
    pcie: PCIE5,
    arch: "Hopper",
    source: "NVIDIA H100 datasheet (SXM5): BF16 1,979 TFLOPS with sparsity, 989.4 dense; FP32 67; NVLink 4 900 GB/s both ways",
};

pub const PEAKS: &[Peak] = &[
    A100,
    Peak {
        id: "a100-80gb",
        ..A100
    },
    H100_SXM,
    Peak {
        id: "h100-pcie",
        half: 756.0 * T,
        fp32: 51.2 * T,
        link: PCIE5,
        pcie: PCIE5,
        arch: "Hopper",
        source: "NVIDIA H100 datasheet (PCIe): BF16 1,513 TFLOPS with sparsity, 756 dense; FP32 51; no NVLink bridge assumed",
    },
    Peak {
        id: "h200",
        source: "NVIDIA H200 datasheet (SXM): BF16 1,979 TFLOPS with sparsity, 989 dense; FP32 67; NVLink 900 GB/s both ways",
        ..H100_SXM
    },
    Peak {
        id: "rtx4090",
        half: 165.2 * T,
        fp32: 82.6 * T,
        link: PCIE4,
        pcie: PCIE4,
        arch: "Ada",
        source: "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: FP16/BF16 tensor with FP32 accumulate 165.2 TFLOPS dense; FP32 82.6; no NVLink",
    },
    Peak {
        id: "l40s",
        half: 362.05 * T,
        fp32: 91.6 * T,
        link: PCIE4,
        pcie: PCIE4,
        arch: "Ada",
        source: "NVIDIA L40S datasheet: BF16 733 TFLOPS with sparsity, 362 dense; FP32 91.6; no NVLink",
    },
    Peak {
        id: "l4",
        half: 121.0 * T,
        fp32: 30.3 * T,
        link: PCIE4,
        pcie: PCIE4,
        arch: "Ada",
        source: "NVIDIA L4 datasheet: BF16 242 TFLOPS with sparsity, 121 dense; FP32 30.3",
    },
    Peak {
        id: "rtx3090",
        half: 71.0 * T,
        fp32: 35.6 * T,
        link: PCIE4,
        pcie: PCIE4,
        arch: "Ampere",
        source: "NVIDIA Ampere GA102 whitepaper, RTX 3090: FP16 tensor with FP32 accumulate 71 TFLOPS dense; FP32 35.6",
    },
];

/// The peaks of card `id`, if the table has them.
pub fn get(id: &str) -> Option<&'static Peak> {
    PEAKS.iter().find(|p| p.id == id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_peak_names_a_card_of_the_card_table() {
        for p in PEAKS {
            assert!(crate::alloc::cards::get(p.id).is_some(), "{}", p.id);
            assert!(p.half > p.fp32 && p.link > 0.0 && p.pcie > 0.0, "{}", p.id);
        }
    }
}
