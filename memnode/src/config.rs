//! How a memory node is started: its configuration and its place in the cluster.

use std::path::PathBuf;
use std::time::Duration;

use rackfs_verbs::Secret;

use crate::qos::QosConfig;

/// How to start a memory node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub node_id: u32,
    pub name: String,
    /// The node's failure domain (replicas of a stripe avoid sharing one).
    pub domain: Option<String>,
    /// TCP address for verbs and control connections (`None`: no TCP listener).
    pub listen: Option<String>,
    /// Unix socket for shm (and local control) connections.
    pub shm_socket: Option<PathBuf>,
    pub region_len: u64,
    pub secret: Secret,
    /// Adaptive-polling budget of NIC threads, control sessions and this node's own control
    /// calls before they sleep in `read` (`rackfs_verbs::poll`).
    pub poll: Duration,
    pub role: Role,
    /// How long freed file stripes are held back before their memory is reused.
    pub quarantine: Duration,
    /// How long a mount holding range locks may go without renewing its lease before it is
    /// fenced and its locks recovered (primary only).
    pub lock_lease: Duration,
    /// The lease a data node holds with the coordinator: one that lapses is declared dead and
    /// dropped from the stripes' replicas, and serves nothing until admitted again.
    pub node_lease: Duration,
    /// Where the cluster map, the leases and the election are kept.
    pub coordinator: Coordination,
    /// The cluster's name: its keys' prefix in etcd.
    pub cluster: String,
    /// Whether the primary keeps a metadata standby (only with a coordinator that outlives
    /// the primary; see the `standby` module).
    pub standby: bool,
    /// Copies of every stripe of a new file whose creator does not ask (primary only; never
    /// more than the cluster's nodes).
    pub replicas: u32,
    /// Bytes per second re-replication may copy (primary only).
    pub rebuild_rate: u64,
    pub qos: QosConfig,
    /// Where to serve Prometheus text metrics (`None`: nowhere).
    pub metrics: Option<String>,
    /// Serve RDMA clients on this device too (`None`: tcp and shm only).
    pub rdma_device: Option<String>,
    /// Serve the CPU range-lock server that benchmarks compare Citron with (off in
    /// production: its RPCs are refused).
    pub baseline_lock_server: bool,
}

/// Where a cluster keeps its map, its nodes' leases and the primary's election.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Coordination {
    /// Embedded in the primary's process: no election and no standby, since the cluster's
    /// state lives and dies with the primary.
    InPrimary,
    /// etcd, at these client endpoints (`host:port`, comma-separated).
    Etcd(String),
    /// An embedded coordinator served by a process of its own (`rackfs up`'s), at this
    /// address (`unix:PATH` or `host:port`): it outlives any node.
    Served(String),
}

impl Coordination {
    /// Whether the coordinator outlives the primary, so that a standby can be elected in its
    /// place: the primary campaigns, keeps a standby, and data nodes follow a new primary.
    pub fn elects(&self) -> bool {
        !matches!(self, Coordination::InPrimary)
    }
}

/// A node's place in the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Runs the metadata service; other nodes join it.
    Primary,
    /// Offers its region to the primary, found at one of these addresses (`host:port` or
    /// `unix:PATH`, asked in turn) or, with a coordinator that elects (etcd, or one served
    /// apart), at the one the coordinator's `primary` key
    /// names (then the list may be empty).
    Join(Vec<String>),
    /// Serves verbs and allocation only (no namespace).
    Standalone,
}
