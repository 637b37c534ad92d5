//! QoS through real mounts under fio (needs root and fio): three mounts of one memory node
//! running 4 KiB random reads at once, with different reservations and a limit, against the
//! same three mounts without QoS; and QoS's own cost, one mount with `qos=on` (no reservation,
//! no limit) against one with `qos=off`, alternating.
//!
//! The node's capacity is measured first, in the same run: the three mounts with `qos=off`
//! reading at once; the QoS cluster is then started with that figure as `--qos-capacity`.

use rackfs_tests::TestCluster;
use std::path::Path;

use rackfs_tests::fio::FioRun;

use crate::mounts::{mount_all, randread, Mounts};
use crate::stats::median;

/// fio 4 KiB random reads, one psync job, on `dir`, in a file named after `name` (all mounts
/// of a cluster see the same files: two fio processes laying out one file at once would
/// unlink it under each other); pinned to `cpu` if given.
fn fio(dir: &Path, name: &str, runtime: u32, cpu: Option<usize>) -> FioRun {
    let f = randread(dir, name, runtime)
        .opt("size", "16M")
        .opt("ramp_time", 1);
    match cpu {
        Some(c) => f.opt("cpus_allowed", c),
        None => f,
    }
    .spawn()
}

fn iops(run: FioRun) -> f64 {
    run.wait().first().read.iops
}

/// IOPS of each mount, all reading at once.
fn together(m: &Mounts, runtime: u32) -> Vec<f64> {
    let running: Vec<FioRun> = m
        .dirs
        .iter()
        .enumerate()
        .map(|(i, d)| fio(d, &format!("q{i}"), runtime, None))
        .collect();
    running.into_iter().map(iops).collect()
}

/// Which parts to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// Reservations and a limit, with and without QoS.
    Reservations,
    /// Weights 1:2:3 sharing the spare capacity.
    Weights,
    /// QoS's own cost: qos=on (nothing reserved) against qos=off, alternating, pinned.
    Cost,
    /// Limits reached whole with two replicas, on two and three nodes.
    Limits,
}

pub fn run(runtime: u32, runs: usize, parts: &[Part]) -> String {
    let mut md = String::new();
    if parts.contains(&Part::Limits) {
        md.push_str(&limits(runtime, runs));
    }
    if parts.iter().all(|p| *p == Part::Limits) {
        return md;
    }
    // Capacity: three unaccounted mounts at once, and one alone (the local constraint).
    let (capacity, alone) = {
        let c = TestCluster::start(1, "512M");
        let m = mount_all(&c, &["qos=off"; 3]);
        let all: f64 = together(&m, runtime).iter().sum();
        let one = iops(fio(&m.dirs[0], "q0", runtime, None));
        (all as u64, one as u64)
    };
    md.push_str(&format!(
        "Capacity measured in this run: {capacity} IOPS for three mounts at once, {alone} for \
         one alone (4 KiB random reads, fio psync direct, 1 job per mount, shm, one memory \
         node).\n\n"
    ));
    if parts.contains(&Part::Reservations) {
        md.push_str(&reservations(capacity, alone, runtime, runs));
    }
    if parts.contains(&Part::Weights) {
        md.push_str(&weights(capacity, alone, runtime, runs));
    }
    if parts.contains(&Part::Cost) {
        md.push_str(&cost(runtime, runs));
    }
    md
}

/// One mount with `limit=L` reading 4 KiB at random (one psync job, far faster than L) on
/// clusters of two and three nodes with two replicas and ample capacity: what fio measured
/// against L. The limit is split over the nodes by demand; reads pass a node whose share is
/// spent, and engines lend each other room.
fn limits(runtime: u32, runs: usize) -> String {
    let mut md = format!(
        "## Limits with two replicas\n\n\
         | nodes | limit | fio IOPS (median of {runs}) | min-max | of the limit |\n\
         |---:|---:|---:|---:|---:|\n"
    );
    for nodes in [2, 3] {
        let c = TestCluster::start(nodes, "512M");
        for limit in [2000u32, 10000] {
            let m = rackfs_tests::Mount::new(&c, &format!("limit={limit}"));
            let got: Vec<f64> = (0..runs)
                .map(|_| iops(fio(&m.dir, "limited", runtime, None)))
                .collect();
            let (lo, hi) = got
                .iter()
                .fold((f64::MAX, 0f64), |(l, h), &x| (l.min(x), h.max(x)));
            let med = median(&got);
            md.push_str(&format!(
                "| {nodes} | {limit} | {med:.0} | {lo:.0}-{hi:.0} | {:.1}% |\n",
                100.0 * med / limit as f64
            ));
        }
    }
    // Reservations under contention: each node's QoS capacity set to 3000 IOPS, so a
    // mount reserving 2400 and one reserving nothing, both reading, share a pool that binds.
    let reserved = 2400u32;
    md.push_str(&format!(
        "\n## A reservation with two replicas, each node's QoS capacity 3000 IOPS\n\n\
         | nodes | reservation | its IOPS (median of {runs}) | of the reservation | the other mount's IOPS |\n\
         |---:|---:|---:|---:|---:|\n"
    ));
    for nodes in [2, 3] {
        let c = TestCluster::start_with(
            nodes,
            "512M",
            &["--qos-capacity", "3000", "--qos-client-capacity", "3000"],
        );
        let m = mount_all(&c, &[&format!("reservation={reserved}"), "qos=on"]);
        let got: Vec<Vec<f64>> = (0..runs).map(|_| together(&m, runtime)).collect();
        let a: Vec<f64> = got.iter().map(|g| g[0]).collect();
        let b: Vec<f64> = got.iter().map(|g| g[1]).collect();
        md.push_str(&format!(
            "| {nodes} | {reserved} | {:.0} | {:.1}% | {:.0} |\n",
            median(&a),
            100.0 * median(&a) / reserved as f64,
            median(&b)
        ));
    }
    md.push('\n');
    md
}

fn qos_cluster(capacity: u64, alone: u64) -> TestCluster {
    TestCluster::start_with(
        1,
        "512M",
        &[
            "--qos-capacity",
            &capacity.to_string(),
            "--qos-client-capacity",
            &alone.to_string(),
        ],
    )
}

/// Three mounts with different reservations and a limit, with and without QoS, alternating.
fn reservations(cap: u64, alone: u64, runtime: u32, runs: usize) -> String {
    // M1 reserves the most one mount can surely do (80% of its rate alone, at most 45% of the
    // node), M2 a quarter of the node (no more than M1: one mount's rate alone bounds every
    // reservation, and a noisy measurement can put a quarter of three mounts above it), M3
    // nothing but is limited to a tenth.
    let r1 = (cap * 45 / 100).min(alone * 8 / 10);
    let (r2, l3) = ((cap * 25 / 100).min(r1), cap / 10);
    let c = qos_cluster(cap, alone);
    let with = mount_all(
        &c,
        &[
            &format!("reservation={r1}"),
            &format!("reservation={r2}"),
            &format!("limit={l3}"),
        ],
    );
    let without = mount_all(&c, &["qos=off"; 3]);
    let (q, b) = alternate(&with, &without, runtime, runs);
    let mut md = format!(
        "## Reservations and a limit\n\n\
         | mount | reservation | limit | with QoS: IOPS (median of {runs}) | without QoS |\n\
         |---|---:|---:|---:|---:|\n"
    );
    let spec = [(r1, 0), (r2, 0), (0, l3)];
    for (i, (r, l)) in spec.iter().enumerate() {
        md.push_str(&format!(
            "| M{} | {} | {} | {:.0} | {:.0} |\n",
            i + 1,
            r,
            if *l == 0 {
                "-".to_string()
            } else {
                l.to_string()
            },
            median(&q[i]),
            median(&b[i])
        ));
    }
    md
}

/// Three backlogged mounts with weights 1, 2 and 3 and nothing reserved on a node whose QoS
/// capacity is set below what it can serve, so the pool is what limits them: each should get
/// its weight's share of it. The same mounts without weights get equal shares.
fn weights(cap: u64, alone: u64, runtime: u32, runs: usize) -> String {
    // A quarter of what the node serves, so the pool, not the CPU, is what holds the mounts
    // back (three fio processes and three FUSE daemons share two CPUs); the weight-3 mount's
    // half stays well under what one mount can do alone.
    let pool = (cap / 4).min(alone * 3 / 4);
    let c = qos_cluster(pool, alone);
    let weighted = mount_all(&c, &["weight=1", "weight=2", "weight=3"]);
    let equal = mount_all(&c, &["qos=on"; 3]);
    let (w, e) = alternate(&weighted, &equal, runtime, runs);
    let mw: Vec<f64> = w.iter().map(|x| median(x)).collect();
    let me: Vec<f64> = e.iter().map(|x| median(x)).collect();
    let (sw, se) = (mw.iter().sum::<f64>(), me.iter().sum::<f64>());
    let mut md = format!(
        "\n## Weights, nothing reserved, the node's QoS capacity set to {pool} IOPS\n\n\
         | mount | weight | IOPS (median of {runs}) | share | weight's share | without weights | share |\n\
         |---|---:|---:|---:|---:|---:|---:|\n"
    );
    for i in 0..3 {
        md.push_str(&format!(
            "| M{} | {} | {:.0} | {:.1}% | {:.1}% | {:.0} | {:.1}% |\n",
            i + 1,
            i + 1,
            mw[i],
            100.0 * mw[i] / sw,
            100.0 * (i + 1) as f64 / 6.0,
            me[i],
            100.0 * me[i] / se
        ));
    }
    md
}

/// Runs both sets of mounts `runs` times, alternating which goes first; IOPS per mount.
fn alternate(a: &Mounts, b: &Mounts, runtime: u32, runs: usize) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let mut ra: Vec<Vec<f64>> = vec![Vec::new(); a.dirs.len()];
    let mut rb: Vec<Vec<f64>> = vec![Vec::new(); b.dirs.len()];
    for r in 0..runs {
        for first in [r % 2 == 0, r % 2 == 1] {
            let (m, dst) = if first { (a, &mut ra) } else { (b, &mut rb) };
            for (i, x) in together(m, runtime).into_iter().enumerate() {
                dst[i].push(x);
            }
        }
    }
    (ra, rb)
}

/// QoS's own cost: one mount with qos=on and nothing reserved against one with qos=off,
/// alternating; fio and both mount daemons pinned to CPU 1 (caller and daemon share a CPU).
fn cost(runtime: u32, runs: usize) -> String {
    let c = qos_cluster(100_000_000, 100_000_000);
    let pair = mount_all(&c, &["qos=on", "qos=off"]);
    pair.pin(1);
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for r in 0..runs.max(3) {
        for first in [r % 2 == 0, r % 2 == 1] {
            if first {
                on.push(iops(fio(&pair.dirs[0], "on", runtime, Some(1))));
            } else {
                off.push(iops(fio(&pair.dirs[1], "off", runtime, Some(1))));
            }
        }
    }
    // Pairs run back to back: the ratio within a pair cancels the machine's slow drift.
    let mut ratios: Vec<f64> = on.iter().zip(&off).map(|(a, b)| a / b).collect();
    ratios.sort_by(|a, b| a.total_cmp(b));
    let q = |p: usize| ratios[(ratios.len() - 1) * p / 100];
    format!(
        "\n## QoS's own cost\n\nOne mount alone, fio and the mount daemon pinned to CPU 1, \
         {n} pairs of runs of {runtime} s (qos=on, no reservation or limit, then qos=off, the \
         order alternating): median of the pairwise on/off ratios **{:.1}%** (interquartile \
         range {:.1}-{:.1}%); medians {:.0} IOPS with QoS, {:.0} without.\n",
        100.0 * median(&ratios),
        100.0 * q(25),
        100.0 * q(75),
        median(&on),
        median(&off),
        n = on.len(),
    )
}
