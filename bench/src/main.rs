//! `rackfs-bench`: RackFS benchmarks, each run side by side with its baseline.

mod fio;
mod locks;
mod stats;
mod verbs;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

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

#[derive(Subcommand)]
enum Cmd {
    /// One-sided verbs per transport vs local memory (shm) and a bare TCP ping-pong (tcp).
    Verbs {
        /// A short smoke run (one run per point, 50 ms each).
        #[arg(long)]
        quick: bool,
        /// Measuring time per point and run, in milliseconds.
        #[arg(long, default_value_t = 300)]
        duration_ms: u64,
        /// Runs per point (alternating system and baseline); the median is reported.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Transports to measure.
        #[arg(long, value_delimiter = ',', default_value = "shm,tcp")]
        transports: Vec<String>,
        /// Also write the markdown table to this file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Range locks: Citron vs an RPC lock server on the memory node vs one mutex per segment.
    Locks {
        /// A short smoke run.
        #[arg(long)]
        quick: bool,
        /// Measuring time per point and run, in milliseconds.
        #[arg(long, default_value_t = 300)]
        duration_ms: u64,
        /// Runs per point (rotating the systems); the median is reported.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Also write the markdown table to this file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// fio on tmpfs, the in-memory FUSE baseline, and RackFS over shm and tcp (needs root).
    Fio {
        /// A short smoke run (one 1 s run per point).
        #[arg(long)]
        quick: bool,
        /// Runs per point; the median is reported.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Seconds per fio run (after 1 s of ramp).
        #[arg(long, default_value_t = 4)]
        runtime: u32,
        /// Also write the markdown table to this file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

fn main() {
    match Cli::parse().cmd {
        Cmd::Verbs {
            quick,
            duration_ms,
            runs,
            transports,
            out,
        } => {
            let cfg = verbs::Config {
                duration: Duration::from_millis(if quick { 50 } else { duration_ms }),
                runs: if quick { 1 } else { runs.max(1) },
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
                out,
            );
        }
        Cmd::Locks {
            quick,
            duration_ms,
            runs,
            out,
        } => {
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
                runs: if quick { 1 } else { runs.max(1) },
            };
            eprintln!("{}", locks::table_header());
            let rows = locks::run(&cfg);
            publish(
                &locks::table_header(),
                rows.iter().map(locks::format_row),
                locks::ratios(&rows),
                out,
            );
        }
        Cmd::Fio {
            quick,
            runs,
            runtime,
            out,
        } => {
            let cfg = fio::Config {
                runs: if quick { 1 } else { runs.max(1) },
                runtime_s: if quick { 1 } else { runtime.max(1) },
                size_per_job: if quick { "32M" } else { "128M" },
            };
            eprintln!("{}", fio::table_header());
            let rows = fio::run(&cfg);
            publish(
                &fio::table_header(),
                rows.iter().map(fio::format_row),
                fio::ratios(&rows),
                out,
            );
        }
    }
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
    println!("{md}");
    if let Some(path) = out {
        std::fs::write(&path, md).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
}
