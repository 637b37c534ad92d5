//! fio on RackFS next to its baselines, measured in the same run.
//!
//! Systems: tmpfs (the kernel's own memory filesystem), `rackfs-memfs` (a minimal in-memory
//! fuser filesystem with RackFS's FUSE configuration: the FUSE ceiling), and RackFS over shm
//! and over tcp (two memory nodes, 1 MiB stripes). Placement: on this 2-core machine a FUSE
//! round trip costs ~3 us when fio and the FUSE daemon share a CPU and 10-20x more when a
//! sleeping CPU must wake, so single-job runs pin fio and every FUSE daemon to CPU 0 and the
//! memory nodes to CPU 1; 4-job runs let fio and the daemons use both CPUs. Each point runs
//! `runs` times, the order of systems rotating between runs; the median is reported.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rackfs_tests::{bin_path, pin, wait_for, Fio, Mount, TempDir, TestCluster};

use crate::stats::{median, rate};

#[derive(Clone, Copy)]
pub struct Workload {
    pub name: &'static str,
    pub rw: &'static str,
    pub bs: &'static str,
    pub jobs: u32,
}

pub const WORKLOADS: [Workload; 6] = [
    Workload {
        name: "4K randread, 1 job",
        rw: "randread",
        bs: "4k",
        jobs: 1,
    },
    Workload {
        name: "4K randread, 4 jobs",
        rw: "randread",
        bs: "4k",
        jobs: 4,
    },
    Workload {
        name: "4K randwrite, 1 job",
        rw: "randwrite",
        bs: "4k",
        jobs: 1,
    },
    Workload {
        name: "4K randwrite, 4 jobs",
        rw: "randwrite",
        bs: "4k",
        jobs: 4,
    },
    Workload {
        name: "1M seq read, 1 job",
        rw: "read",
        bs: "1M",
        jobs: 1,
    },
    Workload {
        name: "1M seq write, 1 job",
        rw: "write",
        bs: "1M",
        jobs: 1,
    },
];

pub struct Config {
    pub runs: usize,
    pub runtime_s: u32,
    pub size_per_job: &'static str,
    /// Only the workloads whose name contains this (all if `None`).
    pub only: Option<String>,
}

/// One result of one fio run.
#[derive(Clone, Copy, Debug, Default)]
pub struct FioResult {
    pub iops: f64,
    pub bw: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

/// One filesystem under test.
pub struct System {
    pub name: &'static str,
    pub dir: PathBuf,
    /// Whether fio should use O_DIRECT (not on tmpfs).
    pub direct: bool,
    /// Whether it is RackFS (mounts of one cluster).
    pub rackfs: bool,
}

/// A RackFS cluster to mount: started here, or one that already runs.
pub enum Target {
    Embedded { nodes: usize, region: &'static str },
    Existing { addr: String, secret_file: PathBuf },
}

/// Everything mounted for a benchmark, unmounted on drop.
pub struct Rig {
    pub systems: Vec<System>,
    /// The FUSE ceiling's daemon (`rackfs-memfs`).
    daemons: Vec<Child>,
    /// tmpfs and memfs mount points.
    mounts: Vec<PathBuf>,
    rackfs: Vec<Mount>,
    /// The embedded cluster (kept running while mounted).
    cluster: Option<TestCluster>,
    /// A second cluster, on etcd with a metadata standby (see [`Rig::add_standby`]).
    standby: Option<TestCluster>,
    pub addr: String,
    pub secret_file: PathBuf,
    /// Holds the tmpfs and memfs mount points.
    _tmp: TempDir,
}

impl Drop for Rig {
    fn drop(&mut self) {
        for m in &self.mounts {
            let _ = Command::new("umount").arg("-l").arg(m).status();
        }
        for d in &mut self.daemons {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
}

impl Rig {
    /// Pins every FUSE daemon (all threads) to `cpus`.
    /// Lets the embedded memory nodes run on `cpus` (the rig starts them on CPU 1).
    pub fn pin_nodes(&self, cpus: &str) {
        let clusters = self.cluster.iter().chain(&self.standby);
        for n in clusters.flat_map(|c| c.nodes.iter().flatten()) {
            pin(n.child.id(), cpus);
        }
    }

    pub fn pin_daemons(&self, cpus: &str) {
        for d in &self.daemons {
            pin(d.id(), cpus);
        }
        for m in &self.rackfs {
            m.pin(cpus);
        }
    }

    /// Adds bindfs (`bindfs -f SRC DST`, default options: one thread) over a directory on the
    /// rig's tmpfs, as the system after tmpfs, its daemon pinned to `cpus`. Errs, mounting
    /// nothing, when bindfs is not installed or does not mount.
    pub fn add_bindfs(&mut self, cpus: &str) -> Result<(), String> {
        let (src, dst) = (
            self.systems[0].dir.join("bindfs-src"),
            self._tmp.path().join("bindfs"),
        );
        for d in [&src, &dst] {
            std::fs::create_dir_all(d).map_err(|e| format!("mkdir {}: {e}", d.display()))?;
        }
        if !have("bindfs") {
            return Err("bindfs is not installed (apt-get install bindfs)".into());
        }
        let mut child = Command::new("taskset")
            .args(["-c", cpus, "bindfs", "-f"])
            .arg(&src)
            .arg(&dst)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("start bindfs: {e}"))?;
        let up = wait_for(Duration::from_secs(10), || {
            fuse_mounted(&dst) || !matches!(child.try_wait(), Ok(None))
        });
        if !up || !fuse_mounted(&dst) {
            let _ = Command::new("umount").arg("-l").arg(&dst).status();
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("bindfs did not mount {}", dst.display()));
        }
        // Unmounted first on drop: it sits on the tmpfs.
        self.mounts.insert(0, dst.clone());
        self.daemons.push(child);
        self.systems.insert(
            1,
            System {
                name: "bindfs",
                dir: dst,
                direct: false,
                rackfs: false,
            },
        );
        Ok(())
    }

    /// Adds RackFS over shm on a second cluster of two memory nodes whose membership lives in
    /// a local etcd (Debian's `etcd-server`), so the data node is the primary's metadata
    /// standby and every change waits for its journal (as under `rackfs up`), as the last
    /// system, its daemon pinned to `cpus`. Errs, adding nothing, without etcd or when no
    /// standby is named within 15 s.
    pub fn add_standby(&mut self, cpus: &str) -> Result<(), String> {
        if !have("etcd") {
            return Err("etcd is not installed (apt-get install etcd-server)".into());
        }
        let c = TestCluster::on_etcd(2, "1G", &[]);
        for n in c.nodes.iter().flatten() {
            pin(n.child.id(), "1");
        }
        crate::failover::standby_named(&c, Duration::from_secs(15))?;
        let m = Mount::try_new(&c.addr(), &c.secret_file, "transport=shm")
            .map_err(|log| format!("mount on the standby cluster failed: {log}"))?;
        m.pin(cpus);
        self.systems.push(System {
            name: "RackFS shm + standby",
            dir: m.dir.clone(),
            direct: true,
            rackfs: true,
        });
        self.rackfs.push(m);
        self.standby = Some(c);
        Ok(())
    }

    /// Mounts the rig's cluster once more with extra mount options, its daemon on `cpus`.
    pub fn mount_rackfs(&mut self, options: &str, cpus: &str) -> PathBuf {
        let m = Mount::try_new(&self.addr, &self.secret_file, options)
            .unwrap_or_else(|log| panic!("rackfs mount with {options} failed: {log}"));
        m.pin(cpus);
        let dir = m.dir.clone();
        self.rackfs.push(m);
        dir
    }
}

/// Whether `program` is on the PATH.
pub(crate) fn have(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn pinned(cpus: &str, program: &Path) -> Command {
    let mut c = Command::new("taskset");
    c.args(["-c", cpus]).arg(program);
    c
}

fn mounted(dir: &Path, fstype_prefix: &str) -> bool {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            f.len() > 2 && Path::new(f[1]) == dir && f[0].starts_with(fstype_prefix)
        })
}

/// Whether a FUSE filesystem is mounted on `dir`.
fn fuse_mounted(dir: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            f.len() > 2 && Path::new(f[1]) == dir && f[2].starts_with("fuse")
        })
}

fn setup(daemon_cpus: &str) -> Rig {
    rig(
        daemon_cpus,
        &Target::Embedded {
            nodes: 2,
            region: "1G",
        },
    )
}

/// tmpfs, the FUSE ceiling (`rackfs-memfs`), and RackFS over shm (embedded clusters only)
/// and tcp, the FUSE daemons pinned to `daemon_cpus`.
pub fn rig(daemon_cpus: &str, target: &Target) -> Rig {
    let tmp = TempDir::new("bench");
    let mk = |n: &str| {
        let p = tmp.path().join(n);
        std::fs::create_dir_all(&p).expect("mkdir");
        p
    };
    let (tmpfs, memfs) = (mk("tmpfs"), mk("memfs"));
    assert!(Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2g", "tmpfs"])
        .arg(&tmpfs)
        .status()
        .expect("mount")
        .success());
    let daemons = vec![pinned(daemon_cpus, &bin_path("rackfs-memfs"))
        .arg(&memfs)
        .stdout(Stdio::null())
        .spawn()
        .expect("memfs")];
    assert!(
        wait_for(Duration::from_secs(10), || mounted(&memfs, "memfs")),
        "memfs mounted"
    );
    let (cluster, addr, secret_file) = match target {
        Target::Embedded { nodes, region } => {
            let c = TestCluster::start(*nodes, region);
            // The memory nodes' NIC threads run on CPU 1 (they only matter for tcp).
            for n in c.nodes.iter().flatten() {
                pin(n.child.id(), "1");
            }
            let (a, s) = (c.addr(), c.secret_file.clone());
            (Some(c), a, s)
        }
        Target::Existing { addr, secret_file } => (None, addr.clone(), secret_file.clone()),
    };
    let mut rig = Rig {
        systems: Vec::new(),
        daemons,
        mounts: vec![tmpfs.clone(), memfs.clone()],
        rackfs: Vec::new(),
        cluster,
        standby: None,
        addr,
        secret_file,
        _tmp: tmp,
    };
    // shm needs the nodes on this host; an existing cluster is reached over tcp only.
    let transports: &[(&str, &'static str)] = if rig.cluster.is_some() {
        &[("shm", "RackFS shm"), ("tcp", "RackFS tcp")]
    } else {
        &[("tcp", "RackFS tcp")]
    };
    let mut rackfs = Vec::new();
    for (t, name) in transports {
        let dir = rig.mount_rackfs(&format!("transport={t}"), daemon_cpus);
        rackfs.push(System {
            name,
            dir,
            direct: true,
            rackfs: true,
        });
    }
    rig.systems = vec![
        System {
            name: "tmpfs",
            dir: tmpfs,
            direct: false,
            rackfs: false,
        },
        System {
            name: "memfs (FUSE ceiling)",
            dir: memfs,
            direct: true,
            rackfs: false,
        },
    ];
    rig.systems.extend(rackfs);
    rig
}

fn run_fio(dir: &Path, w: &Workload, direct: bool, cfg: &Config, cpus: &str) -> FioResult {
    let report = Fio::job("job", dir)
        .opt("rw", w.rw)
        .opt("bs", w.bs)
        .opt("size", cfg.size_per_job)
        .opt("numjobs", w.jobs)
        .opt("ioengine", "psync")
        .opt("direct", u8::from(direct))
        .flag("time_based")
        .opt("runtime", cfg.runtime_s)
        .opt("ramp_time", 1)
        .flag("group_reporting")
        .opt("cpus_allowed", cpus)
        .run();
    let j = report.first();
    let side = if w.rw.contains("read") {
        &j.read
    } else {
        &j.write
    };
    FioResult {
        iops: side.iops,
        bw: side.bw_bytes,
        p50_us: side.p50_us,
        p99_us: side.p99_us,
    }
}

pub struct Row {
    pub workload: Workload,
    pub system: &'static str,
    pub result: FioResult,
    pub min_iops: f64,
    pub max_iops: f64,
}

pub fn run(cfg: &Config) -> Vec<Row> {
    let mut rows = Vec::new();
    let chosen = |w: &&Workload| {
        cfg.only
            .as_ref()
            .is_none_or(|o| w.name.contains(o.as_str()))
    };
    for (cpus, jobs) in [("0", 1), ("0-1", 4)] {
        if !WORKLOADS.iter().filter(chosen).any(|w| w.jobs == jobs) {
            continue;
        }
        let rig = setup(cpus);
        for w in WORKLOADS.iter().filter(chosen).filter(|w| w.jobs == jobs) {
            let n = rig.systems.len();
            let mut results: Vec<Vec<FioResult>> = vec![Vec::new(); n];
            for run in 0..cfg.runs {
                for k in 0..n {
                    let i = (k + run) % n;
                    let s = &rig.systems[i];
                    results[i].push(run_fio(&s.dir, w, s.direct, cfg, cpus));
                }
            }
            for (i, rs) in results.into_iter().enumerate() {
                let iops: Vec<f64> = rs.iter().map(|r| r.iops).collect();
                let r = FioResult {
                    iops: median(&iops),
                    bw: median(&rs.iter().map(|r| r.bw).collect::<Vec<_>>()),
                    p50_us: median(&rs.iter().map(|r| r.p50_us).collect::<Vec<_>>()),
                    p99_us: median(&rs.iter().map(|r| r.p99_us).collect::<Vec<_>>()),
                };
                let row = Row {
                    workload: *w,
                    system: rig.systems[i].name,
                    result: r,
                    min_iops: iops.iter().cloned().fold(f64::MAX, f64::min),
                    max_iops: iops.iter().cloned().fold(0.0, f64::max),
                };
                eprintln!("{}", format_row(&row));
                rows.push(row);
            }
        }
    }
    rows
}

pub fn table_header() -> String {
    "| workload | system | IOPS (median) | min–max | MB/s | p50 µs | p99 µs |\n|---|---|---:|---:|---:|---:|---:|".into()
}

pub fn format_row(r: &Row) -> String {
    format!(
        "| {} | {} | {} | {}–{} | {:.0} | {:.1} | {:.1} |",
        r.workload.name,
        r.system,
        rate(r.result.iops),
        rate(r.min_iops),
        rate(r.max_iops),
        r.result.bw / 1e6,
        r.result.p50_us,
        r.result.p99_us
    )
}

/// RackFS against the FUSE ceiling and shm against tcp, per workload.
pub fn ratios(rows: &[Row]) -> Vec<String> {
    let get = |w: &str, s: &str| {
        rows.iter()
            .find(|r| r.workload.name == w && r.system == s)
            .map(|r| r.result)
    };
    WORKLOADS
        .iter()
        .filter_map(|w| {
            let (m, shm, tcp) = (
                get(w.name, "memfs (FUSE ceiling)")?,
                get(w.name, "RackFS shm")?,
                get(w.name, "RackFS tcp")?,
            );
            let metric = |r: FioResult| if w.bs == "1M" { r.bw } else { r.iops };
            Some(format!(
                "{}: RackFS shm = {:.0}% of the FUSE ceiling's {}; tcp = {:.0}% of shm",
                w.name,
                100.0 * metric(shm) / metric(m),
                if w.bs == "1M" { "bandwidth" } else { "IOPS" },
                100.0 * metric(tcp) / metric(shm)
            ))
        })
        .collect()
}
