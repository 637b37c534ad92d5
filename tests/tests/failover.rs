//! The metadata service survives its primary (etcd only): a data node mirrors the namespace
//! by the primary's journal and, once the primary's lease lapses, is elected and serves it;
//! mounts find it, keep their open files and report what they wrote.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::fs;
use std::io::Write;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::time::{Duration, Instant};

use rackfs_coord::{Coordinator, Etcd};
use rackfs_proto::control::RPC_KINDS;
use rackfs_tests::{wait_for, Mount, TestCluster};

fn etcd(c: &TestCluster) -> Etcd {
    Etcd::new(&c.etcd_endpoints(), "test", Duration::from_secs(2)).unwrap()
}

/// The node id the coordinator names under `key` (`primary` or `standby`).
fn named(c: &TestCluster, key: &str) -> Option<u64> {
    let v = etcd(c).get(key).ok()??;
    serde_json::from_slice::<serde_json::Value>(&v).ok()?["node_id"].as_u64()
}

fn log(c: &TestCluster, i: usize) -> String {
    c.nodes[i].as_ref().map(|n| n.stderr()).unwrap_or_default()
}

/// Three nodes on etcd (2 s leases) once the primary named its standby.
fn with_standby(region: &str) -> TestCluster {
    let c = TestCluster::on_etcd(3, region, &["--node-lease-ms", "2000"]);
    assert!(
        wait_for(Duration::from_secs(10), || named(&c, "standby").is_some()),
        "no standby named:\n{}",
        log(&c, 0)
    );
    c
}

/// `rackfs status` of mount `m` (stdout and stderr).
fn status(m: &Mount) -> String {
    let out = std::process::Command::new(rackfs_tests::bin_path("rackfs"))
        .arg("status")
        .arg(&m.dir)
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// kill -9 of the primary: the standby takes over with every name, attribute and byte; an
/// open file keeps working (its writes since the last close included), and new files can be
/// made.
#[test]
fn a_killed_primary_is_replaced_by_its_standby_and_nothing_is_lost() {
    let mut c = with_standby("64M");
    let standby = named(&c, "standby").unwrap() as usize;
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K,transport=tcp");
    let status = || status(&m);
    let st = status();
    assert!(
        st.contains(&format!("metadata standby: mn{standby} (in sync")),
        "{st}"
    );
    fs::create_dir(m.path("d")).unwrap();
    for i in 0..20 {
        fs::write(m.path(&format!("d/f{i}")), vec![i as u8; 100_000 + i * 7]).unwrap();
    }
    fs::rename(m.path("d/f0"), m.path("d/renamed")).unwrap();
    fs::remove_file(m.path("d/f1")).unwrap();
    std::os::unix::fs::symlink("f2", m.path("d/link")).unwrap();
    // Open across the failover, written both before and after it.
    let mut open = fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .open(m.path("open"))
        .unwrap();
    open.write_all(&vec![b'a'; 300_000]).unwrap();

    c.kill(0);
    let t0 = Instant::now();
    assert!(
        wait_for(Duration::from_secs(15), || named(&c, "primary")
            == Some(standby as u64)),
        "the standby was not elected:\n{}",
        log(&c, standby)
    );
    // The first namespace operation waits for the new primary.
    let names: Vec<String> = fs::read_dir(m.path("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    eprintln!(
        "namespace served again {:?} after kill -9 of the primary",
        t0.elapsed()
    );
    assert_eq!(names.len(), 20, "{names:?}");
    assert!(names.contains(&"renamed".to_string()) && !names.contains(&"f1".to_string()));
    assert_eq!(
        fs::read_link(m.path("d/link")).unwrap().to_str(),
        Some("f2")
    );
    assert_eq!(fs::read(m.path("d/renamed")).unwrap(), vec![0u8; 100_000]);
    for i in 2..20 {
        let got = fs::read(m.path(&format!("d/f{i}"))).unwrap_or_else(|e| {
            panic!(
                "d/f{i}: {e}\nmount:\n{}\nstandby:\n{}\nthird:\n{}",
                m.log_text(),
                log(&c, standby),
                log(&c, 3 - standby)
            )
        });
        assert_eq!(got, vec![i as u8; 100_000 + i * 7], "d/f{i}");
    }
    // The open file: its size written one-sidedly to the dead primary was reported again.
    assert_eq!(fs::metadata(m.path("open")).unwrap().len(), 300_000);
    open.write_all_at(&vec![b'b'; 100_000], 300_000).unwrap();
    drop(open);
    let mut want = vec![b'a'; 300_000];
    want.extend(vec![b'b'; 100_000]);
    assert_eq!(fs::read(m.path("open")).unwrap(), want);
    // New names, new data.
    fs::write(m.path("after"), b"written after the failover").unwrap();
    assert_eq!(
        fs::read(m.path("after")).unwrap(),
        b"written after the failover"
    );
    // The new primary makes the third node its standby once it follows.
    let other = 3 - standby;
    assert!(
        wait_for(Duration::from_secs(15), || status()
            .contains(&format!("metadata standby: mn{other} (in sync"))),
        "{}",
        status()
    );
    assert!(
        wait_for(Duration::from_secs(10), || log(&c, other)
            .contains("another primary was elected: following it")),
        "{}",
        log(&c, other)
    );
    // The old primary, restarted with its own command line (`--primary`: a unit's is fixed),
    // joins as a data node instead of campaigning with an empty namespace, and takes data.
    c.restart(0);
    assert!(
        wait_for(Duration::from_secs(15), || status()
            .lines()
            .any(
                |l| l.trim_start().starts_with("mn0 ") && !l.contains("DOWN")
            )),
        "{}\n{}",
        status(),
        log(&c, 0)
    );
    let l = log(&c, 0);
    assert!(
        l.contains("joining it as a data node") && !l.contains("elected primary of the cluster"),
        "{l}"
    );
    assert_eq!(named(&c, "primary"), Some(standby as u64));
    assert_eq!(fs::read(m.path("d/renamed")).unwrap(), vec![0u8; 100_000]);
}

/// kill -9 of the primary while two mounts (shm and tcp) run fio with crc32c verification:
/// both runs finish without an error or a mismatch (their operations wait for the standby to
/// take over), and everything reads back, crc-checked, through a fresh mount.
#[test]
fn a_killed_primary_loses_no_byte_under_fio_verify_from_two_mounts() {
    let mut c = with_standby("96M");
    let standby = named(&c, "standby").unwrap() as usize;
    let a = Mount::new(&c, "stripe_unit=64K");
    let b = Mount::new(&c, "stripe_unit=64K,transport=tcp");
    fs::create_dir(a.path("a")).unwrap();
    fs::create_dir(a.path("b")).unwrap();
    let job = |m: &Mount, dir: &str| {
        rackfs_tests::Fio::verify(dir, &m.dir.join(dir), "randwrite", "6M")
            .opt("loops", 8)
            .opt("verify_backlog", 256)
    };
    let t0 = Instant::now();
    let mut runs = [job(&a, "a").spawn(), job(&b, "b").spawn()];
    std::thread::sleep(Duration::from_millis(700));
    assert!(runs.iter_mut().all(|r| r.running()), "fio ended too soon");
    c.kill(0);
    let killed_at = t0.elapsed();
    let [ra, rb] = runs;
    for (name, m, run) in [("shm", &a, ra), ("tcp", &b, rb)] {
        let report = run.finish().unwrap_or_else(|e| {
            let fio: String = e.lines().take(3).collect::<Vec<_>>().join("\n");
            panic!(
                "{name} mount: {fio}\nmount log:\n{}\nstandby log:\n{}",
                m.log_text(),
                log(&c, standby)
            )
        });
        let j = report.first();
        assert_eq!(
            j.error,
            0,
            "{name} mount: fio error {j:?}\nmount log:\n{}\nstandby log:\n{}",
            if name == "shm" {
                a.log_text()
            } else {
                b.log_text()
            },
            log(&c, standby)
        );
        assert!(j.read.io_bytes >= 6 << 20, "{name}: verified what it wrote");
    }
    assert!(t0.elapsed() > killed_at, "the runs went on after the kill");
    assert_eq!(named(&c, "primary"), Some(standby as u64));
    for m in [&a, &b] {
        assert!(
            m.log_text()
                .contains("continuing on the primary that took over"),
            "the mount went through the failover: {}",
            m.log_text()
        );
    }
    let source = c.nodes[standby].as_ref().unwrap().tcp.clone();
    let fresh = Mount::try_new(&source, &c.secret_file, "stripe_unit=64K,transport=tcp").unwrap();
    for dir in ["a", "b"] {
        let report = rackfs_tests::Fio::verify(dir, &fresh.dir.join(dir), "randwrite", "6M")
            .opt("verify_only", 1)
            .run();
        assert_eq!(
            report.first().error,
            0,
            "{dir}: verify-only pass {report:?}"
        );
    }
}

/// A primary stopped (SIGSTOP) past its lease is replaced by its standby; resumed, it serves
/// nothing and exits, naming the new primary; the mount carries on with the new one.
#[test]
fn a_stopped_primary_is_replaced_and_exits_when_it_resumes() {
    let mut c = with_standby("64M");
    let standby = named(&c, "standby").unwrap() as usize;
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K,transport=tcp");
    fs::write(m.path("f"), vec![1u8; 200_000]).unwrap();
    let pid = c.nodes[0].as_ref().unwrap().child.id() as i32;
    rackfs_tests::stop_process(pid);
    assert!(
        wait_for(Duration::from_secs(15), || named(&c, "primary")
            == Some(standby as u64)),
        "the standby was not elected:\n{}",
        log(&c, standby)
    );
    fs::write(m.path("g"), b"while the old primary is stopped").unwrap();
    // SAFETY: SIGCONT to the memory node process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let exited = wait_for(Duration::from_secs(10), || {
        c.nodes[0]
            .as_mut()
            .is_some_and(|n| !matches!(n.child.try_wait(), Ok(None)))
    });
    assert!(exited, "the old primary still runs:\n{}", log(&c, 0));
    assert!(
        log(&c, 0).contains("another node is primary now"),
        "{}",
        log(&c, 0)
    );
    assert_eq!(fs::read(m.path("f")).unwrap(), vec![1u8; 200_000]);
    assert_eq!(
        fs::read(m.path("g")).unwrap(),
        b"while the old primary is stopped"
    );
    c.kill(0);
}

/// Deposed means silent. Four nodes: the primary is stopped past its lease, its standby takes
/// over and names another node its standby. Resumed, the old primary acts on nothing before it
/// exits: it neither withdraws the new standby's name, nor declares nodes dead, fences mounts,
/// or copies and frees data on the nodes (each is refused: its coordinator writes are guarded
/// by its election, the data nodes follow only the newest primary's epoch). So once the new
/// primary is killed in turn, the standby it named takes over with every file.
#[test]
fn a_resumed_deposed_primary_acts_on_nothing_and_a_third_node_takes_over() {
    let mut c = TestCluster::on_etcd(4, "64M", &["--node-lease-ms", "2000"]);
    assert!(
        wait_for(Duration::from_secs(10), || named(&c, "standby").is_some()),
        "no standby named:\n{}",
        log(&c, 0)
    );
    let first = named(&c, "standby").unwrap() as usize;
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K,transport=tcp");
    let status = || status(&m);
    for i in 0..10 {
        fs::write(m.path(&format!("f{i}")), vec![i as u8; 300_000]).unwrap();
    }
    let pid = c.nodes[0].as_ref().unwrap().child.id() as i32;
    rackfs_tests::stop_process(pid);
    assert!(
        wait_for(Duration::from_secs(15), || named(&c, "primary")
            == Some(first as u64)),
        "the standby was not elected:\n{}",
        log(&c, first)
    );
    // The new primary copies the old one's replicas back and names a standby of its own.
    let mut second = None;
    assert!(
        wait_for(Duration::from_secs(30), || {
            second = named(&c, "standby").filter(|&s| s != first as u64 && s != 0);
            let st = status();
            second.is_some_and(|s| st.contains(&format!("metadata standby: mn{s} (in sync")))
                && st.contains("data: healthy")
        }),
        "{}\n{}",
        status(),
        log(&c, first)
    );
    let second = second.unwrap() as usize;
    fs::write(m.path("between"), b"written between the failovers").unwrap();
    // Resumed past its lease, the old primary exits having acted on nothing.
    // SAFETY: SIGCONT to the memory node process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let exited = wait_for(Duration::from_secs(10), || {
        c.nodes[0]
            .as_mut()
            .is_some_and(|n| !matches!(n.child.try_wait(), Ok(None)))
    });
    let old = log(&c, 0);
    assert!(exited, "the old primary still runs:\n{old}");
    for acted in [
        "metadata standby dropped",
        "out of the cluster",
        "fencing it on every memory node",
        "its lease is revoked",
    ] {
        assert!(
            !old.contains(acted),
            "the deposed primary acted ({acted}):\n{old}"
        );
    }
    assert_eq!(named(&c, "standby"), Some(second as u64), "{old}");
    // The second failover: the standby the new primary named takes over with every file.
    c.kill(first);
    assert!(
        wait_for(Duration::from_secs(20), || named(&c, "primary")
            == Some(second as u64)),
        "the new standby was not elected:\n{}",
        log(&c, second)
    );
    for i in 0..10 {
        let got = fs::read(m.path(&format!("f{i}")))
            .unwrap_or_else(|e| panic!("f{i}: {e}\n{}\n{}", m.log_text(), log(&c, second)));
        assert_eq!(got, vec![i as u8; 300_000], "f{i}");
    }
    assert_eq!(
        fs::read(m.path("between")).unwrap(),
        b"written between the failovers"
    );
    fs::write(m.path("after"), b"after both").unwrap();
    assert_eq!(fs::read(m.path("after")).unwrap(), b"after both");
}

/// Two primaries die one after the other: once the first standby took over, made the third
/// node its standby and copied the dead primary's replicas back, killing it too leaves the
/// third node serving every file.
#[test]
fn a_second_failover_after_the_first_loses_nothing() {
    let mut c = with_standby("64M");
    let first = named(&c, "standby").unwrap() as usize;
    let last = 3 - first;
    let m = Mount::new(&c, "attr_timeout=0,stripe_unit=64K,transport=tcp");
    let status = || status(&m);
    for i in 0..10 {
        fs::write(m.path(&format!("f{i}")), vec![i as u8; 300_000]).unwrap();
    }
    c.kill(0);
    assert_eq!(fs::read(m.path("f0")).unwrap(), vec![0u8; 300_000]);
    assert!(
        wait_for(Duration::from_secs(20), || {
            let st = status();
            st.contains(&format!("metadata standby: mn{last} (in sync"))
                && st.contains("data: healthy")
        }),
        "{}\n{}",
        status(),
        log(&c, first)
    );
    fs::write(m.path("between"), b"written between the failovers").unwrap();
    c.kill(first);
    for i in 0..10 {
        let got = fs::read(m.path(&format!("f{i}")))
            .unwrap_or_else(|e| panic!("f{i}: {e}\n{}\n{}", m.log_text(), log(&c, last)));
        assert_eq!(got, vec![i as u8; 300_000], "f{i}");
    }
    assert_eq!(
        fs::read(m.path("between")).unwrap(),
        b"written between the failovers"
    );
    assert_eq!(named(&c, "primary"), Some(last as u64));
}

/// Record locks survive the primary: a lock held through one mount still excludes a process
/// on another mount after kill -9 of the primary (the mounts reclaim their processes' locks
/// from the new primary in its grace period, before anyone may take a new one), and goes when
/// its holder unlocks.
#[test]
fn record_locks_are_reclaimed_from_the_primary_that_takes_over() {
    let mut c = with_standby("32M");
    let a = Mount::new(&c, "transport=tcp");
    let b = Mount::new(&c, "transport=tcp");
    fs::write(a.path("db"), b"x").unwrap();
    let mut holder = rackfs_tests::Locker::spawn();
    let mut other = rackfs_tests::Locker::spawn();
    assert_eq!(
        holder.ask(&format!("open {}", a.path("db").display())),
        "ok"
    );
    assert_eq!(other.ask(&format!("open {}", b.path("db").display())), "ok");
    assert_eq!(holder.ask("setlk W 0 10"), "ok");
    assert_eq!(holder.ask("setlk R 100 0"), "ok");
    assert_eq!(other.ask("setlk W 5 1"), "EAGAIN");

    c.kill(0);
    // After the take-over the holder's locks still exclude (the first answer waits out the
    // failover and, if need be, the grace period).
    let t0 = Instant::now();
    other.send("setlk W 5 1");
    let first = other.answer(Duration::from_secs(30));
    assert_eq!(first.as_deref(), Some("EAGAIN"), "{}", a.log_text());
    assert_eq!(other.ask("setlk W 200 1"), "EAGAIN");
    assert_eq!(other.ask("setlk R 200 1"), "ok");
    eprintln!(
        "lock operations answered again {:?} after the kill",
        t0.elapsed()
    );
    assert!(
        a.log_text().contains("record locks reclaimed"),
        "{}",
        a.log_text()
    );
    // The holder still holds, and gives them up.
    other.send("setlkw W 0 10");
    assert_eq!(
        other.answer(Duration::from_millis(500)),
        None,
        "granted while held"
    );
    assert_eq!(holder.ask("setlk U 0 0"), "ok");
    assert_eq!(
        other.answer(Duration::from_secs(10)).as_deref(),
        Some("ok"),
        "the waiter was not granted once the holder unlocked"
    );
}

/// Group commit: changes from eight threads, across a pause of the standby (SIGSTOP, shorter
/// than its journal deadline) during which they queue behind the journal RPC in flight, are
/// none of them answered before the standby has them: after kill -9 of the primary every file
/// is there with its bytes and the last mode each thread set. (How many entries share a
/// journal RPC is printed, not asserted: it depends on timing.)
#[test]
fn changes_from_many_threads_across_a_standby_pause_survive_the_primary() {
    const THREADS: usize = 8;
    const CHMODS: usize = 300;
    let mut c = with_standby("64M");
    let standby = named(&c, "standby").unwrap() as usize;
    let m = Mount::new(&c, "transport=tcp,threads=16");
    let journal = RPC_KINDS.iter().position(|k| *k == "journal").unwrap();
    let shipped = |c: &TestCluster| {
        let s = c.control(standby).stats().unwrap();
        (s.rpcs[journal], s.journal_entries)
    };
    let body = |t: usize| format!("the file of thread {t}").repeat(100);
    for t in 0..THREADS {
        fs::write(m.path(&format!("f{t}")), body(t)).unwrap();
    }
    let started = std::sync::Barrier::new(THREADS + 1);
    let (rpcs, entries) = std::thread::scope(|s| {
        for t in 0..THREADS {
            let (m, started) = (&m, &started);
            s.spawn(move || {
                let path = m.path(&format!("f{t}"));
                started.wait();
                for i in 0..CHMODS {
                    let mode = 0o600 | (i as u32 % 64);
                    fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
                }
            });
        }
        started.wait();
        std::thread::sleep(Duration::from_millis(50));
        let before = shipped(&c);
        let pid = c.nodes[standby].as_ref().unwrap().child.id() as i32;
        rackfs_tests::stop_process(pid);
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: SIGCONT to the memory node process this test started.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
        std::thread::sleep(Duration::from_millis(20));
        let after = shipped(&c);
        (after.0 - before.0, after.1 - before.1)
    });
    eprintln!(
        "around a 300 ms pause of the standby: {entries} journal entries in {rpcs} journal RPCs"
    );
    assert!(
        entries > 0,
        "no change reached the standby around its pause"
    );
    assert_eq!(
        named(&c, "standby"),
        Some(standby as u64),
        "the standby was dropped"
    );
    c.kill(0);
    assert!(
        wait_for(Duration::from_secs(15), || named(&c, "primary")
            == Some(standby as u64)),
        "the standby was not elected:\n{}",
        log(&c, standby)
    );
    for t in 0..THREADS {
        let path = m.path(&format!("f{t}"));
        let got = fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("f{t}: {e}\nmount:\n{}", m.log_text()));
        assert_eq!(got, body(t), "f{t}");
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600 | ((CHMODS as u32 - 1) % 64), "f{t}");
    }
}
