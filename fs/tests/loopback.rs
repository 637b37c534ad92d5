//! The client core against an in-process cluster: control connections over
//! [`rackfs_fs::link::Loopback`] to nodes whose metadata service is the real one
//! ([`rackfs_meta::MetaService`] over [`rackfs_meta::MemStorage`]), time from a
//! [`rackfs_fs::clock::ManualClock`]. No sockets, no threads of the test's own, no real time:
//! what a deterministic simulation of the cluster builds on.

mod common;

use common::node;
use std::ffi::OsStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rackfs_fs::client::{AttrChange, Caller, Client, Errno, SetTime};
use rackfs_fs::clock::{Clock, ManualClock};
use rackfs_fs::cluster::{Cluster, FAILOVER_WAIT};
use rackfs_fs::env::Env;
use rackfs_fs::link::Loopback;
use rackfs_fs::options::{MountOptions, TransportChoice};
use rackfs_fs::spawn::Queue;
use rackfs_meta::{MemStorage, MetaService};
use rackfs_proto::control::{ClusterInfo, ControlRequest, ControlResponse, ErrorCode};
use rackfs_proto::namespace::{Kind, ROOT_INO};
use rackfs_verbs::Secret;

/// The metadata service and the memory it keeps its records in (one for the whole cluster: a
/// standby that takes over has mirrored it exactly).
type Meta = Arc<Mutex<(MetaService, MemStorage)>>;

/// The cluster as a node sees it, with `primary` as the primary.
fn info(nodes: u32, primary: u32, elects: bool) -> ClusterInfo {
    ClusterInfo {
        primary: node(primary),
        nodes: (0..nodes).map(node).collect(),
        down: Vec::new(),
        coordinator: "loopback".into(),
        elects,
        mounts: Vec::new(),
        epochs: Vec::new(),
        standby: None,
    }
}

/// A cluster of `nodes` nodes served in process at `n0`, `n1`, ...; node `id` names as
/// primary whom `primary_seen_by(id)` says.
struct World {
    lo: Arc<Loopback>,
    clock: Arc<ManualClock>,
    /// Sessions the primary fenced: it refuses their requests, executing none.
    fenced: Arc<Mutex<Vec<u64>>>,
    /// The threads the mounts' cores start, run only when the test says.
    threads: Arc<Queue>,
}

impl World {
    fn new(
        nodes: u32,
        elects: bool,
        primary_seen_by: impl Fn(u32) -> u32 + Send + Sync + 'static,
    ) -> World {
        let clock = Arc::new(ManualClock::default());
        let service = MetaService::new(Duration::from_secs(30), clock.wall_ns());
        let meta: Meta = Arc::new(Mutex::new((service, MemStorage::new(nodes, 16 << 20))));
        let lo = Arc::new(Loopback::new());
        let primary_seen_by = Arc::new(primary_seen_by);
        let fenced: Arc<Mutex<Vec<u64>>> = Arc::default();
        for id in 0..nodes {
            let (meta, seen, fenced) = (meta.clone(), primary_seen_by.clone(), fenced.clone());
            let closed = meta.clone();
            lo.serve(
                &format!("n{id}"),
                id,
                &format!("node{id}"),
                move |session, req| {
                    let mut m = meta.lock().unwrap();
                    let (svc, st) = &mut *m;
                    match req {
                        _ if fenced.lock().unwrap().contains(&session) => ControlResponse::Error {
                            code: ErrorCode::Fenced,
                            message: format!("session {session} was fenced"),
                        },
                        ControlRequest::Cluster => {
                            ControlResponse::Cluster(Box::new(info(nodes, seen(id), elects)))
                        }
                        ControlRequest::Meta(req) => svc.handle(session, req, st),
                        ControlRequest::Adopt { from } => {
                            svc.adopt(from, session, st);
                            ControlResponse::Ok
                        }
                        other => ControlResponse::Error {
                            code: ErrorCode::Invalid,
                            message: format!("not served in this test: {other:?}"),
                        },
                    }
                },
                Some(Arc::new(move |session| {
                    let mut m = closed.lock().unwrap();
                    let (svc, st) = &mut *m;
                    svc.end_session(session, st);
                })),
            );
        }
        World {
            lo,
            clock,
            fenced,
            threads: Arc::new(Queue::new()),
        }
    }

    fn env(&self) -> Env {
        Env {
            clock: self.clock.clone(),
            dial: self.lo.clone(),
            spawn: self.threads.clone(),
        }
    }

    /// A mount's core, connected through `n0`.
    fn mount(&self, opts: MountOptions) -> Client {
        let secret = Secret::new(b"loopback-test-secret").unwrap();
        let cluster = Cluster::connect(
            self.env(),
            &["n0".to_string()],
            secret,
            TransportChoice::Tcp,
            None,
            "mount:/test",
        )
        .expect("connected over the loopback");
        let client = Client::new(Arc::new(cluster), opts);
        // Its look at the cluster's nodes each second is a loop: these tests never run it.
        self.threads.discard("rackfs-members");
        client
    }
}

fn name(s: &str) -> &OsStr {
    OsStr::new(s)
}

const ME: Caller = Caller {
    uid: 1000,
    gid: 100,
};

fn errno(code: i32) -> Errno {
    Errno::new(code)
}

#[test]
fn namespace_operations_round_trip_through_the_core_and_refusals_map_to_errnos() {
    let w = World::new(1, false, |_| 0);
    let a = w.mount(MountOptions::default());
    assert_eq!(a.cluster().session(), 1, "the loopback's first session");

    let d = a.mkdir(ROOT_INO, name("d"), 0o777, 0o022, ME).unwrap();
    assert_eq!(
        (d.kind, d.perm, d.uid, d.gid),
        (Kind::Dir, 0o755, 1000, 100)
    );
    let (f, opened) = a
        .create(
            d.ino,
            name("f"),
            0o644,
            0,
            libc::O_WRONLY | libc::O_CREAT,
            ME,
        )
        .unwrap();
    assert_eq!(f.kind, Kind::File);
    assert_eq!(a.lookup(d.ino, name("f")).unwrap().ino, f.ino);
    let mut listed = Vec::new();
    a.readdir(d.ino, 0, |e| {
        listed.push(String::from_utf8(e.name.clone()).unwrap());
        false
    })
    .unwrap();
    assert!(listed.contains(&"f".to_string()), "{listed:?}");

    // The service's refusals, as the caller's errno.
    assert_eq!(a.lookup(d.ino, name("nope")), Err(errno(libc::ENOENT)));
    assert_eq!(
        a.mkdir(ROOT_INO, name("d"), 0o755, 0, ME),
        Err(errno(libc::EEXIST))
    );
    assert_eq!(a.rmdir(ROOT_INO, name("d")), Err(errno(libc::ENOTEMPTY)));
    let excl = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL;
    assert_eq!(
        a.create(d.ino, name("f"), 0o644, 0, excl, ME)
            .map(|r| r.0.ino),
        Err(errno(libc::EEXIST))
    );
    // The core's policy: without O_EXCL, a name another mount created is opened instead.
    let (again, _) = a
        .create(
            d.ino,
            name("f"),
            0o644,
            0,
            libc::O_WRONLY | libc::O_CREAT,
            ME,
        )
        .unwrap();
    assert_eq!(again.ino, f.ino);
    a.create(
        d.ino,
        name("g"),
        0o644,
        0,
        libc::O_WRONLY | libc::O_CREAT,
        ME,
    )
    .unwrap();
    let noreplace = libc::RENAME_NOREPLACE;
    assert_eq!(
        a.rename(d.ino, name("f"), d.ino, name("g"), noreplace),
        Err(errno(libc::EEXIST))
    );
    assert_eq!(
        a.rename(d.ino, name("f"), d.ino, name("g"), libc::RENAME_WHITEOUT),
        Err(errno(libc::EINVAL))
    );

    // "Now" is the mount's clock.
    w.clock.advance(Duration::from_secs(90));
    let change = AttrChange {
        mtime: Some(SetTime::Now),
        ..AttrChange::default()
    };
    let touched = a.setattr(f.ino, change).unwrap();
    assert_eq!(touched.mtime_ns, w.clock.wall_ns());

    // Another mount is another session and sees the same namespace.
    let b = w.mount(MountOptions {
        read_only: true,
        ..MountOptions::default()
    });
    assert_eq!(b.cluster().session(), 2);
    assert_eq!(b.lookup(ROOT_INO, name("d")).unwrap().ino, d.ino);
    assert_eq!(
        b.mkdir(ROOT_INO, name("e"), 0o755, 0, ME),
        Err(errno(libc::EROFS))
    );
    a.release(f.ino, opened.fh).unwrap();
}

#[test]
fn a_mount_follows_the_primary_elected_after_its_primary_died_on_virtual_time() {
    // Node 1 is elected one (virtual) second after this starts.
    let clock_seen = Arc::new(Mutex::new(None::<Arc<ManualClock>>));
    let c = clock_seen.clone();
    let w = World::new(2, true, move |_| {
        let clock = c.lock().unwrap().clone().expect("the clock");
        u32::from(clock.now() >= Duration::from_secs(1))
    });
    *clock_seen.lock().unwrap() = Some(w.clock.clone());

    let a = w.mount(MountOptions::default());
    let cl = a.cluster();
    let first = cl.session();
    a.mkdir(ROOT_INO, name("before"), 0o755, 0, ME).unwrap();

    w.lo.set_down("n0", true);
    let b = a.mkdir(ROOT_INO, name("after"), 0o755, 0, ME).unwrap();
    assert_eq!((cl.failovers(), cl.primary_id()), (1, 1));
    assert_ne!(cl.session(), first, "a new session on the new primary");
    // It asked every 200 ms until the election.
    let waited = w.clock.now();
    assert!(
        waited >= Duration::from_secs(1) && waited <= Duration::from_millis(1200),
        "{waited:?}"
    );
    // The retried request was made once.
    assert_eq!(a.lookup(ROOT_INO, name("after")).unwrap().ino, b.ino);
    assert!(a.lookup(ROOT_INO, name("before")).is_ok());
    // The mount's failover hook started its record-lock reclaim (nothing to reclaim here).
    assert_eq!(w.threads.waiting(), ["rackfs-reclaim"]);
    assert_eq!(w.threads.run_next().as_deref(), Some("rackfs-reclaim"));
}

/// Only a failover changes whom the mount takes for the primary. A node's address asked of
/// the primary's link while a deposed primary still answered there (it names itself) made
/// the watcher reconnect to the deposed node and fail over again from the primary the mount
/// had just followed (chaos, the primary paused past its lease).
#[test]
fn a_map_naming_another_primary_outside_a_failover_does_not_move_the_mount() {
    // The primary every node names: node 0, node 1 once node 0 is down, then node 0 again (as
    // a deposed primary answering late would).
    let named = Arc::new(Mutex::new(0));
    let n = named.clone();
    let w = World::new(3, true, move |_| *n.lock().unwrap());
    let a = w.mount(MountOptions::default());
    let cl = a.cluster();
    w.lo.set_down("n0", true);
    *named.lock().unwrap() = 1;
    a.mkdir(ROOT_INO, name("d"), 0o755, 0, ME).unwrap();
    assert_eq!((cl.failovers(), cl.primary_id()), (1, 1));
    *named.lock().unwrap() = 0;
    // Node 2's queue pair cannot be made here (no data nodes): its address is asked of the
    // primary, which answers with a map naming node 0.
    assert!(cl.node(2).is_err());
    assert_eq!(
        cl.info().primary.node_id,
        1,
        "still the primary it followed"
    );
    assert_eq!(cl.connect_primary().unwrap().node_id(), 1);
    assert!(cl.info().nodes.iter().any(|n| n.node_id == 2));
}

/// Chaos on etcd: a mount fenced by the primary (its lease judged lapsed) kept sending its
/// closes in the fenced session, refused every 20 ms, until a data operation started a new
/// one. A namespace request refused as fenced now starts it, and is made there, once.
#[test]
fn a_namespace_request_refused_as_fenced_is_made_once_in_a_new_session() {
    let w = World::new(1, false, |_| 0);
    let a = w.mount(MountOptions::default());
    let cl = a.cluster();
    let first = cl.session();
    a.mkdir(ROOT_INO, name("before"), 0o755, 0, ME).unwrap();
    w.fenced.lock().unwrap().push(first);
    let d = a.mkdir(ROOT_INO, name("after"), 0o755, 0, ME).unwrap();
    assert_ne!(cl.session(), first, "a new session");
    assert_eq!(a.lookup(ROOT_INO, name("after")).unwrap().ino, d.ino);
    assert!(a.lookup(ROOT_INO, name("before")).is_ok());
    assert_eq!(cl.failovers(), 0, "the same primary");
}

#[test]
fn without_a_new_primary_a_mount_gives_up_with_eio_after_the_failover_wait() {
    let w = World::new(2, true, |_| 0);
    let a = w.mount(MountOptions::default());
    w.lo.set_down("n0", true);
    assert_eq!(
        a.mkdir(ROOT_INO, name("x"), 0o755, 0, ME),
        Err(errno(libc::EIO))
    );
    let waited = w.clock.now();
    assert!(
        waited > FAILOVER_WAIT && waited <= FAILOVER_WAIT + Duration::from_millis(200),
        "{waited:?}"
    );
    assert_eq!(a.cluster().failovers(), 0);
    assert!(w.threads.waiting().is_empty(), "no failover, no reclaim");
}

#[test]
fn a_create_without_o_excl_opens_only_a_regular_file_another_mount_made() {
    // The kernel fails a create answered with anything but a regular file with EIO (and the
    // open it made was never released); a directory is EISDIR, as open(2) answers, anything
    // else ESTALE, so the kernel looks the name up again.
    let w = World::new(1, false, |_| 0);
    let (a, b) = (
        w.mount(MountOptions::default()),
        w.mount(MountOptions::default()),
    );
    b.mkdir(ROOT_INO, name("d"), 0o755, 0, ME).unwrap();
    b.symlink(ROOT_INO, name("l"), std::path::Path::new("d"), ME)
        .unwrap();
    b.mknod(ROOT_INO, name("p"), libc::S_IFIFO | 0o644, 0, 0, ME)
        .unwrap();
    let create = |n| {
        a.create(
            ROOT_INO,
            name(n),
            0o644,
            0,
            libc::O_RDWR | libc::O_CREAT,
            ME,
        )
        .map(|(attr, _)| attr.kind)
    };
    assert_eq!(create("d"), Err(errno(libc::EISDIR)));
    assert_eq!(create("l"), Err(errno(libc::ESTALE)));
    assert_eq!(create("p"), Err(errno(libc::ESTALE)));
    b.create(
        ROOT_INO,
        name("f"),
        0o644,
        0,
        libc::O_RDWR | libc::O_CREAT,
        ME,
    )
    .unwrap();
    assert_eq!(create("f"), Ok(Kind::File), "a regular file is opened");
    // Nothing was left open: the directory goes with its name.
    let d = b.lookup(ROOT_INO, name("d")).unwrap();
    b.rmdir(ROOT_INO, name("d")).unwrap();
    assert_eq!(a.getattr(d.ino), Err(errno(libc::ENOENT)));
}
