//! Data nodes' leases with the primary (see `rackfs_verbs::lease`): a data node serves data
//! only while the primary renews its lease, and the primary declares a node dead (drops it
//! from every stripe's replicas) only once its lease has lapsed.
//!
//! * A data node renews every quarter of the lease, on a control connection of its own
//!   ([`keep_lease`]), timing each lease from when it sent the renewal. Its [`ServeLease`] is
//!   what its tcp NIC threads check, and it copies the deadline into each shm client's
//!   counter block ([`LeaseWords`], `rackfs_verbs::shm::LEASE_WORD`), which the client checks.
//! * The primary times leases with [`crate::lease::Leases`] keyed by node id, from when each
//!   renewal arrived. A node whose lease lapses is declared dead ([`declare_dead`]): marked
//!   down (no new data goes there) and dropped from every stripe that has another replica.
//! * Stripes left with fewer replicas than their file asks for are copied onto other live
//!   nodes in the background, rate-bounded ([`rebuild_round`], `rackfs_meta::file::File::rebuild`).
//! * A node declared dead is taken back at its next renewal: the primary first frees on it the
//!   replicas it dropped (stale now; tombstoning their tags sends mounts that cached them back
//!   to the layout), then renews. Stripes it alone held were never dropped and serve again.
//!   A node that joins (again) is new and empty, so joining drops its old replicas.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rackfs_proto::control::{ControlRequest, ControlResponse, ErrorCode};
use rackfs_proto::{ControlClient, Refusal, RpcError};
use rackfs_verbs::lease::{monotonic_ns, ServeLease};
use rackfs_verbs::shm::set_lease;
use rackfs_verbs::Region;
use tracing::{info, warn};

use crate::node::Node;

/// The counter blocks of this node's shm clients, where their copy of the node's lease lives.
#[derive(Default)]
pub struct LeaseWords(Mutex<Vec<Weak<Region>>>);

impl LeaseWords {
    /// A new shm client's counter block: it gets the lease's deadline now and on every
    /// renewal, as long as it lives.
    pub fn add(&self, block: &Arc<Region>, lease: &ServeLease) {
        self.0
            .lock()
            .expect("lease words lock")
            .push(Arc::downgrade(block));
        set_lease(block, lease.until(), true);
    }

    /// Copies the lease's deadline into every live client's block.
    fn publish(&self, until: u64) {
        let mut v = self.0.lock().expect("lease words lock");
        v.retain(|w| match w.upgrade() {
            Some(b) => {
                set_lease(&b, until, false);
                true
            }
            None => false,
        });
    }
}

/// A data node's renewal loop (runs on a thread of its own while the node runs).
pub fn keep_lease(node: &Node, primary: &str) {
    let id = node.cfg.node_id;
    let mut conn: Option<ControlClient> = None;
    let mut every = Duration::from_millis(100);
    let mut complained = false;
    while !node.is_stopping() {
        let c = match conn.take() {
            Some(c) => c,
            None => match ControlClient::connect(
                primary,
                &node.cfg.secret,
                &format!("lease-{}", node.cfg.name),
            ) {
                Ok(c) => c,
                Err(e) => {
                    if !std::mem::replace(&mut complained, true) {
                        warn!(primary, error = %e, "cannot reach the primary to renew this node's lease; it stops serving data when the lease lapses");
                    }
                    std::thread::sleep(every);
                    continue;
                }
            },
        };
        let sent = monotonic_ns();
        match c.call(&ControlRequest::NodeRenew { node: id }) {
            Ok(ControlResponse::Lease { ms }) => {
                node.serve.extend_to(sent + ms * 1_000_000);
                node.lease_words.publish(node.serve.until());
                every = Duration::from_millis(ms / 4).max(Duration::from_millis(10));
                if std::mem::replace(&mut complained, false) {
                    info!("this node's lease is renewed again");
                }
                conn = Some(c);
            }
            Ok(other) => {
                warn!(answer = ?other, "unexpected answer to a lease renewal");
            }
            Err(e) => {
                if !std::mem::replace(&mut complained, true) {
                    warn!(primary, error = %e, "cannot renew this node's lease; it stops serving data when the lease lapses");
                }
            }
        }
        std::thread::sleep(every);
    }
}

/// The primary's record of nodes declared dead: per node, the extents of its replicas that
/// were dropped (stale now), freed on the node before it serves again. Its lock also
/// serialises declaring a node dead with taking it back.
#[derive(Default)]
pub struct Discards(Mutex<HashMap<u32, Vec<u64>>>);

/// Primary: data node `id` is out (its lease lapsed): no new data goes there, and it is dropped
/// from every stripe that has another replica. Does nothing for a node whose lease holds (it
/// renewed meanwhile). `joined`: the node just joined again with empty memory, so its old
/// replicas are dropped, but it is up.
pub fn declare_dead(node: &Node, id: u32, why: &str, joined: bool) {
    let (Some(meta), Some(leases)) = (&node.meta, &node.node_leases) else {
        return;
    };
    let mut discards = node.discards.0.lock().expect("discards lock");
    if !joined {
        if leases.check(id as u64).is_ok() {
            return;
        }
        node.members.mark_down(id, why);
    }
    let d = meta
        .lock()
        .expect("metadata lock")
        .namespace
        .drop_node(id, node);
    if !d.extents.is_empty() || d.lost > 0 {
        warn!(
            node = id,
            reason = why,
            dropped = d.extents.len(),
            unavailable = d.lost,
            "memory node out of the cluster: its replicas are dropped from the stripes that have another; stripes it alone held fail with EIO until it returns"
        );
    }
    let pending = discards.entry(id).or_default();
    if joined {
        pending.clear(); // its memory is new
    } else {
        pending.extend(d.extents);
    }
}

/// Primary: renews data node `id`'s lease. A node declared dead is taken back here: the
/// replicas dropped from it are freed on it first (their tags tombstoned, so a mount that
/// cached them re-reads the layout), then its lease starts again and new data may go there.
pub fn renew(node: &Node, id: u32) -> Result<Duration, Refusal> {
    let Some(leases) = &node.node_leases else {
        return Err(Refusal::new(
            ErrorCode::NotPrimary,
            "node leases are kept by the primary",
        ));
    };
    if let Ok(d) = leases.renew(id as u64) {
        return Ok(d);
    }
    declare_dead(node, id, "its lease lapsed", false);
    let mut discards = node.discards.0.lock().expect("discards lock");
    let peer = node.members.peer(id)?;
    let pending = discards.remove(&id).unwrap_or_default();
    for (i, &offset) in pending.iter().enumerate() {
        match peer.free(offset) {
            Ok(_) | Err(RpcError::Refused { .. }) => {}
            Err(e) => {
                discards.insert(id, pending[i..].to_vec());
                return Err(Refusal::new(
                    ErrorCode::Unavailable,
                    format!("stale replicas on node {id} not freed yet: {e}"),
                ));
            }
        }
    }
    leases.end(id as u64);
    leases.hold(id as u64);
    node.members.mark_up(id);
    info!(
        node = id,
        freed = pending.len(),
        "memory node back: its dropped replicas are freed, and it takes new data again"
    );
    Ok(leases.lease())
}

/// Primary: a mount could not write to data node `id`. Answers once the node is out (its lease
/// lapsed: it serves nothing any more, so writes may go on without it), or refuses if it keeps
/// renewing for a whole lease (the mount's connection failed, not the node).
pub fn node_failed(node: &Node, id: u32) -> Result<(), Refusal> {
    let Some(leases) = &node.node_leases else {
        return Err(Refusal::new(
            ErrorCode::NotPrimary,
            "node leases are kept by the primary",
        ));
    };
    if id == node.cfg.node_id {
        return Err(Refusal::new(
            ErrorCode::Unavailable,
            format!("memory node {id} is the primary and answers"),
        ));
    }
    node.members.peer(id)?;
    let until = std::time::Instant::now() + leases.lease() + Duration::from_millis(500);
    loop {
        if leases.check(id as u64).is_err() {
            // Idempotent: the lease checker may be dropping it right now.
            declare_dead(node, id, "its lease lapsed", false);
            return Ok(());
        }
        if std::time::Instant::now() > until {
            return Err(Refusal::new(
                ErrorCode::Unavailable,
                format!("memory node {id} still renews its lease with the primary"),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Re-replication progress (primary only).
#[derive(Default)]
pub struct Rebuilds {
    pub stripes: AtomicU64,
    pub bytes: AtomicU64,
}

/// How often the primary looks for degraded stripes to copy.
pub const REBUILD_EVERY: Duration = Duration::from_millis(200);

/// Primary: one round of re-replication. Copies degraded stripes back to their replication
/// factor, at most `rate` bytes per second (so foreground I/O keeps going), one stripe per
/// hold of the metadata lock.
pub fn rebuild_round(node: &Node, rate: u64) {
    let Some(meta) = &node.meta else { return };
    let mut budget = (rate as u128 * REBUILD_EVERY.as_millis() / 1000) as u64;
    let work = meta
        .lock()
        .expect("metadata lock")
        .namespace
        .degraded_stripes(64);
    for (ino, stripe) in work {
        if budget == 0 || node.is_stopping() {
            break;
        }
        let copied = meta
            .lock()
            .expect("metadata lock")
            .namespace
            .rebuild(ino, stripe, node);
        match copied {
            Ok(0) => {}
            Ok(n) => {
                budget = budget.saturating_sub(n);
                node.rebuilds.stripes.fetch_add(1, Ordering::Relaxed);
                node.rebuilds.bytes.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                warn!(ino, stripe, error = %e, "re-replicating a stripe failed; retrying later")
            }
        }
    }
}
