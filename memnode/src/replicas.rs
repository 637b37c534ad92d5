//! The primary's bookkeeping of the replicas dead data nodes cost: the stale ones dropped from
//! the stripes, to free on their node before it serves again ([`Discards`]), and how far
//! re-replication has copied the stripes left short back ([`Rebuilds`]).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;

use rackfs_clock::{Mutex, MutexGuard};

/// The primary's record of nodes declared dead: per node, the extents of its replicas that
/// were dropped (stale now), freed on the node before it serves again. Its lock also
/// serialises declaring a node dead with admitting it. Lock order: it is taken before the
/// metadata lock and the frees' sending lock, never while holding either (`Node::send_frees`
/// notes the frees of a down node only after sending).
#[derive(Default)]
pub struct Discards(Mutex<HashMap<u32, Vec<Discard>>>);

/// An extent to free on a node when it is admitted again: its base, and the stripe tag it must
/// still carry (so a free sent again never frees memory the node handed out since).
pub type Discard = (u64, Option<u64>);

impl Discards {
    /// The extents to free per node, held for a whole declaration or admission.
    pub fn lock(&self) -> MutexGuard<'_, HashMap<u32, Vec<Discard>>> {
        self.0.lock().expect("discards lock")
    }

    /// The extent at `offset` on node `id` could not be freed (the node is down); it is freed
    /// when the node is admitted again, before it serves anyone.
    pub fn add(&self, id: u32, offset: u64, tag: Option<u64>) {
        self.lock().entry(id).or_default().push((offset, tag));
    }
}

/// Re-replication progress (primary only).
#[derive(Default)]
pub struct Rebuilds {
    pub stripes: AtomicU64,
    pub bytes: AtomicU64,
    /// The inode the next look for degraded stripes starts from (0: the first).
    pub scan_from: AtomicU64,
}
