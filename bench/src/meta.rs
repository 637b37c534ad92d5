//! `rackfs-bench meta`: metadata and small-file speed of RackFS next to its baselines, all
//! mounted at once and measured in the same run: tmpfs, bindfs over tmpfs (a plain
//! pass-through FUSE daemon, skipped if not installed), `rackfs-memfs` (the FUSE ceiling),
//! RackFS over shm and tcp (two memory nodes, default mount options), and RackFS over shm on
//! two nodes on a local etcd, where the data node is the metadata standby and every change
//! waits for its journal (as under `rackfs up`; skipped without etcd).
//!
//! * **Small-file loop**, from this process, with 1 and 8 threads: create (open
//!   `O_CREAT|O_WRONLY`, write 4 KiB, close) of N files, then stat of each, open + read 4 KiB +
//!   close of each, unlink of each; ops/s per phase. With 8 threads each thread has its own
//!   subdirectory and an equal share of the N files (as mdtest's unique-directory mode); each
//!   phase is timed from the first thread's start to the last one's end.
//! * **Source tree**: a tar of crate sources (the local cargo registry, else this repository),
//!   built once; per system `tar -xf` into the mount, `find -type f -exec stat` (whose output
//!   is checked against the tree), `grep -r` for a string no file holds (every byte read) and
//!   `rm -rf`; seconds per step.
//! * **filebench personalities**: the workload suite's fio stand-ins for fileserver, varmail and
//!   webserver (`bench/fio/*-like.fio`), each for 3 s (quick: 1 s) in a fresh directory; ops/s,
//!   reads and writes together.
//!
//! Placement as in `fio`: single-threaded points run this process (and the tools it starts)
//! and every FUSE daemon on CPU 0, the memory nodes on CPU 1; 8-thread points let the threads
//! and the daemons use both CPUs. Before measuring, each system runs one untimed 100-file loop
//! (a fresh RackFS mount's first creates are several times slower). Each point runs `runs`
//! times, the order of systems rotating; cells are the median with min-max.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::IntoRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use rackfs_tests::TempDir;

use crate::fio::{rig, Target};
use crate::stats::{median, rate};

pub struct Config {
    pub runs: usize,
    /// Files of the small-file loop (split over the threads).
    pub files: usize,
    /// About this many MiB of file data in the source tree.
    pub tree_mib: u64,
    /// Seconds each personality stand-in runs.
    pub personality_s: u64,
    /// Single-threaded points on CPU 0 with the FUSE daemons, memory nodes on CPU 1; else
    /// every process may run on any CPU, as a user runs them.
    pub pinned: bool,
}

const LOOP_PHASES: [&str; 4] = ["create", "stat", "open+read", "unlink"];
const TREE_PHASES: [&str; 4] = ["untar", "find + stat", "grep -r", "rm -rf"];
/// filebench's personalities, as the workload suite's fio stand-ins (`bench/fio/*-like.fio`).
const PERSONALITIES: [&str; 3] = ["fileserver", "varmail", "webserver"];
/// Files of the untimed small-file loop each system runs first.
const WARMUP_FILES: usize = 100;
/// What `grep -r` looks for: in no file of the tree, so grep reads every byte.
const NEEDLE: &str = "rackfs-meta-benchmark-needle-7f3a";

/// One table: samples per system, phase (`N` of them) and run.
struct Table<const N: usize> {
    title: String,
    /// Ops/s (higher is better) or seconds (lower is better).
    seconds: bool,
    phases: [&'static str; N],
    systems: Vec<&'static str>,
    samples: Vec<[Vec<f64>; N]>,
}

impl<const N: usize> Table<N> {
    fn new(
        title: String,
        seconds: bool,
        phases: [&'static str; N],
        systems: &[&'static str],
    ) -> Table<N> {
        Table {
            title,
            seconds,
            phases,
            systems: systems.to_vec(),
            samples: systems
                .iter()
                .map(|_| std::array::from_fn(|_| Vec::new()))
                .collect(),
        }
    }

    fn add(&mut self, system: usize, values: [f64; N]) {
        for (p, v) in values.into_iter().enumerate() {
            self.samples[system][p].push(v);
        }
    }

    fn fmt(&self, x: f64) -> String {
        if self.seconds {
            format!("{x:.2}")
        } else {
            rate(x)
        }
    }

    fn cell(&self, xs: &[f64]) -> String {
        let m = self.fmt(median(xs));
        if xs.len() < 2 {
            return m;
        }
        let min = xs.iter().cloned().fold(f64::MAX, f64::min);
        let max = xs.iter().cloned().fold(f64::MIN, f64::max);
        format!("{m} ({}–{})", self.fmt(min), self.fmt(max))
    }

    fn markdown(&self) -> String {
        let bindfs = self.systems.iter().position(|s| *s == "bindfs");
        let unit = if self.seconds { "s" } else { "ops/s" };
        let mut md = format!("## {}\n\n", self.title);
        md.push_str(&format!(
            "Median {unit}{} over the runs.",
            if self.samples.first().is_some_and(|s| s[0].len() > 1) {
                " (min–max)"
            } else {
                ""
            }
        ));
        if bindfs.is_some() {
            md.push_str(if self.seconds {
                " vs bindfs: time as a multiple of bindfs's (below 1: faster)."
            } else {
                " vs bindfs: ops/s as a multiple of bindfs's (above 1: faster)."
            });
        }
        md.push_str("\n\n| system |");
        for p in self.phases {
            md.push_str(&format!(" {p} |"));
        }
        if bindfs.is_some() {
            md.push_str(" vs bindfs |");
        }
        md.push_str("\n|---|");
        md.push_str(&"---:|".repeat(self.phases.len()));
        if bindfs.is_some() {
            md.push_str("---|");
        }
        md.push('\n');
        for (i, name) in self.systems.iter().enumerate() {
            md.push_str(&format!("| {name} |"));
            for p in 0..self.phases.len() {
                md.push_str(&format!(" {} |", self.cell(&self.samples[i][p])));
            }
            if let Some(b) = bindfs {
                let ratios = if i == b {
                    "—".to_string()
                } else {
                    (0..self.phases.len())
                        .map(|p| {
                            let r = median(&self.samples[i][p]) / median(&self.samples[b][p]);
                            format!("{} {r:.2}x", self.phases[p])
                        })
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                md.push_str(&format!(" {ratios} |"));
            }
            md.push('\n');
        }
        md.push('\n');
        md
    }
}

/// Pins the calling thread (and so the threads and processes it starts later) to CPUs
/// `first..=last`.
fn pin_self(first: usize, last: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it, and
    // sched_setaffinity reads it for the calling thread only.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in first..=last {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    assert!(ok, "cannot pin the benchmark to CPUs {first}-{last}");
}

/// Closes `f`, reporting the error close(2) gives (a FUSE filesystem's flush).
fn close(f: File) -> std::io::Result<()> {
    // SAFETY: the descriptor is owned (taken out of `f`) and closed once.
    if unsafe { libc::close(f.into_raw_fd()) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// One phase of the small-file loop over `paths`.
fn phase(p: usize, paths: &[PathBuf]) -> std::io::Result<()> {
    let data = [0x5au8; 4096];
    let mut buf = [0u8; 4096];
    for path in paths {
        match p {
            0 => {
                // O_CREAT|O_WRONLY, no O_TRUNC: the files are new.
                let mut f = OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(path)?;
                f.write_all(&data)?;
                close(f)?;
            }
            1 => {
                let len = std::fs::metadata(path)?.len();
                if len != 4096 {
                    return Err(std::io::Error::other(format!(
                        "{}: {len} bytes, not 4096",
                        path.display()
                    )));
                }
            }
            2 => {
                let mut f = File::open(path)?;
                f.read_exact(&mut buf)?;
                close(f)?;
            }
            _ => std::fs::remove_file(path)?,
        }
    }
    Ok(())
}

/// The small-file loop in a new directory under `root`: ops/s of each phase.
fn small_files(root: &Path, files: usize, threads: usize) -> Result<[f64; 4], String> {
    let base = root.join("meta-loop");
    let dirs: Vec<PathBuf> = (0..threads).map(|t| base.join(format!("t{t}"))).collect();
    for d in &dirs {
        std::fs::create_dir_all(d).map_err(|e| format!("mkdir {}: {e}", d.display()))?;
    }
    let shares: Vec<Vec<PathBuf>> = (0..threads)
        .map(|t| {
            (t..files)
                .step_by(threads)
                .map(|i| dirs[t].join(format!("f{i}")))
                .collect()
        })
        .collect();
    let mut out = [0.0; 4];
    for (p, o) in out.iter_mut().enumerate() {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            let workers: Vec<_> = shares
                .iter()
                .map(|paths| s.spawn(move || phase(p, paths)))
                .collect();
            workers
                .into_iter()
                .try_for_each(|w| w.join().expect("small-file worker"))
        })
        .map_err(|e| format!("{} under {}: {e}", LOOP_PHASES[p], base.display()))?;
        *o = files as f64 / t0.elapsed().as_secs_f64();
    }
    for d in dirs.iter().chain([&base]) {
        std::fs::remove_dir(d).map_err(|e| format!("rmdir {}: {e}", d.display()))?;
    }
    Ok(out)
}

/// The source tree's archive and what it holds.
struct Tree {
    archive: PathBuf,
    what: String,
    files: u64,
    bytes: u64,
    _scratch: TempDir,
}

/// Tars crates of the local cargo registry (whole crates, in name order, until about
/// `mib` MiB of file data), or this repository's sources when there is no registry.
fn build_tree(mib: u64) -> Result<Tree, String> {
    let scratch = TempDir::in_memory("meta-tree");
    let archive = scratch.path().join("tree.tar");
    let mut tar = Command::new("tar");
    tar.arg("-cf").arg(&archive);
    let (what, files, bytes) = if let Some(src) = crate::suite::registry_sources() {
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(&src)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        dirs.sort();
        let (mut files, mut bytes, mut crates) = (0, 0, Vec::new());
        for d in dirs {
            if bytes >= mib << 20 {
                break;
            }
            let (f, b) = crate::suite::tree_size(&d);
            files += f;
            bytes += b;
            crates.push(d.file_name().expect("crate dir name").to_owned());
        }
        tar.arg("-C").arg(&src).args(&crates);
        (
            format!("{} crates of the local cargo registry", crates.len()),
            files,
            bytes,
        )
    } else {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace")
            .to_path_buf();
        let members: Vec<PathBuf> = std::fs::read_dir(&repo)
            .map_err(|e| format!("read {}: {e}", repo.display()))?
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| PathBuf::from(e.file_name()))
            .filter(|n| !n.starts_with("target") && !n.starts_with(".git"))
            .collect();
        let (mut files, mut bytes) = (0, 0);
        for m in &members {
            let (f, b) = crate::suite::tree_size(&repo.join(m));
            files += f;
            bytes += b;
        }
        tar.arg("-C").arg(&repo).args(&members);
        (
            "this repository's sources (no cargo registry here)".into(),
            files,
            bytes,
        )
    };
    let out = tar.output().map_err(|e| format!("run tar: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "tar of the source tree failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(Tree {
        archive,
        what,
        files,
        bytes,
        _scratch: scratch,
    })
}

/// Runs `cmd`, which must exit with one of `ok` codes; its seconds and standard output.
fn timed(cmd: &mut Command, ok: &[i32]) -> Result<(f64, Vec<u8>), String> {
    let t0 = Instant::now();
    let out = cmd
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    let s = t0.elapsed().as_secs_f64();
    if !out.status.code().is_some_and(|c| ok.contains(&c)) {
        return Err(format!(
            "{cmd:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok((s, out.stdout))
}

/// Untar, find + stat, grep -r and rm -rf of the tree in a new directory under `root`.
fn tree_run(root: &Path, tree: &Tree) -> Result<[f64; 4], String> {
    let dir = root.join("meta-tree");
    std::fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
    let (untar, _) = timed(
        Command::new("tar")
            .arg("-xf")
            .arg(&tree.archive)
            .arg("-C")
            .arg(&dir),
        &[0],
    )?;
    let (find, sizes) = timed(
        Command::new("find")
            .arg(&dir)
            .args(["-type", "f", "-exec", "stat", "-c", "%s", "{}", "+"]),
        &[0],
    )?;
    let sizes = String::from_utf8_lossy(&sizes);
    let (files, bytes) = sizes.lines().fold((0u64, 0u64), |(f, b), l| {
        (f + 1, b + l.trim().parse::<u64>().unwrap_or(0))
    });
    if (files, bytes) != (tree.files, tree.bytes) {
        return Err(format!(
            "{}: find saw {files} files of {bytes} bytes, the tree has {} of {}",
            dir.display(),
            tree.files,
            tree.bytes
        ));
    }
    let (grep, _) = timed(
        Command::new("grep")
            .args(["-r", "-F", NEEDLE])
            .arg(&dir)
            .stdout(Stdio::null()),
        &[0, 1],
    )?;
    let (rm, _) = timed(Command::new("rm").arg("-rf").arg(&dir), &[0])?;
    Ok([untar, find, grep, rm])
}

/// The fio stand-ins of filebench's personalities, each for `runtime_s` in a directory of its
/// own under `root` (removed after): ops/s, reads and writes together, per personality.
fn personalities(root: &Path, runtime_s: u64) -> Result<[f64; 3], String> {
    let mut out = [0.0; 3];
    for (i, p) in PERSONALITIES.iter().enumerate() {
        let dir = root.join(format!("personality-{p}"));
        std::fs::create_dir_all(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        let run = crate::suite::spawn_fio(
            &format!("{p}-like.fio"),
            &[("DIR", dir.display().to_string())],
            &[format!("--runtime={runtime_s}")],
        );
        out[i] = crate::suite::fio_groups(run).values().map(|g| g.iops).sum();
        timed(Command::new("rm").arg("-rf").arg(&dir), &[0])?;
    }
    Ok(out)
}

/// Runs `point` (by system index) `runs` times on every system, the order rotating between
/// runs, into `t`; an error names the system.
fn rotating<const N: usize>(
    runs: usize,
    systems: &[&str],
    t: &mut Table<N>,
    mut point: impl FnMut(usize) -> Result<[f64; N], String>,
) -> Result<(), String> {
    let n = systems.len();
    for run in 0..runs {
        for k in 0..n {
            let i = (k + run) % n;
            let r = point(i).map_err(|e| format!("{}: {e}", systems[i]))?;
            t.add(i, r);
        }
    }
    Ok(())
}

/// Pinned: the benchmark and the FUSE daemons on CPUs 0 to `last_cpu`, the memory nodes on
/// CPU 1. Unpinned: everything anywhere.
fn place(rig: &crate::fio::Rig, pinned: bool, last_cpu: usize) {
    if pinned {
        rig.pin_daemons(if last_cpu == 0 { "0" } else { "0-1" });
        pin_self(0, last_cpu);
    } else {
        rig.pin_daemons("0-1");
        rig.pin_nodes("0-1");
        pin_self(0, 1);
    }
}

/// Runs every workload on every system; the report in markdown.
pub fn run(cfg: &Config) -> Result<String, String> {
    let tree = build_tree(cfg.tree_mib)?;
    let mut rig = rig(
        "0",
        &Target::Embedded {
            nodes: 2,
            region: "1G",
        },
    );
    let mut notes = Vec::new();
    if let Err(e) = rig.add_bindfs("0") {
        eprintln!("rackfs-bench meta: {e}; skipping bindfs");
        notes.push(format!("bindfs skipped: {e}."));
    }
    if let Err(e) = rig.add_standby("0") {
        eprintln!("rackfs-bench meta: {e}; skipping RackFS with a standby");
        notes.push(format!("RackFS with a standby skipped: {e}."));
    }
    let systems: Vec<&'static str> = rig.systems.iter().map(|s| s.name).collect();
    // Untimed: a fresh RackFS mount's first creates are several times slower than the rest.
    place(&rig, cfg.pinned, 0);
    for (s, name) in rig.systems.iter().zip(&systems) {
        small_files(&s.dir, WARMUP_FILES, 1).map_err(|e| format!("{name}: warm-up: {e}"))?;
    }
    let mut tables = Vec::new();
    for (threads, last_cpu) in [(1, 0), (8, 1)] {
        place(&rig, cfg.pinned, last_cpu);
        let mut t = Table::new(
            format!(
                "Small files, {threads} thread{}: {} files of 4 KiB",
                if threads == 1 { "" } else { "s" },
                cfg.files
            ),
            false,
            LOOP_PHASES,
            &systems,
        );
        rotating(cfg.runs, &systems, &mut t, |i| {
            let r = small_files(&rig.systems[i].dir, cfg.files, threads)?;
            let shown = r.map(rate).join(" / ");
            eprintln!("small files, {threads} thread(s), {}: {shown}", systems[i]);
            Ok(r)
        })?;
        tables.push(t);
    }
    place(&rig, cfg.pinned, 0);
    let mut t = Table::new(
        format!(
            "Source tree: {} ({} files, {:.1} MiB)",
            tree.what,
            tree.files,
            tree.bytes as f64 / (1 << 20) as f64
        ),
        true,
        TREE_PHASES,
        &systems,
    );
    rotating(cfg.runs, &systems, &mut t, |i| {
        let r = tree_run(&rig.systems[i].dir, &tree)?;
        let shown = r.map(|s| format!("{s:.2} s")).join(" / ");
        eprintln!("source tree, {}: {shown}", systems[i]);
        Ok(r)
    })?;
    tables.push(t);
    place(&rig, cfg.pinned, 1);
    let mut t = Table::new(
        format!(
            "filebench personalities (the workload suite's fio stand-ins, {} s each)",
            cfg.personality_s
        ),
        false,
        PERSONALITIES,
        &systems,
    );
    rotating(cfg.runs, &systems, &mut t, |i| {
        let r = personalities(&rig.systems[i].dir, cfg.personality_s)?;
        let shown = r.map(rate).join(" / ");
        eprintln!("personalities, {}: {shown}", systems[i]);
        Ok(r)
    })?;
    let personality_table = t;
    pin_self(0, 1);
    drop(rig);
    let mut md = format!(
        "# Metadata and small files\n\n`rackfs-bench meta`: {} run(s) per point, systems \
         rotating; RackFS on two memory nodes (default mount options; `+ standby`: on a local \
         etcd, the data node the metadata standby); {}; each system ran an \
         untimed {WARMUP_FILES}-file loop first.\n\n",
        cfg.runs,
        if cfg.pinned {
            "pinned (`--pinned`): single-threaded points on CPU 0 with the FUSE daemons, memory \
             nodes on CPU 1"
        } else {
            "not pinned: every process on any CPU, as a user runs them"
        }
    );
    for t in &tables {
        md.push_str(&t.markdown());
    }
    md.push_str(&personality_table.markdown());
    for n in notes {
        md.push_str(&format!("- {n}\n"));
    }
    Ok(md)
}
