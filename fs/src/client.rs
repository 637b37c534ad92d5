//! The client core: one mount's filesystem operations, one method per operation, in plain
//! Rust values (inode numbers, names, offsets, flags as integers, the caller's ids), answering
//! with domain types or an [`Errno`]. The FUSE adapter ([`crate::fuse`]) only translates
//! kernel requests into these calls and their answers into replies; nothing here knows fuser.
//!
//! Namespace operations are control RPCs to the primary ([`Cluster::meta`]); reads and writes
//! go through [`FileData`] with one-sided verbs. What a mount decides is decided here:
//!
//! * **Failover.** A namespace request whose primary died is sent once more, to the primary
//!   elected next, by [`Cluster::meta`]. A data operation (read, write, fallocate) that failed
//!   with EIO because the primary died and another took over meanwhile runs once more
//!   (`Client::across_failover`). When this mount moves to a primary that took over, cached
//!   layouts are dropped, what it wrote one-sidedly to its open files is reported again
//!   (`Settle`), and its record locks are reclaimed on a thread of their own.
//! * **Threads.** The waits and reclaims above run on threads started through the mount's
//!   [`crate::spawn::Spawn`] (see [`crate::spawn`] for every thread of the core); time comes
//!   from its [`crate::clock::Clock`].
//! * **Set-user-ID.** A write by a process without `CAP_FSETID` (the kernel says so per write)
//!   clears set-user-ID and set-group-ID with one RPC, and only for a handle whose file had
//!   those bits when opened ([`has_setid`]); a truncate arrives with the cleared mode already.
//! * **O_APPEND.** A handle opened with O_APPEND writes at the end of file as the cluster
//!   knows it, not at the kernel's offset ([`Placement`]).
//! * **Caching.** Files open with direct I/O and parallel direct writes, so every mount sees a
//!   write as soon as `write()` returns, unless `cache=writeback` ([`Caching`]).
//! * **Read-only mounts** refuse every change with EROFS; permission checks are the kernel's
//!   (`default_permissions`), none are made here.
//! * **Record locks** (`fcntl`, `flock`) go to [`crate::reclock`]; a request that must wait
//!   does so on a thread of its own, so the caller's worker stays free for the holders'
//!   unlocks.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rackfs_proto::control::{ControlResponse, ErrorCode, FsStat};
use rackfs_proto::namespace::{
    Attr, DirEntry, Kind, MetaRequest, NewKind, SetAttr, RENAME_EXCHANGE, RENAME_NOREPLACE,
};
use rackfs_proto::RpcError;

use crate::caches::Caches;
use crate::clock::Clock;
use crate::cluster::Cluster;
use crate::file::FileData;
use crate::kept::Kept;
use crate::options::{CacheMode, MountOptions};
use crate::reclock;
use crate::releases::Releases;

/// Why an operation failed: the errno its caller gets. Always positive (anything else is
/// EIO), so two errors compare equal exactly when the caller would see the same errno.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", describe(.0))]
pub struct Errno(i32);

fn describe(code: &i32) -> std::io::Error {
    std::io::Error::from_raw_os_error(*code)
}

impl Errno {
    /// `code` as an errno; a code that is not positive is EIO.
    pub const fn new(code: i32) -> Errno {
        if code > 0 {
            Errno(code)
        } else {
            Errno(libc::EIO)
        }
    }

    /// The errno's number (`libc::E*`).
    pub const fn code(self) -> i32 {
        self.0
    }
}

/// A failed control RPC as the caller's errno; a node gone or not answering is logged where
/// it shows (as a warning, with the node's name).
fn rpc(e: RpcError) -> Errno {
    match e {
        RpcError::Timeout { .. } | RpcError::Connection(_) => {
            tracing::warn!(error = %e, "metadata request failed")
        }
        _ => tracing::debug!(error = %e, "metadata request failed"),
    }
    Errno::new(e.errno())
}

/// How the kernel may cache an open file's data (the mount's `cache=` option).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caching {
    /// Direct I/O with parallel direct writes: every mount sees a write when `write()`
    /// returns.
    Direct,
    /// The kernel keeps cached data across opens and buffers writes (writeback cache), so
    /// other mounts see a write only after the kernel flushes it (doc/SEMANTICS.md).
    Writeback,
}

/// An open file handle as the caller gets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Opened {
    pub fh: u64,
    pub caching: Caching,
}

/// The time an attribute is set to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetTime {
    /// This mount's clock when the change is made.
    Now,
    At(SystemTime),
}

/// A `setattr` as asked: `None` leaves the attribute as it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttrChange {
    /// The mode; only its permission bits (`0o7777`) are used.
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<SetTime>,
    pub mtime: Option<SetTime>,
}

/// Who asks for an operation: its owner and group become a new inode's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

/// The answer to `getxattr` or `listxattr` for a caller buffer of a given size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XattrReply {
    /// The caller asked with size 0: how long the value is.
    Size(u32),
    /// The value, which fits the caller's buffer.
    Data(Vec<u8>),
}

/// `statfs` in 4 KiB blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

/// Where a write goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// At the offset the caller gave.
    At(u64),
    /// At the end of file as the cluster knows it (O_APPEND), not the kernel's cached size.
    End,
}

/// What a mount remembers of one open file handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Handle {
    /// Opened with O_APPEND.
    append: bool,
    /// The file had set-user-ID (or set-group-ID with group execute) when opened: a write by
    /// an unprivileged process clears them.
    setid: bool,
    /// It took the mount's kept open of the file ([`crate::kept`]) instead of registering one.
    kept: bool,
}

impl Handle {
    /// A handle opened with open flags `flags` on a file whose mode was `perm`.
    fn opened(flags: i32, perm: u16, kept: bool) -> Handle {
        Handle {
            append: flags & libc::O_APPEND != 0,
            setid: has_setid(perm),
            kept,
        }
    }

    /// Where a write at `offset` through this handle goes.
    fn place(self, offset: u64) -> Placement {
        if self.append {
            Placement::End
        } else {
            Placement::At(offset)
        }
    }
}

/// Whether `perm` has bits an unprivileged write must clear (as Linux's `should_remove_suid`).
pub fn has_setid(perm: u16) -> bool {
    let perm = u32::from(perm);
    perm & libc::S_ISUID != 0
        || perm & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP
}

/// Whether a write through `handle` (`None`: one this mount does not know) must clear
/// set-user-ID and set-group-ID first: the kernel asked (`kill_suidgid`, the writer lacks
/// `CAP_FSETID`) and the file had them when opened.
fn clears_setid(handle: Option<Handle>, kill_suidgid: bool) -> bool {
    handle.is_some_and(|h| h.setid) && kill_suidgid
}

/// Answers a `getxattr` or `listxattr`: the length when the caller asks with size 0, ERANGE
/// when its buffer is too small.
fn xattr_reply(answer: Result<ControlResponse, Errno>, size: u32) -> Result<XattrReply, Errno> {
    match answer? {
        ControlResponse::Xattr(v) if size == 0 => Ok(XattrReply::Size(v.len() as u32)),
        ControlResponse::Xattr(v) if v.len() > size as usize => Err(Errno(libc::ERANGE)),
        ControlResponse::Xattr(v) => Ok(XattrReply::Data(v)),
        _ => Err(Errno(libc::EIO)),
    }
}

/// `rename(2)` flags (`libc::RENAME_*`) as the metadata service's; EINVAL for any other than
/// RENAME_NOREPLACE and RENAME_EXCHANGE (RENAME_WHITEOUT included).
fn rename_flags(flags: u32) -> Result<u32, Errno> {
    let known = libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE;
    if flags & !known != 0 {
        return Err(Errno(libc::EINVAL));
    }
    let mut f = 0;
    if flags & libc::RENAME_NOREPLACE != 0 {
        f |= RENAME_NOREPLACE;
    }
    if flags & libc::RENAME_EXCHANGE != 0 {
        f |= RENAME_EXCHANGE;
    }
    Ok(f)
}

/// The permission bits a new inode gets from `mode` and the caller's `umask`.
fn new_perm(mode: u32, umask: u32) -> u16 {
    (mode & !umask & 0o7777) as u16
}

/// Bytes of stripe 0 a file created for writing gets placed by its create (a 4 KiB page, as a
/// local filesystem's first block); the last close trims a smaller file's extent to its size.
const CREATE_RESERVE: u64 = 4096;

/// How many failovers of the primary one data operation is carried across.
const FAILOVER_RETRIES: u32 = 3;

/// How long a size change or `fallocate` is asked again while the primary refuses it as
/// `Unavailable` (a primary that took over, before the data nodes holding the file's stripes
/// followed it; no node able to take a stripe), before it fails with `EIO`.
const UNAVAILABLE_PATIENCE: Duration = Duration::from_secs(10);

/// Whether the service may refuse `req` as `Unavailable` for a while (see
/// [`UNAVAILABLE_PATIENCE`]): it changes a file's stripes.
fn changes_stripes(req: &MetaRequest) -> bool {
    matches!(
        req,
        MetaRequest::SetAttr {
            set: SetAttr { size: Some(_), .. },
            ..
        } | MetaRequest::Fallocate { .. }
    )
}

/// The attributes an answer carries.
fn attr_in(r: ControlResponse) -> Result<Attr, Errno> {
    match r {
        ControlResponse::Attr(a) => Ok(a),
        _ => Err(Errno(libc::EIO)),
    }
}

/// The one inode whose attributes `req` may change, if that is all it changes of what a mount
/// keeps (a new node's own are not kept yet).
fn changes_only(req: &MetaRequest) -> Option<u64> {
    match req {
        MetaRequest::SetAttr { ino, .. }
        | MetaRequest::SetXattr { ino, .. }
        | MetaRequest::RemoveXattr { ino, .. }
        | MetaRequest::Fallocate { ino, .. } => Some(*ino),
        MetaRequest::Create { parent, .. } => Some(*parent),
        _ => None,
    }
}

/// Whether `req` leaves every directory's attributes as they were (so the attributes this
/// mount learnt stay true).
fn reads_only(req: &MetaRequest) -> bool {
    matches!(
        req,
        MetaRequest::Lookup { .. }
            | MetaRequest::GetAttr { .. }
            | MetaRequest::ReadDir { .. }
            | MetaRequest::ReadDirPlus { .. }
            | MetaRequest::ReadLink { .. }
            | MetaRequest::Open { .. }
            | MetaRequest::Releases { .. }
            | MetaRequest::AllocStripe { .. }
            | MetaRequest::GetStripe { .. }
            | MetaRequest::StatFs
            | MetaRequest::LockSlot
            | MetaRequest::LockTree { .. }
            | MetaRequest::GetXattr { .. }
            | MetaRequest::ListXattr { .. }
            | MetaRequest::RecordLocks { .. }
            | MetaRequest::Settle { .. }
    )
}

/// `t` in nanoseconds since the epoch; `Now` is `clock`'s wall time.
fn nanos(t: SetTime, clock: &dyn Clock) -> u64 {
    match t {
        SetTime::At(t) => t
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
        SetTime::Now => clock.wall_ns(),
    }
}

/// One mount's filesystem: its cluster, its open files and handles.
pub struct Client {
    cluster: Arc<Cluster>,
    opts: MountOptions,
    caches: Caches,
    /// Last closes not told to the primary yet.
    releases: Arc<Releases>,
    /// Open handles.
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
}

impl Client {
    /// The filesystem of a mount on `cluster` with options `opts`; registers what the mount
    /// does when it continues on a primary that took over.
    pub fn new(cluster: Arc<Cluster>, opts: MountOptions) -> Client {
        let kept_opens = match opts.attr_timeout.is_zero() {
            // Without a lease, a kept open would never be reused.
            true => 0,
            false => opts.kept_opens,
        };
        let caches = Caches {
            kept: Arc::new(Kept::new(kept_opens)),
            ..Caches::default()
        };
        {
            // On a primary that took over: cached layouts go, and what this mount wrote to
            // its open files (sizes written one-sidedly to the old primary) is reported again.
            let (weak, files) = (Arc::downgrade(&cluster), caches.files.clone());
            cluster.on_failover(move || {
                let Some(cl) = weak.upgrade() else { return };
                let open: Vec<_> = files.lock().expect("files lock").values().cloned().collect();
                // Record locks are reclaimed on a thread of their own: a reclaim that met a
                // failed primary would start another failover, which waits for this one.
                let (held, cluster) = (open.clone(), cl.clone());
                let reclaim = move || held.iter().for_each(|f| f.record_locks.reclaim(&cluster));
                let spawned = cl.env().spawn.spawn("rackfs-reclaim", Box::new(reclaim));
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "no thread to reclaim record locks on: they are lost");
                }
                for f in open {
                    let wrote = f.written();
                    f.invalidate();
                    f.forget_size();
                    if let Some((size, mtime)) = wrote {
                        let settle = MetaRequest::Settle { ino: f.ino, size, mtime };
                        match cl.primary().meta(settle) {
                            Ok(_) | Err(RpcError::Refused { code: ErrorCode::NotFound, .. }) => {}
                            Err(e) => tracing::warn!(ino = f.ino, error = %e, "cannot report this mount's writes to the new primary"),
                        }
                    }
                }
            });
        }
        cluster.keep_members_known();
        let releases = Arc::new(Releases::new(caches.leased.clone(), caches.kept.clone()));
        Client {
            cluster,
            opts,
            caches,
            releases,
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
        }
    }

    /// This mount's caches (the watcher makes them forget other mounts' changes).
    pub fn caches(&self) -> Caches {
        self.caches.clone()
    }

    /// This mount's queued last closes (sent by `releases::spawn`'s thread).
    pub fn releases(&self) -> Arc<Releases> {
        self.releases.clone()
    }

    /// The cluster this filesystem serves.
    pub fn cluster(&self) -> Arc<Cluster> {
        self.cluster.clone()
    }

    /// How long the kernel may cache attributes and names (`attr_timeout`).
    pub fn ttl(&self) -> Duration {
        self.opts.attr_timeout
    }

    /// How the kernel may cache file data on this mount.
    pub fn caching(&self) -> Caching {
        match self.opts.cache {
            CacheMode::None => Caching::Direct,
            CacheMode::Writeback => Caching::Writeback,
        }
    }

    /// Runs a data operation, and again if it failed with EIO because the primary died and
    /// another took over meanwhile (at most [`FAILOVER_RETRIES`] times: each retry needs a
    /// failover of its own).
    fn across_failover<T>(&self, mut op: impl FnMut() -> Result<T, i32>) -> Result<T, Errno> {
        let mut before = self.cluster.failovers();
        let mut r = op();
        let mut retries = 0;
        while matches!(r, Err(libc::EIO))
            && retries < FAILOVER_RETRIES
            && self.cluster.primary_replaced(before)
        {
            before = self.cluster.failovers();
            retries += 1;
            r = op();
        }
        if retries > 0 && r.is_err() {
            tracing::warn!(
                retries,
                "a data operation failed again after the primary's failover"
            );
        }
        r.map_err(Errno::new)
    }

    /// Sends `req` to the primary. What it may change is not answered from this mount's
    /// leased cache from before it is sent, and is forgotten again once it is answered
    /// ([`crate::leased`]). Returns the answer, and the news to learn it with if nothing
    /// happened meanwhile.
    fn send(&self, req: MetaRequest) -> (Result<ControlResponse, Errno>, Option<u64>) {
        let leased = &self.caches.leased;
        let flight = leased.changing(&req);
        let sent = leased.news();
        let r = match changes_stripes(&req) {
            true => self.patiently(req),
            false => self.cluster.meta(req),
        };
        (r.map_err(rpc), leased.answered(flight, sent))
    }

    /// Sends `req`, again while it is refused as `Unavailable`, for up to
    /// [`UNAVAILABLE_PATIENCE`] (a refused request was not carried out).
    fn patiently(&self, req: MetaRequest) -> Result<ControlResponse, RpcError> {
        let clock = self.cluster.clock();
        let started = clock.now();
        let mut pause = Duration::from_millis(1);
        loop {
            match self.cluster.meta(req.clone()) {
                Err(RpcError::Refused {
                    code: ErrorCode::Unavailable,
                    message,
                }) if clock.now().saturating_sub(started) < UNAVAILABLE_PATIENCE => {
                    tracing::debug!(%message, "a stripe change refused for now: asking again");
                    clock.sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                r => return r,
            }
        }
    }

    /// The attributes `req` is answered with, kept in the leased cache (with the name they
    /// were looked up by) if nothing happened meanwhile.
    fn attr_learnt(&self, name: Option<(u64, &[u8])>, req: MetaRequest) -> Result<Attr, Errno> {
        let (r, news) = self.meta_news(req);
        let a = attr_in(r?)?;
        if let Some(news) = news {
            self.caches.leased.learn(name, &a, news);
        }
        Ok(a)
    }

    /// What the leased cache answers, if it answered `a`: `a` itself, unless it is a regular
    /// file whose record changed since (then forgotten).
    fn fresh(&self, a: Option<Attr>) -> Option<Attr> {
        let a = a?;
        if a.kind != Kind::File || crate::file::record_unchanged(&self.cluster, &a) {
            return Some(a);
        }
        self.caches.leased.stale(a.ino);
        None
    }

    fn meta(&self, req: MetaRequest) -> Result<ControlResponse, Errno> {
        self.meta_news(req).0
    }

    /// [`Client::meta`], with the news to learn its answer with ([`Client::send`]).
    fn meta_news(&self, req: MetaRequest) -> (Result<ControlResponse, Errno>, Option<u64>) {
        let changes = !reads_only(&req);
        let only = changes_only(&req);
        let r = self.send(req);
        match only {
            // One inode's attributes changed: what was learnt of other directories still
            // holds (tar sets a file's owner, mode and times right after creating it).
            Some(ino) => self.caches.attrs.forget(ino),
            None if changes => self.caches.attrs.changed(),
            None => {}
        }
        r
    }

    /// A change whose answer carries a directory's attributes after it (create, unlink,
    /// rmdir): they are kept for the kernel's next getattr of it (see [`crate::caches::LearntAttrs`]).
    fn meta_learning(&self, req: MetaRequest) -> (Result<ControlResponse, Errno>, Option<u64>) {
        let sent = self.caches.attrs.generation();
        // A removed directory's own attributes change too.
        let alone = !matches!(req, MetaRequest::Rmdir { .. });
        let (r, news) = self.send(req);
        let now = self.cluster.clock().mono_ns();
        match &r {
            Ok(ControlResponse::Attr(dir)) if self.learns() => {
                self.caches.attrs.keep(dir.clone(), alone, sent, now)
            }
            Ok(ControlResponse::Created(c)) if self.learns() => {
                self.caches.attrs.keep(c.parent.clone(), alone, sent, now)
            }
            _ => self.caches.attrs.changed(),
        }
        (r, news)
    }

    /// Whether the kernel caches attributes at all (else nothing is kept for it).
    fn learns(&self) -> bool {
        !self.opts.attr_timeout.is_zero()
    }

    fn attr_of(&self, req: MetaRequest) -> Result<Attr, Errno> {
        attr_in(self.meta(req)?)
    }

    fn writable(&self) -> Result<(), Errno> {
        if self.opts.read_only {
            Err(Errno(libc::EROFS))
        } else {
            Ok(())
        }
    }

    /// The data path of regular file `a`, made on its first open.
    fn file(&self, a: &Attr) -> Result<Arc<FileData>, Errno> {
        let layout = a.layout.ok_or(Errno(libc::EISDIR))?;
        Ok(self
            .caches
            .files
            .lock()
            .expect("files lock")
            .entry(a.ino)
            .or_insert_with(|| {
                Arc::new(FileData::new(
                    a.ino,
                    layout,
                    self.opts.attr_timeout,
                    self.opts.locks,
                    self.opts.keep_locks,
                ))
            })
            .clone())
    }

    fn cached_file(&self, ino: u64) -> Option<Arc<FileData>> {
        self.caches
            .files
            .lock()
            .expect("files lock")
            .get(&ino)
            .cloned()
    }

    /// The data path of open file `ino`; EBADF if this mount has not opened it.
    fn open_file(&self, ino: u64) -> Result<Arc<FileData>, Errno> {
        self.cached_file(ino).ok_or(Errno(libc::EBADF))
    }

    /// Registers an open with the metadata service (one round trip, answered with the
    /// attributes) and returns them with a new handle.
    fn open_handle(&self, ino: u64, flags: i32) -> Result<(Attr, Opened), Errno> {
        let a = self.attr_of(MetaRequest::Open { ino })?;
        if a.kind == Kind::File {
            self.file(&a)?;
        }
        let opened = self.new_handle(flags, a.perm, false);
        Ok((a, opened))
    }

    /// A handle on the open this mount kept of `ino` past its last close, without a round
    /// trip: while the watcher holds the mount's lease, and if the file's data path is known.
    fn reopen_kept(&self, ino: u64, flags: i32) -> Option<Opened> {
        let now = self.cluster.clock().mono_ns();
        if !self.caches.leased.running(now) || self.cached_file(ino).is_none() {
            return None;
        }
        let perm = self.caches.kept.reopen(ino)?;
        Some(self.new_handle(flags, perm, true))
    }

    /// A new handle of an opened inode (`kept`: on the mount's kept open).
    fn new_handle(&self, flags: i32, perm: u16, kept: bool) -> Opened {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles
            .lock()
            .expect("handles lock")
            .insert(fh, Handle::opened(flags, perm, kept));
        Opened {
            fh,
            caching: self.caching(),
        }
    }

    fn create_node(
        &self,
        parent: u64,
        name: &OsStr,
        kind: NewKind,
        perm: u16,
        caller: Caller,
    ) -> Result<Attr, Errno> {
        self.writable()?;
        let dir = kind == NewKind::Dir;
        let leased = self.caches.leased.running(self.cluster.clock().mono_ns());
        let (r, news) = self.meta_news(MetaRequest::Create {
            parent,
            name: name.as_bytes().to_vec(),
            kind,
            perm,
            uid: caller.uid,
            gid: caller.gid,
        });
        let a = attr_in(r?)?;
        // The primary registered a new directory with this mount's watcher as it made it.
        if dir {
            self.caches.leased.hold(a.ino, leased, news);
        } else if let Some(news) = news {
            self.caches
                .leased
                .learn(Some((parent, name.as_bytes())), &a, news);
        }
        Ok(a)
    }

    /// The kind of a regular file this mount creates (its stripe unit and replicas).
    fn new_file(&self) -> NewKind {
        NewKind::File {
            stripe_unit: self.opts.stripe_unit,
            replicas: self.opts.replicas,
        }
    }

    /// A setattr that changes the size: for a regular file it runs under the file's
    /// whole-file lock and shrinks its lock tree.
    fn set_size(&self, ino: u64, set: SetAttr) -> Result<Attr, Errno> {
        let size = set.size;
        let setattr = || {
            self.attr_of(MetaRequest::SetAttr {
                ino,
                set: set.clone(),
            })
        };
        match self.attr_of(MetaRequest::GetAttr { ino })? {
            a if a.kind == Kind::File => {
                let size = size.unwrap_or(a.size);
                self.file(&a)?
                    .truncate(&self.cluster, size, || setattr().map_err(Errno::code))
                    .map_err(Errno::new)
            }
            _ => setattr(),
        }
    }

    /// Looks `name` up in directory `parent`, answered from the leased cache
    /// ([`crate::leased`]) if it can: absent from a directory this mount holds whole, or
    /// known.
    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<Attr, Errno> {
        let name = name.as_bytes();
        let now = self.cluster.clock().mono_ns();
        if self.caches.leased.absent(parent, name, now) {
            return Err(Errno(libc::ENOENT));
        }
        if let Some(a) = self.fresh(self.caches.leased.lookup(parent, name, now)) {
            return Ok(a);
        }
        let req = MetaRequest::Lookup {
            parent,
            name: name.to_vec(),
        };
        self.attr_learnt(Some((parent, name)), req)
    }

    /// An inode's attributes: those this mount's last change of it was answered with, if
    /// still fresh (see [`crate::caches::LearntAttrs`]), else the leased cache's
    /// ([`crate::leased`]), else the primary's.
    pub fn getattr(&self, ino: u64) -> Result<Attr, Errno> {
        let now = self.cluster.clock().mono_ns();
        if let Some(a) = self.caches.attrs.take(ino, now, self.opts.attr_timeout) {
            return Ok(a);
        }
        if let Some(a) = self.fresh(self.caches.leased.attr(ino, now)) {
            return Ok(a);
        }
        self.attr_learnt(None, MetaRequest::GetAttr { ino })
    }

    /// Changes attributes; a size change of a regular file is a truncate under its whole-file
    /// lock.
    pub fn setattr(&self, ino: u64, change: AttrChange) -> Result<Attr, Errno> {
        self.writable()?;
        let clock = &**self.cluster.clock();
        let set = SetAttr {
            perm: change.mode.map(|m| (m & 0o7777) as u16),
            uid: change.uid,
            gid: change.gid,
            size: change.size,
            atime_ns: change.atime.map(|t| nanos(t, clock)),
            mtime_ns: change.mtime.map(|t| nanos(t, clock)),
            // A truncate by an unprivileged process arrives with the cleared mode already
            // (the kernel turns ATTR_KILL_SUID into a mode change).
            kill_suidgid: false,
        };
        let a = match change.size {
            Some(_) => self.set_size(ino, set),
            None => self.attr_of(MetaRequest::SetAttr { ino, set }),
        }?;
        self.caches.kept.set_perm(ino, a.perm);
        Ok(a)
    }

    /// `fallocate(2)`: reserve (mode 0, `KEEP_SIZE`), punch a hole (`PUNCH_HOLE|KEEP_SIZE`)
    /// or zero a range (`ZERO_RANGE`), under the whole-file lock; the service refuses other
    /// modes (`EOPNOTSUPP`).
    pub fn fallocate(&self, ino: u64, offset: u64, length: u64, mode: i32) -> Result<(), Errno> {
        self.writable()?;
        let f = self.open_file(ino)?;
        let send = |offset, len| {
            let req = MetaRequest::Fallocate {
                ino,
                offset,
                len,
                mode: mode as u32,
            };
            self.meta(req).map(|_| ()).map_err(Errno::code)
        };
        self.across_failover(|| f.fallocate(&self.cluster, offset, length, send))
    }

    /// Sets extended attribute `name`; `position` is for macOS resource forks only (EINVAL).
    pub fn setxattr(
        &self,
        ino: u64,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        position: u32,
    ) -> Result<(), Errno> {
        self.writable()?;
        if position != 0 {
            return Err(Errno(libc::EINVAL));
        }
        self.meta(MetaRequest::SetXattr {
            ino,
            name: name.as_bytes().to_vec(),
            value: value.to_vec(),
            flags: flags as u32,
        })?;
        if let Some(f) = self.cached_file(ino) {
            f.set_lacks_capability(false);
        }
        Ok(())
    }

    /// The kernel asks for `security.capability` before every buffered write: for a file open
    /// here, an answer of "none" is kept until the watcher reports a change to the file (so
    /// only while the watcher runs, `attr_timeout` > 0).
    pub fn getxattr(&self, ino: u64, name: &OsStr, size: u32) -> Result<XattrReply, Errno> {
        let capability = name.as_bytes() == b"security.capability";
        let open = capability && !self.ttl().is_zero();
        let open = open.then(|| self.cached_file(ino)).flatten();
        if open.as_ref().is_some_and(|f| f.lacks_capability()) {
            return Err(Errno(libc::ENODATA));
        }
        let req = MetaRequest::GetXattr {
            ino,
            name: name.as_bytes().to_vec(),
        };
        let answer = self.meta(req);
        if let Some(f) = open {
            f.set_lacks_capability(answer == Err(Errno(libc::ENODATA)));
        }
        xattr_reply(answer, size)
    }

    pub fn listxattr(&self, ino: u64, size: u32) -> Result<XattrReply, Errno> {
        xattr_reply(self.meta(MetaRequest::ListXattr { ino }), size)
    }

    pub fn removexattr(&self, ino: u64, name: &OsStr) -> Result<(), Errno> {
        self.writable()?;
        self.meta(MetaRequest::RemoveXattr {
            ino,
            name: name.as_bytes().to_vec(),
        })
        .map(|_| ())
    }

    /// A symbolic link's target.
    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>, Errno> {
        match self.meta(MetaRequest::ReadLink { ino })? {
            ControlResponse::Target(t) => Ok(t),
            _ => Err(Errno(libc::EIO)),
        }
    }

    /// Creates a regular file, FIFO, socket or device node (its kind in `mode`'s `S_IFMT`;
    /// EINVAL for any other).
    pub fn mknod(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        caller: Caller,
    ) -> Result<Attr, Errno> {
        let special = |kind| NewKind::Special { kind, rdev };
        let kind = match mode & libc::S_IFMT {
            libc::S_IFREG | 0 => self.new_file(),
            libc::S_IFIFO => special(Kind::Fifo),
            libc::S_IFSOCK => special(Kind::Socket),
            libc::S_IFCHR => special(Kind::CharDev),
            libc::S_IFBLK => special(Kind::BlockDev),
            _ => return Err(Errno(libc::EINVAL)),
        };
        self.create_node(parent, name, kind, new_perm(mode, umask), caller)
    }

    pub fn mkdir(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        caller: Caller,
    ) -> Result<Attr, Errno> {
        self.create_node(parent, name, NewKind::Dir, new_perm(mode, umask), caller)
    }

    pub fn unlink(&self, parent: u64, name: &OsStr) -> Result<(), Errno> {
        self.remove(parent, name, false)
    }

    pub fn rmdir(&self, parent: u64, name: &OsStr) -> Result<(), Errno> {
        self.remove(parent, name, true)
    }

    /// unlink (`dir` false) or rmdir (`dir` true).
    fn remove(&self, parent: u64, name: &OsStr, dir: bool) -> Result<(), Errno> {
        self.writable()?;
        // A file this mount closed and now removes is freed when the removal returns: its
        // closes go first, and the open it kept goes with the unlink (all free ones go first
        // if the name's inode is not known).
        let known = match dir {
            true => None,
            false => self.caches.leased.ino_of(parent, name.as_bytes()),
        };
        self.releases.send(&self.cluster);
        if !dir && known.is_none() {
            self.caches.kept.give_back_free();
            self.releases.send(&self.cluster);
        }
        let release = known.filter(|&ino| self.caches.kept.take(ino));
        let name = name.as_bytes().to_vec();
        let req = if dir {
            MetaRequest::Rmdir { parent, name }
        } else {
            MetaRequest::Unlink {
                parent,
                name,
                release,
            }
        };
        self.meta_learning(req).0.map(|_| ())
    }

    pub fn symlink(
        &self,
        parent: u64,
        name: &OsStr,
        target: &Path,
        caller: Caller,
    ) -> Result<Attr, Errno> {
        let kind = NewKind::Symlink(target.as_os_str().as_bytes().to_vec());
        self.create_node(parent, name, kind, 0o777, caller)
    }

    /// `rename(2)` with its flags (`libc::RENAME_*`).
    pub fn rename(
        &self,
        parent: u64,
        name: &OsStr,
        new_parent: u64,
        new_name: &OsStr,
        flags: u32,
    ) -> Result<(), Errno> {
        self.writable()?;
        let flags = rename_flags(flags)?;
        // A file this mount closed and now renames over is freed when the rename returns:
        // its close, then the open it kept, go first.
        self.releases.send(&self.cluster);
        if let Some(ino) = self.caches.leased.ino_of(new_parent, new_name.as_bytes()) {
            self.caches.kept.doom(ino);
            self.releases.send(&self.cluster);
        }
        self.meta(MetaRequest::Rename {
            parent,
            name: name.as_bytes().to_vec(),
            new_parent,
            new_name: new_name.as_bytes().to_vec(),
            flags,
        })
        .map(|_| ())
    }

    pub fn link(&self, ino: u64, new_parent: u64, new_name: &OsStr) -> Result<Attr, Errno> {
        self.writable()?;
        self.attr_of(MetaRequest::Link {
            ino,
            parent: new_parent,
            name: new_name.as_bytes().to_vec(),
        })
    }

    /// Opens `ino` with open flags `flags` (`libc::O_*`).
    pub fn open(&self, ino: u64, flags: i32) -> Result<Opened, Errno> {
        if self.opts.read_only && flags & libc::O_ACCMODE != libc::O_RDONLY {
            return Err(Errno(libc::EROFS));
        }
        if let Some(opened) = self.reopen_kept(ino, flags) {
            return Ok(opened);
        }
        match self.open_handle(ino, flags) {
            // The kernel's cached name points at a file another mount removed: ESTALE makes
            // the kernel look the name up again and retry the open (it then creates the file
            // for O_CREAT, or returns ENOENT), as NFS clients do.
            Err(Errno(libc::ENOENT)) => Err(Errno(libc::ESTALE)),
            r => r.map(|(_, opened)| opened),
        }
    }

    /// Creates regular file `name` in `parent` and opens it with open flags `flags`.
    pub fn create(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        caller: Caller,
    ) -> Result<(Attr, Opened), Errno> {
        self.writable()?;
        let (stripe_unit, replicas) = (self.opts.stripe_unit, self.opts.replicas);
        // A writer's first bytes go to memory placed by the create itself, under a lock tree
        // published by it too: no further round trip before the first write.
        let reserve = match flags & libc::O_ACCMODE {
            libc::O_RDONLY => 0,
            _ => CREATE_RESERVE,
        };
        let req = MetaRequest::CreateOpen {
            parent,
            name: name.as_bytes().to_vec(),
            stripe_unit,
            replicas,
            perm: new_perm(mode, umask),
            uid: caller.uid,
            gid: caller.gid,
            reserve,
            lock_units: if self.opts.locks {
                reserve.div_ceil(crate::lock::LOCK_UNIT).max(1)
            } else {
                0
            },
        };
        let sent = self.cluster.clock().mono_ns();
        let (r, news) = self.meta_learning(req);
        let a = match r {
            Ok(ControlResponse::Created(c)) => {
                let f = self.file(&c.attr)?;
                f.cache_stripe(0, c.stripe, sent);
                if let Some(news) = news {
                    let leased = &self.caches.leased;
                    leased.learn(Some((parent, name.as_bytes())), &c.attr, news);
                    // A new file has no extended attributes: the kernel's question before
                    // the first write (`security.capability`) needs no round trip, unless the
                    // watcher heard of anything since the create left (another mount may
                    // have set one on it). Set first, then checked: the watcher clears it
                    // after it bumps the news.
                    f.set_lacks_capability(true);
                    if leased.news() != news {
                        f.set_lacks_capability(false);
                    }
                }
                let opened = self.new_handle(flags, c.attr.perm, false);
                return Ok((c.attr, opened));
            }
            Ok(_) => return Err(Errno(libc::EIO)),
            // Another mount created the name since the kernel looked it up: without O_EXCL
            // the open succeeds on that file, as on a local filesystem, and O_TRUNC empties it
            // (as when two local opens race: the later one truncates). Only a regular file is
            // opened here (the kernel fails a create answered with anything else with EIO): a
            // directory is EISDIR, as open(2) answers; for a symlink or special file ESTALE
            // makes the kernel look the name up again and open what it finds as it should.
            Err(Errno(libc::EEXIST)) if flags & libc::O_EXCL == 0 => {
                match self.lookup(parent, name)? {
                    a if a.kind == Kind::Dir => return Err(Errno(libc::EISDIR)),
                    a if a.kind != Kind::File => return Err(Errno(libc::ESTALE)),
                    a if flags & libc::O_TRUNC != 0 && a.kind == Kind::File => self.set_size(
                        a.ino,
                        SetAttr {
                            size: Some(0),
                            ..SetAttr::default()
                        },
                    )?,
                    a => a,
                }
            }
            Err(e) => return Err(e),
        };
        self.open_handle(a.ino, flags)
    }

    /// Reads up to `size` bytes at `offset` of open file `ino`, handing them to `deliver`
    /// (straight from the completion when it can). Run again if the primary was replaced
    /// meanwhile, so `deliver` may be called twice if the first attempt delivered and then
    /// failed; the caller keeps the first.
    pub fn read(
        &self,
        ino: u64,
        offset: u64,
        size: u32,
        mut deliver: impl FnMut(&[u8]),
    ) -> Result<(), Errno> {
        let f = self.open_file(ino)?;
        self.across_failover(|| f.read_with(&self.cluster, offset, size, &mut deliver))
    }

    /// Writes `data` through handle `fh` at `offset` (at the end of file for O_APPEND);
    /// `kill_suidgid`: the writer lacks `CAP_FSETID`. Returns how many bytes were written.
    pub fn write(
        &self,
        ino: u64,
        fh: u64,
        offset: u64,
        data: &[u8],
        kill_suidgid: bool,
    ) -> Result<u32, Errno> {
        self.writable()?;
        let f = self.open_file(ino)?;
        let handle = self.handles.lock().expect("handles lock").get(&fh).copied();
        // One RPC, and only for files that had those bits when opened.
        if clears_setid(handle, kill_suidgid) {
            let set = SetAttr {
                kill_suidgid: true,
                ..SetAttr::default()
            };
            self.attr_of(MetaRequest::SetAttr { ino, set })?;
            if let Some(h) = self.handles.lock().expect("handles lock").get_mut(&fh) {
                h.setid = false;
            }
        }
        let place = handle.map_or(Placement::At(offset), |h| h.place(offset));
        // Written again in full after a failover: the same bytes at the same place. An
        // O_APPEND write goes again to where its last attempt put it if that attempt landed
        // as far as the new primary knows, else to the end of file: once either way.
        let placed = Cell::new(None);
        self.across_failover(|| match place {
            Placement::End => match placed.get().filter(|&at| self.landed(ino, at, data)) {
                Some(at) => f.write_locked(&self.cluster, at, data),
                None => f
                    .append(&self.cluster, data, |at| placed.set(Some(at)))
                    .map(|_| ()),
            },
            Placement::At(offset) => f.write_locked(&self.cluster, offset, data),
        })?;
        Ok(data.len() as u32)
    }

    /// Whether an O_APPEND write of `data` at `at`, in flight when the primary died, landed
    /// as far as the filesystem knows: the size the new primary took over with covers it.
    /// (The old primary journals sizes with other changes, so that size may or may not hold
    /// the write; the mount alone cannot tell, and another append since may have moved the
    /// end of file past it.)
    fn landed(&self, ino: u64, at: u64, data: &[u8]) -> bool {
        let end = at + data.len() as u64;
        let ask = MetaRequest::SizeAtTakeOver { ino };
        let known = self.cluster.meta(ask);
        matches!(known, Ok(ControlResponse::SizeAtTakeOver(Some(size))) if size >= end)
    }

    /// A close of open file `ino` by lock owner `lock_owner`: drops the closing process's
    /// `fcntl` locks on the file (POSIX: any close of the file does). Writes are in remote
    /// memory already.
    pub fn flush(&self, ino: u64, lock_owner: u64) -> Result<(), Errno> {
        let Some(f) = self.cached_file(ino) else {
            return Ok(());
        };
        f.record_locks
            .closed_by(&self.cluster, lock_owner)
            .map_err(Errno::new)
    }

    /// `F_GETLK`: the first lock of another owner, on any mount, that conflicts with `r`.
    pub fn getlk(
        &self,
        ino: u64,
        r: &reclock::Request,
    ) -> Result<Option<reclock::Conflict>, Errno> {
        let f = self.open_file(ino)?;
        f.record_locks.test(&self.cluster, r).map_err(Errno::new)
    }

    /// `F_SETLK`, `F_SETLKW` (`sleep`) and `flock`, through handle `fh`, held across every
    /// mount. `done` gets the answer: at once, or, when the request must wait, from a thread
    /// of its own that ends the wait with EINTR once thread `tid` of the lock's process has a
    /// signal to take. (If no thread can be made, `done` is dropped unanswered.)
    pub fn setlk(
        &self,
        ino: u64,
        fh: u64,
        r: reclock::Request,
        tid: u32,
        sleep: bool,
        done: impl FnOnce(Result<(), Errno>) + Send + 'static,
    ) {
        let f = match self.open_file(ino) {
            Ok(f) => f,
            Err(e) => return done(Err(e)),
        };
        match f.record_locks.try_set(&self.cluster, fh, &r) {
            Ok(true) => return done(Ok(())),
            Ok(false) if !sleep => return done(Err(Errno(libc::EAGAIN))),
            Ok(false) => {}
            Err(e) => return done(Err(Errno::new(e))),
        }
        let cluster = self.cluster.clone();
        let wait = move || {
            let interrupted = || reclock::signal_pending(r.pid, tid);
            let res = f.record_locks.set_waiting(&cluster, fh, &r, interrupted);
            done(res.map_err(Errno::new))
        };
        let waiter = self
            .cluster
            .env()
            .spawn
            .spawn("rackfs-lockwait", Box::new(wait));
        if let Err(e) = waiter {
            tracing::warn!(error = %e, "no thread to wait for a lock on");
        }
    }

    /// The data is in remote memory when `write` returns; fsync also makes the size and mtime
    /// this mount wrote one-sidedly part of the metadata the standby mirrors, so they survive
    /// the primary even if this mount dies with it.
    pub fn fsync(&self, ino: u64) -> Result<(), Errno> {
        let wrote = self.cached_file(ino).and_then(|f| f.written());
        let Some((size, mtime)) = wrote else {
            return Ok(());
        };
        self.meta(MetaRequest::Settle { ino, size, mtime })
            .map(|_| ())
    }

    /// The last close of handle `fh` of `ino`: drops its flock and OFD locks, forgets the
    /// handle and queues the release for the metadata service (see [`crate::releases`]).
    pub fn release(&self, ino: u64, fh: u64) -> Result<(), Errno> {
        let file = self.cached_file(ino);
        if let Some(f) = &file {
            if let Err(e) = f.record_locks.released(&self.cluster, fh) {
                tracing::warn!(
                    ino,
                    errno = e,
                    "the locks of a closed file were not dropped"
                );
            }
        }
        let handle = self.handles.lock().expect("handles lock").remove(&fh);
        // Only a regular file's open is kept (its data path is what a reopen needs), and only
        // under the lease (without it, no reopen would take it).
        let may_keep = file.is_some() && self.caches.leased.running(self.cluster.clock().mono_ns());
        let close = self
            .caches
            .kept
            .close(ino, handle.is_some_and(|h| h.kept), may_keep);
        if self.releases.add(ino, close) {
            self.releases.send(&self.cluster);
        }
        Ok(())
    }

    /// Lists directory `ino` from after cookie `offset`, handing each entry to `add` until it
    /// says the caller's buffer is full (`true`) or the directory ends.
    pub fn readdir(
        &self,
        ino: u64,
        offset: u64,
        add: impl FnMut(&DirEntry) -> bool,
    ) -> Result<(), Errno> {
        let page = |after| match self.meta(MetaRequest::ReadDir {
            ino,
            after,
            max: PAGE,
        })? {
            ControlResponse::Entries(e) => Ok(e),
            _ => Err(Errno(libc::EIO)),
        };
        pages(offset, page, |e| e.cookie, add)
    }

    /// [`Client::readdir`] with each entry's attributes: the kernel then looks none of the
    /// names up.
    pub fn readdir_plus(
        &self,
        ino: u64,
        offset: u64,
        mut add: impl FnMut(&DirEntry, &Attr) -> bool,
    ) -> Result<(), Errno> {
        let page = |after| {
            let (r, news) = self.meta_news(MetaRequest::ReadDirPlus {
                ino,
                after,
                max: PAGE,
            });
            match r? {
                ControlResponse::EntriesPlus(e) => {
                    if let Some(news) = news {
                        for (d, a) in &e {
                            self.caches.leased.learn(Some((ino, &d.name)), a, news);
                        }
                    }
                    Ok(e)
                }
                _ => Err(Errno(libc::EIO)),
            }
        };
        pages(offset, page, |(e, _)| e.cookie, |(e, a)| add(e, a))
    }

    /// The filesystem's capacity and free space as this mount's files can fill them, in
    /// 4 KiB blocks: what stripes of its `stripe_unit=` with its `replicas=` (or the
    /// cluster's default) fit on the data nodes, every replica on a different node (see
    /// [`rackfs_proto::space`]). A file given another count through `rackfs.replicas` takes
    /// more or less than this predicts.
    pub fn statfs(&self) -> Result<StatFs, Errno> {
        self.releases.send(&self.cluster);
        match self.meta(MetaRequest::StatFs)? {
            ControlResponse::FsStat(s) => Ok(statfs_blocks(&s, &self.opts)),
            _ => Err(Errno(libc::EIO)),
        }
    }
}

/// `statfs` figures from the nodes' memory, for files of `opts`' replica count and stripe
/// unit: blocks and free blocks both usable ones, so `bavail <= bfree <= blocks`.
fn statfs_blocks(s: &FsStat, opts: &MountOptions) -> StatFs {
    let u = s.usable(opts.replicas, opts.stripe_unit);
    StatFs {
        blocks: u.capacity / 4096,
        bfree: u.free / 4096,
        bavail: u.free / 4096,
        files: s.files,
        ffree: u32::MAX as u64,
        bsize: 4096,
        namelen: 255,
        frsize: 4096,
    }
}

/// Directory entries asked for per request.
const PAGE: u32 = 256;

/// Hands the entries `page(after)` returns, page after page from after cookie `offset`, to
/// `add` until it says the caller's buffer is full (`true`) or a page comes back empty.
fn pages<T>(
    offset: u64,
    mut page: impl FnMut(u64) -> Result<Vec<T>, Errno>,
    cookie: impl Fn(&T) -> u64,
    mut add: impl FnMut(&T) -> bool,
) -> Result<(), Errno> {
    let mut after = offset;
    loop {
        let entries = page(after)?;
        if entries.is_empty() {
            return Ok(());
        }
        for e in &entries {
            if add(e) {
                return Ok(());
            }
            after = cookie(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statfs_counts_what_the_mounts_replicas_and_stripes_can_fill() {
        use rackfs_proto::space::NodeSpace;
        let node = |node, free| NodeSpace {
            node,
            capacity: 60 << 20,
            free,
        };
        let s = FsStat {
            capacity: 120 << 20,
            free: 100 << 20,
            files: 3,
            replicas: 2,
            nodes: vec![node(0, 50 << 20), node(1, 50 << 20)],
        };
        let mut opts = MountOptions::default();
        let two = statfs_blocks(&s, &opts);
        // 1 MiB stripes plus their tags: 59 fit in 60 MiB, 49 in 50 MiB; two copies each.
        assert_eq!(
            (two.blocks, two.bfree, two.bavail),
            (59 * 256, 49 * 256, 49 * 256)
        );
        opts.replicas = 1;
        let one = statfs_blocks(&s, &opts);
        assert_eq!((one.blocks, one.bfree), (2 * 59 * 256, 2 * 49 * 256));
        // A node with less room bounds two-replica stripes: none of them takes two copies.
        let lopsided = FsStat {
            nodes: vec![node(0, 10 << 20), node(1, 50 << 20)],
            ..s
        };
        opts.replicas = 0;
        let st = statfs_blocks(&lopsided, &opts);
        assert_eq!(st.bavail, 9 * 256);
        assert!(st.bavail <= st.bfree && st.bfree <= st.blocks);
    }

    #[test]
    fn an_unprivileged_write_clears_setuid_and_executable_setgid_only() {
        // As Linux's should_remove_suid (pjdfstest chmod/12).
        for (perm, clears) in [
            (0o4777, true),  // set-user-ID
            (0o4000, true),  // set-user-ID alone
            (0o2777, true),  // set-group-ID with group execute
            (0o2010, true),  // the same, nothing else
            (0o6777, true),  // both
            (0o2767, false), // set-group-ID without group execute: mandatory locking, kept
            (0o2000, false),
            (0o1777, false), // sticky is no set-ID bit
            (0o777, false),
        ] {
            assert_eq!(has_setid(perm), clears, "mode {perm:o}");
        }
    }

    #[test]
    fn setid_is_cleared_only_when_the_kernel_asks_and_the_file_had_it_at_open() {
        let setid = Handle::opened(libc::O_WRONLY, 0o4755, false);
        let plain = Handle::opened(libc::O_WRONLY, 0o755, false);
        assert!(clears_setid(Some(setid), true));
        assert!(
            !clears_setid(Some(setid), false),
            "a writer with CAP_FSETID"
        );
        assert!(!clears_setid(Some(plain), true), "nothing to clear: no RPC");
        assert!(
            !clears_setid(None, true),
            "a handle this mount does not know"
        );
    }

    #[test]
    fn an_o_append_handle_writes_at_the_end_of_file_whatever_the_offset() {
        let append = Handle::opened(libc::O_WRONLY | libc::O_APPEND, 0o644, false);
        let plain = Handle::opened(libc::O_RDWR | libc::O_CREAT, 0o644, false);
        assert_eq!(append.place(0), Placement::End);
        assert_eq!(append.place(12345), Placement::End);
        assert_eq!(plain.place(12345), Placement::At(12345));
    }

    #[test]
    fn xattr_answers_follow_the_callers_buffer_size() {
        let value = || Ok(ControlResponse::Xattr(b"abcd".to_vec()));
        assert_eq!(xattr_reply(value(), 0), Ok(XattrReply::Size(4)));
        assert_eq!(xattr_reply(value(), 3), Err(Errno(libc::ERANGE)));
        assert_eq!(
            xattr_reply(value(), 4),
            Ok(XattrReply::Data(b"abcd".to_vec()))
        );
        assert_eq!(
            xattr_reply(value(), 64),
            Ok(XattrReply::Data(b"abcd".to_vec()))
        );
        let empty = Ok(ControlResponse::Xattr(Vec::new()));
        assert_eq!(xattr_reply(empty, 0), Ok(XattrReply::Size(0)));
        let missing = Err(Errno(libc::ENODATA));
        assert_eq!(xattr_reply(missing, 0), Err(Errno(libc::ENODATA)));
        let confused = Ok(ControlResponse::Target(Vec::new()));
        assert_eq!(xattr_reply(confused, 16), Err(Errno(libc::EIO)));
    }

    #[test]
    fn rename_takes_noreplace_and_exchange_and_refuses_other_flags() {
        assert_eq!(rename_flags(0), Ok(0));
        assert_eq!(rename_flags(libc::RENAME_NOREPLACE), Ok(RENAME_NOREPLACE));
        assert_eq!(rename_flags(libc::RENAME_EXCHANGE), Ok(RENAME_EXCHANGE));
        let both = libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE;
        assert_eq!(rename_flags(both), Ok(RENAME_NOREPLACE | RENAME_EXCHANGE));
        assert_eq!(
            rename_flags(libc::RENAME_WHITEOUT),
            Err(Errno(libc::EINVAL))
        );
        let whiteout = libc::RENAME_NOREPLACE | libc::RENAME_WHITEOUT;
        assert_eq!(rename_flags(whiteout), Err(Errno(libc::EINVAL)));
    }

    #[test]
    fn a_new_inode_takes_the_mode_less_the_umask_and_no_file_type() {
        assert_eq!(new_perm(0o777, 0o022), 0o755);
        assert_eq!(new_perm(libc::S_IFREG | 0o4755, 0), 0o4755);
        assert_eq!(new_perm(libc::S_IFDIR | 0o1777, 0o077), 0o1700);
    }

    #[test]
    fn an_errno_is_always_positive() {
        assert_eq!(Errno::new(libc::ENOENT).code(), libc::ENOENT);
        assert_eq!(Errno::new(0), Errno(libc::EIO));
        assert_eq!(Errno::new(-libc::ENOENT), Errno(libc::EIO));
        let shown = Errno::new(libc::ENOENT).to_string();
        assert!(shown.contains("No such file"), "{shown}");
    }

    #[test]
    fn set_times_are_nanoseconds_since_the_epoch_and_now_is_the_mounts_clock() {
        let clock = crate::clock::ManualClock::new(5_000_000_000);
        let t = UNIX_EPOCH + Duration::new(12, 34);
        assert_eq!(nanos(SetTime::At(t), &clock), 12_000_000_034);
        let before_epoch = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(nanos(SetTime::At(before_epoch), &clock), 0);
        assert_eq!(nanos(SetTime::Now, &clock), 5_000_000_000);
        clock.advance(Duration::from_millis(7));
        assert_eq!(nanos(SetTime::Now, &clock), 5_007_000_000);
    }
}
