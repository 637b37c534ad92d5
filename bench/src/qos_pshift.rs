//! pShift through real mounts (needs root and fio): a mount with a reservation whose demand
//! moves from one memory node to the other halfway through, next to two backlogged mounts
//! without reservations reading on both nodes. With pShift the primary moves the mount's
//! reservation to the node it works on within a period or two; with an even split
//! (`--qos-even-split`) half of it stays on the idle node and the mount misses it.
//!
//! Scaling: two memory nodes on this host over shm, each with a QoS capacity of a tenth of
//! what the three mounts read at once (so tokens, not the CPU, are what is scarce); the
//! reserving mount reserves 80% of one node. Files are one stripe (1 MiB) long, so each
//! lives on one node: stripes go round-robin from the file's inode number, and the two files
//! the mount reads are created one after the other.

use std::path::Path;
use std::time::{Duration, Instant};

use rackfs_proto::control::{ControlRequest, ControlResponse};
use rackfs_tests::{TempDir, TestCluster};

use rackfs_tests::fio::{Fio, FioRun};

use crate::mounts::{mount_all, randread};
use crate::plot;

/// fio 4 KiB random reads of `file` (or of an 8 MiB file of its own, named after the job),
/// one psync job. (All mounts of a cluster see the same files.)
fn fio(dir: &Path, name: &str, file: Option<&str>, runtime: u32) -> Fio {
    let f = randread(dir, name, runtime);
    match file {
        Some(file) => f.opt("filename", file).opt("size", "1M"),
        None => f.opt("size", "8M"),
    }
}

/// One second: the reserving mount's IOPS (fio's log), and its reservation share on each
/// node in that node's last finished period.
#[derive(Default, Clone, Copy, Debug)]
struct Sample {
    iops: u64,
    share: [u64; 2],
}

/// fio's per-second IOPS log (`--write_iops_log=PREFIX --log_avg_msec=1000`).
fn iops_log(prefix: &Path) -> Vec<u64> {
    let path = format!("{}_iops.1.log", prefix.display());
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    text.lines()
        .filter_map(|l| l.split(',').nth(1)?.trim().parse().ok())
        .collect()
}

/// One run: per second, what the reserving mount did and was given on each node.
fn one(
    tmp: &TempDir,
    tag: &str,
    capacity: u64,
    reservation: u64,
    phase: u32,
    even: bool,
) -> Vec<Sample> {
    let cap = capacity.to_string();
    let mut flags = vec!["--qos-capacity", &cap, "--qos-client-capacity", &cap];
    if even {
        flags.push("--qos-even-split");
    }
    let c = TestCluster::start_with(2, "256M", &flags);
    let m = mount_all(
        &c,
        &[&format!("reservation={reservation}"), "qos=on", "qos=on"],
    );
    // Two one-stripe files created back to back: consecutive inodes, different nodes.
    for f in ["a", "b"] {
        std::fs::write(m.dirs[0].join(f), vec![7u8; 1 << 20]).expect("write test file");
    }
    let control = c.control(0);
    let status = || match control.call(&ControlRequest::QosStatus) {
        Ok(ControlResponse::QosStatus(s)) => s,
        other => panic!("QoS status: {other:?}"),
    };
    let slot = status()
        .mounts
        .iter()
        .find(|q| q.reservation == reservation)
        .expect("the reserving mount is admitted")
        .slot;
    let others: Vec<FioRun> = m.dirs[1..]
        .iter()
        .enumerate()
        .map(|(i, d)| fio(d, &format!("m{}", i + 2), None, phase * 2 + 2).spawn())
        .collect();
    // Once a second, while the reserving mount reads a, then b: each node's last finished
    // period (the nodes' periods are not aligned, so each sample is every node's last second).
    let last = || -> Sample {
        let mut s = Sample::default();
        for n in status().nodes {
            let i = (n.node_id as usize).min(1);
            if let Some(x) = n
                .periods
                .last()
                .and_then(|p| p.mounts.iter().find(|x| x.0 == slot))
            {
                // 1 s periods: tokens per period are IOPS.
                s.share[i] = x.1;
            }
        }
        s
    };
    std::thread::sleep(Duration::from_secs(1));
    let mut out = Vec::new();
    let start = Instant::now();
    for (k, f) in ["a", "b"].into_iter().enumerate() {
        let log = tmp.path().join(format!("{tag}-{f}"));
        let run = fio(&m.dirs[0], "m1", Some(f), phase)
            .opt("write_iops_log", log.display())
            .opt("log_avg_msec", 1000)
            .spawn();
        let mut shares = Vec::new();
        for t in 1..=phase {
            let at = start + Duration::from_secs((k as u32 * phase + t) as u64);
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            shares.push(last());
        }
        run.wait();
        for (mut s, iops) in shares.into_iter().zip(iops_log(&log)) {
            s.iops = iops;
            out.push(s);
        }
    }
    for o in others {
        o.wait();
    }
    out
}

pub fn run(phase: u32, plots: Option<&Path>) -> String {
    let tmp = TempDir::new("bench-pshift");
    let capacity = 8000;
    let reservation = capacity * 8 / 10;
    let with = one(&tmp, "ps", capacity, reservation, phase, false);
    let even = one(&tmp, "ev", capacity, reservation, phase, true);
    let total = |s: &Sample| s.iops;
    // Seconds in which the mount met its reservation (within 5%), and its median rate. Each
    // phase starts with a period or two of the old placement: the controller places by the
    // last finished period, once a period.
    let steady = |v: &[Sample]| -> (usize, usize, u64) {
        let met = v
            .iter()
            .filter(|s| total(s) * 100 >= reservation * 95)
            .count();
        let mut sorted: Vec<u64> = v.iter().map(total).collect();
        sorted.sort_unstable();
        (
            v.len(),
            met,
            sorted.get(sorted.len() / 2).copied().unwrap_or(0),
        )
    };
    let (n_ps, met_ps, med_ps) = steady(&with);
    let (n_ev, met_ev, med_ev) = steady(&even);
    let mut md = format!(
        "Two memory nodes, QoS capacity {capacity} IOPS each (a fixed budget well below what \
         the CPU serves, so tokens are what is scarce). M1 reserves {reservation} IOPS and reads \
         a file on node 0 for {phase} s, then one on node 1 for {phase} s; M2 and M3 reserve \
         nothing and read on both nodes all along.\n\n\
         | placement | seconds | M1 met >= 95% of R | median M1 IOPS |\n|---|---:|---:|---:|\n\
         | pShift (by demand) | {n_ps} | {met_ps} | {med_ps} |\n\
         | even split | {n_ev} | {met_ev} | {med_ev} |\n\n\
         Per second: M1's IOPS (fio's log) with pShift and with an even split, and with pShift its \
         reservation share on each node in that node's last finished period:\n\n\
         | s | M1 IOPS, pShift | share n0 | share n1 | M1 IOPS, even split |\n\
         |---:|---:|---:|---:|---:|\n"
    );
    for (i, s) in with.iter().enumerate() {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            i + 1,
            s.iops,
            s.share[0],
            s.share[1],
            even.get(i).map_or(0, |e| e.iops)
        ));
    }
    if let Some(dir) = plots {
        let col = |v: &[Sample], f: &dyn Fn(&Sample) -> u64| -> Vec<f64> {
            v.iter().map(|s| f(s) as f64).collect()
        };
        let n = with.len().max(even.len());
        let svg = plot::lines(
            "pShift: M1's demand moves from node 0 to node 1",
            "IOPS",
            "seconds",
            &[
                ("M1 IOPS, pShift", col(&with, &total)),
                ("M1 IOPS, even split", col(&even, &total)),
                ("M1 reservation", vec![reservation as f64; n]),
                ("M1 share on node 0 (pShift)", col(&with, &|s| s.share[0])),
                ("M1 share on node 1 (pShift)", col(&with, &|s| s.share[1])),
            ],
        );
        let f = plot::save(dir, "qos-pshift", &svg);
        md.push_str(&format!("\n![pShift]({f})\n"));
    }
    md
}
