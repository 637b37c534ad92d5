//! `rackfs-bench`: RackFS benchmarks, each run side by side with its baseline.

mod failover;
mod fio;
mod locks;
mod meta;
mod mounts;
mod plot;
mod qos;
mod qos_engine;
mod qos_mounts;
mod qos_pshift;
mod reclocks;
mod replicas;
mod rpc_table;
mod shared;
mod stats;
mod suite;
mod verbs;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use rackfs_cli::outln;

#[derive(Parser)]
#[command(
    name = "rackfs-bench",
    version,
    about = "RackFS benchmarks with same-run baselines"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// What every benchmark takes.
#[derive(Args)]
struct RunArgs {
    /// A short smoke run (one short run per point).
    #[arg(long)]
    quick: bool,
    /// Runs per point, rotating the systems; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Also write the markdown table to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

impl RunArgs {
    fn runs(&self) -> usize {
        if self.quick {
            1
        } else {
            self.runs.max(1)
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// One-sided verbs per transport vs local memory (shm) and a bare TCP ping-pong (tcp).
    Verbs {
        #[command(flatten)]
        run: RunArgs,
        /// Measuring time per point and run, in milliseconds (quick: 50).
        #[arg(long, default_value_t = 300)]
        duration_ms: u64,
        /// Transports to measure.
        #[arg(long, value_delimiter = ',', default_value = "shm,tcp")]
        transports: Vec<String>,
    },
    /// Range locks: Citron vs an RPC lock server on the memory node vs one mutex per segment.
    Locks {
        #[command(flatten)]
        run: RunArgs,
        /// Measuring time per point and run, in milliseconds (quick: 100).
        #[arg(long, default_value_t = 300)]
        duration_ms: u64,
    },
    /// fio on tmpfs, the in-memory FUSE baseline, and RackFS over shm and tcp (needs root).
    Fio {
        #[command(flatten)]
        run: RunArgs,
        /// Seconds per fio run, after 1 s of ramp (quick: 1).
        #[arg(long, default_value_t = 4)]
        runtime: u32,
        /// Only the workloads whose name contains this, e.g. "1M seq write".
        #[arg(long)]
        only: Option<String>,
    },
    /// Replicated reads under skew (a hot node; r=1, r=2 static, r=2 adaptive) and the cost
    /// of a second replica on writes (needs root, fio and the cgroup v1 cpu controller).
    Replicas {
        #[command(flatten)]
        run: RunArgs,
        /// Seconds per fio run, after 1 s of ramp (quick: 2).
        #[arg(long, default_value_t = 5)]
        runtime: u32,
    },
    /// The metadata standby: what its journal costs small-file creation, and how long a
    /// mount waits after kill -9 of the primary (needs root and etcd-server).
    Failover {
        #[command(flatten)]
        run: RunArgs,
        /// Files created per run (quick: 200).
        #[arg(long, default_value_t = 2000)]
        files: usize,
    },
    /// Haechi's experiments 2A, 2B, 2C and 4 on the simulator with a modelled NIC.
    Qos {
        #[command(flatten)]
        run: RunArgs,
    },
    /// What one QoS token check costs (the engine against a real memory node over shm).
    QosEngine {
        #[command(flatten)]
        run: RunArgs,
    },
    /// Three real mounts with reservations and a limit under fio, with and without QoS, and
    /// QoS's own cost (needs root and fio).
    QosMounts {
        #[command(flatten)]
        run: RunArgs,
        /// Seconds per fio run, after 1 s of ramp (quick: 2).
        #[arg(long, default_value_t = 5)]
        runtime: u32,
        /// Which parts to run.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "reservations,weights,cost,limits"
        )]
        parts: Vec<qos_mounts::Part>,
    },
    /// The workload suite: fio job files and filebench personalities from `bench/` on RackFS
    /// and its baselines, range-locked sharing, QoS over time, lock throughput and scale-down,
    /// written to `DIR/report.md` with charts (needs root and fio).
    Suite {
        /// How much to run.
        #[arg(long, value_enum, default_value = "default")]
        set: suite::Set,
        /// Runs per point (quick: 1).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Seconds per fio run, after 1 s of ramp (quick: 1).
        #[arg(long, default_value_t = 2)]
        runtime: u32,
        /// Use this running cluster (its primary's HOST:PORT, over tcp) instead of starting one.
        #[arg(long, value_name = "ADDR", requires = "secret_file")]
        cluster: Option<String>,
        /// The cluster's secret file (with --cluster).
        #[arg(long)]
        secret_file: Option<PathBuf>,
        /// Where the report and charts go (default: `bench/results/DATE`).
        #[arg(long)]
        out_dir: Option<PathBuf>,
    },
    /// The suite's small-file section alone: a source tree untarred into RackFS, its node memory
    /// against its bytes, and its time against tmpfs.
    Tree {
        /// quick: about 30 MB of the tree; default: all of it.
        #[arg(long, value_enum, default_value = "default")]
        set: suite::Set,
    },
    /// Counts the 4 KiB units of FILE that hold a mix of bytes rather than one of PATTERNS
    /// throughout (after `bench/fio/overlap-verify.fio`); fails if any does.
    CheckUnits {
        file: PathBuf,
        /// Byte patterns, e.g. 0xaa 0xbb.
        #[arg(required = true, value_parser = parse_byte)]
        patterns: Vec<u8>,
    },
    /// pShift through real mounts: a reserving mount's demand moves between two memory
    /// nodes, with pShift and with an even split (needs root and fio).
    QosPshift {
        #[command(flatten)]
        run: RunArgs,
        /// Seconds the mount reads on each node (quick: 4).
        #[arg(long, default_value_t = 8)]
        phase: u32,
    },
    /// fcntl lock + unlock pairs per second on tmpfs and across two RackFS mounts,
    /// uncontended and contended (needs root).
    RecordLocks {
        #[command(flatten)]
        run: RunArgs,
        /// Measuring time per point and run, in milliseconds (quick: 200).
        #[arg(long, default_value_t = 2000)]
        duration_ms: u64,
    },
    /// One process of the record-lock benchmark: locks and unlocks one byte of FILE for
    /// `--ms` and prints pairs per second.
    #[command(hide = true)]
    LockLoop {
        file: PathBuf,
        byte: i64,
        #[arg(long)]
        ms: u64,
        /// F_SETLKW instead of F_SETLK.
        #[arg(long)]
        wait: bool,
    },
    /// Control RPCs and verbs per file operation (create, open+read, stat, readdir, unlink,
    /// rename, mkdir, chmod, truncate) from the nodes' counters, through a real mount (needs
    /// root).
    RpcTable {
        /// Operations counted per row (quick: 50).
        #[arg(long, default_value_t = 200)]
        ops: usize,
        /// Memory nodes (stripes keep the default 2 replicas).
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(2..=4))]
        nodes: u16,
        /// Fewer operations per row.
        #[arg(long)]
        quick: bool,
        /// Also write the markdown to this file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Metadata and small files on tmpfs, bindfs over tmpfs, the FUSE ceiling and RackFS over
    /// shm and tcp (and over shm with a metadata standby on a local etcd): a
    /// create/stat/open+read/unlink loop of 4 KiB files with 1 and 8 threads, untar, find,
    /// grep -r and rm -rf of a source tree, and fio stand-ins of filebench's fileserver,
    /// varmail and webserver (needs root and fio; bindfs and etcd if installed).
    Meta {
        #[command(flatten)]
        run: RunArgs,
        /// Files of the small-file loop, split over the threads (quick: 300).
        #[arg(long, default_value_t = 2000)]
        files: usize,
        /// MiB of file data in the source tree, in whole crates (quick: 8).
        #[arg(long, default_value_t = 32)]
        tree_mib: u64,
        /// Pin single-threaded points to CPU 0 with the FUSE daemons and the memory nodes to
        /// CPU 1 (default: no pinning, as a user runs them).
        #[arg(long)]
        pinned: bool,
    },
    /// fio writers on two mounts sharing one file: disjoint regions with and without range
    /// locks, and overlapping writers checked for mixed 4 KiB units (needs root).
    Shared {
        #[command(flatten)]
        run: RunArgs,
        /// Seconds per fio run, after 1 s of ramp (quick: 1).
        #[arg(long, default_value_t = 4)]
        runtime: u32,
    },
}

fn main() {
    match Cli::parse().cmd {
        Cmd::Verbs {
            run,
            duration_ms,
            transports,
        } => {
            let cfg = verbs::Config {
                duration: Duration::from_millis(if run.quick { 50 } else { duration_ms }),
                runs: run.runs(),
                transports,
                ops: vec![
                    verbs::Op::Cas,
                    verbs::Op::Faa,
                    verbs::Op::Read(4096),
                    verbs::Op::Write(4096),
                    verbs::Op::Read(65536),
                    verbs::Op::Write(65536),
                ],
                batches: vec![1, 8, 32],
                threads: vec![1, 2],
            };
            eprintln!("{}", verbs::table_header());
            let rows = verbs::run(&cfg);
            publish(
                &verbs::table_header(),
                rows.iter().map(verbs::format_row),
                verbs::batching_gains(&rows),
                run.out,
            );
        }
        Cmd::Locks { run, duration_ms } => {
            let quick = run.quick;
            let cfg = locks::Config {
                transports: vec!["shm", "tcp"],
                clients: if quick {
                    vec![1, 8]
                } else {
                    vec![1, 2, 4, 8, 16]
                },
                patterns: if quick {
                    vec![locks::Pattern::Unaligned, locks::Pattern::Variable]
                } else {
                    locks::Pattern::ALL.to_vec()
                },
                spaces: if quick {
                    vec![4096]
                } else {
                    vec![1 << 20, 4096]
                },
                duration: Duration::from_millis(if quick { 100 } else { duration_ms }),
                runs: run.runs(),
            };
            eprintln!("{}", locks::table_header());
            let rows = locks::run(&cfg);
            publish(
                &locks::table_header(),
                rows.iter().map(locks::format_row),
                locks::ratios(&rows),
                run.out,
            );
        }
        Cmd::Fio { run, runtime, only } => {
            let cfg = fio::Config {
                runs: run.runs(),
                runtime_s: if run.quick { 1 } else { runtime.max(1) },
                size_per_job: if run.quick { "32M" } else { "128M" },
                only,
            };
            eprintln!("{}", fio::table_header());
            let rows = fio::run(&cfg);
            publish(
                &fio::table_header(),
                rows.iter().map(fio::format_row),
                fio::ratios(&rows),
                run.out,
            );
        }
        Cmd::Failover { run, files } => {
            let cfg = failover::Config {
                runs: run.runs(),
                files: if run.quick { 200 } else { files.max(10) },
            };
            match failover::run(&cfg) {
                Ok(md) => report(&md, run.out),
                Err(e) => {
                    eprintln!("rackfs-bench failover: {e}");
                    std::process::exit(1);
                }
            }
        }
        Cmd::Replicas { run, runtime } => {
            let cfg = replicas::Config {
                runs: run.runs(),
                runtime_s: if run.quick { 2 } else { runtime.max(1) },
            };
            match replicas::run(&cfg) {
                Ok(md) => report(&md, run.out),
                Err(e) => {
                    eprintln!("rackfs-bench replicas: {e}");
                    std::process::exit(1);
                }
            }
        }
        Cmd::Qos { run } => {
            let periods = if run.quick { 6 } else { 20 };
            let mut md =
                String::from("# Haechi experiments (simulated NIC, see bench/src/qos.rs)\n\n");
            // Charts go next to the report (PNG when a converter is installed, else SVG).
            let plots = run
                .out
                .as_ref()
                .and_then(|p| p.parent().map(|d| d.to_path_buf()));
            for zipf in [false, true] {
                let (t, rows) = qos::exp_2a(zipf, periods);
                let name = if zipf { "Zipf(0.6)" } else { "uniform" };
                md.push_str(&format!(
                    "## 2A: {name} reservations, 90% of capacity reserved, all backlogged\n\n{t}\n"
                ));
                if let Some(dir) = &plots {
                    let mean = |v: &[u64]| v.iter().sum::<u64>() as f64 * 10.0 / v.len() as f64;
                    let svg = plot::bars(
                        &format!("2A, {name} reservations: mean IOPS per client"),
                        "IOPS",
                        &(1..=rows.len())
                            .map(|c| format!("C{c}"))
                            .collect::<Vec<_>>(),
                        &[
                            ("reservation", rows.iter().map(|r| r.0 as f64).collect()),
                            ("Haechi", rows.iter().map(|r| mean(&r.1)).collect()),
                            ("no QoS", rows.iter().map(|r| mean(&r.2)).collect()),
                        ],
                    );
                    let f = plot::save(
                        dir,
                        &format!("qos-2a-{}", if zipf { "zipf" } else { "uniform" }),
                        &svg,
                    );
                    md.push_str(&format!("![2A {name}]({f})\n\n"));
                }
                eprintln!("2A done");
            }
            for zipf in [false, true] {
                md.push_str(&format!(
                    "## 2B: C1, C2 ask for half their reservation ({})\n\n{}\n",
                    if zipf { "Zipf(0.6)" } else { "uniform" },
                    qos::exp_2b(zipf, periods, plots.as_deref())
                ));
                eprintln!("2B done");
            }
            md.push_str(&format!(
                "## 2C: reserved share of capacity\n\n{}\n",
                qos::exp_2c(periods, plots.as_deref())
            ));
            eprintln!("2C done");
            md.push_str(&format!(
                "## Weights 1:2:3, nothing reserved, all backlogged\n\n{}\n",
                qos::exp_weights(periods, plots.as_deref())
            ));
            for drop in [true, false] {
                let (t, series) = qos::exp_4(drop, periods);
                let mut image = String::new();
                if let Some(dir) = &plots {
                    let col = |f: fn(&(u64, u64, u64, u64)) -> u64| {
                        series.iter().map(|x| f(x) as f64).collect::<Vec<f64>>()
                    };
                    let reservation = qos::reservations(true, 0.8)[0] as f64;
                    let svg = plot::lines(
                        &format!(
                            "4: background load {} at period {}",
                            if drop { "starts" } else { "stops" },
                            periods / 2
                        ),
                        "IOPS",
                        "QoS period",
                        &[
                            ("capacity estimate", col(|x| x.1)),
                            ("QoS clients", col(|x| x.2)),
                            ("C1", col(|x| x.3)),
                            ("C1 reservation", vec![reservation; series.len()]),
                        ],
                    );
                    let f = plot::save(
                        dir,
                        &format!("qos-4-{}", if drop { "drop" } else { "rise" }),
                        &svg,
                    );
                    image = format!("![4 {}]({f})\n\n", if drop { "drop" } else { "rise" });
                }
                md.push_str(&format!(
                    "## 4: background load {} at period {}\n\n{t}\n{image}",
                    if drop {
                        "takes 25% of the NIC"
                    } else {
                        "(25% of the NIC) stops"
                    },
                    periods / 2
                ));
            }
            report(&md, run.out);
        }
        Cmd::QosEngine { run } => {
            let line = qos_engine::run(
                run.runs(),
                Duration::from_millis(if run.quick { 200 } else { 1000 }),
            );
            report(&line, run.out);
        }
        Cmd::QosMounts {
            run,
            runtime,
            parts,
        } => {
            let md = qos_mounts::run(
                if run.quick { 2 } else { runtime.max(1) },
                run.runs(),
                &parts,
            );
            report(&md, run.out);
        }
        Cmd::Suite {
            set,
            runs,
            runtime,
            cluster,
            secret_file,
            out_dir,
        } => {
            let quick = set == suite::Set::Quick;
            let out_dir = out_dir.unwrap_or_else(|| {
                let day = std::process::Command::new("date")
                    .arg("+%F")
                    .output()
                    .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                    .unwrap_or_else(|_| "today".into());
                PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("results")
                    .join(day)
            });
            let target = match (cluster, secret_file) {
                (Some(addr), Some(secret_file)) => fio::Target::Existing { addr, secret_file },
                _ => fio::Target::Embedded {
                    nodes: 2,
                    region: "2G",
                },
            };
            let md = suite::run(&suite::Config {
                set,
                runs: if quick { 1 } else { runs.max(1) },
                runtime: if quick { 1 } else { runtime.max(1) },
                target,
                out_dir: out_dir.clone(),
            });
            outln!("{md}");
            eprintln!("report: {}", out_dir.join("report.md").display());
        }
        Cmd::Tree { set } => outln!("{}", suite::source_tree(set)),
        Cmd::CheckUnits { file, patterns } => match suite::check_units(&file, &patterns) {
            Ok((units, 0)) => outln!("{}: {units} units, none mixed", file.display()),
            Ok((units, mixed)) => {
                outln!("{}: {mixed} of {units} units mixed", file.display());
                std::process::exit(1);
            }
            Err(e) => {
                eprintln!("rackfs-bench: cannot read {}: {e}", file.display());
                std::process::exit(2);
            }
        },
        Cmd::QosPshift { run, phase } => {
            let plots = run
                .out
                .as_ref()
                .and_then(|p| p.parent().map(|d| d.to_path_buf()));
            let md = qos_pshift::run(if run.quick { 4 } else { phase.max(3) }, plots.as_deref());
            report(&md, run.out);
        }
        Cmd::RecordLocks { run, duration_ms } => {
            let cfg = reclocks::Config {
                runs: run.runs(),
                duration: Duration::from_millis(if run.quick { 200 } else { duration_ms }),
            };
            match reclocks::run(&cfg) {
                Ok(md) => report(&md, run.out),
                Err(e) => {
                    eprintln!("rackfs-bench record-locks: {e}");
                    std::process::exit(1);
                }
            }
        }
        Cmd::LockLoop {
            file,
            byte,
            ms,
            wait,
        } => match reclocks::lock_loop(&file, byte, wait, Duration::from_millis(ms)) {
            Ok(r) => outln!("{r}"),
            Err(e) => {
                eprintln!("lock-loop: {e}");
                std::process::exit(1);
            }
        },
        Cmd::RpcTable {
            ops,
            nodes,
            quick,
            out,
        } => {
            let md = rpc_table::run(if quick { 50 } else { ops.max(10) }, nodes.into());
            report(&md, out);
        }
        Cmd::Meta {
            run,
            files,
            tree_mib,
            pinned,
        } => {
            let cfg = meta::Config {
                runs: run.runs(),
                files: if run.quick { 300 } else { files.max(8) },
                tree_mib: if run.quick { 8 } else { tree_mib.max(1) },
                personality_s: if run.quick { 1 } else { 3 },
                pinned,
            };
            match meta::run(&cfg) {
                Ok(md) => report(&md, run.out),
                Err(e) => {
                    eprintln!("rackfs-bench meta: {e}");
                    std::process::exit(1);
                }
            }
        }
        Cmd::Shared { run, runtime } => {
            let cfg = shared::Config {
                runs: run.runs(),
                runtime_s: if run.quick { 1 } else { runtime.max(1) },
                writers: if run.quick { vec![1, 2] } else { vec![1, 2, 4] },
            };
            eprintln!("{}", shared::table_header());
            let (rows, notes) = shared::run(&cfg);
            publish(
                &shared::table_header(),
                rows.iter().map(shared::format_row),
                notes,
                run.out,
            );
        }
    }
}

/// A byte given as 0xNN or decimal.
fn parse_byte(s: &str) -> Result<u8, String> {
    match s.strip_prefix("0x") {
        Some(h) => u8::from_str_radix(h, 16),
        None => s.parse(),
    }
    .map_err(|e| format!("{s}: not a byte ({e})"))
}

/// Prints a markdown table and its headline lines, and writes them to `out` if given.
fn publish(
    header: &str,
    rows: impl Iterator<Item = String>,
    notes: Vec<String>,
    out: Option<PathBuf>,
) {
    let mut md = format!("{header}\n{}\n", rows.collect::<Vec<_>>().join("\n"));
    for line in notes {
        md.push_str(&format!("\n- {line}"));
    }
    report(&md, out);
}

/// Prints a report and writes it to `out` if given.
fn report(md: &str, out: Option<PathBuf>) {
    outln!("{md}");
    if let Some(path) = out {
        std::fs::write(&path, md).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
}
