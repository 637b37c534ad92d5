//! The FUSE filesystem: kernel requests mapped onto the metadata service and the data path.
//!
//! Namespace operations are control RPCs to the primary; reads and writes go through
//! [`FileData`] with one-sided verbs. Files open with direct I/O and parallel direct writes
//! (unless `cache=writeback`), so every mount sees a write as soon as `write()` returns.
//! Permission checks are the kernel's (`default_permissions`).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyLock, ReplyOpen, ReplyStatfs, ReplyWrite,
    ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use rackfs_proto::control::{ControlResponse, ErrorCode};
use rackfs_proto::namespace::{
    Attr, Kind, MetaRequest, NewKind, SetAttr, RENAME_EXCHANGE, RENAME_NOREPLACE,
};
use rackfs_proto::RpcError;

use crate::cluster::Cluster;
use crate::file::FileData;
use crate::options::{CacheMode, MountOptions};
use crate::reclock;

/// A mounted RackFS.
pub struct RackFs {
    cluster: Arc<Cluster>,
    opts: MountOptions,
    files: crate::watch::Files,
    /// Open handles.
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
}

fn errno(e: i32) -> Errno {
    Errno::from_i32(e)
}

fn rpc(e: RpcError) -> Errno {
    match e {
        // The node (named in the error) is gone or not answering: say so where it shows.
        RpcError::Timeout { .. } | RpcError::Connection(_) => {
            tracing::warn!(error = %e, "metadata request failed")
        }
        _ => tracing::debug!(error = %e, "metadata request failed"),
    }
    errno(e.errno())
}

/// Answers a `getxattr` or `listxattr`: the length when the caller asks with size 0, ERANGE
/// when its buffer is too small.
fn reply_xattr(answer: Result<ControlResponse, Errno>, size: u32, reply: ReplyXattr) {
    match answer {
        Ok(ControlResponse::Xattr(v)) if size == 0 => reply.size(v.len() as u32),
        Ok(ControlResponse::Xattr(v)) if v.len() > size as usize => reply.error(Errno::ERANGE),
        Ok(ControlResponse::Xattr(v)) => reply.data(&v),
        Ok(_) => reply.error(Errno::EIO),
        Err(e) => reply.error(e),
    }
}

fn to_time(ns: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(ns)
}

fn to_ns(t: TimeOrNow) -> u64 {
    let t = match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    };
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn kind(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
        Kind::CharDev => FileType::CharDevice,
        Kind::BlockDev => FileType::BlockDevice,
    }
}

fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.allocated.div_ceil(512),
        atime: to_time(a.atime_ns),
        mtime: to_time(a.mtime_ns),
        ctime: to_time(a.ctime_ns),
        crtime: to_time(a.ctime_ns),
        kind: kind(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: 4096,
        flags: 0,
    }
}

/// What a mount remembers of one open file handle.
#[derive(Clone, Copy)]
struct Handle {
    /// Opened with O_APPEND.
    append: bool,
    /// The file had set-user-ID (or set-group-ID with group execute) when opened: a write by
    /// an unprivileged process clears them.
    setid: bool,
}

/// Whether `perm` has bits an unprivileged write must clear (as Linux's `should_remove_suid`).
fn has_setid(perm: u16) -> bool {
    let perm = u32::from(perm);
    perm & libc::S_ISUID != 0
        || perm & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP
}

impl RackFs {
    pub fn new(cluster: Arc<Cluster>, opts: MountOptions) -> RackFs {
        let files: crate::watch::Files = Default::default();
        {
            // On a primary that took over: cached layouts go, and what this mount wrote to
            // its open files (sizes written one-sidedly to the old primary) is reported again.
            let (weak, files) = (Arc::downgrade(&cluster), files.clone());
            cluster.on_failover(move || {
                let Some(cl) = weak.upgrade() else { return };
                let open: Vec<_> = files.lock().expect("files lock").values().cloned().collect();
                // Record locks are reclaimed on a thread of their own: a reclaim that met a
                // failed primary would start another failover, which waits for this one.
                let (held, cluster) = (open.clone(), cl.clone());
                let spawned = std::thread::Builder::new()
                    .name("rackfs-reclaim".into())
                    .spawn(move || held.iter().for_each(|f| f.record_locks.reclaim(&cluster)));
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
        RackFs {
            cluster,
            opts,
            files,
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
        }
    }

    /// Runs a data operation, and once more if it failed with EIO because the primary died
    /// and another took over meanwhile.
    fn across_failover<T>(&self, mut op: impl FnMut() -> Result<T, i32>) -> Result<T, i32> {
        let before = self.cluster.failovers();
        match op() {
            Err(libc::EIO) if self.cluster.primary_replaced(before) => op(),
            r => r,
        }
    }

    fn meta(&self, req: MetaRequest) -> Result<ControlResponse, Errno> {
        self.cluster.meta(req).map_err(rpc)
    }

    fn attr_of(&self, req: MetaRequest) -> Result<Attr, Errno> {
        match self.meta(req)? {
            ControlResponse::Attr(a) => Ok(a),
            _ => Err(Errno::EIO),
        }
    }

    /// This mount's open files (the watcher forgets their sizes on change).
    pub fn files(&self) -> crate::watch::Files {
        self.files.clone()
    }

    /// The cluster this filesystem serves.
    pub fn cluster(&self) -> Arc<Cluster> {
        self.cluster.clone()
    }

    fn ttl(&self) -> Duration {
        self.opts.attr_timeout
    }

    fn file(&self, a: &Attr) -> Result<Arc<FileData>, Errno> {
        let layout = a.layout.ok_or(Errno::EISDIR)?;
        Ok(self
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
                ))
            })
            .clone())
    }

    fn cached_file(&self, ino: u64) -> Option<Arc<FileData>> {
        self.files.lock().expect("files lock").get(&ino).cloned()
    }

    fn open_flags(&self) -> FopenFlags {
        match self.opts.cache {
            CacheMode::None => {
                FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES
            }
            CacheMode::Writeback => FopenFlags::FOPEN_KEEP_CACHE,
        }
    }

    /// Registers an open with the metadata service and returns a new handle.
    fn open_handle(&self, a: &Attr, flags: i32) -> Result<u64, Errno> {
        if a.kind == Kind::File {
            self.file(a)?;
        }
        self.meta(MetaRequest::Open { ino: a.ino })?;
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().expect("handles lock").insert(
            fh,
            Handle {
                append: flags & libc::O_APPEND != 0,
                setid: has_setid(a.perm),
            },
        );
        Ok(fh)
    }

    fn create_node(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        kind: NewKind,
        perm: u16,
    ) -> Result<Attr, Errno> {
        if self.opts.read_only {
            return Err(Errno::EROFS);
        }
        self.attr_of(MetaRequest::Create {
            parent: parent.0,
            name: name.as_bytes().to_vec(),
            kind,
            perm,
            uid: req.uid(),
            gid: req.gid(),
        })
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
                    .truncate(&self.cluster, size, || setattr().map_err(i32::from))
                    .map_err(errno)
            }
            _ => setattr(),
        }
    }

    /// unlink (`dir` false) or rmdir (`dir` true).
    fn remove(&self, parent: INodeNo, name: &OsStr, dir: bool, reply: ReplyEmpty) {
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let (parent, name) = (parent.0, name.as_bytes().to_vec());
        let req = if dir {
            MetaRequest::Rmdir { parent, name }
        } else {
            MetaRequest::Unlink { parent, name }
        };
        match self.meta(req) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn writable(&self) -> Result<(), Errno> {
        if self.opts.read_only {
            Err(Errno::EROFS)
        } else {
            Ok(())
        }
    }
}

impl Filesystem for RackFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.add_capabilities(fuser::InitFlags::FUSE_PARALLEL_DIROPS);
        // fcntl and flock locks go to the filesystem (held across mounts), not the kernel.
        if let Err(missing) = config.add_capabilities(
            fuser::InitFlags::FUSE_POSIX_LOCKS | fuser::InitFlags::FUSE_FLOCK_LOCKS,
        ) {
            tracing::warn!(?missing, "the kernel keeps file locks local to this mount");
        }
        // Files are opened for direct I/O; this lets them be mapped too (MAP_SHARED included):
        // a mapping goes through the page cache, written back on msync, munmap or close.
        if let Err(missing) = config.add_capabilities(fuser::InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP) {
            tracing::warn!(
                ?missing,
                "the kernel cannot map direct-I/O files (Linux 6.6 or later can): shared \
                 mappings of RackFS files fail with ENODEV"
            );
        }
        if self.opts.cache == CacheMode::Writeback {
            // The kernel buffers writes and flushes them later: fast for one writer, but other
            // mounts see them only after the flush (doc/SEMANTICS.md).
            if let Err(missing) = config.add_capabilities(fuser::InitFlags::FUSE_WRITEBACK_CACHE) {
                tracing::warn!(
                    ?missing,
                    "the kernel offers no writeback cache; cache=writeback acts as keep_cache"
                );
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.attr_of(MetaRequest::Lookup {
            parent: parent.0,
            name: name.as_bytes().to_vec(),
        }) {
            Ok(a) => reply.entry(&self.ttl(), &file_attr(&a), Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr_of(MetaRequest::GetAttr { ino: ino.0 }) {
            Ok(a) => reply.attr(&self.ttl(), &file_attr(&a)),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let set = SetAttr {
            perm: mode.map(|m| (m & 0o7777) as u16),
            uid,
            gid,
            size,
            atime_ns: atime.map(to_ns),
            mtime_ns: mtime.map(to_ns),
            // A truncate by an unprivileged process arrives with the cleared mode already
            // (the kernel turns ATTR_KILL_SUID into a mode change).
            kill_suidgid: false,
        };
        let res = match size {
            Some(_) => self.set_size(ino.0, set),
            None => self.attr_of(MetaRequest::SetAttr { ino: ino.0, set }),
        };
        match res {
            Ok(a) => reply.attr(&self.ttl(), &file_attr(&a)),
            Err(e) => reply.error(e),
        }
    }

    /// `fallocate(2)`: reserve (mode 0, `KEEP_SIZE`), punch a hole (`PUNCH_HOLE|KEEP_SIZE`)
    /// or zero a range (`ZERO_RANGE`), under the whole-file lock; other modes `EOPNOTSUPP`.
    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let Some(f) = self.cached_file(ino.0) else {
            return reply.error(Errno::EBADF);
        };
        let send = |offset, len| {
            let req = MetaRequest::Fallocate {
                ino: ino.0,
                offset,
                len,
                mode: mode as u32,
            };
            self.meta(req).map(|_| ()).map_err(i32::from)
        };
        let res = self.across_failover(|| f.fallocate(&self.cluster, offset, length, send));
        match res {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        position: u32,
        reply: ReplyEmpty,
    ) {
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        if position != 0 {
            return reply.error(Errno::EINVAL); // macOS resource forks only
        }
        match self.meta(MetaRequest::SetXattr {
            ino: ino.0,
            name: name.as_bytes().to_vec(),
            value: value.to_vec(),
            flags: flags as u32,
        }) {
            Ok(_) => {
                if let Some(f) = self.cached_file(ino.0) {
                    f.set_lacks_capability(false);
                }
                reply.ok()
            }
            Err(e) => reply.error(e),
        }
    }

    /// The kernel asks for `security.capability` before every buffered write: for a file open
    /// here, an answer of "none" is kept until the watcher reports a change to the file (so
    /// only while the watcher runs, `attr_timeout` > 0).
    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let capability = name.as_bytes() == b"security.capability";
        let open = capability && !self.ttl().is_zero();
        let open = open.then(|| self.cached_file(ino.0)).flatten();
        if open.as_ref().is_some_and(|f| f.lacks_capability()) {
            return reply.error(Errno::ENODATA);
        }
        let req = MetaRequest::GetXattr {
            ino: ino.0,
            name: name.as_bytes().to_vec(),
        };
        let answer = self.meta(req);
        if let Some(f) = open {
            f.set_lacks_capability(answer == Err(Errno::ENODATA));
        }
        reply_xattr(answer, size, reply);
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        reply_xattr(
            self.meta(MetaRequest::ListXattr { ino: ino.0 }),
            size,
            reply,
        );
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        match self.meta(MetaRequest::RemoveXattr {
            ino: ino.0,
            name: name.as_bytes().to_vec(),
        }) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.meta(MetaRequest::ReadLink { ino: ino.0 }) {
            Ok(ControlResponse::Target(t)) => reply.data(&t),
            Ok(_) => reply.error(Errno::EIO),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let perm = (mode & !umask & 0o7777) as u16;
        let special = |kind| NewKind::Special { kind, rdev };
        let kind = match mode & libc::S_IFMT {
            libc::S_IFREG | 0 => NewKind::File {
                stripe_unit: self.opts.stripe_unit,
                replicas: self.opts.replicas,
            },
            libc::S_IFIFO => special(Kind::Fifo),
            libc::S_IFSOCK => special(Kind::Socket),
            libc::S_IFCHR => special(Kind::CharDev),
            libc::S_IFBLK => special(Kind::BlockDev),
            _ => return reply.error(Errno::EINVAL),
        };
        match self.create_node(req, parent, name, kind, perm) {
            Ok(a) => reply.entry(&self.ttl(), &file_attr(&a), Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        match self.create_node(
            req,
            parent,
            name,
            NewKind::Dir,
            (mode & !umask & 0o7777) as u16,
        ) {
            Ok(a) => reply.entry(&self.ttl(), &file_attr(&a), Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent, name, false, reply)
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent, name, true, reply)
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let kind = NewKind::Symlink(target.as_os_str().as_bytes().to_vec());
        match self.create_node(req, parent, link_name, kind, 0o777) {
            Ok(a) => reply.entry(&self.ttl(), &file_attr(&a), Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let mut f = 0;
        if flags.contains(RenameFlags::RENAME_NOREPLACE) {
            f |= RENAME_NOREPLACE;
        }
        if flags.contains(RenameFlags::RENAME_EXCHANGE) {
            f |= RENAME_EXCHANGE;
        }
        if flags.bits() & !(RenameFlags::RENAME_NOREPLACE | RenameFlags::RENAME_EXCHANGE).bits()
            != 0
        {
            return reply.error(Errno::EINVAL);
        }
        match self.meta(MetaRequest::Rename {
            parent: parent.0,
            name: name.as_bytes().to_vec(),
            new_parent: newparent.0,
            new_name: newname.as_bytes().to_vec(),
            flags: f,
        }) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        match self.attr_of(MetaRequest::Link {
            ino: ino.0,
            parent: newparent.0,
            name: newname.as_bytes().to_vec(),
        }) {
            Ok(a) => reply.entry(&self.ttl(), &file_attr(&a), Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let f = flags.0;
        if self.opts.read_only && f & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        let a = match self.attr_of(MetaRequest::GetAttr { ino: ino.0 }) {
            Ok(a) => a,
            // The kernel's cached name points at a file another mount removed: ESTALE makes
            // the kernel look the name up again and retry the open (it then creates the file
            // for O_CREAT, or returns ENOENT), as NFS clients do.
            Err(e) if e == Errno::ENOENT => return reply.error(Errno::ESTALE),
            Err(e) => return reply.error(e),
        };
        match self.open_handle(&a, f) {
            Ok(fh) => reply.opened(FileHandle(fh), self.open_flags()),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let kind = NewKind::File {
            stripe_unit: self.opts.stripe_unit,
            replicas: self.opts.replicas,
        };
        let a = match self.create_node(req, parent, name, kind, (mode & !umask & 0o7777) as u16) {
            Ok(a) => a,
            // Another mount created the name since the kernel looked it up: without O_EXCL
            // the open succeeds on that file, as on a local filesystem, and O_TRUNC empties it
            // (as when two local opens race: the later one truncates).
            Err(e) if e == Errno::EEXIST && flags & libc::O_EXCL == 0 => {
                let found = self.attr_of(MetaRequest::Lookup {
                    parent: parent.0,
                    name: name.as_bytes().to_vec(),
                });
                let res = match found {
                    Ok(a) if flags & libc::O_TRUNC != 0 && a.kind == Kind::File => self.set_size(
                        a.ino,
                        SetAttr {
                            size: Some(0),
                            ..SetAttr::default()
                        },
                    ),
                    other => other,
                };
                match res {
                    Ok(a) => a,
                    Err(e) => return reply.error(e),
                }
            }
            Err(e) => return reply.error(e),
        };
        match self.open_handle(&a, flags) {
            Ok(fh) => reply.created(
                &self.ttl(),
                &file_attr(&a),
                Generation(0),
                FileHandle(fh),
                self.open_flags(),
            ),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(f) = self.cached_file(ino.0) else {
            return reply.error(Errno::EBADF);
        };
        let mut reply = Some(reply);
        let result = self.across_failover(|| {
            f.read_with(&self.cluster, offset, size, |d| {
                if let Some(r) = reply.take() {
                    r.data(d)
                }
            })
        });
        if let (Err(e), Some(r)) = (result, reply.take()) {
            r.error(errno(e));
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let Some(f) = self.cached_file(ino.0) else {
            return reply.error(Errno::EBADF);
        };
        let handle = self
            .handles
            .lock()
            .expect("handles lock")
            .get(&fh.0)
            .copied();
        let append = handle.is_some_and(|h| h.append);
        // The kernel asks a write by a process without CAP_FSETID to clear set-user-ID and
        // set-group-ID; one RPC, and only for files that had those bits when opened.
        if handle.is_some_and(|h| h.setid)
            && write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID)
        {
            let set = SetAttr {
                kill_suidgid: true,
                ..SetAttr::default()
            };
            if let Err(e) = self.attr_of(MetaRequest::SetAttr { ino: ino.0, set }) {
                return reply.error(e);
            }
            if let Some(h) = self.handles.lock().expect("handles lock").get_mut(&fh.0) {
                h.setid = false;
            }
        }
        // O_APPEND: the end of the file as the cluster knows it, not the kernel's cached size.
        // Written again in full after a failover: the same bytes at the same place. (An
        // O_APPEND write whose first attempt landed before the primary died lands twice.)
        let res = self.across_failover(|| {
            if append {
                f.append(&self.cluster, data).map(|_| ())
            } else {
                f.write_locked(&self.cluster, offset, data)
            }
        });
        match res {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// Writes are in remote memory when `write()` returns; a close drops the closing
    /// process's `fcntl` locks on the file (POSIX: any close of the file does).
    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let Some(f) = self.cached_file(ino.0) else {
            return reply.ok();
        };
        match f.record_locks.closed_by(&self.cluster, lock_owner.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// `F_GETLK`: the first lock of another owner, on any mount, that conflicts.
    fn getlk(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        reply: ReplyLock,
    ) {
        let Some(f) = self.cached_file(ino.0) else {
            return reply.error(Errno::EBADF);
        };
        let r = reclock::Request::new(lock_owner.0, pid, start, end, typ);
        match f.record_locks.test(&self.cluster, &r) {
            Ok(Some((start, end, typ, pid))) => reply.locked(start, end, typ, pid),
            Ok(None) => reply.locked(0, 0, libc::F_UNLCK, 0),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// `F_SETLK`, `F_SETLKW` and `flock`, held across every mount. A request that must wait
    /// does so on a thread of its own (the FUSE workers stay free for the holders' unlocks).
    fn setlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        let Some(f) = self.cached_file(ino.0) else {
            return reply.error(Errno::EBADF);
        };
        let r = reclock::Request::new(lock_owner.0, pid, start, end, typ);
        match f.record_locks.try_set(&self.cluster, fh.0, &r) {
            Ok(true) => return reply.ok(),
            Ok(false) if !sleep => return reply.error(Errno::EAGAIN),
            Ok(false) => {}
            Err(e) => return reply.error(errno(e)),
        }
        let (cluster, tid) = (self.cluster.clone(), req.pid());
        let waiter = std::thread::Builder::new()
            .name("rackfs-lockwait".into())
            .spawn(move || {
                let interrupted = || reclock::signal_pending(pid, tid);
                match f.record_locks.set_waiting(&cluster, fh.0, &r, interrupted) {
                    Ok(()) => reply.ok(),
                    Err(e) => reply.error(errno(e)),
                }
            });
        if let Err(e) = waiter {
            tracing::warn!(error = %e, "no thread to wait for a lock on");
        }
    }

    /// The data is in remote memory when `write` returns; fsync also makes the size and mtime
    /// this mount wrote one-sidedly part of the metadata the standby mirrors, so they survive
    /// the primary even if this mount dies with it.
    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let wrote = self.cached_file(ino.0).and_then(|f| f.written());
        let Some((size, mtime)) = wrote else {
            return reply.ok();
        };
        match self.meta(MetaRequest::Settle {
            ino: ino.0,
            size,
            mtime,
        }) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // The last close of an open file drops its flock and OFD locks.
        if let Some(f) = self.cached_file(ino.0) {
            if let Err(e) = f.record_locks.released(&self.cluster, fh.0) {
                tracing::warn!(
                    ino = ino.0,
                    errno = e,
                    "the locks of a closed file were not dropped"
                );
            }
        }
        self.handles.lock().expect("handles lock").remove(&fh.0);
        match self.meta(MetaRequest::Release { ino: ino.0 }) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let mut after = offset;
        loop {
            let entries = match self.meta(MetaRequest::ReadDir {
                ino: ino.0,
                after,
                max: 256,
            }) {
                Ok(ControlResponse::Entries(e)) => e,
                Ok(_) => return reply.error(Errno::EIO),
                Err(e) => return reply.error(e),
            };
            if entries.is_empty() {
                return reply.ok();
            }
            for e in entries {
                if reply.add(
                    INodeNo(e.ino),
                    e.cookie,
                    kind(e.kind),
                    OsStr::from_bytes(&e.name),
                ) {
                    return reply.ok();
                }
                after = e.cookie;
            }
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.meta(MetaRequest::StatFs) {
            Ok(ControlResponse::FsStat(s)) => reply.statfs(
                s.capacity / 4096,
                s.free / 4096,
                s.free / 4096,
                s.files,
                u32::MAX as u64,
                4096,
                255,
                4096,
            ),
            Ok(_) => reply.error(Errno::EIO),
            Err(e) => reply.error(e),
        }
    }
}
