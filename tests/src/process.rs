//! Processes and scratch space: where the workspace's binaries are, private temporary
//! directories, and polling with a deadline.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Path of a binary built from this workspace (`target/<profile>/NAME`).
pub fn bin_path(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("RACKFS_BIN_DIR") {
        return Path::new(&dir).join(name);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().expect("deps dir");
    let dir = if dir.ends_with("deps") {
        dir.parent().expect("profile dir")
    } else {
        dir
    };
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not built: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// A private scratch directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        Self::under(&std::env::temp_dir(), tag)
    }

    /// A scratch directory in memory (`/dev/shm` when there is one): for etcd's data, whose
    /// fsyncs would otherwise stall on a busy disk.
    pub fn in_memory(tag: &str) -> TempDir {
        let shm = Path::new("/dev/shm");
        Self::under(if shm.is_dir() { shm } else { Path::new("/tmp") }, tag)
    }

    fn under(base: &Path, tag: &str) -> TempDir {
        let mut n = [0u8; 6];
        n.copy_from_slice(&rackfs_verbs::auth::nonce()[..6]);
        let hex: String = n.iter().map(|b| format!("{b:02x}")).collect();
        let p = base.join(format!("rackfs-{tag}-{hex}"));
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Polls `cond` every 10 ms until it holds or `timeout` passes.
pub fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// Stops process `pid` (SIGSTOP) and returns once every one of its threads is stopped:
/// kill(2) returns before a thread running on another CPU has stopped.
pub fn stop_process(pid: i32) {
    // SAFETY: kill(2) with a pid the caller started; no memory is involved.
    let sent = unsafe { libc::kill(pid, libc::SIGSTOP) };
    assert_eq!(sent, 0, "SIGSTOP {pid}");
    let all_stopped = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|tasks| {
                tasks.flatten().all(|t| {
                    std::fs::read_to_string(t.path().join("stat")).is_ok_and(|s| {
                        s.rsplit_once(") ")
                            .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
                    })
                })
            })
            .unwrap_or(true)
    };
    assert!(
        wait_for(Duration::from_secs(5), all_stopped),
        "process {pid} did not stop"
    );
}
