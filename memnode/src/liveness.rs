//! Data nodes' membership (see `rackfs_verbs::lease` and [`crate::coordinator`]): a data node
//! serves data only while it holds its lease with the coordinator, under the epoch the primary
//! admitted it with, and the primary declares a node dead (drops it from every stripe's
//! replicas) only once that lease has lapsed.
//!
//! * A data node registers under a new lease (its *epoch*), is admitted by the primary, then
//!   renews every quarter of the lease ([`Renewer`]; admitted before it serves anyone), timing
//!   each lease from when it sent the renewal. A lapsed lease cannot be renewed: the node is
//!   fenced and starts over under a new epoch. Its [`ServeLease`] is what its tcp NIC threads
//!   check before every batch and its handshake before every data connection; it copies the
//!   deadline into each shm client's counter block ([`LeaseWords`],
//!   `rackfs_verbs::shm::LEASE_WORD`), which the client checks; when it lapses, rdma clients'
//!   connections are shut down (their queue pairs go). A node stopped outright cannot do the
//!   last: its NIC goes on serving rdma reads.
//! * The primary looks at the coordinator's members a few times per lease ([`check_members`],
//!   [`Epochs`]). A node whose lease lapsed is declared dead: marked down
//!   (no new data goes there) and dropped from every stripe that has another replica.
//! * Stripes left with fewer replicas than their file asks for are copied onto other live
//!   nodes in the background, rate-bounded ([`rebuild_round`], `rackfs_meta::file::File::rebuild`).
//! * A node that comes back under a new epoch is admitted ([`admit`]) only after the primary
//!   freed on it the replicas it dropped (stale now; tombstoning their tags sends mounts that
//!   cached them back to the layout). Stripes it alone held were never dropped and serve
//!   again. A node that joins (again) is new and empty, so joining drops its old replicas.
//!
//! [`ServeLease`]: rackfs_verbs::lease::ServeLease
//! [`LeaseWords`]: crate::lease_words::LeaseWords
//! [`Epochs`]: crate::epochs::Epochs

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rackfs_coord::{renew, renew_every, CoordError, Coordinator, Held, LeaseId};
use rackfs_proto::control::{ControlRequest, ControlResponse, ErrorCode};
use rackfs_proto::link::ControlLink;
use rackfs_proto::namespace::Change;
use rackfs_proto::{Refusal, RpcError};
use tracing::{info, warn};

use crate::coordinator::{members, node_key, node_value, parse_primary};
use crate::node::{FreesGo, Node};
use crate::replicas::Discard;
use crate::term::PRIMARY_KEY;

/// How a data node takes over as primary once the coordinator's `primary` key is gone. The
/// daemon installs it in the [`Renewer`]: the standby's take-over and the start of a primary
/// sit above liveness, so the renewer only notices when to call them.
#[derive(Clone, Copy)]
pub struct TakeOver {
    /// Whether to campaign now: this node is the metadata standby and the key is gone.
    pub should: fn(&Node) -> bool,
    /// Campaigns and, elected, serves as the primary; returns whether it did.
    pub run: fn(&Arc<Node>) -> bool,
}

/// A data node's side of its membership: holds a lease with the coordinator, registers under
/// it (`nodes/<id>`, its epoch being the lease's id), asks the primary to admit it under that
/// epoch, then renews the lease every quarter of its ttl, timing it from when the renewal was
/// sent. A lease that lapsed cannot be renewed: the node starts over with a new epoch.
pub struct Renewer {
    coord: Arc<dyn Coordinator>,
    primary: String,
    /// The connection to the primary (opened through the node's dial).
    conn: Option<Arc<dyn ControlLink>>,
    /// The lease this node registered under, and whether the primary admitted it.
    lease: Option<(Held, bool)>,
    every: Duration,
    complained: bool,
    lapsed: bool,
    /// Set while this node campaigns to take over as primary (a thread of its own).
    taking_over: Arc<AtomicBool>,
    take_over: TakeOver,
}

impl Renewer {
    /// A renewer for a data node that joined the primary at `primary`; `take_over` is how it
    /// becomes the primary itself.
    pub fn new(coord: Arc<dyn Coordinator>, primary: &str, take_over: TakeOver) -> Renewer {
        Renewer {
            coord,
            primary: primary.into(),
            conn: None,
            lease: None,
            every: Duration::from_millis(100),
            complained: false,
            lapsed: false,
            taking_over: Arc::default(),
            take_over,
        }
    }

    /// One round: registers, asks for admission or renews, as the lease's state calls for;
    /// with a coordinator that elects, then follows the elected primary.
    pub fn renew(&mut self, node: &Arc<Node>) {
        if let Err(why) = self.step(node) {
            self.trouble(&why);
        }
        self.check(node);
        // Admitted or not: a node whose lease lapsed while the primary changed asks the old
        // one to admit it under its new epoch, which it never will; it must follow the new
        // one first (found by the whole-cluster simulation, `memnode/tests/world.rs`).
        if let (true, Some((held, _))) = (node.cfg.coordinator.elects(), self.lease) {
            self.follow(node, held.lease);
        }
    }

    /// Follows the primary the coordinator's `primary` key names once another was elected
    /// (joining it with this node's memory and epoch, after fencing the old primary's mounts'
    /// data connections), or, when the key is gone and this node is the metadata standby,
    /// campaigns to take over ([`TakeOver`]; the protocol is the `standby` module's).
    fn follow(&mut self, node: &Arc<Node>, epoch: LeaseId) {
        match node.coord.created(PRIMARY_KEY) {
            Ok(Some((term, v))) => {
                // Requests of earlier primaries are refused from now on (see `crate::term`).
                node.followed.learn(term);
                let Some((id, tcp, sessions_from)) = parse_primary(&v) else {
                    return;
                };
                if id == node.cfg.node_id || node.members.primary_id() == Some(id) {
                    return;
                }
                info!(primary = id, %tcp, "another primary was elected: following it");
                node.fences
                    .fence_below(sessions_from, Duration::from_secs(3));
                match node
                    .members
                    .join(&*node.dial, &tcp, &node.cfg.secret, Some(epoch))
                {
                    Ok(()) => {
                        self.primary = tcp;
                        self.conn = None;
                    }
                    Err(e) => {
                        warn!(primary = id, error = %e, "cannot join the new primary yet; retrying")
                    }
                }
            }
            Ok(None) if (self.take_over.should)(node) => {
                if self.taking_over.swap(true, Ordering::SeqCst) {
                    return;
                }
                warn!("the primary's key is gone and this node is its metadata standby: campaigning to take over");
                let (flag, run) = (self.taking_over.clone(), self.take_over.run);
                node.start_thread("take-over", move |n| {
                    if !run(&n) {
                        flag.store(false, Ordering::SeqCst);
                    }
                });
            }
            _ => {}
        }
    }

    fn step(&mut self, node: &Node) -> Result<(), String> {
        let now = || node.clock.now();
        match &mut self.lease {
            None => {
                let sent = now();
                let (lease, ttl) = self
                    .coord
                    .grant(node.cfg.node_lease)
                    .map_err(|e| e.to_string())?;
                let value = node_value(&node.members.me(), lease);
                self.coord
                    .put(&node_key(node.cfg.node_id), &value, Some(lease))
                    .map_err(|e| e.to_string())?;
                info!(epoch = lease, coordinator = %self.coord.describe(), "registered this node under a new epoch");
                self.lease = Some((Held::new(lease, sent, ttl), false));
                self.every = renew_every(ttl);
            }
            Some((held, _)) => match renew(&*self.coord, held, now()) {
                Ok(()) => {}
                Err(CoordError::Expired(_)) => {
                    warn!(epoch = held.lease, "this node's lease lapsed: it is fenced, and registers under a new epoch to be admitted again");
                    self.lease = None;
                    // At once, not a renewal period later.
                    return self.step(node);
                }
                Err(e) => return Err(e.to_string()),
            },
        }
        let Some((held, admitted)) = self.lease else {
            return Ok(());
        };
        if !admitted {
            self.admit(node, held.lease)?;
            self.lease = Some((held, true));
        }
        node.serve.extend_to(node.lease_ns(held.until()));
        node.lease_words.publish(node.serve.until());
        if std::mem::replace(&mut self.complained, false) {
            info!("this node's lease is renewed again");
        }
        Ok(())
    }

    /// Asks the primary to admit this node under epoch `lease`.
    fn admit(&mut self, node: &Node, lease: LeaseId) -> Result<(), String> {
        let c = match self.conn.take() {
            Some(c) => c,
            None => node
                .dial
                .connect(
                    &self.primary,
                    &node.cfg.secret,
                    &format!("lease-{}", node.cfg.name),
                )
                .map_err(|e| e.to_string())?,
        };
        let r = c.call(&ControlRequest::NodeAdmit {
            node: node.cfg.node_id,
            epoch: lease,
        });
        self.conn = Some(c);
        match r {
            Ok(ControlResponse::Lease { .. }) => {
                info!(epoch = lease, "admitted by the primary: serving data");
                Ok(())
            }
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(format!("the primary did not admit this node: {e}")),
        }
    }

    fn trouble(&mut self, why: &str) {
        if !std::mem::replace(&mut self.complained, true) {
            warn!(coordinator = %self.coord.describe(), primary = %self.primary, error = why, "cannot renew this node's lease; it stops serving data when the lease lapses");
        }
    }

    /// Once the lease lapsed: logged, and rdma clients are cut off.
    fn check(&mut self, node: &Node) {
        if node.serving() {
            self.lapsed = false;
        } else if !std::mem::replace(&mut self.lapsed, true) {
            warn!("this node's lease lapsed: it serves no data until it is admitted again");
            node.lease_words.lapsed();
        }
    }

    /// Renews every quarter of the lease while the node runs as a data node (on a thread of
    /// its own); a node that took over as primary gives its data node's lease up.
    pub fn run(mut self, node: &Arc<Node>) {
        while !node.is_stopping() {
            node.clock.sleep(self.every);
            if node.meta.get().is_some() {
                if let Some((held, _)) = self.lease {
                    let _ = self.coord.revoke(held.lease);
                }
                return;
            }
            self.renew(node);
        }
    }
}

/// Primary: data node `id` is out (its lease lapsed): no new data goes there, and it is
/// dropped from every stripe that has another replica. Does nothing for a node that is live
/// (it renewed meanwhile).
fn declare_dead(node: &Node, id: u32, why: &str) {
    let Some(epochs) = node.epochs.get() else {
        return;
    };
    let mut discards = node.discards.lock();
    if epochs.is_live(id) {
        return;
    }
    node.members.mark_down(id, why);
    drop_replicas(node, id, why, &mut discards, false);
}

/// Drops node `id` from every stripe that has another replica. `empty`: the node's memory is
/// new (it joined again), so there is nothing on it to free later.
fn drop_replicas(
    node: &Node,
    id: u32,
    why: &str,
    discards: &mut HashMap<u32, Vec<Discard>>,
    empty: bool,
) {
    // The frees other changes queued go by the frees thread, not this one: sending them notes
    // those of a down node in `discards`, which the caller holds (it waited on itself for
    // good, and every later declaration, admission and NodeFailed behind it).
    let Some(d) = node.with_meta_freeing(FreesGo::Soon, |m| m.drop_node(id, node)) else {
        return;
    };
    if !d.extents.is_empty() {
        // Files' blocks changed: the mounts forget what they answer themselves.
        node.watchers.forget_everything();
    }
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
    if empty {
        pending.clear();
    } else {
        let stale = d.extents.into_iter().chain(d.pooled);
        pending.extend(stale.map(|(base, tag)| (base, Some(tag))));
    }
}

/// Primary: node `id` joined again with empty memory: its old replicas are dropped, and it
/// takes data only once admitted under a new epoch.
pub fn rejoined(node: &Node, id: u32) {
    let Some(epochs) = node.epochs.get() else {
        return;
    };
    let mut discards = node.discards.lock();
    epochs.forget(id);
    drop_replicas(node, id, "it joined again, empty", &mut discards, true);
}

/// Primary: admits data node `id` under `epoch`, a lease under which the coordinator shows it
/// registered. A node coming back from an earlier epoch is fenced by the new one: its replicas
/// of the old epoch are dropped where another copy exists and freed on it (their tags
/// tombstoned, so a mount that cached them re-reads the layout) before it is admitted.
/// Stripes it alone held were never dropped and serve again.
pub fn admit(node: &Node, id: u32, epoch: LeaseId) -> Result<Duration, Refusal> {
    let Some(epochs) = node.epochs.get() else {
        return Err(Refusal::new(
            ErrorCode::NotPrimary,
            "data nodes are admitted by the primary",
        ));
    };
    let unavailable = |e: CoordError| {
        Refusal::new(
            ErrorCode::Unavailable,
            format!("cannot check node {id}'s lease with the coordinator: {e}"),
        )
    };
    let registered = members(&*node.coord).map_err(unavailable)?;
    if !registered.contains(&(id, epoch)) {
        return Err(Refusal::new(
            ErrorCode::Fenced,
            format!("node {id} is not registered under epoch {epoch:x} (its lease lapsed?)"),
        ));
    }
    let mut discards = node.discards.lock();
    let before = epochs.admitted(id);
    if before == Some(epoch) {
        return Ok(node.cfg.node_lease);
    }
    if before.is_some() {
        node.members
            .mark_down(id, "it comes back under a new epoch");
        drop_replicas(node, id, "its earlier epoch ended", &mut discards, false);
    }
    // The replicas just dropped are freed only by a primary that still holds its lease (a
    // deposed one, whose standby took over on a mirror that keeps them, frees nothing).
    if !node.serving() {
        return Err(Refusal::new(
            ErrorCode::NotPrimary,
            format!(
                "primary {} lost its lease while admitting node {id}",
                node.cfg.name
            ),
        ));
    }
    let peer = node.members.peer(id)?;
    let pending = discards.remove(&id).unwrap_or_default();
    for (i, &(offset, tag)) in pending.iter().enumerate() {
        match peer.free(offset, tag) {
            Ok(_) => {}
            // Freed already (a free that timed out while the node was stopped ran when it
            // resumed), or the memory went to another stripe since: left as it is.
            Err(RpcError::Refused { message, .. }) => {
                tracing::debug!(node = id, offset, why = %message, "a stale replica is freed already")
            }
            Err(e) => {
                discards.insert(id, pending[i..].to_vec());
                return Err(Refusal::new(
                    ErrorCode::Unavailable,
                    format!("stale replicas on node {id} not freed yet: {e}"),
                ));
            }
        }
    }
    epochs.admit(id, epoch);
    node.members.mark_up(id);
    if before.is_some() || !pending.is_empty() {
        info!(node = id, epoch, freed = pending.len(), "memory node back under a new epoch: its dropped replicas are freed, and it takes new data again");
    } else {
        info!(node = id, epoch, "memory node admitted: it takes new data");
    }
    Ok(node.cfg.node_lease)
}

/// Primary: one look at the coordinator's members; nodes whose lease lapsed are declared dead.
pub fn check_members(node: &Node) {
    let Some(epochs) = node.epochs.get() else {
        return;
    };
    match members(&*node.coord) {
        Ok(registered) => {
            for id in epochs.refresh(registered) {
                declare_dead(node, id, "its lease lapsed");
            }
        }
        Err(e) => {
            warn!(coordinator = %node.coord.describe(), error = %e, "cannot read the cluster's members from the coordinator; no node is declared dead meanwhile")
        }
    }
}

/// Primary: a mount could not write to data node `id`. Answers once the node is out (its lease
/// lapsed: it serves nothing any more, so writes may go on without it), or refuses if it keeps
/// its lease for a whole lease (the mount's connection failed, not the node).
pub fn node_failed(node: &Node, id: u32) -> Result<(), Refusal> {
    let Some(epochs) = node.epochs.get() else {
        return Err(Refusal::new(
            ErrorCode::NotPrimary,
            "data nodes' leases are watched by the primary",
        ));
    };
    if id == node.cfg.node_id {
        return Err(Refusal::new(
            ErrorCode::Unavailable,
            format!("memory node {id} is the primary and answers"),
        ));
    }
    let until = node.clock.now() + node.cfg.node_lease + Duration::from_millis(1500);
    if node.members.peer(id).is_err() {
        // Not a member of this primary: an old primary after a take-over, whose stripes lose
        // it (nothing of it is live), or a data node that has not followed this primary yet
        // (after a take-over; its key with the coordinator lives and it joins within a
        // renewal): its replicas are kept, and the writer tries again once it joined.
        let unavailable = |why: String| Err(Refusal::new(ErrorCode::Unavailable, why));
        loop {
            match members(&*node.coord).map(|m| m.iter().any(|&(n, _)| n == id)) {
                Ok(false) => {
                    let d = node.with_meta(|m| m.drop_node(id, node));
                    if d.is_some_and(|d| !d.extents.is_empty()) {
                        node.watchers.forget_everything();
                    }
                    return Ok(());
                }
                _ if node.members.peer(id).is_ok() => {
                    return unavailable(format!(
                        "memory node {id} has just joined this primary: write again"
                    ));
                }
                _ if node.clock.now() > until => {
                    return unavailable(format!(
                        "memory node {id} holds its lease but has not joined this primary yet"
                    ));
                }
                _ => node.clock.sleep(Duration::from_millis(20)),
            }
        }
    }
    loop {
        if !epochs.is_live(id) {
            // Idempotent: the member check may be dropping it right now.
            declare_dead(node, id, "its lease lapsed");
            return Ok(());
        }
        if node.clock.now() > until {
            return Err(Refusal::new(
                ErrorCode::Unavailable,
                format!("memory node {id} still holds its lease"),
            ));
        }
        node.clock.sleep(Duration::from_millis(20));
    }
}

/// How often the primary looks for degraded stripes to copy.
pub const REBUILD_EVERY: Duration = Duration::from_millis(200);

/// Inodes looked at per look for degraded stripes (under the metadata lock): a namespace of
/// up to this many files is looked over whole every round, a larger one over several rounds.
const SCAN_BUDGET: usize = 8192;

/// Primary: one round of re-replication. Copies degraded stripes back to their replication
/// factor, at most `rate` bytes per second (so foreground I/O keeps going), one stripe per
/// hold of the metadata lock.
pub fn rebuild_round(node: &Node, rate: u64) {
    let Some(meta) = node.meta.get() else { return };
    let mut budget = (rate as u128 * REBUILD_EVERY.as_millis() / 1000) as u64;
    let from = node.rebuilds.scan_from.load(Ordering::Relaxed);
    let (work, next) = meta
        .lock()
        .expect("metadata lock")
        .namespace
        .degraded_stripes(from, SCAN_BUDGET, 64);
    node.rebuilds.scan_from.store(next, Ordering::Relaxed);
    for (ino, stripe) in work {
        if budget == 0 || node.is_stopping() {
            break;
        }
        let copied = node
            .with_meta(|m| m.rebuild(ino, stripe, node))
            .expect("primary");
        match copied {
            Ok(0) => {}
            Ok(n) => {
                // The file's blocks grew back: the mounts forget them (nobody waits).
                node.watchers.publish(0, vec![Change::Blocks { ino }]);
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
