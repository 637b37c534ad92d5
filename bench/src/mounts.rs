//! Real mounts for benchmarks, unmounted on drop, and fio's JSON results.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rackfs_tests::{bin_path, wait_for, TempDir, TestCluster};

/// `rackfs mount --foreground` daemons of one cluster, one per option string.
pub struct Mounts {
    pub dirs: Vec<PathBuf>,
    daemons: Vec<Child>,
}

impl Drop for Mounts {
    fn drop(&mut self) {
        for d in &self.dirs {
            let _ = Command::new("umount").arg("-l").arg(d).status();
        }
        for c in &mut self.daemons {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Mounts {
    /// Pins every mount daemon (all its threads) to `cpu`.
    pub fn pin(&self, cpu: usize) {
        for d in &self.daemons {
            let ok = Command::new("taskset")
                .args(["-a", "-c", "-p", &cpu.to_string(), &d.id().to_string()])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "taskset could not pin mount daemon {}", d.id());
        }
    }
}

/// Mounts `cluster` once per entry of `opts` (mount options) at `tmp/tag-i`; a mount that
/// fails panics with its log.
pub fn mount_all(cluster: &TestCluster, tmp: &TempDir, tag: &str, opts: &[&str]) -> Mounts {
    let mut m = Mounts {
        dirs: Vec::new(),
        daemons: Vec::new(),
    };
    for (i, o) in opts.iter().enumerate() {
        let dir = tmp.path().join(format!("{tag}-{i}"));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let all = format!("secret_file={},{o}", cluster.secret_file.display());
        let log = tmp.path().join(format!("{tag}-{i}.log"));
        m.daemons.push(
            Command::new(bin_path("rackfs"))
                .args(["mount", "--foreground", &cluster.addr()])
                .arg(&dir)
                .args(["-o", &all])
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("mount log"))
                .spawn()
                .expect("rackfs mount"),
        );
        assert!(
            wait_for(Duration::from_secs(10), || {
                rackfs_fs::mount::is_rackfs_mount(&dir)
            }),
            "mount of {} with {o} failed: {}",
            dir.display(),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        m.dirs.push(dir);
    }
    m
}

/// fio 4 KiB random reads, one psync direct job named `name` in `dir`, for `runtime` s, JSON
/// on a pipe; the caller adds the file's size or name (mounts of one cluster see the same
/// files, so concurrent runs need their own names).
pub fn randread(dir: &std::path::Path, name: &str, runtime: u32) -> Command {
    let mut cmd = Command::new("fio");
    cmd.args([
        &format!("--name={name}"),
        &format!("--directory={}", dir.display()),
        "--rw=randread",
        "--bs=4k",
        "--ioengine=psync",
        "--direct=1",
        "--time_based",
        &format!("--runtime={runtime}"),
        "--output-format=json",
    ]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// Waits for a fio run started with `--output-format=json` and returns the IOPS of its
/// first job (or group) on `side` (`read` or `write`).
pub fn fio_iops(child: Child, side: &str) -> f64 {
    let out = child.wait_with_output().expect("fio");
    assert!(
        out.status.success(),
        "fio failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("fio JSON");
    v["jobs"][0][side]["iops"].as_f64().unwrap_or(0.0)
}
