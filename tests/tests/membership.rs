//! Membership on a real etcd (`--etcd`; Debian's `etcd-server`, started on loopback): nodes
//! register under leases whose ids are their epochs, the primary is elected through a key, a
//! node whose lease lapsed is dropped and comes back only under a new epoch, and a second
//! primary never acts beside the first.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::fs;
use std::time::{Duration, Instant};

use rackfs_coord::{Coordinator, Etcd};
use rackfs_tests::{wait_for, Mount, TestCluster};

fn etcd(c: &TestCluster) -> Etcd {
    Etcd::new(&c.etcd_endpoints(), "test", Duration::from_secs(2)).unwrap()
}

/// The epochs etcd holds for the cluster's data nodes, by node id.
fn epochs(c: &TestCluster) -> Vec<(u32, i64)> {
    etcd(c)
        .list("nodes/")
        .unwrap()
        .into_iter()
        .map(|(k, v)| {
            let v: serde_json::Value = serde_json::from_slice(&v).unwrap();
            (k[6..].parse().unwrap(), v["epoch"].as_i64().unwrap())
        })
        .collect()
}

fn epoch_of(c: &TestCluster, id: u32) -> Option<i64> {
    epochs(c)
        .into_iter()
        .find(|(n, _)| *n == id)
        .map(|(_, e)| e)
}

/// The cluster map lives in etcd; a killed data node's key goes with its lease, it is dropped
/// from the replicas (files stay readable), and started again it registers under a new epoch
/// and takes new data.
#[test]
fn on_etcd_a_killed_node_is_dropped_with_its_lease_and_returns_under_a_new_epoch() {
    let mut c = TestCluster::on_etcd(3, "64M", &["--node-lease-ms", "2000"]);
    let map = etcd(&c);
    let primary: serde_json::Value =
        serde_json::from_slice(&map.get("primary").unwrap().expect("a primary key")).unwrap();
    assert_eq!(primary["name"], "mn0");
    assert!(
        wait_for(Duration::from_secs(5), || epochs(&c).len() == 2),
        "{:?}",
        epochs(&c)
    );
    let old = epoch_of(&c, 2).unwrap();
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K");
    for i in 0..6 {
        fs::write(m.path(&format!("f{i}")), vec![i as u8; 256 << 10]).unwrap();
    }
    c.kill(2);
    let t0 = Instant::now();
    assert!(
        wait_for(Duration::from_secs(10), || epoch_of(&c, 2).is_none()),
        "node 2's key outlives its lease"
    );
    let primary_log = || c.nodes[0].as_ref().unwrap().stderr();
    assert!(
        wait_for(Duration::from_secs(5), || primary_log()
            .contains("memory node out of the cluster")),
        "{}",
        primary_log()
    );
    eprintln!("node 2 dropped {:?} after kill -9", t0.elapsed());
    for i in 0..6 {
        assert_eq!(
            fs::read(m.path(&format!("f{i}"))).unwrap(),
            vec![i as u8; 256 << 10]
        );
    }
    c.restart(2);
    assert!(
        wait_for(Duration::from_secs(10), || epoch_of(&c, 2)
            .is_some_and(|e| e != old)),
        "node 2 registers under a new epoch: {:?}",
        epochs(&c)
    );
    let used = |i: usize| c.control(i).stats().unwrap().used;
    let before = used(2);
    for i in 0..12 {
        fs::write(m.path(&format!("n{i}")), vec![9u8; 64 << 10]).unwrap_or_else(|e| {
            panic!(
                "{e}: {}\n{}\n{}",
                m.log_text(),
                c.nodes[0].as_ref().unwrap().stderr(),
                c.nodes[2].as_ref().unwrap().stderr()
            )
        });
    }
    assert!(used(2) > before, "the returned node takes new data");
}

/// A data node stopped past its lease is fenced: etcd drops its key, the primary drops its
/// replicas; resumed, it finds its lease gone, registers under a new epoch and is admitted
/// only after its stale replicas are freed. Nothing stale is read.
#[test]
fn on_etcd_a_stopped_node_is_fenced_by_its_epoch() {
    let c = TestCluster::on_etcd(3, "64M", &["--node-lease-ms", "2000"]);
    assert!(wait_for(Duration::from_secs(5), || epochs(&c).len() == 2));
    let old = epoch_of(&c, 1).unwrap();
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K,transport=tcp,timeout=1");
    const LEN: usize = 12 << 16;
    fs::write(m.path("f"), vec![b'A'; LEN]).unwrap();
    let pid = c.nodes[1].as_ref().unwrap().child.id() as i32;
    rackfs_tests::stop_process(pid);
    assert!(
        wait_for(Duration::from_secs(10), || epoch_of(&c, 1).is_none()),
        "the stopped node's lease lapses"
    );
    let log = |i: usize| c.nodes[i].as_ref().unwrap().stderr();
    assert!(
        wait_for(Duration::from_secs(5), || log(0)
            .contains("memory node out of the cluster")),
        "{}",
        log(0)
    );
    // Truncates and rewrites: the stopped node's extents are freed when it is admitted again.
    fs::write(m.path("f"), vec![b'B'; LEN]).unwrap();
    // SAFETY: SIGCONT to a memory node process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert!(
        wait_for(Duration::from_secs(10), || log(0)
            .contains("memory node back under a new epoch")),
        "{}",
        log(0)
    );
    assert!(log(1).contains("lease lapsed"), "{}", log(1));
    let new = epoch_of(&c, 1).unwrap();
    assert_ne!(new, old, "a new epoch");
    assert_eq!(fs::read(m.path("f")).unwrap(), vec![b'B'; LEN]);
    let fresh = Mount::new(&c, "attr_timeout=0,transport=tcp");
    assert_eq!(fs::read(fresh.path("f")).unwrap(), vec![b'B'; LEN]);
}

/// One primary per cluster: a second `--primary` of a cluster that has one does not take it:
/// it joins as a data node (so a primary restarted after its standby took over comes back with
/// the same command line); after a kill -9 of the primary of a cluster without a standby, it is
/// elected again once its old lease lapsed.
#[test]
fn on_etcd_one_primary_acts_at_a_time() {
    let mut c = TestCluster::on_etcd(1, "32M", &["--node-lease-ms", "2000"]);
    let mut second = std::process::Command::new(rackfs_tests::bin_path("rackfs-memnode"))
        .args([
            "--primary",
            "--listen",
            "127.0.0.1:0",
            "--region",
            "16M",
            "--node-id",
            "7",
        ])
        .args([
            "--etcd",
            &c.etcd_endpoints(),
            "--cluster",
            "test",
            "--node-lease-ms",
            "2000",
        ])
        .arg("--secret-file")
        .arg(&c.secret_file)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    let out = second.stdout.take().unwrap();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut ready).unwrap();
    let _ = second.kill();
    let second = second.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(ready.contains("ready: node=7"), "{ready}\n{err}");
    assert!(
        err.contains("joining it as a data node") && err.contains("node 0"),
        "{err}"
    );
    assert!(err.contains("joined the primary"), "{err}");
    assert!(!err.contains("elected primary of the cluster"), "{err}");
    c.kill(0);
    let t0 = Instant::now();
    c.restart(0);
    let took = t0.elapsed();
    let log = c.nodes[0].as_ref().unwrap().stderr();
    assert!(log.contains("elected primary"), "{log}");
    assert!(log.contains("waiting for its lease to lapse"), "{log}");
    eprintln!("a restarted primary was elected after {took:?}");
}

/// etcd stopped for less than a lease changes nothing; stopped for longer, the nodes and the
/// primary stop serving (nothing acts on a lapsed lease) and the cluster serves again on its
/// own once it is back (the primary re-elected, or its standby elected instead), with every
/// byte intact.
#[test]
fn on_etcd_the_cluster_rides_out_an_etcd_pause() {
    let c = TestCluster::on_etcd(2, "32M", &["--node-lease-ms", "2000"]);
    assert!(wait_for(Duration::from_secs(5), || epochs(&c).len() == 1));
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K");
    fs::write(m.path("f"), vec![5u8; 1 << 20]).unwrap();
    let etcd_pid = c.etcd.as_ref().unwrap().pid(0) as i32;
    let pause = |d: Duration| {
        rackfs_tests::stop_process(etcd_pid);
        std::thread::sleep(d);
        // SAFETY: SIGCONT to the etcd this test started.
        assert_eq!(unsafe { libc::kill(etcd_pid, libc::SIGCONT) }, 0);
    };
    let e1 = epoch_of(&c, 1).unwrap();
    pause(Duration::from_millis(500));
    assert_eq!(fs::read(m.path("f")).unwrap(), vec![5u8; 1 << 20]);
    assert_eq!(epoch_of(&c, 1), Some(e1), "a short pause ends no lease");
    pause(Duration::from_secs(5));
    let log = |i: usize| c.nodes[i].as_ref().unwrap().stderr();
    // Once etcd is back, whoever is elected first serves: the primary again (its data node
    // then registers under a new epoch), or its standby, whose mirror holds every change the
    // primary answered (the old primary then exits: deposed, it acts on nothing).
    let again = || log(0).contains("elected primary again");
    let took_over = || log(1).contains("took over as primary");
    assert!(
        wait_for(Duration::from_secs(15), || again() || took_over()),
        "{}",
        log(0)
    );
    if again() {
        assert!(
            wait_for(Duration::from_secs(15), || epoch_of(&c, 1)
                .is_some_and(|e| e != e1)),
            "{:?}",
            epochs(&c)
        );
    } else {
        let primary: serde_json::Value =
            serde_json::from_slice(&etcd(&c).get("primary").unwrap().unwrap()).unwrap();
        assert_eq!(primary["node_id"], 1, "{primary}");
    }
    assert!(
        wait_for(Duration::from_secs(20), || fs::read(m.path("f"))
            .is_ok_and(|d| d == vec![5u8; 1 << 20])),
        "the file reads back once the cluster serves again:\nmount:\n{}\nmn0:\n{}\nmn1:\n{}",
        m.log_text(),
        log(0),
        log(1)
    );
    // New files too, once the mount follows whoever serves (a namespace change may meet the
    // moment the old primary exits).
    assert!(
        wait_for(Duration::from_secs(20), || fs::write(m.path("g"), b"after")
            .is_ok()),
        "no new file after the pause:\nmount:\n{}\nmn0:\n{}\nmn1:\n{}",
        m.log_text(),
        log(0),
        log(1)
    );
    assert_eq!(fs::read(m.path("g")).unwrap(), b"after");
}

/// A primary stopped past its lease on etcd serves nothing once it resumes (its lease lapsed
/// at etcd, and its own clock says so too), campaigns again, and, nobody else having taken
/// the key, serves again: the files are intact and writable. (No standby here: one would take
/// the key, see `failover.rs`.)
#[test]
fn on_etcd_a_stopped_primary_resumes_only_after_it_is_elected_again() {
    let c = TestCluster::on_etcd(2, "32M", &["--node-lease-ms", "2000", "--no-standby"]);
    assert!(wait_for(Duration::from_secs(5), || epochs(&c).len() == 1));
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K");
    fs::write(m.path("f"), vec![3u8; 512 << 10]).unwrap();
    let first: serde_json::Value =
        serde_json::from_slice(&etcd(&c).get("primary").unwrap().unwrap()).unwrap();
    let pid = c.nodes[0].as_ref().unwrap().child.id() as i32;
    rackfs_tests::stop_process(pid);
    assert!(
        wait_for(Duration::from_secs(10), || etcd(&c)
            .get("primary")
            .unwrap()
            .is_none()),
        "the stopped primary's key lapses"
    );
    // SAFETY: SIGCONT to the memory node process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let log = || c.nodes[0].as_ref().unwrap().stderr();
    assert!(
        wait_for(Duration::from_secs(10), || log()
            .contains("elected primary again")),
        "{}",
        log()
    );
    assert!(log().contains("this primary's lease lapsed"), "{}", log());
    let again: serde_json::Value =
        serde_json::from_slice(&etcd(&c).get("primary").unwrap().unwrap()).unwrap();
    assert_eq!(again["name"], first["name"]);
    assert!(
        wait_for(Duration::from_secs(20), || fs::read(m.path("f"))
            .is_ok_and(|d| d == vec![3u8; 512 << 10])),
        "the file reads back once the primary serves again"
    );
    fs::write(m.path("g"), b"after").unwrap();
    assert_eq!(fs::read(m.path("g")).unwrap(), b"after");
}

/// Whether the etcd member at `endpoint` is its cluster's leader (`/v3/maintenance/status`).
fn is_leader(endpoint: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(endpoint) else {
        return false;
    };
    let body = "{}";
    let req = format!(
        "POST /v3/maintenance/status HTTP/1.1\r\nHost: {endpoint}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut out = String::new();
    if s.write_all(req.as_bytes()).is_err() || s.read_to_string(&mut out).is_err() {
        return false;
    }
    let Some((_, json)) = out.split_once("\r\n\r\n") else {
        return false;
    };
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
    v["leader"].is_string() && v["leader"] == v["header"]["member_id"]
}

/// On a three-member etcd, losing a member (its leader, or else the endpoint every client
/// tries first) loses nothing: clients go on with the others, etcd elects a new leader and
/// keeps the leases, and no node is dropped.
#[test]
fn on_a_three_member_etcd_the_death_of_a_member_changes_nothing() {
    let mut c = TestCluster::on_etcd_members(3, 2, "32M", &["--node-lease-ms", "2000"]);
    assert!(wait_for(Duration::from_secs(5), || epochs(&c).len() == 1));
    let before = epochs(&c);
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K");
    fs::write(m.path("f"), vec![4u8; 256 << 10]).unwrap();
    let endpoints = c.etcd_endpoints();
    let leader = endpoints.split(',').position(is_leader).unwrap_or(0);
    eprintln!(
        "killing etcd member {leader} (leader: {})",
        is_leader(endpoints.split(',').nth(leader).unwrap())
    );
    c.etcd.as_mut().unwrap().kill(leader);
    for i in 0..30 {
        fs::write(m.path(&format!("g{i}")), vec![i as u8; 64 << 10]).unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(fs::read(m.path("f")).unwrap(), vec![4u8; 256 << 10]);
    for i in 0..30 {
        assert_eq!(
            fs::read(m.path(&format!("g{i}"))).unwrap(),
            vec![i as u8; 64 << 10]
        );
    }
    assert_eq!(epochs(&c), before, "no lease lapsed");
    let log = c.nodes[0].as_ref().unwrap().stderr();
    assert!(!log.contains("memory node out of the cluster"), "{log}");
    assert!(!log.contains("lease lapsed"), "{log}");
}

/// The sessions whose mount lock lease etcd holds.
fn mount_leases(c: &TestCluster) -> Vec<u64> {
    etcd(c)
        .list("mounts/")
        .unwrap()
        .into_iter()
        .map(|(k, _)| k.rsplit('/').next().unwrap().parse().unwrap())
        .collect()
}

/// A mount's lock lease lives in etcd (`mounts/<session>`): the mount is out, and fenced, as
/// soon as etcd no longer has it (here deleted, as if it lapsed there); the mount then carries
/// on under a new session with a new lease, and a stopped mount's lease lapses in etcd.
#[test]
fn on_etcd_a_mounts_lock_lease_lives_in_etcd_and_its_loss_fences_the_mount() {
    let c = TestCluster::on_etcd(2, "32M", &["--lock-lease-ms", "2000"]);
    let m = Mount::new(&c, "transport=tcp");
    fs::write(m.path("a"), b"first").unwrap(); // takes a lock slot, so a lease
    let held = mount_leases(&c);
    assert_eq!(held.len(), 1, "one mount, one lease in etcd: {held:?}");
    let status = std::process::Command::new(rackfs_tests::bin_path("rackfs"))
        .args(["status", "--cluster", &c.addr(), "--secret-file"])
        .arg(&c.secret_file)
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains(&format!("mounts holding a lock lease: 1 [{}]", held[0])),
        "{status}"
    );

    // etcd loses the lease: the primary fences the mount within an eighth of a lease or so.
    etcd(&c).delete(&format!("mounts/{}", held[0])).unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || m.log_text().contains("fenced")),
        "the mount was not fenced: {}",
        m.log_text()
    );
    // It carries on under a new session, with a new lease in etcd.
    let again = wait_for(Duration::from_secs(10), || {
        fs::write(m.path("b"), b"second").is_ok()
    });
    assert!(again, "the mount did not recover: {}", m.log_text());
    assert_eq!(fs::read(m.path("a")).unwrap(), b"first");
    let now = mount_leases(&c);
    assert!(
        now.len() == 1 && now[0] != held[0],
        "a new session's lease: {now:?}"
    );

    // A stopped mount renews nothing: its lease lapses in etcd.
    let pid = m.child.id() as i32;
    rackfs_tests::stop_process(pid);
    let t0 = Instant::now();
    let lapsed = wait_for(Duration::from_secs(10), || mount_leases(&c).is_empty());
    // SAFETY: signalling the mount process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert!(lapsed, "a stopped mount's lease outlived it in etcd");
    eprintln!(
        "a stopped mount's lease left etcd {:?} after the stop",
        t0.elapsed()
    );
}

/// A data node carries out a primary's requests (alloc, free, fence, ...) only on a connection
/// that declared the newest primary's epoch it has seen: an undeclared connection and one of
/// an earlier epoch (a deposed primary's) are refused by name; the primary's own connection
/// keeps working.
#[test]
fn on_etcd_a_data_node_obeys_only_the_newest_primarys_epoch() {
    use rackfs_proto::control::{ControlRequest, ErrorCode};
    use rackfs_proto::RpcError;
    let c = TestCluster::on_etcd(2, "32M", &["--node-lease-ms", "2000"]);
    assert!(wait_for(Duration::from_secs(5), || epochs(&c).len() == 1));
    let (epoch, _) = etcd(&c).created("primary").unwrap().unwrap();
    let refusal = |ctl: &rackfs_proto::ControlClient| match ctl.alloc(4096, 4096) {
        Err(RpcError::Refused { code, message }) => (code, message),
        other => panic!("a primary's request was carried out: {other:?}"),
    };
    let undeclared = c.control(1);
    let (code, why) = refusal(&undeclared);
    assert_eq!(code, ErrorCode::NotPrimary);
    assert!(why.contains("declared its epoch"), "{why}");
    let deposed = c.control(1);
    let declared = deposed.call(&ControlRequest::Primary {
        node: 0,
        epoch: epoch - 1,
    });
    assert!(
        matches!(&declared, Err(RpcError::Refused { message, .. }) if message.contains("deposed")),
        "{declared:?}"
    );
    let (_, why) = refusal(&deposed);
    assert!(why.contains("declared its epoch"), "{why}");
    // The primary's own connection still works: a file is written and read back through it.
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K");
    fs::write(m.path("f"), vec![9u8; 300_000]).unwrap();
    assert_eq!(fs::read(m.path("f")).unwrap(), vec![9u8; 300_000]);
}
