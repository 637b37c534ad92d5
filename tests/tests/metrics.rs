//! A mount's own metrics (`-o metrics=ADDR`): Prometheus text with its filesystem operations
//! (count, latency, errors by errno), control RPCs by kind, verbs batches, range-lock and QoS
//! waits and QoS tokens; a bad address fails the mount with a clear error.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};

use rackfs_tests::{Mount, TestCluster};

/// A port nobody listens on now (the test mounts right after).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn scrape(port: u16) -> String {
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut page = String::new();
    c.read_to_string(&mut page).unwrap();
    assert!(page.starts_with("HTTP/1.0 200 OK"), "{page}");
    page
}

/// The value of the sample `name{labels}` (labels in the order the mount writes them).
fn sample(page: &str, name: &str, labels: &str) -> Option<u64> {
    let key = format!("{name}{{{labels}}} ");
    page.lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn a_mount_serves_its_operations_rpcs_and_waits_as_prometheus_text() {
    let c = TestCluster::start(2, "64M");
    let port = free_port();
    let m = Mount::new(&c, &format!("metrics=127.0.0.1:{port},stripe_unit=64K"));
    let mount = m.dir.display().to_string();
    for i in 0..5 {
        std::fs::write(m.path(&format!("f{i}")), vec![i as u8; 100_000]).unwrap();
        assert_eq!(
            std::fs::read(m.path(&format!("f{i}"))).unwrap().len(),
            100_000
        );
    }
    for i in 0..3 {
        let e = std::fs::metadata(m.path(&format!("missing{i}"))).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
    }
    let page = scrape(port);
    let op = |op: &str| {
        sample(
            &page,
            "rackfs_mount_op_seconds_count",
            &format!("mount=\"{mount}\",op=\"{op}\""),
        )
        .unwrap_or_else(|| panic!("no {op} count in:\n{page}"))
    };
    assert!(op("write") >= 5, "{page}");
    assert!(op("read") >= 5, "{page}");
    assert!(op("create") >= 5, "{page}");
    let enoent = sample(
        &page,
        "rackfs_mount_op_errors_total",
        &format!("mount=\"{mount}\",op=\"lookup\",errno=\"ENOENT\""),
    );
    assert!(enoent.is_some_and(|n| n >= 3), "{page}");
    let meta = sample(
        &page,
        "rackfs_mount_rpc_seconds_count",
        &format!("mount=\"{mount}\",kind=\"meta\""),
    );
    assert!(meta.is_some_and(|n| n >= 5), "{page}");
    for family in [
        "rackfs_mount_verbs_batch_seconds_count",
        "rackfs_mount_lock_wait_seconds_count",
        "rackfs_mount_qos_wait_seconds_count",
    ] {
        let n = sample(&page, family, &format!("mount=\"{mount}\""));
        assert!(n.is_some_and(|n| n >= 5), "{family}: {page}");
    }
    // Writes and reads of 100 KB spent tokens (one per 4 KiB), from the reservation or the pool.
    let tokens: u64 = page
        .lines()
        .filter(|l| l.starts_with("rackfs_mount_qos_tokens_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert!(tokens >= 5 * 2 * 25, "{tokens} tokens: {page}");
    assert!(
        page.contains("# TYPE rackfs_mount_op_seconds histogram"),
        "{page}"
    );
}

#[test]
fn a_metrics_address_that_cannot_be_served_fails_the_mount_clearly() {
    let c = TestCluster::start(1, "32M");
    let err = Mount::try_new(&c.addr(), &c.secret_file, "metrics=9101")
        .err()
        .expect("a port alone is not an address");
    assert!(
        err.contains("metrics") && err.contains("HOST:PORT"),
        "{err}"
    );
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let err = Mount::try_new(
        &c.addr(),
        &c.secret_file,
        &format!("metrics=127.0.0.1:{port}"),
    )
    .err()
    .expect("the port is taken");
    assert!(
        err.contains(&format!("cannot serve metrics on 127.0.0.1:{port}")),
        "{err}"
    );
}
