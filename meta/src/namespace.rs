//! The namespace: directories, inodes, attributes and the layouts of regular files.
//!
//! The service runs one request at a time (its owner serialises them). Regular files also have
//! state that mounts read and update one-sidedly in the primary's region: the file record and
//! the extent table, whose formats and writers are stated in [`rackfs_proto::record`]. This
//! type writes the record's size and time words on truncate and setattr; a file's layout
//! (table, replicas) is its [`File`]'s. A file's stripes (quarantined by their data nodes),
//! tables and record are freed only when it has no names and no opens left.
//!
//! Time comes from [`Storage::wall_ns`], so the service runs under a simulated clock too.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use rackfs_proto::control::{ControlResponse, DataHealth, ErrorCode, ExtentAt};
use rackfs_proto::namespace::{
    Attr, Change, Created, DirEntry, FileLayout, Kind, MetaRequest, NewKind, SetAttr, StripeExtent,
    FALLOC_KEEP_SIZE, FALLOC_PUNCH_HOLE, FALLOC_ZERO_RANGE, MAX_FILE_SIZE, MAX_NAME,
    MAX_STRIPE_UNIT, RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO,
};
use rackfs_proto::record::{
    MAX_REPLICAS, RECORD_LEN, REC_INO, REC_MTIME, REC_SIZE, REC_STRIPE, TAG_SPACE,
};
use rackfs_proto::Refusal;

use crate::file::{read_word, write_word, Dropped, File};

/// Stripe extents asked of a data node per `Resolve` (well inside a frame).
const RESOLVE_BATCH: usize = 16 << 10;

/// Serials a primary that takes over skips: its predecessor numbered allocations, moves and
/// retags in changes the journal never carried (a batch of requests at most), and a later
/// change of a stripe must carry a larger serial than any of those (see
/// [`crate::file::File::settle_tags`]).
const TAKE_OVER_SERIALS: u64 = 1 << 24;

/// What [`Namespace::roll_forward`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RolledForward {
    /// Replicas pointed at the extent (or tag) their node holds now.
    pub relocated: u64,
    /// Replicas dropped: their node holds them no more.
    pub dropped: u64,
    /// Old copies of moved extents freed.
    pub freed: u64,
    /// The node did not answer.
    pub unanswered: bool,
}
use crate::pool::Pool;
use crate::storage::Storage;
use crate::xattr::Xattrs;

/// The virtual extended attribute that reads and sets a file's replica count (not listed).
const REPLICAS_XATTR: &[u8] = b"rackfs.replicas";

type MetaResult<T> = Result<T, Refusal>;

fn err<T>(code: ErrorCode, msg: impl Into<String>) -> MetaResult<T> {
    Err(Refusal::new(code, msg))
}

/// The refusal of an operation on regular files asked of an inode of `kind`.
fn not_a_file<T>(kind: Kind, msg: &str) -> MetaResult<T> {
    let code = match kind {
        Kind::Dir => ErrorCode::IsDir,
        _ => ErrorCode::Invalid,
    };
    err(code, msg)
}

#[derive(Default, Serialize, Deserialize)]
struct DirState {
    parent: u64,
    entries: BTreeMap<u64, (Vec<u8>, u64)>,
    by_name: BTreeMap<Vec<u8>, u64>,
    next_cookie: u64,
}

#[derive(Serialize, Deserialize)]
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
    file: Option<File>,
    opens: u32,
    xattrs: Xattrs,
}

/// The namespace and file layouts (see the module docs).
#[derive(Serialize, Deserialize)]
pub struct Namespace {
    inodes: BTreeMap<u64, Inode>,
    next_ino: u64,
    next_tag: u64,
    /// Replicas of a new file's stripes when its creator does not ask (at most the nodes).
    default_replicas: u32,
    /// Opens held per client session, released when the session ends.
    sessions: BTreeMap<u64, BTreeMap<u64, u32>>,
    /// Regular files deleted since [`Namespace::take_deleted`] was last called (their lock
    /// trees are to be retired).
    deleted: Vec<u64>,
    /// A primary that took over, until the mounts' sizes settle: a record's size may be behind
    /// what a mount wrote under the old primary (reported by that mount once it follows), so
    /// no last stripe is trimmed to it (the bytes past it would be lost).
    #[serde(default)]
    trims_held: bool,
    /// A primary that took over: the data nodes whose extents it has followed
    /// ([`Namespace::roll_forward`]).
    #[serde(default)]
    resolved: BTreeSet<u32>,
    /// Extents placed ahead on the other data nodes for new files' first stripes.
    #[serde(default)]
    pool: Pool,
    /// A primary that took over: the nodes its tables listed replicas on then and that it has
    /// not followed since ([`Namespace::roll_forward`] answered) nor dropped. Such a replica
    /// may sit elsewhere, or under another tag, than the tables say (moved or retagged by the
    /// predecessor in a change the mirror lacks), so no stripe listing it grows meanwhile.
    #[serde(default)]
    unfollowed: BTreeSet<u32>,
    /// The most data nodes the cluster has had at a create: new files ask for replicas up to
    /// it, not up to the nodes of the moment, which right after a take-over (before the others
    /// follow) or while nodes restart are fewer. A file capped by a passing dip would keep one
    /// replica for good, and die with the node that holds it.
    #[serde(default)]
    most_nodes: u32,
}

impl Namespace {
    /// A namespace with an empty root directory created at `t` (ns since the epoch).
    pub fn new(t: u64) -> Namespace {
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
            xattrs: Xattrs::default(),
        };
        Namespace {
            inodes: BTreeMap::from([(ROOT_INO, root)]),
            next_ino: ROOT_INO + 1,
            next_tag: 1,
            default_replicas: 2,
            sessions: BTreeMap::new(),
            deleted: Vec::new(),
            trims_held: false,
            unfollowed: BTreeSet::new(),
            resolved: BTreeSet::new(),
            pool: Pool::default(),
            most_nodes: 0,
        }
    }

    /// Sets how many replicas new files get when their creator does not ask (1 to
    /// [`MAX_REPLICAS`]; never more than the cluster's nodes).
    pub fn set_default_replicas(&mut self, r: u32) {
        self.default_replicas = r.clamp(1, MAX_REPLICAS);
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
            MetaRequest::Unlink {
                parent,
                name,
                release,
            } => {
                let removed = self.remove(parent, &name, false, st);
                // After the removal: a file that goes with it is not trimmed first.
                if let Some(ino) = release {
                    self.release(session, ino, st);
                }
                removed.and_then(|_| self.attr(parent, st))
            }
            MetaRequest::Rmdir { parent, name } => self
                .remove(parent, &name, true, st)
                .and_then(|_| self.attr(parent, st)),
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
            MetaRequest::ReadDirPlus { ino, after, max } => self.readdir_plus(ino, after, max, st),
            MetaRequest::ReadLink { ino } => self.get(ino).and_then(|i| match i.kind {
                Kind::Symlink => Ok(ControlResponse::Target(i.target.clone())),
                _ => err(ErrorCode::Invalid, "not a symbolic link"),
            }),
            MetaRequest::Open { ino } => self.open(session, ino).and_then(|_| self.attr(ino, st)),
            MetaRequest::CreateOpen {
                parent,
                name,
                stripe_unit,
                replicas,
                perm,
                uid,
                gid,
                reserve,
                lock_units: _,
            } => {
                let kind = NewKind::File {
                    stripe_unit,
                    replicas,
                };
                self.create_open(session, parent, &name, kind, (perm, uid, gid), reserve, st)
            }
            MetaRequest::Releases { inos, kept } => {
                for &ino in &inos {
                    self.release(session, ino, st);
                }
                // A kept open the session does not hold (its opens went with a session that
                // ended) is answered without attributes: the mount does not reuse it.
                let kept: Vec<u64> = kept
                    .into_iter()
                    .filter(|&ino| self.close_kept(session, ino, st))
                    .collect();
                let all = inos.iter().chain(&kept);
                let attrs = all.filter_map(|&ino| match self.attr(ino, st) {
                    Ok(ControlResponse::Attr(a)) => Some(a),
                    _ => None,
                });
                Ok(ControlResponse::Released(attrs.collect()))
            }
            MetaRequest::AllocStripe { ino, stripe, end } => {
                let placed = self.alloc_stripe(ino, stripe, end, st);
                self.give_back_pool_if_short(ino, placed.as_ref().map(Vec::len), st);
                placed.map(ControlResponse::Stripe)
            }
            MetaRequest::GetStripe { ino, stripe } => {
                self.get(ino).and_then(|i| match i.file.as_ref() {
                    Some(f) => Ok(ControlResponse::Stripe(f.stripe(stripe))),
                    None => err(ErrorCode::Invalid, "not a regular file"),
                })
            }
            MetaRequest::Numbered { req, .. } => Ok(self.handle(session, *req, st)),
            MetaRequest::LockSlot
            | MetaRequest::LockTree { .. }
            | MetaRequest::ReclaimLocks { .. }
            | MetaRequest::Retry { .. }
            | MetaRequest::SizeAtTakeOver { .. } => err(
                ErrorCode::Internal,
                "lock, retry and take-over requests are the service's, not the namespace's",
            ),
            MetaRequest::SetXattr {
                ino, name, value, ..
            } if name == REPLICAS_XATTR => self
                .set_replicas(ino, &value, st)
                .map(|()| ControlResponse::Ok),
            MetaRequest::GetXattr { ino, name } if name == REPLICAS_XATTR => {
                self.get(ino).and_then(|i| match &i.file {
                    Some(f) => Ok(ControlResponse::Xattr(f.replicas.to_string().into_bytes())),
                    None => err(ErrorCode::NoData, "only regular files have a replica count"),
                })
            }
            MetaRequest::SetXattr {
                ino,
                name,
                value,
                flags,
            } => self.change_xattrs(ino, st, |x| x.set(&name, &value, flags)),
            MetaRequest::RemoveXattr { ino, name } => {
                self.change_xattrs(ino, st, |x| x.remove(&name))
            }
            MetaRequest::GetXattr { ino, name } => self
                .get(ino)
                .and_then(|i| i.xattrs.get(&name))
                .map(|v| ControlResponse::Xattr(v.to_vec())),
            MetaRequest::ListXattr { ino } => self
                .get(ino)
                .map(|i| ControlResponse::Xattr(i.xattrs.list())),
            MetaRequest::RecordLocks { ino } => {
                self.record_locks(ino, st).map(ControlResponse::RecordLocks)
            }
            MetaRequest::Fallocate {
                ino,
                offset,
                len,
                mode,
            } => {
                let done = self.fallocate(ino, offset, len, mode, st);
                let out_of_memory = matches!(&done, Err(e) if e.code == ErrorCode::OutOfMemory);
                if out_of_memory {
                    self.pool.give_back(st);
                }
                done.map(|()| ControlResponse::Ok)
            }
            MetaRequest::Settle { ino, size, mtime } => self
                .settle(ino, size, mtime, st)
                .map(|()| ControlResponse::Ok),
            MetaRequest::StatFs => {
                let mut s = st.fs_stat();
                s.files = self.inodes.len() as u64;
                // What a file created without a replica count gets (see Create).
                s.replicas = (self.default_replicas)
                    .min(self.most_nodes.max(st.cluster_size() as u32))
                    .max(1);
                Ok(ControlResponse::FsStat(s))
            }
        };
        r.unwrap_or_else(ControlResponse::from)
    }

    /// What other mounts must forget or learn if `req` succeeds: names removed or replaced,
    /// inodes whose attributes change (mode, owner, size, link count), and names created
    /// (for the mounts holding their directory whole; the kernel caches no negative entries).
    pub fn changes_of(&self, req: &MetaRequest) -> Vec<Change> {
        let entry = |parent: u64, name: &[u8]| Change::Entry {
            parent,
            name: name.to_vec(),
        };
        let target = |parent: u64, name: &[u8]| {
            self.lookup(parent, name)
                .ok()
                .map(|ino| Change::Inode { ino })
        };
        let created = |parent: u64, name: &[u8]| Change::Created {
            parent,
            name: name.to_vec(),
        };
        match req {
            MetaRequest::Create { parent, name, .. }
            | MetaRequest::CreateOpen { parent, name, .. } => vec![created(*parent, name)],
            MetaRequest::Link { ino, parent, name } => {
                vec![Change::Inode { ino: *ino }, created(*parent, name)]
            }
            // A last close may trim the file's memory, an allocation grow it (pushed without
            // waiting: see `rackfs_memnode::watch`).
            MetaRequest::Releases { inos, kept } => inos
                .iter()
                .chain(kept)
                .map(|&ino| Change::Blocks { ino })
                .collect(),
            MetaRequest::AllocStripe { ino, .. } => vec![Change::Blocks { ino: *ino }],
            MetaRequest::SetAttr { ino, .. }
            | MetaRequest::SetXattr { ino, .. }
            | MetaRequest::Fallocate { ino, .. }
            | MetaRequest::RemoveXattr { ino, .. } => {
                vec![Change::Inode { ino: *ino }]
            }
            MetaRequest::Unlink { parent, name, .. } | MetaRequest::Rmdir { parent, name } => {
                let mut v = vec![entry(*parent, name)];
                v.extend(target(*parent, name));
                v
            }
            MetaRequest::Rename {
                parent,
                name,
                new_parent,
                new_name,
                ..
            } => {
                // The moved inode's ctime changes, and the replaced one's link count.
                let mut v = vec![entry(*parent, name), entry(*new_parent, new_name)];
                v.extend(target(*parent, name));
                v.extend(target(*new_parent, new_name));
                v
            }
            _ => Vec::new(),
        }
    }

    /// Releases every open held by a session that ended (its mount went away).
    pub fn end_session(&mut self, session: u64, st: &dyn Storage) {
        if let Some(opens) = self.sessions.remove(&session) {
            for (ino, n) in opens {
                if let Some(i) = self.inodes.get_mut(&ino) {
                    i.opens = i.opens.saturating_sub(n);
                    if let Some(f) = &i.file {
                        // What the gone mount wrote reaches the standby with this step.
                        st.load(f.record + REC_SIZE);
                        st.load(f.record + REC_MTIME);
                    }
                }
                self.maybe_delete(ino, st);
            }
        }
    }

    /// The opens of session `from` become session `to`'s (a fenced mount's new session).
    pub fn adopt(&mut self, from: u64, to: u64) {
        if let Some(opens) = self.sessions.remove(&from) {
            let into = self.sessions.entry(to).or_default();
            for (ino, n) in opens {
                *into.entry(ino).or_default() += n;
            }
        }
    }

    /// The offset of regular file `ino`'s record in the service's region.
    pub fn record(&self, ino: u64) -> MetaResult<u64> {
        match self.get(ino)?.file.as_ref() {
            Some(f) => Ok(f.record),
            None => err(ErrorCode::Invalid, "not a regular file"),
        }
    }

    /// The offset of every regular file's record.
    pub fn file_records(&self) -> Vec<u64> {
        let files = self.inodes.values().filter_map(|i| i.file.as_ref());
        files.map(|f| f.record).collect()
    }

    /// Each regular file's size word as `region` holds it.
    pub fn file_sizes(&self, region: &rackfs_verbs::Region) -> std::collections::HashMap<u64, u64> {
        let files = self
            .inodes
            .iter()
            .filter_map(|(&ino, i)| Some((ino, i.file.as_ref()?)));
        files
            .map(|(ino, f)| (ino, read_word(region, f.record + REC_SIZE)))
            .collect()
    }

    /// The client sessions holding opens.
    pub fn sessions(&self) -> Vec<u64> {
        self.sessions.keys().copied().collect()
    }

    /// Every extent of the metadata area the namespace holds: (offset, bytes) of each file's
    /// record and tables.
    pub fn meta_extents(&self) -> Vec<(u64, u64)> {
        self.inodes
            .values()
            .filter_map(|i| i.file.as_ref())
            .flat_map(File::meta_extents)
            .collect()
    }

    /// Regular files deleted since the last call.
    pub fn take_deleted(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.deleted)
    }

    /// How many inodes exist.
    pub fn inodes(&self) -> u64 {
        self.inodes.len() as u64
    }

    /// `setfattr -n rackfs.replicas -v N FILE`: the replica count of a file without stripes.
    fn set_replicas(&mut self, ino: u64, value: &[u8], st: &dyn Storage) -> MetaResult<()> {
        let n = std::str::from_utf8(value)
            .ok()
            .and_then(|v| v.trim().parse::<u32>().ok())
            .ok_or_else(|| {
                Refusal::new(
                    ErrorCode::Invalid,
                    format!("{} is not a replica count", String::from_utf8_lossy(value)),
                )
            })?;
        let t = st.wall_ns();
        let i = self.get_mut(ino)?;
        let Some(f) = i.file.as_mut() else {
            return err(
                ErrorCode::Invalid,
                "only regular files have a replica count",
            );
        };
        f.set_replicas(n, st)?;
        i.ctime = t;
        Ok(())
    }

    /// Applies `change` to an inode's extended attributes; a change moves its ctime.
    fn change_xattrs(
        &mut self,
        ino: u64,
        st: &dyn Storage,
        change: impl FnOnce(&mut Xattrs) -> MetaResult<()>,
    ) -> MetaResult<ControlResponse> {
        let t = st.wall_ns();
        let i = self.get_mut(ino)?;
        change(&mut i.xattrs)?;
        i.ctime = t;
        Ok(ControlResponse::Ok)
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
        let (size, mtime, layout, allocated) = match &i.file {
            Some(f) => (
                read_word(region, f.record + REC_SIZE),
                read_word(region, f.record + REC_MTIME).max(i.mtime),
                Some(FileLayout {
                    node: primary,
                    record: f.record,
                    stripe_unit: f.stripe_unit,
                }),
                f.memory(),
            ),
            None => (
                match i.kind {
                    Kind::Symlink => i.target.len() as u64,
                    Kind::Dir => 4096,
                    _ => 0,
                },
                i.mtime,
                None,
                0,
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
            allocated,
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
        let t = st.wall_ns();
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
            xattrs: Xattrs::default(),
        };
        match kind {
            NewKind::File {
                stripe_unit,
                replicas,
            } => {
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
                if replicas > MAX_REPLICAS {
                    return err(
                        ErrorCode::Invalid,
                        format!("{replicas} replicas asked; at most {MAX_REPLICAS} are allowed"),
                    );
                }
                // The cluster's default when none is asked, never more than the cluster has
                // had nodes (those down included: their copies are made when they or others
                // are back).
                self.most_nodes = self.most_nodes.max(st.cluster_size() as u32);
                let replicas = match replicas {
                    0 => self.default_replicas,
                    r => r,
                }
                .min(self.most_nodes)
                .max(1);
                let (_, region) = st.local();
                let record = st.meta_alloc(RECORD_LEN)?;
                write_word(region, record + REC_STRIPE, stripe_unit);
                write_word(region, record + REC_INO, ino);
                write_word(region, record + REC_MTIME, t);
                inode.file = Some(File::new(record, stripe_unit, replicas, region));
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

    /// [`MetaRequest::CreateOpen`]'s namespace part: create, open, then place stripe 0 for
    /// `reserve` bytes if there is memory for it (without, the first write asks).
    #[allow(clippy::too_many_arguments)]
    fn create_open(
        &mut self,
        session: u64,
        parent: u64,
        name: &[u8],
        kind: NewKind,
        (perm, uid, gid): (u16, u32, u32),
        reserve: u64,
        st: &dyn Storage,
    ) -> MetaResult<ControlResponse> {
        let ControlResponse::Attr(attr) = self.create(parent, name, kind, perm, uid, gid, st)?
        else {
            unreachable!("create answers the new inode's attributes")
        };
        self.open(session, attr.ino)?;
        let unit = attr.layout.as_ref().map_or(0, |l| l.stripe_unit);
        let stripe = match reserve.min(unit) {
            0 => Vec::new(),
            end => self
                .alloc_first_stripe(attr.ino, end, st)
                .unwrap_or_else(|e| {
                    tracing::debug!(ino = attr.ino, error = %e, "no stripe placed at create");
                    Vec::new()
                }),
        };
        let ControlResponse::Attr(parent) = self.attr(parent, st)? else {
            unreachable!("attr answers attributes")
        };
        let ControlResponse::Attr(attr) = self.attr(attr.ino, st)? else {
            unreachable!("attr answers attributes")
        };
        Ok(ControlResponse::Created(Box::new(Created {
            attr,
            parent,
            stripe,
            lock_tree: 0,
        })))
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
            .ok_or_else(|| Refusal::new(ErrorCode::NotFound, "no such entry"))?;
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
        // Linux's order (linkat): the source, the new name's parent, the new name, then kind.
        let is_dir = self.get(ino)?.kind == Kind::Dir;
        if self.dir(parent)?.by_name.contains_key(name) {
            return err(
                ErrorCode::Exists,
                format!("{} exists", String::from_utf8_lossy(name)),
            );
        }
        if is_dir {
            return err(
                ErrorCode::Permission,
                "hard links to directories are not allowed",
            );
        }
        let t = st.wall_ns();
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
        let t = st.wall_ns();
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
            self.deleted.push(ino);
            f.delete(st);
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
        // Linux's order (renameat2): both parents, the source, NOREPLACE, EXCHANGE's target,
        // the ancestor traps, the same inode, then kinds and emptiness.
        self.dir(parent)?;
        self.dir(new_parent)?;
        let src = self.lookup(parent, name)?;
        let dst = self
            .dir(new_parent)?
            .by_name
            .get(new_name)
            .map(|c| self.dir(new_parent).expect("dir").entries[c].1);
        let exchange = flags & RENAME_EXCHANGE != 0;
        if flags & RENAME_NOREPLACE != 0 && dst.is_some() {
            return err(ErrorCode::Exists, "target exists");
        }
        if exchange && dst.is_none() {
            return err(ErrorCode::NotFound, "exchange target does not exist");
        }
        let src_is_dir = self.get(src)?.kind == Kind::Dir;
        let into_itself = || err(ErrorCode::Invalid, "cannot move a directory into itself");
        if src_is_dir && self.contains(src, new_parent)? {
            return into_itself();
        }
        let dst_is_dir = match dst {
            Some(d) => self.get(d)?.kind == Kind::Dir,
            None => false,
        };
        if let Some(d) = dst.filter(|_| dst_is_dir) {
            if self.contains(d, parent)? {
                return if exchange {
                    into_itself()
                } else {
                    err(ErrorCode::NotEmpty, "target directory not empty")
                };
            }
        }
        if dst == Some(src) {
            return Ok(()); // one name, or two hard links of one file: nothing to do
        }
        let t = st.wall_ns();
        if let (true, Some(dst)) = (exchange, dst) {
            self.set_entry(parent, name, dst)?;
            self.set_entry(new_parent, new_name, src)?;
            self.reparent(src, new_parent, src_is_dir, parent)?;
            self.reparent(dst, parent, dst_is_dir, new_parent)?;
            for ino in [src, dst, parent, new_parent] {
                self.get_mut(ino)?.ctime = t;
            }
            // Both directories' entries changed, as in any rename (tmpfs and ext4 do the same).
            for dir in [parent, new_parent] {
                self.get_mut(dir)?.mtime = t;
            }
            return Ok(());
        }
        if let Some(dst) = dst {
            let d = self.get(dst)?;
            match (src_is_dir, dst_is_dir) {
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

    /// Whether directory `dir` is `target` or one of its ancestors.
    fn contains(&self, dir: u64, target: u64) -> MetaResult<bool> {
        let mut p = target;
        loop {
            if p == dir {
                return Ok(true);
            }
            if p == ROOT_INO {
                return Ok(false);
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
            .ok_or_else(|| Refusal::new(ErrorCode::NotFound, "no such entry"))?;
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

    /// [`Namespace::readdir`] with each entry's attributes.
    fn readdir_plus(
        &self,
        ino: u64,
        after: u64,
        max: u32,
        st: &dyn Storage,
    ) -> MetaResult<ControlResponse> {
        let ControlResponse::Entries(entries) = self.readdir(ino, after, max)? else {
            unreachable!("readdir answers entries")
        };
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let ControlResponse::Attr(a) = self.attr(e.ino, st)? else {
                unreachable!("attr answers attributes")
            };
            out.push((e, a));
        }
        Ok(ControlResponse::EntriesPlus(out))
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
        self.closed(ino, 0, st);
        self.maybe_delete(ino, st);
    }

    /// A last close after which session `session` keeps its open (a mount reopens such a
    /// file without asking): settled and trimmed as a release that left only that open.
    /// False, and nothing happens, if the session holds no open of `ino`.
    fn close_kept(&mut self, session: u64, ino: u64, st: &dyn Storage) -> bool {
        // A session's opens are among the file's: with more than the kept one, no trim.
        let held = self
            .sessions
            .get(&session)
            .is_some_and(|s| s.contains_key(&ino));
        if held {
            self.closed(ino, 1, st);
        }
        held
    }

    /// A mount closed `ino`: what it wrote reaches the standby with this step, and the last
    /// extent is trimmed to the size when at most `left` opens remain (a kept open, which
    /// only its own mount's next close can follow, is one a trim may leave).
    fn closed(&mut self, ino: u64, left: u32, st: &dyn Storage) {
        let serial = self.next_tag;
        if let Some(i) = self.inodes.get_mut(&ino) {
            if let Some(f) = &i.file {
                st.load(f.record + REC_SIZE);
                st.load(f.record + REC_MTIME);
            }
            if i.opens <= left && i.nlink > 0 && !self.trims_held {
                if let Some(f) = i.file.as_mut() {
                    self.next_tag += 1;
                    if let Err(e) = f.trim(serial, st) {
                        tracing::warn!(ino, error = %e, "last stripe not trimmed");
                    }
                }
            }
        }
    }

    fn setattr(&mut self, ino: u64, set: SetAttr, st: &dyn Storage) -> MetaResult<ControlResponse> {
        let t = st.wall_ns();
        if let Some(size) = set.size {
            self.truncate(ino, size, st)?;
        }
        let (_, region) = st.local();
        let i = self.get_mut(ino)?;
        if set.kill_suidgid {
            const SUID: u16 = 0o4000;
            const SGID: u16 = 0o2000;
            const XGRP: u16 = 0o0010;
            i.perm &= !SUID;
            if i.perm & XGRP != 0 {
                i.perm &= !SGID;
            }
        }
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

    /// A file's size and mtime grow to at least what a mount reports having written.
    fn settle(&mut self, ino: u64, size: u64, mtime: u64, st: &dyn Storage) -> MetaResult<()> {
        let (_, region) = st.local();
        let record = self.record(ino)?;
        if size > st.load(record + REC_SIZE) {
            write_word(region, record + REC_SIZE, size.min(MAX_FILE_SIZE));
        }
        if mtime > st.load(record + REC_MTIME) {
            write_word(region, record + REC_MTIME, mtime);
        }
        Ok(())
    }

    fn truncate(&mut self, ino: u64, size: u64, st: &dyn Storage) -> MetaResult<()> {
        if size > MAX_FILE_SIZE {
            return err(
                ErrorCode::TooBig,
                format!("size {size} exceeds the maximum file size {MAX_FILE_SIZE}"),
            );
        }
        let (_, region) = st.local();
        let t = st.wall_ns();
        if let Some(f) = self.get(ino)?.file.as_ref() {
            // The stripes the cut may zero (the one holding a lower end) or free (beyond it).
            let (unit, old) = (f.stripe_unit, st.load(f.record + REC_SIZE));
            let first = match size < old {
                true => size / unit,
                false => size.div_ceil(unit),
            };
            self.followed(ino, first..u64::MAX)?;
        }
        let i = self.get_mut(ino)?;
        let Some(f) = i.file.as_mut() else {
            return not_a_file(i.kind, "not a regular file");
        };
        let old = st.load(f.record + REC_SIZE);
        let was = (st.load(f.record + REC_MTIME), i.mtime);
        write_word(region, f.record + REC_SIZE, size);
        write_word(region, f.record + REC_MTIME, t);
        i.mtime = t;
        let cut = f.cut(size, old, st);
        if cut.is_err() {
            // Refused before it freed anything (the zeroing of the new last stripe failed on
            // every replica): the file stays as it was, so the truncate asked again zeroes.
            write_word(region, f.record + REC_SIZE, old);
            write_word(region, f.record + REC_MTIME, was.0);
            i.mtime = was.1;
        }
        cut
    }

    /// The offset of a file's record-lock table, made (zeroed) on first use.
    fn record_locks(&mut self, ino: u64, st: &dyn Storage) -> MetaResult<u64> {
        let i = self.get_mut(ino)?;
        let Some(f) = i.file.as_mut() else {
            return err(ErrorCode::Invalid, "record locks need a regular file");
        };
        if f.record_locks == 0 {
            let len = rackfs_locks::record::TABLE_LEN;
            let at = st.meta_alloc(len)?;
            let (_, region) = st.local();
            region
                .write(at, &vec![0u8; len as usize])
                .map_err(|e| Refusal::new(ErrorCode::Internal, e.to_string()))?;
            f.record_locks = at;
        }
        Ok(f.record_locks)
    }

    /// Every record-lock table: (inode, offset).
    pub fn record_lock_tables(&self) -> Vec<(u64, u64)> {
        self.inodes
            .iter()
            .filter_map(|(&ino, i)| i.file.as_ref().map(|f| (ino, f.record_locks)))
            .filter(|&(_, at)| at != 0)
            .collect()
    }

    /// `fallocate(2)` (see [`MetaRequest::Fallocate`]); the caller holds the whole-file lock.
    fn fallocate(
        &mut self,
        ino: u64,
        offset: u64,
        len: u64,
        mode: u32,
        st: &dyn Storage,
    ) -> MetaResult<()> {
        let keep = mode & FALLOC_KEEP_SIZE != 0;
        let known = FALLOC_KEEP_SIZE | FALLOC_PUNCH_HOLE | FALLOC_ZERO_RANGE;
        if mode & !known != 0 || (mode & FALLOC_PUNCH_HOLE != 0 && !keep) {
            return err(
                ErrorCode::NotSupported,
                format!("fallocate mode {mode:#x} (supported: 0, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE, ZERO_RANGE)"),
            );
        }
        if mode & FALLOC_PUNCH_HOLE != 0 && mode & FALLOC_ZERO_RANGE != 0 || len == 0 {
            return err(
                ErrorCode::Invalid,
                format!("fallocate mode {mode:#x} of {len} bytes"),
            );
        }
        let end = match offset.checked_add(len) {
            Some(end) if end <= MAX_FILE_SIZE => end,
            _ => {
                return err(
                    ErrorCode::TooBig,
                    format!(
                    "fallocate to {offset} + {len} exceeds the maximum file size {MAX_FILE_SIZE}"
                ),
                )
            }
        };
        if let Some(unit) = self.get(ino)?.file.as_ref().map(|f| f.stripe_unit) {
            self.followed(ino, offset / unit..end.div_ceil(unit))?;
        }
        let (_, region) = st.local();
        let t = st.wall_ns();
        let mut serial = self.next_tag;
        let i = self.get_mut(ino)?;
        let Some(f) = i.file.as_mut() else {
            return not_a_file(i.kind, "fallocate needs a regular file");
        };
        let done = if mode & FALLOC_PUNCH_HOLE != 0 {
            f.punch(offset, end, st)
        } else {
            f.reserve(ino, offset, end, keep, &mut serial, st)
                .and_then(|()| match mode & FALLOC_ZERO_RANGE {
                    0 => Ok(()),
                    _ => f.zero(offset, end, st),
                })
        };
        let grows = !keep && end > st.load(f.record + REC_SIZE);
        if done.is_ok() && grows {
            write_word(region, f.record + REC_SIZE, end);
        }
        if done.is_ok() && (grows || mode & (FALLOC_PUNCH_HOLE | FALLOC_ZERO_RANGE) != 0) {
            write_word(region, f.record + REC_MTIME, t);
            i.mtime = t;
            i.ctime = t;
        }
        self.next_tag = serial;
        done
    }

    /// Refuses (Unavailable, which mounts ask again) while a replica of one of `stripes` of
    /// file `ino` sits on a node not followed since the take-over (see `unfollowed`): moving or
    /// zeroing it now would fail there, or drop a good replica.
    fn followed(&self, ino: u64, stripes: std::ops::Range<u64>) -> MetaResult<()> {
        if self.unfollowed.is_empty() {
            return Ok(());
        }
        let Some(f) = self.get(ino)?.file.as_ref() else {
            return Ok(());
        };
        let stale = f
            .replica_nodes(stripes)
            .find(|n| self.unfollowed.contains(n));
        match stale {
            Some(n) => err(
                ErrorCode::Unavailable,
                format!(
                    "node {n} holds a replica of this file and has not followed this primary yet"
                ),
            ),
            None => Ok(()),
        }
    }

    fn alloc_stripe(
        &mut self,
        ino: u64,
        stripe: u64,
        end: u64,
        st: &dyn Storage,
    ) -> MetaResult<Vec<StripeExtent>> {
        // Every allocation gets a serial of its own (one wasted on a refusal costs nothing).
        let serial = self.next_tag;
        self.next_tag += 1;
        self.followed(ino, stripe..stripe.saturating_add(1))?;
        let i = self.get_mut(ino)?;
        let Some(f) = i.file.as_mut() else {
            return err(ErrorCode::Invalid, "not a regular file");
        };
        if stripe.saturating_mul(f.stripe_unit) >= MAX_FILE_SIZE {
            return err(ErrorCode::TooBig, "offset beyond the maximum file size");
        }
        if end > f.stripe_unit {
            return err(
                ErrorCode::Invalid,
                format!("{end} bytes do not fit a stripe of {}", f.stripe_unit),
            );
        }
        f.alloc_stripe(ino, stripe, end, serial, st)
    }

    /// A new file's first stripe, placed from the pool ([`crate::pool`]) where it can be.
    fn alloc_first_stripe(
        &mut self,
        ino: u64,
        end: u64,
        st: &dyn Storage,
    ) -> MetaResult<Vec<StripeExtent>> {
        let cap = match self.get(ino)?.file.as_ref() {
            Some(f) if end <= f.stripe_unit => f.hole_cap(0, end),
            _ => None,
        };
        let placed = match cap.and_then(|cap| self.pool.take(cap, &mut self.next_tag, st)) {
            Some(slot) => {
                let f = self.get_mut(ino)?.file.as_mut().expect("a regular file");
                f.alloc_hole_from(ino, 0, end, slot, st)
            }
            None => self.alloc_stripe(ino, 0, end, st),
        };
        self.give_back_pool_if_short(ino, placed.as_ref().map(Vec::len), st);
        placed
    }

    /// A placement for file `ino` ran short of memory (failed for it, or got fewer replicas
    /// than the file asks while there are nodes enough for them): the pooled extents are
    /// freed, so that memory serves the stripes that need it.
    fn give_back_pool_if_short(
        &mut self,
        ino: u64,
        placed: Result<usize, &Refusal>,
        st: &dyn Storage,
    ) {
        let short = match placed {
            Err(e) => e.code == ErrorCode::OutOfMemory,
            Ok(n) => {
                let asked = self
                    .get(ino)
                    .ok()
                    .and_then(|i| i.file.as_ref())
                    .map_or(0, |f| f.replicas as usize);
                n < asked && st.data_nodes().len() >= asked
            }
        };
        if short {
            self.pool.give_back(st);
        }
    }

    /// Node memory held by extents placed ahead ([`crate::pool`]), in data bytes.
    pub fn pooled_bytes(&self) -> u64 {
        self.pool.bytes()
    }

    /// Data node `node` was declared dead: its replicas are dropped from every stripe that
    /// has another (see [`File::drop_node`]), and its extents placed ahead.
    pub fn drop_node(&mut self, node: u32, st: &dyn Storage) -> Dropped {
        let pooled = self.pool.drop_node(node);
        self.unfollowed.remove(&node);
        let (_, region) = st.local();
        let mut d = Dropped {
            pooled,
            ..Dropped::default()
        };
        for f in self.inodes.values_mut().filter_map(|i| i.file.as_mut()) {
            f.drop_node(node, region, &mut d);
        }
        d
    }

    /// Up to `max` stripes (file, stripe) below their file's replication factor, among at
    /// most `budget` inodes from inode `from` on; and the inode to go on from (0: the scan
    /// reached the end). The budget bounds how long a caller holds the metadata lock however
    /// many files there are.
    pub fn degraded_stripes(&self, from: u64, budget: usize, max: usize) -> (Vec<(u64, u64)>, u64) {
        let mut v = Vec::new();
        for (looked, (&ino, i)) in self.inodes.range(from..).enumerate() {
            if looked == budget || v.len() >= max {
                return (v, ino);
            }
            if let Some(f) = &i.file {
                v.extend(
                    f.degraded_stripes(max - v.len())
                        .into_iter()
                        .map(|k| (ino, k)),
                );
            }
        }
        (v, 0)
    }

    /// This primary took over (see [`crate::journal::Step::TakeOver`]); it has followed no
    /// data node yet.
    pub fn take_over(&mut self) {
        self.trims_held = true;
        self.resolved.clear();
        self.unfollowed.clear();
        for f in self.inodes.values().filter_map(|i| i.file.as_ref()) {
            self.unfollowed.extend(f.replica_nodes(..));
        }
        self.next_tag += TAKE_OVER_SERIALS;
    }

    /// The mounts' sizes settled after a take-over: last stripes are trimmed again.
    pub fn sizes_settled(&mut self) {
        self.trims_held = false;
    }

    /// A primary that took over, once data node `node` follows it: points every replica its
    /// tables list on the node at what the node holds now (see [`crate::history`]: moves and
    /// retags its predecessor made without the standby knowing), drops replicas the node no
    /// longer holds, and frees the old copies of moved extents.
    pub fn roll_forward(&mut self, node: u32, st: &dyn Storage) -> RolledForward {
        self.resolved.insert(node);
        let (_, region) = st.local();
        let mut out = RolledForward::default();
        // Every replica on the node, by (base, tag): (inode, stripe, slot).
        type Slot = (u64, u64, usize);
        let mut listed: BTreeMap<ExtentAt, Vec<Slot>> = BTreeMap::new();
        for (&ino, i) in &self.inodes {
            if let Some(f) = &i.file {
                for (k, j, e) in f.replicas_on(node) {
                    listed
                        .entry((e.offset - TAG_SPACE, e.tag))
                        .or_default()
                        .push((ino, k, j));
                }
            }
        }
        let asked: Vec<ExtentAt> = listed.keys().copied().collect();
        // One call even with nothing listed: it names the old copies to free.
        let chunks: Vec<&[ExtentAt]> = match asked.is_empty() {
            true => vec![&[]],
            false => asked.chunks(RESOLVE_BATCH).collect(),
        };
        let mut moved = std::collections::BTreeSet::new();
        for chunk in chunks {
            let r = match st.resolve(node, chunk) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(node, error = %e, "cannot ask a data node what it holds: replicas it moved for the old primary may read EIO");
                    out.unanswered = true;
                    return out;
                }
            };
            moved.extend(r.moved);
            for (at, now) in r.changed {
                for &(ino, k, j) in listed.get(&at).into_iter().flatten() {
                    let f = self.inodes.get_mut(&ino).and_then(|i| i.file.as_mut());
                    if f.is_some_and(|f| f.relocate(region, k, j, now)) {
                        match now {
                            Some(_) => out.relocated += 1,
                            None => out.dropped += 1,
                        }
                    }
                }
            }
        }
        // Replicas the old primary did not get to move or retag while it did others of the
        // same stripe: the followed ones hold all they held. (A node not serving yet frees
        // them when it is admitted.)
        let mut stale = Vec::new();
        for f in self.inodes.values_mut().filter_map(|i| i.file.as_mut()) {
            f.settle_tags(region, &self.resolved, &mut stale);
        }
        for e in stale {
            out.dropped += 1;
            if let Err(err) = st.free(e.node, e.offset - TAG_SPACE, Some(e.tag)) {
                tracing::warn!(node = e.node, error = %err, "a replica left behind by the old primary's last change stays allocated");
            }
        }
        // After that, no table lists a moved extent's old copy.
        for (base, tag) in moved {
            match st.free(node, base, Some(tag)) {
                Ok(()) => out.freed += 1,
                Err(e) => {
                    tracing::warn!(node, base, error = %e, "a moved stripe's old extent stays allocated")
                }
            }
        }
        self.unfollowed.remove(&node);
        out
    }

    /// Copies stripe `stripe` of file `ino` back towards its replication factor (see
    /// [`File::rebuild`]); returns the bytes copied.
    pub fn rebuild(&mut self, ino: u64, stripe: u64, st: &dyn Storage) -> MetaResult<u64> {
        let serial = self.next_tag;
        self.next_tag += 1;
        let Some(f) = self.inodes.get_mut(&ino).and_then(|i| i.file.as_mut()) else {
            return Ok(0); // deleted meanwhile
        };
        let copied = f.rebuild(ino, stripe, serial, st);
        // Nothing copied though a node could take the copy: memory ran short there, and the
        // pooled extents serve a degraded stripe better than a create to come.
        if copied == Ok(0) && self.pool.bytes() > 0 && f.could_rebuild(stripe, &st.data_nodes()) {
            self.pool.give_back(st);
        }
        copied
    }

    /// The health of the files' data: files with a degraded stripe (fewer live replicas than
    /// asked), and files with a stripe whose every live replica is on a node in `down`.
    pub fn health(&self, down: &[u32]) -> DataHealth {
        let mut h = DataHealth::default();
        for f in self.inodes.values().filter_map(|i| i.file.as_ref()) {
            h.files += 1;
            let degraded = f.degraded(down);
            h.degraded_stripes += degraded;
            if f.lost(down) > 0 {
                h.unavailable_files += 1;
            } else if degraded > 0 {
                h.degraded_files += 1;
            }
        }
        h
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
