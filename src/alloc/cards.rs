//! The cards people have: total memory as CUDA reports it (`cudaMemGetInfo`'s total, the "total
//! capacity" of PyTorch's OOM message) and what a process holds outside PyTorch's allocator on
//! each. Every figure is cited in docs/validation.md ("The cards"); `source` says where it is
//! from in one line.
//!
//! Totals read from an OOM message are printed to 0.01 GiB: the bytes here are that value, good
//! to ±5 MiB. The non-PyTorch footprint is the message's "this process has" less PyTorch's
//! allocated and reserved-but-unallocated, measured on real messages (17 in our corpus: 0.19-1.62
//! GiB, median 0.42 GiB; per architecture in validation/allocator/cards-research.md: T4 ~130 MiB,
//! L4 235, RTX 4090 470-505, L40S 420-507, A100 410-520, H100/H200 ~600, RTX 5090 595, with
//! lazy module loading); about 4 MiB per SM where only that growth says (Volta, GA10x:
//! derived), 0.45 GiB where nothing does (AMD: modelled).

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

/// 0.45 GiB: the footprint where a card's own messages do not say more (AMD: none found).
const DEFAULT_NON_PYTORCH: u64 = 461 * MIB;
/// Volta: 80 SMs at about 3.75 MiB each (derived from the per-SM growth of the measured cards).
const VOLTA_NON_PYTORCH: u64 = 300 * MIB;
/// Ampere GA10x: about 4 MiB per SM (derived the same way: 3090 ≈ 330 MiB; A4000's 48 SMs
/// measured 210 MiB).
const GA10X_PER_SM: u64 = 4 * MIB;

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
        id: "v100-16gb",
        name: "Tesla V100 16 GB",
        arch: "Volta",
        total: 16_928_342_016,
        non_pytorch: VOLTA_NON_PYTORCH,
        source: "deviceQuery 16144 MBytes (16928342016 bytes, CUDA 12.4); 1.x OOM 15.78 GiB on CUDA 9 (Shift-GCN#34)",
    },
    Card {
        id: "v100-32gb",
        name: "Tesla V100 32 GB",
        arch: "Volta",
        total: gib_100(3174),
        non_pytorch: VOLTA_NON_PYTORCH,
        source: "OOM messages: 31.74 GiB total capacity (LLaVA#812, ChatGLM-Finetuning#73)",
    },
    Card {
        id: "a10",
        name: "A10 24 GB",
        arch: "Ampere",
        total: 23_609_475_072,
        non_pytorch: 72 * GA10X_PER_SM,
        source: "deviceQuery 21.99 GBytes (23609475072 bytes, CUDA 12.2; aalanwyr/face2cuda); nvidia-smi 23028 MiB counts more",
    },
    Card {
        id: "a10g",
        name: "A10G 24 GB (AWS g5)",
        arch: "Ampere",
        total: 22_587 * MIB,
        non_pytorch: 80 * GA10X_PER_SM,
        source: "torch total_memory=22587MB (cu130, R580); 1.x OOM 22.20 GiB on older drivers (Dreambooth-Stable-Diffusion#18)",
    },
    Card {
        id: "rtx3090",
        name: "GeForce RTX 3090 24 GB",
        arch: "Ampere",
        total: 25_327_697_920,
        non_pytorch: 82 * GA10X_PER_SM,
        source: "deviceQuery 24154 MBytes (25327697920 bytes, CUDA 12.6; thamada/nvidia-smi); 1.x OOM 23.70 GiB on R455 (GaoLii/DSP#10)",
    },
    Card {
        id: "a6000",
        name: "RTX A6000 48 GB",
        arch: "Ampere",
        total: 51_160_023_040,
        non_pytorch: 84 * GA10X_PER_SM,
        source: "deviceQuery 48790 MBytes (51160023040 bytes, CUDA 12.7, ECC off); 47.54 GiB on another driver",
    },
    Card {
        id: "l4",
        name: "L4 24 GB",
        arch: "Ada",
        total: 23_570_219_008,
        non_pytorch: 235 * MIB,
        source: "deviceQuery 22478 MBytes (23570219008 bytes, CUDA 12.4; thamada/nvidia-smi); OOM 22.03 GiB (evo2#190)",
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
        id: "rtx5090",
        name: "GeForce RTX 5090 32 GB",
        arch: "Blackwell",
        total: 33_680_457_728,
        non_pytorch: 595 * MIB,
        source: "deviceQuery 32120 MBytes (33680457728 bytes, CUDA 12.8; NVIDIA/nccl#1637); OOM 31.37 GiB (Wan2.1#465)",
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
        id: "h100-pcie",
        name: "H100 PCIe 80 GB",
        arch: "Hopper",
        total: 85_028_896_768,
        non_pytorch: 600 * MIB,
        source: "OOM message 79.19 GiB on an H100 PCIe (the SXM's R570 deviceQuery bytes, 85028896768); 79.11 GiB on 2022 drivers",
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
    Card {
        id: "mi250x",
        name: "Instinct MI250X / MI250, one GCD 64 GB",
        arch: "CDNA2",
        total: 68_702_699_520,
        non_pytorch: DEFAULT_NON_PYTORCH,
        source: "rocminfo pool 67092480 KiB (68702699520 bytes; ROCm/TheRock#1395); HIP OOM 63.98 GiB",
    },
    Card {
        id: "mi300x",
        name: "Instinct MI300X 192 GB",
        arch: "CDNA3",
        total: 206_141_652_992,
        non_pytorch: DEFAULT_NON_PYTORCH,
        source: "rocminfo 201310208 KiB (206141652992 bytes; thamada/nvidia-smi); HIP OOM 191.98 GiB",
    },
];

/// What one NCCL communicator holds per rank outside PyTorch's allocator (its channels' FIFO
/// buffers and the shared send/recv buffer): 1 GiB, derived from NCCL 2.28's initialisation on
/// one RTX 3090 (996 MiB, NVIDIA/nccl PR#2366) and 8×H100 before the first all_to_all (1.06 GB,
/// NVIDIA/nccl#1685); more after all_to_all, and per extra communicator (nccl#864, #986).
pub const NCCL_COMMUNICATOR: u64 = 1 << 30;

/// What eager module loading adds to the table's (lazy) figure: every kernel of PyTorch's own
/// libraries in the context. The transformers docs' "Model training anatomy" measured 1,343 MB
/// with a 1×1 tensor on a V100 under CUDA 11 (nvidia-smi), against the table's 300 MiB lazy
/// Volta figure: about 1 GiB. ptrblck (pytorch#107667): ">1000MB" before CUDA 11.7.
/// pytorch#86509 measured less, +380 MB, with PyTorch 1.13's kernels: a range (modelled).
pub const EAGER_MODULES: u64 = 1 << 30;

impl Card {
    /// PyTorch's default BLAS workspace on this card, which its caching allocator holds
    /// (pytorch 26a3905 `aten/src/ATen/cuda/CublasHandlePool.cpp`, `parseChosenWorkspaceSize`):
    /// 32 MiB on Hopper (sm90); on ROCm 32 MiB, 128 MiB on gfx94x (MI300, CDNA3); else
    /// `:4096:2:16:8`, 8 MiB + 128 KiB.
    pub fn blas_workspace(&self) -> u64 {
        match self.arch {
            "Hopper" | "CDNA2" => 32 * MIB,
            "CDNA3" => 128 * MIB,
            _ => crate::plan::build::CUBLAS_WORKSPACE,
        }
    }

    /// `w` as it runs on this card: its BLAS workspace the card's default unless given.
    pub fn adopt(&self, w: &mut crate::workload::Workload) {
        if w.cublas_workspace.is_none() {
            w.cublas_workspace = Some(self.blas_workspace());
        }
    }

    /// Outside PyTorch on this card for one rank of `w`: one NCCL communicator per process
    /// group the rank is in (data, tensor, pipeline, context parallel; one where more than one
    /// GPU runs without a layout).
    pub fn non_pytorch_for(&self, w: &crate::workload::Workload) -> u64 {
        let eager = match w.cuda_modules {
            crate::workload::ModuleLoading::Lazy => 0,
            crate::workload::ModuleLoading::Eager => EAGER_MODULES,
        };
        self.non_pytorch
            .saturating_add(eager)
            .saturating_add(NCCL_COMMUNICATOR.saturating_mul(w.communicators()))
    }
}

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
        assert_eq!(t("rtx5090"), "31.37");
        assert_eq!(t("mi300x"), "191.98");
        assert_eq!(t("v100-16gb"), "15.77");
        assert_eq!(t("h100-pcie"), "79.19");
        // Every card the issue names is in the table.
        for id in [
            "t4",
            "v100-16gb",
            "v100-32gb",
            "a10",
            "a10g",
            "l4",
            "l40s",
            "a6000",
            "a100-40gb",
            "a100-80gb",
            "h100-pcie",
            "h100-sxm",
            "h200",
            "rtx3090",
            "rtx4090",
            "rtx5090",
            "mi250x",
            "mi300x",
        ] {
            assert!(get(id).is_some(), "{id}");
        }
        assert!(get("rtx-9999").is_none());
        for c in CARDS {
            assert!(c.non_pytorch < c.total / 8, "{}", c.id);
        }
    }
}
