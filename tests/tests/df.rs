//! `df` tells the truth: a mount reports the capacity and free space its files can fill (its
//! replica count's worth of the nodes' memory, in its stripes), and `rackfs status` shows the
//! raw and usable figures.

use std::ffi::CString;
use std::fs;
use std::mem::MaybeUninit;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rackfs_tests::{bin_path, wait_for, Mount, TestCluster};

const MIB: u64 = 1 << 20;

/// Each test node's region: 64 MiB, of which a sixteenth is the metadata area.
const REGION: &str = "64M";

/// (capacity, free, available) in bytes, as `statvfs(3)` reports them for `dir`.
fn df(dir: &Path) -> (u64, u64, u64) {
    let path = CString::new(dir.as_os_str().as_bytes()).expect("a path without NUL");
    let mut st = MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is a NUL-terminated string that outlives the call, and `st` points to
    // writable memory of the size of the `statvfs` struct the call fills.
    let rc = unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) };
    assert_eq!(
        rc,
        0,
        "statvfs {}: {}",
        dir.display(),
        std::io::Error::last_os_error()
    );
    // SAFETY: statvfs returned 0, so it filled the whole struct.
    let st = unsafe { st.assume_init() };
    let f = st.f_frsize;
    (st.f_blocks * f, st.f_bfree * f, st.f_bavail * f)
}

/// The nodes' raw memory for files: each region less its metadata area.
fn raw(c: &TestCluster, nodes: usize) -> u64 {
    (0..nodes)
        .map(|i| c.control(i).stats().unwrap().capacity)
        .sum()
}

#[test]
fn a_two_replica_mount_fills_to_what_df_reported_and_only_then_gets_enospc() {
    let c = TestCluster::start(2, REGION);
    // No replicas= option: the cluster's default, two.
    let m = Mount::new(&c, "attr_timeout=0");
    let raw = raw(&c, 2);
    assert_eq!(
        raw,
        2 * (60 * MIB),
        "two 64 MiB regions less their 4 MiB metadata areas"
    );
    let (blocks, bfree, avail) = df(&m.dir);
    assert!(
        avail <= bfree && bfree <= blocks,
        "{blocks} {bfree} {avail}"
    );
    // Half the raw space, less the QoS area and a 64-byte tag per 1 MiB stripe.
    assert!(
        avail <= raw / 2 && avail >= raw / 2 - 2 * MIB,
        "avail {avail} for raw {raw} with two replicas"
    );
    let data = vec![7u8; MIB as usize];
    let mut written = 0u64;
    let mut files = 0;
    let err = loop {
        assert!(
            written < raw,
            "{written} bytes written with two replicas on {raw} bytes"
        );
        match fs::write(m.path(&format!("f{files}")), &data) {
            Ok(()) => {
                written += MIB;
                files += 1;
            }
            Err(e) => break e,
        }
    };
    assert_eq!(
        err.raw_os_error(),
        Some(libc::ENOSPC),
        "the first failure after {written} bytes: {err}"
    );
    eprintln!(
        "df: blocks {blocks}, avail {avail}; written before ENOSPC {written} ({:.1}% of avail)",
        written as f64 * 100.0 / avail as f64
    );
    let off = written.abs_diff(avail) as f64 / avail as f64;
    assert!(
        off <= 0.05,
        "df said {avail} bytes available, {written} were written before ENOSPC"
    );
    let (_, _, left) = df(&m.dir);
    assert!(left < 2 * MIB, "a full mount shows {left} bytes available");
    assert_eq!(
        fs::read(m.path("f0")).unwrap(),
        data,
        "the first file is intact"
    );

    for i in 0..=files {
        let _ = fs::remove_file(m.path(&format!("f{i}")));
    }
    // Freed stripes sit in the nodes' quarantine (200 ms here) before reuse; an allocation
    // waits for them, so they count as available at once, and in any case within a few holds.
    let back = wait_for(Duration::from_secs(5), || df(&m.dir).2 >= avail);
    assert!(
        back,
        "after deleting everything avail is {} (was {avail})",
        df(&m.dir).2
    );
    fs::write(m.path("again"), &data).expect("space is writable again");
}

#[test]
fn a_one_replica_mount_reports_twice_as_much_and_status_shows_both() {
    let c = TestCluster::start(2, REGION);
    let two = Mount::new(&c, "attr_timeout=0,replicas=2");
    let one = Mount::new(&c, "attr_timeout=0,replicas=1");
    let raw = raw(&c, 2);
    let (blocks2, _, avail2) = df(&two.dir);
    let (blocks1, bfree1, avail1) = df(&one.dir);
    assert!(avail1 <= bfree1 && bfree1 <= blocks1);
    assert!(
        avail1 <= raw && avail1 >= raw - 4 * MIB,
        "{avail1} of {raw}"
    );
    // Twice, to a stripe per node (each node's count of whole stripes is rounded down once
    // for one replica, once for the pair).
    assert!(
        avail1.abs_diff(2 * avail2) <= 2 * MIB && blocks1.abs_diff(2 * blocks2) <= 2 * MIB,
        "one replica: {blocks1}/{avail1}, two: {blocks2}/{avail2}"
    );

    // `rackfs status` shows the raw sum and the usable figures with the replica count used.
    let out = Command::new(bin_path("rackfs"))
        .args(["status", "--cluster", &c.addr(), "--secret-file"])
        .arg(&c.secret_file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let size = rackfs_proto::size::format_size;
    let raw_line = text
        .lines()
        .find(|l| l.contains("space, raw"))
        .unwrap_or_else(|| panic!("no raw space line:\n{text}"));
    assert!(
        raw_line.contains("2 data nodes") && raw_line.contains(&size(raw)),
        "{raw_line}"
    );
    let usable = text
        .lines()
        .find(|l| l.contains("space, usable"))
        .unwrap_or_else(|| panic!("no usable space line:\n{text}"));
    eprintln!("{raw_line}\n{usable}");
    assert!(
        usable.contains("2 replicas, the cluster's default")
            && usable.contains(&format!("{} capacity", size(blocks2))),
        "{usable} (df on the two-replica mount: {blocks2})"
    );
}
