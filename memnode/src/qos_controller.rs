//! The primary's QoS controller loop: each period it asks every node for its QoS status, runs
//! the placement ([`rackfs_meta::placement::ClusterQos`]) and pushes each node its new shares;
//! it also admits mounts' QoS requests.

use rackfs_clock::Mutex;

use rackfs_meta::placement::{ClusterQos, MountQos, Placement};
use rackfs_proto::control::{ControlRequest, ControlResponse, ErrorCode, QosNodeStatus, QosStatus};
use rackfs_proto::Refusal;
use tracing::{info, warn};

use crate::membership::Membership;
use crate::qos::NodeQos;

/// The nodes a controller drives: the primary's own monitor and its peers.
pub struct QosNodes<'a> {
    pub own: Option<&'a NodeQos>,
    pub node_id: u32,
    pub members: &'a Membership,
}

/// The cluster's QoS controller (primary only).
pub struct QosController {
    cluster: Mutex<ClusterQos>,
}

/// A QoS request: a mount's reservation, limit (IOPS; 0 = none) and weight.
#[derive(Debug, Clone, Copy)]
pub struct QosRequest {
    pub reservation: u64,
    pub limit: u64,
    pub weight: u32,
}

impl QosController {
    /// A controller; `pshift` off splits every reservation evenly (experiments only).
    pub fn new(pshift: bool) -> QosController {
        QosController {
            cluster: Mutex::new(ClusterQos::new(!pshift)),
        }
    }

    /// Every node's QoS status; with `shares`, each node first gets its new shares.
    fn statuses(&self, nodes: &QosNodes, shares: Option<&Placement>) -> Vec<QosNodeStatus> {
        let mut out = Vec::new();
        if let Some(q) = nodes.own {
            if let Some(s) = shares.and_then(|s| s.get(&nodes.node_id)) {
                q.set_shares(s);
            }
            out.push(q.status(nodes.node_id));
        }
        // Every peer, down ones included: this is also how the primary notices a node going
        // down or coming back (once a period; the transitions are logged, not each call).
        for (id, c) in nodes.members.peers() {
            // Without new shares, keep the node's: send what was last placed there.
            let shares = match shares {
                Some(s) => s.get(&id).cloned().unwrap_or_default(),
                None => self.current_shares(id),
            };
            match c.call(&ControlRequest::QosShares { shares }) {
                Ok(ControlResponse::QosNode(st)) => {
                    nodes.members.mark_up(id);
                    out.push(st);
                }
                Ok(other) => warn!(node = id, reply = ?other, "unexpected QoS reply"),
                Err(e) => nodes.members.mark_down(id, &e.to_string()),
            }
        }
        out
    }

    /// The shares last placed on `node`.
    fn current_shares(&self, node: u32) -> Vec<(u16, u64, u64, u32)> {
        let c = self.cluster.lock().expect("cluster qos");
        c.placed.get(&node).cloned().unwrap_or_default()
    }

    /// One round: every node's status, placement, new shares pushed.
    pub fn place(&self, nodes: &QosNodes) {
        let statuses = self.statuses(nodes, None);
        let shares = self.cluster.lock().expect("cluster qos").place(&statuses);
        self.statuses(nodes, Some(&shares));
    }

    /// The slot's mount session, if a mount holds QoS slot `slot`.
    pub fn session_of(&self, slot: u16) -> Result<u64, Refusal> {
        self.cluster
            .lock()
            .expect("cluster qos")
            .mounts
            .get(&slot)
            .map(|m| m.session)
            .ok_or_else(|| {
                Refusal::new(ErrorCode::NotFound, format!("no mount has QoS slot {slot}"))
            })
    }

    /// Admits `req` for the mount of `session` in `slot`, places it and pushes the shares.
    pub fn admit(
        &self,
        nodes: &QosNodes,
        slot: u16,
        session: u64,
        req: QosRequest,
    ) -> Result<ControlResponse, Refusal> {
        let statuses = self.statuses(nodes, None);
        let q = MountQos {
            session,
            reservation: req.reservation,
            limit: req.limit,
            weight: req.weight,
        };
        let shares = {
            let mut c = self.cluster.lock().expect("cluster qos");
            c.admit(slot, q, &statuses)?;
            c.place(&statuses)
        };
        self.statuses(nodes, Some(&shares));
        info!(
            slot,
            reservation = req.reservation,
            limit = req.limit,
            weight = req.weight,
            "QoS admitted"
        );
        Ok(ControlResponse::QosGranted {
            slot,
            reservation: req.reservation,
            limit: req.limit,
        })
    }

    /// Every mount's QoS and every node's periods.
    pub fn status(&self, nodes: &QosNodes) -> QosStatus {
        let mounts = self.cluster.lock().expect("cluster qos").report();
        QosStatus {
            mounts,
            nodes: self.statuses(nodes, None),
        }
    }

    /// Forgets the mount of an ended session and re-places the others.
    pub fn end_session(&self, nodes: &QosNodes, session: u64) {
        if self
            .cluster
            .lock()
            .expect("cluster qos")
            .end_session(session)
        {
            self.place(nodes);
        }
    }
}
