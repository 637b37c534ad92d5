//! `rackfs-memfs DIR`: the FUSE ceiling baseline for benchmarks — a minimal in-memory
//! filesystem on fuser with the same configuration as a RackFS mount (4 threads, `clone_fd`,
//! direct I/O with parallel direct writes). Regular files in a tree of directories; enough for
//! fio and for untarring a source tree (modes, owners and times are not kept). Unmounts on
//! SIGTERM/SIGINT.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::{Mutex, RwLock};
use std::time::{Duration, SystemTime};

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

const TTL: Duration = Duration::from_secs(1);

struct MemFs {
    /// Each directory's entries (name to inode), by the directory's inode; the root is 1.
    dirs: Mutex<Dirs>,
    files: RwLock<HashMap<u64, RwLock<Vec<u8>>>>,
    next: Mutex<u64>,
}

impl Default for MemFs {
    fn default() -> MemFs {
        MemFs {
            dirs: Mutex::new(HashMap::from([(1, HashMap::new())])),
            files: RwLock::default(),
            next: Mutex::new(1),
        }
    }
}

/// Directories: each one's entries (name to inode), by the directory's inode.
type Dirs = HashMap<u64, HashMap<Vec<u8>, u64>>;

/// The inode `name` in directory `parent` names, if any.
fn child(dirs: &Dirs, parent: INodeNo, name: &OsStr) -> Option<u64> {
    dirs.get(&parent.0)
        .and_then(|d| d.get(name.as_encoded_bytes()).copied())
}

fn attr(ino: u64, size: u64, dir: bool) -> FileAttr {
    let t = SystemTime::UNIX_EPOCH;
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size.div_ceil(512),
        atime: t,
        mtime: t,
        ctime: t,
        crtime: t,
        kind: if dir {
            FileType::Directory
        } else {
            FileType::RegularFile
        },
        perm: if dir { 0o755 } else { 0o644 },
        nlink: if dir { 2 } else { 1 },
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl MemFs {
    fn size(&self, ino: u64) -> Option<u64> {
        self.files
            .read()
            .unwrap()
            .get(&ino)
            .map(|f| f.read().unwrap().len() as u64)
    }
    fn attr_of(&self, ino: u64) -> Option<FileAttr> {
        if ino == 1 {
            return Some(attr(1, 4096, true));
        }
        self.size(ino).map(|s| attr(ino, s, false)).or_else(|| {
            self.dirs
                .lock()
                .unwrap()
                .contains_key(&ino)
                .then(|| attr(ino, 4096, true))
        })
    }
    fn new_ino(&self) -> u64 {
        let mut n = self.next.lock().unwrap();
        *n += 1;
        *n
    }
}

const FLAGS: FopenFlags =
    FopenFlags::FOPEN_DIRECT_IO.union(FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES);

impl Filesystem for MemFs {
    fn lookup(&self, _r: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let ino = child(&self.dirs.lock().unwrap(), parent, name);
        match ino.and_then(|i| self.attr_of(i)) {
            Some(a) => reply.entry(&TTL, &a, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }
    fn getattr(&self, _r: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr_of(ino.0) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }
    fn setattr(
        &self,
        _r: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        if let Some(s) = size {
            if let Some(f) = self.files.read().unwrap().get(&ino.0) {
                f.write().unwrap().resize(s as usize, 0);
            }
        }
        match self.attr_of(ino.0) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }
    fn create(
        &self,
        _r: &Request,
        parent: INodeNo,
        name: &OsStr,
        _m: u32,
        _u: u32,
        _f: i32,
        reply: ReplyCreate,
    ) {
        let mut dirs = self.dirs.lock().unwrap();
        let Some(names) = dirs.get_mut(&parent.0) else {
            return reply.error(Errno::ENOENT);
        };
        let ino = *names
            .entry(name.as_encoded_bytes().to_vec())
            .or_insert_with(|| self.new_ino());
        if dirs.contains_key(&ino) {
            return reply.error(Errno::EISDIR);
        }
        drop(dirs);
        self.files.write().unwrap().entry(ino).or_default();
        reply.created(
            &TTL,
            &self.attr_of(ino).unwrap(),
            Generation(0),
            FileHandle(0),
            FLAGS,
        );
    }
    fn open(&self, _r: &Request, _ino: INodeNo, _f: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FLAGS);
    }
    fn read(
        &self,
        _r: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _f: OpenFlags,
        _l: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let files = self.files.read().unwrap();
        let Some(f) = files.get(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let d = f.read().unwrap();
        let start = (offset as usize).min(d.len());
        let end = (start + size as usize).min(d.len());
        reply.data(&d[start..end]);
    }
    fn write(
        &self,
        _r: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _wf: WriteFlags,
        _f: OpenFlags,
        _l: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let files = self.files.read().unwrap();
        let Some(f) = files.get(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let end = offset as usize + data.len();
        let mut w = f.write().unwrap();
        if w.len() < end {
            w.resize(end, 0);
        }
        w[offset as usize..end].copy_from_slice(data);
        reply.written(data.len() as u32);
    }
    fn flush(&self, _r: &Request, _i: INodeNo, _fh: FileHandle, _l: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }
    fn mkdir(
        &self,
        _r: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let mut dirs = self.dirs.lock().unwrap();
        let Some(names) = dirs.get_mut(&parent.0) else {
            return reply.error(Errno::ENOENT);
        };
        if names.contains_key(name.as_encoded_bytes()) {
            return reply.error(Errno::EEXIST);
        }
        let ino = self.new_ino();
        names.insert(name.as_encoded_bytes().to_vec(), ino);
        dirs.insert(ino, HashMap::new());
        reply.entry(&TTL, &attr(ino, 4096, true), Generation(0));
    }
    fn unlink(&self, _r: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut dirs = self.dirs.lock().unwrap();
        let Some(ino) = child(&dirs, parent, name) else {
            return reply.error(Errno::ENOENT);
        };
        if dirs.contains_key(&ino) {
            return reply.error(Errno::EISDIR);
        }
        dirs.get_mut(&parent.0)
            .unwrap()
            .remove(name.as_encoded_bytes());
        drop(dirs);
        self.files.write().unwrap().remove(&ino);
        reply.ok()
    }
    fn rmdir(&self, _r: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut dirs = self.dirs.lock().unwrap();
        let Some(ino) = child(&dirs, parent, name) else {
            return reply.error(Errno::ENOENT);
        };
        match dirs.get(&ino) {
            None => return reply.error(Errno::ENOTDIR),
            Some(d) if !d.is_empty() => return reply.error(Errno::ENOTEMPTY),
            Some(_) => {}
        }
        dirs.remove(&ino);
        dirs.get_mut(&parent.0)
            .unwrap()
            .remove(name.as_encoded_bytes());
        reply.ok()
    }
    fn readdir(
        &self,
        _r: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let dirs = self.dirs.lock().unwrap();
        let Some(names) = dirs.get(&ino.0) else {
            return reply.error(Errno::ENOTDIR);
        };
        let mut all: Vec<(Vec<u8>, u64)> = names.iter().map(|(n, i)| (n.clone(), *i)).collect();
        all.sort();
        for (i, (n, ino)) in all.iter().enumerate().skip(offset as usize) {
            let kind = if dirs.contains_key(ino) {
                FileType::Directory
            } else {
                FileType::RegularFile
            };
            if reply.add(INodeNo(*ino), i as u64 + 1, kind, OsStr::from_bytes(n)) {
                break;
            }
        }
        reply.ok();
    }
}

fn main() {
    let dir = std::env::args().nth(1).expect("usage: rackfs-memfs DIR");
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("memfs".into()),
        MountOption::DefaultPermissions,
    ];
    config.n_threads = Some(4);
    config.clone_fd = true;
    let mut session = fuser::Session::new(MemFs::default(), &dir, &config).expect("mount memfs");
    let mut unmounter = session.unmount_callable();
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT])
        .expect("signal handlers");
    std::thread::spawn(move || {
        if signals.forever().next().is_some() {
            let _ = unmounter.unmount();
        }
    });
    session.run().expect("memfs session");
}
