//! A Backend wrapper that places tensors as PyTorch's caching allocator does: segments from the
//! backend below, each tensor a view at the offset the one allocator model (`alloc::caching`,
//! the model `estimate` and snapshot replay use) chooses.
//!
//! Below it the device sees what a PyTorch process asks of the driver: 2 MiB segments for
//! small tensors, 20 MiB ones for 1-10 MiB tensors, larger tensors' own rounded segments, the
//! cache kept between tensors and released (then retried) only when the driver refuses. So a
//! probe's boundary includes the rounding and fragmentation PyTorch suffers. Addresses of
//! segments are laid out as the model lays them out (the driver's own pointers never decide a
//! placement), so the probe places every tensor where `estimate`'s replay places it.
//!
//! `expandable_segments:True` is refused here: it needs one range of address space grown by
//! `cuMemMap`, which no backend offers yet (estimate models it).

use std::collections::{BTreeMap, HashMap};

use super::{
    AllocError, Backend, BackendError, BackendKind, BufferId, DeviceInfo, DynBackend, HeapUsage,
    MemoryInfo,
};
use crate::alloc::sizes::ROUND_LARGE;
use crate::alloc::{AllocConf, Allocator, BlockId, Device, Oom, Stats};
use crate::kernels::KernelId;
use crate::units::fmt_bytes;

/// Where tensors go: one buffer each (`direct`, the probe's old behaviour) or into segments as
/// PyTorch's caching allocator places them (`pytorch`, the default on CUDA).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AllocatorMode {
    Pytorch,
    #[default]
    Direct,
}

/// `--allocator` and `--alloc-conf` as given (None: not given).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllocatorPick {
    pub mode: Option<AllocatorMode>,
    pub conf: Option<String>,
}

impl AllocatorPick {
    /// The allocator settings' text when tensors go through the caching allocator on a
    /// `backend` device (pytorch: the default on CUDA), None when they go direct; an error line
    /// for a setting PyTorch refuses, or pytorch where the backend cannot bind part of a buffer.
    pub fn resolve(&self, backend: BackendKind) -> Result<Option<String>, String> {
        let default = if backend == BackendKind::Cuda {
            AllocatorMode::Pytorch
        } else {
            AllocatorMode::Direct
        };
        let mode = self.mode.unwrap_or(default);
        if mode == AllocatorMode::Direct {
            return match self.conf {
                Some(_) if self.mode.is_some() => {
                    Err("--alloc-conf: the allocator settings apply to --allocator pytorch".into())
                }
                Some(_) => Err(format!(
                    "--alloc-conf: tensors go direct on {} (one buffer each); the settings \
                     apply to --allocator pytorch",
                    backend.as_str()
                )),
                None => Ok(None),
            };
        }
        if !matches!(backend, BackendKind::Cuda | BackendKind::Mock) {
            return Err(format!(
                "--allocator pytorch: the {} backend binds whole buffers only, so tensors \
                 cannot sit inside segments there; it runs on CUDA (use --allocator direct)",
                backend.as_str()
            ));
        }
        let (conf, _) = crate::alloc::conf::from_flag_or_env(self.conf.as_deref())?;
        if conf.expandable_segments {
            return Err(EXPANDABLE.into());
        }
        Ok(Some(conf.text))
    }
}

const EXPANDABLE: &str = "--allocator pytorch: expandable_segments:True needs cuMemMap, which the \
probe does not drive yet (estimate models it); use --allocator direct or drop the setting";

/// The backend below as the allocator's device: segments are its buffers.
struct Segments {
    inner: DynBackend,
    /// Segment base address (as the model lays them out) → buffer and size.
    by_addr: BTreeMap<u64, (BufferId, u64)>,
    next: u64,
    /// Why the last segment was refused (budget, device loss, a limit), for the caller.
    refused: Option<AllocError>,
}

impl Device for Segments {
    fn malloc(&mut self, size: u64) -> Option<u64> {
        match self.inner.alloc_buffer(size) {
            Ok(id) => {
                let addr = self.next;
                self.next += size.div_ceil(ROUND_LARGE) * ROUND_LARGE;
                self.by_addr.insert(addr, (id, size));
                Some(addr)
            }
            Err(e) => {
                self.refused = Some(e);
                None
            }
        }
    }
    fn free(&mut self, addr: u64, _size: u64) {
        if let Some((id, _)) = self.by_addr.remove(&addr) {
            self.inner.free_buffer(id);
        }
    }
    // Expandable segments are refused when the wrapper is built: no address space is taken.
    fn reserve(&mut self, _size: u64) -> u64 {
        0
    }
    fn map(&mut self, _addr: u64, _size: u64) -> bool {
        false
    }
    fn unmap(&mut self, _addr: u64, _size: u64) {}
    fn total(&self) -> u64 {
        self.inner.memory().total_bytes.unwrap_or(u64::MAX)
    }
    fn free_bytes(&self) -> u64 {
        self.inner.memory().free_bytes.unwrap_or(0)
    }
}

/// Any backend that binds part of a buffer, with tensors placed by the caching allocator.
pub struct PooledBackend {
    seg: Segments,
    alloc: Allocator,
    /// Each live tensor buffer (a view) → its block.
    blocks: HashMap<BufferId, BlockId>,
    info: DeviceInfo,
}

impl PooledBackend {
    /// Wrap `inner` with an allocator of `conf`; an error line where it cannot be done.
    pub fn new(inner: DynBackend, conf: AllocConf) -> Result<Self, String> {
        if conf.expandable_segments {
            return Err(EXPANDABLE.into());
        }
        let mut info = inner.info().clone();
        // A chunk up to this size always gets a segment within the device's buffer limit.
        let limit = info.max_chunk_bytes() / ROUND_LARGE * ROUND_LARGE;
        info.max_buffer_size = info.max_buffer_size.min(limit);
        info.max_storage_binding_size = info.max_storage_binding_size.min(limit);
        let mut seg = Segments {
            inner,
            by_addr: BTreeMap::new(),
            next: 1 << 40,
            refused: None,
        };
        // Check once that the backend can bind part of a buffer (where there is room to).
        if let Ok(probe) = seg.inner.alloc_buffer(1024) {
            let view = seg.inner.view_buffer(probe, 512, 512);
            if let Some(v) = view {
                seg.inner.free_buffer(v);
            }
            seg.inner.free_buffer(probe);
            if view.is_none() {
                return Err(format!(
                    "--allocator pytorch: the {} backend cannot bind part of a buffer, so \
                     tensors cannot sit inside segments there; use --allocator direct",
                    info.backend.as_str()
                ));
            }
        }
        Ok(PooledBackend {
            seg,
            alloc: Allocator::new(conf),
            blocks: HashMap::new(),
            info,
        })
    }

    /// The refusal a caller sees: what the device said (budget, loss, a limit), else PyTorch's
    /// message.
    fn refusal(&mut self, bytes: u64, oom: &Oom) -> AllocError {
        match self.seg.refused.take() {
            Some(e @ (AllocError::Budget { .. } | AllocError::DeviceLost(_))) => e,
            Some(e @ AllocError::ExceedsLimit { .. }) => e,
            _ => AllocError::OutOfMemory {
                requested: bytes,
                detail: oom_text(oom),
            },
        }
    }
}

/// A refusal in the words of PyTorch's message (c10/cuda/CUDACachingAllocator.cpp).
pub fn oom_text(o: &Oom) -> String {
    format!(
        "caching allocator: tried to allocate {} (a {} block); {} free on the device; {} \
         allocated, {} reserved but unallocated (largest free piece {}){}",
        fmt_bytes(o.alloc_size),
        fmt_bytes(o.rounded),
        fmt_bytes(o.device_free),
        fmt_bytes(o.allocated),
        fmt_bytes(o.cached_free),
        fmt_bytes(o.largest_cached),
        if o.fragmentation() {
            "; the free memory in total was enough: fragmentation"
        } else {
            ""
        }
    )
}

impl Backend for PooledBackend {
    super::forward_to_inner!(seg.inner);

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn memory(&self) -> MemoryInfo {
        self.seg.inner.memory()
    }

    fn alloc_buffer(&mut self, bytes: u64) -> Result<BufferId, AllocError> {
        self.alloc_buffer_on(bytes, 0)
    }

    fn alloc_buffer_on(&mut self, bytes: u64, stream: i64) -> Result<BufferId, AllocError> {
        if bytes > self.info.max_chunk_bytes() {
            return Err(AllocError::ExceedsLimit {
                requested: bytes,
                limit: self.info.max_chunk_bytes(),
            });
        }
        self.seg.refused = None;
        let block = match self.alloc.malloc(&mut self.seg, bytes, stream, None) {
            Ok(b) => b,
            Err(oom) => return Err(self.refusal(bytes, &oom)),
        };
        let (addr, _) = self.alloc.block(block);
        let view = self
            .seg
            .by_addr
            .range(..=addr)
            .next_back()
            .and_then(|(&base, &(id, _))| self.seg.inner.view_buffer(id, addr - base, bytes));
        match view {
            Some(v) => {
                self.blocks.insert(v, block);
                Ok(v)
            }
            None => {
                self.alloc.free(block);
                Err(AllocError::Other(format!(
                    "no view of {bytes} bytes at {addr:#x} in its segment"
                )))
            }
        }
    }

    fn free_buffer(&mut self, id: BufferId) {
        if let Some(b) = self.blocks.remove(&id) {
            self.alloc.free(b);
        }
        self.seg.inner.free_buffer(id);
    }

    /// What the device holds for the allocator: its segments (PyTorch's "reserved").
    fn allocated_bytes(&self) -> u64 {
        self.seg.inner.allocated_bytes()
    }

    fn hold_outside(&mut self, bytes: u64) -> Option<bool> {
        self.seg.inner.hold_outside(bytes)
    }

    fn release_outside(&mut self) {
        self.seg.inner.release_outside()
    }

    fn allocator_stats(&self) -> Option<Stats> {
        Some(self.alloc.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::conf::parse;
    use crate::backend::mock::MockBackend;

    const MIB: u64 = 1 << 20;

    fn pooled(capacity: u64) -> PooledBackend {
        let m = MockBackend::with_limits(capacity, 1 << 30, 1 << 30);
        PooledBackend::new(Box::new(m), AllocConf::default()).unwrap()
    }

    #[test]
    fn small_tensors_share_one_2_mib_segment_and_read_back_apart() {
        let mut p = pooled(64 * MIB);
        let a = p.alloc_buffer(1000).unwrap();
        let b = p.alloc_buffer(3000).unwrap();
        assert_eq!(p.allocated_bytes(), 2 * MIB, "one small segment");
        let s = p.allocator_stats().unwrap();
        assert_eq!((s.allocated, s.reserved), (1024 + 3072, 2 * MIB));
        p.write_buffer(a, 0, &[1; 1000]).unwrap();
        p.write_buffer(b, 0, &[2; 3000]).unwrap();
        assert_eq!(p.read_buffer(a, 0, 1000).unwrap(), vec![1; 1000]);
        assert_eq!(p.read_buffer(b, 0, 3000).unwrap(), vec![2; 3000]);
        // The cache keeps the segment once both are freed.
        p.free_buffer(a);
        p.free_buffer(b);
        assert_eq!(p.allocated_bytes(), 2 * MIB);
        assert_eq!(p.allocator_stats().unwrap().allocated, 0);
    }

    #[test]
    fn a_refusal_frees_the_cache_and_retries_then_names_fragmentation() {
        // 60 MiB: three 20 MiB segments of 6 MiB tensors, then a 30 MiB tensor.
        let mut p = pooled(60 * MIB);
        let t: Vec<_> = (0..9).map(|_| p.alloc_buffer(6 * MIB).unwrap()).collect();
        assert_eq!(p.allocated_bytes(), 60 * MIB);
        // Free every other tensor: 30 MiB free in total, no piece over 12 MiB.
        for id in t.iter().step_by(2) {
            p.free_buffer(*id);
        }
        let e = p.alloc_buffer(14 * MIB).unwrap_err();
        let AllocError::OutOfMemory { detail, .. } = e else {
            panic!("{e:?}")
        };
        assert!(detail.contains("fragmentation"), "{detail}");
        // Free the rest: the retry releases the cached segments and the request fits.
        for id in t.iter().skip(1).step_by(2) {
            p.free_buffer(*id);
        }
        assert!(p.alloc_buffer(30 * MIB).is_ok());
        // Both requests found no piece, freed the cache and retried.
        assert_eq!(p.allocator_stats().unwrap().num_alloc_retries, 2);
        assert_eq!(p.allocated_bytes(), 30 * MIB);
    }

    #[test]
    fn a_budget_refusal_stays_a_budget_refusal() {
        let m = MockBackend::with_limits(1 << 30, 1 << 30, 1 << 30);
        let b = crate::backend::budget::BudgetBackend::new(Box::new(m), 4 * MIB);
        let mut p = PooledBackend::new(Box::new(b), AllocConf::default()).unwrap();
        assert!(matches!(
            p.alloc_buffer(3 * MIB),
            Err(AllocError::Budget { .. })
        ));
    }

    #[test]
    fn the_pick_is_pytorch_on_cuda_direct_elsewhere_and_bad_settings_are_one_line() {
        let pick = |mode, conf: Option<&str>| AllocatorPick {
            mode,
            conf: conf.map(String::from),
        };
        let cuda = BackendKind::Cuda;
        assert_eq!(pick(None, None).resolve(BackendKind::Vulkan), Ok(None));
        assert_eq!(
            pick(None, Some("max_split_size_mb:64")).resolve(cuda),
            Ok(Some("max_split_size_mb:64".into()))
        );
        let p = Some(AllocatorMode::Pytorch);
        let e = pick(p, None).resolve(BackendKind::Vulkan).unwrap_err();
        assert!(e.contains("binds whole buffers only"), "{e}");
        let e = pick(p, Some("max_spilt_size_mb:64"))
            .resolve(cuda)
            .unwrap_err();
        assert!(
            e.starts_with("--alloc-conf: unknown key 'max_spilt_size_mb'"),
            "{e}"
        );
        let e = pick(p, Some("expandable_segments:True"))
            .resolve(cuda)
            .unwrap_err();
        assert!(e.contains("cuMemMap"), "{e}");
        let e = pick(None, Some("max_split_size_mb:64"))
            .resolve(BackendKind::Gl)
            .unwrap_err();
        assert!(e.contains("apply to --allocator pytorch"), "{e}");
    }

    #[test]
    fn expandable_segments_and_a_backend_without_views_are_refused() {
        let m = MockBackend::new(MIB);
        let e = PooledBackend::new(Box::new(m), parse("expandable_segments:True").unwrap());
        assert!(e.err().unwrap().contains("expandable_segments"));
        let e = PooledBackend::new(
            Box::new(MockBackend::new(MIB).without_views()),
            AllocConf::default(),
        );
        assert!(e.err().unwrap().contains("cannot bind part of a buffer"));
    }
}
