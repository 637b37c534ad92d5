//! Shared file mappings, for tests of `mmap` through a mount.

use std::fs::File;
use std::os::fd::AsRawFd;

/// Maps the first `len` bytes of `f` shared and read-write, runs `body` on them, then
/// `msync(MS_SYNC)`s and unmaps; panics with the OS error if mapping fails.
pub fn mapped<T>(f: &File, len: usize, body: impl FnOnce(&mut [u8]) -> T) -> T {
    // SAFETY: a fresh mapping of an open file at an address the kernel chooses.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(
        p,
        libc::MAP_FAILED,
        "mmap MAP_SHARED: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: the mapping is `len` bytes, lives until munmap below, and nothing aliases it.
    let out = body(unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) });
    // SAFETY: msync and munmap of the mapping made above.
    unsafe {
        assert_eq!(libc::msync(p, len, libc::MS_SYNC), 0);
        assert_eq!(libc::munmap(p, len), 0);
    }
    out
}
