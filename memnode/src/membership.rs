//! Cluster membership as a node knows it: where it is reached itself, the primary, and (on the
//! primary) every other data node with a control connection to it. Connections are opened
//! through the [`Dial`] the caller hands in (the node's), never a socket of this module's own.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rackfs_clock::Mutex;
use rackfs_proto::control::{ClusterInfo, ControlRequest, ControlResponse, ErrorCode, NodeAddr};
use rackfs_proto::link::{ControlLink, Dial};
use rackfs_proto::{Refusal, RpcError};
use rackfs_verbs::Secret;
use tracing::{info, warn};

/// Another node of the cluster, as the primary knows it.
struct Peer {
    addr: NodeAddr,
    control: Arc<dyn ControlLink>,
    /// Why the primary cannot reach it (`None`: up).
    down: Option<String>,
}

/// This node, the primary and the peers.
pub struct Membership {
    me: Mutex<NodeAddr>,
    /// The primary's address (a joined node's view; the primary's own on the primary).
    primary: Mutex<Option<NodeAddr>>,
    /// Every other data node (primary only).
    peers: Mutex<BTreeMap<u32, Peer>>,
    is_primary: AtomicBool,
}

impl Membership {
    pub fn new(me: NodeAddr, is_primary: bool) -> Membership {
        Membership {
            primary: Mutex::new(is_primary.then(|| me.clone())),
            me: Mutex::new(me),
            peers: Mutex::new(BTreeMap::new()),
            is_primary: AtomicBool::new(is_primary),
        }
    }

    /// The primary's node id, as this node knows it.
    pub fn primary_id(&self) -> Option<u32> {
        self.primary
            .lock()
            .expect("primary lock")
            .as_ref()
            .map(|p| p.node_id)
    }

    /// This node is the primary from now on (it took over from another).
    pub fn become_primary(&self) {
        *self.primary.lock().expect("primary lock") = Some(self.me());
        self.is_primary.store(true, Ordering::SeqCst);
    }

    pub fn me(&self) -> NodeAddr {
        self.me.lock().expect("me lock").clone()
    }

    /// Ids of every data node this node knows and can reach, itself included, in order: where
    /// new data may go.
    pub fn data_nodes(&self) -> Vec<u32> {
        let mut v = vec![self.me.lock().expect("me lock").node_id];
        v.extend(
            self.peers
                .lock()
                .expect("peers lock")
                .iter()
                .filter(|(_, p)| p.down.is_none())
                .map(|(id, _)| *id),
        );
        v.sort_unstable();
        v
    }

    /// Records that peer `node` could not be reached; logged once, when it goes down.
    pub fn mark_down(&self, node: u32, why: &str) {
        if let Some(p) = self.peers.lock().expect("peers lock").get_mut(&node) {
            if p.down.is_none() {
                warn!(
                    node,
                    name = %p.addr.name,
                    reason = %why,
                    "memory node unreachable: new data goes to the others (it is dropped from the replicas once its lease lapses)"
                );
                p.down = Some(why.to_string());
            }
        }
    }

    /// Whether peer `node` is marked down.
    pub fn is_down(&self, node: u32) -> bool {
        self.peers
            .lock()
            .expect("peers lock")
            .get(&node)
            .is_some_and(|p| p.down.is_some())
    }

    /// Records that peer `node` answered again; logged once.
    pub fn mark_up(&self, node: u32) {
        if let Some(p) = self.peers.lock().expect("peers lock").get_mut(&node) {
            if p.down.take().is_some() {
                info!(node, name = %p.addr.name, "memory node reachable again");
            }
        }
    }

    /// Where node `node` (this one or a peer) is reached, and its failure domain.
    pub fn addr_of(&self, node: u32) -> Option<NodeAddr> {
        let me = self.me();
        if me.node_id == node {
            return Some(me);
        }
        self.peers
            .lock()
            .expect("peers lock")
            .get(&node)
            .map(|p| p.addr.clone())
    }

    /// The control connection to peer `node`.
    pub fn peer(&self, node: u32) -> Result<Arc<dyn ControlLink>, Refusal> {
        self.peers
            .lock()
            .expect("peers lock")
            .get(&node)
            .map(|p| p.control.clone())
            .ok_or_else(|| {
                Refusal::new(
                    ErrorCode::Unavailable,
                    format!("node {node} is not in the cluster"),
                )
            })
    }

    /// Every peer's id and control connection.
    pub fn peers(&self) -> Vec<(u32, Arc<dyn ControlLink>)> {
        self.peers
            .lock()
            .expect("peers lock")
            .iter()
            .map(|(&id, p)| (id, p.control.clone()))
            .collect()
    }

    /// The peers that are up.
    pub fn live_peers(&self) -> Vec<(u32, Arc<dyn ControlLink>)> {
        self.peers
            .lock()
            .expect("peers lock")
            .iter()
            .filter(|(_, p)| p.down.is_none())
            .map(|(&id, p)| (id, p.control.clone()))
            .collect()
    }

    /// The cluster as this node knows it (`None` before it joined one).
    pub fn cluster_info(&self) -> Option<ClusterInfo> {
        let primary = self.primary.lock().expect("primary lock").clone()?;
        let mut nodes = vec![self.me()];
        let peers = self.peers.lock().expect("peers lock");
        nodes.extend(peers.values().map(|p| p.addr.clone()));
        nodes.sort_by_key(|n| n.node_id);
        let down = peers
            .iter()
            .filter_map(|(&id, p)| p.down.clone().map(|why| (id, why)))
            .collect();
        Some(ClusterInfo {
            primary,
            nodes,
            down,
            coordinator: String::new(),
            elects: false,
            mounts: Vec::new(),
            epochs: Vec::new(),
            standby: None,
        })
    }

    /// Offers this node to the primary at `addr` (reached through `dial`): a new node (`epoch`
    /// `None`), or one that keeps its memory and follows a primary that took over, registered
    /// under `epoch`.
    pub fn join(
        &self,
        dial: &dyn Dial,
        addr: &str,
        secret: &Secret,
        epoch: Option<i64>,
    ) -> Result<(), RpcError> {
        let me = self.me();
        let c = dial.connect(addr, secret, &format!("node-{}", me.name))?;
        match c.call(&ControlRequest::Join { node: me, epoch })? {
            ControlResponse::Cluster(info) => {
                info!(primary = %info.primary.name, nodes = info.nodes.len(), "joined the cluster");
                *self.primary.lock().expect("primary lock") = Some(info.primary);
                Ok(())
            }
            other => Err(RpcError::Unexpected {
                peer: addr.into(),
                what: format!("{other:?}"),
            }),
        }
    }

    /// The primary's side of a join: connects back to the node through `dial` (declaring
    /// `term`, this primary's node id and epoch: see `crate::term`) and adds it; each call on
    /// that connection gives up after `deadline`. A node id already in the cluster at another
    /// address is refused while `live` says its holder is.
    pub fn accept_join(
        &self,
        dial: &dyn Dial,
        node: NodeAddr,
        secret: &Secret,
        term: (u32, u64),
        deadline: Duration,
        live: impl Fn(u32) -> bool,
    ) -> Result<ClusterInfo, Refusal> {
        let me = self.me();
        if !self.is_primary.load(Ordering::SeqCst) {
            return Err(Refusal::new(
                ErrorCode::NotPrimary,
                format!("node {} is not the primary", me.name),
            ));
        }
        if node.node_id == me.node_id {
            return Err(Refusal::new(
                ErrorCode::Exists,
                format!("node id {} is the primary's own id", node.node_id),
            ));
        }
        if let Some(p) = self.peers.lock().expect("peers lock").get(&node.node_id) {
            if (p.addr.name != node.name || p.addr.tcp != node.tcp) && live(node.node_id) {
                return Err(Refusal::new(
                    ErrorCode::Exists,
                    format!(
                        "node id {} is already in the cluster as {}, which holds its lease",
                        node.node_id, p.addr.name
                    ),
                ));
            }
        }
        if node.tcp.is_none() && node.shm.is_none() {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                "a joining node must listen somewhere",
            ));
        }
        let name = format!("primary-{}", me.name);
        let control = crate::term::connect_node(dial, &node, secret, &name, term.0, term.1)
            .map_err(|e| {
                Refusal::new(
                    ErrorCode::Unavailable,
                    format!("cannot reach joining node {}: {e}", node.name),
                )
            })?;
        control.set_deadline(deadline);
        let addr = control.peer().to_string();
        info!(node = node.node_id, name = %node.name, %addr, "node joined");
        self.peers.lock().expect("peers lock").insert(
            node.node_id,
            Peer {
                addr: node,
                control,
                down: None,
            },
        );
        Ok(self.cluster_info().expect("the primary knows itself"))
    }
}
