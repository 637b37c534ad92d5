//! Reference-model tests of the client core (issue 24, item 3; mountpoint-s3's reftests are the
//! model): random sequences of namespace operations, each from one of two or three mounts'
//! [`Client`]s over one in-process cluster (the real [`MetaService`] behind
//! [`rackfs_fs::link::Loopback`], time from a [`ManualClock`]), run against a model of what
//! POSIX/Linux and doc/SEMANTICS.md promise; proptest shrinks a failure to a minimal sequence.
//!
//! What the model promises: one tree shared by every mount. A change answered on one mount is
//! seen by every other at the next call, since at this level every call goes to the primary
//! (the kernel's attribute and entry caches are the kernel's, not the core's). Each operation's
//! answer (attributes: kind, mode, nlink, owner, size, rdev, times; entries; link targets;
//! extended attribute values and sizes; or the errno, in Linux's order of checks) must be the
//! model's, and after every step each mount's walk of the whole tree must be the model's (its
//! directories' own attributes after the last step). What the core caches itself and these
//! operations can observe, a `security.capability` answer of "none" for a file the mount
//! opened and a directory's attributes its own create or unlink was answered with (served to
//! its next getattr), is kept until the mount's watcher hears of a change: the cluster here
//! pushes every change to the other mounts' caches as the primary's watch does before an
//! operation returns, so the model's answer is the tree's.
//!
//! Paths are resolved by each mount's own lookups, as the kernel would (ENOTDIR for a
//! non-directory on the way, no symlinks followed). A mount's last closes are queued (see
//! `rackfs_fs::releases`); before each step the other mounts' go out, as their sender threads
//! would within the window, while the stepping mount's own must go with its removals.
//! Mounts 0 and 2 hold their watcher's lease throughout, so they answer from what they learnt
//! and keep their files' opens past the last close (`rackfs_fs::kept`), reopening them
//! without asking.
//!
//! Left out: reads, writes, fallocate and record locks (one-sided verbs; no data nodes here);
//! truncate under the whole-file range lock (verbs too), so mounts run with `locks=off`, where
//! truncate is the service's alone; failover and fencing (`loopback.rs`, `failover.rs`);
//! xattr size limits and the virtual `rackfs.replicas` (`xattrs.rs`); read-only mounts;
//! permission checks (the kernel's, `default_permissions`); readdir cookies under changes made
//! between pages (`posix.rs`); the group and set-group-ID bit a new inode would take from a
//! set-group-ID directory on Linux (the core gives it the caller's group).
//!
//! 256 cases of up to 60 steps by default (well under a second); `RACKFS_REFTEST_CASES` asks
//! for more. A failure prints the shrunk sequence; keep it as a case of
//! `shrunk_sequences_found_so_far_agree_with_the_model`.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use rackfs_fs::caches::Caches;
use rackfs_fs::client::{AttrChange, Caller, Client, SetTime, XattrReply};
use rackfs_fs::clock::{Clock, ManualClock};
use rackfs_fs::env::Env;
use rackfs_fs::link::Loopback;
use rackfs_fs::options::{MountOptions, TransportChoice};
use rackfs_fs::spawn::Queue;
use rackfs_meta::{MemStorage, MetaService};
use rackfs_proto::control::{ClusterInfo, ControlRequest, ControlResponse, ErrorCode, NodeAddr};
use rackfs_proto::namespace::{Attr, Kind, ROOT_INO};
use rackfs_verbs::Secret;

// ---------------------------------------------------------------------------------------------
// The cluster: one node serving the real metadata service; a watcher push to the other mounts.

/// Each mount's caches by its session, for the pushes a watcher would apply.
type Watchers = Arc<Mutex<HashMap<u64, Caches>>>;

struct World {
    lo: Arc<Loopback>,
    clock: Arc<ManualClock>,
    storage: Arc<Mutex<(MetaService, MemStorage)>>,
    watchers: Watchers,
    threads: Arc<Queue>,
}

fn info() -> ClusterInfo {
    let node = NodeAddr {
        node_id: 0,
        name: "node0".into(),
        tcp: Some("n0".into()),
        shm: None,
        capacity: 16 << 20,
        qos_area: 0,
        quarantine_ms: 1000,
        domain: None,
    };
    ClusterInfo {
        primary: node.clone(),
        nodes: vec![node],
        down: Vec::new(),
        coordinator: "loopback".into(),
        elects: false,
        mounts: Vec::new(),
        epochs: Vec::new(),
        standby: None,
    }
}

impl World {
    fn new() -> World {
        let clock = Arc::new(ManualClock::default());
        let service = MetaService::new(Duration::from_secs(30), clock.wall_ns());
        let st = MemStorage::new(1, 16 << 20);
        // The service's clock reads the mounts' wall time.
        st.advance(Duration::from_nanos(
            clock.wall_ns() - rackfs_meta::Storage::wall_ns(&st),
        ));
        let storage = Arc::new(Mutex::new((service, st)));
        let watchers: Watchers = Arc::default();
        let lo = Arc::new(Loopback::new());
        let (meta, pushed) = (storage.clone(), watchers.clone());
        let closed = storage.clone();
        lo.serve(
            "n0",
            0,
            "node0",
            move |session, req| {
                let mut m = meta.lock().unwrap();
                let (svc, st) = &mut *m;
                match req {
                    ControlRequest::Cluster => ControlResponse::Cluster(Box::new(info())),
                    ControlRequest::Meta(req) => {
                        let resp = svc.handle(session, req, st);
                        // The primary's watch: every other mount hears of the change before
                        // it is answered, and forgets what it knew.
                        for change in svc.take_changes() {
                            for (_, caches) in
                                pushed.lock().unwrap().iter().filter(|(&s, _)| s != session)
                            {
                                caches.forget(&change);
                            }
                        }
                        resp
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
        World {
            lo,
            clock,
            storage,
            watchers,
            threads: Arc::new(Queue::new()),
        }
    }

    /// Mount `i`: mounts 0 and 2 let the kernel cache for a second (so the core keeps
    /// `security.capability` answers), mount 1 not at all.
    fn mount(&self, i: usize) -> Client {
        let env = Env {
            clock: self.clock.clone(),
            dial: self.lo.clone(),
            spawn: self.threads.clone(),
        };
        let secret = Secret::new(b"reference-model-secret").unwrap();
        let cluster = rackfs_fs::cluster::Cluster::connect(
            env,
            &["n0".to_string()],
            secret,
            TransportChoice::Tcp,
            None,
            "mount:/reftest",
        )
        .expect("connected over the loopback");
        let opts = MountOptions {
            attr_timeout: Duration::from_secs(if i == 1 { 0 } else { 1 }),
            locks: false,
            ..MountOptions::default()
        };
        let c = Client::new(Arc::new(cluster), opts);
        // Its look at the cluster's nodes each second (one node here) is a loop never run.
        self.threads.discard("rackfs-members");
        // A mount that caches holds its watcher's lease throughout (the pushes here stand for
        // its watcher): it answers what it learnt itself, and reopens files whose opens it kept.
        if i != 1 {
            c.caches()
                .leased
                .renew(self.clock.mono_ns(), Duration::from_secs(1));
        }
        self.watchers
            .lock()
            .unwrap()
            .insert(c.cluster().session(), c.caches());
        c
    }

    /// Moves the service's and the mounts' clocks on by a millisecond.
    fn tick(&self) {
        self.clock.advance(Duration::from_millis(1));
        self.storage
            .lock()
            .unwrap()
            .1
            .advance(Duration::from_millis(1));
    }

    /// (the service's time, the mounts' time) in ns since the epoch.
    fn now(&self) -> (u64, u64) {
        use rackfs_meta::Storage;
        (
            self.storage.lock().unwrap().1.wall_ns(),
            self.clock.wall_ns(),
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Operations.

const NAMES: [&str; 3] = ["a", "b", "c"];

/// A name: one of [`NAMES`], or (index 3) one over 255 bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Name(u8);

impl Name {
    fn bytes(self) -> Vec<u8> {
        match NAMES.get(self.0 as usize) {
            Some(n) => n.as_bytes().to_vec(),
            None => vec![b'n'; 256],
        }
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match NAMES.get(self.0 as usize) {
            Some(n) => f.write_str(n),
            None => f.write_str("n{256}"),
        }
    }
}

/// A path from the root, by names of [`NAMES`].
#[derive(Clone, PartialEq, Eq)]
struct P(Vec<u8>);

impl fmt::Debug for P {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("/");
        }
        for &c in &self.0 {
            write!(f, "/{}", NAMES[c as usize])?;
        }
        Ok(())
    }
}

/// `p/name`.
#[derive(Clone, PartialEq, Eq)]
struct At(P, Name);

impl fmt::Debug for At {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        if self.0 .0.is_empty() {
            write!(f, "/{:?}", self.1)
        } else {
            write!(f, "{:?}/{:?}", self.0, self.1)
        }
    }
}

/// A mode or umask, shown in octal.
#[derive(Clone)]
struct Mode(u32);

impl fmt::Debug for Mode {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{:#o}", self.0)
    }
}

const XATTR_NAMES: [&str; 6] = [
    "user.a",
    "user.b",
    "trusted.t",
    "security.capability",
    "system.posix_acl_access",
    "user.",
];

/// An extended attribute's name, by its index in [`XATTR_NAMES`].
#[derive(Clone, Copy)]
struct XName(usize);

impl XName {
    fn name(self) -> &'static str {
        XATTR_NAMES[self.0]
    }
}

impl fmt::Debug for XName {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Special {
    Fifo,
    Socket,
    Char,
    Block,
    Regular,
}

impl Special {
    fn mode(self) -> u32 {
        match self {
            Special::Fifo => libc::S_IFIFO,
            Special::Socket => libc::S_IFSOCK,
            Special::Char => libc::S_IFCHR,
            Special::Block => libc::S_IFBLK,
            Special::Regular => libc::S_IFREG,
        }
    }

    fn kind(self) -> Kind {
        match self {
            Special::Fifo => Kind::Fifo,
            Special::Socket => Kind::Socket,
            Special::Char => Kind::CharDev,
            Special::Block => Kind::BlockDev,
            Special::Regular => Kind::File,
        }
    }
}

/// A time a setattr sets: the mount's clock, or seconds (and a few ns) since the epoch.
#[derive(Clone, Copy, Debug)]
enum T {
    Now,
    At(u64),
}

impl T {
    fn set(self) -> SetTime {
        match self {
            T::Now => SetTime::Now,
            T::At(ns) => SetTime::At(UNIX_EPOCH + Duration::from_nanos(ns)),
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Mkdir {
        at: At,
        mode: Mode,
        umask: Mode,
        root: bool,
    },
    Create {
        at: At,
        mode: Mode,
        umask: Mode,
        excl: bool,
        trunc: bool,
        root: bool,
    },
    Mknod {
        at: At,
        kind: Special,
        mode: Mode,
        rdev: u32,
    },
    Symlink {
        at: At,
        target: &'static str,
    },
    Link {
        from: P,
        to: At,
    },
    Unlink {
        at: At,
    },
    Rmdir {
        at: At,
    },
    Rename {
        from: At,
        to: At,
        flags: u32,
    },
    SetAttr {
        path: P,
        mode: Option<Mode>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<T>,
        mtime: Option<T>,
    },
    /// Resolve a path (lookups) and getattr what it names.
    Stat {
        path: P,
    },
    /// getattr of an inode number handed out earlier (its index among them), deleted or not.
    StatIno {
        index: usize,
    },
    /// Lists a directory `page` entries per call (resuming from the last entry's cookie).
    Readdir {
        path: P,
        page: usize,
    },
    Readlink {
        path: P,
    },
    /// Opens and closes (registers the file with the mount: its capability answers are kept).
    Open {
        path: P,
    },
    SetXattr {
        path: P,
        name: XName,
        value: Vec<u8>,
        flags: u32,
    },
    GetXattr {
        path: P,
        name: XName,
        size: u32,
    },
    ListXattr {
        path: P,
        size: u32,
    },
    RemoveXattr {
        path: P,
        name: XName,
    },
}

#[derive(Clone)]
struct Step {
    mount: usize,
    op: Op,
}

impl fmt::Debug for Step {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "m{}: {:?}", self.mount, self.op)
    }
}

/// A case: how many mounts, and the steps.
#[derive(Clone)]
struct Case {
    mounts: usize,
    steps: Vec<Step>,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        writeln!(f, "{} mounts:", self.mounts)?;
        for s in &self.steps {
            writeln!(f, "  {s:?}")?;
        }
        Ok(())
    }
}

fn name() -> impl Strategy<Value = Name> {
    prop_oneof![30 => (0u8..3).prop_map(Name), 1 => Just(Name(3))]
}

/// A directory's path: mostly shallow.
fn dir() -> impl Strategy<Value = P> {
    prop_oneof![
        5 => Just(P(Vec::new())),
        4 => (0u8..3).prop_map(|c| P(vec![c])),
        1 => (0u8..3, 0u8..3).prop_map(|(a, b)| P(vec![a, b])),
    ]
}

/// Something's path (not the root): mostly one or two names deep.
fn path() -> impl Strategy<Value = P> {
    prop_oneof![
        6 => (0u8..3).prop_map(|c| P(vec![c])),
        3 => (0u8..3, 0u8..3).prop_map(|(a, b)| P(vec![a, b])),
        1 => prop::collection::vec(0u8..3, 3).prop_map(P),
    ]
}

fn at() -> impl Strategy<Value = At> {
    (dir(), name()).prop_map(|(p, n)| At(p, n))
}

fn mode(max: u32) -> impl Strategy<Value = Mode> {
    (0..=max).prop_map(Mode)
}

fn umask() -> impl Strategy<Value = Mode> {
    prop::sample::select(vec![0, 0o022, 0o077]).prop_map(Mode)
}

fn time() -> impl Strategy<Value = Option<T>> {
    prop::option::weighted(
        0.3,
        prop_oneof![
            Just(T::Now),
            (0u64..3).prop_map(|s| T::At(s * 1_000_000_007))
        ],
    )
}

fn op() -> impl Strategy<Value = Op> {
    let special = prop::sample::select(vec![
        Special::Fifo,
        Special::Socket,
        Special::Char,
        Special::Block,
        Special::Regular,
    ]);
    let flags = prop_oneof![
        6 => Just(0),
        2 => Just(libc::RENAME_NOREPLACE),
        3 => Just(libc::RENAME_EXCHANGE),
        1 => Just(libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE),
        1 => Just(libc::RENAME_WHITEOUT),
    ];
    let xname =
        prop_oneof![4 => Just(0usize), 2 => Just(1), 1 => Just(2), 3 => Just(3), 1 => 4usize..6]
            .prop_map(XName);
    // Attributes and links mostly on names at the top, so that they meet existing ones.
    let top = || prop_oneof![3 => (0u8..3).prop_map(|c| P(vec![c])), 1 => path()];
    let xsize = prop::sample::select(vec![0u32, 1, 64]);
    let owner = prop::option::weighted(0.2, prop::sample::select(vec![0u32, 100, 1000]));
    prop_oneof![
        6 => (at(), mode(0o1777), umask(), any::<bool>())
            .prop_map(|(at, mode, umask, root)| Op::Mkdir { at, mode, umask, root }),
        6 => (at(), mode(0o7777), umask(), prop::bool::weighted(0.3), prop::bool::weighted(0.3), any::<bool>())
            .prop_map(|(at, mode, umask, excl, trunc, root)| Op::Create { at, mode, umask, excl, trunc, root }),
        2 => (at(), special, mode(0o7777), prop::sample::select(vec![0u32, 0x0801]))
            .prop_map(|(at, kind, mode, rdev)| Op::Mknod { at, kind, mode, rdev }),
        2 => (at(), prop::sample::select(vec!["a", "../b", "/x/y"]))
            .prop_map(|(at, target)| Op::Symlink { at, target }),
        3 => (path(), at()).prop_map(|(from, to)| Op::Link { from, to }),
        3 => at().prop_map(|at| Op::Unlink { at }),
        3 => at().prop_map(|at| Op::Rmdir { at }),
        8 => (at(), at(), flags).prop_map(|(from, to, flags)| Op::Rename { from, to, flags }),
        3 => (path(), prop::option::weighted(0.4, mode(0o7777)), owner.clone(), owner,
              prop::option::weighted(0.3, prop::sample::select(vec![0u64, 1, 5000])), time(), time())
            .prop_map(|(path, mode, uid, gid, size, atime, mtime)| Op::SetAttr { path, mode, uid, gid, size, atime, mtime }),
        3 => path().prop_map(|path| Op::Stat { path }),
        1 => (0usize..64).prop_map(|index| Op::StatIno { index }),
        2 => (dir(), 1usize..4).prop_map(|(path, page)| Op::Readdir { path, page }),
        1 => top().prop_map(|path| Op::Readlink { path }),
        1 => path().prop_map(|path| Op::Open { path }),
        3 => (top(), xname.clone(), prop::collection::vec(any::<u8>(), 0..3), prop::sample::select(vec![0u32, 0, 0, 1, 2, 3]))
            .prop_map(|(path, name, value, flags)| Op::SetXattr { path, name, value, flags }),
        2 => (top(), xname.clone(), xsize.clone()).prop_map(|(path, name, size)| Op::GetXattr { path, name, size }),
        1 => (top(), xsize).prop_map(|(path, size)| Op::ListXattr { path, size }),
        2 => (top(), xname).prop_map(|(path, name)| Op::RemoveXattr { path, name }),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (2usize..=3, prop::collection::vec((0usize..3, op()), 1..=60)).prop_map(|(mounts, steps)| {
        Case {
            mounts,
            steps: steps
                .into_iter()
                .map(|(m, op)| Step {
                    mount: m % mounts,
                    op,
                })
                .collect(),
        }
    })
}

// ---------------------------------------------------------------------------------------------
// What an operation answers, in comparable form.

/// The attributes the model promises (everything but the layout and allocated memory).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    ino: u64,
    kind: Kind,
    perm: u16,
    nlink: u32,
    uid: u32,
    gid: u32,
    size: u64,
    rdev: u32,
    atime: u64,
    mtime: u64,
    ctime: u64,
}

fn seen(a: &Attr) -> Seen {
    Seen {
        ino: a.ino,
        kind: a.kind,
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        size: a.size,
        rdev: a.rdev,
        atime: a.atime_ns,
        mtime: a.mtime_ns,
        ctime: a.ctime_ns,
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Out {
    Done,
    Attr(Seen),
    /// A directory listing: (name, inode, kind) in the order listed.
    Entries(Vec<(String, u64, Kind)>),
    Target(String),
    Xattr(XattrReply),
}

/// An answer: what came back, or the errno.
type Answer = Result<Out, i32>;

fn e(code: i32) -> Answer {
    Err(code)
}

// ---------------------------------------------------------------------------------------------
// Running an operation on a mount, resolving paths by its own lookups as the kernel would.

const ME: Caller = Caller {
    uid: 1000,
    gid: 100,
};
const ROOT: Caller = Caller { uid: 0, gid: 0 };

fn os(b: &[u8]) -> &OsStr {
    OsStr::from_bytes(b)
}

fn resolve(c: &Client, p: &P) -> Result<Attr, i32> {
    let Some((&first, rest)) = p.0.split_first() else {
        return c.getattr(ROOT_INO).map_err(|e| e.code());
    };
    let mut a = c
        .lookup(ROOT_INO, OsStr::new(NAMES[first as usize]))
        .map_err(|e| e.code())?;
    for &n in rest {
        if a.kind != Kind::Dir {
            return Err(libc::ENOTDIR);
        }
        a = c
            .lookup(a.ino, OsStr::new(NAMES[n as usize]))
            .map_err(|e| e.code())?;
    }
    Ok(a)
}

/// The directory `p` names (ENOTDIR, from the kernel, if it is not one).
fn resolve_dir(c: &Client, p: &P) -> Result<u64, i32> {
    match resolve(c, p)? {
        a if a.kind == Kind::Dir => Ok(a.ino),
        _ => Err(libc::ENOTDIR),
    }
}

/// Lists directory `ino` taking `page` entries per call.
fn list(c: &Client, ino: u64, page: usize) -> Answer {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let mut got = Vec::new();
        c.readdir(ino, after, |e| {
            if got.len() == page {
                return true;
            }
            got.push((
                String::from_utf8_lossy(&e.name).into_owned(),
                e.ino,
                e.kind,
                e.cookie,
            ));
            false
        })
        .map_err(|e| e.code())?;
        let Some(last) = got.last() else { break };
        after = last.3;
        out.extend(got.into_iter().map(|(n, i, k, _)| (n, i, k)));
        if out.len() > 1000 {
            panic!("readdir of {ino} does not end: {out:?}");
        }
    }
    // The listing with attributes (the kernel's readdirplus) names the same entries, each
    // with its own inode's attributes.
    let mut plus = Vec::new();
    c.readdir_plus(ino, 0, |e, a| {
        assert_eq!(
            (a.ino, a.kind),
            (e.ino, e.kind),
            "readdirplus attributes of {e:?}"
        );
        plus.push((String::from_utf8_lossy(&e.name).into_owned(), e.ino, e.kind));
        plus.len() > 1000
    })
    .map_err(|e| e.code())?;
    assert_eq!(plus, out, "readdirplus and readdir of {ino} differ");
    Ok(Out::Entries(out))
}

fn attr(r: Result<Attr, rackfs_fs::client::Errno>) -> Answer {
    r.map(|a| Out::Attr(seen(&a))).map_err(|e| e.code())
}

fn run_op(c: &Client, op: &Op, known: &[u64]) -> Answer {
    let done =
        |r: Result<(), rackfs_fs::client::Errno>| r.map(|()| Out::Done).map_err(|e| e.code());
    match op {
        Op::Mkdir {
            at,
            mode,
            umask,
            root,
        } => {
            let p = resolve_dir(c, &at.0)?;
            let caller = if *root { ROOT } else { ME };
            attr(c.mkdir(p, os(&at.1.bytes()), mode.0, umask.0, caller))
        }
        Op::Create {
            at,
            mode,
            umask,
            excl,
            trunc,
            root,
        } => {
            let p = resolve_dir(c, &at.0)?;
            let caller = if *root { ROOT } else { ME };
            let mut flags = libc::O_RDWR | libc::O_CREAT;
            if *excl {
                flags |= libc::O_EXCL;
            }
            if *trunc {
                flags |= libc::O_TRUNC;
            }
            let (a, opened) = c
                .create(
                    p,
                    os(&at.1.bytes()),
                    libc::S_IFREG | mode.0,
                    umask.0,
                    flags,
                    caller,
                )
                .map_err(|e| e.code())?;
            c.release(a.ino, opened.fh).map_err(|e| e.code())?;
            Ok(Out::Attr(seen(&a)))
        }
        Op::Mknod {
            at,
            kind,
            mode,
            rdev,
        } => {
            let p = resolve_dir(c, &at.0)?;
            attr(c.mknod(p, os(&at.1.bytes()), kind.mode() | mode.0, 0o022, *rdev, ME))
        }
        Op::Symlink { at, target } => {
            let p = resolve_dir(c, &at.0)?;
            attr(c.symlink(p, os(&at.1.bytes()), Path::new(target), ME))
        }
        Op::Link { from, to } => {
            let src = resolve(c, from)?;
            let p = resolve_dir(c, &to.0)?;
            attr(c.link(src.ino, p, os(&to.1.bytes())))
        }
        Op::Unlink { at } => {
            let p = resolve_dir(c, &at.0)?;
            done(c.unlink(p, os(&at.1.bytes())))
        }
        Op::Rmdir { at } => {
            let p = resolve_dir(c, &at.0)?;
            done(c.rmdir(p, os(&at.1.bytes())))
        }
        Op::Rename { from, to, flags } => {
            let p = resolve_dir(c, &from.0)?;
            let np = resolve_dir(c, &to.0)?;
            done(c.rename(p, os(&from.1.bytes()), np, os(&to.1.bytes()), *flags))
        }
        Op::SetAttr {
            path,
            mode,
            uid,
            gid,
            size,
            atime,
            mtime,
        } => {
            let a = resolve(c, path)?;
            let change = AttrChange {
                mode: mode.as_ref().map(|m| m.0),
                uid: *uid,
                gid: *gid,
                size: *size,
                atime: atime.map(T::set),
                mtime: mtime.map(T::set),
            };
            attr(c.setattr(a.ino, change))
        }
        Op::Stat { path } if path.0.is_empty() => attr(c.getattr(ROOT_INO)),
        Op::Stat { path } => {
            let a = resolve(c, path)?;
            attr(c.getattr(a.ino))
        }
        Op::StatIno { index } => match known.get(index % known.len().max(1)) {
            Some(&ino) => attr(c.getattr(ino)),
            None => Ok(Out::Done),
        },
        Op::Readdir { path, page } => {
            let a = resolve(c, path)?;
            list(c, a.ino, *page)
        }
        Op::Readlink { path } => {
            let a = resolve(c, path)?;
            c.readlink(a.ino)
                .map(|t| Out::Target(String::from_utf8_lossy(&t).into_owned()))
                .map_err(|e| e.code())
        }
        Op::Open { path } => {
            let a = resolve(c, path)?;
            let opened = c.open(a.ino, libc::O_RDONLY).map_err(|e| e.code())?;
            done(c.release(a.ino, opened.fh))
        }
        Op::SetXattr {
            path,
            name,
            value,
            flags,
        } => {
            let a = resolve(c, path)?;
            done(c.setxattr(a.ino, OsStr::new(name.name()), value, *flags as i32, 0))
        }
        Op::GetXattr { path, name, size } => {
            let a = resolve(c, path)?;
            c.getxattr(a.ino, OsStr::new(name.name()), *size)
                .map(Out::Xattr)
                .map_err(|e| e.code())
        }
        Op::ListXattr { path, size } => {
            let a = resolve(c, path)?;
            c.listxattr(a.ino, *size)
                .map(Out::Xattr)
                .map_err(|e| e.code())
        }
        Op::RemoveXattr { path, name } => {
            let a = resolve(c, path)?;
            done(c.removexattr(a.ino, OsStr::new(name.name())))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The model: one tree of names, inodes keyed by the numbers the service handed out.

#[derive(Clone, Debug)]
enum MKind {
    File { size: u64 },
    Dir { entries: BTreeMap<Vec<u8>, u64> },
    Symlink { target: Vec<u8> },
    Special(Kind),
}

#[derive(Clone, Debug)]
struct MInode {
    kind: MKind,
    perm: u16,
    uid: u32,
    gid: u32,
    rdev: u32,
    atime: u64,
    mtime: u64,
    ctime: u64,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

/// What a creation makes: its kind, permission bits and device number.
struct New {
    kind: MKind,
    perm: u16,
    rdev: u32,
}

/// The reference: inodes keyed by the numbers the service handed out, directories as name
/// maps; link counts are derived from the tree, not kept.
struct Model {
    inodes: BTreeMap<u64, MInode>,
    /// Every inode number handed out, in order (the deleted ones must answer ENOENT).
    ever: Vec<u64>,
    /// The service's time and the mounts' (`SetTime::Now`) for the step being run.
    now: u64,
    mount_now: u64,
    /// Which operations ran and how many succeeded, for the summary.
    tally: BTreeMap<&'static str, (u64, u64)>,
}

fn check_name(name: &[u8]) -> Result<(), i32> {
    if name.len() > 255 {
        return Err(libc::ENAMETOOLONG);
    }
    Ok(())
}

impl Model {
    fn new(root: &Attr) -> Model {
        let r = MInode {
            kind: MKind::Dir {
                entries: BTreeMap::new(),
            },
            perm: root.perm,
            uid: root.uid,
            gid: root.gid,
            rdev: 0,
            atime: root.atime_ns,
            mtime: root.mtime_ns,
            ctime: root.ctime_ns,
            xattrs: BTreeMap::new(),
        };
        Model {
            inodes: BTreeMap::from([(ROOT_INO, r)]),
            ever: vec![ROOT_INO],
            now: 0,
            mount_now: 0,
            tally: BTreeMap::new(),
        }
    }

    fn is_dir(&self, ino: u64) -> bool {
        matches!(self.inodes[&ino].kind, MKind::Dir { .. })
    }

    fn entries(&self, dir: u64) -> &BTreeMap<Vec<u8>, u64> {
        match &self.inodes[&dir].kind {
            MKind::Dir { entries } => entries,
            _ => panic!("{dir} is not a directory"),
        }
    }

    fn entries_mut(&mut self, dir: u64) -> &mut BTreeMap<Vec<u8>, u64> {
        match &mut self.inodes.get_mut(&dir).expect("dir").kind {
            MKind::Dir { entries } => entries,
            _ => panic!("{dir} is not a directory"),
        }
    }

    fn parent_of(&self, dir: u64) -> u64 {
        if dir == ROOT_INO {
            return ROOT_INO;
        }
        self.inodes
            .iter()
            .find(|(_, i)| matches!(&i.kind, MKind::Dir { entries } if entries.values().any(|&c| c == dir)))
            .map(|(&p, _)| p)
            .expect("a directory has a parent")
    }

    /// Whether directory `a` is `b` or one of its ancestors.
    fn contains(&self, a: u64, b: u64) -> bool {
        let mut p = b;
        loop {
            if p == a {
                return true;
            }
            if p == ROOT_INO {
                return false;
            }
            p = self.parent_of(p);
        }
    }

    fn names(&self, ino: u64) -> u32 {
        self.inodes
            .values()
            .map(|i| match &i.kind {
                MKind::Dir { entries } => entries.values().filter(|&&c| c == ino).count() as u32,
                _ => 0,
            })
            .sum()
    }

    fn nlink(&self, ino: u64) -> u32 {
        match &self.inodes[&ino].kind {
            MKind::Dir { entries } => {
                2 + entries.values().filter(|&&c| self.is_dir(c)).count() as u32
            }
            _ => self.names(ino),
        }
    }

    fn seen(&self, ino: u64) -> Seen {
        let i = &self.inodes[&ino];
        let (kind, size) = match &i.kind {
            MKind::File { size } => (Kind::File, *size),
            MKind::Dir { .. } => (Kind::Dir, 4096),
            MKind::Symlink { target } => (Kind::Symlink, target.len() as u64),
            MKind::Special(k) => (*k, 0),
        };
        Seen {
            ino,
            kind,
            perm: i.perm,
            nlink: self.nlink(ino),
            uid: i.uid,
            gid: i.gid,
            size,
            rdev: i.rdev,
            atime: i.atime,
            mtime: i.mtime,
            ctime: i.ctime,
        }
    }

    fn attr(&self, ino: u64) -> Answer {
        Ok(Out::Attr(self.seen(ino)))
    }

    /// Drops inodes no name reaches (every open is closed when its operation ends).
    fn collect(&mut self) {
        loop {
            let dead: Vec<u64> = self
                .inodes
                .keys()
                .copied()
                .filter(|&i| i != ROOT_INO && self.names(i) == 0)
                .collect();
            if dead.is_empty() {
                return;
            }
            for i in dead {
                self.inodes.remove(&i);
            }
        }
    }

    fn resolve(&self, p: &P) -> Result<u64, i32> {
        let mut cur = ROOT_INO;
        for &n in &p.0 {
            if !self.is_dir(cur) {
                return Err(libc::ENOTDIR);
            }
            cur = *self
                .entries(cur)
                .get(NAMES[n as usize].as_bytes())
                .ok_or(libc::ENOENT)?;
        }
        Ok(cur)
    }

    fn resolve_dir(&self, p: &P) -> Result<u64, i32> {
        let d = self.resolve(p)?;
        if self.is_dir(d) {
            Ok(d)
        } else {
            Err(libc::ENOTDIR)
        }
    }

    /// A parent's entry changed.
    fn touch_dir(&mut self, dir: u64) {
        let now = self.now;
        let d = self.inodes.get_mut(&dir).expect("dir");
        d.mtime = now;
        d.ctime = now;
    }

    /// A new inode named `name` in `parent`, made by `caller`, numbered as the service
    /// answered (`got`).
    fn create(
        &mut self,
        parent: u64,
        name: &[u8],
        new: New,
        caller: Caller,
        got: &Answer,
    ) -> Answer {
        check_name(name)?;
        if self.entries(parent).contains_key(name) {
            return e(libc::EEXIST);
        }
        // The number the service chose, if it is a fresh one.
        let ino = match got {
            Ok(Out::Attr(a)) if !self.ever.contains(&a.ino) => a.ino,
            _ => u64::MAX,
        };
        let now = self.now;
        self.inodes.insert(
            ino,
            MInode {
                kind: new.kind,
                perm: new.perm,
                uid: caller.uid,
                gid: caller.gid,
                rdev: new.rdev,
                atime: now,
                mtime: now,
                ctime: now,
                xattrs: BTreeMap::new(),
            },
        );
        self.ever.push(ino);
        self.entries_mut(parent).insert(name.to_vec(), ino);
        self.touch_dir(parent);
        self.attr(ino)
    }

    /// Truncates file `ino` to `size`.
    fn truncate(&mut self, ino: u64, size: u64) -> Result<(), i32> {
        let now = self.now;
        let i = self.inodes.get_mut(&ino).expect("inode");
        match &mut i.kind {
            MKind::File { size: s } => *s = size,
            MKind::Dir { .. } => return Err(libc::EISDIR),
            _ => return Err(libc::EINVAL),
        }
        i.mtime = now;
        Ok(())
    }

    fn remove(&mut self, parent: u64, name: &[u8], dir: bool) -> Answer {
        check_name(name)?;
        let ino = *self.entries(parent).get(name).ok_or(libc::ENOENT)?;
        match (dir, self.is_dir(ino)) {
            (true, false) => return e(libc::ENOTDIR),
            (false, true) => return e(libc::EISDIR),
            (true, true) if !self.entries(ino).is_empty() => return e(libc::ENOTEMPTY),
            _ => {}
        }
        self.entries_mut(parent).remove(name);
        self.touch_dir(parent);
        let now = self.now;
        self.inodes.get_mut(&ino).expect("inode").ctime = now;
        self.collect();
        Ok(Out::Done)
    }

    /// Linux's `renameat2` order: flags, names, the source, NOREPLACE, EXCHANGE's target, the
    /// ancestor traps, the same inode, kinds, emptiness.
    fn rename(&mut self, p: u64, name: &[u8], np: u64, nname: &[u8], flags: u32) -> Answer {
        let (noreplace, exchange) = (libc::RENAME_NOREPLACE, libc::RENAME_EXCHANGE);
        if flags & !(noreplace | exchange) != 0 {
            return e(libc::EINVAL);
        }
        check_name(name)?;
        check_name(nname)?;
        if flags == noreplace | exchange {
            return e(libc::EINVAL);
        }
        let src = *self.entries(p).get(name).ok_or(libc::ENOENT)?;
        let dst = self.entries(np).get(nname).copied();
        if flags & noreplace != 0 && dst.is_some() {
            return e(libc::EEXIST);
        }
        let exchange = flags & exchange != 0;
        if exchange && dst.is_none() {
            return e(libc::ENOENT);
        }
        if self.is_dir(src) && self.contains(src, np) {
            return e(libc::EINVAL);
        }
        if dst.is_some_and(|d| self.is_dir(d) && self.contains(d, p)) {
            return e(if exchange {
                libc::EINVAL
            } else {
                libc::ENOTEMPTY
            });
        }
        if dst == Some(src) {
            return Ok(Out::Done);
        }
        let now = self.now;
        if exchange {
            let dst = dst.expect("checked");
            self.entries_mut(p).insert(name.to_vec(), dst);
            self.entries_mut(np).insert(nname.to_vec(), src);
            for ino in [src, dst] {
                self.inodes.get_mut(&ino).expect("inode").ctime = now;
            }
            self.touch_dir(p);
            self.touch_dir(np);
            return Ok(Out::Done);
        }
        if let Some(d) = dst {
            match (self.is_dir(src), self.is_dir(d)) {
                (true, false) => return e(libc::ENOTDIR),
                (false, true) => return e(libc::EISDIR),
                (true, true) if !self.entries(d).is_empty() => return e(libc::ENOTEMPTY),
                _ => {}
            }
            self.inodes.get_mut(&d).expect("inode").ctime = now;
        }
        self.entries_mut(p).remove(name);
        self.entries_mut(np).insert(nname.to_vec(), src);
        self.inodes.get_mut(&src).expect("inode").ctime = now;
        self.touch_dir(p);
        self.touch_dir(np);
        self.collect();
        Ok(Out::Done)
    }

    /// An xattr name's namespace: `user.`, `trusted.`, `security.` are kept, others refused.
    fn xattr_name(name: &str) -> Result<(), i32> {
        match ["user.", "trusted.", "security."]
            .iter()
            .find(|p| name.starts_with(**p))
        {
            Some(p) if name.len() == p.len() => Err(libc::EINVAL),
            Some(_) => Ok(()),
            None => Err(libc::EOPNOTSUPP),
        }
    }

    fn xattr_reply(value: Vec<u8>, size: u32) -> Answer {
        match size {
            0 => Ok(Out::Xattr(XattrReply::Size(value.len() as u32))),
            s if value.len() > s as usize => e(libc::ERANGE),
            _ => Ok(Out::Xattr(XattrReply::Data(value))),
        }
    }

    /// What `op` answers, applying it; `got` is what the mount answered (the new inode's
    /// number is the service's to choose).
    fn apply(&mut self, op: &Op, got: &Answer) -> Answer {
        match op {
            Op::Mkdir {
                at,
                mode,
                umask,
                root,
            } => {
                let p = self.resolve_dir(&at.0)?;
                let kind = MKind::Dir {
                    entries: BTreeMap::new(),
                };
                let perm = (mode.0 & !umask.0 & 0o7777) as u16;
                let caller = if *root { ROOT } else { ME };
                self.create(
                    p,
                    &at.1.bytes(),
                    New {
                        kind,
                        perm,
                        rdev: 0,
                    },
                    caller,
                    got,
                )
            }
            Op::Create {
                at,
                mode,
                umask,
                excl,
                trunc,
                root,
            } => {
                let p = self.resolve_dir(&at.0)?;
                let name = at.1.bytes();
                check_name(&name)?;
                match self.entries(p).get(&name).copied() {
                    // open(2) with O_CREAT of a name that exists: EEXIST with O_EXCL, EISDIR
                    // for a directory, else it opens it (and O_TRUNC empties a regular file).
                    Some(_) if *excl => e(libc::EEXIST),
                    Some(ino) if self.is_dir(ino) => e(libc::EISDIR),
                    // The kernel looks again (and follows the link, or opens the special file).
                    Some(ino) if !matches!(self.inodes[&ino].kind, MKind::File { .. }) => {
                        e(libc::ESTALE)
                    }
                    Some(ino) => {
                        if *trunc && matches!(self.inodes[&ino].kind, MKind::File { .. }) {
                            self.truncate(ino, 0)?;
                            self.inodes.get_mut(&ino).expect("inode").ctime = self.now;
                        }
                        self.attr(ino)
                    }
                    None => {
                        let perm = (mode.0 & !umask.0 & 0o7777) as u16;
                        let caller = if *root { ROOT } else { ME };
                        self.create(
                            p,
                            &name,
                            New {
                                kind: MKind::File { size: 0 },
                                perm,
                                rdev: 0,
                            },
                            caller,
                            got,
                        )
                    }
                }
            }
            Op::Mknod {
                at,
                kind,
                mode,
                rdev,
            } => {
                let p = self.resolve_dir(&at.0)?;
                let perm = (mode.0 & !0o022 & 0o7777) as u16;
                let (k, rdev) = match kind.kind() {
                    Kind::File => (MKind::File { size: 0 }, 0),
                    k => (MKind::Special(k), *rdev),
                };
                self.create(
                    p,
                    &at.1.bytes(),
                    New {
                        kind: k,
                        perm,
                        rdev,
                    },
                    ME,
                    got,
                )
            }
            Op::Symlink { at, target } => {
                let p = self.resolve_dir(&at.0)?;
                let kind = MKind::Symlink {
                    target: target.as_bytes().to_vec(),
                };
                self.create(
                    p,
                    &at.1.bytes(),
                    New {
                        kind,
                        perm: 0o777,
                        rdev: 0,
                    },
                    ME,
                    got,
                )
            }
            Op::Link { from, to } => {
                let src = self.resolve(from)?;
                let p = self.resolve_dir(&to.0)?;
                let name = to.1.bytes();
                check_name(&name)?;
                if self.entries(p).contains_key(&name) {
                    return e(libc::EEXIST);
                }
                if self.is_dir(src) {
                    return e(libc::EPERM);
                }
                self.entries_mut(p).insert(name, src);
                self.touch_dir(p);
                self.inodes.get_mut(&src).expect("inode").ctime = self.now;
                self.attr(src)
            }
            Op::Unlink { at } => {
                let p = self.resolve_dir(&at.0)?;
                self.remove(p, &at.1.bytes(), false)
            }
            Op::Rmdir { at } => {
                let p = self.resolve_dir(&at.0)?;
                self.remove(p, &at.1.bytes(), true)
            }
            Op::Rename { from, to, flags } => {
                let p = self.resolve_dir(&from.0)?;
                let np = self.resolve_dir(&to.0)?;
                self.rename(p, &from.1.bytes(), np, &to.1.bytes(), *flags)
            }
            Op::SetAttr {
                path,
                mode,
                uid,
                gid,
                size,
                atime,
                mtime,
            } => {
                let ino = self.resolve(path)?;
                if let Some(s) = size {
                    self.truncate(ino, *s)?;
                }
                let (now, mount_now) = (self.now, self.mount_now);
                let at = |t: T| match t {
                    T::Now => mount_now,
                    T::At(ns) => ns,
                };
                let i = self.inodes.get_mut(&ino).expect("inode");
                if let Some(m) = mode {
                    i.perm = (m.0 & 0o7777) as u16;
                }
                i.uid = uid.unwrap_or(i.uid);
                i.gid = gid.unwrap_or(i.gid);
                if let Some(t) = atime {
                    i.atime = at(*t);
                }
                if let Some(t) = mtime {
                    i.mtime = at(*t);
                }
                i.ctime = now;
                self.attr(ino)
            }
            Op::Stat { path } => {
                let ino = self.resolve(path)?;
                self.attr(ino)
            }
            Op::StatIno { index } => match self.ever.get(index % self.ever.len()) {
                Some(ino) if self.inodes.contains_key(ino) => self.attr(*ino),
                Some(_) => e(libc::ENOENT),
                None => Ok(Out::Done),
            },
            Op::Readdir { path, .. } => {
                let ino = self.resolve(path)?;
                if !self.is_dir(ino) {
                    return e(libc::ENOTDIR);
                }
                Ok(self.listing(ino))
            }
            Op::Readlink { path } => match &self.inodes[&self.resolve(path)?].kind {
                MKind::Symlink { target } => {
                    Ok(Out::Target(String::from_utf8_lossy(target).into_owned()))
                }
                _ => e(libc::EINVAL),
            },
            Op::Open { path } => self.resolve(path).map(|_| Out::Done),
            Op::SetXattr {
                path,
                name,
                value,
                flags,
            } => {
                let ino = self.resolve(path)?;
                let n = name.name();
                Self::xattr_name(n)?;
                let (create, replace) = (libc::XATTR_CREATE as u32, libc::XATTR_REPLACE as u32);
                if *flags & !(create | replace) != 0 || *flags == create | replace {
                    return e(libc::EINVAL);
                }
                let now = self.now;
                let i = self.inodes.get_mut(&ino).expect("inode");
                match (i.xattrs.contains_key(n.as_bytes()), *flags) {
                    (true, f) if f == create => return e(libc::EEXIST),
                    (false, f) if f == replace => return e(libc::ENODATA),
                    _ => {}
                }
                i.xattrs.insert(n.as_bytes().to_vec(), value.clone());
                i.ctime = now;
                Ok(Out::Done)
            }
            Op::GetXattr { path, name, size } => {
                let ino = self.resolve(path)?;
                let n = name.name();
                Self::xattr_name(n)?;
                let v = self.inodes[&ino]
                    .xattrs
                    .get(n.as_bytes())
                    .ok_or(libc::ENODATA)?;
                Self::xattr_reply(v.clone(), *size)
            }
            Op::ListXattr { path, size } => {
                let ino = self.resolve(path)?;
                Self::xattr_reply(self.xattr_list(ino), *size)
            }
            Op::RemoveXattr { path, name } => {
                let ino = self.resolve(path)?;
                let n = name.name();
                Self::xattr_name(n)?;
                let now = self.now;
                let i = self.inodes.get_mut(&ino).expect("inode");
                i.xattrs.remove(n.as_bytes()).ok_or(libc::ENODATA)?;
                i.ctime = now;
                Ok(Out::Done)
            }
        }
    }

    /// A directory's listing: `.`, `..`, then its names (the order is compared as a set).
    fn listing(&self, dir: u64) -> Out {
        let mut out = vec![
            (".".to_string(), dir, Kind::Dir),
            ("..".to_string(), self.parent_of(dir), Kind::Dir),
        ];
        for (name, &ino) in self.entries(dir) {
            out.push((
                String::from_utf8_lossy(name).into_owned(),
                ino,
                self.seen(ino).kind,
            ));
        }
        Out::Entries(out)
    }

    fn xattr_list(&self, ino: u64) -> Vec<u8> {
        let mut names = Vec::new();
        for n in self.inodes[&ino].xattrs.keys() {
            names.extend_from_slice(n);
            names.push(0);
        }
        names
    }
}

/// A listing with `.` and `..` first and the names sorted: the order of the names is the
/// service's to choose.
fn sorted(a: Answer) -> Answer {
    match a {
        Ok(Out::Entries(mut v)) => {
            let dots = v.len().min(2);
            v[dots..].sort_by(|a, b| a.0.cmp(&b.0));
            Ok(Out::Entries(v))
        }
        other => other,
    }
}

fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Mkdir { .. } => "mkdir",
        Op::Create { .. } => "create",
        Op::Mknod { .. } => "mknod",
        Op::Symlink { .. } => "symlink",
        Op::Link { .. } => "link",
        Op::Unlink { .. } => "unlink",
        Op::Rmdir { .. } => "rmdir",
        Op::Rename { .. } => "rename",
        Op::SetAttr { .. } => "setattr",
        Op::Stat { .. } => "stat",
        Op::StatIno { .. } => "stat-ino",
        Op::Readdir { .. } => "readdir",
        Op::Readlink { .. } => "readlink",
        Op::Open { .. } => "open",
        Op::SetXattr { .. } => "setxattr",
        Op::GetXattr { .. } => "getxattr",
        Op::ListXattr { .. } => "listxattr",
        Op::RemoveXattr { .. } => "removexattr",
    }
}

// ---------------------------------------------------------------------------------------------
// Running a case.

/// Walks the whole tree through mount `c` (readdir, lookup, getattr, readlink, xattrs, and a
/// `security.capability` query on everything) and compares it with the model.
/// Directory attributes a mount may answer a getattr with instead of the tree's: those its own
/// last change of the directory (a create or unlink in it) was answered with, until another
/// change of its own or one pushed by another mount (see `Caches::forget`). Other mounts'
/// creations are not pushed, so those attributes may miss them, as the kernel's cache does.
type Learnt = HashMap<u64, Answer>;

/// Whether `op` is a namespace change (after which the mount keeps no learnt attributes but
/// the ones its answer carried).
fn changes(op: &Op) -> bool {
    matches!(
        op,
        Op::Mkdir { .. }
            | Op::Create { .. }
            | Op::Mknod { .. }
            | Op::Symlink { .. }
            | Op::Link { .. }
            | Op::Unlink { .. }
            | Op::Rmdir { .. }
            | Op::Rename { .. }
            | Op::SetAttr { .. }
            | Op::SetXattr { .. }
            | Op::RemoveXattr { .. }
    )
}

/// The inode `at` names in the model now, if any.
fn named(m: &Model, at: &At) -> Option<u64> {
    let n = at.1 .0;
    if n as usize >= NAMES.len() {
        return None;
    }
    let mut p = at.0.clone();
    p.0.push(n);
    m.resolve(&p).ok()
}

/// The inodes other mounts forget when `op` succeeds (the primary's pushed changes: names
/// removed or replaced, with their directories; inodes whose attributes change), by the model
/// before it runs.
fn pushed_by(m: &Model, op: &Op) -> Vec<u64> {
    let dir = |p: &P| m.resolve(p).ok();
    let v = match op {
        Op::Unlink { at } | Op::Rmdir { at } => vec![dir(&at.0), named(m, at)],
        Op::Rename { from, to, .. } => vec![dir(&from.0), dir(&to.0), named(m, to)],
        Op::SetAttr { path, .. } | Op::SetXattr { path, .. } | Op::RemoveXattr { path, .. } => {
            vec![dir(path)]
        }
        Op::Link { from, .. } => vec![dir(from)],
        _ => Vec::new(),
    };
    v.into_iter().flatten().collect()
}

/// The directory whose attributes `op`'s answer carries if it succeeds: a file's create (not
/// an open of an existing name), an unlink, an rmdir.
fn learning_dir(m: &Model, op: &Op) -> Option<u64> {
    match op {
        Op::Create { at, .. } if named(m, at).is_none() => m.resolve(&at.0).ok(),
        Op::Unlink { at } | Op::Rmdir { at } => m.resolve(&at.0).ok(),
        _ => None,
    }
}

/// Compares mount `mount`'s whole tree with the model's. Directories' own attributes only when
/// given what the mount may have `learnt`: a getattr takes that, which a check after every
/// step would do before any later step could see it stale.
fn compare(
    c: &Client,
    m: &Model,
    mount: usize,
    mut learnt: Option<&mut Learnt>,
) -> Result<(), TestCaseError> {
    let mut dirs = vec![(ROOT_INO, "/".to_string())];
    while let Some((dir, path)) = dirs.pop() {
        prop_assert_eq!(
            sorted(list(c, dir, 256)),
            sorted(Ok(m.listing(dir))),
            "m{} lists {}",
            mount,
            path
        );
        if let Some(learnt) = learnt.as_deref_mut() {
            let got = attr(c.getattr(dir));
            if learnt.remove(&dir).as_ref() != Some(&got) {
                prop_assert_eq!(got, m.attr(dir), "m{} stats {}", mount, path);
            }
        }
        for (name, &ino) in m.entries(dir) {
            let at = format!("{}{}", path, String::from_utf8_lossy(name));
            prop_assert_eq!(
                attr(c.lookup(dir, os(name))),
                m.attr(ino),
                "m{} looks up {}",
                mount,
                at
            );
            if let MKind::Symlink { target } = &m.inodes[&ino].kind {
                let got = c.readlink(ino).map_err(|e| e.code());
                prop_assert_eq!(got, Ok(target.clone()), "m{} reads link {}", mount, at);
            }
            let listed = c.listxattr(ino, 4096).map_err(|e| e.code());
            prop_assert_eq!(
                listed,
                Ok(XattrReply::Data(m.xattr_list(ino))),
                "m{} lists xattrs of {}",
                mount,
                at
            );
            for n in ["user.a", "security.capability"] {
                let got = c.getxattr(ino, OsStr::new(n), 64).map_err(|e| e.code());
                let want = m.inodes[&ino]
                    .xattrs
                    .get(n.as_bytes())
                    .cloned()
                    .map(XattrReply::Data);
                prop_assert_eq!(
                    got,
                    want.ok_or(libc::ENODATA),
                    "m{} gets {} of {}",
                    mount,
                    n,
                    at
                );
            }
            if m.is_dir(ino) {
                dirs.push((ino, format!("{at}/")));
            }
        }
    }
    Ok(())
}

fn run(case: &Case) -> Result<BTreeMap<&'static str, (u64, u64)>, TestCaseError> {
    let w = World::new();
    let mounts: Vec<Client> = (0..case.mounts).map(|i| w.mount(i)).collect();
    let root = mounts[0].getattr(ROOT_INO).expect("the root");
    let mut m = Model::new(&root);
    // Per mount, the directory attributes it may still answer from its own last change.
    let mut learnt: Vec<Learnt> = vec![Learnt::new(); case.mounts];
    for (i, step) in case.steps.iter().enumerate() {
        w.tick();
        (m.now, m.mount_now) = w.now();
        // The other mounts' queued last closes go out, as their sender threads would send
        // them within the window; the stepping mount's own must go with its removals. Every
        // mount's kept opens that a change it heard doomed go back, as its sender thread
        // gives them back within its sweep.
        for (j, c) in mounts.iter().enumerate() {
            if j != step.mount {
                c.releases().send(&c.cluster());
            }
            c.releases().send_given_back(&c.cluster());
        }
        let c = &mounts[step.mount];
        let pushed = pushed_by(&m, &step.op);
        let learns = learning_dir(&m, &step.op).filter(|_| step.mount != 1);
        let stat = match &step.op {
            Op::Stat { path } => m.resolve(path).ok(),
            Op::StatIno { index } => m.ever.get(index % m.ever.len().max(1)).copied(),
            _ => None,
        };
        let got = run_op(c, &step.op, &m.ever);
        let want = m.apply(&step.op, &got);
        let (got, want) = match step.op {
            Op::Readdir { .. } => (sorted(got), sorted(want)),
            _ => (got, want),
        };
        let stale = stat.and_then(|ino| learnt[step.mount].remove(&ino));
        if stale.as_ref() != Some(&got) {
            prop_assert_eq!(&got, &want, "step {}: {:?}", i, step);
        }
        if got.is_ok() && changes(&step.op) {
            learnt[step.mount].clear();
            for (k, l) in learnt.iter_mut().enumerate() {
                if k != step.mount {
                    pushed.iter().for_each(|ino| _ = l.remove(ino));
                }
            }
            if let Some(dir) = learns {
                learnt[step.mount].insert(dir, m.attr(dir));
            }
        }
        let t = m.tally.entry(op_name(&step.op)).or_default();
        t.0 += 1;
        t.1 += u64::from(got.is_ok());
        for (j, c) in mounts.iter().enumerate() {
            compare(c, &m, j, None)
                .map_err(|e| TestCaseError::fail(format!("after step {i} ({step:?}): {e}")))?;
        }
    }
    for (j, c) in mounts.iter().enumerate() {
        compare(c, &m, j, Some(&mut learnt[j]))
            .map_err(|e| TestCaseError::fail(format!("after the last step: {e}")))?;
    }
    // Every inode the model dropped is gone from the service (no open or name kept it) once
    // the mounts' queued last closes went out.
    for c in &mounts {
        c.releases().send(&c.cluster());
    }
    for &ino in &m.ever {
        if !m.inodes.contains_key(&ino) {
            prop_assert_eq!(
                attr(mounts[0].getattr(ino)),
                e(libc::ENOENT),
                "inode {} should be gone",
                ino
            );
        }
    }
    prop_assert!(
        w.threads.waiting().is_empty(),
        "threads started: {:?}",
        w.threads.waiting()
    );
    Ok(std::mem::take(&mut m.tally))
}

/// How many cases: 256 by default (well under a minute in a debug build),
/// `RACKFS_REFTEST_CASES` for more.
fn cases() -> u32 {
    std::env::var("RACKFS_REFTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

#[test]
fn mounts_agree_with_the_reference_model() {
    let config = Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let tally = Arc::new(Mutex::new(BTreeMap::<&'static str, (u64, u64)>::new()));
    let sum = tally.clone();
    let result = runner.run(&case(), move |case| {
        for (op, (n, ok)) in run(&case)? {
            let mut t = sum.lock().unwrap();
            let e = t.entry(op).or_default();
            e.0 += n;
            e.1 += ok;
        }
        Ok(())
    });
    match result {
        Ok(()) => {
            let t = tally.lock().unwrap();
            let parts: Vec<String> = t
                .iter()
                .map(|(op, (n, ok))| format!("{op} {ok}/{n}"))
                .collect();
            println!(
                "reference model: {} cases; ops ok/run: {}",
                cases(),
                parts.join(", ")
            );
        }
        Err(TestError::Fail(why, case)) => panic!("{why}\nminimal failing sequence:\n{case:?}"),
        Err(e) => panic!("{e}"),
    }
}

/// Runs `steps` (mount, operation) on `mounts` mounts: a shrunk sequence kept as a test.
fn replay(mounts: usize, steps: Vec<(usize, Op)>) {
    let steps = steps
        .into_iter()
        .map(|(mount, op)| Step { mount, op })
        .collect();
    if let Err(e) = run(&Case { mounts, steps }) {
        panic!("{e}");
    }
}

#[test]
fn shrunk_sequences_found_so_far_agree_with_the_model() {
    let (a, b) = (Name(0), Name(1));
    let root = || P(Vec::new());
    // A create without O_EXCL over a directory another mount made opened the directory.
    let create = Op::Create {
        at: At(root(), b),
        mode: Mode(0o644),
        umask: Mode(0),
        excl: false,
        trunc: false,
        root: false,
    };
    let mkdir = |n| Op::Mkdir {
        at: At(root(), n),
        mode: Mode(0o755),
        umask: Mode(0),
        root: false,
    };
    replay(2, vec![(1, mkdir(b)), (0, create)]);
    // RENAME_EXCHANGE left the directories' mtime as it was.
    let fifo = Op::Mknod {
        at: At(root(), a),
        kind: Special::Fifo,
        mode: Mode(0o644),
        rdev: 0,
    };
    let exchange = Op::Rename {
        from: At(root(), a),
        to: At(root(), b),
        flags: libc::RENAME_EXCHANGE,
    };
    replay(2, vec![(0, fifo), (1, mkdir(b)), (0, exchange)]);
    // A file this mount closed (its release still queued) and then removed is gone when the
    // removal returns.
    let create = |n| Op::Create {
        at: At(root(), n),
        mode: Mode(0o644),
        umask: Mode(0),
        excl: false,
        trunc: false,
        root: false,
    };
    let unlink = Op::Unlink { at: At(root(), a) };
    replay(
        1,
        vec![(0, create(a)), (0, unlink), (0, Op::StatIno { index: 1 })],
    );
    let rename = Op::Rename {
        from: At(root(), b),
        to: At(root(), a),
        flags: 0,
    };
    let stat_a = Op::StatIno { index: 1 };
    replay(
        1,
        vec![(0, create(a)), (0, create(b)), (0, rename), (0, stat_a)],
    );
    // A directory's open is never kept past its close: its rmdir leaves nothing behind.
    let open = Op::Open { path: P(vec![a.0]) };
    let rmdir = Op::Rmdir { at: At(root(), a) };
    replay(2, vec![(0, mkdir(a)), (0, open), (0, rmdir)]);
    // A file one mount kept open past its close and another unlinked goes once the keeping
    // mount's sender gives the open back.
    let unlink = Op::Unlink { at: At(root(), a) };
    let stat = Op::StatIno { index: 1 };
    replay(2, vec![(0, create(a)), (1, unlink), (0, stat)]);
}
