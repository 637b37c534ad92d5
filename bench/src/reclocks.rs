//! fcntl record locks across mounts (issue 15): `F_SETLK(W)` + `F_UNLCK` pairs per second on
//! one byte of a file, by one process (uncontended), by two processes on different bytes, and
//! by two processes on the same byte (contended, `F_SETLKW`), on tmpfs (the kernel's local
//! locks, for scale) and on RackFS with the two processes on two mounts (shm and tcp) of one
//! cluster. Each process is this binary's `lock-loop`, locking and unlocking for a fixed time;
//! a point's rate is the sum of its processes' rates, the median over the runs.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rackfs_tests::{Mount, TempDir, TestCluster};

use crate::stats::{median, rate};

pub struct Config {
    pub runs: usize,
    pub duration: Duration,
}

/// Locks and unlocks byte `byte` of `path` for `duration`; returns pairs per second.
pub fn lock_loop(path: &Path, byte: i64, wait: bool, duration: Duration) -> Result<f64, String> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let lock = |typ: i32| {
        // SAFETY: flock is plain data; all-zero is a valid value.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = typ as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = byte;
        fl.l_len = 1;
        let cmd = if wait { libc::F_SETLKW } else { libc::F_SETLK };
        // SAFETY: a plain syscall on our descriptor with a valid flock.
        match unsafe { libc::fcntl(f.as_raw_fd(), cmd, &mut fl as *mut libc::flock) } {
            0 => Ok(()),
            _ => Err(format!("fcntl: {}", std::io::Error::last_os_error())),
        }
    };
    let t0 = Instant::now();
    let mut pairs = 0u64;
    while t0.elapsed() < duration {
        lock(libc::F_WRLCK)?;
        lock(libc::F_UNLCK)?;
        pairs += 1;
    }
    Ok(pairs as f64 / t0.elapsed().as_secs_f64())
}

/// Runs `lock-loop` processes at once, one per (file, byte); returns their summed rate.
fn together(loops: &[(PathBuf, i64)], wait: bool, duration: Duration) -> Result<f64, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let children: Vec<_> = loops
        .iter()
        .map(|(path, byte)| {
            let mut c = Command::new(&exe);
            c.arg("lock-loop").arg(path).arg(byte.to_string());
            c.arg("--ms").arg(duration.as_millis().to_string());
            if wait {
                c.arg("--wait");
            }
            c.stdout(Stdio::piped()).spawn().map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    let mut total = 0.0;
    for c in children {
        let out = c.wait_with_output().map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(format!("lock-loop failed: {text}"));
        }
        total += text
            .trim()
            .parse::<f64>()
            .map_err(|e| format!("{text:?}: {e}"))?;
    }
    Ok(total)
}

/// One measured point: its name, each process's (file, byte), and whether they wait.
type Point = (String, Vec<(PathBuf, i64)>, bool);

fn points(tmp: &Path, a: &Path, b: &Path) -> Vec<Point> {
    let mut v = Vec::new();
    for (sys, one, two) in [("tmpfs", tmp, tmp), ("RackFS (shm + tcp mounts)", a, b)] {
        v.push((format!("{sys}: 1 process"), vec![(one.join("f"), 0)], false));
        v.push((
            format!("{sys}: 2 processes, different bytes"),
            vec![(one.join("f"), 0), (two.join("f"), 1)],
            false,
        ));
        v.push((
            format!("{sys}: 2 processes, one byte (F_SETLKW)"),
            vec![(one.join("f"), 0), (two.join("f"), 0)],
            true,
        ));
    }
    v
}

pub fn run(cfg: &Config) -> Result<String, String> {
    let tmp = TempDir::in_memory("reclocks");
    let c = TestCluster::start(2, "64M");
    let a =
        Mount::try_new(&c.addr(), &c.secret_file, "qos=off").map_err(|l| format!("mount: {l}"))?;
    let b = Mount::try_new(&c.addr(), &c.secret_file, "qos=off,transport=tcp")
        .map_err(|l| format!("mount: {l}"))?;
    let pts = points(tmp.path(), &a.dir, &b.dir);
    let mut rates = vec![Vec::new(); pts.len()];
    for run in 0..cfg.runs {
        for (i, (name, loops, wait)) in pts.iter().enumerate() {
            let r = together(loops, *wait, cfg.duration)?;
            eprintln!("run {run}: {name}: {} pairs/s", rate(r));
            rates[i].push(r);
        }
    }
    let mut md = format!(
        "### fcntl lock + unlock pairs per second (one byte each, {} ms per point, median of {} runs)\n\n\
         | point | pairs/s |\n|---|---:|\n",
        cfg.duration.as_millis(),
        cfg.runs
    );
    for ((name, _, _), r) in pts.iter().zip(&rates) {
        md.push_str(&format!("| {name} | {} |\n", rate(median(r))));
    }
    Ok(md)
}
