//! Allocation, fill/verify/checksum and OOM behaviour of the wgpu backend (on lavapipe in CI).

use oomprobe::backend::wgpu::{AdapterSelector, WgpuBackend};
use oomprobe::backend::Backend;
use oomprobe::ops::words::{self, pattern};

const NO_ADAPTER: &str = "no wgpu adapter: install a GPU driver or the software Vulkan driver \
                          (apt-get install -y mesa-vulkan-drivers libvulkan1)";

fn open() -> WgpuBackend {
    match WgpuBackend::open(AdapterSelector::Auto) {
        Ok(b) => b,
        Err(e) => panic!("{NO_ADAPTER}: {e}"),
    }
}

fn read_words(b: &mut dyn Backend, id: oomprobe::backend::BufferId, words: u64) -> Vec<u32> {
    let bytes = b.read_buffer(id, 0, words * 4).expect("read back");
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn fill_kernel_writes_the_host_pattern() {
    let mut b = open();
    let words = 1000u64;
    let id = b.alloc_buffer(words * 4).expect("alloc");
    // Poison first so unwritten words are caught.
    b.write_buffer(id, 0, &vec![0xAB; (words * 4) as usize])
        .unwrap();
    let first = (1u64 << 32) - 300; // crosses the 32-bit boundary of the word index
    words::fill_buffer(&mut b, id, first, words, 42).expect("fill");
    b.synchronize().expect("sync");
    let got = read_words(&mut b, id, words);
    let want: Vec<u32> = (0..words).map(|i| pattern(first + i, 42)).collect();
    assert_eq!(got, want);
    b.free_buffer(id);
    assert_eq!(b.allocated_bytes(), 0);
}
