//! The metadata service's standby: a data node that mirrors the primary's namespace and takes
//! over when the primary dies. Only with a coordinator that outlives the primary (etcd, or one
//! served apart): the one embedded in the primary dies with it, so nobody would be left to
//! elect another.
//!
//! * **Sync.** The primary picks a live data node ([`keep`]) and, under the metadata lock,
//!   switches journaling on and sends it a snapshot ([`ControlRequest::Mirror`]): the
//!   namespace and the bytes of every record and table, which the standby writes at the same
//!   offsets of its own metadata area. Then it writes the coordinator's `standby` key naming
//!   the node. The key has no lease: it must outlive the primary.
//! * **Journal.** Every change of the namespace is journaled (`rackfs_meta::journal`), its
//!   entries queued in order under the metadata lock ([`Standby::queue`]), and they reach the
//!   standby ([`ControlRequest::Journal`]) before the change, or any request after it, is
//!   answered ([`Standby::commit`]: group commit, many changes per round trip). A standby that
//!   does not take them is dropped: the `standby` key is deleted first, then the primary goes
//!   on alone.
//!   **Invariant: while the `standby` key names a node, every change the primary answered is
//!   in that node's mirror.**
//! * **Take-over.** A data node with a mirror looks at the `primary` key with each renewal of
//!   its lease (`crate::liveness::Renewer`). Once the key is gone and `standby` names it, it
//!   campaigns; elected, it checks `standby` still names it, then serves its mirror as the
//!   primary ([`take_over`]): lock trees start afresh, the old primary is dropped from the
//!   replicas like a dead data node, data connections of the old primary's sessions are fenced
//!   (every data node does so when it follows the new primary), and mounts reconnect, adopt
//!   their old sessions' opens and report again the sizes they wrote.
//!
//! What each side keeps between these steps is its [`Standby`].
//!
//! [`Standby`]: crate::standby_state::Standby
//! [`Standby::queue`]: crate::standby_state::Standby::queue
//! [`Standby::commit`]: crate::standby_state::Standby::commit

use std::sync::Arc;
use std::time::Duration;

use rackfs_coord::Write;
use rackfs_meta::MetaService;
use rackfs_proto::control::{ControlRequest, ControlResponse, ErrorCode};
use rackfs_proto::link::ControlLink;
use rackfs_proto::Refusal;
use tracing::{error, info, warn};

use crate::coordinator::{parse_standby, primary_value, standby_value};
use crate::election::Primacy;
use crate::node::{first_session, Node};

/// Bytes of a snapshot per [`ControlRequest::Mirror`] (well inside a frame).
const PIECE: usize = 4 << 20;

/// Primary: makes a live data node the standby if there is none (with a coordinator that
/// elects); runs a few times
/// per lease.
pub fn keep(node: &Node) {
    if !node.cfg.coordinator.elects()
        || !node.cfg.standby
        || node.standby.follower().is_some()
        || !node.serving()
    {
        return;
    }
    let retry = node.cfg.node_lease;
    if node.standby.failed_within(retry, node.clock.now()) {
        return;
    }
    let me = node.cfg.node_id;
    let Some(meta) = node.meta.get() else { return };
    let Some(id) = rackfs_meta::Storage::data_nodes(node)
        .into_iter()
        .find(|&id| id != me && !node.members.is_down(id))
    else {
        return;
    };
    // Reached before the metadata lock is taken: a stopped node answers only at the deadline,
    // and every change would wait for it meanwhile.
    let synced = connect(node, id).and_then(|peer| {
        let mut m = meta.lock().expect("metadata lock");
        let seq = sync(node, &mut m, id, &*peer).inspect_err(|_| {
            m.set_journaling(false);
        })?;
        node.standby.set_follower(id, peer);
        Ok(seq)
    });
    match synced {
        Ok(seq) => info!(
            standby = id,
            seq, "metadata standby in sync: every change reaches it before it is answered"
        ),
        Err(why) => {
            node.standby.sync_failed(node.clock.now());
            warn!(standby = id, error = %why, "cannot make this node the metadata standby; retrying later");
        }
    }
}

/// The journal connection to node `id`, this primary's epoch declared on it.
fn connect(node: &Node, id: u32) -> Result<Arc<dyn ControlLink>, String> {
    let addr = node
        .members
        .addr_of(id)
        .ok_or_else(|| format!("node {id} has no address"))?;
    let peer = crate::term::connect_node(
        &*node.dial,
        &addr,
        &node.cfg.secret,
        &format!("journal-{}", node.cfg.name),
        node.cfg.node_id,
        node.term.epoch(),
    )
    .map_err(|e| e.to_string())?;
    peer.set_deadline((node.cfg.node_lease / 2).max(Duration::from_millis(200)));
    Ok(peer)
}

/// Sends node `id` a snapshot of `m` over `peer` with journaling on, then names it in the
/// `standby` key; returns the journal position the snapshot stands at.
fn sync(node: &Node, m: &mut MetaService, id: u32, peer: &dyn ControlLink) -> Result<u64, String> {
    let seq = m.set_journaling(true);
    let bytes = crate::standby_state::snapshot(m, node.data_region())?;
    let pieces: Vec<&[u8]> = bytes.chunks(PIECE).collect();
    for (i, piece) in pieces.iter().enumerate() {
        let req = ControlRequest::Mirror {
            primary: node.cfg.node_id,
            seq,
            last: i + 1 == pieces.len(),
            piece: piece.to_vec(),
        };
        match peer.call(&req) {
            Ok(ControlResponse::Ok) => {}
            Ok(other) => return Err(format!("unexpected answer {other:?}")),
            Err(e) => return Err(e.to_string()),
        }
    }
    let guard = node
        .term
        .guard()
        .ok_or("this node holds no primary's term")?;
    let name = Write::Put {
        key: "standby".into(),
        value: standby_value(id, node.cfg.node_id),
        lease: None,
    };
    node.coord
        .write_if(&guard, name)
        .map_err(|e| format!("cannot name the standby in the coordinator: {e}"))?;
    Ok(seq)
}

/// Data node: one piece of a snapshot from the primary (see [`Standby::take_piece`](crate::standby_state::Standby::take_piece)).
pub fn take_piece(
    node: &Node,
    primary: u32,
    seq: u64,
    last: bool,
    piece: Vec<u8>,
) -> Result<(), Refusal> {
    if node.meta.get().is_some() {
        return Err(Refusal::new(
            ErrorCode::Invalid,
            "the primary mirrors nobody",
        ));
    }
    let area = node.store.meta_len();
    node.standby
        .take_piece(node.data_region(), area, (primary, seq, last), piece)
}

/// Data node: journal entries from the primary, replayed in order (see
/// [`Standby::take_journal`](crate::standby_state::Standby::take_journal)).
pub fn take_journal(node: &Node, bytes: &[u8]) -> Result<(), Refusal> {
    let applied = node.standby.take_journal(node.data_region(), bytes)?;
    node.counters
        .journal_entries
        .fetch_add(applied, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Data node: whether to campaign for primary now: it has a mirror, the `primary` key is gone
/// and `standby` names this node.
pub fn should_take_over(node: &Node) -> bool {
    node.standby.has_mirror() && matches!(node.coord.get("primary"), Ok(None)) && named(node)
}

fn named(node: &Node) -> bool {
    matches!(node.coord.get("standby"), Ok(Some(v)) if parse_standby(&v) == Some(node.cfg.node_id))
}

/// Data node with a mirror: campaigns for primary and, elected, becomes it over the mirror
/// (`start_primary`, the daemon's, starts the node as the primary serving it). Returns whether
/// it did.
pub fn take_over(node: &Arc<Node>, start_primary: fn(&Arc<Node>, MetaService)) -> bool {
    let started = node.clock.now();
    let sessions_from = first_session(&*node.clock);
    let me = node.members.me();
    let primacy = match Primacy::campaign(
        node.coord.clone(),
        primary_value(&me, sessions_from),
        node.cfg.node_lease,
        &node.cfg.cluster,
        &*node.clock,
    ) {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "the standby was not elected primary");
            return false;
        }
    };
    node.term.begin(primacy.lease(), primacy.epoch());
    let Some(mirror) = node.standby.take_mirror() else {
        return give_up(node, primacy, "the mirror was dropped meanwhile");
    };
    if !named(node) {
        return give_up(
            node,
            primacy,
            "the primary dropped this standby before it died",
        );
    }
    let clear = Write::Delete {
        key: "standby".into(),
    };
    if let Err(e) = node.coord.write_if(&primacy.guard(), clear) {
        warn!(error = %e, "cannot clear the standby key; the next standby overwrites it");
    }
    let old = mirror.primary;
    let old_sessions = mirror.ns.sessions();
    let first = old_sessions
        .iter()
        .max()
        .map_or(sessions_from, |&s| sessions_from.max(s + 1));
    node.next_session
        .store(first, std::sync::atomic::Ordering::SeqCst);
    if let Err(e) = node
        .store
        .meta_adopt(&node.cfg.name, &mirror.ns.meta_extents())
    {
        error!(error = %e, "the mirror's records do not fit this node's metadata area");
        return give_up(node, primacy, "its metadata area does not hold the mirror");
    }
    // Data connections of the old primary's sessions end here, as on every data node that
    // follows the new primary: writes under the old lock trees cannot outlive it.
    node.fences.fence_below(first, Duration::from_secs(3));
    let mut meta = MetaService::over(mirror.ns, node.cfg.quarantine, mirror.seq);
    meta.set_answered(mirror.answered);
    meta.forget_old_lock_trees(&**node);
    // What the old primary had journaled of each file's size, before any mount writes here;
    // trims wait until the mounts report theirs.
    meta.take_over(&**node);
    // Mounts follow within a lock lease or so (their watchers notice), then reclaim their
    // processes' record locks; new locks wait for the grace period.
    meta.take_over_record_locks(&**node, 2 * node.cfg.lock_lease);
    // Before anyone is served: no layout handed out lists the old primary's replicas.
    let d = meta.drop_node(old, &**node);
    warn!(
        node = old,
        dropped = d.extents.len(),
        unavailable = d.lost,
        "the old primary is out: its replicas are dropped where another copy lives"
    );
    // Every replica listed on this node is what it holds now (a move or retag the old primary
    // made in a change the mirror lacks is followed, not left to read EIO); each data node's
    // are when it follows this primary (`rejoined_after_take_over`).
    rejoined_after_take_over(node.cfg.node_id, &mut meta, node);
    node.sessions_from
        .store(first, std::sync::atomic::Ordering::SeqCst);
    node.serve.extend_to(node.lease_ns(primacy.until()));
    start_primary(node, meta);
    node.start_thread("primary-lease", move |n| primacy.run(&n));
    end_orphans(node, old_sessions);
    info!(old_primary = old, seq = mirror.seq, took = ?node.clock.now().saturating_sub(started), "took over as primary: serving the namespace mirrored from the old primary");
    true
}

/// A primary that took over: data node `id` follows it (or it is this node), keeping its
/// memory: the replicas the tables list there follow the moves and retags the old primary
/// made in changes its standby never had (see `rackfs_meta::history`).
pub fn rejoined_after_take_over(id: u32, meta: &mut MetaService, node: &Node) {
    let r = meta.roll_forward(id, node);
    if r != Default::default() {
        node.watchers.forget_everything();
        warn!(node = id, relocated = r.relocated, dropped = r.dropped, freed = r.freed, unanswered = r.unanswered, "replicas the old primary changed in its last changes are followed to where their node holds them");
    }
}

/// Elected without a usable mirror: steps down (the lease is revoked so another may run).
fn give_up(node: &Node, primacy: Primacy, why: &str) -> bool {
    error!(
        reason = why,
        "elected primary but cannot serve the namespace: stepping down"
    );
    primacy.resign();
    node.serve.extend_to(0);
    false
}

/// The old primary's sessions that no mount adopted within a few leases end then (their mount
/// died with the primary): their opens are released.
fn end_orphans(node: &Arc<Node>, sessions: Vec<u64>) {
    let wait = 2 * node.cfg.lock_lease + 2 * node.cfg.node_lease;
    node.start_thread("orphans", move |n| {
            n.clock.sleep(wait);
            if !n.serving() {
                return; // deposed meanwhile: the sessions are the next primary's concern
            }
            n.with_meta(|m| {
                let left: Vec<u64> = m
                    .namespace
                    .sessions()
                    .into_iter()
                    .filter(|s| sessions.contains(s))
                    .collect();
                for &s in &left {
                    m.end_session(s, &*n);
                }
                if !left.is_empty() {
                    info!(sessions = left.len(), "sessions of the old primary no mount took over are ended: their open files are released");
                }
                // The mounts that had a write in flight at the take-over have asked by now
                // (last: the closes of the sessions just ended trim nothing to a size a
                // mount that is merely late would still report).
                m.sizes_settled(&*n);
            });
    });
}
