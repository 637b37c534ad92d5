//! The coordinator's semantics, checked on both implementations: the embedded one and a real
//! etcd (Debian's `etcd-server`, started on loopback; the suite installs it).

use std::time::Duration;

use rackfs_coord::{CoordError, Coordinator, Etcd, EtcdServer, Guard, Local, Write};

fn etcd(tag: &str) -> (EtcdServer, Etcd, std::path::PathBuf) {
    let dir =
        std::path::Path::new("/dev/shm").join(format!("rackfs-coord-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let server = EtcdServer::start(&dir).unwrap_or_else(|e| panic!("{e}"));
    let c = Etcd::new(&server.endpoints(), "test", Duration::from_secs(2)).unwrap();
    (server, c, dir)
}

/// Keys, create-if-absent and listing.
fn keys(c: &dyn Coordinator) {
    assert_eq!(c.get("a").unwrap(), None);
    c.put("a", b"1", None).unwrap();
    assert_eq!(c.get("a").unwrap(), Some(b"1".to_vec()));
    assert_eq!(c.create("a", b"2", None).unwrap(), Err(b"1".to_vec()));
    let b = c.create("b", b"3", None).unwrap().unwrap();
    assert_eq!(c.created("b").unwrap(), Some((b, b"3".to_vec())));
    assert_eq!(c.created("nothing").unwrap(), None);
    c.put("nodes/1", b"x", None).unwrap();
    c.put("nodes/2", b"y", None).unwrap();
    c.put("nodesz", b"z", None).unwrap();
    assert_eq!(
        c.list("nodes/").unwrap(),
        vec![
            ("nodes/1".into(), b"x".to_vec()),
            ("nodes/2".into(), b"y".to_vec())
        ]
    );
    c.delete("a").unwrap();
    assert_eq!(c.get("a").unwrap(), None);
    // A key created anew has a later revision than one created before.
    let a = c.create("a", b"4", None).unwrap().unwrap();
    assert!(a > b, "revision {a} of a later create, {b} before");
    // Rewriting a key keeps the revision it was created at.
    c.put("b", b"5", None).unwrap();
    assert_eq!(c.created("b").unwrap(), Some((b, b"5".to_vec())));
}

/// Guarded writes land only while the guard's key is held under its lease.
fn guarded_writes(c: &dyn Coordinator, ttl: Duration) {
    let (mine, _) = c.grant(ttl).unwrap();
    c.create("boss", b"me", Some(mine)).unwrap().unwrap();
    let me = Guard {
        key: "boss".into(),
        lease: mine,
    };
    assert!(c.holds(&me).unwrap());
    let put = |v: &[u8]| Write::Put {
        key: "deputy".into(),
        value: v.to_vec(),
        lease: None,
    };
    c.write_if(&me, put(b"1")).unwrap();
    assert_eq!(c.get("deputy").unwrap(), Some(b"1".to_vec()));
    // Another lease, a missing key, or a key without lease: not held, nothing written.
    let (other, _) = c.grant(ttl).unwrap();
    for g in [
        Guard {
            key: "boss".into(),
            lease: other,
        },
        Guard {
            key: "nobody".into(),
            lease: 0,
        },
        Guard {
            key: "boss".into(),
            lease: 0,
        },
    ] {
        assert!(!c.holds(&g).unwrap(), "{g:?}");
        assert!(matches!(
            c.write_if(&g, put(b"2")),
            Err(CoordError::NotHeld { .. })
        ));
        assert!(matches!(
            c.write_if(
                &g,
                Write::Delete {
                    key: "deputy".into()
                }
            ),
            Err(CoordError::NotHeld { .. })
        ));
    }
    assert_eq!(c.get("deputy").unwrap(), Some(b"1".to_vec()));
    // A key put without a lease is held by the guard of lease 0.
    c.put("fixed", b"x", None).unwrap();
    let fixed = Guard {
        key: "fixed".into(),
        lease: 0,
    };
    assert!(c.holds(&fixed).unwrap());
    // Deposed: once the lease is gone (and another holds the key), the old guard fails.
    c.revoke(mine).unwrap();
    c.create("boss", b"you", Some(other)).unwrap().unwrap();
    assert!(matches!(
        c.write_if(
            &me,
            Write::Delete {
                key: "deputy".into()
            }
        ),
        Err(CoordError::NotHeld { .. })
    ));
    assert_eq!(c.get("deputy").unwrap(), Some(b"1".to_vec()));
    let you = Guard {
        key: "boss".into(),
        lease: other,
    };
    c.write_if(
        &you,
        Write::Delete {
            key: "deputy".into(),
        },
    )
    .unwrap();
    assert_eq!(c.get("deputy").unwrap(), None);
    c.revoke(other).unwrap();
}

/// A lease's keys go when it lapses; a lapsed lease cannot be renewed or used.
fn leases(c: &dyn Coordinator, ttl: Duration) {
    let (l, granted) = c.grant(ttl).unwrap();
    assert!(granted >= ttl, "granted {granted:?} for {ttl:?}");
    assert!(c.create("leader", b"me", Some(l)).unwrap().is_ok());
    // Renewed, it lives past its first ttl.
    for _ in 0..3 {
        std::thread::sleep(granted / 2);
        c.keep_alive(l).unwrap();
    }
    assert_eq!(c.get("leader").unwrap(), Some(b"me".to_vec()));
    let (other, _) = c.grant(ttl).unwrap();
    assert_eq!(
        c.create("leader", b"you", Some(other)).unwrap(),
        Err(b"me".to_vec())
    );
    // Left alone, it lapses and takes its key along.
    let end = std::time::Instant::now() + granted * 3;
    while c.get("leader").unwrap().is_some() {
        assert!(
            std::time::Instant::now() < end,
            "the lapsed lease's key stays"
        );
        std::thread::sleep(Duration::from_millis(100));
        c.keep_alive(other).unwrap();
    }
    assert!(matches!(c.keep_alive(l), Err(CoordError::Expired(id)) if id == l));
    assert!(matches!(
        c.put("k", b"v", Some(l)),
        Err(CoordError::Expired(_))
    ));
    assert!(matches!(
        c.create("k", b"v", Some(l)),
        Err(CoordError::Expired(_))
    ));
    assert!(c.create("leader", b"you", Some(other)).unwrap().is_ok());
    c.revoke(other).unwrap();
    assert_eq!(c.get("leader").unwrap(), None);
}

#[test]
fn the_embedded_coordinator_keeps_the_contract() {
    let c = Local::new(Duration::from_secs(60));
    keys(&c);
    leases(&c, Duration::from_millis(300));
    guarded_writes(&c, Duration::from_secs(5));
}

#[test]
fn etcd_keeps_the_contract() {
    let (_server, c, dir) = etcd("contract");
    keys(&c);
    leases(&c, Duration::from_secs(2));
    guarded_writes(&c, Duration::from_secs(5));
    // Another cluster's keys are its own.
    let other = Etcd::new(&_server.endpoints(), "other", Duration::from_secs(2)).unwrap();
    assert_eq!(other.get("b").unwrap(), None);
    assert_eq!(other.list("nodes/").unwrap(), vec![]);
    drop(_server);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_unreachable_etcd_is_a_clear_error_within_the_deadline() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let c = Etcd::new(
        &format!("127.0.0.1:{port}"),
        "x",
        Duration::from_millis(300),
    )
    .unwrap();
    let t = std::time::Instant::now();
    let e = c.get("a").unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(matches!(e, CoordError::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains(&port.to_string()), "{e}");
}

#[test]
fn a_stopped_etcd_fails_calls_at_the_deadline_and_serves_again_once_resumed() {
    let (server, c, dir) = etcd("stopped");
    c.put("a", b"1", None).unwrap();
    // SAFETY: SIGSTOP/SIGCONT to the etcd this test started.
    unsafe { libc::kill(server.pid(0) as i32, libc::SIGSTOP) };
    let t = std::time::Instant::now();
    let short = Etcd::new(&server.endpoints(), "test", Duration::from_millis(400)).unwrap();
    let got = short.get("a");
    assert!(
        matches!(got, Err(CoordError::Unreachable { .. })),
        "a get from a stopped etcd: {got:?}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    // SAFETY: as above.
    unsafe { libc::kill(server.pid(0) as i32, libc::SIGCONT) };
    assert_eq!(c.get("a").unwrap(), Some(b"1".to_vec()));
    drop(server);
    let _ = std::fs::remove_dir_all(dir);
}
