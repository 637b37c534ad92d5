//! The control RPC: the only path on which a memory node's CPU does work for a client.
//!
//! Requests and responses travel in `ControlRequest`/`ControlResponse` frames of the verbs wire
//! protocol ([`rackfs_verbs::wire`]) on an authenticated control connection, one response per
//! request, in order. A body is a request id and the message, encoded with `postcard` (compact,
//! versioned by the frame header); decoding is strict — unknown variants, short input and
//! trailing bytes are errors — so a malformed body closes the connection instead of panicking.
//!
//! The first request on every control connection is [`ControlRequest::Hello`] with the
//! client's [`PROTOCOL_VERSION`]; the node answers with its own and, when they differ, refuses
//! every later request with [`ErrorCode::Version`]. `Hello` is variant 0 of both enums in every
//! version, so the check itself never breaks.

use rackfs_verbs::wire::WireError;
use rackfs_verbs::VerbTotals;
use serde::{Deserialize, Serialize};

use crate::namespace::{Attr, Change, DirEntry, MetaRequest, StripeExtent};
use crate::space::{NodeSpace, Usable};

/// The version of this crate's contract: control messages and remote-memory formats. Bump it
/// on any change a peer of the previous version would misread.
pub const PROTOCOL_VERSION: u32 = 18;

/// The most extents one [`ControlRequest::FreeMany`] may name; a node refuses more.
pub const MAX_FREE_MANY: usize = 1024;

/// Names of the control RPC kinds, in [`ControlRequest::kind_index`] order, for counters.
pub const RPC_KINDS: [&str; 31] = [
    "hello",
    "ping",
    "stats",
    "alloc",
    "free",
    "cluster",
    "join",
    "zero",
    "meta",
    "baseline_range_lock",
    "baseline_range_unlock",
    "qos_shares",
    "qos_set",
    "qos_status",
    "resize",
    "session",
    "watch",
    "renew",
    "fence",
    "adopt",
    "node_failed",
    "node_admit",
    "retag",
    "pull",
    "coord",
    "mirror",
    "journal",
    "primary",
    "resolve",
    "alloc_many",
    "free_many",
];

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlRequest {
    /// The client's protocol version; must be the connection's first request.
    Hello {
        version: u32,
    },
    Ping,
    Stats,
    /// Allocate an extent of the data region. With a `tag`, the extent is a file stripe: its
    /// first 8 bytes hold the owner tag and the data starts [`crate::record::TAG_SPACE`] later;
    /// freeing it tombstones the tag and quarantines the memory before reuse.
    Alloc {
        len: u64,
        align: u64,
        tag: Option<u64>,
    },
    /// Free the extent that starts at `offset`. With `tag`, only if it is a live stripe
    /// extent with that owner tag (see [`ControlRequest::Retag`] for why).
    Free {
        offset: u64,
        tag: Option<u64>,
    },
    /// The cluster's nodes (answered by every node; only the primary knows them all).
    Cluster,
    /// A node offers its region to the cluster (sent to the primary). `epoch`: the node
    /// follows a primary that took over and keeps its memory, registered under this epoch
    /// (admitted as it is); `None`: a new, empty node.
    Join {
        node: NodeAddr,
        epoch: Option<i64>,
    },
    /// Zero `len` bytes at `offset` of an allocated extent (truncate's partial stripe); with
    /// `tag`, only if that extent is a live stripe with that owner tag.
    Zero {
        offset: u64,
        len: u64,
        tag: Option<u64>,
    },
    /// Move the file stripe extent at `offset` into a new one of `len` data bytes tagged `tag`
    /// on the same node: the old tag is tombstoned before its data is copied, and the old
    /// extent quarantined (see `crate::record`); only if the old extent is a live stripe
    /// tagged `expect`. Answered with the new extent.
    Resize {
        offset: u64,
        len: u64,
        tag: u64,
        expect: u64,
    },
    /// A namespace operation (primary only).
    Meta(MetaRequest),
    /// This connection's session id (to name it in [`ControlRequest::Watch`]).
    Session,
    /// Sent by a mount's watcher, on a connection of its own, to the primary: acknowledges
    /// the changes up to `acked` (its kernel has forgotten them), then waits (at most
    /// `poll_ms`) for namespace changes made by other sessions than `of` (the mount's main
    /// session). A change's operation returns only when every other watcher acknowledged it,
    /// or after that watcher's `ttl_ms` (its kernel cache timeout, after which it forgets
    /// anyway). Answered with [`ControlResponse::Changes`]. `dropped`: directories this
    /// mount no longer holds whole (see [`crate::namespace::Change::Created`]).
    Watch {
        of: u64,
        acked: u64,
        ttl_ms: u64,
        poll_ms: u64,
        dropped: Vec<u64>,
    },
    /// Sent by a mount that holds a lock client slot, on a connection of its own, to the
    /// primary: renews the lease of session `of` (the mount's main session). A mount whose lease
    /// runs out is fenced on every node and its range locks recovered; from then on its
    /// requests are refused with [`ErrorCode::Fenced`]. Answered with [`ControlResponse::Lease`].
    Renew {
        of: u64,
    },
    /// The primary to every node: execute nothing more from data connections opened under
    /// fence token `token` (a mount whose lease expired; see `rackfs_verbs::wire::Hello`), and
    /// refuse new ones. Answered once none of them can run another batch.
    Fence {
        token: u64,
    },
    /// Sent by a mount that was fenced, on its new session, to the primary: the files its
    /// fenced session `from` had open become this session's (a fenced session keeps its opens,
    /// so files unlinked meanwhile stay readable). Refused unless `from` was fenced.
    Adopt {
        from: u64,
    },
    /// Sent by a mount to the primary when data node `node` failed one of its writes: answered
    /// `Ok` once the node is declared dead and dropped from every stripe's replicas (a write
    /// then goes to the replicas left), refused with `Unavailable` while the node still
    /// answers the primary (the mount reconnects and writes again).
    NodeFailed {
        node: u32,
    },
    /// Sent by data node `node` to the primary once it holds a coordinator lease `epoch` under
    /// which it registered itself (`nodes/<id>`): take it (back) into the cluster under that
    /// epoch. A node declared dead gets its stale replicas freed first. The node serves data
    /// only from the answer on ([`ControlResponse::Lease`], its lease's ttl) and only while it
    /// keeps that lease alive with the coordinator (`rackfs_verbs::lease`).
    NodeAdmit {
        node: u32,
        epoch: i64,
    },
    /// The primary to a data node: give the stripe extent at `offset` the owner tag `tag`, in
    /// place (re-replication: a mount's write that found the old tag landed before this, and
    /// one that finds the new tag is redone on the new layout); only if its tag is `expect`.
    /// Every change the primary makes to a stripe extent names the tag it expects there: a
    /// primary that took over from a standby whose layout lacks a change its predecessor made
    /// (it died in it) must never touch memory the data node reused since.
    Retag {
        offset: u64,
        expect: u64,
        tag: u64,
    },
    /// The primary to a data node: copy `len` bytes from offset `from` of node `source`'s
    /// region (read one-sidedly over tcp from `source`'s address) to offset `to` of this one
    /// (re-replication of a stripe onto this node), only while the source extent's owner tag,
    /// at `from` less [`crate::record::TAG_SPACE`], reads `expect` before and after.
    Pull {
        source: String,
        from: u64,
        to: u64,
        len: u64,
        expect: u64,
    },
    /// A coordinator operation on the embedded coordinator (primary only; see
    /// [`crate::coord`]).
    Coord(crate::coord::CoordCall),
    /// Sent by the primary to the data node it makes its standby: one piece of a snapshot of
    /// the metadata service (see `rackfs_meta::journal`) standing at journal entry `seq`;
    /// pieces come in order, the last with `last`.
    Mirror {
        primary: u32,
        seq: u64,
        last: bool,
        piece: Vec<u8>,
    },
    /// Sent by the primary to its standby before it answers a change: journal entries
    /// (`rackfs_meta::Entry`s, encoded), which the standby replays in order.
    Journal {
        entries: Vec<u8>,
    },
    /// Lock units `[l, r)` of lock space `space` in the node's CPU-based range-lock table;
    /// answered when granted. The *baseline* Citron is measured against (every lock operation
    /// costs the node's CPU): a node serves it only when started with `--baseline-lock-server`
    /// and refuses it otherwise. Ranges a session holds are released when it disconnects.
    BaselineRangeLock {
        space: u64,
        l: u64,
        r: u64,
    },
    BaselineRangeUnlock {
        space: u64,
        l: u64,
        r: u64,
    },
    /// The primary's QoS controller to a node: the mounts' shares of this node from the next
    /// period on (slot, reservation, limit in tokens per period). Answered with the node's
    /// QoS status.
    QosShares {
        shares: Vec<(u16, u64, u64, u32)>,
    },
    /// Set a mount's QoS (primary only): `slot` of another mount's session (`rackfs qos set`),
    /// or `None` for the caller's own. IOPS = tokens per second; limit 0 = none. Admission
    /// control may refuse it.
    QosSet {
        slot: Option<u16>,
        reservation: u64,
        limit: u64,
        weight: u32,
    },
    /// Every mount's QoS and every node's periods (primary only).
    QosStatus,
    /// Sent by a primary on each connection it opens to a data node: the requests that follow
    /// speak for primary `node`, elected at `epoch` (its key's revision in the coordinator).
    /// A data node carries out a primary's actions (alloc, free, resize, zero, retag, pull,
    /// fence, mirror, journal) only on a connection of the newest epoch it has seen, so a
    /// deposed primary that resumes after a pause can no longer touch it.
    Primary {
        node: u32,
        epoch: u64,
    },
    /// A primary that took over to a data node: what it holds now where the primary's tables
    /// list each stripe extent (base offset, owner tag). The old primary may have moved or
    /// retagged extents in a change that died with it (its standby never had it). Answered
    /// with [`ControlResponse::Resolved`].
    Resolve {
        extents: Vec<ExtentAt>,
    },
    /// Allocate one file stripe extent of `len` data bytes per tag in `tags` (as
    /// [`ControlRequest::Alloc`] with that tag): a primary placing stripes ahead of need, in
    /// one round trip. Answered with [`ControlResponse::AllocatedMany`]: as many as fit, in the
    /// order asked.
    AllocMany {
        len: u64,
        tags: Vec<u64>,
    },
    /// Free stripe extents (base offset, owner tag), each as [`ControlRequest::Free`] with
    /// its tag: a primary's frees for one node in one round trip. Answered with
    /// [`ControlResponse::FreedMany`].
    FreeMany {
        extents: Vec<ExtentAt>,
    },
}

/// A stripe extent as a node holds it: (base offset, owner tag).
pub type ExtentAt = (u64, u64);

/// What a data node holds where a primary expects stripe extents
/// ([`ControlRequest::Resolve`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resolved {
    /// Each asked extent (base offset, tag) that no longer carries the tag asked, with where
    /// its data lives now (base offset, tag: moved to a new extent, or retagged in place), or
    /// `None`: the node holds it no more.
    pub changed: Vec<(ExtentAt, Option<ExtentAt>)>,
    /// Extents moved away whose old copy the node still holds (base offset, old tag): the
    /// primary frees each once no table lists it.
    pub moved: Vec<ExtentAt>,
}

impl ControlRequest {
    pub fn kind_index(&self) -> usize {
        match self {
            ControlRequest::Hello { .. } => 0,
            ControlRequest::Ping => 1,
            ControlRequest::Stats => 2,
            ControlRequest::Alloc { .. } => 3,
            ControlRequest::Free { .. } => 4,
            ControlRequest::Cluster => 5,
            ControlRequest::Join { .. } => 6,
            ControlRequest::Zero { .. } => 7,
            ControlRequest::Meta(_) => 8,
            ControlRequest::BaselineRangeLock { .. } => 9,
            ControlRequest::BaselineRangeUnlock { .. } => 10,
            ControlRequest::QosShares { .. } => 11,
            ControlRequest::QosSet { .. } => 12,
            ControlRequest::QosStatus => 13,
            ControlRequest::Resize { .. } => 14,
            ControlRequest::Session => 15,
            ControlRequest::Watch { .. } => 16,
            ControlRequest::Renew { .. } => 17,
            ControlRequest::Fence { .. } => 18,
            ControlRequest::Adopt { .. } => 19,
            ControlRequest::NodeFailed { .. } => 20,
            ControlRequest::NodeAdmit { .. } => 21,
            ControlRequest::Retag { .. } => 22,
            ControlRequest::Pull { .. } => 23,
            ControlRequest::Coord(_) => 24,
            ControlRequest::Mirror { .. } => 25,
            ControlRequest::Journal { .. } => 26,
            ControlRequest::Primary { .. } => 27,
            ControlRequest::Resolve { .. } => 28,
            ControlRequest::AllocMany { .. } => 29,
            ControlRequest::FreeMany { .. } => 30,
        }
    }
}

/// Where a node can be reached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAddr {
    pub node_id: u32,
    pub name: String,
    /// `host:port` of its TCP listener.
    pub tcp: Option<String>,
    /// Path of its Unix socket (usable only on the same host).
    pub shm: Option<String>,
    pub capacity: u64,
    /// Offset of the node's QoS area in its data region.
    pub qos_area: u64,
    /// How long the node holds freed file stripes back from reuse (ms). A mount writes to a
    /// cached stripe without first re-checking its tag only within half of this since it last
    /// saw the tag match (see `rackfs_proto::record`).
    pub quarantine_ms: u64,
    /// The node's failure domain (a rack, a host, a power feed): replicas of a stripe go to
    /// different domains while there are enough (`None`: a domain of its own).
    pub domain: Option<String>,
}

/// The cluster as a node knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterInfo {
    /// The primary (metadata service).
    pub primary: NodeAddr,
    /// Every data node, the primary included, by id.
    pub nodes: Vec<NodeAddr>,
    /// Nodes the primary cannot reach, with why: their files return EIO and new data goes
    /// elsewhere. Empty on a healthy cluster.
    pub down: Vec<(u32, String)>,
    /// Where membership, leases and the election live (etcd, or embedded in the primary).
    pub coordinator: String,
    /// Whether another node can be elected primary when this one dies (the coordinator is
    /// etcd): mounts then wait for a new primary instead of failing.
    pub elects: bool,
    /// Mount sessions holding a lock lease (on the coordinator: `mounts/<session>`).
    pub mounts: Vec<u64>,
    /// The epoch each data node was admitted under (its lease with the coordinator), by id.
    pub epochs: Vec<(u32, i64)>,
    /// The data node whose mirror of the metadata is in sync (etcd only; `None`: the primary's
    /// death would lose the namespace).
    pub standby: Option<u32>,
}

/// Error classes a node reports; each error response also carries a full message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    OutOfMemory,
    Invalid,
    NotFound,
    Exists,
    NotEmpty,
    NotDir,
    IsDir,
    NameTooLong,
    TooBig,
    Permission,
    NotPrimary,
    Unavailable,
    Internal,
    /// Admission control refused a QoS request.
    Refused,
    /// The peer speaks another protocol version.
    Version,
    /// The mount's lease expired and it was fenced: it must be mounted again.
    Fenced,
    /// No such extended attribute.
    NoData,
    /// A name too long, or an answer larger than the caller's buffer.
    Range,
    /// An extended attribute value too large.
    ValueTooBig,
    /// An operation or attribute namespace RackFS does not support.
    NotSupported,
}

impl ErrorCode {
    /// The errno a filesystem returns for this error.
    pub fn errno(self) -> i32 {
        match self {
            ErrorCode::OutOfMemory => libc::ENOSPC,
            ErrorCode::Invalid => libc::EINVAL,
            ErrorCode::NotFound => libc::ENOENT,
            ErrorCode::Exists => libc::EEXIST,
            ErrorCode::NotEmpty => libc::ENOTEMPTY,
            ErrorCode::NotDir => libc::ENOTDIR,
            ErrorCode::IsDir => libc::EISDIR,
            ErrorCode::NameTooLong => libc::ENAMETOOLONG,
            ErrorCode::TooBig => libc::EFBIG,
            ErrorCode::Permission => libc::EPERM,
            ErrorCode::Refused => libc::EDQUOT,
            ErrorCode::Version => libc::EPROTO,
            ErrorCode::NoData => libc::ENODATA,
            ErrorCode::Range => libc::ERANGE,
            ErrorCode::ValueTooBig => libc::E2BIG,
            ErrorCode::NotSupported => libc::EOPNOTSUPP,
            ErrorCode::NotPrimary
            | ErrorCode::Unavailable
            | ErrorCode::Internal
            | ErrorCode::Fenced => libc::EIO,
        }
    }
}

/// Everything a node reports about itself.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStats {
    pub node_id: u32,
    pub name: String,
    pub uptime_ms: u64,
    pub capacity: u64,
    /// Bytes allocated, including extents waiting in quarantine.
    pub used: u64,
    pub free: u64,
    pub largest_free: u64,
    pub extents: u64,
    /// Bytes freed but held back from reuse (quarantine) until stale readers are gone.
    pub quarantined: u64,
    /// Bytes of lock trees (published and retired) and trees replaced by recovery (primary).
    pub lock_trees: u64,
    pub lock_recoveries: u64,
    /// The files' data health (primary only; see [`DataHealth`]).
    pub health: DataHealth,
    /// Verbs served by NIC threads and executed by shm clients, by opcode.
    pub verbs: VerbTotals,
    /// Control RPCs served, by kind ([`RPC_KINDS`]).
    pub rpcs: [u64; RPC_KINDS.len()],
    /// Open connections by kind: verbs, control, shm, rdma.
    pub open: [u64; 4],
    /// The RDMA device the node serves on and how it does atomics (`None`: no RDMA).
    pub rdma: Option<String>,
    pub connections_total: u64,
    pub auth_failures: u64,
    pub protocol_errors: u64,
    /// Journal entries replayed on this node's mirror (metadata standby).
    pub journal_entries: u64,
}

/// How whole the files' data is, and how far re-replication got (the primary's view).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataHealth {
    pub files: u64,
    /// Files with a stripe below its replication factor (still readable and writable).
    pub degraded_files: u64,
    /// Files with a stripe none of whose replicas is on a live node (EIO there).
    pub unavailable_files: u64,
    /// Stripes below their replication factor, waiting to be copied.
    pub degraded_stripes: u64,
    /// Stripes copied back to their replication factor since the primary started.
    pub rebuilt_stripes: u64,
    pub rebuilt_bytes: u64,
}

/// One finished QoS period of one node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QosPeriod {
    pub period: u64,
    /// Tokens the period had (the capacity estimate).
    pub capacity: u64,
    pub pool_start: u64,
    pub converted: u64,
    /// Per mount: slot, reservation share, tokens spent, of them from the pool, tokens asked.
    pub mounts: Vec<(u16, u64, u64, u64, u64)>,
}

/// A node's QoS state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QosNodeStatus {
    pub node_id: u32,
    pub period_ms: u64,
    /// Capacity estimate, tokens per period.
    pub capacity: u64,
    /// Whether the capacity was profiled (`--qos-capacity`) or assumed.
    pub profiled: bool,
    /// The most one mount can do, IOPS (admission's local constraint).
    pub client_iops: u64,
    /// The last periods, oldest first.
    pub periods: Vec<QosPeriod>,
}

/// A mount's QoS as the primary admitted it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QosMount {
    pub slot: u16,
    pub reservation: u64,
    pub limit: u64,
    pub weight: u32,
    /// Its reservation share per node (tokens per period), as pShift placed it.
    pub shares: Vec<(u32, u64)>,
    /// Per node, the last period finished before this mount took the slot: earlier periods
    /// of the slot were another mount's.
    pub since: Vec<(u32, u64)>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QosStatus {
    pub mounts: Vec<QosMount>,
    pub nodes: Vec<QosNodeStatus>,
}

/// Filesystem-wide capacity, for `statfs` and `rackfs status`: the raw figures, summed over
/// the data nodes that take new data, and each node's, from which a mount works out what its
/// files can fill ([`FsStat::usable`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsStat {
    /// Sum of the nodes' memory for file data (their regions past the metadata areas).
    pub capacity: u64,
    /// Sum of their free memory, quarantined memory included.
    pub free: u64,
    pub files: u64,
    /// The replica count a new file gets when its mount does not ask (the cluster's default,
    /// at most its nodes).
    pub replicas: u32,
    /// Each node's share of `capacity` and `free`.
    pub nodes: Vec<NodeSpace>,
}

impl FsStat {
    /// What files of `replicas` copies (0: the cluster's default) and `stripe_unit`-byte
    /// stripes can fill (see [`crate::space`]).
    pub fn usable(&self, replicas: u32, stripe_unit: u64) -> Usable {
        let r = if replicas == 0 {
            self.replicas
        } else {
            replicas
        };
        crate::space::usable(&self.nodes, r, stripe_unit)
    }
}

/// A request the node refused: the error class and a message saying why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{message}")]
pub struct Refusal {
    pub code: ErrorCode,
    pub message: String,
}

impl Refusal {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Refusal {
        Refusal {
            code,
            message: message.into(),
        }
    }
}

impl From<Refusal> for ControlResponse {
    fn from(r: Refusal) -> ControlResponse {
        ControlResponse::Error {
            code: r.code,
            message: r.message,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlResponse {
    Ok,
    /// The node accepts the client's protocol version.
    Hello {
        version: u32,
    },
    Pong,
    Stats(Box<NodeStats>),
    Allocated {
        rkey: u32,
        region_len: u64,
        offset: u64,
        len: u64,
    },
    Freed {
        len: u64,
    },
    Cluster(Box<ClusterInfo>),
    Attr(Attr),
    Entries(Vec<DirEntry>),
    Target(Vec<u8>),
    /// A stripe's replicas (at least one).
    Stripe(Vec<StripeExtent>),
    FsStat(FsStat),
    LockSlot(u16),
    LockTree(u64),
    /// An extended attribute's value, or a list of names.
    Xattr(Vec<u8>),
    /// A file's record-lock table: its offset in the primary's region.
    RecordLocks(u64),
    QosNode(QosNodeStatus),
    /// The mount's slot and its admitted QoS.
    QosGranted {
        slot: u16,
        reservation: u64,
        limit: u64,
    },
    QosStatus(QosStatus),
    Session {
        id: u64,
    },
    /// The lease was renewed for `ms` from the request's arrival.
    Lease {
        ms: u64,
    },
    /// A coordinator operation's answer.
    Coord(crate::coord::CoordAnswer),
    /// Changes for a watcher, numbered up to `seq` (acknowledge with that). `lost`: changes
    /// were dropped because the watcher lagged (its caches expire on their own).
    Changes {
        seq: u64,
        changes: Vec<Change>,
        lost: bool,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
    /// A file made and opened by [`crate::namespace::MetaRequest::CreateOpen`].
    Created(Box<crate::namespace::Created>),
    /// Directory entries with their attributes
    /// ([`crate::namespace::MetaRequest::ReadDirPlus`]).
    EntriesPlus(Vec<(DirEntry, Attr)>),
    /// See [`ControlRequest::Resolve`].
    Resolved(Resolved),
    /// The base offsets of the extents a [`ControlRequest::AllocMany`] allocated.
    AllocatedMany {
        offsets: Vec<u64>,
    },
    /// The extents of a [`ControlRequest::FreeMany`] the node did not free (base offset, why);
    /// the others it freed.
    FreedMany {
        refused: Vec<(u64, String)>,
    },
    /// See [`crate::namespace::MetaRequest::SizeAtTakeOver`].
    SizeAtTakeOver(Option<u64>),
    /// The attributes, after the release, of the files a
    /// [`crate::namespace::MetaRequest::Releases`] named that still exist.
    Released(Vec<Attr>),
}

fn encode<T: Serialize>(id: u64, msg: &T) -> Vec<u8> {
    let mut b = id.to_le_bytes().to_vec();
    b.extend(postcard::to_stdvec(msg).expect("control messages serialize"));
    b
}

fn decode<'a, T: Deserialize<'a>>(
    body: &'a [u8],
    what: &'static str,
) -> Result<(u64, T), WireError> {
    if body.len() < 8 {
        return Err(WireError::malformed(what, "shorter than its request id"));
    }
    let id = u64::from_le_bytes(body[..8].try_into().expect("8 bytes"));
    let (msg, rest) = postcard::take_from_bytes(&body[8..])
        .map_err(|e| WireError::malformed(what, e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::malformed(
            what,
            format!("{} trailing bytes", rest.len()),
        ));
    }
    Ok((id, msg))
}

impl ControlRequest {
    pub fn encode(&self, id: u64) -> Vec<u8> {
        encode(id, self)
    }
    pub fn decode(body: &[u8]) -> Result<(u64, ControlRequest), WireError> {
        decode(body, "control request")
    }
}

impl ControlResponse {
    pub fn encode(&self, id: u64) -> Vec<u8> {
        encode(id, self)
    }
    pub fn decode(body: &[u8]) -> Result<(u64, ControlResponse), WireError> {
        decode(body, "control response")
    }

    pub fn error(code: ErrorCode, message: impl Into<String>) -> ControlResponse {
        ControlResponse::Error {
            code,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn requests_round_trip(id: u64, len: u64, align: u64, tag: Option<u64>, which in 0u8..6) {
            let req = match which {
                0 => ControlRequest::Ping,
                1 => ControlRequest::Stats,
                2 => ControlRequest::Alloc { len, align, tag },
                3 => ControlRequest::Free { offset: len, tag },
                4 => ControlRequest::Hello { version: len as u32 },
                _ => ControlRequest::Meta(MetaRequest::Lookup { parent: len, name: align.to_le_bytes().to_vec() }),
            };
            prop_assert_eq!(ControlRequest::decode(&req.encode(id)).unwrap(), (id, req));
        }

        #[test]
        fn stats_round_trip(id: u64, words in proptest::collection::vec(any::<u64>(), 64), name in ".{0,30}") {
            let s = NodeStats {
                node_id: words[0] as u32, name, uptime_ms: words[1], capacity: words[2], used: words[3],
                free: words[4], largest_free: words[5], extents: words[6], quarantined: words[7],
                lock_trees: words[8], lock_recoveries: words[9],
                health: DataHealth { files: words[40], degraded_files: words[41], unavailable_files: words[42], degraded_stripes: words[43], rebuilt_stripes: words[44], rebuilt_bytes: words[45] },
                verbs: VerbTotals { ops: words[10..16].try_into().unwrap(), bytes: words[16..22].try_into().unwrap(), errors: words[22], batches: words[23] },
                rpcs: words[24..24 + RPC_KINDS.len()].try_into().unwrap(), open: words[40..44].try_into().unwrap(),
                rdma: (words[48] % 2 == 1).then(|| format!("rxe{}", words[46])),
                connections_total: words[43], auth_failures: words[44], protocol_errors: words[45], journal_entries: words[47],
            };
            let r = ControlResponse::Stats(Box::new(s));
            prop_assert_eq!(ControlResponse::decode(&r.encode(id)).unwrap(), (id, r));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = ControlRequest::decode(&bytes);
            let _ = ControlResponse::decode(&bytes);
        }
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let mut b = ControlRequest::Ping.encode(1);
        b.push(0);
        assert!(ControlRequest::decode(&b).is_err());
        assert!(ControlRequest::decode(&[1, 2, 3]).is_err());
    }
}
