//! The namespace against a reference model: random sequences of create, mkdir, symlink, link,
//! unlink, rmdir, rename (with and without RENAME_NOREPLACE / RENAME_EXCHANGE), truncate,
//! setattr, stripe allocation and extended attributes run on both; every result (attributes or errno) must agree,
//! and after every step the whole tree, every inode's attributes and the memory in use must too.
//!
//! The model is a plain tree of names in the spirit of mountpoint-s3's reftests: link counts
//! are derived from the tree, not kept, and errors follow Linux's precedence (the order the
//! VFS checks them in `renameat2`, `linkat`, `unlinkat`, `mkdirat`).

use std::collections::BTreeMap;

use proptest::prelude::*;
use rackfs_meta::{MemStorage, MetaService, Namespace, Storage};
use rackfs_proto::control::{ControlResponse, ErrorCode};
use rackfs_proto::namespace::{
    Attr, Kind, MetaRequest, NewKind, SetAttr, MAX_FILE_SIZE, RENAME_EXCHANGE, RENAME_NOREPLACE,
    ROOT_INO, XATTR_CREATE, XATTR_REPLACE,
};
use rackfs_proto::record::{EXTENT_GRANULE, TAG_SPACE};

const UNIT: u64 = 4096;

#[derive(Debug, Clone)]
enum MKind {
    /// Stripes by index, with the most bytes ever asked of each, and the copies of each.
    File {
        size: u64,
        stripes: BTreeMap<u64, u64>,
        replicas: u64,
    },
    Dir {
        entries: BTreeMap<Vec<u8>, u64>,
    },
    Symlink,
}

#[derive(Debug, Clone)]
struct MInode {
    kind: MKind,
    perm: u16,
    uid: u32,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

/// The reference: inodes by number, directories as name maps.
struct Model {
    inodes: BTreeMap<u64, MInode>,
    next_ino: u64,
}

type MResult<T> = Result<T, ErrorCode>;

impl Model {
    fn new() -> Model {
        let root = MInode {
            kind: MKind::Dir {
                entries: BTreeMap::new(),
            },
            perm: 0o755,
            uid: 0,
            xattrs: BTreeMap::new(),
        };
        Model {
            inodes: BTreeMap::from([(ROOT_INO, root)]),
            next_ino: ROOT_INO + 1,
        }
    }

    fn entries(&self, dir: u64) -> MResult<&BTreeMap<Vec<u8>, u64>> {
        match &self.inodes.get(&dir).ok_or(ErrorCode::NotFound)?.kind {
            MKind::Dir { entries } => Ok(entries),
            _ => Err(ErrorCode::NotDir),
        }
    }

    fn entries_mut(&mut self, dir: u64) -> &mut BTreeMap<Vec<u8>, u64> {
        match &mut self.inodes.get_mut(&dir).expect("dir").kind {
            MKind::Dir { entries } => entries,
            _ => panic!("not a dir"),
        }
    }

    fn is_dir(&self, ino: u64) -> bool {
        matches!(self.inodes[&ino].kind, MKind::Dir { .. })
    }

    fn parent_of(&self, dir: u64) -> u64 {
        if dir == ROOT_INO {
            return ROOT_INO;
        }
        for (&p, i) in &self.inodes {
            if let MKind::Dir { entries } = &i.kind {
                if entries.values().any(|&c| c == dir) {
                    return p;
                }
            }
        }
        panic!("directory {dir} has no parent")
    }

    /// Whether `a` is `b` or one of its ancestors.
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

    /// How many directory entries name `ino`.
    fn names(&self, ino: u64) -> u32 {
        self.inodes
            .values()
            .filter_map(|i| match &i.kind {
                MKind::Dir { entries } => Some(entries.values().filter(|&&c| c == ino).count()),
                _ => None,
            })
            .sum::<usize>() as u32
    }

    fn nlink(&self, ino: u64) -> u32 {
        match &self.inodes[&ino].kind {
            MKind::Dir { entries } => {
                2 + entries.values().filter(|&&c| self.is_dir(c)).count() as u32
            }
            _ => self.names(ino),
        }
    }

    /// Drops inodes no name reaches (no opens in this model).
    fn collect(&mut self) {
        let dead: Vec<u64> = self
            .inodes
            .keys()
            .copied()
            .filter(|&i| i != ROOT_INO && self.names(i) == 0)
            .collect();
        for i in dead {
            self.inodes.remove(&i);
        }
        // A removed directory was empty, so one pass is enough; check it stays so.
        assert!(self
            .inodes
            .keys()
            .all(|&i| i == ROOT_INO || self.names(i) > 0));
    }

    fn check_name(name: &[u8]) -> MResult<()> {
        if name.is_empty() || name.contains(&b'/') {
            return Err(ErrorCode::Invalid);
        }
        if name.len() > 255 {
            return Err(ErrorCode::NameTooLong);
        }
        Ok(())
    }

    fn create(&mut self, parent: u64, name: &[u8], kind: MKind) -> MResult<u64> {
        Self::check_name(name)?;
        if self.entries(parent)?.contains_key(name) {
            return Err(ErrorCode::Exists);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        let perm = if matches!(kind, MKind::Symlink) {
            0o777
        } else {
            0o644
        };
        self.inodes.insert(
            ino,
            MInode {
                kind,
                perm,
                uid: 0,
                xattrs: BTreeMap::new(),
            },
        );
        self.entries_mut(parent).insert(name.to_vec(), ino);
        Ok(ino)
    }

    fn link(&mut self, ino: u64, parent: u64, name: &[u8]) -> MResult<u64> {
        Self::check_name(name)?;
        if !self.inodes.contains_key(&ino) {
            return Err(ErrorCode::NotFound);
        }
        if self.entries(parent)?.contains_key(name) {
            return Err(ErrorCode::Exists);
        }
        if self.is_dir(ino) {
            return Err(ErrorCode::Permission);
        }
        self.entries_mut(parent).insert(name.to_vec(), ino);
        Ok(ino)
    }

    fn remove(&mut self, parent: u64, name: &[u8], dir: bool) -> MResult<()> {
        Self::check_name(name)?;
        let ino = *self.entries(parent)?.get(name).ok_or(ErrorCode::NotFound)?;
        match (dir, self.is_dir(ino)) {
            (true, false) => return Err(ErrorCode::NotDir),
            (false, true) => return Err(ErrorCode::IsDir),
            (true, true) if !self.entries(ino)?.is_empty() => return Err(ErrorCode::NotEmpty),
            _ => {}
        }
        self.entries_mut(parent).remove(name);
        self.collect();
        Ok(())
    }

    /// Linux's `renameat2` order: both parents, the source name, NOREPLACE, EXCHANGE's
    /// target, the ancestor traps, same inode, kinds, emptiness.
    fn rename(&mut self, p: u64, name: &[u8], np: u64, nname: &[u8], flags: u32) -> MResult<()> {
        Self::check_name(name)?;
        Self::check_name(nname)?;
        self.entries(p)?;
        self.entries(np)?;
        let src = *self.entries(p)?.get(name).ok_or(ErrorCode::NotFound)?;
        let dst = self.entries(np)?.get(nname).copied();
        if flags & RENAME_NOREPLACE != 0 && dst.is_some() {
            return Err(ErrorCode::Exists);
        }
        let exchange = flags & RENAME_EXCHANGE != 0;
        if exchange && dst.is_none() {
            return Err(ErrorCode::NotFound);
        }
        // The source is an ancestor of the target's parent.
        if self.is_dir(src) && self.contains(src, np) {
            return Err(ErrorCode::Invalid);
        }
        // The target is an ancestor of the source's parent.
        if let Some(d) = dst.filter(|&d| self.is_dir(d) && self.contains(d, p)) {
            let _ = d;
            return Err(if exchange {
                ErrorCode::Invalid
            } else {
                ErrorCode::NotEmpty
            });
        }
        if dst == Some(src) {
            return Ok(());
        }
        if exchange {
            let dst = dst.expect("checked");
            self.entries_mut(p).insert(name.to_vec(), dst);
            self.entries_mut(np).insert(nname.to_vec(), src);
            return Ok(());
        }
        if let Some(d) = dst {
            match (self.is_dir(src), self.is_dir(d)) {
                (true, false) => return Err(ErrorCode::NotDir),
                (false, true) => return Err(ErrorCode::IsDir),
                (true, true) if !self.entries(d)?.is_empty() => return Err(ErrorCode::NotEmpty),
                _ => {}
            }
        }
        self.entries_mut(p).remove(name);
        self.entries_mut(np).insert(nname.to_vec(), src);
        self.collect();
        Ok(())
    }

    /// `setxattr` (`value` some) or `removexattr` (none), with Linux's flags.
    fn xattr(&mut self, ino: u64, name: &[u8], value: Option<&[u8]>, flags: u32) -> MResult<()> {
        let i = self.inodes.get_mut(&ino).ok_or(ErrorCode::NotFound)?;
        if !name.starts_with(b"user.") {
            return Err(ErrorCode::NotSupported);
        }
        let exists = i.xattrs.contains_key(name);
        match value {
            None if !exists => Err(ErrorCode::NoData),
            None => {
                i.xattrs.remove(name);
                Ok(())
            }
            Some(_) if exists && flags == XATTR_CREATE => Err(ErrorCode::Exists),
            Some(_) if !exists && flags == XATTR_REPLACE => Err(ErrorCode::NoData),
            Some(v) => {
                i.xattrs.insert(name.to_vec(), v.to_vec());
                Ok(())
            }
        }
    }

    fn setattr(
        &mut self,
        ino: u64,
        size: Option<u64>,
        perm: Option<u16>,
        uid: Option<u32>,
    ) -> MResult<()> {
        if let Some(s) = size {
            if s > MAX_FILE_SIZE {
                return Err(ErrorCode::TooBig);
            }
        }
        let i = self.inodes.get_mut(&ino).ok_or(ErrorCode::NotFound)?;
        if let Some(s) = size {
            match &mut i.kind {
                MKind::File { size, stripes, .. } => {
                    *size = s;
                    stripes.retain(|&k, _| k < s.div_ceil(UNIT));
                }
                MKind::Dir { .. } => return Err(ErrorCode::IsDir),
                MKind::Symlink => return Err(ErrorCode::Invalid),
            }
        }
        if let Some(p) = perm {
            i.perm = p & 0o7777;
        }
        if let Some(u) = uid {
            i.uid = u;
        }
        Ok(())
    }

    /// Stripe allocation: the model keeps which stripes exist and how much was asked of each.
    fn replicas(&self, ino: u64) -> u64 {
        match &self.inodes[&ino].kind {
            MKind::File { replicas, .. } => *replicas,
            _ => 0,
        }
    }

    fn alloc_stripe(&mut self, ino: u64, stripe: u64, end: u64) -> MResult<()> {
        let i = self.inodes.get_mut(&ino).ok_or(ErrorCode::NotFound)?;
        match &mut i.kind {
            MKind::File { stripes, .. } if end <= UNIT => {
                let e = stripes.entry(stripe).or_default();
                *e = (*e).max(end).max(1);
                Ok(())
            }
            _ => Err(ErrorCode::Invalid),
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Create {
        parent: usize,
        name: Vec<u8>,
        kind: u8,
    },
    Link {
        ino: usize,
        parent: usize,
        name: Vec<u8>,
    },
    Unlink {
        parent: usize,
        name: Vec<u8>,
    },
    Rmdir {
        parent: usize,
        name: Vec<u8>,
    },
    Rename {
        parent: usize,
        name: Vec<u8>,
        new_parent: usize,
        new_name: Vec<u8>,
        flags: u32,
    },
    SetAttr {
        ino: usize,
        size: Option<u64>,
        perm: Option<u16>,
        uid: Option<u32>,
    },
    AllocStripe {
        ino: usize,
        stripe: u64,
        end: u64,
    },
    /// `setxattr` when `value` is some, else `removexattr`.
    Xattr {
        ino: usize,
        name: Vec<u8>,
        value: Option<Vec<u8>>,
        flags: u32,
    },
}

fn name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        20 => prop::sample::select(vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec(), b"d".to_vec()]),
        1 => Just(Vec::new()),
        1 => Just(b"x/y".to_vec()),
        1 => Just(vec![b'n'; 256]),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let idx = 0usize..64;
    prop_oneof![
        6 => (idx.clone(), name(), 0u8..3).prop_map(|(parent, name, kind)| Op::Create { parent, name, kind }),
        2 => (idx.clone(), idx.clone(), name()).prop_map(|(ino, parent, name)| Op::Link { ino, parent, name }),
        2 => (idx.clone(), name()).prop_map(|(parent, name)| Op::Unlink { parent, name }),
        2 => (idx.clone(), name()).prop_map(|(parent, name)| Op::Rmdir { parent, name }),
        4 => (idx.clone(), name(), idx.clone(), name(), prop::sample::select(vec![0, RENAME_NOREPLACE, RENAME_EXCHANGE]))
            .prop_map(|(parent, name, new_parent, new_name, flags)| Op::Rename { parent, name, new_parent, new_name, flags }),
        2 => (idx.clone(), prop::option::of(prop_oneof![0u64..40_000, Just(MAX_FILE_SIZE + 1)]), prop::option::of(0u16..0o10000), prop::option::of(0u32..3))
            .prop_map(|(ino, size, perm, uid)| Op::SetAttr { ino, size, perm, uid }),
        2 => (idx, 0u64..12, prop_oneof![0u64..=UNIT, Just(UNIT + 1)]).prop_map(|(ino, stripe, end)| Op::AllocStripe { ino, stripe, end }),
        // Few inodes and names, so that flags meet existing and missing attributes alike.
        4 => (0usize..3, prop::sample::select(vec![b"user.a".to_vec(), b"user.a".to_vec(), b"user.b".to_vec(), b"os2.a".to_vec()]),
              prop::option::of(prop::collection::vec(any::<u8>(), 0..4)), 0u32..3)
            .prop_map(|(ino, name, value, flags)| Op::Xattr { ino, name, value, flags }),
    ]
}

/// Runs one request on the service; `Ok(response)` or the error class.
fn call(svc: &mut MetaService, st: &MemStorage, req: MetaRequest) -> MResult<ControlResponse> {
    match svc.handle(1, req, st) {
        ControlResponse::Error { code, .. } => Err(code),
        r => Ok(r),
    }
}

fn attr(svc: &mut MetaService, st: &MemStorage, ino: u64) -> MResult<Attr> {
    match call(svc, st, MetaRequest::GetAttr { ino })? {
        ControlResponse::Attr(a) => Ok(a),
        other => panic!("getattr answered {other:?}"),
    }
}

/// The whole tree and every inode agree.
fn compare(svc: &mut MetaService, st: &MemStorage, m: &Model) -> Result<(), TestCaseError> {
    for (&ino, i) in &m.inodes {
        let a =
            attr(svc, st, ino).map_err(|e| TestCaseError::fail(format!("inode {ino}: {e:?}")))?;
        let (kind, size) = match &i.kind {
            MKind::File { size, .. } => (Kind::File, *size),
            MKind::Dir { .. } => (Kind::Dir, 4096),
            MKind::Symlink => (Kind::Symlink, 1),
        };
        prop_assert_eq!(
            (a.kind, a.size, a.perm, a.uid, a.nlink),
            (kind, size, i.perm, i.uid, m.nlink(ino)),
            "inode {}",
            ino
        );
        let mut names = Vec::new();
        for (name, value) in &i.xattrs {
            names.extend_from_slice(name);
            names.push(0);
            let got = call(
                svc,
                st,
                MetaRequest::GetXattr {
                    ino,
                    name: name.clone(),
                },
            );
            prop_assert_eq!(
                got,
                Ok(ControlResponse::Xattr(value.clone())),
                "inode {}",
                ino
            );
        }
        let listed = call(svc, st, MetaRequest::ListXattr { ino });
        prop_assert_eq!(listed, Ok(ControlResponse::Xattr(names)), "inode {}", ino);
        if let MKind::Dir { entries } = &i.kind {
            let got = match call(
                svc,
                st,
                MetaRequest::ReadDir {
                    ino,
                    after: 0,
                    max: 1000,
                },
            ) {
                Ok(ControlResponse::Entries(e)) => e,
                other => panic!("readdir answered {other:?}"),
            };
            let got: BTreeMap<Vec<u8>, u64> = got
                .into_iter()
                .filter(|e| e.name != b"." && e.name != b"..")
                .map(|e| (e.name, e.ino))
                .collect();
            prop_assert_eq!(&got, entries, "directory {}", ino);
        }
    }
    // Inode numbers that are gone in the model are gone in the service.
    for ino in ROOT_INO..m.next_ino {
        if !m.inodes.contains_key(&ino) {
            prop_assert_eq!(
                attr(svc, st, ino).err(),
                Some(ErrorCode::NotFound),
                "inode {} should be gone",
                ino
            );
        }
    }
    Ok(())
}

/// The bounds on the stripe memory of the model's live files: a file's first stripe holds at
/// least the bytes asked of it and at most three times that (geometric growth) or the stripe
/// unit; later stripes are whole; each has its tag.
fn stripe_bytes(m: &Model) -> (u64, u64) {
    let ends = m.inodes.values().flat_map(|i| match &i.kind {
        MKind::File {
            stripes, replicas, ..
        } => stripes
            .iter()
            .flat_map(|(&k, &e)| std::iter::repeat_n((k, e), *replicas as usize))
            .collect(),
        _ => Vec::new(),
    });
    ends.fold((0, 0), |(lo, hi), (stripe, end)| {
        let end = end.next_multiple_of(EXTENT_GRANULE);
        let (l, h) = if stripe == 0 {
            (end, (3 * end).min(UNIT))
        } else {
            (UNIT, UNIT)
        };
        (lo + l + TAG_SPACE, hi + h + TAG_SPACE)
    })
}

fn pick(known: &[u64], i: usize) -> u64 {
    known[i % known.len()]
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let st = MemStorage::new(3, 1 << 30);
    let mut svc = MetaService::new(std::time::Duration::from_secs(2), st.wall_ns());
    let mut standby = Standby::follow(&mut svc, &st);
    let mut m = Model::new();
    // Every inode number ever handed out, the deleted ones included (they must answer ENOENT).
    let mut known = vec![ROOT_INO];
    for op in ops {
        let (want, got): (MResult<Option<u64>>, MResult<Option<u64>>) = match op.clone() {
            Op::Create { parent, name, kind } => {
                let parent = pick(&known, parent);
                let (mk, nk) = match kind {
                    0 => (
                        MKind::File {
                            size: 0,
                            stripes: BTreeMap::new(),
                            replicas: name.first().map_or(1, |&c| c as u64 % 3 + 1),
                        },
                        NewKind::File {
                            stripe_unit: UNIT,
                            replicas: name.first().map_or(1, |&c| c as u32 % 3 + 1),
                        },
                    ),
                    1 => (
                        MKind::Dir {
                            entries: BTreeMap::new(),
                        },
                        NewKind::Dir,
                    ),
                    _ => (MKind::Symlink, NewKind::Symlink(b"t".to_vec())),
                };
                let perm = if kind == 2 { 0o777 } else { 0o644 };
                let want = m.create(parent, &name, mk).map(Some);
                let got = call(
                    &mut svc,
                    &st,
                    MetaRequest::Create {
                        parent,
                        name,
                        kind: nk,
                        perm,
                        uid: 0,
                        gid: 0,
                    },
                )
                .map(|r| match r {
                    ControlResponse::Attr(a) => Some(a.ino),
                    o => panic!("{o:?}"),
                });
                if let Ok(Some(i)) = got {
                    known.push(i);
                }
                (want, got)
            }
            Op::Link { ino, parent, name } => {
                let (ino, parent) = (pick(&known, ino), pick(&known, parent));
                (
                    m.link(ino, parent, &name).map(Some),
                    call(&mut svc, &st, MetaRequest::Link { ino, parent, name }).map(|r| match r {
                        ControlResponse::Attr(a) => Some(a.ino),
                        o => panic!("{o:?}"),
                    }),
                )
            }
            Op::Unlink { parent, name } => {
                let parent = pick(&known, parent);
                (
                    m.remove(parent, &name, false).map(|_| None),
                    call(
                        &mut svc,
                        &st,
                        MetaRequest::Unlink {
                            parent,
                            name,
                            release: None,
                        },
                    )
                    .map(|_| None),
                )
            }
            Op::Rmdir { parent, name } => {
                let parent = pick(&known, parent);
                (
                    m.remove(parent, &name, true).map(|_| None),
                    call(&mut svc, &st, MetaRequest::Rmdir { parent, name }).map(|_| None),
                )
            }
            Op::Rename {
                parent,
                name,
                new_parent,
                new_name,
                flags,
            } => {
                let (parent, new_parent) = (pick(&known, parent), pick(&known, new_parent));
                (
                    m.rename(parent, &name, new_parent, &new_name, flags)
                        .map(|_| None),
                    call(
                        &mut svc,
                        &st,
                        MetaRequest::Rename {
                            parent,
                            name,
                            new_parent,
                            new_name,
                            flags,
                        },
                    )
                    .map(|_| None),
                )
            }
            Op::SetAttr {
                ino,
                size,
                perm,
                uid,
            } => {
                let ino = pick(&known, ino);
                let set = SetAttr {
                    size,
                    perm,
                    uid,
                    ..SetAttr::default()
                };
                (
                    m.setattr(ino, size, perm, uid).map(|_| None),
                    call(&mut svc, &st, MetaRequest::SetAttr { ino, set }).map(|_| None),
                )
            }
            Op::AllocStripe { ino, stripe, end } => {
                let ino = pick(&known, ino);
                let got = call(&mut svc, &st, MetaRequest::AllocStripe { ino, stripe, end });
                if let Ok(ControlResponse::Stripe(r)) = &got {
                    // Every replica asked for, each on its own node, all under one tag.
                    let mut nodes: Vec<u32> = r.iter().map(|e| e.node).collect();
                    nodes.dedup();
                    prop_assert_eq!(nodes.len(), r.len(), "replicas share a node: {:?}", r);
                    prop_assert!(r.iter().all(|e| e.tag == r[0].tag && e.cap() >= end));
                    let want = m.replicas(ino);
                    prop_assert_eq!(r.len() as u64, want, "{:?}", r);
                }
                (
                    m.alloc_stripe(ino, stripe, end).map(|_| None),
                    got.map(|_| None),
                )
            }
            Op::Xattr {
                ino,
                name,
                value,
                flags,
            } => {
                let ino = pick(&known, ino);
                let want = m.xattr(ino, &name, value.as_deref(), flags).map(|_| None);
                let req = match value {
                    Some(value) => MetaRequest::SetXattr {
                        ino,
                        name,
                        value,
                        flags,
                    },
                    None => MetaRequest::RemoveXattr { ino, name },
                };
                (want, call(&mut svc, &st, req).map(|_| None))
            }
        };
        prop_assert_eq!(&got, &want, "{:?}", op);
        compare(&mut svc, &st, &m)?;
        standby.catch_up(&mut svc, &st)?;
    }
    let on_nodes: u64 = (0..3).map(|n| st.used(n)).sum::<u64>();
    let (lo, hi) = stripe_bytes(&m);
    // Each live stripe takes its extent and tag; each file a record.
    let files = m
        .inodes
        .values()
        .filter(|i| matches!(i.kind, MKind::File { .. }))
        .count() as u64;
    prop_assert!(
        on_nodes >= lo + files * 64,
        "{} bytes for stripes of at least {}",
        on_nodes,
        lo
    );
    // At most: also an extent table of 16 entries (of up to 3 slots) per file (stripe indices
    // stay below 16).
    prop_assert!(
        on_nodes <= hi + files * (64 + 3 * 16 * 16),
        "{} bytes for stripes of at most {}",
        on_nodes,
        hi
    );
    // Remove everything: every byte comes back (stripes, tables, records).
    remove_all(&mut svc, &st, &mut m, ROOT_INO)?;
    standby.catch_up(&mut svc, &st)?;
    prop_assert_eq!(
        (0..3).map(|n| st.used(n)).sum::<u64>(),
        0,
        "memory leaked after removing every file"
    );
    Ok(())
}

/// A standby following the service by its journal, from a snapshot taken when it attached:
/// after every step it must hold the same namespace and the same metadata-area bytes.
struct Standby {
    ns: Namespace,
    region: rackfs_verbs::Region,
    seq: u64,
}

impl Standby {
    fn follow(svc: &mut MetaService, st: &MemStorage) -> Standby {
        let seq = svc.set_journaling(true);
        let bytes = postcard::to_allocvec(&svc.namespace).unwrap();
        let region =
            rackfs_verbs::Region::create_memfd("standby", 1 << 30, 1, rackfs_verbs::Access::ALL)
                .unwrap();
        for (at, len) in svc.namespace.meta_extents() {
            let mut b = vec![0; len as usize];
            st.local().1.read(at, &mut b).unwrap();
            region.write(at, &b).unwrap();
        }
        Standby {
            ns: postcard::from_bytes(&bytes).unwrap(),
            region,
            seq,
        }
    }

    fn catch_up(&mut self, svc: &mut MetaService, st: &MemStorage) -> Result<(), TestCaseError> {
        for e in svc.take_journal() {
            prop_assert_eq!(e.seq, self.seq + 1, "journal entries in order");
            self.seq = e.seq;
            // Through the wire encoding, as a standby receives them.
            let e: rackfs_meta::Entry =
                postcard::from_bytes(&postcard::to_allocvec(&e).unwrap()).unwrap();
            if let Err(why) = rackfs_meta::journal::replay(&mut self.ns, &self.region, e) {
                return Err(TestCaseError::fail(why));
            }
        }
        prop_assert_eq!(
            postcard::to_allocvec(&self.ns).unwrap(),
            postcard::to_allocvec(&svc.namespace).unwrap(),
            "the standby's namespace differs from the primary's"
        );
        for (at, len) in svc.namespace.meta_extents() {
            let (mut mine, mut theirs) = (vec![0; len as usize], vec![0; len as usize]);
            st.local().1.read(at, &mut theirs).unwrap();
            self.region.read(at, &mut mine).unwrap();
            prop_assert_eq!(mine, theirs, "metadata-area bytes differ at {:#x}", at);
        }
        Ok(())
    }
}

fn remove_all(
    svc: &mut MetaService,
    st: &MemStorage,
    m: &mut Model,
    dir: u64,
) -> Result<(), TestCaseError> {
    let entries: Vec<(Vec<u8>, u64)> = m.entries(dir).unwrap().clone().into_iter().collect();
    for (name, ino) in entries {
        let is_dir = m.is_dir(ino);
        if is_dir {
            remove_all(svc, st, m, ino)?;
        }
        let req = if is_dir {
            MetaRequest::Rmdir {
                parent: dir,
                name: name.clone(),
            }
        } else {
            MetaRequest::Unlink {
                parent: dir,
                name: name.clone(),
                release: None,
            }
        };
        prop_assert_eq!(call(svc, st, req).map(|_| ()), m.remove(dir, &name, is_dir));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn namespace_matches_the_reference_model(ops in prop::collection::vec(op(), 1..60)) {
        run(ops)?;
    }
}

#[test]
fn a_hard_link_survives_the_rename_of_its_other_name() {
    run(vec![
        Op::Create {
            parent: 0,
            name: b"a".to_vec(),
            kind: 0,
        },
        Op::Link {
            ino: 1,
            parent: 0,
            name: b"b".to_vec(),
        },
        Op::Rename {
            parent: 0,
            name: b"a".to_vec(),
            new_parent: 0,
            new_name: b"b".to_vec(),
            flags: 0,
        },
        Op::Unlink {
            parent: 0,
            name: b"b".to_vec(),
        },
    ])
    .unwrap();
}

#[test]
fn an_exchange_moves_the_mtime_of_both_directories() {
    // As any rename, and as tmpfs and ext4 do for RENAME_EXCHANGE.
    let st = MemStorage::new(1, 1 << 20);
    let mut svc = MetaService::new(std::time::Duration::from_secs(2), st.wall_ns());
    let create = |svc: &mut MetaService, parent, name: &[u8], kind| {
        let req = MetaRequest::Create {
            parent,
            name: name.to_vec(),
            kind,
            perm: 0o755,
            uid: 0,
            gid: 0,
        };
        match call(svc, &st, req) {
            Ok(ControlResponse::Attr(a)) => a.ino,
            other => panic!("{other:?}"),
        }
    };
    let d = create(&mut svc, ROOT_INO, b"d", NewKind::Dir);
    create(&mut svc, ROOT_INO, b"a", NewKind::Dir);
    create(&mut svc, d, b"b", NewKind::Symlink(b"t".to_vec()));
    st.advance(std::time::Duration::from_secs(1));
    let exchange = MetaRequest::Rename {
        parent: ROOT_INO,
        name: b"a".to_vec(),
        new_parent: d,
        new_name: b"b".to_vec(),
        flags: RENAME_EXCHANGE,
    };
    assert_eq!(call(&mut svc, &st, exchange), Ok(ControlResponse::Ok));
    for dir in [ROOT_INO, d] {
        let a = attr(&mut svc, &st, dir).unwrap();
        assert_eq!(
            (a.mtime_ns, a.ctime_ns),
            (st.wall_ns(), st.wall_ns()),
            "{dir}"
        );
    }
}
