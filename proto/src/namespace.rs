//! Namespace messages: the requests a mount sends to the metadata service and the attributes,
//! directory entries and stripe extents it gets back.

use serde::{Deserialize, Serialize};

/// The root directory's inode number.
pub const ROOT_INO: u64 = 1;
/// Largest file size (EFBIG beyond).
pub const MAX_FILE_SIZE: u64 = 1 << 46;
pub const MAX_NAME: usize = 255;
/// Stripe units allowed: multiples of 4 KiB from 4 KiB to 64 MiB.
pub const MAX_STRIPE_UNIT: u64 = 64 << 20;
/// The stripe unit of files whose mount does not set `stripe_unit=`.
pub const DEFAULT_STRIPE_UNIT: u64 = 1 << 20;

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
    /// A regular file with `replicas` copies of every stripe (0: the cluster's default).
    File {
        stripe_unit: u64,
        replicas: u32,
    },
    Dir,
    Symlink(Vec<u8>),
    Special {
        kind: Kind,
        rdev: u32,
    },
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
    /// Bytes of node memory holding the file's data (its stripe extents' capacities).
    pub allocated: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetAttr {
    pub perm: Option<u16>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime_ns: Option<u64>,
    pub mtime_ns: Option<u64>,
    /// Clear set-user-ID, and set-group-ID if group execute is set (a write by an
    /// unprivileged process), from the mode the service holds now.
    pub kill_suidgid: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// Position in the directory: stable while the entry exists, never reused.
    pub cookie: u64,
    pub ino: u64,
    pub kind: Kind,
    pub name: Vec<u8>,
}

/// A namespace change that other mounts' kernels must forget what they cached of, pushed to
/// their watchers (`ControlRequest::Watch`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// The name `name` in directory `parent` went away or now names another inode.
    Entry { parent: u64, name: Vec<u8> },
    /// The inode's attributes changed (mode, owner, size, link count, times).
    Inode { ino: u64 },
    /// The inode's blocks changed (an allocation, a last close's trim, a re-replication), and
    /// nothing else: pushed without waiting, and its cached data stays.
    Blocks { ino: u64 },
    /// The name `name` now exists in directory `parent`. Pushed only to the mounts that hold
    /// `parent` whole (they made it, and answer lookups of names they do not know there as
    /// absent without asking the primary).
    Created { parent: u64, name: Vec<u8> },
}

/// One allocated stripe: data at `offset` on `node`, tag at `offset -` [`crate::record::TAG_SPACE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StripeExtent {
    pub node: u32,
    pub offset: u64,
    pub tag: u64,
}

impl StripeExtent {
    /// Data bytes the extent holds; the stripe's bytes beyond it read as zeros.
    pub fn cap(&self) -> u64 {
        crate::record::tag_capacity(self.tag)
    }
}

/// Longest extended attribute name (Linux `XATTR_NAME_MAX`): ERANGE beyond.
pub const XATTR_NAME_MAX: usize = 255;
/// Largest extended attribute value (Linux `XATTR_SIZE_MAX`): E2BIG beyond.
pub const XATTR_SIZE_MAX: usize = 65536;
/// Most bytes of names (each with its NUL) one inode's attributes may have, so a list always
/// fits Linux's `XATTR_LIST_MAX`; and most bytes of names and values together. ENOSPC beyond.
pub const XATTR_LIST_MAX: usize = 65536;
pub const XATTR_TOTAL_MAX: usize = 256 << 10;
/// `setxattr` flags: fail if the attribute exists / does not exist.
pub const XATTR_CREATE: u32 = 1;
pub const XATTR_REPLACE: u32 = 2;

/// `fallocate` modes RackFS supports (Linux's values): keep the size, punch a hole (with
/// [`FALLOC_KEEP_SIZE`]), zero a range.
pub const FALLOC_KEEP_SIZE: u32 = 0x01;
pub const FALLOC_PUNCH_HOLE: u32 = 0x02;
pub const FALLOC_ZERO_RANGE: u32 = 0x10;

pub const RENAME_NOREPLACE: u32 = 1;
pub const RENAME_EXCHANGE: u32 = 2;

/// A record lock (`fcntl`, OFD or `flock`) as a mount reclaims it after a failover.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReclaimedLock {
    pub owner: u64,
    pub pid: u32,
    pub host: u16,
    pub start: u64,
    /// Exclusive; `u64::MAX`: to the end of file and beyond.
    pub end: u64,
    pub exclusive: bool,
}

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
    /// Removes a name (answered with the directory's attributes after the change). With
    /// `release`, the session first gives back one open of that file, one it kept past its
    /// last close (see [`MetaRequest::Releases`]): a file the mount kept and now removes is
    /// freed when the removal returns.
    Unlink {
        parent: u64,
        name: Vec<u8>,
        release: Option<u64>,
    },
    /// Removes an empty directory (answered like [`MetaRequest::Unlink`]).
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
    /// A mount opened the file: it is kept, even unlinked, until released. Answered with its
    /// attributes.
    Open {
        ino: u64,
    },
    /// Make stripe `stripe` of a file hold at least its first `end` bytes (allocating it if
    /// it is a hole, growing its extents if they are smaller); returns its replicas' extents.
    AllocStripe {
        ino: u64,
        stripe: u64,
        end: u64,
    },
    /// Stripe `stripe`'s replicas (none: a hole), answered after any move of it in progress.
    GetStripe {
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
    /// What a mount wrote to a file it has open, reported again to a primary that took over
    /// (the size and mtime words it wrote one-sidedly to the old one): the size grows to at
    /// least `size`, the mtime to at least `mtime`.
    Settle {
        ino: u64,
        size: u64,
        mtime: u64,
    },
    /// File `ino`'s size as this primary's mirror held it when it took over, before any
    /// mount wrote or reported a size to it (`None`: it did not take over, or a while ago).
    /// A mount whose `O_APPEND` write was in flight when the old primary died asks: the
    /// write landed, as far as the filesystem knows, exactly when that size covers it.
    SizeAtTakeOver {
        ino: u64,
    },
    /// Set extended attribute `name` (with its namespace prefix, e.g. `user.`) to `value`;
    /// `flags` are [`XATTR_CREATE`] or [`XATTR_REPLACE`].
    SetXattr {
        ino: u64,
        name: Vec<u8>,
        value: Vec<u8>,
        flags: u32,
    },
    /// An extended attribute's value (answered with `ControlResponse::Xattr`).
    GetXattr {
        ino: u64,
        name: Vec<u8>,
    },
    /// The inode's extended attribute names, each followed by a NUL, as `listxattr(2)` gives
    /// them (answered with `ControlResponse::Xattr`).
    ListXattr {
        ino: u64,
    },
    RemoveXattr {
        ino: u64,
        name: Vec<u8>,
    },
    /// `fallocate(2)` on bytes `[offset, offset + len)` of a file, which the caller holds the
    /// whole-file range lock of. `mode` 0 allocates every stripe of the range (ENOSPC now
    /// rather than at a later write) and grows the size to its end; [`FALLOC_KEEP_SIZE`]
    /// keeps the size; [`FALLOC_PUNCH_HOLE`] frees the stripes wholly inside the range and
    /// zeroes the rest of it; [`FALLOC_ZERO_RANGE`] allocates and zeroes it.
    Fallocate {
        ino: u64,
        offset: u64,
        len: u64,
        mode: u32,
    },
    /// The file's record-lock table (`rackfs_locks::record`), made on first use: answered
    /// with `ControlResponse::RecordLocks` (its offset in the primary's region).
    RecordLocks {
        ino: u64,
    },
    /// Locks this mount's processes held on a file under the primary that died, asserted
    /// again to the one that took over, during its grace period (when no other lock may be
    /// taken); refused once the grace period is over.
    ReclaimLocks {
        ino: u64,
        locks: Vec<ReclaimedLock>,
    },
    /// `req` again, sent by a mount to a primary that took over, on behalf of its session
    /// `from` of the old primary (whose answer was lost): if the old primary made that change
    /// (the standby replayed it among `from`'s last ones: mounts send changes
    /// [`MetaRequest::Numbered`], so it is that very request), its answer is returned, not
    /// made twice. A mount that must ask again once more (its answer lost again) wraps this
    /// retry in another: the primary looks in every session the request went through.
    Retry {
        from: u64,
        #[serde(deserialize_with = "wrapped")]
        req: Box<MetaRequest>,
    },
    /// The mount closed these files for the last time: `inos` gives one registered open of
    /// each back, `kept` keeps it (the mount reopens the file without asking, and gives the
    /// open back later). Either settles what the mount wrote and, when no other open of the
    /// file is left (the kept one aside), trims its last extent. A mount sends its last closes
    /// in batches. Answered with `ControlResponse::Released` (the files' attributes after it).
    Releases {
        inos: Vec<u64>,
        kept: Vec<u64>,
    },
    /// A regular file's `open(O_CREAT)` in one round trip: [`MetaRequest::Create`], then an
    /// open by the caller's session, then (if `reserve` > 0) stripe 0 placed for its first
    /// `reserve` bytes and (if `lock_units` > 0) its lock tree published for that many units.
    /// Answered with `ControlResponse::Created`; a failure after the create (no memory for
    /// the stripe) leaves that part out, for the mount to ask later.
    CreateOpen {
        parent: u64,
        name: Vec<u8>,
        stripe_unit: u64,
        replicas: u32,
        perm: u16,
        uid: u32,
        gid: u32,
        reserve: u64,
        lock_units: u64,
    },
    /// [`MetaRequest::ReadDir`] with each entry's attributes (for the kernel's readdirplus,
    /// which then needs no lookup per name); answered with `ControlResponse::EntriesPlus`.
    ReadDirPlus {
        ino: u64,
        after: u64,
        max: u32,
    },
    /// `req`, numbered uniquely within the mount: a retry of it ([`MetaRequest::Retry`]) is
    /// matched to it alone, never to an equal request the session made before (a mount opens
    /// the same file many times, and an open answered twice is an open counted once).
    Numbered {
        id: u64,
        #[serde(deserialize_with = "wrapped")]
        req: Box<MetaRequest>,
    },
}

/// How deep [`MetaRequest::Retry`] and [`MetaRequest::Numbered`] may wrap requests in a
/// decoded message: a mount wraps at most four times (a numbered request in up to three
/// retries, one per failover it follows, see [`MetaRequest::Retry`]). Deeper is refused before decoding recurses further, so a crafted frame cannot exhaust a node's
/// stack.
pub const MAX_WRAPPING: u32 = 4;

std::thread_local! {
    static WRAPPING: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Decodes a wrapped request, counting the wrapping on this thread (see [`MAX_WRAPPING`]).
fn wrapped<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Box<MetaRequest>, D::Error> {
    struct Unwrap;
    impl Drop for Unwrap {
        fn drop(&mut self) {
            WRAPPING.with(|w| w.set(w.get() - 1));
        }
    }
    let depth = WRAPPING.with(|w| {
        w.set(w.get() + 1);
        w.get()
    });
    let _unwrap = Unwrap;
    if depth > MAX_WRAPPING {
        return Err(serde::de::Error::custom(format!(
            "a request wrapped more than {MAX_WRAPPING} deep (retries and numbers)"
        )));
    }
    MetaRequest::deserialize(d).map(Box::new)
}

impl MetaRequest {
    /// The request itself, without its number ([`MetaRequest::Numbered`]).
    pub fn inner(&self) -> &MetaRequest {
        match self {
            MetaRequest::Numbered { req, .. } => req.inner(),
            r => r,
        }
    }
}

/// The answer to [`MetaRequest::CreateOpen`]: the new file, its directory's attributes after
/// the change, stripe 0's replicas (empty if none was placed) and the published lock-tree
/// word (0 for none).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Created {
    pub attr: Attr,
    pub parent: Attr,
    pub stripe: Vec<StripeExtent>,
    pub lock_tree: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `req` wrapped `depth` times, alternating retries and numbers.
    fn wrapped_in(depth: u32) -> MetaRequest {
        (0..depth).fold(MetaRequest::StatFs, |req, k| match k % 2 {
            0 => MetaRequest::Numbered {
                id: k as u64,
                req: Box::new(req),
            },
            _ => MetaRequest::Retry {
                from: 7,
                req: Box::new(req),
            },
        })
    }

    #[test]
    fn requests_wrapped_deeper_than_a_mount_wraps_them_are_refused_when_decoded() {
        for depth in 0..=MAX_WRAPPING {
            let bytes = postcard::to_allocvec(&wrapped_in(depth)).unwrap();
            let back: MetaRequest = postcard::from_bytes(&bytes).unwrap();
            assert_eq!(back, wrapped_in(depth));
        }
        let deep = postcard::to_allocvec(&wrapped_in(MAX_WRAPPING + 1)).unwrap();
        let err = postcard::from_bytes::<MetaRequest>(&deep).unwrap_err();
        assert!(matches!(err, postcard::Error::SerdeDeCustom), "{err:?}");
        // A crafted frame a million wraps deep (two bytes each: a retry with `from` 0) is
        // refused without recursing through it; the count is back to 0 afterwards.
        let mut crafted = Vec::new();
        let retry = postcard::to_allocvec(&MetaRequest::Retry {
            from: 0,
            req: Box::new(MetaRequest::StatFs),
        })
        .unwrap();
        let stat = postcard::to_allocvec(&MetaRequest::StatFs).unwrap();
        let head = &retry[..retry.len() - stat.len()];
        for _ in 0..1_000_000 {
            crafted.extend_from_slice(head);
        }
        crafted.extend_from_slice(&stat);
        assert!(postcard::from_bytes::<MetaRequest>(&crafted).is_err());
        let two = postcard::to_allocvec(&wrapped_in(2)).unwrap();
        assert!(postcard::from_bytes::<MetaRequest>(&two).is_ok());
    }
}
