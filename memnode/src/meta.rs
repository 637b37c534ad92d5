//! The metadata service of the primary memory node: namespace, attributes and file layouts.
//!
//! Namespace operations arrive by control RPC and run under one lock. Regular files also have
//! state that clients read and update one-sidedly, kept in the primary's region:
//!
//! * a **file record** of [`RECORD_LEN`] bytes: `size` (word 0; clients grow it with CAS-max,
//!   the service sets it on truncate), `mtime` in ns (word 1; clients write it after data
//!   writes), the extent table's offset and capacity (words 2-3; only the service writes them,
//!   table before record, so a reader never sees a table that is not yet filled), the stripe
//!   unit (word 4), the inode number (word 5) and the published lock tree (word 6, a
//!   [`crate::locktree::TreeWord`]; only the service writes it, see [`crate::locktree`]);
//! * an **extent table**: per stripe index, 16 bytes `location, tag` where location is
//!   `node_id << 48 | data offset` on that node and `tag` identifies the allocation (0: hole).
//!   Only the service writes it: location then tag on allocation, tag then location on free.
//!
//! Every stripe extent carries its tag in its first 8 bytes on its data node. A client reads
//! that tag in the same batch as the stripe's data: a mismatch means its cached layout is
//! stale (the stripe was freed by truncate or unlink) and the operation is redone. Freed
//! stripes are quarantined before reuse, so a stale operation never touches another file's data.
//! When a table grows it is copied and the old copy kept until the file is deleted, because
//! clients may still read it; they re-check the record after reading entries from a table.

use std::collections::{BTreeMap, HashMap};
use std::time::{SystemTime, UNIX_EPOCH};

use rackfs_verbs::Region;
use serde::{Deserialize, Serialize};

use crate::control::{ControlResponse, ErrorCode, FsStat};
use crate::locktree::{LockTrees, TreeMemory, TreeWord};

pub const ROOT_INO: u64 = 1;
pub const RECORD_LEN: u64 = 64;
pub const REC_SIZE: u64 = 0;
pub const REC_MTIME: u64 = 8;
pub const REC_TABLE: u64 = 16;
pub const REC_TABLE_CAP: u64 = 24;
pub const REC_STRIPE: u64 = 32;
pub const REC_INO: u64 = 40;
pub const REC_LOCKS: u64 = 48;
pub const ENTRY_LEN: u64 = 16;
/// Largest file size (EFBIG beyond).
pub const MAX_FILE_SIZE: u64 = 1 << 46;
pub const MAX_NAME: usize = 255;
/// Stripe units allowed: multiples of 4 KiB from 4 KiB to 64 MiB.
pub const MAX_STRIPE_UNIT: u64 = 64 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDev,
    BlockDev,
}

/// What to create.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NewKind {
    File { stripe_unit: u64 },
    Dir,
    Symlink(Vec<u8>),
    Special { kind: Kind, rdev: u32 },
}

/// Where a regular file's record lives (always on the primary).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileLayout {
    pub node: u32,
    pub record: u64,
    pub stripe_unit: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attr {
    pub ino: u64,
    pub kind: Kind,
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub atime_ns: u64,
    pub mtime_ns: u64,
    pub ctime_ns: u64,
    pub rdev: u32,
    pub layout: Option<FileLayout>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetAttr {
    pub perm: Option<u16>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime_ns: Option<u64>,
    pub mtime_ns: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// Position in the directory: stable while the entry exists, never reused.
    pub cookie: u64,
    pub ino: u64,
    pub kind: Kind,
    pub name: Vec<u8>,
}

/// One allocated stripe: data at `offset` on `node`, tag at `offset - TAG_SPACE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StripeExtent {
    pub node: u32,
    pub offset: u64,
    pub tag: u64,
}

pub const RENAME_NOREPLACE: u32 = 1;
pub const RENAME_EXCHANGE: u32 = 2;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaRequest {
    Lookup {
        parent: u64,
        name: Vec<u8>,
    },
    GetAttr {
        ino: u64,
    },
    SetAttr {
        ino: u64,
        set: SetAttr,
    },
    Create {
        parent: u64,
        name: Vec<u8>,
        kind: NewKind,
        perm: u16,
        uid: u32,
        gid: u32,
    },
    Link {
        ino: u64,
        parent: u64,
        name: Vec<u8>,
    },
    Unlink {
        parent: u64,
        name: Vec<u8>,
    },
    Rmdir {
        parent: u64,
        name: Vec<u8>,
    },
    Rename {
        parent: u64,
        name: Vec<u8>,
        new_parent: u64,
        new_name: Vec<u8>,
        flags: u32,
    },
    /// Entries with cookies greater than `after`, at most `max`.
    ReadDir {
        ino: u64,
        after: u64,
        max: u32,
    },
    ReadLink {
        ino: u64,
    },
    /// A mount opened the file: it is kept, even unlinked, until released.
    Open {
        ino: u64,
    },
    Release {
        ino: u64,
    },
    /// Allocate stripe `stripe` of a file if it is a hole; returns its extent either way.
    AllocStripe {
        ino: u64,
        stripe: u64,
    },
    StatFs,
    /// This session's client slot in lock trees (assigned on first request).
    LockSlot,
    /// Publish a lock tree covering at least `units` for file `ino` in place of `old` (a
    /// [`crate::locktree::TreeWord`]; 0 for none), which the caller holds entirely. Answered
    /// with the published word, unchanged if `old` was not the published tree.
    LockTree {
        ino: u64,
        old: u64,
        units: u64,
    },
}

/// What the service needs from its node: memory on any data node, and its own region.
pub trait Storage: Send + Sync {
    /// Ids of the nodes that hold file data, this one included.
    fn data_nodes(&self) -> Vec<u32>;
    /// Allocates on `node`; a tagged extent's data starts `TAG_SPACE` after the returned offset.
    fn alloc(&self, node: u32, len: u64, tag: Option<u64>) -> Result<u64, (ErrorCode, String)>;
    fn free(&self, node: u32, offset: u64) -> Result<(), (ErrorCode, String)>;
    fn zero(&self, node: u32, offset: u64, len: u64) -> Result<(), (ErrorCode, String)>;
    /// This node's id and data region (where records and tables live).
    fn local(&self) -> (u32, &Region);
    fn fs_stat(&self) -> FsStat;
}

type MetaResult<T> = Result<T, (ErrorCode, String)>;

fn err<T>(code: ErrorCode, msg: impl Into<String>) -> MetaResult<T> {
    Err((code, msg.into()))
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

struct FileState {
    record: u64,
    table: u64,
    table_cap: u64,
    stripe_unit: u64,
    stripes: BTreeMap<u64, StripeExtent>,
    /// Earlier tables, kept because clients may still read them.
    retired_tables: Vec<u64>,
}

#[derive(Default)]
struct DirState {
    parent: u64,
    entries: BTreeMap<u64, (Vec<u8>, u64)>,
    by_name: HashMap<Vec<u8>, u64>,
    next_cookie: u64,
}

struct Inode {
    kind: Kind,
    perm: u16,
    nlink: u32,
    uid: u32,
    gid: u32,
    atime: u64,
    mtime: u64,
    ctime: u64,
    rdev: u32,
    target: Vec<u8>,
    dir: Option<DirState>,
    file: Option<FileState>,
    opens: u32,
}

/// The namespace and file layouts (see the module docs).
pub struct Namespace {
    inodes: HashMap<u64, Inode>,
    next_ino: u64,
    next_tag: u64,
    /// Opens held per client session, released when the session ends.
    sessions: HashMap<u64, HashMap<u64, u32>>,
    pub locks: LockTrees,
}

/// The lock service's memory: plain extents of the service's own region.
pub struct LocalTreeMemory<'a>(pub &'a dyn Storage);

impl TreeMemory for LocalTreeMemory<'_> {
    fn region(&self) -> &Region {
        self.0.local().1
    }
    fn alloc(&self, len: u64) -> Result<u64, (ErrorCode, String)> {
        self.0.alloc(self.0.local().0, len, None)
    }
    fn free(&self, offset: u64) {
        if let Err((_, e)) = self.0.free(self.0.local().0, offset) {
            tracing::warn!(offset, error = %e, "cannot free a retired lock tree");
        }
    }
}

impl Namespace {
    /// An empty namespace; `lock_grace`: how long retired lock trees and the slots of ended
    /// sessions are kept (see [`crate::locktree`]).
    pub fn new(lock_grace: std::time::Duration) -> Namespace {
        let t = now_ns();
        let root = Inode {
            kind: Kind::Dir,
            perm: 0o755,
            nlink: 2,
            uid: 0,
            gid: 0,
            atime: t,
            mtime: t,
            ctime: t,
            rdev: 0,
            target: Vec::new(),
            dir: Some(DirState {
                parent: ROOT_INO,
                next_cookie: 3,
                ..Default::default()
            }),
            file: None,
            opens: 0,
        };
        Namespace {
            inodes: HashMap::from([(ROOT_INO, root)]),
            next_ino: ROOT_INO + 1,
            next_tag: 1,
            sessions: HashMap::new(),
            locks: LockTrees::new(lock_grace, lock_grace),
        }
    }

    /// Handles one request on behalf of client session `session`.
    pub fn handle(&mut self, session: u64, req: MetaRequest, st: &dyn Storage) -> ControlResponse {
        let r = match req {
            MetaRequest::Lookup { parent, name } => self
                .lookup(parent, &name)
                .and_then(|ino| self.attr(ino, st)),
            MetaRequest::GetAttr { ino } => self.attr(ino, st),
            MetaRequest::SetAttr { ino, set } => self.setattr(ino, set, st),
            MetaRequest::Create {
                parent,
                name,
                kind,
                perm,
                uid,
                gid,
            } => self.create(parent, &name, kind, perm, uid, gid, st),
            MetaRequest::Link { ino, parent, name } => self.link(ino, parent, &name, st),
            MetaRequest::Unlink { parent, name } => self
                .remove(parent, &name, false, st)
                .map(|_| ControlResponse::Ok),
            MetaRequest::Rmdir { parent, name } => self
                .remove(parent, &name, true, st)
                .map(|_| ControlResponse::Ok),
            MetaRequest::Rename {
                parent,
                name,
                new_parent,
                new_name,
                flags,
            } => self
                .rename(parent, &name, new_parent, &new_name, flags, st)
                .map(|_| ControlResponse::Ok),
            MetaRequest::ReadDir { ino, after, max } => self.readdir(ino, after, max),
            MetaRequest::ReadLink { ino } => self.get(ino).and_then(|i| match i.kind {
                Kind::Symlink => Ok(ControlResponse::Target(i.target.clone())),
                _ => err(ErrorCode::Invalid, "not a symbolic link"),
            }),
            MetaRequest::Open { ino } => self.open(session, ino).map(|_| ControlResponse::Ok),
            MetaRequest::Release { ino } => {
                self.release(session, ino, st);
                Ok(ControlResponse::Ok)
            }
            MetaRequest::AllocStripe { ino, stripe } => self
                .alloc_stripe(ino, stripe, st)
                .map(ControlResponse::Stripe),
            MetaRequest::LockSlot => self.locks.attach(session).map(ControlResponse::LockSlot),
            MetaRequest::LockTree { ino, old, units } => {
                let record = match self.get(ino).map(|i| i.file.as_ref().map(|f| f.record)) {
                    Ok(Some(r)) => Ok(r),
                    Ok(None) => err(ErrorCode::Invalid, "not a regular file"),
                    Err(e) => Err(e),
                };
                record.and_then(|record| {
                    self.locks
                        .publish(
                            &LocalTreeMemory(st),
                            ino,
                            record + REC_LOCKS,
                            TreeWord(old),
                            units,
                        )
                        .map(|w| ControlResponse::LockTree(w.0))
                })
            }
            MetaRequest::StatFs => {
                let mut s = st.fs_stat();
                s.files = self.inodes.len() as u64;
                Ok(ControlResponse::FsStat(s))
            }
        };
        r.unwrap_or_else(|(code, message)| ControlResponse::Error { code, message })
    }

    /// Releases every open held by a session that ended (its mount went away).
    pub fn end_session(&mut self, session: u64, st: &dyn Storage) {
        self.locks.end_session(session);
        if let Some(opens) = self.sessions.remove(&session) {
            for (ino, n) in opens {
                if let Some(i) = self.inodes.get_mut(&ino) {
                    i.opens = i.opens.saturating_sub(n);
                }
                self.maybe_delete(ino, st);
            }
        }
    }

    fn get(&self, ino: u64) -> MetaResult<&Inode> {
        self.inodes
            .get(&ino)
            .map_or_else(|| err(ErrorCode::NotFound, format!("no inode {ino}")), Ok)
    }

    fn get_mut(&mut self, ino: u64) -> MetaResult<&mut Inode> {
        match self.inodes.get_mut(&ino) {
            Some(i) => Ok(i),
            None => err(ErrorCode::NotFound, format!("no inode {ino}")),
        }
    }

    fn dir(&self, ino: u64) -> MetaResult<&DirState> {
        self.get(ino)?.dir.as_ref().map_or_else(
            || err(ErrorCode::NotDir, format!("inode {ino} is not a directory")),
            Ok,
        )
    }

    fn dir_mut(&mut self, ino: u64) -> MetaResult<&mut DirState> {
        match self.get_mut(ino)?.dir.as_mut() {
            Some(d) => Ok(d),
            None => err(ErrorCode::NotDir, format!("inode {ino} is not a directory")),
        }
    }

    fn lookup(&self, parent: u64, name: &[u8]) -> MetaResult<u64> {
        let d = self.dir(parent)?;
        match name {
            b"." => return Ok(parent),
            b".." => return Ok(d.parent),
            _ => {}
        }
        check_name(name)?;
        match d.by_name.get(name) {
            Some(c) => Ok(d.entries[c].1),
            None => err(
                ErrorCode::NotFound,
                format!("{} not found", String::from_utf8_lossy(name)),
            ),
        }
    }

    fn attr(&self, ino: u64, st: &dyn Storage) -> MetaResult<ControlResponse> {
        let i = self.get(ino)?;
        let (primary, region) = st.local();
        let (size, mtime, layout) = match &i.file {
            Some(f) => (
                read_word(region, f.record + REC_SIZE),
                read_word(region, f.record + REC_MTIME).max(i.mtime),
                Some(FileLayout {
                    node: primary,
                    record: f.record,
                    stripe_unit: f.stripe_unit,
                }),
            ),
            None => (
                match i.kind {
                    Kind::Symlink => i.target.len() as u64,
                    Kind::Dir => 4096,
                    _ => 0,
                },
                i.mtime,
                None,
            ),
        };
        Ok(ControlResponse::Attr(Attr {
            ino,
            kind: i.kind,
            perm: i.perm,
            nlink: i.nlink,
            uid: i.uid,
            gid: i.gid,
            size,
            atime_ns: i.atime,
            mtime_ns: mtime,
            ctime_ns: i.ctime,
            rdev: i.rdev,
            layout,
        }))
    }

    #[allow(clippy::too_many_arguments)]
    fn create(
        &mut self,
        parent: u64,
        name: &[u8],
        kind: NewKind,
        perm: u16,
        uid: u32,
        gid: u32,
        st: &dyn Storage,
    ) -> MetaResult<ControlResponse> {
        check_name(name)?;
        if self.dir(parent)?.by_name.contains_key(name) || name == b"." || name == b".." {
            return err(
                ErrorCode::Exists,
                format!("{} exists", String::from_utf8_lossy(name)),
            );
        }
        let t = now_ns();
        let ino = self.next_ino;
        let mut inode = Inode {
            kind: Kind::File,
            perm: perm & 0o7777,
            nlink: 1,
            uid,
            gid,
            atime: t,
            mtime: t,
            ctime: t,
            rdev: 0,
            target: Vec::new(),
            dir: None,
            file: None,
            opens: 0,
        };
        match kind {
            NewKind::File { stripe_unit } => {
                if stripe_unit == 0
                    || !stripe_unit.is_multiple_of(4096)
                    || stripe_unit > MAX_STRIPE_UNIT
                {
                    return err(
                        ErrorCode::Invalid,
                        format!(
                            "stripe unit {stripe_unit} is not a multiple of 4 KiB up to 64 MiB"
                        ),
                    );
                }
                let (me, region) = st.local();
                let record = st.alloc(me, RECORD_LEN, None)?;
                write_word(region, record + REC_STRIPE, stripe_unit);
                write_word(region, record + REC_INO, ino);
                write_word(region, record + REC_MTIME, t);
                inode.file = Some(FileState {
                    record,
                    table: 0,
                    table_cap: 0,
                    stripe_unit,
                    stripes: BTreeMap::new(),
                    retired_tables: Vec::new(),
                });
            }
            NewKind::Dir => {
                inode.kind = Kind::Dir;
                inode.nlink = 2;
                inode.dir = Some(DirState {
                    parent,
                    next_cookie: 3,
                    ..Default::default()
                });
            }
            NewKind::Symlink(target) => {
                if target.is_empty() || target.len() > 4096 {
                    return err(ErrorCode::Invalid, "symlink target must be 1 to 4096 bytes");
                }
                inode.kind = Kind::Symlink;
                inode.perm = 0o777;
                inode.target = target;
            }
            NewKind::Special { kind, rdev } => {
                if matches!(kind, Kind::File | Kind::Dir | Kind::Symlink) {
                    return err(ErrorCode::Invalid, "not a special file kind");
                }
                inode.kind = kind;
                inode.rdev = rdev;
            }
        }
        let is_dir = inode.kind == Kind::Dir;
        self.next_ino += 1;
        self.inodes.insert(ino, inode);
        self.add_entry(parent, name, ino, t)?;
        if is_dir {
            self.get_mut(parent)?.nlink += 1;
        }
        self.attr(ino, st)
    }

    fn add_entry(&mut self, parent: u64, name: &[u8], ino: u64, t: u64) -> MetaResult<()> {
        let d = self.dir_mut(parent)?;
        let cookie = d.next_cookie;
        d.next_cookie += 1;
        d.entries.insert(cookie, (name.to_vec(), ino));
        d.by_name.insert(name.to_vec(), cookie);
        let p = self.get_mut(parent)?;
        p.mtime = t;
        p.ctime = t;
        Ok(())
    }

    fn remove_entry(&mut self, parent: u64, name: &[u8], t: u64) -> MetaResult<u64> {
        let d = self.dir_mut(parent)?;
        let cookie = d
            .by_name
            .remove(name)
            .ok_or((ErrorCode::NotFound, "no such entry".to_string()))?;
        let (_, ino) = d
            .entries
            .remove(&cookie)
            .expect("by_name and entries agree");
        let p = self.get_mut(parent)?;
        p.mtime = t;
        p.ctime = t;
        Ok(ino)
    }

    fn link(
        &mut self,
        ino: u64,
        parent: u64,
        name: &[u8],
        st: &dyn Storage,
    ) -> MetaResult<ControlResponse> {
        check_name(name)?;
        if self.get(ino)?.kind == Kind::Dir {
            return err(
                ErrorCode::Permission,
                "hard links to directories are not allowed",
            );
        }
        if self.dir(parent)?.by_name.contains_key(name) {
            return err(
                ErrorCode::Exists,
                format!("{} exists", String::from_utf8_lossy(name)),
            );
        }
        let t = now_ns();
        self.add_entry(parent, name, ino, t)?;
        let i = self.get_mut(ino)?;
        i.nlink += 1;
        i.ctime = t;
        self.attr(ino, st)
    }

    fn remove(
        &mut self,
        parent: u64,
        name: &[u8],
        want_dir: bool,
        st: &dyn Storage,
    ) -> MetaResult<()> {
        check_name(name)?;
        if name == b"." || name == b".." {
            return err(ErrorCode::Invalid, "cannot remove . or ..");
        }
        let ino = self.lookup(parent, name)?;
        let i = self.get(ino)?;
        match (want_dir, i.kind == Kind::Dir) {
            (true, false) => return err(ErrorCode::NotDir, "not a directory"),
            (false, true) => return err(ErrorCode::IsDir, "is a directory"),
            (true, true) if !i.dir.as_ref().expect("dir").entries.is_empty() => {
                return err(ErrorCode::NotEmpty, "directory not empty")
            }
            _ => {}
        }
        let t = now_ns();
        self.remove_entry(parent, name, t)?;
        self.drop_link(ino, parent, t, st);
        Ok(())
    }

    /// One name of `ino` (in `parent`) went away.
    fn drop_link(&mut self, ino: u64, parent: u64, t: u64, st: &dyn Storage) {
        let Some(i) = self.inodes.get_mut(&ino) else {
            return;
        };
        i.ctime = t;
        if i.kind == Kind::Dir {
            i.nlink = 0;
            if let Some(p) = self.inodes.get_mut(&parent) {
                p.nlink -= 1;
            }
        } else {
            i.nlink -= 1;
        }
        self.maybe_delete(ino, st);
    }

    /// Deletes an inode with no names and no opens, returning its memory.
    fn maybe_delete(&mut self, ino: u64, st: &dyn Storage) {
        let Some(i) = self.inodes.get(&ino) else {
            return;
        };
        if i.nlink > 0 || i.opens > 0 || ino == ROOT_INO {
            return;
        }
        let i = self.inodes.remove(&ino).expect("present");
        if let Some(f) = i.file {
            self.locks.forget(&LocalTreeMemory(st), ino);
            let (me, _) = st.local();
            for (_, s) in f.stripes {
                let _ = st.free(s.node, s.offset - crate::server::TAG_SPACE);
            }
            for t in f
                .retired_tables
                .into_iter()
                .chain((f.table != 0).then_some(f.table))
            {
                let _ = st.free(me, t);
            }
            let _ = st.free(me, f.record);
        }
    }

    fn rename(
        &mut self,
        parent: u64,
        name: &[u8],
        new_parent: u64,
        new_name: &[u8],
        flags: u32,
        st: &dyn Storage,
    ) -> MetaResult<()> {
        check_name(name)?;
        check_name(new_name)?;
        if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE) != 0
            || flags == RENAME_NOREPLACE | RENAME_EXCHANGE
        {
            return err(
                ErrorCode::Invalid,
                format!("unsupported rename flags {flags:#x}"),
            );
        }
        for n in [name, new_name] {
            if n == b"." || n == b".." {
                return err(ErrorCode::Invalid, "cannot rename . or ..");
            }
        }
        let src = self.lookup(parent, name)?;
        self.dir(new_parent)?;
        let dst = self
            .dir(new_parent)?
            .by_name
            .get(new_name)
            .map(|c| self.dir(new_parent).expect("dir").entries[c].1);
        if parent == new_parent && name == new_name {
            return Ok(());
        }
        let src_is_dir = self.get(src)?.kind == Kind::Dir;
        if src_is_dir {
            self.ensure_not_inside(src, new_parent)?;
        }
        let t = now_ns();
        if flags & RENAME_EXCHANGE != 0 {
            let dst = dst.ok_or((
                ErrorCode::NotFound,
                "exchange target does not exist".to_string(),
            ))?;
            let dst_is_dir = self.get(dst)?.kind == Kind::Dir;
            if dst_is_dir {
                self.ensure_not_inside(dst, parent)?;
            }
            self.set_entry(parent, name, dst)?;
            self.set_entry(new_parent, new_name, src)?;
            self.reparent(src, new_parent, src_is_dir, parent)?;
            self.reparent(dst, parent, dst_is_dir, new_parent)?;
            for ino in [src, dst, parent, new_parent] {
                self.get_mut(ino)?.ctime = t;
            }
            return Ok(());
        }
        if let Some(dst) = dst {
            if flags & RENAME_NOREPLACE != 0 {
                return err(ErrorCode::Exists, "target exists");
            }
            if dst == src {
                return Ok(()); // two hard links of one file: nothing to do
            }
            let d = self.get(dst)?;
            match (src_is_dir, d.kind == Kind::Dir) {
                (true, false) => return err(ErrorCode::NotDir, "target is not a directory"),
                (false, true) => return err(ErrorCode::IsDir, "target is a directory"),
                (true, true) if !d.dir.as_ref().expect("dir").entries.is_empty() => {
                    return err(ErrorCode::NotEmpty, "target directory not empty")
                }
                _ => {}
            }
            self.remove_entry(new_parent, new_name, t)?;
            self.drop_link(dst, new_parent, t, st);
        }
        self.remove_entry(parent, name, t)?;
        self.add_entry(new_parent, new_name, src, t)?;
        self.reparent(src, new_parent, src_is_dir, parent)?;
        self.get_mut(src)?.ctime = t;
        Ok(())
    }

    /// A directory may not move into its own subtree: fails if `dir` is `target` or one of
    /// its ancestors.
    fn ensure_not_inside(&self, dir: u64, target: u64) -> MetaResult<()> {
        let mut p = target;
        loop {
            if p == dir {
                return err(ErrorCode::Invalid, "cannot move a directory into itself");
            }
            if p == ROOT_INO {
                return Ok(());
            }
            p = self.dir(p)?.parent;
        }
    }

    /// Points an existing entry at another inode (exchange), keeping its cookie.
    fn set_entry(&mut self, parent: u64, name: &[u8], ino: u64) -> MetaResult<()> {
        let d = self.dir_mut(parent)?;
        let c = *d
            .by_name
            .get(name)
            .ok_or((ErrorCode::NotFound, "no such entry".to_string()))?;
        d.entries.get_mut(&c).expect("agree").1 = ino;
        Ok(())
    }

    fn reparent(
        &mut self,
        ino: u64,
        new_parent: u64,
        is_dir: bool,
        old_parent: u64,
    ) -> MetaResult<()> {
        if is_dir && new_parent != old_parent {
            self.dir_mut(ino)?.parent = new_parent;
            self.get_mut(old_parent)?.nlink -= 1;
            self.get_mut(new_parent)?.nlink += 1;
        }
        Ok(())
    }

    fn readdir(&self, ino: u64, after: u64, max: u32) -> MetaResult<ControlResponse> {
        let d = self.dir(ino)?;
        let mut out = Vec::new();
        if after < 1 {
            out.push(DirEntry {
                cookie: 1,
                ino,
                kind: Kind::Dir,
                name: b".".to_vec(),
            });
        }
        if after < 2 {
            out.push(DirEntry {
                cookie: 2,
                ino: d.parent,
                kind: Kind::Dir,
                name: b"..".to_vec(),
            });
        }
        for (&cookie, (name, child)) in d.entries.range(after.max(2) + 1..) {
            if out.len() >= max.max(1) as usize {
                break;
            }
            let kind = self.inodes.get(child).map_or(Kind::File, |i| i.kind);
            out.push(DirEntry {
                cookie,
                ino: *child,
                kind,
                name: name.clone(),
            });
        }
        Ok(ControlResponse::Entries(out))
    }

    fn open(&mut self, session: u64, ino: u64) -> MetaResult<()> {
        self.get_mut(ino)?.opens += 1;
        *self
            .sessions
            .entry(session)
            .or_default()
            .entry(ino)
            .or_default() += 1;
        Ok(())
    }

    fn release(&mut self, session: u64, ino: u64, st: &dyn Storage) {
        let Some(s) = self.sessions.get_mut(&session) else {
            return;
        };
        let Some(n) = s.get_mut(&ino) else { return };
        *n -= 1;
        if *n == 0 {
            s.remove(&ino);
        }
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.opens = i.opens.saturating_sub(1);
        }
        self.maybe_delete(ino, st);
    }

    fn setattr(&mut self, ino: u64, set: SetAttr, st: &dyn Storage) -> MetaResult<ControlResponse> {
        let t = now_ns();
        if let Some(size) = set.size {
            self.truncate(ino, size, st)?;
        }
        let (_, region) = st.local();
        let i = self.get_mut(ino)?;
        if let Some(p) = set.perm {
            i.perm = p & 0o7777;
        }
        if let Some(u) = set.uid {
            i.uid = u;
        }
        if let Some(g) = set.gid {
            i.gid = g;
        }
        if let Some(a) = set.atime_ns {
            i.atime = a;
        }
        if let Some(m) = set.mtime_ns {
            i.mtime = m;
            if let Some(f) = &i.file {
                write_word(region, f.record + REC_MTIME, m);
            }
        }
        i.ctime = t;
        self.attr(ino, st)
    }

    fn truncate(&mut self, ino: u64, size: u64, st: &dyn Storage) -> MetaResult<()> {
        if size > MAX_FILE_SIZE {
            return err(
                ErrorCode::TooBig,
                format!("size {size} exceeds the maximum file size {MAX_FILE_SIZE}"),
            );
        }
        let (_, region) = st.local();
        let t = now_ns();
        let i = self.get_mut(ino)?;
        let Some(f) = i.file.as_mut() else {
            return err(
                if i.kind == Kind::Dir {
                    ErrorCode::IsDir
                } else {
                    ErrorCode::Invalid
                },
                "not a regular file",
            );
        };
        let old = read_word(region, f.record + REC_SIZE);
        write_word(region, f.record + REC_SIZE, size);
        write_word(region, f.record + REC_MTIME, t);
        i.mtime = t;
        if size < old {
            let unit = f.stripe_unit;
            let keep = size.div_ceil(unit);
            // Zero the cut-off tail of the last kept stripe, so a later extension reads zeros.
            if !size.is_multiple_of(unit) {
                if let Some(s) = f.stripes.get(&(size / unit)) {
                    st.zero(s.node, s.offset + size % unit, unit - size % unit)?;
                }
            }
            let gone: Vec<u64> = f.stripes.range(keep..).map(|(&k, _)| k).collect();
            for k in gone {
                let s = f.stripes.remove(&k).expect("present");
                let e = f.table + k * ENTRY_LEN;
                write_word(region, e + 8, 0);
                write_word(region, e, 0);
                st.free(s.node, s.offset - crate::server::TAG_SPACE)?;
            }
        }
        Ok(())
    }

    fn alloc_stripe(
        &mut self,
        ino: u64,
        stripe: u64,
        st: &dyn Storage,
    ) -> MetaResult<StripeExtent> {
        let tag = self.next_tag;
        let (me, region) = st.local();
        let nodes = st.data_nodes();
        let i = self.get_mut(ino)?;
        let Some(f) = i.file.as_mut() else {
            return err(ErrorCode::Invalid, "not a regular file");
        };
        if stripe.saturating_mul(f.stripe_unit) >= MAX_FILE_SIZE {
            return err(ErrorCode::TooBig, "offset beyond the maximum file size");
        }
        if let Some(s) = f.stripes.get(&stripe) {
            return Ok(*s);
        }
        if stripe >= f.table_cap {
            let cap = (stripe + 1).next_power_of_two().max(16);
            let table = st.alloc(me, cap * ENTRY_LEN, None)?;
            if f.table != 0 {
                let mut old = vec![0u8; (f.table_cap * ENTRY_LEN) as usize];
                region.read(f.table, &mut old).expect("table in region");
                region.write(table, &old).expect("table in region");
                f.retired_tables.push(f.table);
            }
            f.table = table;
            f.table_cap = cap;
            write_word(region, f.record + REC_TABLE, table);
            write_word(region, f.record + REC_TABLE_CAP, cap);
        }
        // Spread stripes round-robin over the nodes, starting at a per-file offset.
        let node = nodes[((ino + stripe) % nodes.len() as u64) as usize];
        let base = st.alloc(node, f.stripe_unit, Some(tag))?;
        let s = StripeExtent {
            node,
            offset: base + crate::server::TAG_SPACE,
            tag,
        };
        let e = f.table + stripe * ENTRY_LEN;
        write_word(region, e, (node as u64) << 48 | s.offset);
        write_word(region, e + 8, tag);
        f.stripes.insert(stripe, s);
        self.next_tag += 1;
        Ok(s)
    }
}

fn check_name(name: &[u8]) -> MetaResult<()> {
    if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
        return err(ErrorCode::Invalid, "invalid file name");
    }
    if name.len() > MAX_NAME {
        return err(
            ErrorCode::NameTooLong,
            format!("name of {} bytes exceeds {MAX_NAME}", name.len()),
        );
    }
    Ok(())
}

/// Reads a word of the service's own region (atomically: clients CAS the same words).
pub fn read_word(region: &Region, offset: u64) -> u64 {
    region.load(offset).expect("word in region")
}

/// Writes a word of the service's own region (atomically).
pub fn write_word(region: &Region, offset: u64, v: u64) {
    region.store(offset, v).expect("word in region")
}
