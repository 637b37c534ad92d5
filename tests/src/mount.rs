//! Real FUSE mounts: `rackfs mount --foreground` child processes, unmounted on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::node::TestCluster;
use crate::process::{bin_path, wait_for, TempDir};

/// A real FUSE mount served by a `rackfs mount --foreground` child process.
pub struct Mount {
    pub child: Child,
    pub dir: PathBuf,
    pub log: PathBuf,
    _tmp: TempDir,
}

impl Mount {
    /// Mounts `cluster` with extra `-o` options (the secret file is added).
    pub fn new(cluster: &TestCluster, opts: &str) -> Mount {
        Self::try_new(&cluster.addr(), &cluster.secret_file, opts)
            .unwrap_or_else(|e| panic!("mount failed: {e}"))
    }

    pub fn try_new(source: &str, secret_file: &Path, opts: &str) -> Result<Mount, String> {
        let tmp = TempDir::new("mnt");
        let dir = tmp.path().join("m");
        std::fs::create_dir(&dir).expect("mount dir");
        let log = tmp.path().join("mount.log");
        let mut all = format!("secret_file={}", secret_file.display());
        if !opts.is_empty() {
            all.push(',');
            all.push_str(opts);
        }
        let child = Command::new(bin_path("rackfs"))
            .args(["mount", "--foreground", source])
            .arg(&dir)
            .args(["-o", &all])
            // A test run's RUST_LOG (say `info,rackfs_fs=debug`) reaches the mount too.
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn rackfs mount");
        let mut m = Mount {
            child,
            dir,
            log,
            _tmp: tmp,
        };
        let ok = wait_for(Duration::from_secs(15), || {
            rackfs_fs::mount::is_rackfs_mount(&m.dir) || !matches!(m.child.try_wait(), Ok(None))
        });
        if !ok || !rackfs_fs::mount::is_rackfs_mount(&m.dir) {
            let _ = m.child.kill();
            return Err(std::fs::read_to_string(&m.log).unwrap_or_default());
        }
        Ok(m)
    }

    /// The mount's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    /// Pins the mount daemon (all its threads) to `cpus` (a `taskset -c` list).
    pub fn pin(&self, cpus: &str) {
        pin(self.child.id(), cpus);
    }
}

/// Pins process `pid` (all its threads) to `cpus` (a `taskset -c` list); panics if it cannot.
pub fn pin(pid: u32, cpus: &str) {
    let ok = Command::new("taskset")
        .args(["-a", "-c", "-p", cpus, &pid.to_string()])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "taskset could not pin process {pid} to CPUs {cpus}");
}

impl Drop for Mount {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(self.dir.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: umount2 on a NUL-terminated path we mounted; MNT_DETACH never blocks.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        let _ = wait_for(Duration::from_secs(5), || {
            !matches!(self.child.try_wait(), Ok(None))
        });
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
