//! Replicated data (`replicas=`, default 2): a data node killed or stopped under load loses no
//! acknowledged byte and turns no file into EIO while another replica lives; a stopped node is
//! dropped once its lease lapsed, serves nothing stale when it resumes, and takes data again.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use rackfs_tests::{wait_for, Fio, Mount, TestCluster};

/// Three nodes with a 1 s node lease, so a dead node is dropped quickly.
fn cluster() -> TestCluster {
    TestCluster::start_with(3, "96M", &["--node-lease-ms", "1000"])
}

/// Bytes of node memory in use on node `i`.
fn used(c: &TestCluster, i: usize) -> u64 {
    c.control(i).stats().unwrap().used
}

/// kill -9 of a data node while two mounts (shm and tcp) run fio with crc32c verification:
/// both runs finish without an error or a mismatch, and every file reads back the same through
/// a fresh mount (fio's verify-only pass).
#[test]
fn a_killed_data_node_loses_no_byte_under_fio_verify_from_two_mounts() {
    let mut c = cluster();
    let a = Mount::new(&c, "stripe_unit=64K");
    let b = Mount::new(&c, "stripe_unit=64K,transport=tcp");
    fs::create_dir(a.path("a")).unwrap();
    fs::create_dir(a.path("b")).unwrap();
    let job = |m: &Mount, dir: &str| {
        Fio::verify(dir, &m.dir.join(dir), "randwrite", "6M")
            .opt("loops", 3)
            .opt("verify_backlog", 256)
    };
    let before = used(&c, 1);
    let t0 = Instant::now();
    let mut runs = [job(&a, "a").spawn(), job(&b, "b").spawn()];
    // Once node 1 holds some of the new data, kill it.
    assert!(
        wait_for(Duration::from_secs(20), || used(&c, 1) > before + (2 << 20)),
        "node 1 never took data"
    );
    assert!(runs.iter_mut().all(|r| r.running()), "fio ended too soon");
    c.kill(1);
    let killed_at = t0.elapsed();
    let [ra, rb] = runs;
    for (name, report) in [("shm", ra.wait()), ("tcp", rb.wait())] {
        let j = report.first();
        assert_eq!(j.error, 0, "{name} mount: fio error {j:?}");
        assert!(j.read.io_bytes >= 6 << 20, "{name}: verified what it wrote");
    }
    assert!(
        t0.elapsed() > killed_at,
        "the runs went on after the kill at {killed_at:?}"
    );
    // Everything reads back, crc-checked, through a mount that never saw node 1.
    let fresh = Mount::new(&c, "stripe_unit=64K,transport=tcp");
    for dir in ["a", "b"] {
        let report = Fio::verify(dir, &fresh.dir.join(dir), "randwrite", "6M")
            .opt("verify_only", 1)
            .run();
        assert_eq!(
            report.first().error,
            0,
            "{dir}: verify-only pass {report:?}"
        );
    }
    let log = c.nodes[0].as_ref().unwrap().stderr();
    assert!(
        log.contains("memory node out of the cluster"),
        "the primary drops node 1 from the replicas: {log}"
    );
}

/// A data node stopped (SIGSTOP) under a tcp mount and an shm mount: a write over its stripes
/// waits at most its lease plus the mount's timeout, then lands on the other replicas; neither
/// mount reads the stopped node's stale copy, before or after it resumes; once back, it is
/// freed of the dropped replicas and takes new data again.
#[test]
fn a_stopped_data_node_is_dropped_after_its_lease_and_serves_nothing_stale() {
    let c = cluster();
    let a = Mount::new(&c, "attr_timeout=0,timeout=1,stripe_unit=64K,transport=tcp");
    let b = Mount::new(&c, "attr_timeout=0,stripe_unit=64K");
    const LEN: usize = 12 << 16; // 12 stripes, 2 replicas each over 3 nodes
    fs::write(a.path("f"), vec![b'A'; LEN]).unwrap();
    // Both mounts cache the layout (and so the stopped node's replicas).
    assert_eq!(fs::read(a.path("f")).unwrap(), vec![b'A'; LEN]);
    assert_eq!(fs::read(b.path("f")).unwrap(), vec![b'A'; LEN]);
    assert!(used(&c, 1) >= (LEN as u64 / 3), "node 1 holds replicas");
    let pid = c.nodes[1].as_ref().unwrap().child.id() as i32;
    // SAFETY: SIGSTOP to a memory node process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let t0 = Instant::now();
    let f = OpenOptions::new().write(true).open(a.path("f")).unwrap();
    f.write_all_at(&vec![b'B'; LEN], 0)
        .unwrap_or_else(|e| panic!("write with a node stopped: {e}\n{}", a.log_text()));
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(6), "the write took {took:?}");
    for m in [&a, &b] {
        assert_eq!(
            fs::read(m.path("f")).unwrap(),
            vec![b'B'; LEN],
            "{} reads the new data while node 1 is stopped",
            m.dir.display()
        );
    }
    // SAFETY: SIGCONT to the same process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let primary = || c.nodes[0].as_ref().unwrap().stderr();
    assert!(
        wait_for(Duration::from_secs(10), || primary()
            .contains("memory node back")),
        "node 1 is taken back: {}",
        primary()
    );
    for m in [&a, &b] {
        assert_eq!(
            fs::read(m.path("f")).unwrap(),
            vec![b'B'; LEN],
            "after resume"
        );
    }
    let fresh = Mount::new(&c, "attr_timeout=0");
    assert_eq!(fs::read(fresh.path("f")).unwrap(), vec![b'B'; LEN]);
    // It takes new data again: many new files spread over all three nodes.
    let before = used(&c, 1);
    for i in 0..12 {
        fs::write(b.path(&format!("n{i}")), vec![i as u8; 64 << 10]).unwrap();
    }
    assert!(used(&c, 1) > before, "new data goes to node 1 again");
    for i in 0..12 {
        assert_eq!(
            fs::read(a.path(&format!("n{i}"))).unwrap(),
            vec![i as u8; 64 << 10]
        );
    }
}

/// With two replicas over two nodes, killing one leaves every file readable and writable, and
/// `rackfs status` reports the degraded files.
#[test]
fn a_dead_node_of_two_leaves_every_file_readable_and_writable() {
    let mut c = TestCluster::start_with(2, "32M", &["--node-lease-ms", "1000"]);
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K");
    for i in 0..6 {
        fs::write(m.path(&format!("f{i}")), format!("file {i}").repeat(1000)).unwrap();
    }
    c.kill(1);
    for i in 0..6 {
        assert_eq!(
            fs::read(m.path(&format!("f{i}"))).unwrap(),
            format!("file {i}").repeat(1000).as_bytes(),
            "f{i} after the kill"
        );
    }
    for i in 0..6 {
        fs::write(m.path(&format!("f{i}")), format!("again {i}")).unwrap();
        assert_eq!(
            fs::read(m.path(&format!("f{i}"))).unwrap(),
            format!("again {i}").as_bytes()
        );
    }
    fs::write(m.path("new"), vec![9u8; 1 << 20]).unwrap();
    assert_eq!(fs::read(m.path("new")).unwrap(), vec![9u8; 1 << 20]);
}

/// After a node dies, its stripes are copied back to two replicas on the nodes left while a
/// writer keeps overwriting them (`rackfs status` counts the copies); a second node's death
/// then loses nothing either.
#[test]
fn a_dead_nodes_stripes_are_copied_back_while_written_and_survive_a_second_death() {
    let mut c = cluster();
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K,transport=tcp");
    const FILES: usize = 8;
    const LEN: usize = 4 << 16;
    let content = |i: usize, round: u8| vec![round.wrapping_mul(31).wrapping_add(i as u8); LEN];
    for i in 0..FILES {
        fs::write(m.path(&format!("f{i}")), content(i, 0)).unwrap();
    }
    c.kill(1);
    // A writer overwrites every file, round after round, while the copies are made.
    let dir = m.dir.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut round = 0u8;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                round = round.wrapping_add(1);
                for i in 0..FILES {
                    let f = OpenOptions::new()
                        .write(true)
                        .open(dir.join(format!("f{i}")))
                        .unwrap();
                    f.write_all_at(&content(i, round), 0)
                        .unwrap_or_else(|e| panic!("round {round} f{i}: {e}"));
                }
            }
            round
        })
    };
    let health = || c.control(0).stats().unwrap().health;
    assert!(
        wait_for(Duration::from_secs(30), || {
            let h = health();
            h.rebuilt_stripes > 0 && h.degraded_stripes == 0
        }),
        "copies made: {:?}",
        health()
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let last = writer.join().unwrap();
    assert!(last >= 1, "the writer ran during the copies");
    let h = health();
    assert_eq!((h.degraded_files, h.unavailable_files), (0, 0), "{h:?}");
    c.kill(2);
    for i in 0..FILES {
        assert_eq!(
            fs::read(m.path(&format!("f{i}"))).unwrap(),
            content(i, last),
            "f{i} after a second node died"
        );
    }
}

/// A file written while one of two nodes is away (stopped, declared dead) still asks for two
/// replicas: it is placed on the node left, and its second copies are made on the other node
/// once that is back.
#[test]
fn files_written_while_a_node_is_away_get_their_second_copy_when_it_returns() {
    let c = TestCluster::start_with(2, "32M", &["--node-lease-ms", "1000"]);
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K,transport=tcp,timeout=1");
    let pid = c.nodes[1].as_ref().unwrap().child.id() as i32;
    // SAFETY: SIGSTOP to a memory node process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let health = || c.control(0).stats().unwrap().health;
    // Once its lease lapsed, new data goes to node 0 only.
    std::thread::sleep(Duration::from_millis(1500));
    fs::write(m.path("late"), vec![7u8; 4 << 16]).unwrap();
    assert!(health().degraded_files >= 1, "{:?}", health());
    let before = used(&c, 0);
    // SAFETY: SIGCONT to the same process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let h = health;
    assert!(
        wait_for(Duration::from_secs(15), || {
            let h = h();
            h.degraded_stripes == 0 && h.rebuilt_stripes >= 4
        }),
        "copied once the node is back: {:?}",
        h()
    );
    assert!(used(&c, 1) >= 4 << 16, "node 1 holds the copies");
    assert_eq!(used(&c, 0), before, "node 0 kept its own");
    assert_eq!(fs::read(m.path("late")).unwrap(), vec![7u8; 4 << 16]);
}
