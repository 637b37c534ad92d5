//! One file shared by writers on two mounts, through fio: the range-lock case.
//!
//! *Disjoint writers*: 4 KiB random writes, each writer in its own 16 MiB region of one file,
//! 1, 2 and 4 writers spread over two mounts (one fio process per mount), with range locks
//! (`locks=on`: a mount writing uncontended keeps the file's lock tree), with a lock per write
//! (`locks=on,keep_locks=off`) and without (`locks=off`, the baseline measured in the same
//! run). Aggregate IOPS per point; the order of the three rotates from run to run.
//!
//! *Overlapping writers*: two fio processes on two mounts write 16 KiB blocks at 4 KiB-aligned
//! random offsets of the same 4 MiB, each with its own byte pattern; afterwards every 4 KiB
//! unit must hold one pattern. Counted with and without locks (no lock: mixed units may appear,
//! depending on timing).

use std::path::Path;

use rackfs_tests::TestCluster;

use rackfs_tests::fio::{Fio, FioRun};

use crate::mounts::{mount_all, Mounts};

use crate::stats::{median, rate};

const REGION: u64 = 16 << 20;

pub struct Config {
    pub runs: usize,
    pub runtime_s: u32,
    pub writers: Vec<u32>,
}

pub struct Row {
    pub writers: u32,
    pub on: Vec<f64>,
    /// A lock per write (`keep_locks=off`).
    pub each: Vec<f64>,
    pub off: Vec<f64>,
}

/// Starts fio writing to `file` with `jobs` jobs, the first at region `first`.
fn fio(file: &Path, jobs: u32, first: u32, runtime: u32) -> FioRun {
    Fio::default()
        .opt("name", "w")
        .opt("filename", file.display())
        .opt("rw", "randwrite")
        .opt("bs", "4k")
        .opt("ioengine", "psync")
        .opt("direct", 1)
        .opt("size", REGION)
        .opt("offset", first as u64 * REGION)
        .opt("offset_increment", REGION)
        .opt("numjobs", jobs)
        .flag("time_based")
        .opt("runtime", runtime)
        .opt("ramp_time", 1)
        .flag("group_reporting")
        .spawn()
}

fn iops(run: FioRun) -> f64 {
    run.wait().first().write.iops
}

/// Aggregate IOPS of `writers` disjoint writers over the two mounts of `pair`.
fn disjoint(pair: &Mounts, writers: u32, runtime: u32) -> f64 {
    let on_a = writers.div_ceil(2);
    let on_b = writers - on_a;
    let a = fio(&pair.dirs[0].join("shared"), on_a, 0, runtime);
    let b = (on_b > 0).then(|| fio(&pair.dirs[1].join("shared"), on_b, on_a, runtime));
    iops(a) + b.map_or(0.0, iops)
}

/// Units of the overlap file holding bytes of more than one writer after two overlapping fio
/// writers ran; returns (mixed units, units checked).
fn overlap(pair: &Mounts, runtime: u32) -> (usize, usize) {
    let len: u64 = 4 << 20;
    let name = "overlap";
    std::fs::write(pair.dirs[0].join(name), vec![0u8; len as usize]).expect("overlap file");
    let run = |dir: &Path, pattern: &str| {
        Fio::default()
            .opt("name", "o")
            .opt("filename", dir.join(name).display())
            .opt("rw", "randwrite")
            .opt("bs", "16k")
            .opt("blockalign", "4k")
            .opt("ioengine", "psync")
            .opt("direct", 1)
            .opt("size", len)
            // The pattern alone, no verify header: a unit is one writer's or mixed.
            .opt("verify", "pattern")
            .opt("verify_pattern", pattern)
            .opt("do_verify", 0)
            .flag("time_based")
            .opt("runtime", runtime)
            .spawn()
    };
    let (a, b) = (run(&pair.dirs[0], "0xaa"), run(&pair.dirs[1], "0xbb"));
    a.wait();
    b.wait();
    let data = std::fs::read(pair.dirs[1].join(name)).expect("read back");
    let mixed = data
        .chunks(4096)
        .filter(|u| u.iter().any(|&b| b != u[0]))
        .count();
    (mixed, data.len() / 4096)
}

pub fn run(cfg: &Config) -> (Vec<Row>, Vec<String>) {
    let cluster = TestCluster::start(2, "1G");
    let on = mount_all(&cluster, &["locks=on"; 2]);
    let each = mount_all(&cluster, &["locks=on,keep_locks=off"; 2]);
    let off = mount_all(&cluster, &["locks=off"; 2]);
    let max = *cfg.writers.iter().max().unwrap_or(&1) as u64;
    // Lay the file out once (both pairs share the cluster, so one file serves both).
    std::fs::write(
        on.dirs[0].join("shared"),
        vec![0u8; (max * REGION) as usize],
    )
    .expect("lay out");
    let mut rows = Vec::new();
    for &w in &cfg.writers {
        let mut row = Row {
            writers: w,
            on: Vec::new(),
            each: Vec::new(),
            off: Vec::new(),
        };
        for r in 0..cfg.runs {
            // Rotate which configuration goes first.
            for k in 0..3 {
                match (r + k) % 3 {
                    0 => row.on.push(disjoint(&on, w, cfg.runtime_s)),
                    1 => row.each.push(disjoint(&each, w, cfg.runtime_s)),
                    _ => row.off.push(disjoint(&off, w, cfg.runtime_s)),
                }
            }
        }
        eprintln!("{}", format_row(&row));
        rows.push(row);
    }
    let base = rows.first().map(|r| median(&r.on)).unwrap_or(1.0);
    let mut notes: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{} writer(s): with locks {} IOPS = {:.0}% of without (a lock per write: {:.0}%); {:.2}x one writer with locks",
                r.writers,
                rate(median(&r.on)),
                100.0 * median(&r.on) / median(&r.off),
                100.0 * median(&r.each) / median(&r.off),
                median(&r.on) / base
            )
        })
        .collect();
    for (name, pair) in [("locks=on", &on), ("locks=off", &off)] {
        let (mixed, units) = overlap(pair, cfg.runtime_s);
        notes.push(format!(
            "overlapping writers (2 mounts, 16 KiB at 4 KiB-aligned offsets, {}s), {name}: {mixed} of {units} 4 KiB units mixed from two writers",
            cfg.runtime_s
        ));
    }
    (rows, notes)
}

pub fn table_header() -> String {
    "| writers (2 mounts) | locks=on IOPS (median, min–max) | keep_locks=off IOPS | locks=off IOPS | on / off | keep_locks=off / off |\n|---:|---:|---:|---:|---:|---:|".into()
}

pub fn format_row(r: &Row) -> String {
    let span = |v: &[f64]| {
        let lo = v.iter().cloned().fold(f64::MAX, f64::min);
        let hi = v.iter().cloned().fold(0.0, f64::max);
        format!("{} ({}–{})", rate(median(v)), rate(lo), rate(hi))
    };
    format!(
        "| {} | {} | {} | {} | {:.0}% | {:.0}% |",
        r.writers,
        span(&r.on),
        span(&r.each),
        span(&r.off),
        100.0 * median(&r.on) / median(&r.off),
        100.0 * median(&r.each) / median(&r.off)
    )
}
