//! `rackfs-bench suite`: the workload suite as a user would run it, with its baselines in the
//! same invocation, written up as one report with tables and charts.
//!
//! * fio job files from `bench/fio/` (the same files a user runs with plain `fio`) on tmpfs, the
//!   FUSE ceiling (`rackfs-memfs`), RackFS over shm and over tcp, and RackFS with QoS on;
//! * filebench personalities from `bench/filebench/` when `filebench` is installed, else their
//!   fio stand-ins (`bench/fio/*-like.fio`), labelled as such;
//! * range-locked writers sharing a file from two mounts, and overlapping writers checked for
//!   mixed 4 KiB units;
//! * QoS: three mounts' IOPS over time against their reservations;
//! * lock throughput against the number of clients (Citron vs an RPC lock server);
//! * scale-down: memory and lock trees before and after files of several GiB are truncated;
//! * small files: a source tree (the local crate registry) untarred into RackFS, the node
//!   memory it takes against the bytes it holds, and the time against tmpfs.
//!
//! Noise on a small shared machine: the systems take turns (the order rotates every run), each
//! point is repeated and reported as median with min-max; single-job points pin fio and the FUSE
//! daemons to CPU 0 and the memory nodes to CPU 1.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use rackfs_proto::control::NodeStats;
use rackfs_tests::fio::{Fio, FioRun};
use rackfs_tests::{TempDir, TestCluster};

use crate::fio::{rig, Rig, Target};
use crate::mounts::mount_all;
use crate::plot;
use crate::stats::{median, rate};

/// How much to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Set {
    /// A smoke run: every section once, short (about 3 minutes).
    Quick,
    /// Every workload at 1, 4 and 16 jobs, 3 runs each (under 15 minutes here).
    Default,
}

pub struct Config {
    pub set: Set,
    pub runs: usize,
    pub runtime: u32,
    pub target: Target,
    pub out_dir: PathBuf,
}

/// What one fio run of one job group gave.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FioOut {
    pub(crate) iops: f64,
    bw: f64,
    p50_us: f64,
    p99_us: f64,
}

/// The job files, next to this crate.
fn job(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fio").join(name)
}

/// Starts fio on a copy of job file `file` in which each `--key=value` of `extra` replaces
/// the file's `key=` lines (or joins its `[global]` section): fio itself lets a job file's
/// values win over the command line. `env` fills the file's `${VARS}`.
pub(crate) fn spawn_fio(file: &str, env: &[(&str, String)], extra: &[String]) -> FioRun {
    let text = std::fs::read_to_string(job(file)).expect("read the job file");
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    for opt in extra {
        let (key, value) = opt
            .trim_start_matches("--")
            .split_once('=')
            .expect("--key=value");
        let line = format!("{key}={value}");
        let mut replaced = false;
        for l in lines
            .iter_mut()
            .filter(|l| l.split('=').next() == Some(key))
        {
            *l = line.clone();
            replaced = true;
        }
        if !replaced {
            let at = lines
                .iter()
                .position(|l| l.trim() == "[global]")
                .map_or(0, |i| i + 1);
            lines.insert(at, line);
        }
    }
    static COPIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let rendered =
        std::env::temp_dir().join(format!("rackfs-suite-{}-{n}-{file}", std::process::id()));
    std::fs::write(&rendered, lines.join("\n") + "\n").expect("write the job file copy");
    env.iter()
        .fold(Fio::file(&rendered), |f, (k, v)| f.env(k, v))
        .spawn()
}

/// Per job group (by the name of its first job): reads and writes together.
pub(crate) fn fio_groups(run: FioRun) -> BTreeMap<String, FioOut> {
    let mut groups = BTreeMap::new();
    for j in run.wait().jobs {
        let main = *j.main_side();
        let e: &mut FioOut = groups.entry(j.name).or_default();
        e.iops += j.read.iops + j.write.iops;
        e.bw += j.read.bw_bytes + j.write.bw_bytes;
        e.p50_us = e.p50_us.max(main.p50_us);
        e.p99_us = e.p99_us.max(main.p99_us);
    }
    groups
}

/// One measured point: a job file with its parameters, on every system it applies to.
struct Point {
    section: &'static str,
    label: String,
    file: &'static str,
    env: Vec<(&'static str, String)>,
    /// Extra fio options (override the job file).
    extra: Vec<String>,
    /// CPUs for fio and the FUSE daemons: "0" for one job (pinned together), else "0-1".
    cpus: &'static str,
    /// Job groups to report, as (label suffix, group name); empty: the file's first group.
    groups: Vec<(&'static str, &'static str)>,
    /// Bandwidth rather than IOPS is the headline.
    bandwidth: bool,
    /// Also run on the QoS-on RackFS mount (for the on/off comparison).
    qos: bool,
}

/// Median, min and max of one reported figure.
#[derive(Clone, Debug)]
struct Cell {
    section: &'static str,
    label: String,
    system: String,
    runs: Vec<FioOut>,
    bandwidth: bool,
}

impl Cell {
    fn metric(&self, f: impl Fn(&FioOut) -> f64) -> (f64, f64, f64) {
        let v: Vec<f64> = self.runs.iter().map(f).collect();
        (
            median(&v),
            v.iter().cloned().fold(f64::MAX, f64::min),
            v.iter().cloned().fold(0.0, f64::max),
        )
    }
    fn headline(&self) -> (f64, f64, f64) {
        if self.bandwidth {
            self.metric(|r| r.bw / 1e6)
        } else {
            self.metric(|r| r.iops)
        }
    }
}

fn points(set: Set) -> Vec<Point> {
    let jobs: &[u32] = match set {
        Set::Quick => &[1, 4],
        Set::Default => &[1, 4, 16],
    };
    let mut v = Vec::new();
    for rw in ["randread", "randwrite", "randrw"] {
        for &j in jobs {
            v.push(Point {
                section: "4 KiB random I/O",
                label: format!(
                    "4K {}, {j} job{}",
                    if rw == "randrw" { "randrw 70/30" } else { rw },
                    if j == 1 { "" } else { "s" }
                ),
                file: "randio-4k.fio",
                env: vec![("RW", rw.into()), ("JOBS", j.to_string())],
                // Files persist across the points of one job file (fio reuses a file that is
                // large enough), so each is laid out once per system.
                extra: vec![format!("--size={}M", 64 / j.min(8))],
                cpus: if j == 1 { "0" } else { "0-1" },
                groups: vec![],
                bandwidth: false,
                qos: rw == "randread",
            });
        }
    }
    for rw in ["read", "write"] {
        v.push(Point {
            section: "1 MiB sequential",
            label: format!("1M seq {rw}"),
            file: "seq-1m.fio",
            env: vec![("RW", rw.into())],
            extra: vec!["--size=256M".into()],
            cpus: "0",
            groups: vec![],
            bandwidth: true,
            qos: false,
        });
    }
    v.push(Point {
        section: "metadata and small files",
        label: "small files".into(),
        file: "smallfiles.fio",
        env: vec![],
        extra: vec![format!(
            "--nrfiles={}",
            if set == Set::Quick { 200 } else { 1000 }
        )],
        cpus: "0-1",
        groups: vec![
            (": create", "create"),
            (": stat", "stat"),
            (": read", "read"),
            (": unlink", "unlink"),
        ],
        bandwidth: false,
        qos: false,
    });
    v.push(Point::plain(
        "metadata and small files",
        "append-heavy log, 4 writers".into(),
        "applog.fio",
    ));
    v
}

impl Point {
    /// A job file run as it is, unpinned, its first group reported as IOPS.
    fn plain(section: &'static str, label: String, file: &'static str) -> Point {
        Point {
            section,
            label,
            file,
            env: vec![],
            extra: vec![],
            cpus: "0-1",
            groups: vec![],
            bandwidth: false,
            qos: false,
        }
    }
}

/// The filebench personalities, or their fio stand-ins.
fn filebench_points(have_filebench: bool) -> Vec<Point> {
    if have_filebench {
        return Vec::new(); // run by `filebench_runs`
    }
    ["fileserver", "varmail", "webserver", "randomrw"]
        .into_iter()
        .map(|p| {
            Point::plain(
                "filebench personalities (fio stand-ins: filebench is not installed)",
                format!("{p} (fio equivalent)"),
                match p {
                    "fileserver" => "fileserver-like.fio",
                    "varmail" => "varmail-like.fio",
                    "webserver" => "webserver-like.fio",
                    _ => "randomrw-like.fio",
                },
            )
        })
        .collect()
}

pub fn run(cfg: &Config) -> String {
    let started = Instant::now();
    std::fs::create_dir_all(&cfg.out_dir).expect("create the results directory");
    let have_filebench = crate::fio::have("filebench");
    let mut all = points(cfg.set);
    all.extend(filebench_points(have_filebench));
    let mut rig = rig("0", &cfg.target);
    let qos_dir = rig.mount_rackfs("transport=tcp,qos=on", "0");
    let systems = rig.systems.len();
    let total: u64 = all
        .iter()
        .map(|p| (cfg.runs * (systems + p.qos as usize)) as u64)
        .sum::<u64>()
        + 6;
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} {msg}")
            .expect("progress template"),
    );
    let mut cells: Vec<Cell> = Vec::new();
    let mut last_file = "";
    for p in &all {
        if p.file != last_file {
            for s in &rig.systems {
                clean(&s.dir);
            }
            clean(&qos_dir);
            last_file = p.file;
        }
        rig.pin_daemons(p.cpus);
        let mut targets: Vec<(String, PathBuf, bool)> = rig
            .systems
            .iter()
            .map(|s| (s.name.to_string(), s.dir.clone(), s.direct))
            .collect();
        if p.qos {
            targets.push(("RackFS tcp, QoS on".into(), qos_dir.clone(), true));
        }
        let n = targets.len();
        let mut per: Vec<Vec<BTreeMap<String, FioOut>>> = vec![Vec::new(); n];
        for r in 0..cfg.runs {
            for k in 0..n {
                let i = (k + r) % n;
                let (name, dir, direct) = &targets[i];
                say(&bar, format!("{} on {name}", p.label));
                let mut env = p.env.clone();
                env.push(("DIR", dir.display().to_string()));
                let mut extra = p.extra.clone();
                extra.push(format!("--cpus_allowed={}", p.cpus));
                if !direct {
                    extra.push("--direct=0".into());
                }
                if p.file == "smallfiles.fio" {
                    // Each run creates its files anew.
                    clean(dir);
                } else {
                    extra.push(format!("--runtime={}", cfg.runtime));
                    // Shorter ramp where the file has one (fio 3.33 hangs when a ramp is added
                    // to its many-small-files jobs).
                    if std::fs::read_to_string(job(p.file)).is_ok_and(|t| t.contains("ramp_time")) {
                        extra.push("--ramp_time=500ms".into());
                    }
                }
                let out = fio_groups(spawn_fio(p.file, &env, &extra));
                per[i].push(out);
                bar.inc(1);
            }
        }
        for (i, (name, _, _)) in targets.iter().enumerate() {
            let groups: Vec<(&str, Option<&str>)> = if p.groups.is_empty() {
                vec![("", None)]
            } else {
                p.groups.iter().map(|&(s, g)| (s, Some(g))).collect()
            };
            for (suffix, g) in groups {
                let runs = per[i]
                    .iter()
                    .map(|m| match g {
                        Some(g) => m.get(g).copied().unwrap_or_default(),
                        None => m.values().next().copied().unwrap_or_default(),
                    })
                    .collect();
                cells.push(Cell {
                    section: p.section,
                    label: format!("{}{suffix}", p.label),
                    system: name.clone(),
                    runs,
                    bandwidth: p.bandwidth,
                });
            }
        }
    }
    let mut md = header(cfg, have_filebench);
    md.push_str(&tables(&cells, &cfg.out_dir));
    if have_filebench {
        say(&bar, "filebench");
        md.push_str(&filebench_runs(&rig, cfg));
    }
    say(&bar, "shared file and overlapping writers");
    md.push_str(&shared_file(&mut rig, cfg));
    bar.inc(1);
    drop(rig);
    say(&bar, "QoS over time");
    md.push_str(&qos_over_time(cfg));
    bar.inc(1);
    say(&bar, "lock throughput");
    md.push_str(&lock_throughput(cfg));
    bar.inc(1);
    say(&bar, "scale-down");
    md.push_str(&scale_down(cfg));
    bar.inc(1);
    say(&bar, "small-file tree");
    md.push_str(&source_tree(cfg.set));
    bar.inc(1);
    bar.finish_with_message("done");
    md.push_str(&format!(
        "\n---\nThe whole suite took {:.0} s.\n",
        started.elapsed().as_secs_f64()
    ));
    std::fs::write(cfg.out_dir.join("report.md"), &md).expect("write report.md");
    md
}

/// Shows what runs now: on the bar when stderr is a terminal, else as a log line (CI).
fn say(bar: &ProgressBar, msg: impl Into<String>) {
    let msg = msg.into();
    if !std::io::stderr().is_terminal() {
        eprintln!(
            "[{}/{}] {msg}",
            bar.position() + 1,
            bar.length().unwrap_or(0)
        );
    }
    bar.set_message(msg);
}

/// Removes what a run left in `dir` (files and directories; best effort).
fn clean(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            let _ = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
        }
    }
}

fn header(cfg: &Config, have_filebench: bool) -> String {
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let sh = |c: &str| {
        Command::new("sh")
            .args(["-c", c])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    format!(
        "# RackFS workload suite\n\n\
         Produced by `rackfs-bench suite --set {} --runs {} --runtime {}` at commit `{commit}` on \
         {} ({} CPUs, kernel {}, fio {}). Every figure is the median of {} runs with min-max; the \
         systems take turns, rotating their order each run. One-job points pin fio and the FUSE \
         daemons to CPU 0 and the memory nodes to CPU 1. filebench: {}.\n\n",
        format!("{:?}", cfg.set).to_lowercase(),
        cfg.runs,
        cfg.runtime,
        sh("date -u +%Y-%m-%dT%H:%MZ"),
        sh("nproc"),
        sh("uname -r"),
        sh("fio --version"),
        cfg.runs,
        if have_filebench {
            "installed"
        } else {
            "not installed, its personalities ran as fio stand-ins (labelled)"
        }
    )
}

/// One table per section, and a bar chart of the headline figure per system.
fn tables(cells: &[Cell], dir: &Path) -> String {
    let mut md = String::new();
    let mut sections: Vec<&str> = cells.iter().map(|c| c.section).collect();
    sections.dedup();
    for (k, section) in sections.iter().enumerate() {
        let here: Vec<&Cell> = cells.iter().filter(|c| c.section == *section).collect();
        md.push_str(&format!(
            "## {section}\n\n| workload | system | median | min-max | p50 µs | p99 µs |\n|---|---|---:|---:|---:|---:|\n"
        ));
        for c in &here {
            let (m, lo, hi) = c.headline();
            let (unit, fmt): (&str, fn(f64) -> String) = if c.bandwidth {
                (" MB/s", |x| format!("{x:.0}"))
            } else {
                (" IOPS", rate)
            };
            md.push_str(&format!(
                "| {} | {} | {}{unit} | {}-{} | {:.1} | {:.1} |\n",
                c.label,
                c.system,
                fmt(m),
                fmt(lo),
                fmt(hi),
                c.metric(|r| r.p50_us).0,
                c.metric(|r| r.p99_us).0
            ));
        }
        let mut labels: Vec<String> = Vec::new();
        for c in &here {
            if !labels.contains(&c.label) {
                labels.push(c.label.clone());
            }
        }
        // tmpfs (no FUSE) runs 5-10x faster than any FUSE filesystem: it stays in the tables
        // and off the charts, whose scale it would flatten.
        let mut systems: Vec<String> = here
            .iter()
            .map(|c| c.system.clone())
            .filter(|s| s != "tmpfs")
            .collect();
        systems.sort();
        systems.dedup();
        let bw = here.iter().any(|c| c.bandwidth);
        let figure = |l: &str, s: &str, f: &dyn Fn(&Cell) -> f64| {
            here.iter()
                .find(|c| c.label == l && c.system == s)
                .map_or(0.0, |c| f(c))
        };
        // At most three workloads per chart, so their labels stay readable.
        for (n, chunk) in labels.chunks(3).enumerate() {
            let series = |f: &dyn Fn(&Cell) -> f64| -> Vec<(&str, Vec<f64>)> {
                systems
                    .iter()
                    .map(|s| (s.as_str(), chunk.iter().map(|l| figure(l, s, f)).collect()))
                    .collect()
            };
            let short = section.split(" (").next().unwrap_or(section);
            let title = if labels.len() > 3 {
                format!("{short} ({}/{})", n + 1, labels.len().div_ceil(3))
            } else {
                short.to_string()
            };
            let head = series(&|c: &Cell| c.headline().0);
            let svg = plot::bars(&title, if bw { "MB/s" } else { "IOPS" }, chunk, &head);
            let f = plot::save(dir, &format!("suite-{k}-{n}"), &svg);
            md.push_str(&format!("\n![{title}]({f})"));
            let lat = series(&|c: &Cell| c.metric(|r| r.p99_us).0);
            if !bw && lat.iter().any(|s| s.1.iter().any(|&x| x > 0.0)) {
                let svg = plot::bars(&format!("{title}: p99 latency"), "µs", chunk, &lat);
                let f = plot::save(dir, &format!("suite-{k}-{n}-p99"), &svg);
                md.push_str(&format!(" ![{title} p99]({f})"));
            }
            md.push('\n');
        }
        md.push('\n');
    }
    md
}

/// filebench's own personalities on every system (when installed): ops/s from its summary.
fn filebench_runs(rig: &Rig, cfg: &Config) -> String {
    let mut md = "## filebench personalities\n\n| personality | system | ops/s (median) | min-max |\n|---|---|---:|---:|\n".to_string();
    // filebench needs address-space randomisation off while it runs; put it back afterwards.
    let aslr = Path::new("/proc/sys/kernel/randomize_va_space");
    let saved = std::fs::read_to_string(aslr).unwrap_or_else(|_| "2".into());
    let _ = std::fs::write(aslr, "0");
    for p in ["fileserver", "varmail", "webserver", "randomrw"] {
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("filebench")
            .join(format!("{p}.f"));
        let text = std::fs::read_to_string(&src).expect("read the personality");
        for s in &rig.systems {
            let (mut ops, mut failure) = (Vec::new(), None);
            for _ in 0..cfg.runs {
                let f = std::env::temp_dir().join(format!("rackfs-{p}.f"));
                std::fs::write(
                    &f,
                    text.replace("$MOUNTDIR", &s.dir.display().to_string())
                        .replace("$RUNTIME", &cfg.runtime.max(5).to_string()),
                )
                .expect("write the personality");
                // Bounded: a filebench that cannot start its workers hangs.
                let out = Command::new("timeout")
                    .arg((cfg.runtime.max(5) + 120).to_string())
                    .arg("filebench")
                    .arg("-f")
                    .arg(&f)
                    .output();
                // filebench reports on stdout and complains on stderr.
                let (text, errors) = out
                    .map(|o| {
                        (
                            String::from_utf8_lossy(&o.stdout).to_string(),
                            String::from_utf8_lossy(&o.stderr).to_string(),
                        )
                    })
                    .unwrap_or_default();
                // "IO Summary: 12345 ops 2057.4 ops/s ..."
                match text
                    .lines()
                    .find(|l| l.contains("IO Summary"))
                    .and_then(|l| {
                        l.split_whitespace()
                            .zip(l.split_whitespace().skip(1))
                            .find(|(_, u)| *u == "ops/s")
                            .and_then(|(v, _)| v.parse::<f64>().ok())
                    }) {
                    Some(x) => ops.push(x),
                    // filebench's own complaint, else what it said last, else a timeout.
                    None => {
                        failure = Some(
                            errors
                                .lines()
                                .chain(text.lines())
                                .find(|l| l.contains("Failed"))
                                .into_iter()
                                .chain(text.lines().rev())
                                .find(|l| !l.trim().is_empty() && !l.contains("Shutting down"))
                                .unwrap_or("no output: timed out")
                                .trim()
                                .to_string(),
                        )
                    }
                }
                clean(&s.dir);
            }
            if ops.is_empty() {
                md.push_str(&format!(
                    "| {p} | {} | failed: {} | - |\n",
                    s.name,
                    failure.unwrap_or_default().replace('|', "/")
                ));
                continue;
            }
            let lo = ops.iter().cloned().fold(f64::MAX, f64::min);
            let hi = ops.iter().cloned().fold(0.0, f64::max);
            md.push_str(&format!(
                "| {p} | {} | {} | {}-{} |\n",
                s.name,
                rate(median(&ops)),
                rate(lo),
                rate(hi)
            ));
        }
    }
    let _ = std::fs::write(aslr, saved.trim());
    md
}

/// Two mounts writing disjoint regions of one file (range locks), and two mounts overwriting
/// the same 4 MiB, checked for mixed 4 KiB units.
fn shared_file(rig: &mut Rig, cfg: &Config) -> String {
    let a = rig
        .systems
        .iter()
        .find(|s| s.rackfs)
        .expect("a RackFS mount")
        .dir
        .clone();
    let b = rig.mount_rackfs("transport=tcp", "0-1");
    rig.pin_daemons("0-1");
    let rt = format!("--runtime={}", cfg.runtime);
    // The shared file exists before the writers start: two fio processes laying out one file
    // at once would unlink it under each other (as on any filesystem).
    let presize = |name: &str, len: u64| {
        std::fs::File::create(a.join(name))
            .and_then(|f| f.set_len(len))
            .expect("create the shared file");
    };
    let (mut one, mut two) = (Vec::new(), Vec::new());
    for _ in 0..cfg.runs {
        presize("shared-disjoint.dat", 64 << 20);
        let env = |d: &Path, off: &str, jobs: &str| {
            vec![
                ("DIR", d.display().to_string()),
                ("OFFSET", off.to_string()),
                ("JOBS", jobs.to_string()),
            ]
        };
        let solo = fio_groups(spawn_fio(
            "shared-disjoint.fio",
            &env(&a, "0", "1"),
            std::slice::from_ref(&rt),
        ));
        one.push(solo.values().map(|o| o.iops).sum::<f64>());
        let x = spawn_fio(
            "shared-disjoint.fio",
            &env(&a, "0", "2"),
            std::slice::from_ref(&rt),
        );
        let y = spawn_fio(
            "shared-disjoint.fio",
            &env(&b, "32M", "2"),
            std::slice::from_ref(&rt),
        );
        let sum: f64 = [x, y]
            .into_iter()
            .map(|c| fio_groups(c).values().map(|o| o.iops).sum::<f64>())
            .sum();
        two.push(sum);
    }
    clean(&a);
    presize("overlap.dat", 4 << 20);
    let x = spawn_fio(
        "overlap-verify.fio",
        &[("DIR", a.display().to_string()), ("PATTERN", "0xaa".into())],
        std::slice::from_ref(&rt),
    );
    let y = spawn_fio(
        "overlap-verify.fio",
        &[("DIR", b.display().to_string()), ("PATTERN", "0xbb".into())],
        std::slice::from_ref(&rt),
    );
    fio_groups(x);
    fio_groups(y);
    let (units, mixed) = check_units(&a.join("overlap.dat"), &[0xaa, 0xbb]).expect("check units");
    clean(&a);
    format!(
        "## One file, two mounts (range locks)\n\n\
         `shared-disjoint.fio`, 4 KiB random writes to disjoint 16 MiB regions of one file: one \
         writer on one mount {} IOPS (median, {}-{}); 2 writers on each of two mounts {} IOPS in \
         all ({}-{}).\n\n\
         `overlap-verify.fio`, two mounts overwriting the same 4 MiB in 16 KiB blocks at \
         4 KiB-aligned offsets with their own patterns, at once, for {} s: **{mixed} of {units} units mixed** (every 4 KiB unit must hold \
         one writer's pattern).\n\n",
        rate(median(&one)),
        rate(one.iter().cloned().fold(f64::MAX, f64::min)),
        rate(one.iter().cloned().fold(0.0, f64::max)),
        rate(median(&two)),
        rate(two.iter().cloned().fold(f64::MAX, f64::min)),
        rate(two.iter().cloned().fold(0.0, f64::max)),
        cfg.runtime,
    )
}

/// Counts the 4 KiB units of `file` (and how many of them hold a mix of bytes rather than one
/// of `patterns` throughout).
pub fn check_units(file: &Path, patterns: &[u8]) -> std::io::Result<(usize, usize)> {
    let data = std::fs::read(file)?;
    let mut mixed = 0;
    for unit in data.chunks(4096) {
        let first = unit[0];
        if !patterns.contains(&first) || unit.iter().any(|&b| b != first) {
            mixed += 1;
        }
    }
    Ok((data.len().div_ceil(4096), mixed))
}

/// Three mounts with different reservations, their IOPS each second against the reservation.
fn qos_over_time(cfg: &Config) -> String {
    let secs = cfg.runtime.max(2) * 6;
    let capacity = 24_000u64;
    let c = TestCluster::start_with(
        1,
        "512M",
        &[
            "--qos-capacity",
            &capacity.to_string(),
            "--qos-client-capacity",
            &capacity.to_string(),
        ],
    );
    let tmp = TempDir::new("suite-qos");
    let spec = [(12_000u64, 0u64), (6_000, 0), (0, 3_000)];
    let opts: Vec<String> = spec
        .iter()
        .map(|(r, l)| {
            if *l > 0 {
                format!("limit={l}")
            } else {
                format!("reservation={r}")
            }
        })
        .collect();
    let m = mount_all(&c, &opts.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    let logs: Vec<PathBuf> = (0..3).map(|i| tmp.path().join(format!("m{i}"))).collect();
    let running: Vec<FioRun> = m
        .dirs
        .iter()
        .zip(&logs)
        .enumerate()
        .map(|(i, (d, log))| {
            spawn_fio(
                "randio-4k.fio",
                &[
                    ("DIR", d.display().to_string()),
                    ("RW", "randread".into()),
                    ("JOBS", "1".into()),
                ],
                &[
                    // All mounts of a cluster see the same files: one name per mount.
                    format!("--filename_format=qos-m{i}.$jobnum"),
                    "--size=16M".into(),
                    format!("--runtime={secs}"),
                    "--ramp_time=0".into(),
                    format!("--write_iops_log={}", log.display()),
                    "--log_avg_msec=1000".into(),
                ],
            )
        })
        .collect();
    for r in running {
        fio_groups(r);
    }
    let series: Vec<Vec<f64>> = logs
        .iter()
        .map(|l| {
            let path = format!("{}_iops.1.log", l.display());
            std::fs::read_to_string(&path)
                .unwrap_or_default()
                .lines()
                .filter_map(|x| x.split(',').nth(1)?.trim().parse().ok())
                .collect()
        })
        .collect();
    let n = series.iter().map(|s| s.len()).max().unwrap_or(0);
    let names = [
        "M1 (R=12k)",
        "M2 (R=6k)",
        "M3 (limit 3k)",
        "M1 reservation",
        "M2 reservation",
    ];
    let svg = plot::lines(
        &format!("QoS over time: one memory node, capacity {capacity} IOPS"),
        "IOPS",
        "seconds",
        &[
            (names[0], series[0].clone()),
            (names[1], series[1].clone()),
            (names[2], series[2].clone()),
            (names[3], vec![12_000.0; n]),
            (names[4], vec![6_000.0; n]),
        ],
    );
    let f = plot::save(&cfg.out_dir, "suite-qos", &svg);
    // The first two seconds include laying out the files.
    let med = |s: &Vec<f64>| median(&s[2.min(s.len())..]);
    format!(
        "## QoS over time\n\nOne memory node with a QoS capacity of {capacity} IOPS; three mounts \
         reading 4 KiB at random (fio, one job each) for {secs} s: M1 reserves 12k IOPS, M2 6k, \
         M3 nothing with a limit of 3k. Median IOPS per second after the first two: M1 {}, M2 {}, M3 \
         {}.\n\n![QoS over time]({f})\n\n",
        rate(med(&series[0])),
        rate(med(&series[1])),
        rate(med(&series[2])),
    )
}

/// Citron and the RPC lock server against the number of clients (shm, fixed 64-unit ranges).
fn lock_throughput(cfg: &Config) -> String {
    let clients = vec![1, 2, 4, 8, 16];
    let rows = crate::locks::run(&crate::locks::Config {
        transports: vec!["shm"],
        clients: clients.clone(),
        patterns: vec![crate::locks::Pattern::Unaligned],
        spaces: vec![4096],
        duration: Duration::from_millis(200),
        runs: cfg.runs,
    });
    let mut md = "## Lock throughput against clients\n\nshm, 64-unit ranges at any offset in a space of 4096 units (high contention).\n\n| clients | Citron acquisitions/s | RPC lock server | segment mutex |\n|---:|---:|---:|---:|\n".to_string();
    let get = |s: crate::locks::System, c: usize| {
        rows.iter()
            .find(|r| r.system == s && r.clients == c)
            .map_or(0.0, |r| r.sample.per_sec)
    };
    use crate::locks::System as L;
    for &c in &clients {
        md.push_str(&format!(
            "| {c} | {} | {} | {} |\n",
            rate(get(L::Citron, c)),
            rate(get(L::RpcServer, c)),
            rate(get(L::SegmentMutex, c))
        ));
    }
    let labels: Vec<String> = clients.iter().map(|c| c.to_string()).collect();
    let series: Vec<(&str, Vec<f64>)> = L::ALL
        .iter()
        .map(|&s| (s.name(), clients.iter().map(|&c| get(s, c)).collect()))
        .collect();
    let svg = plot::bars(
        "Lock acquisitions per second against clients (shm)",
        "acquisitions/s",
        &labels,
        &series,
    );
    let f = plot::save(&cfg.out_dir, "suite-locks", &svg);
    md.push_str(&format!("\n![locks]({f})\n\n"));
    md
}

/// Grows a dense and a sparse file to several GiB, truncates both to 4 KiB, and records the
/// memory nodes' used memory and lock-tree bytes before, grown and after.
fn scale_down(cfg: &Config) -> String {
    let dense_gib: u64 = if cfg.set == Set::Quick { 1 } else { 3 };
    let sparse_gib: u64 = 16;
    let c = TestCluster::start(2, "3G");
    let m = mount_all(&c, &["transport=shm"]);
    let stats = || -> Vec<NodeStats> {
        (0..2)
            .map(|i| c.control(i).stats().expect("node stats"))
            .collect()
    };
    let sum = |s: &[NodeStats], f: fn(&NodeStats) -> u64| s.iter().map(f).sum::<u64>();
    let before = stats();
    let dense = m.dirs[0].join("dense");
    let sparse = m.dirs[0].join("sparse");
    {
        use std::io::Write;
        use std::os::unix::fs::FileExt;
        let mut f = std::fs::File::create(&dense).expect("create dense");
        let chunk = vec![0x5au8; 1 << 20];
        for _ in 0..dense_gib * 1024 {
            f.write_all(&chunk).expect("write dense");
        }
        let s = std::fs::File::create(&sparse).expect("create sparse");
        for i in 0..sparse_gib {
            s.write_all_at(&chunk[..4096], (i << 30) + (1 << 30) - 4096)
                .expect("write sparse");
        }
    }
    let grown = stats();
    let t0 = Instant::now();
    for f in [&dense, &sparse] {
        std::fs::OpenOptions::new()
            .write(true)
            .open(f)
            .and_then(|f| f.set_len(4096))
            .expect("truncate");
    }
    let truncate_ms = t0.elapsed().as_secs_f64() * 1e3;
    // Freed data is quarantined (200 ms here) and retired lock trees wait their grace (2 s).
    std::thread::sleep(Duration::from_secs(4));
    let after = stats();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let kib = |b: u64| b as f64 / 1024.0;
    let rows = [
        ("before", &before),
        ("grown", &grown),
        ("after ftruncate", &after),
    ];
    let mut md = format!(
        "## Scale-down\n\nTwo memory nodes (3 GiB regions), one mount over shm. A dense file is \
         written to {dense_gib} GiB and a sparse one gets a 4 KiB write at the end of each of \
         {sparse_gib} GiB; both are then `ftruncate`d to 4 KiB ({truncate_ms:.0} ms for both).\n\n\
         | moment | used memory (both nodes) | lock trees |\n|---|---:|---:|\n"
    );
    for (name, s) in rows {
        md.push_str(&format!(
            "| {name} | {:.1} MiB | {:.1} KiB |\n",
            mib(sum(s, |n| n.used)),
            kib(sum(s, |n| n.lock_trees))
        ));
    }
    let labels: Vec<String> = rows.iter().map(|r| r.0.to_string()).collect();
    let svg = plot::bars(
        "Scale-down: used memory of the memory nodes",
        "MiB",
        &labels,
        &[(
            "used memory",
            rows.iter().map(|r| mib(sum(r.1, |n| n.used))).collect(),
        )],
    );
    let f = plot::save(&cfg.out_dir, "suite-scale-down", &svg);
    let svg = plot::bars(
        "Scale-down: lock trees",
        "KiB",
        &labels,
        &[(
            "lock trees",
            rows.iter()
                .map(|r| kib(sum(r.1, |n| n.lock_trees)))
                .collect(),
        )],
    );
    let g = plot::save(&cfg.out_dir, "suite-scale-down-locks", &svg);
    md.push_str(&format!("\n![memory]({f}) ![lock trees]({g})\n\n"));
    md
}

/// The crate registry's sources (a tree of many small files, as a user's source tree is).
pub(crate) fn registry_sources() -> Option<PathBuf> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
    let src = home.join("registry/src");
    let index = std::fs::read_dir(&src).ok()?.flatten().next()?.path();
    index.is_dir().then_some(index)
}

/// Regular files and their bytes under `dir` (symlinks not followed).
pub(crate) fn tree_size(dir: &Path) -> (u64, u64) {
    let mut files = 0;
    let mut bytes = 0;
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => todo.push(e.path()),
                Ok(t) if t.is_file() => {
                    files += 1;
                    bytes += e.metadata().map_or(0, |m| m.len());
                }
                _ => {}
            }
        }
    }
    (files, bytes)
}

/// Untars a source tree into tmpfs and into RackFS (two nodes, shm) and reports the node
/// memory the tree takes against the bytes of its files, and the time against tmpfs.
pub fn source_tree(set: Set) -> String {
    let mut md = String::from("## Small files: a source tree\n\n");
    let Some(src) = registry_sources() else {
        md.push_str("Skipped: no crate registry sources (`$CARGO_HOME/registry/src`) here.\n\n");
        return md;
    };
    // The quick set takes crates until about 30 MB, the default set all of them.
    let budget: u64 = if set == Set::Quick {
        30 << 20
    } else {
        u64::MAX
    };
    let mut crates = Vec::new();
    let (mut files, mut bytes) = (0, 0);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&src)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    for d in dirs {
        if bytes >= budget {
            break;
        }
        let (f, b) = tree_size(&d);
        files += f;
        bytes += b;
        crates.push(d.file_name().expect("crate dir name").to_owned());
    }
    let scratch = TempDir::new("tree");
    let archive = scratch.path().join("tree.tar");
    let status = Command::new("tar")
        .arg("-cf")
        .arg(&archive)
        .arg("-C")
        .arg(&src)
        .args(&crates)
        .status()
        .expect("run tar");
    assert!(status.success(), "tar of the registry sources failed");
    let untar = |into: &Path| -> f64 {
        let t0 = Instant::now();
        let out = Command::new("tar")
            .arg("-xf")
            .arg(&archive)
            .arg("-C")
            .arg(into)
            .output()
            .expect("run tar");
        assert!(
            out.status.success(),
            "untar into {}: {}",
            into.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        t0.elapsed().as_secs_f64()
    };
    let shm = PathBuf::from(format!("/dev/shm/rackfs-tree-{}", std::process::id()));
    std::fs::create_dir_all(&shm).expect("a directory on tmpfs");
    let tmpfs_s = untar(&shm);
    let _ = std::fs::remove_dir_all(&shm);
    let c = TestCluster::start(2, "1G");
    let m = mount_all(&c, &["transport=shm"]);
    // (used, quarantined) over both nodes.
    let used = || -> (u64, u64) {
        (0..2)
            .map(|i| c.control(i).stats().expect("node stats"))
            .fold((0, 0), |(u, q), s| (u + s.used, q + s.quarantined))
    };
    let before = used().0;
    let rackfs_s = untar(&m.dirs[0]);
    let (at_end, in_quarantine) = used();
    // Extents moved away from (grown, trimmed) are freed after the quarantine.
    rackfs_tests::wait_for(Duration::from_secs(10), || used().1 == 0);
    let taken = used().0 - before;
    let (got_files, got_bytes) = tree_size(&m.dirs[0]);
    assert_eq!(
        (got_files, got_bytes),
        (files, bytes),
        "the untarred tree has every file and byte"
    );
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    md.push_str(&format!(
        "{} crates of the local crate registry ({files} files, {:.1} MiB of file data; mean \
         file {:.1} KiB), untarred with `tar -xf` into tmpfs and into RackFS (two memory \
         nodes, one mount over shm, default 1 MiB stripe unit).\n\n\
         | | tmpfs | RackFS |\n|---|---:|---:|\n\
         | untar time | {tmpfs_s:.2} s | {rackfs_s:.2} s ({:.2}x tmpfs) |\n\
         | node memory taken when tar ends | | {:.1} MiB ({:.1} MiB of it in quarantine) |\n\
         | node memory taken after the quarantine | | {:.1} MiB |\n\
         | **node memory / file bytes** | | **{:.2}** |\n\n\
         Node memory is the memory nodes' allocated bytes after minus before: file data, \
         extent tags, records, extent tables and lock trees (the metadata service's own heap \
         is not in it). Extents a file grew out of, or was trimmed from at its last close, \
         stay allocated for the quarantine (2 s by default, 200 ms here) before reuse.\n\n",
        crates.len(),
        mib(bytes),
        bytes as f64 / files.max(1) as f64 / 1024.0,
        rackfs_s / tmpfs_s,
        mib(at_end - before),
        mib(in_quarantine),
        mib(taken),
        taken as f64 / bytes.max(1) as f64,
    ));
    md
}
