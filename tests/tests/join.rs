//! How a data node finds the primary (`--join A,B,...`, `--etcd`): real processes. A unit's
//! command line is fixed while the primary moves, so a node passes over addresses that are
//! dead or not the primary, finds the primary in etcd, and otherwise fails in bounded time
//! naming every address it tried.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::process::Command;
use std::time::{Duration, Instant};

use rackfs_coord::{Coordinator, Etcd};
use rackfs_tests::{bin_path, wait_for, TestCluster};

/// A loopback address nothing listens on (a port just given back).
fn dead_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

fn log(c: &TestCluster, i: usize) -> String {
    c.nodes[i].as_ref().map(|n| n.stderr()).unwrap_or_default()
}

fn etcd(c: &TestCluster) -> Etcd {
    Etcd::new(&c.etcd_endpoints(), "test", Duration::from_secs(2)).unwrap()
}

/// The node id and epoch etcd's `nodes/<id>` holds for node `id`.
fn registered(c: &TestCluster, id: u32) -> Option<i64> {
    let v = etcd(c).get(&format!("nodes/{id}")).ok()??;
    serde_json::from_slice::<serde_json::Value>(&v).ok()?["epoch"].as_i64()
}

/// The node id etcd's `key` (`primary`, `standby`) names.
fn named(c: &TestCluster, key: &str) -> Option<usize> {
    let v = etcd(c).get(key).ok()??;
    Some(serde_json::from_slice::<serde_json::Value>(&v).ok()?["node_id"].as_u64()? as usize)
}

/// Whether the primary (node `p`) lists node `id` as a live member.
fn member(c: &TestCluster, p: usize, id: u32) -> bool {
    c.control(p).cluster().is_ok_and(|info| {
        info.nodes.iter().any(|n| n.node_id == id) && !info.down.iter().any(|(d, _)| *d == id)
    })
}

/// `rackfs-memnode` with `args` (and a region, listener and the cluster's secret): its exit
/// status, stderr, and how long it ran.
fn run(c: &TestCluster, args: &[&str]) -> (std::process::ExitStatus, String, Duration) {
    let t0 = Instant::now();
    let out = Command::new(bin_path("rackfs-memnode"))
        .args([
            "--region",
            "16M",
            "--listen",
            "127.0.0.1:0",
            "--secret-file",
        ])
        .arg(&c.secret_file)
        .args(args)
        .output()
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
        t0.elapsed(),
    )
}

/// Without etcd: `--join DEAD,PRIMARY` passes over the dead address, joins the primary, and
/// renews its lease with the primary's embedded coordinator (not with the dead address).
#[test]
fn a_node_passes_over_a_dead_address_and_joins_the_primary() {
    let mut c = TestCluster::start(1, "32M");
    let dead = dead_addr();
    let join = format!("{dead},{}", c.addr());
    let i = c.add(&["--join", &join, "--node-id", "1", "--name", "mn1"]);
    let l = log(&c, i);
    assert!(
        l.contains("trying the next address") && l.contains(&dead),
        "{l}"
    );
    assert!(
        wait_for(Duration::from_secs(10), || member(&c, 0, 1)),
        "{}",
        log(&c, 0)
    );
    std::thread::sleep(Duration::from_secs(2));
    let l = log(&c, i);
    assert!(l.contains("admitted by the primary: serving data"), "{l}");
    assert!(!l.contains("cannot renew this node's lease"), "{l}");
}

/// On etcd: `--join DEAD,PRIMARY` joins the primary.
#[test]
fn on_etcd_a_node_with_a_dead_address_first_joins_the_primary() {
    let mut c = TestCluster::on_etcd(1, "32M", &["--node-lease-ms", "2000"]);
    let join = format!("{},{}", dead_addr(), c.addr());
    let ep = c.etcd_endpoints();
    c.add(&[
        "--join",
        &join,
        "--node-id",
        "1",
        "--name",
        "mn1",
        "--etcd",
        &ep,
        "--cluster",
        "test",
        "--node-lease-ms",
        "2000",
    ]);
    assert!(
        wait_for(Duration::from_secs(10), || member(&c, 0, 1)
            && registered(&c, 1).is_some()),
        "{}",
        log(&c, 0)
    );
}

/// On etcd, after kill -9 of the primary and its standby's take-over, a data node restarted
/// with its original command line (`--join` the dead primary's address) finds the new primary
/// in etcd and joins it. So does a node given no `--join` at all.
#[test]
fn on_etcd_a_node_restarted_with_the_old_primarys_address_finds_the_new_one() {
    let mut c = TestCluster::on_etcd(3, "32M", &["--node-lease-ms", "2000"]);
    assert!(
        wait_for(Duration::from_secs(10), || named(&c, "standby").is_some()),
        "no standby named:\n{}",
        log(&c, 0)
    );
    let standby = named(&c, "standby").unwrap();
    let other = 3 - standby;
    let old = c.addr();
    assert!(c.flags(other).contains(&old), "{:?}", c.flags(other));
    c.kill(0);
    assert!(
        wait_for(Duration::from_secs(15), || named(&c, "primary")
            == Some(standby)),
        "the standby was not elected:\n{}",
        log(&c, standby)
    );
    // The other node restarts (new process, empty memory) once its earlier lease lapsed.
    c.kill(other);
    assert!(
        wait_for(Duration::from_secs(10), || registered(&c, other as u32)
            .is_none()),
        "node {other}'s key outlives its lease"
    );
    let t0 = Instant::now();
    c.restart(other);
    eprintln!(
        "joined the new primary {:?} after its restart",
        t0.elapsed()
    );
    let l = log(&c, other);
    assert!(l.contains("joined the primary"), "{l}");
    assert!(
        wait_for(Duration::from_secs(10), || member(
            &c,
            standby,
            other as u32
        ) && registered(
            &c,
            other as u32
        )
        .is_some()),
        "{}\n{}",
        log(&c, standby),
        log(&c, other)
    );
    // A fourth node with no --join: etcd alone names the primary.
    let ep = c.etcd_endpoints();
    c.add(&[
        "--node-id",
        "3",
        "--name",
        "mn3",
        "--etcd",
        &ep,
        "--cluster",
        "test",
        "--node-lease-ms",
        "2000",
    ]);
    assert!(
        wait_for(Duration::from_secs(10), || member(&c, standby, 3)),
        "{}",
        log(&c, standby)
    );
}

/// Without etcd, `--join` with no primary among its addresses (dead ones, and a data node
/// that answers it is not the primary) fails within the node's patience (10 s), naming every
/// address with its answer.
#[test]
fn a_join_list_without_the_primary_fails_in_bounded_time_naming_every_address() {
    let c = TestCluster::start(2, "32M");
    let data = c.nodes[1].as_ref().unwrap().tcp.clone();
    let (a, b) = (dead_addr(), dead_addr());
    let join = format!("{a},{data},{b}");
    let (status, err, took) = run(&c, &["--join", &join, "--node-id", "5", "--name", "mn5"]);
    assert!(!status.success(), "{err}");
    assert!(took < Duration::from_secs(20), "took {took:?}: {err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains("no primary took this node in within"),
        "{err}"
    );
    for addr in [&a, &data, &b] {
        assert!(last.contains(addr.as_str()), "{addr} not named: {last}");
    }
    assert!(last.contains("node mn1 is not the primary"), "{last}");
    assert!(last.contains("Connection refused"), "{last}");
    eprintln!("gave up after {took:?}: {last}");
}

/// A refusal other than "not the primary" ends the search at once: the primary itself refuses
/// a node that takes its id.
#[test]
fn a_refusal_by_the_primary_ends_the_search_at_once() {
    let c = TestCluster::start(1, "32M");
    let join = format!("{},{}", dead_addr(), c.addr());
    let (status, err, took) = run(&c, &["--join", &join, "--node-id", "0", "--name", "other"]);
    assert!(!status.success(), "{err}");
    assert!(took < Duration::from_secs(5), "took {took:?}: {err}");
    assert!(
        err.contains(&format!("the primary at {} refused this node", c.addr()))
            && err.contains("node id 0 is the primary's own id"),
        "{err}"
    );
}

/// Bad `--join` values are refused before anything starts, each with what is wrong.
#[test]
fn bad_join_addresses_are_refused_by_name() {
    let c = TestCluster::start(1, "32M");
    for (join, says) in [
        ("", "an empty address"),
        ("10.0.0.5:7070,,10.0.0.6:7070", "an empty address"),
        ("10.0.0.5", "\"10.0.0.5\" has no port"),
        ("10.0.0.5:http", "\"http\" is not a port number"),
        ("10.0.0.5:70000", "\"70000\" is not a port number"),
        (":7070", "has no host"),
        ("unix:", "names no socket path"),
    ] {
        let (status, err, _) = run(&c, &["--join", join]);
        assert_eq!(status.code(), Some(2), "--join {join:?}: {err}");
        assert!(
            err.contains("--join") && err.contains(says),
            "--join {join:?}: {err}"
        );
    }
    let (status, err, _) = run(&c, &["--primary", "--join", &c.addr()]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("cannot be used with"), "{err}");
}
