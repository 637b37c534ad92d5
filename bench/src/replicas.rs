//! RackOut's read balancing under skew, and what a second replica costs writes (issue 14).
//!
//! Three memory nodes serve a tcp mount (their NIC threads, on CPU 1, execute every verb).
//! Node 2 is made *hot*: its process is throttled to [`HOT_PERCENT`]% of a CPU (cgroup v1 `cpu` quota),
//! a node that is slow because it is busy. Four fio jobs read 4 KiB at random, Zipf(0.99)
//! over a set of files and within each, through three mounts of the same cluster: one
//! replica, two replicas read by the static policy, two read by the adaptive one. Each run
//! reports aggregate IOPS, p99 latency and the share of verbs each node served (its counters'
//! difference). Then, with no node throttled, 4 KiB random writes with one and two replicas.
//! Runs rotate the configurations; medians are reported.

use std::path::{Path, PathBuf};

use rackfs_tests::{pin, Fio, Mount, TestCluster};

use crate::stats::median;

/// How much of a CPU the hot node gets.
const HOT_PERCENT: u64 = 3;

/// The cgroup that throttles the hot node.
const HOT_CGROUP: &str = "/sys/fs/cgroup/cpu/rackfs-bench-hot";

pub struct Config {
    pub runs: usize,
    pub runtime_s: u32,
}

/// One configuration's medians.
pub struct Row {
    pub name: &'static str,
    pub iops: f64,
    pub p99_us: f64,
    /// Share of the verbs each node served, in percent.
    pub share: Vec<f64>,
}

/// Throttles process `pid` to `percent` of one CPU until dropped.
struct Throttle;

impl Throttle {
    fn new(pid: u32, percent: u64) -> Result<Throttle, String> {
        let dir = Path::new(HOT_CGROUP);
        let w = |f: &str, v: String| {
            std::fs::write(dir.join(f), v).map_err(|e| format!("{}/{f}: {e}", dir.display()))
        };
        std::fs::create_dir_all(dir).map_err(|e| {
            format!("cannot create {HOT_CGROUP} (needs root and the cgroup v1 cpu controller): {e}")
        })?;
        w("cpu.cfs_period_us", "100000".into())?;
        w("cpu.cfs_quota_us", (percent * 1000).to_string())?;
        w("cgroup.procs", pid.to_string())?;
        Ok(Throttle)
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        // Move the processes back to the root group, then remove the group.
        if let Ok(procs) = std::fs::read_to_string(Path::new(HOT_CGROUP).join("cgroup.procs")) {
            for p in procs.lines() {
                let _ = std::fs::write("/sys/fs/cgroup/cpu/cgroup.procs", p);
            }
        }
        let _ = std::fs::remove_dir(HOT_CGROUP);
    }
}

fn verbs_per_node(c: &TestCluster) -> Vec<u64> {
    (0..c.nodes.len())
        .map(|i| c.control(i).stats().map_or(0, |s| s.verbs.total_ops()))
        .collect()
}

fn fio(dir: &Path, rw: &str, cfg: &Config) -> (f64, f64) {
    let report = Fio::job("skew", dir)
        .opt("rw", rw)
        .opt("bs", "4k")
        .opt("nrfiles", 16)
        .opt("filesize", "2M")
        .opt("file_service_type", "zipf:0.99")
        .opt("random_distribution", "zipf:0.99")
        .opt("numjobs", 4)
        .opt("ioengine", "psync")
        .opt("direct", 1)
        .flag("time_based")
        .opt("runtime", cfg.runtime_s)
        .opt("ramp_time", 1)
        .flag("group_reporting")
        .opt("cpus_allowed", "0")
        .run();
    let j = report.first();
    let side = if rw.contains("read") {
        &j.read
    } else {
        &j.write
    };
    (side.iops, side.p99_us)
}

/// Runs `configs` (name, mount directory) `cfg.runs` times each, rotating, and returns the
/// medians.
fn measure(
    c: &TestCluster,
    configs: &[(&'static str, PathBuf)],
    rw: &str,
    cfg: &Config,
) -> Vec<Row> {
    let n = configs.len();
    let mut samples: Vec<Vec<(f64, f64, Vec<f64>)>> = vec![Vec::new(); n];
    for run in 0..cfg.runs {
        for k in 0..n {
            let i = (k + run) % n;
            let before = verbs_per_node(c);
            let (iops, p99) = fio(&configs[i].1, rw, cfg);
            let after = verbs_per_node(c);
            let d: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
            let total = d.iter().sum::<u64>().max(1) as f64;
            let share = d.iter().map(|&x| 100.0 * x as f64 / total).collect();
            eprintln!(
                "  {} run {run}: {iops:.0} IOPS, p99 {p99:.0} us",
                configs[i].0
            );
            samples[i].push((iops, p99, share));
        }
    }
    samples
        .into_iter()
        .zip(configs)
        .map(|(s, (name, _))| Row {
            name,
            iops: median(&s.iter().map(|x| x.0).collect::<Vec<_>>()),
            p99_us: median(&s.iter().map(|x| x.1).collect::<Vec<_>>()),
            share: (0..c.nodes.len())
                .map(|k| median(&s.iter().map(|x| x.2[k]).collect::<Vec<_>>()))
                .collect(),
        })
        .collect()
}

/// The skew table and the write-cost table, with the ratios the issue asks for.
pub fn run(cfg: &Config) -> Result<String, String> {
    let c = TestCluster::start(3, "512M");
    for n in c.nodes.iter().flatten() {
        pin(n.child.id(), "1");
    }
    let mounts: Vec<(&'static str, Mount)> = [
        ("r=1", "replicas=1"),
        ("r=2 static", "replicas=2,read_policy=static"),
        ("r=2 adaptive", "replicas=2,read_policy=adaptive"),
    ]
    .into_iter()
    .map(|(name, o)| {
        let m = Mount::try_new(
            &c.addr(),
            &c.secret_file,
            &format!("transport=tcp,stripe_unit=64K,qos=off,{o}"),
        )
        .unwrap_or_else(|log| panic!("mount {o}: {log}"));
        m.pin("0");
        (name, m)
    })
    .collect();
    // The mounts share one namespace: each configuration has a directory of its own, so its
    // files are laid out with its replicas.
    let dirs: Vec<(&'static str, PathBuf)> = mounts
        .iter()
        .enumerate()
        .map(|(i, (n, m))| {
            let d = m.dir.join(format!("config{i}"));
            std::fs::create_dir_all(&d).expect("a directory per configuration");
            (*n, d)
        })
        .collect();
    // Lay the files out (each mount's own, with its replicas) before throttling.
    for (_, d) in &dirs {
        fio(
            d,
            "randread",
            &Config {
                runs: 1,
                runtime_s: 1,
            },
        );
    }
    let hot = c.nodes[2].as_ref().expect("node 2").child.id();
    let skew = {
        let _t = Throttle::new(hot, HOT_PERCENT)?;
        eprintln!("Zipf(0.99) 4K random reads, node 2 throttled to {HOT_PERCENT}% of a CPU:");
        measure(&c, &dirs, "randread", cfg)
    };
    eprintln!("4K random writes, no node throttled:");
    let writes = measure(&c, &[dirs[0].clone(), dirs[2].clone()], "randwrite", cfg);
    let mut md = format!(
        "### Reads under skew: Zipf(0.99) 4 KiB random reads, 4 jobs, tcp, node 2 hot \
         (throttled to {HOT_PERCENT}% of a CPU)\n\n\
         | configuration | IOPS | p99 µs | verbs served by node 0 / 1 / 2 (hot) |\n|---|---:|---:|---|\n"
    );
    let shares = |r: &Row| {
        r.share
            .iter()
            .map(|s| format!("{s:.0}%"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    for r in &skew {
        md.push_str(&format!(
            "| {} | {:.0} | {:.0} | {} |\n",
            r.name,
            r.iops,
            r.p99_us,
            shares(r)
        ));
    }
    md.push_str(&format!(
        "\n- r=2 adaptive = {:.2}x the IOPS of r=1 (p99 {:.0} vs {:.0} µs); r=2 static = {:.2}x.\n",
        skew[2].iops / skew[0].iops,
        skew[2].p99_us,
        skew[0].p99_us,
        skew[1].iops / skew[0].iops
    ));
    md.push_str(
        "\n### What the second replica costs: 4 KiB random writes, 4 jobs, tcp, no node throttled\n\n\
         | configuration | IOPS | p99 µs |\n|---|---:|---:|\n",
    );
    for r in &writes {
        md.push_str(&format!(
            "| {} | {:.0} | {:.0} |\n",
            r.name, r.iops, r.p99_us
        ));
    }
    md.push_str(&format!(
        "\n- r=2 write IOPS = {:.0}% of r=1's.\n",
        100.0 * writes[1].iops / writes[0].iops
    ));
    Ok(md)
}
