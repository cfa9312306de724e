//! The cards people have: total memory as CUDA reports it (`cudaMemGetInfo`'s total, the "total
//! capacity" of PyTorch's OOM message) and what a process holds outside PyTorch's allocator on
//! each. Every figure is cited in docs/validation.md ("The cards"); `source` says where it is
//! from in one line.
//!
//! Totals read from an OOM message are printed to 0.01 GiB: the bytes here are that value, good
//! to ±5 MiB. The non-PyTorch footprint is the message's "this process has" less PyTorch's
//! allocated and reserved-but-unallocated, measured on real messages (17 in our corpus: 0.19-1.62
//! GiB, median 0.42 GiB; per architecture in validation/allocator/cards-research.md: T4 ~130 MiB,
//! L4 235, RTX 4090 470-505, L40S 420-507, A100 410-520, H100/H200 ~600, with lazy module
//! loading); 0.45 GiB where a card's own messages do not say more (modelled).

/// One card of the table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Card {
    pub id: &'static str,
    pub name: &'static str,
    pub arch: &'static str,
    /// Total memory as CUDA reports it.
    pub total: u64,
    /// Held outside PyTorch's allocator by a training process (context, cuBLAS, kernels).
    pub non_pytorch: u64,
    /// Where the total comes from.
    pub source: &'static str,
}

const GIB: f64 = (1u64 << 30) as f64;
const MIB: u64 = 1 << 20;

const fn gib_100(centi: u64) -> u64 {
    // centi-GiB (23.65 GiB = 2365) to bytes, rounded to MiB.
    (centi * 1024 / 100) * MIB
}

/// 0.45 GiB: the footprint where a card's own messages do not say more.
const DEFAULT_NON_PYTORCH: u64 = 461 * MIB;

pub const CARDS: &[Card] = &[
    Card {
        id: "t4",
        name: "Tesla T4 16 GB",
        arch: "Turing",
        total: gib_100(1456),
        non_pytorch: 130 * MIB,
        source: "OOM messages: 14.56 GiB (CatVTON#133, leetgpu-challenges#52; 14.75 on Colab, Open-Sora#697)",
    },
    Card {
        id: "v100-32gb",
        name: "Tesla V100 32 GB",
        arch: "Volta",
        total: gib_100(3174),
        non_pytorch: DEFAULT_NON_PYTORCH,
        source: "OOM message: 31.74 GiB total capacity (LLaVA#812)",
    },
    Card {
        id: "a10",
        name: "A10 / A10G 24 GB",
        arch: "Ampere",
        total: 23028 * MIB,
        non_pytorch: DEFAULT_NON_PYTORCH,
        source: "nvidia-smi 23028 MiB (modal-labs/modal-client PR#2797); no OOM message found",
    },
    Card {
        id: "l4",
        name: "L4 24 GB",
        arch: "Ada",
        total: 23034 * MIB,
        non_pytorch: 235 * MIB,
        source: "nvidia-smi 23034 MiB (modal-labs/modal-client PR#2797); no OOM message found",
    },
    Card {
        id: "rtx4090",
        name: "GeForce RTX 4090 24 GB",
        arch: "Ada",
        total: gib_100(2365),
        non_pytorch: 490 * MIB,
        source: "OOM messages: 23.65 GiB (tloen/llama-int8#7, AiOS#29, pytorch#16417), 23.64 (VGen#104)",
    },
    Card {
        id: "l40s",
        name: "L40S 48 GB",
        arch: "Ada",
        total: gib_100(4453),
        non_pytorch: 460 * MIB,
        source: "OOM messages: 44.53 GiB total capacity (Wan2.1#205, twice)",
    },
    Card {
        id: "a100-40gb",
        name: "A100 SXM 40 GB",
        arch: "Ampere",
        total: 42_298_834_944,
        non_pytorch: 465 * MIB,
        source: "deviceQuery 40339 MBytes (42298834944 bytes), bottlerocket-os PR#3873; OOM 39.43-39.59 GiB",
    },
    Card {
        id: "a100-80gb",
        name: "A100 SXM 80 GB",
        arch: "Ampere",
        total: 85_100_068_864,
        non_pytorch: 465 * MIB,
        source: "deviceQuery 81158 MBytes (85100068864 bytes); OOM messages 79.25 GiB (OOTDiffusion#235, VAREdit)",
    },
    Card {
        id: "h100-sxm",
        name: "H100 SXM 80 GB",
        arch: "Hopper",
        total: 85_045_477_376,
        non_pytorch: 600 * MIB,
        source: "deviceQuery 81106 MBytes (85045477376 bytes, driver 12.7); vllm#27508 79.11 GiB",
    },
    Card {
        id: "h200",
        name: "H200 141 GB",
        arch: "Hopper",
        total: gib_100(13979),
        non_pytorch: 600 * MIB,
        source: "OOM message: 139.79 GiB total capacity, 0.74 GiB outside PyTorch (PyTorch docs thread)",
    },
];

/// A card by id (case-insensitive; `-` and `_` alike).
pub fn get(id: &str) -> Option<&'static Card> {
    let norm = |s: &str| s.to_ascii_lowercase().replace('_', "-");
    let want = norm(id);
    CARDS.iter().find(|c| norm(c.id) == want)
}

/// The ids, for an error line.
pub fn ids() -> String {
    CARDS.iter().map(|c| c.id).collect::<Vec<_>>().join(", ")
}

impl Card {
    pub fn total_gib(&self) -> f64 {
        self.total as f64 / GIB
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_read_back_as_the_messages_print_them() {
        let t = |id: &str| format!("{:.2}", get(id).unwrap().total_gib());
        assert_eq!(t("rtx4090"), "23.65");
        assert_eq!(t("a100-80gb"), "79.26");
        assert_eq!(t("h200"), "139.79");
        assert_eq!(t("T4"), "14.56");
        assert!(get("rtx-9999").is_none());
        for c in CARDS {
            assert!(c.non_pytorch < c.total / 8, "{}", c.id);
        }
    }
}
