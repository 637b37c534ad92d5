//! QoS through real mounts under fio (needs root and fio): three mounts of one memory node
//! running 4 KiB random reads at once, with different reservations and a limit, against the
//! same three mounts without QoS; and QoS's own cost, one mount with `qos=on` (no reservation,
//! no limit) against one with `qos=off`, alternating.
//!
//! The node's capacity is measured first, in the same run: the three mounts with `qos=off`
//! reading at once; the QoS cluster is then started with that figure as `--qos-capacity`.

use rackfs_tests::{TempDir, TestCluster};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::mounts::{fio_iops, mount_all, Mounts};
use crate::stats::median;

fn fio(dir: &Path, runtime: u32) -> Child {
    Command::new("fio")
        .args([
            "--name=q",
            &format!("--directory={}", dir.display()),
            "--rw=randread",
            "--bs=4k",
            "--size=16M",
            "--ioengine=psync",
            "--direct=1",
            "--time_based",
            &format!("--runtime={runtime}"),
            "--ramp_time=1",
            "--output-format=json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run fio (apt-get install fio)")
}

fn iops(c: Child) -> f64 {
    fio_iops(c, "read")
}

/// IOPS of each mount, all reading at once.
fn together(m: &Mounts, runtime: u32) -> Vec<f64> {
    let running: Vec<Child> = m.dirs.iter().map(|d| fio(d, runtime)).collect();
    running.into_iter().map(iops).collect()
}

pub fn run(runtime: u32, runs: usize) -> String {
    let tmp = TempDir::new("bench-qos");
    // 1. Capacity: three unaccounted mounts at once, and one alone (the local constraint).
    let (capacity, alone) = {
        let c = TestCluster::start(1, "512M");
        let m = mount_all(&c, &tmp, "measure", &["qos=off"; 3]);
        let all: f64 = together(&m, runtime).iter().sum();
        let one = iops(fio(&m.dirs[0], runtime));
        (all, one)
    };
    let cap = capacity as u64;
    // M1 reserves the most one mount can surely do (80% of its rate alone, at most 45% of the
    // node), M2 a quarter of the node, M3 nothing but is limited to a tenth.
    let r1 = (cap * 45 / 100).min(alone as u64 * 8 / 10);
    let (r2, l3) = (cap * 25 / 100, cap / 10);
    let c = TestCluster::start_with(
        1,
        "512M",
        &[
            "--qos-capacity",
            &cap.to_string(),
            "--qos-client-capacity",
            &(alone as u64).to_string(),
        ],
    );
    let with = mount_all(
        &c,
        &tmp,
        "qos",
        &[
            &format!("reservation={r1}"),
            &format!("reservation={r2}"),
            &format!("limit={l3}"),
        ],
    );
    let without = mount_all(&c, &tmp, "bare", &["qos=off"; 3]);
    let mut q: Vec<Vec<f64>> = vec![Vec::new(); 3];
    let mut b: Vec<Vec<f64>> = vec![Vec::new(); 3];
    for r in 0..runs {
        let order: [&Mounts; 2] = if r % 2 == 0 {
            [&with, &without]
        } else {
            [&without, &with]
        };
        for m in order {
            let res = together(m, runtime);
            let dst = if std::ptr::eq(m, &with) {
                &mut q
            } else {
                &mut b
            };
            for (i, x) in res.into_iter().enumerate() {
                dst[i].push(x);
            }
        }
    }
    drop(with);
    drop(without);
    let mut md = format!(
        "Capacity measured in this run: {cap} IOPS for three mounts at once, {} for one alone \
         (4 KiB random reads, fio psync direct, 1 job per mount, shm, one memory node).\n\n\
         | mount | reservation | limit | with QoS: IOPS (median of {runs}) | without QoS |\n|---|---:|---:|---:|---:|\n",
        alone as u64
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
    // 2. QoS's own cost: qos=on with nothing reserved vs qos=off, one mount each, alternating.
    let pair = mount_all(&c, &tmp, "cost", &["qos=on", "qos=off"]);
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for r in 0..runs.max(3) {
        for first in [r % 2 == 0, r % 2 == 1] {
            if first {
                on.push(iops(fio(&pair.dirs[0], runtime)));
            } else {
                off.push(iops(fio(&pair.dirs[1], runtime)));
            }
        }
    }
    md.push_str(&format!(
        "\nQoS's own cost, one mount alone (median of {}): qos=on, no reservation or limit: {:.0} \
         IOPS; qos=off: {:.0} IOPS; on/off = {:.1}%.\n",
        on.len(),
        median(&on),
        median(&off),
        100.0 * median(&on) / median(&off)
    ));
    md
}
