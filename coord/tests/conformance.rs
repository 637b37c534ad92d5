//! The coordinator's semantics, checked on both implementations: the embedded one and a real
//! etcd (Debian's `etcd-server`, started on loopback; the suite installs it).

use std::time::Duration;

use rackfs_coord::{CoordError, Coordinator, Etcd, EtcdServer, Local};

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
    assert_eq!(c.create("b", b"3", None).unwrap(), Ok(()));
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
    assert_eq!(c.create("a", b"4", None).unwrap(), Ok(()));
}

/// A lease's keys go when it lapses; a lapsed lease cannot be renewed or used.
fn leases(c: &dyn Coordinator, ttl: Duration) {
    let (l, granted) = c.grant(ttl).unwrap();
    assert!(granted >= ttl, "granted {granted:?} for {ttl:?}");
    assert_eq!(c.create("leader", b"me", Some(l)).unwrap(), Ok(()));
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
    assert_eq!(c.create("leader", b"you", Some(other)).unwrap(), Ok(()));
    c.revoke(other).unwrap();
    assert_eq!(c.get("leader").unwrap(), None);
}

#[test]
fn the_embedded_coordinator_keeps_the_contract() {
    let c = Local::new(Duration::from_secs(60));
    keys(&c);
    leases(&c, Duration::from_millis(300));
}

#[test]
fn etcd_keeps_the_contract() {
    let (_server, c, dir) = etcd("contract");
    keys(&c);
    leases(&c, Duration::from_secs(2));
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
    assert!(matches!(
        short.get("a"),
        Err(CoordError::Unreachable { .. })
    ));
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
