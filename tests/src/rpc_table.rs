//! What each file operation costs the memory nodes (issue 25): control RPCs and verbs per
//! operation, read from every node's counters before and after many operations through a real
//! FUSE mount. Shared by the test that fails when a count grows (`tests/tests/rpc_counts.rs`)
//! and `rackfs-bench rpc-table`, which prints the same table for the docs.
//!
//! Background traffic counts on the same counters, so: the *periodic* kinds ([`PERIODIC`]:
//! lease renewals, the embedded coordinator's node leases, the watcher's long polls, QoS, the
//! mounts' look at the cluster's nodes each second, and this module's own `stats` calls) are left out of the per-operation counts and shown as
//! rates of an idle interval instead; verbs (QoS token traffic runs all the time) are counted
//! with the idle interval's rate, times the operations' duration, subtracted.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rackfs_proto::control::{NodeStats, RPC_KINDS};
use rackfs_proto::ControlClient;
use rackfs_verbs::VerbTotals;

use crate::{Mount, TestCluster};

/// RPC kinds that run on timers, not because of an operation: left out of per-operation
/// counts (see [`Measured::idle`] for their rates).
pub const PERIODIC: [&str; 9] = [
    "renew",
    "cluster",
    "coord",
    "watch",
    "qos_shares",
    "qos_set",
    "qos_status",
    "stats",
    "ping",
];

/// How long the kernel's name and attribute cache lasts on a default mount, plus a margin:
/// operations on "names not cached" wait this after creating them.
const CACHE_LAPSE: Duration = Duration::from_millis(1300);

/// Short names of the verb opcodes, in `rackfs_verbs::Opcode::ALL` order.
const OPCODES: [&str; 6] = ["READ", "WRITE", "CAS", "FAA", "MCAS", "MFAA"];

/// The mount options a row is measured with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Options {
    /// The defaults (kernel caches names and attributes for 1 s, a watcher runs).
    Default,
    /// `attr_timeout=0`: no kernel cache, no watcher.
    NoCache,
}

impl Options {
    /// The `-o` string (the transport is always shm).
    pub fn mount_opts(self) -> &'static str {
        match self {
            Options::Default => "transport=shm",
            Options::NoCache => "transport=shm,attr_timeout=0",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Options::Default => "default",
            Options::NoCache => "attr_timeout=0",
        }
    }
}

/// One kind of operation, done by this process through the mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `open(O_CREAT|O_EXCL)` of a new name, `close`.
    Create,
    /// `open(O_CREAT|O_EXCL)`, one 4 KiB `write`, `close`.
    CreateWrite,
    /// `open`, one 4 KiB `read`, `close` of the same unchanged file.
    OpenRead,
    /// `stat` of the same file over and over (cached on a default mount).
    Stat,
    /// `stat` of names not in the kernel's cache (each once, its cache lapsed).
    StatLapsed,
    /// Listing a directory of 100 entries (`opendir`, `getdents` to the end, `closedir`).
    Readdir,
    /// `ls -l` of a directory of 20 entries whose names are not cached: the listing and an
    /// `lstat` of each entry (a directory per operation).
    ListStat,
    /// `unlink` of a 0-byte file whose name is not cached.
    Unlink,
    /// `rename` within a directory to a new name (source name not cached).
    Rename,
    /// `mkdir` of a new name.
    Mkdir,
    /// `chmod` of the same file, alternating between two modes.
    Chmod,
    /// `ftruncate` of an open file, alternately to 4 KiB and to 0.
    Truncate,
}

impl Op {
    pub const ALL: [Op; 12] = [
        Op::Create,
        Op::CreateWrite,
        Op::OpenRead,
        Op::Stat,
        Op::StatLapsed,
        Op::Readdir,
        Op::ListStat,
        Op::Unlink,
        Op::Rename,
        Op::Mkdir,
        Op::Chmod,
        Op::Truncate,
    ];

    /// A short stable name (the test's bounds are keyed by it).
    pub fn name(self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::CreateWrite => "create+write 4K+close",
            Op::OpenRead => "open+read 4K+close",
            Op::Stat => "stat (same file)",
            Op::StatLapsed => "stat (name not cached)",
            Op::Readdir => "readdir (100 entries)",
            Op::ListStat => "ls -l (20 entries, not cached)",
            Op::Unlink => "unlink",
            Op::Rename => "rename (same dir)",
            Op::Mkdir => "mkdir",
            Op::Chmod => "chmod",
            Op::Truncate => "ftruncate",
        }
    }

    /// Whether the op waits for the kernel's cache to lapse on the names it uses.
    fn uncached_names(self) -> bool {
        matches!(
            self,
            Op::StatLapsed | Op::ListStat | Op::Unlink | Op::Rename
        )
    }

    /// Creates what operations `0..count` need in `dir`.
    fn prepare(self, dir: &Path, count: usize) -> std::io::Result<()> {
        fs::create_dir(dir)?;
        match self {
            Op::OpenRead | Op::Stat | Op::Chmod | Op::Truncate => {
                fs::write(dir.join("f"), vec![7u8; 4096])?;
            }
            Op::StatLapsed | Op::Unlink | Op::Rename => {
                for i in 0..count {
                    File::create(dir.join(format!("f{i}")))?;
                }
            }
            Op::ListStat => {
                for i in 0..count {
                    fs::create_dir(dir.join(format!("l{i}")))?;
                    for e in 0..LISTED {
                        File::create(dir.join(format!("l{i}/e{e:02}")))?;
                    }
                }
            }
            Op::Readdir => {
                fs::create_dir(dir.join("d"))?;
                for i in 0..100 {
                    File::create(dir.join(format!("d/e{i:03}")))?;
                }
            }
            Op::Create | Op::CreateWrite | Op::Mkdir => {}
        }
        Ok(())
    }

    /// Operation `i` (each `i` once, in order) in the working directory, on names relative
    /// to it; `open` is the file kept open by `ftruncate`.
    fn run(self, i: usize, open: &mut Option<File>) -> std::io::Result<()> {
        let name = PathBuf::from(format!("f{i}"));
        match self {
            Op::Create => drop(new_file(&name)?),
            Op::CreateWrite => new_file(&name)?.write_all(&[i as u8; 4096])?,
            Op::OpenRead => {
                let mut buf = [0u8; 4096];
                File::open("f")?.read_exact(&mut buf)?;
            }
            Op::Stat => {
                fs::metadata("f")?;
            }
            Op::StatLapsed => {
                fs::metadata(&name)?;
            }
            Op::Readdir => {
                let n = fs::read_dir("d")?.collect::<Result<Vec<_>, _>>()?;
                assert_eq!(n.len(), 100, "readdir lists every entry");
            }
            Op::ListStat => {
                let mut n = 0;
                for e in fs::read_dir(format!("l{i}"))? {
                    fs::symlink_metadata(e?.path())?;
                    n += 1;
                }
                assert_eq!(n, LISTED, "ls -l lists every entry");
            }
            Op::Unlink => fs::remove_file(&name)?,
            Op::Rename => fs::rename(&name, format!("g{i}"))?,
            Op::Mkdir => fs::create_dir(&name)?,
            Op::Chmod => {
                let mode = if i.is_multiple_of(2) { 0o600 } else { 0o644 };
                fs::set_permissions("f", fs::Permissions::from_mode(mode))?
            }
            Op::Truncate => {
                if open.is_none() {
                    *open = Some(OpenOptions::new().write(true).open("f")?);
                }
                let f = open.as_ref().expect("opened above");
                f.set_len(if i.is_multiple_of(2) { 0 } else { 4096 })?
            }
        }
        Ok(())
    }
}

/// Entries of each directory [`Op::ListStat`] lists.
const LISTED: usize = 20;

fn new_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().write(true).create_new(true).open(path)
}

/// Every node's counters at one moment, node 0 (the primary) first.
struct Snapshot(Vec<NodeStats>);

/// Counter deltas of one interval.
#[derive(Clone, Debug)]
pub struct Delta {
    /// Control RPCs served, per node, by kind ([`RPC_KINDS`]).
    pub rpcs: Vec<[u64; RPC_KINDS.len()]>,
    /// Verbs served, all nodes together.
    pub verbs: VerbTotals,
    pub elapsed: Duration,
}

impl Delta {
    fn between(a: &Snapshot, b: &Snapshot, elapsed: Duration) -> Delta {
        let mut verbs = VerbTotals::default();
        let rpcs =
            a.0.iter()
                .zip(&b.0)
                .map(|(x, y)| {
                    for k in 0..6 {
                        verbs.ops[k] += y.verbs.ops[k] - x.verbs.ops[k];
                        verbs.bytes[k] += y.verbs.bytes[k] - x.verbs.bytes[k];
                    }
                    verbs.batches += y.verbs.batches - x.verbs.batches;
                    verbs.errors += y.verbs.errors - x.verbs.errors;
                    std::array::from_fn(|k| y.rpcs[k] - x.rpcs[k])
                })
                .collect();
        Delta {
            rpcs,
            verbs,
            elapsed,
        }
    }
}

/// One row: an operation under some mount options, `n` times.
#[derive(Clone, Debug)]
pub struct Row {
    pub op: Op,
    pub options: Options,
    pub n: usize,
    pub delta: Delta,
    /// The idle interval measured on the same mount (for verbs' background rate).
    pub idle: Delta,
}

fn periodic(kind: usize) -> bool {
    PERIODIC.contains(&RPC_KINDS[kind])
}

impl Row {
    /// Control RPCs per operation to node `node` (periodic kinds left out).
    pub fn rpcs_at(&self, node: usize) -> f64 {
        let sum: u64 = (0..RPC_KINDS.len())
            .filter(|k| !periodic(*k))
            .map(|k| self.delta.rpcs[node][k])
            .sum();
        sum as f64 / self.n as f64
    }

    /// Control RPCs per operation, all nodes.
    pub fn rpcs(&self) -> f64 {
        (0..self.delta.rpcs.len()).map(|i| self.rpcs_at(i)).sum()
    }

    /// Control RPCs per operation to the primary (node 0).
    pub fn rpcs_primary(&self) -> f64 {
        self.rpcs_at(0)
    }

    /// Control RPCs per operation to the other nodes.
    pub fn rpcs_others(&self) -> f64 {
        self.rpcs() - self.rpcs_primary()
    }

    /// Non-periodic kinds per operation, e.g. `meta 2.00, mn1: alloc 1.00`.
    pub fn by_kind(&self) -> String {
        let mut parts = Vec::new();
        for (node, counts) in self.delta.rpcs.iter().enumerate() {
            let kinds: Vec<String> = (0..RPC_KINDS.len())
                .filter(|k| !periodic(*k) && counts[*k] > 0)
                .map(|k| format!("{} {:.2}", RPC_KINDS[k], counts[k] as f64 / self.n as f64))
                .collect();
            if !kinds.is_empty() {
                let prefix = if node == 0 {
                    String::new()
                } else {
                    format!("mn{node}: ")
                };
                parts.push(format!("{prefix}{}", kinds.join(", ")));
            }
        }
        if parts.is_empty() {
            "-".into()
        } else {
            parts.join("; ")
        }
    }

    /// The periodic kinds counted in the interval (left out of the per-op counts), e.g.
    /// `stats 2, coord 1`.
    pub fn periodic(&self) -> String {
        let v: Vec<String> = (0..RPC_KINDS.len())
            .filter(|k| periodic(*k))
            .filter_map(|k| {
                let sum: u64 = self.delta.rpcs.iter().map(|node| node[k]).sum();
                (sum > 0).then(|| format!("{} {sum}", RPC_KINDS[k]))
            })
            .collect();
        v.join(", ")
    }

    /// `x` per operation less the idle rate of `idle_x` over this row's duration.
    fn net(&self, x: u64, idle_x: u64) -> f64 {
        let background =
            idle_x as f64 * self.delta.elapsed.as_secs_f64() / self.idle.elapsed.as_secs_f64();
        ((x as f64 - background) / self.n as f64).max(0.0)
    }

    /// Verbs per operation, all nodes, less the idle background.
    pub fn verbs(&self) -> f64 {
        self.net(self.delta.verbs.total_ops(), self.idle.verbs.total_ops())
    }

    /// Verb batches per operation, all nodes, less the idle background.
    pub fn batches(&self) -> f64 {
        self.net(self.delta.verbs.batches, self.idle.verbs.batches)
    }

    /// Verbs of `opcode` (`READ`, `WRITE`, `CAS`, `FAA`, `MCAS`, `MFAA`) per operation,
    /// less the idle background.
    pub fn verbs_of(&self, opcode: &str) -> f64 {
        let k = OPCODES
            .iter()
            .position(|o| *o == opcode)
            .unwrap_or_else(|| panic!("no opcode {opcode}"));
        self.net(self.delta.verbs.ops[k], self.idle.verbs.ops[k])
    }

    /// Verbs per operation by opcode (those above 0.05), less the idle background.
    pub fn verbs_by_opcode(&self) -> String {
        let v: Vec<String> = OPCODES
            .iter()
            .enumerate()
            .map(|(k, name)| {
                (
                    name,
                    self.net(self.delta.verbs.ops[k], self.idle.verbs.ops[k]),
                )
            })
            .filter(|(_, x)| *x >= 0.05)
            .map(|(name, x)| format!("{name} {x:.1}"))
            .collect();
        if v.is_empty() {
            "-".into()
        } else {
            v.join(", ")
        }
    }
}

/// The whole measurement: every row, and each mount's idle interval.
pub struct Measured {
    pub rows: Vec<Row>,
    /// Per mount options: the idle interval's counters.
    pub idle: Vec<(Options, Delta)>,
    pub nodes: usize,
}

/// What to measure.
pub struct Config {
    /// Operations per row (after the warm-up).
    pub n: usize,
    /// Operations of the same kind done first, not counted.
    pub warmup: usize,
    /// Length of the idle interval measured on each mount.
    pub idle: Duration,
    /// Memory nodes (node 0 the primary); stripes have the cluster's default 2 replicas.
    pub nodes: usize,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            n: 200,
            warmup: 20,
            idle: Duration::from_secs(2),
            nodes: 2,
        }
    }
}

/// Reads every node's counters over one control connection each (opened once, so a snapshot
/// costs each node exactly one `stats` RPC, a periodic kind).
struct Counters(Vec<ControlClient>);

impl Counters {
    fn snapshot(&self) -> Snapshot {
        Snapshot(
            self.0
                .iter()
                .map(|c| c.stats().expect("node stats"))
                .collect(),
        )
    }
}

/// Starts a cluster of `cfg.nodes` nodes over shm and measures every row: each set of mount
/// options on a fresh mount of its own (one mount at a time, so no other mount's watcher
/// takes part), an idle interval first, then each operation: prepare, warm up, snapshot, `n`
/// operations, snapshot. Changes the process's working directory while an operation runs
/// (so the caller must not use relative paths meanwhile, from any thread).
pub fn measure(cfg: &Config) -> Measured {
    let cluster = TestCluster::start(cfg.nodes, "256M");
    let counters = Counters((0..cfg.nodes).map(|i| cluster.control(i)).collect());
    let mut rows = Vec::new();
    let mut idles = Vec::new();
    for options in [Options::Default, Options::NoCache] {
        let mount = Mount::new(&cluster, options.mount_opts());
        let root = mount.path(options.label());
        fs::create_dir(&root).expect("mkdir");
        // Let the mount's first QoS period and connections settle before the idle interval.
        std::thread::sleep(Duration::from_millis(500));
        let a = counters.snapshot();
        let t = Instant::now();
        std::thread::sleep(cfg.idle);
        let idle = Delta::between(&a, &counters.snapshot(), t.elapsed());
        for op in Op::ALL {
            if op == Op::StatLapsed && options == Options::NoCache {
                continue; // the same as Stat there: nothing is cached
            }
            let dir = root.join(op.name().replace([' ', '(', ')', '+'], "_"));
            let delta = measure_op(op, &dir, cfg, &counters)
                .unwrap_or_else(|e| panic!("{} on {}: {e}", op.name(), options.label()));
            rows.push(Row {
                op,
                options,
                n: cfg.n,
                delta,
                idle: idle.clone(),
            });
        }
        idles.push((options, idle));
        drop(mount);
    }
    Measured {
        rows,
        idle: idles,
        nodes: cfg.nodes,
    }
}

/// Prepares `dir`, then runs the warm-up and the counted operations with `dir` as the working
/// directory: names relative to it cost the lookups of one name, not of every component of
/// an absolute path (which, with `attr_timeout=0`, each cost a lookup).
fn measure_op(op: Op, dir: &Path, cfg: &Config, counters: &Counters) -> std::io::Result<Delta> {
    let total = cfg.warmup + cfg.n;
    op.prepare(dir, total)?;
    if op.uncached_names() {
        std::thread::sleep(CACHE_LAPSE);
    }
    let back = std::env::current_dir()?;
    std::env::set_current_dir(dir)?;
    let counted = (|| {
        let mut open = None;
        for i in 0..cfg.warmup {
            op.run(i, &mut open)?;
        }
        // Last closes go to the primary in batches a little later (`rackfs_fs::releases`):
        // the warm-up's before counting starts, the counted operations' before it ends.
        let settle = rackfs_fs::releases::WINDOW * 5;
        std::thread::sleep(settle);
        let a = counters.snapshot();
        let t = Instant::now();
        for i in cfg.warmup..total {
            op.run(i, &mut open)?;
        }
        let elapsed = t.elapsed();
        std::thread::sleep(settle);
        let b = counters.snapshot();
        drop(open);
        Ok(Delta::between(&a, &b, elapsed))
    })();
    std::env::set_current_dir(back)?;
    counted
}

impl Measured {
    /// The row of `op` under `options`.
    pub fn row(&self, op: Op, options: Options) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.op == op && r.options == options)
    }

    /// The table in markdown, with a note on what was counted and the idle rates.
    pub fn markdown(&self) -> String {
        let n = self.rows.first().map_or(0, |r| r.n);
        let mut md = format!(
            "{} memory nodes over shm (node 0 the primary), 2 replicas, one mount, {n} operations \
             per row after a warm-up, from one process. Control RPCs leave out the periodic \
             kinds ({}); verbs are net of the idle rate below.\n\n",
            self.nodes,
            PERIODIC.join(", ")
        );
        md.push_str(
            "| operation | mount | control RPCs/op | to primary | to others | RPCs by kind (per op) \
             | verbs/op | verb batches/op | verbs by opcode (per op) | periodic, left out (in all) |\n\
             |---|---|---:|---:|---:|---|---:|---:|---|---|\n",
        );
        for r in &self.rows {
            md.push_str(&format!(
                "| {} | {} | {:.2} | {:.2} | {:.2} | {} | {:.1} | {:.1} | {} | {} |\n",
                r.op.name(),
                r.options.label(),
                r.rpcs(),
                r.rpcs_primary(),
                r.rpcs_others(),
                r.by_kind(),
                r.verbs(),
                r.batches(),
                r.verbs_by_opcode(),
                r.periodic(),
            ));
        }
        md.push_str("\nIdle, per second (left out above):\n\n");
        for (options, d) in &self.idle {
            let secs = d.elapsed.as_secs_f64();
            let mut kinds: Vec<String> = Vec::new();
            for k in 0..RPC_KINDS.len() {
                let sum: u64 = d.rpcs.iter().map(|node| node[k]).sum();
                if sum > 0 {
                    kinds.push(format!("{} {:.1}", RPC_KINDS[k], sum as f64 / secs));
                }
            }
            md.push_str(&format!(
                "- {} mount: {}; verbs {:.0}, batches {:.0}\n",
                options.label(),
                kinds.join(", "),
                d.verbs.total_ops() as f64 / secs,
                d.verbs.batches as f64 / secs
            ));
        }
        md
    }
}
