//! Data nodes' leases with the primary (see `rackfs_verbs::lease`): a data node serves data
//! only while the primary renews its lease, and the primary declares a node dead (drops it
//! from every stripe's replicas) only once its lease has lapsed.
//!
//! * A data node renews every quarter of the lease, on a control connection of its own
//!   ([`Renewer`]; the first renewal before it serves anyone), timing each lease from when it
//!   sent the renewal. Its [`ServeLease`] is what its tcp NIC threads check before every batch
//!   and its handshake before every data connection; it copies the deadline into each shm
//!   client's counter block ([`LeaseWords`], `rackfs_verbs::shm::LEASE_WORD`), which the client
//!   checks; when it lapses, rdma clients' connections are shut down (their queue pairs go).
//!   A node stopped outright cannot do the last: its NIC goes on serving rdma reads.
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
use std::os::fd::{AsRawFd, OwnedFd};
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

/// What enforces this node's lease beyond its own NIC threads: the counter blocks of its shm
/// clients (their copy of the lease) and the sockets of its rdma clients (closed when the lease
/// lapses, which destroys their queue pairs: the NIC serves them without the node's CPU).
#[derive(Default)]
pub struct LeaseWords {
    blocks: Mutex<Vec<Weak<Region>>>,
    rdma: Mutex<Vec<Weak<OwnedFd>>>,
}

impl LeaseWords {
    /// A new shm client's counter block: it gets the lease's deadline now and on every
    /// renewal, as long as it lives.
    pub fn add(&self, block: &Arc<Region>, lease: &ServeLease) {
        self.blocks
            .lock()
            .expect("lease words lock")
            .push(Arc::downgrade(block));
        set_lease(block, lease.until(), true);
    }

    /// An rdma client's socket (a duplicate), shut down if the lease lapses.
    pub fn add_rdma(&self, socket: &Arc<OwnedFd>) {
        self.rdma
            .lock()
            .expect("lease words lock")
            .push(Arc::downgrade(socket));
    }

    /// The lease lapsed: every rdma client's connection is shut down (they reconnect once it
    /// is renewed; the handshake refuses data connections meanwhile).
    fn lapsed(&self) {
        let mut v = self.rdma.lock().expect("lease words lock");
        for s in v.iter().filter_map(Weak::upgrade) {
            // SAFETY: shutdown(2) on a socket descriptor the connection's thread owns and keeps
            // open while this Arc lives; it only ends the connection.
            unsafe { libc::shutdown(s.as_raw_fd(), libc::SHUT_RDWR) };
        }
        v.clear();
    }

    /// Copies the lease's deadline into every live client's block.
    fn publish(&self, until: u64) {
        let mut v = self.blocks.lock().expect("lease words lock");
        v.retain(|w| match w.upgrade() {
            Some(b) => {
                set_lease(&b, until, false);
                true
            }
            None => false,
        });
    }
}

/// A data node's side of its lease: renews it with the primary on a control connection of its
/// own, timing each lease from when the renewal was sent.
pub struct Renewer {
    primary: String,
    conn: Option<ControlClient>,
    every: Duration,
    complained: bool,
    lapsed: bool,
}

impl Renewer {
    pub fn new(primary: &str) -> Renewer {
        Renewer {
            primary: primary.into(),
            conn: None,
            every: Duration::from_millis(100),
            complained: false,
            lapsed: false,
        }
    }

    /// Renews the lease once (connecting first if needed).
    pub fn renew(&mut self, node: &Node) {
        let c = match self.conn.take() {
            Some(c) => c,
            None => match ControlClient::connect(
                &self.primary,
                &node.cfg.secret,
                &format!("lease-{}", node.cfg.name),
            ) {
                Ok(c) => c,
                Err(e) => {
                    self.trouble(&e.to_string());
                    return self.check(node);
                }
            },
        };
        let sent = monotonic_ns();
        match c.call(&ControlRequest::NodeRenew {
            node: node.cfg.node_id,
        }) {
            Ok(ControlResponse::Lease { ms }) => {
                node.serve.extend_to(sent + ms * 1_000_000);
                node.lease_words.publish(node.serve.until());
                self.every = Duration::from_millis(ms / 4).max(Duration::from_millis(10));
                if std::mem::replace(&mut self.complained, false) {
                    info!("this node's lease is renewed again");
                }
                self.conn = Some(c);
            }
            Ok(other) => self.trouble(&format!("unexpected answer {other:?}")),
            Err(e) => self.trouble(&e.to_string()),
        }
        self.check(node);
    }

    fn trouble(&mut self, why: &str) {
        if !std::mem::replace(&mut self.complained, true) {
            warn!(primary = %self.primary, error = why, "cannot renew this node's lease; it stops serving data when the lease lapses");
        }
    }

    /// Once the lease lapsed: logged, and rdma clients are cut off.
    fn check(&mut self, node: &Node) {
        if node.serve.valid() {
            self.lapsed = false;
        } else if !std::mem::replace(&mut self.lapsed, true) {
            warn!("this node's lease lapsed: it serves no data until the primary renews it");
            node.lease_words.lapsed();
        }
    }

    /// Renews every quarter of the lease while the node runs (on a thread of its own).
    pub fn run(mut self, node: &Node) {
        while !node.is_stopping() {
            std::thread::sleep(self.every);
            self.renew(node);
        }
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
