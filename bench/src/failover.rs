//! The metadata standby: what its journal costs namespace changes, and how long a mount waits
//! when the primary is killed (issue 14, item 4).
//!
//! Three memory nodes on a local etcd (2 s leases), one tcp mount. **Cost:** the mount creates
//! small files (create, write 4 KiB, close), with a standby and without one
//! (`--no-standby`), in alternating runs; the rate is files per second. **Failover:** with a
//! standby in sync, the primary is killed (`kill -9`) and the mount lists a directory at once:
//! the time until that listing returns, every name there, is the service's downtime as an
//! application sees it. Medians over the runs.

use std::time::{Duration, Instant};

use rackfs_coord::{Coordinator, Etcd};
use rackfs_tests::{wait_for, Mount, TestCluster};

use crate::stats::median;

pub struct Config {
    pub runs: usize,
    /// Files per creation run.
    pub files: usize,
}

fn cluster(standby: bool) -> Result<(TestCluster, Mount), String> {
    let mut flags = vec!["--node-lease-ms", "2000"];
    if !standby {
        flags.push("--no-standby");
    }
    let c = TestCluster::on_etcd(3, "256M", &flags);
    if standby {
        standby_named(&c, Duration::from_secs(10))?;
    }
    let m = Mount::try_new(&c.addr(), &c.secret_file, "transport=tcp,qos=off")
        .map_err(|log| format!("mount failed: {log}"))?;
    Ok((c, m))
}

/// Waits up to `within` for cluster `c` (on etcd) to name its metadata standby.
pub(crate) fn standby_named(c: &TestCluster, within: Duration) -> Result<(), String> {
    let etcd = Etcd::new(&c.etcd_endpoints(), "test", Duration::from_secs(2))
        .map_err(|e| e.to_string())?;
    if wait_for(within, || matches!(etcd.get("standby"), Ok(Some(_)))) {
        Ok(())
    } else {
        Err(format!("no metadata standby was named within {within:?}"))
    }
}

/// Files per second the mount creates (create, write 4 KiB, close) in a new directory.
fn create_rate(m: &Mount, dir: &str, files: usize) -> f64 {
    std::fs::create_dir(m.path(dir)).expect("a directory per run");
    let data = vec![7u8; 4096];
    let t0 = Instant::now();
    for i in 0..files {
        std::fs::write(m.path(&format!("{dir}/f{i}")), &data).expect("create a small file");
    }
    files as f64 / t0.elapsed().as_secs_f64()
}

pub fn run(cfg: &Config) -> Result<String, String> {
    let (mut with, mut without, mut downtime) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..cfg.runs {
        // Alternate which configuration goes first.
        for standby in [run % 2 == 0, run % 2 == 1] {
            let (mut c, m) = cluster(standby)?;
            create_rate(&m, "warm", cfg.files / 4);
            let rate = create_rate(&m, "d", cfg.files);
            eprintln!(
                "run {run}: {} files/s {}",
                rate as u64,
                if standby { "with a standby" } else { "without" }
            );
            if !standby {
                without.push(rate);
                continue;
            }
            with.push(rate);
            c.kill(0);
            let t0 = Instant::now();
            let names = std::fs::read_dir(m.path("d"))
                .map_err(|e| format!("listing after the kill: {e}\n{}", m.log_text()))?
                .count();
            let took = t0.elapsed();
            if names != cfg.files {
                return Err(format!("{names} of {} names after the failover", cfg.files));
            }
            eprintln!("run {run}: namespace back {took:?} after kill -9 of the primary");
            downtime.push(took.as_secs_f64());
        }
    }
    let (w, wo) = (median(&with), median(&without));
    let mut md = format!(
        "### Namespace changes with and without a metadata standby (3 nodes on etcd, tcp mount, \
         create + 4 KiB write + close, {} files per run, median of {} runs)\n\n\
         | configuration | files/s |\n|---|---:|\n| no standby | {wo:.0} |\n| standby (journal before each answer) | {w:.0} |\n",
        cfg.files, cfg.runs
    );
    md.push_str(&format!(
        "\n- With a standby: {:.0}% of the rate without.\n",
        100.0 * w / wo
    ));
    md.push_str(&format!(
        "\n### Failover: kill -9 of the primary, then a directory listing through the mount\n\n\
         - Listing returned (every name there) after {:.2} s (median of {}; runs: {}).\n",
        median(&downtime),
        downtime.len(),
        downtime
            .iter()
            .map(|d| format!("{d:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    Ok(md)
}
