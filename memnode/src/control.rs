//! The control RPC: [`answer`] carries out one request of a client session with the node's
//! parts ([`Node`]), the data nodes' liveness ([`crate::liveness`]: joins, admissions, failures)
//! and the metadata standby ([`crate::standby`]: snapshot and journal). It sits above all of
//! them (they use the node's parts, never the dispatch); each control connection (the `conn`
//! module) is one session and calls it per request.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rackfs_proto::control::{
    ClusterInfo, ControlRequest, ControlResponse, ErrorCode, NodeAddr, MAX_FREE_MANY,
    PROTOCOL_VERSION,
};
use rackfs_proto::link::Loopback;
use rackfs_proto::namespace::{MetaRequest, NewKind};
use rackfs_proto::record::TAG_SPACE;
use rackfs_proto::Refusal;
use tracing::warn;

use crate::alloc::GRANULE;
use crate::config::Role;
use crate::lease::Leases;
use crate::node::{FreesGo, Node, FENCE_WAIT};
use crate::qos_controller::QosRequest;

fn refused(code: ErrorCode, message: impl Into<String>) -> ControlResponse {
    Refusal::new(code, message).into()
}

/// Serves `node` at `at` on `lo`, for nodes of one process (tests, simulations): each
/// request goes to [`answer`], each closed connection ends its session. The loopback keeps
/// only a weak handle on the node (the node keeps the loopback, as its dial).
pub fn serve_on(lo: &Loopback, at: &str, node: &Arc<Node>) {
    let (serving, closing) = (Arc::downgrade(node), Arc::downgrade(node));
    lo.serve(
        at,
        node.cfg.node_id,
        &node.cfg.name,
        move |session, req| match serving.upgrade() {
            Some(n) => answer(&n, session, req),
            None => ControlResponse::Error {
                code: ErrorCode::Unavailable,
                message: "the node stopped".into(),
            },
        },
        Some(Arc::new(move |session| {
            if let Some(n) = closing.upgrade() {
                n.end_session(session);
            }
        })),
    );
}

/// Answers one control request of client session `session`.
pub fn answer(node: &Node, session: u64, req: ControlRequest) -> ControlResponse {
    node.counters.rpc(req.kind_index());
    if let Some(l) = node.leases.get() {
        let harmless = matches!(
            req,
            ControlRequest::Hello { .. }
                | ControlRequest::Ping
                | ControlRequest::Stats
                | ControlRequest::Cluster
                | ControlRequest::Renew { .. }
                | ControlRequest::NodeAdmit { .. }
                | ControlRequest::Coord(_)
                | ControlRequest::Primary { .. }
        );
        if let (false, Err(r)) = (harmless, l.check(session)) {
            return r.into();
        }
        // Admitting a data node drops and frees its old epoch's replicas: a primary whose
        // lease lapsed (deposed, perhaps, with a standby taking over on a mirror that still
        // lists them) must not.
        let acts = !harmless || matches!(req, ControlRequest::NodeAdmit { .. });
        if acts && !node.serving() {
            return refused(
                ErrorCode::NotPrimary,
                format!(
                    "primary {} lost its lease with the coordinator ({}); retry once it is elected again",
                    node.cfg.name,
                    node.coord.describe()
                ),
            );
        }
    }
    if let Err(r) = primary_action_allowed(node, session, &req) {
        return r.into();
    }
    match req {
        ControlRequest::Hello { .. } => ControlResponse::Hello {
            version: PROTOCOL_VERSION,
        },
        ControlRequest::Ping => ControlResponse::Pong,
        ControlRequest::Stats => ControlResponse::Stats(Box::new(node.stats())),
        ControlRequest::Alloc { len, align, tag } => match node.store.alloc(len, align, tag) {
            Ok(offset) => ControlResponse::Allocated {
                rkey: node.welcome.regions[0].rkey,
                region_len: node.welcome.regions[0].len,
                offset,
                len: len.next_multiple_of(GRANULE),
            },
            Err(e) => Refusal::from(e).into(),
        },
        ControlRequest::AllocMany { len, tags } => {
            let tags = &tags[..tags.len().min(MAX_ALLOC_MANY)];
            match node.store.alloc_many(len, GRANULE, tags) {
                Ok(offsets) => ControlResponse::AllocatedMany { offsets },
                Err(e) => Refusal::from(e).into(),
            }
        }
        ControlRequest::Free { offset, tag } => match node.store.free(offset, tag) {
            Ok(len) => ControlResponse::Freed { len },
            Err(e) => e.into(),
        },
        ControlRequest::FreeMany { extents } => {
            if extents.len() > MAX_FREE_MANY {
                return Refusal::new(
                    ErrorCode::Invalid,
                    format!(
                        "{} extents to free in one request, at most {MAX_FREE_MANY}",
                        extents.len()
                    ),
                )
                .into();
            }
            let refused = extents
                .into_iter()
                .filter_map(|(offset, tag)| {
                    let r = node.store.free(offset, Some(tag));
                    r.err().map(|e| (offset, e.message))
                })
                .collect();
            ControlResponse::FreedMany { refused }
        }
        ControlRequest::Resize {
            offset,
            len,
            tag,
            expect,
        } => match node.store.resize(offset, len, tag, expect) {
            Ok(offset) => ControlResponse::Allocated {
                rkey: node.welcome.regions[0].rkey,
                region_len: node.welcome.regions[0].len,
                offset,
                len: (len + TAG_SPACE).next_multiple_of(GRANULE),
            },
            Err(e) => e.into(),
        },
        ControlRequest::Zero { offset, len, tag } => node
            .store
            .zero(offset, len, tag)
            .map_or_else(ControlResponse::from, |()| ControlResponse::Ok),
        ControlRequest::Cluster => match node.members.cluster_info() {
            Some(mut c) => {
                c.coordinator = node.coord.describe();
                c.elects = node.cfg.coordinator.elects();
                c.mounts = node.leases.get().map(Leases::sessions).unwrap_or_default();
                c.standby = node.standby.follower();
                if let Some(e) = node.epochs.get() {
                    c.epochs = c
                        .nodes
                        .iter()
                        .filter_map(|n| Some((n.node_id, e.admitted(n.node_id)?)))
                        .collect();
                }
                ControlResponse::Cluster(Box::new(c))
            }
            None => refused(ErrorCode::Unavailable, "this node has not joined a cluster"),
        },
        ControlRequest::Join { node: addr, epoch } => accept_join(node, addr, epoch)
            .map_or_else(ControlResponse::from, |c| {
                ControlResponse::Cluster(Box::new(c))
            }),
        ControlRequest::Mirror {
            primary,
            seq,
            last,
            piece,
        } => crate::standby::take_piece(node, primary, seq, last, piece)
            .map_or_else(ControlResponse::from, |()| ControlResponse::Ok),
        ControlRequest::Journal { entries } => crate::standby::take_journal(node, &entries)
            .map_or_else(ControlResponse::from, |()| ControlResponse::Ok),
        ControlRequest::NodeAdmit { node: id, epoch } => crate::liveness::admit(node, id, epoch)
            .map_or_else(ControlResponse::from, |d| ControlResponse::Lease {
                ms: d.as_millis() as u64,
            }),
        ControlRequest::Coord(call) if node.cfg.role == Role::Primary => {
            crate::coordinator::serve(&*node.coord, call)
                .map_or_else(ControlResponse::from, ControlResponse::Coord)
        }
        ControlRequest::Coord(_) => refused(
            ErrorCode::NotPrimary,
            "the embedded coordinator is held by the primary",
        ),
        ControlRequest::NodeFailed { node: id } => crate::liveness::node_failed(node, id)
            .map_or_else(ControlResponse::from, |()| ControlResponse::Ok),
        ControlRequest::Resolve { extents } => {
            ControlResponse::Resolved(node.store.resolve(&extents))
        }
        ControlRequest::Retag {
            offset,
            expect,
            tag,
        } => node
            .store
            .retag(offset, expect, tag)
            .map_or_else(ControlResponse::from, |()| ControlResponse::Ok),
        ControlRequest::Pull {
            source,
            from,
            to,
            len,
            expect,
        } => node
            .pull(&source, (from, to, len), expect)
            .map_or_else(ControlResponse::from, |()| ControlResponse::Ok),
        ControlRequest::BaselineRangeLock { space, l, r } => match &node.baseline {
            Some(b) => b
                .lock(session, space, l, r)
                .map_or_else(ControlResponse::from, |()| ControlResponse::Ok),
            None => no_baseline(),
        },
        ControlRequest::BaselineRangeUnlock { space, l, r } => match &node.baseline {
            Some(b) => b
                .unlock(session, space, l, r)
                .map_or_else(ControlResponse::from, |()| ControlResponse::Ok),
            None => no_baseline(),
        },
        ControlRequest::QosShares { shares } => match &node.qos {
            Some(q) => {
                q.set_shares(&shares);
                ControlResponse::QosNode(q.status(node.cfg.node_id))
            }
            None => refused(ErrorCode::Invalid, "a standalone node takes no part in QoS"),
        },
        ControlRequest::QosSet {
            slot,
            reservation,
            limit,
            weight,
        } => {
            let req = QosRequest {
                reservation,
                limit,
                weight,
            };
            qos_set(node, session, slot, req).unwrap_or_else(ControlResponse::from)
        }
        ControlRequest::QosStatus => match node.controller.get() {
            Some(c) => ControlResponse::QosStatus(c.status(&node.qos_nodes())),
            None => refused(ErrorCode::NotPrimary, "QoS status is kept by the primary"),
        },
        ControlRequest::Session => ControlResponse::Session { id: session },
        ControlRequest::Primary { node: from, epoch } => node
            .followed
            .declare(session, from, epoch)
            .map_or_else(ControlResponse::from, |()| ControlResponse::Ok),
        ControlRequest::Renew { of } => match node.leases.get() {
            Some(l) => match l.renew(of) {
                Ok(d) => ControlResponse::Lease {
                    ms: d.as_millis() as u64,
                },
                // A primary that is not serving (paused past its own lease, deposed perhaps)
                // cannot tell the mount's lapse from its own: the mount is told to ask the
                // primary serving now, never that it was fenced.
                Err(_) if !node.serving() => refused(
                    ErrorCode::NotPrimary,
                    format!(
                        "primary {} lost its lease with the coordinator ({}); renew with the primary serving now",
                        node.cfg.name,
                        node.coord.describe()
                    ),
                ),
                Err(r) => r.into(),
            },
            None => refused(ErrorCode::NotPrimary, "leases are kept by the primary"),
        },
        ControlRequest::Adopt { from } => match (node.meta.get(), node.leases.get()) {
            (Some(_), Some(l))
                if l.check(from).is_err() || from < node.sessions_from.load(Ordering::SeqCst) =>
            {
                node.with_meta(|m| m.adopt(from, session, node));
                ControlResponse::Ok
            }
            (Some(_), _) => refused(
                ErrorCode::Invalid,
                format!("session {from} was not fenced: its open files are its own"),
            ),
            (None, _) => refused(ErrorCode::NotPrimary, "open files are kept by the primary"),
        },
        ControlRequest::Fence { token } => match node.fences.fence(token, FENCE_WAIT) {
            Ok(_) => ControlResponse::Ok,
            Err(why) => refused(ErrorCode::Unavailable, why),
        },
        ControlRequest::Watch {
            of,
            acked,
            ttl_ms,
            poll_ms,
            dropped,
        } => {
            // A fenced mount is nobody's concern any more: no change waits for it.
            if let Some(Err(r)) = node.leases.get().map(|l| l.check(of)) {
                return r.into();
            }
            node.watchers.drop_whole(of, &dropped);
            let (seq, changes, lost) = node.watchers.watch(
                session,
                of,
                acked,
                Duration::from_millis(ttl_ms),
                Duration::from_millis(poll_ms.min(60_000)),
            );
            ControlResponse::Changes { seq, changes, lost }
        }
        ControlRequest::Meta(m) => match node.meta.get() {
            Some(_) => {
                // Removing names frees only files nobody can read any more, and growing a
                // stripe only extents its move already took the tag from (a mount that reads
                // one finds it gone, as after a free): their extents on other nodes need not
                // hold the answer up.
                let go = match m.inner() {
                    MetaRequest::Unlink { .. }
                    | MetaRequest::Rmdir { .. }
                    | MetaRequest::Rename { .. }
                    | MetaRequest::AllocStripe { .. } => FreesGo::Soon,
                    _ => FreesGo::BeforeAnswer,
                };
                let mkdir = matches!(
                    m.inner(),
                    MetaRequest::Create {
                        kind: NewKind::Dir,
                        ..
                    }
                );
                let (resp, changes) = node
                    .with_meta_freeing(go, |meta| {
                        let resp = meta.handle(session, m, node);
                        // The mount that made a directory holds it whole from the start: no
                        // name can appear in it before this (see `crate::watch`).
                        if let (true, ControlResponse::Attr(a)) = (mkdir, &resp) {
                            node.watchers.hold_whole(session, a.ino);
                        }
                        (resp, meta.take_changes())
                    })
                    .expect("primary");
                // A change is answered only while the primary still holds its lease: a
                // standby elected meanwhile may lack it (its journal may not have arrived).
                if !node.serving() {
                    return refused(
                        ErrorCode::NotPrimary,
                        format!(
                            "primary {} lost its lease while making this change: it may or may not have taken effect",
                            node.cfg.name
                        ),
                    );
                }
                if let (ControlResponse::LockSlot(_), Some(l)) = (&resp, node.leases.get()) {
                    l.hold(session, node.term.guard());
                }
                // Outside the metadata lock: other mounts forget what changed.
                node.watchers.publish(session, changes);
                resp
            }
            None => refused(
                ErrorCode::NotPrimary,
                format!(
                    "node {} is not the primary; namespace operations go to the primary",
                    node.cfg.name
                ),
            ),
        },
    }
}

/// The most extents one [`ControlRequest::AllocMany`] allocates (a primary asks for far
/// fewer; this bounds what a request can make a node do).
const MAX_ALLOC_MANY: usize = 1024;

/// The primary's side of a join. A new node is empty (a new process), so replicas it held
/// before are dropped first; it takes data once admitted under its epoch. A node that
/// follows this primary after a take-over (`epoch`) keeps its memory and is admitted
/// under the epoch it holds.
/// On a data node, a primary's action is carried out only for the newest primary this node
/// has seen (see [`crate::term`]): the connection must have declared that primary's epoch.
fn primary_action_allowed(node: &Node, session: u64, req: &ControlRequest) -> Result<(), Refusal> {
    let primarys = matches!(
        req,
        ControlRequest::Alloc { .. }
            | ControlRequest::AllocMany { .. }
            | ControlRequest::Free { .. }
            | ControlRequest::FreeMany { .. }
            | ControlRequest::Resize { .. }
            | ControlRequest::Zero { .. }
            | ControlRequest::Retag { .. }
            | ControlRequest::Resolve { .. }
            | ControlRequest::Pull { .. }
            | ControlRequest::Fence { .. }
            | ControlRequest::Mirror { .. }
            | ControlRequest::Journal { .. }
            | ControlRequest::QosShares { .. }
    );
    let data_node = matches!(node.cfg.role, Role::Join(_)) && node.meta.get().is_none();
    if !(primarys && data_node) {
        return Ok(());
    }
    node.followed.check(session).inspect_err(|r| {
        warn!(session, reason = %r.message, "refused a primary's request");
    })
}

fn accept_join(node: &Node, addr: NodeAddr, epoch: Option<i64>) -> Result<ClusterInfo, Refusal> {
    let id = addr.node_id;
    let known = node.members.peer(id).is_ok();
    if known && node.epochs.get().is_some_and(|e| e.is_live(id)) {
        // The last look may predate the old holder's lapse: look again before refusing.
        crate::liveness::check_members(node);
    }
    // Only once the join is accepted: a refused one (an id already taken by a node at
    // another address) leaves the running node's replicas alone.
    let live = |id| node.epochs.get().is_some_and(|e| e.is_live(id));
    let term = (node.cfg.node_id, node.term.epoch());
    let info = node.members.accept_join(
        &*node.dial,
        addr,
        &node.cfg.secret,
        term,
        peer_deadline(node),
        live,
    )?;
    match epoch {
        Some(e) => {
            crate::liveness::admit(node, id, e)?;
            node.with_meta(|m| crate::standby::rejoined_after_take_over(id, m, node));
        }
        None if known => crate::liveness::rejoined(node, id),
        None => {}
    }
    Ok(info)
}

/// How long the primary waits for a data node's answer: the node's lease, at most half a
/// mount's deadline. The primary may hold the metadata lock meanwhile; a node that cannot
/// answer within that is taken for down (`Node::with_peer`), so a mount's request queued
/// behind the call is still answered within the mount's own deadline (a stopped data node
/// otherwise made mounts take the primary for dead and fail over to it again, their writes
/// in flight failing with EIO).
fn peer_deadline(node: &Node) -> Duration {
    node.cfg.node_lease.clamp(
        Duration::from_millis(200),
        rackfs_proto::client::RPC_DEADLINE / 2,
    )
}

/// Sets the QoS of `slot`'s mount, or (`None`) of the caller's own mount.
fn qos_set(
    node: &Node,
    session: u64,
    slot: Option<u16>,
    req: QosRequest,
) -> Result<ControlResponse, Refusal> {
    let (Some(c), Some(meta)) = (node.controller.get(), node.meta.get()) else {
        return Err(Refusal::new(
            ErrorCode::NotPrimary,
            "QoS is set on the primary",
        ));
    };
    let (slot, session) = match slot {
        Some(s) => (s, c.session_of(s)?),
        None => (
            meta.lock().expect("metadata lock").locks.attach(session)?,
            session,
        ),
    };
    c.admit(&node.qos_nodes(), slot, session, req)
}

fn no_baseline() -> ControlResponse {
    refused(
        ErrorCode::Invalid,
        "this node serves no baseline lock server (benchmarks start it with \
         --baseline-lock-server)",
    )
}
