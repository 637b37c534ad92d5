//! Sets of real mounts of one cluster for benchmarks, unmounted on drop, and the fio job they
//! run most.

use std::path::{Path, PathBuf};

use rackfs_tests::{Fio, Mount, TestCluster};

/// Mounts of one cluster, one per option string.
pub struct Mounts {
    pub dirs: Vec<PathBuf>,
    mounts: Vec<Mount>,
}

impl Mounts {
    /// Pins every mount daemon (all its threads) to `cpu`.
    pub fn pin(&self, cpu: usize) {
        for m in &self.mounts {
            m.pin(&cpu.to_string());
        }
    }
}

/// Mounts `cluster` once per entry of `opts` (mount options); a mount that fails panics with
/// its log.
pub fn mount_all(cluster: &TestCluster, opts: &[&str]) -> Mounts {
    let mounts: Vec<Mount> = opts.iter().map(|o| Mount::new(cluster, o)).collect();
    Mounts {
        dirs: mounts.iter().map(|m| m.dir.clone()).collect(),
        mounts,
    }
}

/// fio 4 KiB random reads, one psync direct job named `name` in `dir`, for `runtime` s; the
/// caller adds the file's size or name (mounts of one cluster see the same files, so
/// concurrent runs need their own names).
pub fn randread(dir: &Path, name: &str, runtime: u32) -> Fio {
    Fio::job(name, dir)
        .opt("rw", "randread")
        .opt("bs", "4k")
        .opt("ioengine", "psync")
        .opt("direct", 1)
        .flag("time_based")
        .opt("runtime", runtime)
}
