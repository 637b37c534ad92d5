//! The FUSE adapter: translates kernel requests into calls on the client core
//! ([`crate::client::Client`]) and its answers into replies.
//!
//! It holds no policy: failover and retries, the set-user-ID rules, O_APPEND, open handles,
//! record-lock waits, read-only refusals and truncates are the core's. What stays here is
//! fuser's vocabulary: the kernel configuration asked for in `init`, attributes as
//! [`FileAttr`] (4 KiB `blksize`, `blocks` in 512-byte units of the memory held), open flags
//! for the core's [`Caching`], and errors as [`fuser::Errno`] (the same number).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig,
    LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLock, ReplyOpen, ReplyStatfs, ReplyWrite,
    ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use rackfs_proto::namespace::{Attr, Kind};

use crate::client::{AttrChange, Caching, Caller, Client, Errno, SetTime, XattrReply};
use crate::cluster::Cluster;
use crate::options::MountOptions;
use crate::reclock;

/// A mounted RackFS, as fuser serves it.
pub struct RackFs {
    client: Client,
}

/// The errno to reply with; an EIO (the application sees an I/O error) is logged, so the
/// mount's log shows every one next to the warnings that explain it.
fn errno(e: Errno) -> fuser::Errno {
    if e.code() == libc::EIO {
        tracing::warn!("an operation failed with EIO");
    }
    fuser::Errno::from_i32(e.code())
}

fn to_time(ns: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(ns)
}

fn set_time(t: TimeOrNow) -> SetTime {
    match t {
        TimeOrNow::SpecificTime(t) => SetTime::At(t),
        TimeOrNow::Now => SetTime::Now,
    }
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

fn open_flags(c: Caching) -> FopenFlags {
    match c {
        Caching::Direct => FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES,
        Caching::Writeback => FopenFlags::FOPEN_KEEP_CACHE,
    }
}

fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
    }
}

fn reply_empty(res: Result<(), Errno>, reply: ReplyEmpty) {
    match res {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(e)),
    }
}

fn reply_xattr(res: Result<XattrReply, Errno>, reply: ReplyXattr) {
    match res {
        Ok(XattrReply::Size(n)) => reply.size(n),
        Ok(XattrReply::Data(v)) => reply.data(&v),
        Err(e) => reply.error(errno(e)),
    }
}

impl RackFs {
    pub fn new(cluster: Arc<Cluster>, opts: MountOptions) -> RackFs {
        RackFs {
            client: Client::new(cluster, opts),
        }
    }

    /// The client core this adapter serves.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Runs one filesystem operation of the core, recorded in the mount's metrics.
    fn timed<T>(&self, op: &str, f: impl FnOnce() -> Result<T, Errno>) -> Result<T, Errno> {
        let cl = self.client.cluster();
        let started = cl.clock().now();
        let r = f();
        let took = cl.clock().now().saturating_sub(started);
        cl.metrics()
            .op(op, took, r.as_ref().err().map(|e| e.code()));
        r
    }

    /// This mount's caches (the watcher makes them forget other mounts' changes).
    pub fn caches(&self) -> crate::caches::Caches {
        self.client.caches()
    }

    /// This mount's queued last closes (see [`crate::releases`]).
    pub fn releases(&self) -> std::sync::Arc<crate::releases::Releases> {
        self.client.releases()
    }

    /// The cluster this filesystem serves.
    pub fn cluster(&self) -> Arc<Cluster> {
        self.client.cluster()
    }

    fn reply_entry(&self, res: Result<Attr, Errno>, reply: ReplyEntry) {
        match res {
            Ok(a) => reply.entry(&self.client.ttl(), &file_attr(&a), Generation(0)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn reply_attr(&self, res: Result<Attr, Errno>, reply: ReplyAttr) {
        match res {
            Ok(a) => reply.attr(&self.client.ttl(), &file_attr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }
}

impl Filesystem for RackFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.add_capabilities(fuser::InitFlags::FUSE_PARALLEL_DIROPS);
        // Listings carry each entry's attributes (one request per 256 names, no lookup per
        // name after it) where the kernel caches them, that is unless `attr_timeout=0`; the
        // kernel picks readdirplus when a listing's names are looked up (`ls -l`, `find`,
        // `rm -r`).
        if !self.client.ttl().is_zero() {
            let _ = config.add_capabilities(
                fuser::InitFlags::FUSE_DO_READDIRPLUS | fuser::InitFlags::FUSE_READDIRPLUS_AUTO,
            );
        }
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
        if self.client.caching() == Caching::Writeback {
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
        self.reply_entry(
            self.timed("lookup", || self.client.lookup(parent.0, name)),
            reply,
        )
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.reply_attr(self.timed("getattr", || self.client.getattr(ino.0)), reply)
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
        let change = AttrChange {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(set_time),
            mtime: mtime.map(set_time),
        };
        self.reply_attr(
            self.timed("setattr", || self.client.setattr(ino.0, change)),
            reply,
        )
    }

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
        reply_empty(
            self.timed("fallocate", || {
                self.client.fallocate(ino.0, offset, length, mode)
            }),
            reply,
        )
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
        let res = self.timed("setxattr", || {
            self.client.setxattr(ino.0, name, value, flags, position)
        });
        reply_empty(res, reply)
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        reply_xattr(
            self.timed("getxattr", || self.client.getxattr(ino.0, name, size)),
            reply,
        )
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        reply_xattr(
            self.timed("listxattr", || self.client.listxattr(ino.0, size)),
            reply,
        )
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply_empty(
            self.timed("removexattr", || self.client.removexattr(ino.0, name)),
            reply,
        )
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.timed("readlink", || self.client.readlink(ino.0)) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(errno(e)),
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
        let res = self.timed("mknod", || {
            self.client
                .mknod(parent.0, name, mode, umask, rdev, caller(req))
        });
        self.reply_entry(res, reply)
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
        let res = self.timed("mkdir", || {
            self.client.mkdir(parent.0, name, mode, umask, caller(req))
        });
        self.reply_entry(res, reply)
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply_empty(
            self.timed("unlink", || self.client.unlink(parent.0, name)),
            reply,
        )
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply_empty(
            self.timed("rmdir", || self.client.rmdir(parent.0, name)),
            reply,
        )
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let res = self.timed("symlink", || {
            self.client
                .symlink(parent.0, link_name, target, caller(req))
        });
        self.reply_entry(res, reply)
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
        let res = self.timed("rename", || {
            self.client
                .rename(parent.0, name, newparent.0, newname, flags.bits())
        });
        reply_empty(res, reply)
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        self.reply_entry(
            self.timed("link", || self.client.link(ino.0, newparent.0, newname)),
            reply,
        )
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        match self.timed("open", || self.client.open(ino.0, flags.0)) {
            Ok(o) => reply.opened(FileHandle(o.fh), open_flags(o.caching)),
            Err(e) => reply.error(errno(e)),
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
        let res = self.timed("create", || {
            self.client
                .create(parent.0, name, mode, umask, flags, caller(req))
        });
        match res {
            Ok((a, o)) => reply.created(
                &self.client.ttl(),
                &file_attr(&a),
                Generation(0),
                FileHandle(o.fh),
                open_flags(o.caching),
            ),
            Err(e) => reply.error(errno(e)),
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
        // The data is replied straight from the core's buffer; an error only if none was.
        let mut reply = Some(reply);
        let res = self.timed("read", || {
            self.client.read(ino.0, offset, size, |d| {
                if let Some(r) = reply.take() {
                    r.data(d)
                }
            })
        });
        if let (Err(e), Some(r)) = (res, reply.take()) {
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
        let kill_suidgid = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        match self.timed("write", || {
            self.client.write(ino.0, fh.0, offset, data, kill_suidgid)
        }) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply_empty(
            self.timed("flush", || self.client.flush(ino.0, lock_owner.0)),
            reply,
        )
    }

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
        let r = reclock::Request::new(lock_owner.0, pid, start, end, typ);
        match self.timed("getlk", || self.client.getlk(ino.0, &r)) {
            Ok(Some((start, end, typ, pid))) => reply.locked(start, end, typ, pid),
            Ok(None) => reply.locked(0, 0, libc::F_UNLCK, 0),
            Err(e) => reply.error(errno(e)),
        }
    }

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
        let r = reclock::Request::new(lock_owner.0, pid, start, end, typ);
        let done = move |res| reply_empty(res, reply);
        self.client.setlk(ino.0, fh.0, r, req.pid(), sleep, done)
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply_empty(self.timed("fsync", || self.client.fsync(ino.0)), reply)
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
        reply_empty(
            self.timed("release", || self.client.release(ino.0, fh.0)),
            reply,
        )
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let res = self.timed("readdir", || {
            self.client.readdir(ino.0, offset, |e| {
                let name = OsStr::from_bytes(&e.name);
                reply.add(INodeNo(e.ino), e.cookie, kind(e.kind), name)
            })
        });
        match res {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let ttl = self.client.ttl();
        let res = self.timed("readdirplus", || {
            self.client.readdir_plus(ino.0, offset, |e, a| {
                let name = OsStr::from_bytes(&e.name);
                reply.add(
                    INodeNo(e.ino),
                    e.cookie,
                    name,
                    &ttl,
                    &file_attr(a),
                    Generation(0),
                )
            })
        });
        match res {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// RackFS files take no ioctl: `ENOTTY`, the answer of a file without that control, and
    /// no log line (Python's `open` asks whether every file is a terminal).
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        reply.error(fuser::Errno::from_i32(libc::ENOTTY));
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.timed("statfs", || self.client.statfs()) {
            Ok(s) => reply.statfs(
                s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize,
            ),
            Err(e) => reply.error(errno(e)),
        }
    }
}
