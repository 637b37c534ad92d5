//! The data path of one regular file: one-sided reads and writes straight to its stripes.
//!
//! A mount caches a file's layout (the extent table's address and, per stripe it has seen, its
//! replicas). A write goes to every replica of each stripe it touches and returns when all
//! hold it; a read goes to one ([`crate::replica`] chooses). A node that fails a read is
//! avoided and another replica read. A node that fails a write is reported to the primary
//! (`ControlRequest::NodeFailed`), which answers once the node's lease has lapsed and it is
//! dropped from the replicas (so it serves nothing stale); the write is then redone on the
//! replicas left. An entry marked moving (`TAG_MOVING`: the service is moving or copying the
//! stripe) is asked of the service, which answers once the move is done.
//! Every batch that touches a stripe reads the stripe's owner tag after its data ops, on the
//! same queue pair, so the check executes after them; a mismatch means the stripe was freed
//! (truncate, unlink) or moved to a larger extent elsewhere, and the operation is redone with a
//! fresh layout (see `rackfs_proto::record`). A stripe's extent may hold fewer bytes than the
//! stripe unit: reads beyond it are zeros, and a write beyond it first asks the service to grow
//! it. A write to a stripe not seen live within half its node's
//! quarantine checks the tag in a batch of its own first: by then the node may have reused
//! the memory, and a write in the same batch as the check would land before the check fails. The file size lives in the file record on the primary and only
//! grows by CAS-max, so concurrent extending writes from different mounts never lose size.
//! In steady state (layout cached, stripes allocated) reads and writes make no control RPC.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::Duration;

use rackfs_proto::control::{ControlResponse, ErrorCode};
use rackfs_proto::namespace::{FileLayout, MetaRequest, StripeExtent, MAX_FILE_SIZE};
use rackfs_proto::record::{
    entry_offset, split_location, ENTRY_LEN, RECORD_LEN, REC_INO, REC_MTIME, REC_REPLICAS,
    REC_SIZE, REC_TABLE, REC_TABLE_CAP, TAG_MOVING, TAG_SPACE,
};
use rackfs_proto::RpcError;
use rackfs_verbs::{Batch, Completions, RemoteAddr, VerbsError, WrId};
use rustc_hash::FxHashMap;

use crate::cluster::Cluster;
use crate::layout::{pieces, Piece};
use crate::lock::{self, FileLocks};
use rackfs_qos::area::tokens_for;
use rackfs_qos::engine::InFlight;

/// Attempts an operation that keeps meeting stale layouts makes at once.
const MAX_ATTEMPTS: usize = 16;

/// How long an operation that keeps meeting stale layouts goes on (pausing between attempts)
/// before it gives up with EIO: a primary that took over lists a stripe its predecessor moved
/// in its last change at the stripe's new place only once the stripe's node follows it,
/// within a node lease or so.
const STALE_PATIENCE: Duration = Duration::from_secs(4);

/// Why an operation tried again (counted, and logged if it retried long).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Met {
    /// The primary failed it and came back in the operation's session.
    PrimaryBack,
    /// The file's extent table grew or moved while it was read.
    TableMoved,
    /// No replica of a stripe could be read yet (their nodes failed it).
    NoReplicaYet,
    /// A replica's node failed the data operation.
    ReplicaFailed,
    /// A node's QoS area could not be reached.
    QosAreaFailed,
    /// A stripe's tag was not the one the layout named.
    StaleLayout,
    /// No node could take a stripe yet.
    NotPlaced,
    /// A cached stripe was evicted (or shrank) meanwhile.
    Evicted,
}

/// The attempts of one operation: [`MAX_ATTEMPTS`] at once, then with pauses growing to
/// 50 ms while less than [`STALE_PATIENCE`] has passed since it started.
struct Attempts<'a> {
    cl: &'a Cluster,
    made: usize,
    started: u64,
    /// What made the operation try again, and how often (logged if it gives up).
    met: Vec<(Met, u32)>,
}

impl<'a> Attempts<'a> {
    fn new(cl: &'a Cluster) -> Attempts<'a> {
        Attempts {
            cl,
            made: 0,
            started: cl.clock().mono_ns(),
            met: Vec::new(),
        }
    }

    /// The operation tries again because of `why`.
    fn met(&mut self, why: Met) {
        match self.met.iter_mut().find(|m| m.0 == why) {
            Some(m) => m.1 += 1,
            None => self.met.push((why, 1)),
        }
    }

    /// Whether there is time left for more attempts.
    fn patient(&self) -> bool {
        let spent = self.cl.clock().mono_ns().saturating_sub(self.started);
        spent < STALE_PATIENCE.as_nanos() as u64
    }

    /// Whether to make another attempt (after a pause, past the first few).
    fn next(&mut self) -> bool {
        self.made += 1;
        if self.made <= MAX_ATTEMPTS {
            return true;
        }
        if !self.patient() {
            return false;
        }
        let pause = 1u64 << (self.made - MAX_ATTEMPTS).min(6);
        self.cl.clock().sleep(Duration::from_millis(pause.min(50)));
        true
    }

    /// The operation gives up: EIO, logged with what it kept meeting.
    fn exhausted(&mut self, ino: u64, what: &str) -> i32 {
        tracing::warn!(
            ino,
            attempts = self.made - 1,
            met = ?std::mem::take(&mut self.met),
            "{what} kept meeting stale layouts or failed replicas: EIO"
        );
        libc::EIO
    }
}

impl Drop for Attempts<'_> {
    /// An operation that ended (not by giving up) after retrying for a second or more says what
    /// it met.
    fn drop(&mut self) {
        if self.met.is_empty() {
            return; // the common case: no clock read
        }
        let spent = self.cl.clock().mono_ns().saturating_sub(self.started) / 1_000_000;
        if spent >= 1000 {
            tracing::info!(spent_ms = spent, attempts = self.made, met = ?self.met, "an operation ended after retrying for a second or more");
        }
    }
}

/// What one write learnt of nodes that failed it.
struct Failed {
    /// The mount's session when the write started: a primary that failed it is tried again
    /// only while it serves that session.
    session: u64,
    /// Data nodes declared dead after failing it.
    nodes: Vec<u32>,
}

/// Most stripes one `fallocate` request to the service covers (each may take a round trip to
/// every replica's node).
pub const FALLOCATE_STRIPES: u64 = 64;

#[derive(Default)]
struct Layout {
    table: u64,
    cap: u64,
    /// The file's replication factor (slots per table entry; 0 before the record was read).
    replicas: u32,
    /// Per stripe, its live replicas.
    stripes: FxHashMap<u64, Vec<Cached>>,
}

/// A stripe replica this mount knows, and when it last saw it live.
#[derive(Clone, Copy)]
struct Cached {
    extent: StripeExtent,
    /// [`crate::clock::Clock::mono_ns`] when the batch (or RPC) that last found the stripe live was sent; the node
    /// reuses its memory no sooner than a quarantine after that.
    live_at: u64,
}

/// What a mount knows about one regular file.
pub struct FileData {
    pub ino: u64,
    record: u64,
    unit: u64,
    layout: RwLock<Layout>,
    size_hint: AtomicU64,
    /// When `size_hint` was last read from the record (the mount's `mono_ns`; 0: not since
    /// forgotten).
    size_read_at: AtomicU64,
    /// How long reads may trust `size_hint` (the mount's `attr_timeout`).
    size_ttl: Duration,
    /// Range locks for writes and truncate (`None`: the mount runs with `locks=off`).
    locks: Option<FileLocks>,
    /// How far this mount's writes reached and the last mtime they set, since its last
    /// truncate (or another mount's change): reported again to a primary that takes over,
    /// which may lack the size words written one-sidedly to the old one.
    written: AtomicU64,
    written_mtime: AtomicU64,
    /// `fcntl` and `flock` locks of this mount's processes on the file.
    pub record_locks: crate::reclock::FileRecordLocks,
    /// This mount saw the file without a `security.capability` attribute, which the kernel
    /// asks for before every buffered write; forgotten with the size on any change.
    no_capability: AtomicBool,
}

/// Whether regular file `a`'s record still holds the size and modification time `a` was
/// answered with, by one one-sided read of it: every data write moves one of them, so the rest
/// of `a` is as fresh as the changes pushed to the mount (see [`crate::leased`]). False when
/// the read fails.
pub fn record_unchanged(cl: &Cluster, a: &rackfs_proto::namespace::Attr) -> bool {
    let Some(l) = a.layout else { return false };
    let Ok(node) = cl.node(l.node) else {
        return false;
    };
    let Ok(r) = node
        .qp
        .read(RemoteAddr::new(node.rkey, l.record), RECORD_LEN as u32)
    else {
        return false;
    };
    let at = |w: u64| word(&r, (w / 8) as usize);
    at(REC_INO) == a.ino && at(REC_SIZE) == a.size && at(REC_MTIME) <= a.mtime_ns
}

fn word(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
}

/// A tag check posted with a batch: (node, stripe, expected tag, the tag's READ).
type TagCheck = (u32, u64, u64, WrId);

/// The stripes a batch touches, whose tags it reads after its data ops.
#[derive(Default)]
struct Touched(Vec<(StripeExtent, u64, u32)>); // extent, stripe, rkey

impl Touched {
    /// Appends each touched stripe's tag READ to its node's batch.
    fn check(self, batches: &mut BTreeMap<u32, Batch<'_>>) -> Vec<TagCheck> {
        self.0
            .into_iter()
            .map(|(e, stripe, rkey)| {
                let id = batches
                    .entry(e.node)
                    .or_default()
                    .read(RemoteAddr::new(rkey, e.offset - TAG_SPACE), 8);
                (e.node, stripe, e.tag, id)
            })
            .collect()
    }
}

/// Stripes whose tag no longer matches on some replica: freed (and quarantined) or moved
/// since this mount cached them. Only checks of nodes whose batch completed count.
fn stale_stripes(tags: &[TagCheck], done: &BTreeMap<u32, Completions>) -> Vec<u64> {
    let mut v: Vec<u64> = tags
        .iter()
        .filter(|(node, stripe, tag, id)| {
            let Some(c) = done.get(node) else {
                return false;
            };
            let found = c.data(*id).map(|d| word(d, 0));
            let stale = found.as_ref().ok() != Some(tag);
            if stale {
                tracing::debug!(node, stripe, tag, ?found, "a stale stripe tag");
            }
            stale
        })
        .map(|t| t.1)
        .collect();
    v.dedup();
    v
}

/// The outcome of batches posted to several nodes: completions of those that ran, and the
/// nodes whose batch failed (or could not be posted), with why.
struct Outcome {
    done: BTreeMap<u32, Completions>,
    failed: Vec<(u32, VerbsError)>,
}

impl FileData {
    /// `size_ttl`: how long reads may trust the last size seen (see [`FileData::read`]);
    /// `locking`: whether writes and truncates take range locks; `keep_locks`: whether the
    /// mount keeps the file's lock tree while it writes uncontended.
    pub fn new(
        ino: u64,
        layout: FileLayout,
        size_ttl: Duration,
        locking: bool,
        keep_locks: bool,
    ) -> FileData {
        FileData {
            ino,
            record: layout.record,
            unit: layout.stripe_unit,
            layout: RwLock::new(Layout::default()),
            size_hint: AtomicU64::new(0),
            size_read_at: AtomicU64::new(0),
            size_ttl,
            locks: locking.then(|| FileLocks::new(ino, layout.record, keep_locks)),
            written: AtomicU64::new(0),
            written_mtime: AtomicU64::new(0),
            no_capability: AtomicBool::new(false),
            record_locks: crate::reclock::FileRecordLocks::new(ino),
        }
    }

    /// What this mount wrote to the file (end, mtime), if anything since its last truncate
    /// or another mount's change (see [`rackfs_proto::namespace::MetaRequest::Settle`]).
    pub fn written(&self) -> Option<(u64, u64)> {
        let end = self.written.load(Ordering::Relaxed);
        (end > 0).then(|| (end, self.written_mtime.load(Ordering::Relaxed)))
    }

    fn note_size(&self, cl: &Cluster, size: u64) {
        self.size_hint.store(size, Ordering::Relaxed);
        self.size_read_at
            .store(cl.clock().mono_ns(), Ordering::Relaxed);
    }

    /// The size, if it was read from the record within `size_ttl`.
    fn fresh_size(&self, cl: &Cluster) -> Option<u64> {
        let age = cl
            .clock()
            .mono_ns()
            .saturating_sub(self.size_read_at.load(Ordering::Relaxed));
        (self.size_read_at.load(Ordering::Relaxed) != 0 && age < self.size_ttl.as_nanos() as u64)
            .then(|| self.size_hint.load(Ordering::Relaxed))
    }

    /// Forgets the size last read and whether it lacks a capability attribute (another
    /// mount changed the file's attributes).
    pub fn forget_size(&self) {
        self.size_read_at.store(0, Ordering::Relaxed);
        self.written.store(0, Ordering::Relaxed);
        self.no_capability.store(false, Ordering::Relaxed);
    }

    /// Forgets the size last read and whether it lacks a capability attribute (the watcher
    /// lost touch: another mount may have changed them). What this mount wrote stays, to be
    /// reported to a primary that takes over.
    pub fn forget_hints(&self) {
        self.size_read_at.store(0, Ordering::Relaxed);
        self.no_capability.store(false, Ordering::Relaxed);
    }

    /// Whether this mount knows the file has no `security.capability` attribute.
    pub fn lacks_capability(&self) -> bool {
        self.no_capability.load(Ordering::Relaxed)
    }

    /// Records whether the file lacks a `security.capability` attribute.
    pub fn set_lacks_capability(&self, lacks: bool) {
        self.no_capability.store(lacks, Ordering::Relaxed);
    }

    /// Forgets the cached layout (after this mount truncated the file).
    pub fn invalidate(&self) {
        *self.layout.write().expect("layout lock") = Layout::default();
    }

    /// The primary failed a data operation of this file with `e` (its connection is dropped):
    /// whether to try again (see [`FileData::primary_serves`]).
    fn primary_back(&self, cl: &Cluster, session: u64, e: VerbsError) -> bool {
        let fenced = matches!(e, VerbsError::Fenced { .. });
        self.verbs_err(cl, cl.primary_id(), e);
        !fenced && self.primary_serves(cl, session)
    }

    /// After the primary failed a data operation of this file: whether it still serves this
    /// mount's session `session` (see [`Cluster::primary_serves`]), so the operation is tried
    /// again. Otherwise the operation fails with EIO, and the mount runs it again on a primary
    /// that took over (`Client::across_failover`).
    fn primary_serves(&self, cl: &Cluster, session: u64) -> bool {
        let serves = cl.primary_serves(session);
        if !serves {
            tracing::warn!(
                ino = self.ino,
                node = cl.primary_id(),
                "the primary failed a data operation and does not serve this session: EIO"
            );
        }
        serves
    }

    fn verbs_err(&self, cl: &Cluster, node: u32, e: VerbsError) -> i32 {
        tracing::debug!(ino = self.ino, node, error = %e, "I/O failed: EIO");
        cl.verbs_errno(node, &e)
    }

    /// Reads the file record (and the table entries of `wanted` stripes not cached), updating
    /// the cache. Returns the current size.
    pub fn refresh(&self, cl: &Cluster, wanted: &[u64]) -> Result<u64, i32> {
        let primary = cl.primary_id();
        let session = cl.session();
        let mut attempts = Attempts::new(cl);
        while attempts.next() {
            let p = match cl.node(primary) {
                Ok(p) => p,
                Err(e) if self.primary_back(cl, session, e.clone()) => {
                    attempts.met(Met::PrimaryBack);
                    continue;
                }
                Err(_) => return Err(libc::EIO),
            };
            let (table, cap, replicas) = {
                let l = self.layout.read().expect("layout lock");
                (l.table, l.cap, l.replicas)
            };
            let mut b = Batch::new();
            let rec = b.read(RemoteAddr::new(p.rkey, self.record), RECORD_LEN as u32);
            let entry_len = (replicas as u64 * ENTRY_LEN) as u32;
            let entries: Vec<(u64, WrId)> = wanted
                .iter()
                .filter(|&&k| k < cap && replicas > 0)
                .map(|&k| {
                    let at = entry_offset(table, k, replicas);
                    (k, b.read(RemoteAddr::new(p.rkey, at), entry_len))
                })
                .collect();
            let sent = cl.clock().mono_ns();
            let done = match p.qp.execute(b) {
                Ok(done) => done,
                Err(e) if self.primary_back(cl, session, e.clone()) => {
                    attempts.met(Met::PrimaryBack);
                    continue;
                }
                Err(_) => return Err(libc::EIO),
            };
            let r = done.data(rec).map_err(|e| self.verbs_err(cl, primary, e))?;
            let at = |w: u64| word(r, (w / 8) as usize);
            let size = at(REC_SIZE);
            let now = (
                at(REC_TABLE),
                at(REC_TABLE_CAP),
                at(REC_REPLICAS).max(1) as u32,
            );
            if at(REC_INO) != self.ino {
                // The file is gone and its record reused (this handle outlived its open).
                tracing::warn!(
                    ino = self.ino,
                    "the file's record now belongs to another file"
                );
                self.invalidate();
                return Err(libc::ESTALE);
            }
            self.note_size(cl, size);
            let mut l = self.layout.write().expect("layout lock");
            if now != (table, cap, replicas) {
                // The table grew (or first sight): entries read from the old copy may miss
                // recent allocations, so read again from the new one.
                (l.table, l.cap, l.replicas) = now;
                attempts.met(Met::TableMoved);
                continue;
            }
            let mut moving = Vec::new();
            for (k, id) in entries {
                let e = done.data(id).map_err(|e| self.verbs_err(cl, primary, e))?;
                if (0..replicas as usize).any(|j| word(e, 2 * j + 1) == TAG_MOVING) {
                    moving.push(k);
                    continue;
                }
                // The service clears a slot before it frees or drops the replica: live when
                // sent.
                let live: Vec<Cached> = (0..replicas as usize)
                    .map(|j| (word(e, 2 * j), word(e, 2 * j + 1)))
                    .filter(|&(loc, tag)| tag != 0 && loc != 0)
                    .map(|(loc, tag)| {
                        let (node, offset) = split_location(loc);
                        Cached {
                            extent: StripeExtent { node, offset, tag },
                            live_at: sent,
                        }
                    })
                    .collect();
                if !live.is_empty() {
                    l.stripes.insert(k, live);
                }
            }
            drop(l);
            for k in moving {
                self.ask_stripe(cl, k)?;
            }
            return Ok(size);
        }
        Err(attempts.exhausted(self.ino, "reading the file record"))
    }

    /// Learns stripe `k`'s replicas from the service, which answers once a move or copy of it
    /// in progress is done (its entry is marked moving meanwhile).
    fn ask_stripe(&self, cl: &Cluster, k: u64) -> Result<(), i32> {
        let sent = cl.clock().mono_ns();
        let replicas = match cl.meta(MetaRequest::GetStripe {
            ino: self.ino,
            stripe: k,
        }) {
            Ok(ControlResponse::Stripe(r)) => r,
            Ok(_) => return Err(libc::EIO),
            Err(e) => return Err(e.errno()),
        };
        self.cache_stripe(k, replicas, sent);
        Ok(())
    }

    /// Caches stripe `k`'s replicas, learnt from the service by an RPC sent at `sent`.
    pub(crate) fn cache_stripe(&self, k: u64, replicas: Vec<StripeExtent>, sent: u64) {
        if replicas.is_empty() {
            return;
        }
        let live = replicas
            .into_iter()
            .map(|extent| Cached {
                extent,
                live_at: sent,
            })
            .collect();
        self.layout
            .write()
            .expect("layout lock")
            .stripes
            .insert(k, live);
    }

    /// Stripes of `ps` this mount has no extent for.
    fn uncached(&self, ps: &[Piece]) -> Vec<u64> {
        let l = self.layout.read().expect("layout lock");
        let mut v: Vec<u64> = ps
            .iter()
            .map(|p| p.stripe)
            .filter(|k| !l.stripes.contains_key(k))
            .collect();
        v.dedup();
        v
    }

    /// The cached replicas of stripe `stripe`.
    fn cached(&self, stripe: u64) -> Option<Vec<StripeExtent>> {
        self.layout
            .read()
            .expect("layout lock")
            .stripes
            .get(&stripe)
            .map(|c| c.iter().map(|c| c.extent).collect())
    }

    /// Notes that the checks in `tags` found their replicas live in a batch sent at `sent`.
    fn seen_live(&self, tags: &[TagCheck], stale: &[u64], sent: u64) {
        let mut l = self.layout.write().expect("layout lock");
        for t in tags.iter().filter(|t| !stale.contains(&t.1)) {
            if let Some(rs) = l.stripes.get_mut(&t.1) {
                for c in rs.iter_mut() {
                    if c.extent.node == t.0 && c.extent.tag == t.2 {
                        c.live_at = c.live_at.max(sent);
                    }
                }
            }
        }
    }

    /// Before a write: checks, in a batch of their own, the tags of the replicas in `tags` not
    /// seen live within their node's lease, and returns the stripes that turned out stale (or
    /// lost a replica to a failed node). Writing to a replica seen live long ago could land
    /// in memory the node has freed and reused.
    fn recheck(&self, cl: &Cluster, tags: &[TagCheck], dead: &mut Failed) -> Result<Vec<u64>, i32> {
        let now = cl.clock().mono_ns();
        let expired: Vec<TagCheck> = {
            let l = self.layout.read().expect("layout lock");
            tags.iter()
                .filter(|t| {
                    l.stripes
                        .get(&t.1)
                        .and_then(|rs| rs.iter().find(|c| c.extent.node == t.0))
                        .is_none_or(|c| {
                            now.saturating_sub(c.live_at) >= cl.stripe_lease_ns(c.extent.node)
                        })
                })
                .copied()
                .collect()
        };
        if expired.is_empty() {
            return Ok(Vec::new());
        }
        let mut batches: BTreeMap<u32, Batch> = BTreeMap::new();
        let mut checks = Vec::new();
        let mut gone = Vec::new();
        for &(node, stripe, tag, _) in &expired {
            let Some(e) = self
                .cached(stripe)
                .and_then(|rs| rs.into_iter().find(|e| e.node == node))
            else {
                gone.push(stripe);
                continue;
            };
            let rkey = match cl.node(node) {
                Ok(n) => n.rkey,
                Err(err) => {
                    self.verbs_err(cl, node, err);
                    gone.extend(self.replica_failed(cl, node, dead)?);
                    continue;
                }
            };
            let id = batches
                .entry(node)
                .or_default()
                .read(RemoteAddr::new(rkey, e.offset - TAG_SPACE), 8);
            checks.push((node, stripe, tag, id));
        }
        let sent = cl.clock().mono_ns();
        let out = self.run(cl, batches, None)?;
        let mut stale = stale_stripes(&checks, &out.done);
        self.seen_live(&checks, &stale, sent);
        stale.extend(gone);
        stale.extend(self.failed_writes(cl, out.failed, dead)?);
        Ok(stale)
    }

    fn evict(&self, stripes: &[u64]) {
        if stripes.is_empty() {
            return;
        }
        let mut l = self.layout.write().expect("layout lock");
        for k in stripes {
            l.stripes.remove(k);
        }
    }

    /// Data node `node` failed a write: once the primary has dropped it from the replicas
    /// (noted in `dead`) or found it alive, forgets the cached stripes with a replica there and
    /// returns them (the write is redone on a fresh layout).
    fn replica_failed(&self, cl: &Cluster, node: u32, dead: &mut Failed) -> Result<Vec<u64>, i32> {
        let primary = cl.primary_id();
        if node == primary {
            // The file record is there: nothing to fail over to. Tried again while the primary
            // serves the session the operation started in.
            if self.primary_serves(cl, dead.session) {
                return Ok(Vec::new());
            }
            return Err(libc::EIO);
        }
        if cl.node_failed(node)? {
            dead.nodes.push(node);
        }
        Ok(self.forget_node(node))
    }

    /// A read failed on `node`: it is avoided for the rest of the read, and the stripes cached
    /// with a replica there are read from the table again (a cached entry may predate copies
    /// made since, on other nodes).
    fn avoid(&self, node: u32, avoid: &mut Vec<u32>) {
        self.forget_node(node);
        avoid.push(node);
    }

    /// Forgets the cached stripes with a replica on `node` (the next use reads the table
    /// again, which no longer lists the node once the primary dropped it); returns them.
    fn forget_node(&self, node: u32) -> Vec<u64> {
        let mut l = self.layout.write().expect("layout lock");
        let on: Vec<u64> = l
            .stripes
            .iter()
            .filter(|(_, rs)| rs.iter().any(|c| c.extent.node == node))
            .map(|(&k, _)| k)
            .collect();
        for k in &on {
            l.stripes.remove(k);
        }
        on
    }

    /// The stripes to redo after the nodes in `failed` failed a write (see
    /// [`FileData::replica_failed`]); EIO if the mount was fenced or the primary failed.
    fn failed_writes(
        &self,
        cl: &Cluster,
        failed: Vec<(u32, VerbsError)>,
        dead: &mut Failed,
    ) -> Result<Vec<u64>, i32> {
        let mut redo = Vec::new();
        for (node, e) in failed {
            if matches!(e, VerbsError::Fenced { .. }) {
                return Err(libc::EIO);
            }
            redo.extend(self.replica_failed(cl, node, dead)?);
        }
        Ok(redo)
    }

    /// The remote address of piece `p` in replica `e`, noting the replica in `touched` (its
    /// tag is checked after the data ops).
    fn stage(
        &self,
        cl: &Cluster,
        p: &Piece,
        e: StripeExtent,
        touched: &mut Touched,
    ) -> Result<RemoteAddr, VerbsError> {
        let node = cl.node(e.node)?;
        if !touched
            .0
            .iter()
            .any(|t| t.1 == p.stripe && t.0.node == e.node)
        {
            touched.0.push((e, p.stripe, node.rkey));
        }
        Ok(RemoteAddr::new(node.rkey, e.offset + p.offset))
    }

    /// Stripes of `ps` whose cached extents are missing or too small for the pieces to
    /// write, with the bytes each must hold.
    fn short(&self, ps: &[Piece]) -> Vec<(u64, u64)> {
        let l = self.layout.read().expect("layout lock");
        ps.iter()
            .filter(|p| {
                l.stripes
                    .get(&p.stripe)
                    .is_none_or(|rs| rs.iter().any(|c| c.extent.cap() < p.offset + p.len))
            })
            .map(|p| (p.stripe, p.offset + p.len))
            .collect()
    }

    /// QoS: waits until this mount may spend the tokens of the data operations per node. A
    /// node whose QoS area cannot be reached is returned as failed (its replicas may have
    /// others).
    fn admit(
        &self,
        cl: &Cluster,
        tokens: &BTreeMap<u32, u64>,
    ) -> Result<Vec<InFlight>, (u32, VerbsError)> {
        let mut held = Vec::new();
        for (&node, &t) in tokens {
            match cl.admit(node, t) {
                Ok(a) => held.extend(a),
                Err(e) => {
                    cl.loads.failed(node);
                    self.verbs_err(cl, node, e.clone());
                    return Err((node, e));
                }
            }
        }
        Ok(held)
    }

    /// The queue pair to `node`; in session `session` only, if given (see [`Cluster::node_in`]).
    fn node(
        &self,
        cl: &Cluster,
        node: u32,
        session: Option<u64>,
    ) -> Result<std::sync::Arc<crate::cluster::Node>, VerbsError> {
        match session {
            Some(s) => cl.node_in(node, s),
            None => cl.node(node),
        }
    }

    /// Posts one batch per node (in session `session` only, if given) and waits for all. A
    /// node whose batch fails is reported, not fatal: its replicas may have others. Only a
    /// fenced session is an error at once.
    fn run<'a>(
        &self,
        cl: &Cluster,
        batches: BTreeMap<u32, Batch<'a>>,
        session: Option<u64>,
    ) -> Result<Outcome, i32> {
        let mut posted = Vec::with_capacity(batches.len());
        let mut failed = Vec::new();
        for (node, b) in batches {
            match self.node(cl, node, session) {
                Ok(n) => posted.push((node, cl.loads.start(node), n.qp.post(b))),
                Err(e @ VerbsError::Fenced { .. }) => return Err(self.verbs_err(cl, node, e)),
                Err(e) => failed.push((node, e)),
            }
        }
        let mut done = BTreeMap::new();
        for (node, flight, p) in posted {
            match p.wait().and_then(|d| d.check().map(|_| d)) {
                Ok(d) => {
                    cl.metrics().batches.observe(flight.done());
                    done.insert(node, d);
                }
                Err(e) => failed.push((node, e)),
            }
        }
        for (node, e) in &failed {
            cl.loads.failed(*node);
            self.verbs_err(cl, *node, e.clone());
        }
        Ok(Outcome { done, failed })
    }

    /// Reads up to `len` bytes at `offset`; short at end of file.
    ///
    /// The end of file is the size read from the record within the last `size_ttl`, else the
    /// size read in the same round as the data. So growth by other mounts is always seen (a
    /// read past the known size re-reads it), while a shrink by another mount is seen within
    /// `size_ttl` — like the kernel's attribute cache; `attr_timeout=0` makes it immediate.
    pub fn read(&self, cl: &Cluster, offset: u64, len: u32) -> Result<Vec<u8>, i32> {
        self.read_with(cl, offset, len, <[u8]>::to_vec)
    }

    /// [`FileData::read`], handing the bytes to `consume` — straight from the completion when
    /// the read is one piece of one stripe (the common case), so nothing is copied twice.
    /// Each piece is read from one replica of its stripe ([`crate::replica`]); a node that
    /// fails is avoided and the read redone from another replica.
    pub fn read_with<R>(
        &self,
        cl: &Cluster,
        offset: u64,
        len: u32,
        consume: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, i32> {
        let primary = cl.primary_id();
        // Near the end of the file, learn the size first rather than fetch bytes beyond it.
        let mut len = len as u64;
        if offset + len > self.size_hint.load(Ordering::Relaxed) {
            let size = self.refresh(cl, &[])?;
            len = len.min(size.saturating_sub(offset));
        }
        if len == 0 {
            return Ok(consume(&[]));
        }
        let len = len as u32;
        let ps = pieces(offset, len as u64, self.unit);
        // Nodes that failed this read.
        let mut avoid: Vec<u32> = Vec::new();
        let session = cl.session();
        let mut attempts = Attempts::new(cl);
        'attempt: while attempts.next() {
            let missing = self.uncached(&ps);
            let mut size = if missing.is_empty() {
                self.fresh_size(cl)
            } else {
                Some(self.refresh(cl, &missing)?)
            };
            let mut batches: BTreeMap<u32, Batch> = BTreeMap::new();
            let mut touched = Touched::default();
            let mut reads: Vec<(usize, u32, WrId)> = Vec::new(); // piece, node, id
            for (i, p) in ps.iter().enumerate() {
                // A stripe without an extent is a hole, and bytes beyond an extent's capacity
                // are zeros: neither is read (the tag is still checked, as the extent may have
                // grown).
                let Some(replicas) = self.cached(p.stripe) else {
                    continue;
                };
                let held = match replicas.len() {
                    1 => Vec::new(),
                    _ => cl.qos_held_back(replicas.iter().map(|r| r.node), tokens_for(p.len)),
                };
                let Some(e) = cl
                    .loads
                    .choose(self.ino, p.stripe, &replicas, &avoid, &held)
                else {
                    if attempts.patient() {
                        // Each failed node's connection was dropped: the next use reconnects,
                        // in this mount's current session (the node fenced an earlier one when
                        // it followed a primary that took over).
                        avoid.clear();
                        attempts.met(Met::NoReplicaYet);
                        continue 'attempt;
                    }
                    tracing::warn!(ino = self.ino, stripe = p.stripe, nodes = ?avoid, ?replicas, "no replica of the stripe could be read: EIO");
                    return Err(libc::EIO);
                };
                let at = match self.stage(cl, p, e, &mut touched) {
                    Ok(at) => at,
                    Err(err) => {
                        self.verbs_err(cl, e.node, err);
                        cl.loads.failed(e.node);
                        self.avoid(e.node, &mut avoid);
                        attempts.met(Met::ReplicaFailed);
                        continue 'attempt;
                    }
                };
                let n = p.len.min(e.cap().saturating_sub(p.offset));
                if n > 0 {
                    let id = batches.entry(e.node).or_default().read(at, n as u32);
                    reads.push((i, e.node, id));
                }
            }
            let tags = touched.check(&mut batches);
            let size_id = if size.is_none() {
                let pr = match cl.node(primary) {
                    Ok(p) => p,
                    Err(e) if self.primary_back(cl, session, e.clone()) => {
                        attempts.met(Met::PrimaryBack);
                        continue 'attempt;
                    }
                    Err(_) => return Err(libc::EIO),
                };
                Some(
                    batches
                        .entry(primary)
                        .or_default()
                        .read(RemoteAddr::new(pr.rkey, self.record + REC_SIZE), 8),
                )
            } else {
                None
            };
            let mut tokens: BTreeMap<u32, u64> = BTreeMap::new();
            for (i, node, _) in &reads {
                *tokens.entry(*node).or_default() += tokens_for(ps[*i].len);
            }
            let _admitted = match self.admit(cl, &tokens) {
                Ok(a) => a,
                Err((node, _)) => {
                    self.avoid(node, &mut avoid);
                    attempts.met(Met::QosAreaFailed);
                    continue;
                }
            };
            let sent = cl.clock().mono_ns();
            let out = self.run(cl, batches, None)?;
            if !out.failed.is_empty() {
                let on_primary = out.failed.iter().find(|(n, _)| *n == primary);
                if let (Some((_, e)), Some(_)) = (on_primary, size_id) {
                    if !self.primary_back(cl, session, e.clone()) {
                        return Err(libc::EIO);
                    }
                    attempts.met(Met::PrimaryBack);
                    continue;
                }
                for (n, _) in &out.failed {
                    self.avoid(*n, &mut avoid);
                }
                attempts.met(Met::ReplicaFailed);
                continue;
            }
            let done = out.done;
            let stale = stale_stripes(&tags, &done);
            self.seen_live(&tags, &stale, sent);
            if !stale.is_empty() {
                self.evict(&stale);
                attempts.met(Met::StaleLayout);
                continue;
            }
            if let Some(id) = size_id {
                let s = word(done[&primary].data(id).map_err(|_| libc::EIO)?, 0);
                self.note_size(cl, s);
                size = Some(s);
            }
            let size = size.expect("size read one way or the other");
            let valid = size.saturating_sub(offset).min(len as u64) as usize;
            if let ([_], [(_, node, id)]) = (ps.as_slice(), reads.as_slice()) {
                let d = done[node].data(*id).map_err(|_| libc::EIO)?;
                if d.len() >= valid {
                    return Ok(consume(&d[..valid]));
                }
            }
            let mut out = vec![0u8; len as usize];
            for (i, node, id) in reads {
                let at = ps[i].buf_offset as usize;
                let d = done[&node].data(id).map_err(|_| libc::EIO)?;
                out[at..at + d.len()].copy_from_slice(d);
            }
            return Ok(consume(&out[..valid]));
        }
        Err(attempts.exhausted(self.ino, "a read"))
    }

    /// Writes `data` at `offset` under the range lock of the 4 KiB units it touches, so
    /// overlapping writes from different mounts never interleave within a unit.
    pub fn write_locked(&self, cl: &Cluster, offset: u64, data: &[u8]) -> Result<(), i32> {
        let Some(locks) = &self.locks else {
            return self.write(cl, offset, data);
        };
        if data.is_empty() {
            return Ok(());
        }
        let (l, r) = lock::units(offset, data.len() as u64);
        let held = locks.lock(cl, l, r)?;
        let res = self.write_in(cl, offset, data, Some(held.session()));
        locks.unlock(cl, held);
        res
    }

    /// Appends `data` at the end of the file as the cluster knows it; returns where it went,
    /// and tells `placed` before the bytes go out. Under locks, the units from the end of
    /// file to the end of `data` are locked and the size is re-read under the lock: any write
    /// that could move the end of file past that point touches a locked unit, so two appends
    /// never overwrite each other.
    pub fn append(&self, cl: &Cluster, data: &[u8], placed: impl Fn(u64)) -> Result<u64, i32> {
        let Some(locks) = &self.locks else {
            let at = self.size(cl)?;
            placed(at);
            return self.write(cl, at, data).map(|_| at);
        };
        let len = data.len() as u64;
        let mut guess = self.size(cl)?;
        for attempt in 0.. {
            // After a few moves of the end of file, lock everything from the start.
            let (l, r) = if attempt < 8 {
                lock::units(guess, len.max(1))
            } else {
                (0, u64::MAX)
            };
            let held = locks.lock(cl, l, r)?;
            let at = match self.size(cl) {
                Ok(s) => s,
                Err(e) => {
                    locks.unlock(cl, held);
                    return Err(e);
                }
            };
            let (al, ar) = lock::units(at, len.max(1));
            if l <= al && ar <= r {
                placed(at);
                let res = self.write_in(cl, at, data, Some(held.session()));
                locks.unlock(cl, held);
                return res.map(|_| at);
            }
            locks.unlock(cl, held);
            guess = at;
        }
        unreachable!("the last attempts lock the whole file")
    }

    /// Runs `truncate` (the metadata service's size change) holding the whole-file lock, then
    /// shrinks the file's lock tree to the new size (scale-down).
    pub fn truncate<T>(
        &self,
        cl: &Cluster,
        size: u64,
        truncate: impl FnOnce() -> Result<T, i32>,
    ) -> Result<T, i32> {
        let res = self.exclusively(cl, truncate, |locks, held| {
            if let Err(e) = locks.shrink(cl, held, size.div_ceil(lock::LOCK_UNIT)) {
                tracing::warn!(ino = self.ino, errno = e, "lock tree not shrunk");
            }
        });
        if res.is_ok() {
            self.written.store(0, Ordering::Relaxed);
        }
        res
    }

    /// `fallocate(2)` of bytes `[offset, offset + len)` under the whole-file lock: `send`
    /// asks the service for a piece of the range, at most [`FALLOCATE_STRIPES`] stripes at a
    /// time so each request finishes well within its deadline.
    pub fn fallocate(
        &self,
        cl: &Cluster,
        offset: u64,
        len: u64,
        send: impl Fn(u64, u64) -> Result<(), i32>,
    ) -> Result<(), i32> {
        let end = offset.checked_add(len).ok_or(libc::EFBIG)?;
        let res = self.exclusively(
            cl,
            || {
                let mut at = offset;
                while at < end {
                    let to = (at - at % self.unit + FALLOCATE_STRIPES * self.unit).min(end);
                    send(at, to - at)?;
                    at = to;
                }
                Ok(())
            },
            |_, _| {},
        );
        self.size_read_at.store(0, Ordering::Relaxed);
        res
    }

    /// Runs `op` holding the file's whole-file range lock (no write of any mount overlaps it),
    /// then forgets the cached layout; `done` runs, still under the lock, if `op` succeeded.
    fn exclusively<T>(
        &self,
        cl: &Cluster,
        op: impl FnOnce() -> Result<T, i32>,
        done: impl FnOnce(&FileLocks, &lock::Held),
    ) -> Result<T, i32> {
        let Some(locks) = &self.locks else {
            let res = op();
            self.invalidate();
            return res;
        };
        let held = locks.lock(cl, 0, u64::MAX)?;
        // Not on behalf of a session fenced since the lock was taken.
        let res = if cl.session() == held.session() {
            op()
        } else {
            Err(libc::EIO)
        };
        self.invalidate();
        if res.is_ok() {
            done(locks, &held);
        }
        locks.unlock(cl, held);
        res
    }

    /// Writes `data` at `offset`; visible to every mount when this returns.
    pub fn write(&self, cl: &Cluster, offset: u64, data: &[u8]) -> Result<(), i32> {
        self.write_in(cl, offset, data, None)
    }

    /// [`FileData::write`], in session `session` only if given (a write under a range lock
    /// taken in that session: it must fail, not land, once the session was fenced).
    fn write_in(
        &self,
        cl: &Cluster,
        offset: u64,
        data: &[u8],
        session: Option<u64>,
    ) -> Result<(), i32> {
        let primary = cl.primary_id();
        let end = offset.checked_add(data.len() as u64).ok_or(libc::EFBIG)?;
        if end > MAX_FILE_SIZE {
            return Err(libc::EFBIG);
        }
        if data.is_empty() {
            return Ok(());
        }
        let ps = pieces(offset, data.len() as u64, self.unit);
        let mut dead = Failed {
            session: session.unwrap_or_else(|| cl.session()),
            nodes: Vec::new(),
        };
        let mut attempts = Attempts::new(cl);
        while attempts.next() {
            let pr = match self.node(cl, primary, session) {
                Ok(p) => p,
                Err(e) if self.primary_back(cl, dead.session, e.clone()) => {
                    attempts.met(Met::PrimaryBack);
                    continue;
                }
                Err(_) => return Err(libc::EIO),
            };
            let short = self.short(&ps);
            if !short.is_empty() {
                let stripes: Vec<u64> = short.iter().map(|s| s.0).collect();
                self.refresh(cl, &stripes)?;
                let mut placed = true;
                for (k, end) in self.short(&ps) {
                    let sent = cl.clock().mono_ns();
                    let s = match cl.meta(MetaRequest::AllocStripe {
                        ino: self.ino,
                        stripe: k,
                        end,
                    }) {
                        Ok(ControlResponse::Stripe(s)) if !s.is_empty() => s,
                        Ok(_) => return Err(libc::EIO),
                        // No node of the stripe's could take it: a primary that just took
                        // over reaches a data node only once the node follows it, and until
                        // it has followed the node's extents it may ask the node for a
                        // replica its predecessor moved (refused as not found). Asked again
                        // while the operation's patience lasts (a write never answers
                        // ENOENT).
                        Err(RpcError::Refused {
                            code: ErrorCode::Unavailable | ErrorCode::NotFound,
                            message,
                        }) => {
                            tracing::debug!(ino = self.ino, stripe = k, %message, "stripe not placed yet");
                            placed = false;
                            break;
                        }
                        Err(e) => return Err(e.errno()),
                    };
                    self.cache_stripe(k, s, sent);
                }
                if !placed {
                    attempts.met(Met::NotPlaced);
                    continue;
                }
            }
            // Every piece goes to every replica of its stripe.
            let mut batches: BTreeMap<u32, Batch> = BTreeMap::new();
            let mut touched = Touched::default();
            let mut complete = true;
            let mut redo = Vec::new();
            let mut tokens: BTreeMap<u32, u64> = BTreeMap::new();
            'pieces: for p in &ps {
                let replicas = self.cached(p.stripe).unwrap_or_default();
                if replicas.is_empty() || replicas.iter().any(|e| e.cap() < p.offset + p.len) {
                    // Evicted (or replaced by a smaller extent) concurrently: start over.
                    attempts.met(Met::Evicted);
                    complete = false;
                    break;
                }
                if let Some(e) = replicas.iter().find(|e| dead.nodes.contains(&e.node)) {
                    // Its only replica is on a node declared dead: nothing to write to.
                    tracing::warn!(
                        ino = self.ino,
                        stripe = p.stripe,
                        node = e.node,
                        "the stripe's only replica is on a memory node declared dead: EIO"
                    );
                    return Err(libc::EIO);
                }
                let bytes = &data[p.buf_offset as usize..(p.buf_offset + p.len) as usize];
                for e in replicas {
                    match self.stage(cl, p, e, &mut touched) {
                        Ok(at) => {
                            *tokens.entry(e.node).or_default() += tokens_for(p.len);
                            batches.entry(e.node).or_default().write(at, bytes);
                        }
                        Err(err) => {
                            self.verbs_err(cl, e.node, err);
                            redo = self.replica_failed(cl, e.node, &mut dead)?;
                            attempts.met(Met::ReplicaFailed);
                            complete = false;
                            break 'pieces;
                        }
                    }
                }
            }
            if !complete {
                self.evict(&redo);
                continue;
            }
            let tags = touched.check(&mut batches);
            // The record: mtime, and the size. A write that extends what this mount believes is
            // the size tries CAS-max at once; every write also reads the size, because another
            // mount may have truncated the file below this mount's belief.
            let hint = self.size_hint.load(Ordering::Relaxed);
            let size_addr = RemoteAddr::new(pr.rkey, self.record + REC_SIZE);
            let b = batches.entry(primary).or_default();
            let mtime = cl.clock().wall_ns();
            b.write_u64(RemoteAddr::new(pr.rkey, self.record + REC_MTIME), mtime);
            let size_id = b.read(size_addr, 8);
            let cas = (end > hint).then(|| b.cas(size_addr, hint, end));
            let _admitted = match self.admit(cl, &tokens) {
                Ok(a) => a,
                Err(failed) => {
                    let redo = self.failed_writes(cl, vec![failed], &mut dead)?;
                    self.evict(&redo);
                    attempts.met(Met::QosAreaFailed);
                    continue;
                }
            };
            // Right before the data goes out (QoS may have made us wait).
            let expired = self.recheck(cl, &tags, &mut dead)?;
            if !expired.is_empty() {
                self.evict(&expired);
                attempts.met(Met::StaleLayout);
                continue;
            }
            let sent = cl.clock().mono_ns();
            let out = self.run(cl, batches, session)?;
            if !out.failed.is_empty() {
                // A replica's node failed: once it is dropped from the stripes (or found
                // alive), the whole write is redone on the replicas left. Writing a range
                // twice under the lock is harmless.
                let redo = self.failed_writes(cl, out.failed, &mut dead)?;
                self.evict(&redo);
                attempts.met(Met::ReplicaFailed);
                continue;
            }
            let done = out.done;
            let stale = stale_stripes(&tags, &done);
            self.seen_live(&tags, &stale, sent);
            let seen = match cas {
                Some(id) => match done[&primary].value(id).map_err(|_| libc::EIO)? {
                    old if old == hint => end, // our CAS won
                    old => old,
                },
                None => word(done[&primary].data(size_id).map_err(|_| libc::EIO)?, 0),
            };
            self.grow_size(cl, seen, end, session)?;
            if !stale.is_empty() {
                // Some data went to freed (quarantined) memory: write it again.
                self.evict(&stale);
                attempts.met(Met::StaleLayout);
                continue;
            }
            self.written.fetch_max(end, Ordering::Relaxed);
            self.written_mtime.fetch_max(mtime, Ordering::Relaxed);
            return Ok(());
        }
        Err(attempts.exhausted(self.ino, "a write"))
    }

    /// CAS-max of the size to at least `end`, starting from a last seen value.
    fn grow_size(
        &self,
        cl: &Cluster,
        mut seen: u64,
        end: u64,
        session: Option<u64>,
    ) -> Result<(), i32> {
        let primary = cl.primary_id();
        let pr = self
            .node(cl, primary, session)
            .map_err(|e| self.verbs_err(cl, primary, e))?;
        let addr = RemoteAddr::new(pr.rkey, self.record + REC_SIZE);
        while seen < end {
            let old = pr
                .qp
                .cas(addr, seen, end)
                .map_err(|e| self.verbs_err(cl, primary, e))?;
            seen = if old == seen { end } else { old };
        }
        self.note_size(cl, seen);
        Ok(())
    }

    /// The file's current size, read one-sidedly from its record.
    pub fn size(&self, cl: &Cluster) -> Result<u64, i32> {
        self.refresh(cl, &[])
    }
}
