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
    /// Adaptive-polling budget of NIC threads before they sleep in `read`.
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
    /// etcd client endpoints (`host:port`, comma-separated) holding the cluster map, the
    /// leases and the election (`None`: the embedded coordinator, in the primary).
    pub etcd: Option<String>,
    /// The cluster's name: its keys' prefix in etcd.
    pub cluster: String,
    /// Whether the primary keeps a metadata standby (with etcd only; see the `standby` module).
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

/// A node's place in the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Runs the metadata service; other nodes join it.
    Primary,
    /// Offers its region to the primary, found at one of these addresses (`host:port` or
    /// `unix:PATH`, asked in turn) or, with etcd, at the one the coordinator's `primary` key
    /// names (then the list may be empty).
    Join(Vec<String>),
    /// Serves verbs and allocation only (no namespace).
    Standalone,
}
