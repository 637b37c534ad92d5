//! The memory node: registers its regions, serves verbs on them, answers control RPCs.
//!
//! Threads: one accept loop per listener (TCP, Unix socket) and one thread per connection. A
//! verbs connection's thread is a NIC: it executes work requests and nothing else. A control
//! connection's thread answers RPCs (allocation, stats). An shm connection's thread hands the
//! client the regions' memfds, then waits for the connection to close, which is how the node
//! learns the client is gone (its verb counters are then folded into the node's totals).
//!
//! Remote memory ownership: the node's CPU writes region memory only when it initialises the
//! read-only info region at start-up; everything else in the data region is written by clients
//! through verbs, into extents the allocator handed out.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rackfs_verbs::auth::{server_handshake, HandshakeError, Secret};
use rackfs_verbs::counters::COUNTER_BLOCK_LEN;
use rackfs_verbs::wire::{self, ConnKind, FrameKind, Welcome, WireError};
use rackfs_verbs::{Access, Region, RegionTable, VerbCounters, VerbTotals};
use slab::Slab;
use tracing::{debug, info, warn};

use crate::alloc::{AllocError, ExtentAllocator};
use crate::control::{
    ClusterInfo, ControlClient, ControlRequest, ControlResponse, ErrorCode, FsStat, NodeAddr,
    NodeStats, QosNodeStatus, RPC_KINDS,
};
use crate::meta::{Namespace, Storage};

/// Magic at offset 0 of the read-only info region.
pub const INFO_MAGIC: &[u8; 8] = b"RACKFSv1";
const INFO_REGION_LEN: u64 = 4096;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How to start a memory node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub node_id: u32,
    pub name: String,
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
    pub qos: crate::qos::QosConfig,
    /// Where to serve Prometheus text metrics (`None`: nowhere).
    pub metrics: Option<String>,
    /// Serve RDMA clients on this device too (`None`: tcp and shm only).
    pub rdma_device: Option<String>,
}

/// A node's place in the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Runs the metadata service; other nodes join it.
    Primary,
    /// Offers its region to the primary at this address (`host:port` or `unix:PATH`).
    Join(String),
    /// Serves verbs and allocation only (no namespace).
    Standalone,
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("nothing to listen on: give --listen ADDR, --shm-socket PATH, or both")]
    NoListener,
    #[error("RDMA: {0}")]
    Rdma(String),
    #[error("region size {0} is too small: a memory node needs at least 1 MiB")]
    RegionTooSmall(u64),
    #[error("cannot create the {len}-byte region: {err}")]
    Region { len: u64, err: std::io::Error },
    #[error("cannot listen on {addr}: {err}")]
    Listen { addr: String, err: std::io::Error },
    #[error("cannot join the primary at {addr}: {reason}")]
    Join { addr: String, reason: String },
}

/// Held ranges by lock space: `(l, r, session)`.
type RangeTable = HashMap<u64, Vec<(u64, u64, u64)>>;

/// Bytes before a tagged (file stripe) extent's data: its tag lives in the first 8.
pub const TAG_SPACE: u64 = 4096;

/// Another node of the cluster, as the primary knows it.
struct Peer {
    addr: NodeAddr,
    control: Option<Arc<ControlClient>>,
}

struct Shared {
    cfg: NodeConfig,
    table: RegionTable,
    welcome: Welcome,
    allocator: Mutex<ExtentAllocator>,
    /// Verb counters of open connections (one block each, written only by its connection).
    counters_live: Mutex<Slab<VerbCounters>>,
    /// Totals of closed connections.
    counters_retired: Mutex<VerbTotals>,
    rpcs: [AtomicU64; RPC_KINDS.len()],
    open: [AtomicU64; 4],
    /// The RDMA device clients may connect over (with every region registered).
    rdma: Option<rackfs_verbs::rdma::RdmaNic>,
    connections_total: AtomicU64,
    auth_failures: AtomicU64,
    protocol_errors: AtomicU64,
    started: Instant,
    stopping: AtomicBool,
    /// Where clients reach this node (filled in once the listeners are bound).
    me: Mutex<NodeAddr>,
    /// The primary's address (a joined node's view) and, on the primary, every other node.
    primary: Mutex<Option<NodeAddr>>,
    peers: Mutex<BTreeMap<u32, Peer>>,
    /// Tagged extents freed and not yet reusable: (reusable at, offset, length).
    quarantine: Mutex<Vec<(Instant, u64, u64)>>,
    namespace: Option<Mutex<Namespace>>,
    next_session: AtomicU64,
    /// The CPU-based range-lock table (a benchmark baseline).
    range_locks: Mutex<RangeTable>,
    range_freed: Condvar,
    qos: Option<crate::qos::NodeQos>,
    /// The cluster's QoS controller (primary only).
    cluster_qos: Option<Mutex<crate::qos::ClusterQos>>,
}

/// A running memory node.
pub struct MemNode {
    shared: Arc<Shared>,
    tcp_addr: Option<SocketAddr>,
}

/// A fresh random remote key: a client from before a restart gets `BadKey`, never new memory.
fn random_rkey() -> u32 {
    let n = rackfs_verbs::auth::nonce();
    u32::from_le_bytes([n[0], n[1], n[2], n[3]]) | 1
}

impl MemNode {
    /// Creates the regions, binds the listeners and starts serving.
    pub fn start(cfg: NodeConfig) -> Result<MemNode, StartError> {
        if cfg.listen.is_none() && cfg.shm_socket.is_none() {
            return Err(StartError::NoListener);
        }
        if cfg.region_len < 1 << 20 {
            return Err(StartError::RegionTooSmall(cfg.region_len));
        }
        let len = cfg.region_len.next_multiple_of(4096);
        let data = Region::create_memfd("rackfs-region", len, random_rkey(), Access::ALL)
            .map_err(|err| StartError::Region { len, err })?;
        let info =
            Region::create_memfd("rackfs-info", INFO_REGION_LEN, random_rkey(), Access::READ)
                .map_err(|err| StartError::Region { len, err })?;
        let mut page = INFO_MAGIC.to_vec();
        page.extend_from_slice(&(cfg.node_id as u64).to_le_bytes());
        page.extend_from_slice(&len.to_le_bytes());
        page.extend_from_slice(&(data.info().rkey as u64).to_le_bytes());
        info.write(0, &page).expect("info page fits");

        let table = RegionTable::new(vec![Arc::new(data), Arc::new(info)]);
        let rdma = match &cfg.rdma_device {
            Some(d) => {
                let nic = rackfs_verbs::rdma::RdmaNic::open(d, &table).map_err(StartError::Rdma)?;
                info!(device = %nic.describe(), "serving RDMA clients");
                Some(nic)
            }
            None => None,
        };
        let welcome = Welcome {
            node_id: cfg.node_id,
            regions: table.infos(),
        };
        let tcp = match &cfg.listen {
            Some(addr) => Some(TcpListener::bind(addr).map_err(|err| StartError::Listen {
                addr: addr.clone(),
                err,
            })?),
            None => None,
        };
        let unix = match &cfg.shm_socket {
            Some(path) => {
                if path.exists() && UnixStream::connect(path).is_err() {
                    let _ = std::fs::remove_file(path); // stale socket of a dead node
                }
                Some(UnixListener::bind(path).map_err(|err| StartError::Listen {
                    addr: path.display().to_string(),
                    err,
                })?)
            }
            None => None,
        };
        let tcp_addr = tcp.as_ref().and_then(|l| l.local_addr().ok());
        let mut allocator = ExtentAllocator::new(&cfg.name, 0, len);
        // Cluster members run QoS on an area of their region; a standalone node (benchmarks,
        // verbs tests) leaves its whole region to its clients.
        let qos = (cfg.role != Role::Standalone).then(|| {
            let area = allocator
                .alloc(rackfs_qos::area::AREA_LEN, 64)
                .expect("a fresh region has room for the QoS area");
            crate::qos::NodeQos::new(cfg.qos.clone(), &table.regions()[0], area)
        });
        let qos_area = qos.as_ref().map_or(0, |q| q.area);
        let me = NodeAddr {
            node_id: cfg.node_id,
            name: cfg.name.clone(),
            tcp: tcp_addr.map(|a| a.to_string()),
            shm: cfg.shm_socket.as_ref().map(|p| p.display().to_string()),
            capacity: len,
            qos_area,
        };
        let is_primary = cfg.role == Role::Primary;
        let namespace = is_primary.then(|| Mutex::new(Namespace::new(cfg.quarantine)));
        let shared = Arc::new(Shared {
            allocator: Mutex::new(allocator),
            cluster_qos: is_primary.then(|| {
                Mutex::new(crate::qos::ClusterQos {
                    even_split: !cfg.qos.pshift,
                    ..Default::default()
                })
            }),
            qos,
            cfg,
            table,
            rdma,
            welcome,
            counters_live: Mutex::new(Slab::new()),
            counters_retired: Mutex::new(VerbTotals::default()),
            rpcs: Default::default(),
            open: Default::default(),
            connections_total: AtomicU64::new(0),
            auth_failures: AtomicU64::new(0),
            protocol_errors: AtomicU64::new(0),
            started: Instant::now(),
            stopping: AtomicBool::new(false),
            primary: Mutex::new(is_primary.then(|| me.clone())),
            me: Mutex::new(me),
            peers: Mutex::new(BTreeMap::new()),
            quarantine: Mutex::new(Vec::new()),
            namespace,
            next_session: AtomicU64::new(1),
            range_locks: Mutex::new(HashMap::new()),
            range_freed: Condvar::new(),
        });
        {
            let s = shared.clone();
            std::thread::Builder::new()
                .name("quarantine".into())
                .spawn(move || reap_quarantine(s))
                .expect("spawn quarantine thread");
        }
        if shared.qos.is_some() {
            let s = shared.clone();
            std::thread::Builder::new()
                .name("qos-monitor".into())
                .spawn(move || {
                    let qos = s.qos.as_ref().expect("QoS node");
                    while !s.stopping.load(Ordering::SeqCst) {
                        std::thread::sleep(qos.cfg.check);
                        qos.tick(s.data_region());
                    }
                })
                .expect("spawn QoS monitor thread");
        }
        if let Some(addr) = &shared.cfg.metrics {
            let l = TcpListener::bind(addr).map_err(|err| StartError::Listen {
                addr: addr.clone(),
                err,
            })?;
            let s = shared.clone();
            std::thread::Builder::new()
                .name("metrics".into())
                .spawn(move || {
                    crate::metrics::serve(l, || {
                        let qos = s.qos.as_ref().map(|q| q.status(s.cfg.node_id));
                        crate::metrics::render(&s.stats(), qos.as_ref())
                    })
                })
                .expect("spawn metrics thread");
        }
        if shared.cluster_qos.is_some() {
            let s = shared.clone();
            std::thread::Builder::new()
                .name("qos-controller".into())
                .spawn(move || {
                    while !s.stopping.load(Ordering::SeqCst) {
                        std::thread::sleep(s.cfg.qos.period);
                        s.place_qos();
                    }
                })
                .expect("spawn QoS controller thread");
        }
        if shared.namespace.is_some() {
            let s = shared.clone();
            std::thread::Builder::new()
                .name("lock-trees".into())
                .spawn(move || tend_lock_trees(s))
                .expect("spawn lock tree thread");
        }
        if let Some(l) = tcp {
            let s = shared.clone();
            std::thread::Builder::new()
                .name("accept-tcp".into())
                .spawn(move || accept_tcp(l, s))
                .expect("spawn accept thread");
        }
        if let Some(l) = unix {
            let s = shared.clone();
            std::thread::Builder::new()
                .name("accept-unix".into())
                .spawn(move || accept_unix(l, s))
                .expect("spawn accept thread");
        }
        if let Role::Join(addr) = &shared.cfg.role {
            join(&shared, addr).map_err(|reason| StartError::Join {
                addr: addr.clone(),
                reason,
            })?;
        }
        info!(
            node = shared.cfg.node_id,
            role = ?shared.cfg.role,
            name = %shared.cfg.name,
            region = len,
            tcp = ?tcp_addr,
            shm = ?shared.cfg.shm_socket,
            "memory node serving"
        );
        Ok(MemNode { shared, tcp_addr })
    }

    /// The bound TCP address (useful with port 0).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp_addr
    }

    pub fn stats(&self) -> NodeStats {
        self.shared.stats()
    }

    /// Stops accepting connections and removes the Unix socket. Open connections keep working
    /// until the process exits.
    pub fn shutdown(&self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the accept loops so they notice.
        if let Some(a) = self.tcp_addr {
            let _ = TcpStream::connect_timeout(&a, Duration::from_millis(200));
        }
        if let Some(p) = &self.shared.cfg.shm_socket {
            let _ = UnixStream::connect(p);
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for MemNode {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Shared {
    fn stats(&self) -> NodeStats {
        let a = self.allocator.lock().expect("allocator lock").stats();
        let (lock_trees, lock_recoveries) = self.namespace.as_ref().map_or((0, 0), |ns| {
            let ns = ns.lock().expect("namespace lock");
            (ns.locks.memory(), ns.locks.recoveries)
        });
        let mut verbs = *self.counters_retired.lock().expect("counter totals lock");
        for (_, c) in self
            .counters_live
            .lock()
            .expect("counter blocks lock")
            .iter()
        {
            verbs.add(&c.snapshot());
        }
        NodeStats {
            node_id: self.cfg.node_id,
            name: self.cfg.name.clone(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            capacity: a.capacity,
            used: a.used,
            free: a.free,
            largest_free: a.largest_free,
            extents: a.extents,
            quarantined: self
                .quarantine
                .lock()
                .expect("quarantine lock")
                .iter()
                .map(|q| q.2)
                .sum(),
            lock_trees,
            lock_recoveries,
            verbs,
            rpcs: std::array::from_fn(|i| self.rpcs[i].load(Ordering::Relaxed)),
            open: std::array::from_fn(|i| self.open[i].load(Ordering::Relaxed)),
            rdma: self.rdma.as_ref().map(|n| n.describe()),
            connections_total: self.connections_total.load(Ordering::Relaxed),
            auth_failures: self.auth_failures.load(Ordering::Relaxed),
            protocol_errors: self.protocol_errors.load(Ordering::Relaxed),
        }
    }

    /// Runs `f` with a fresh counter block registered as live, then folds it into the totals.
    fn with_counters<T>(&self, counters: VerbCounters, f: impl FnOnce(&VerbCounters) -> T) -> T {
        let key = self
            .counters_live
            .lock()
            .expect("counter blocks lock")
            .insert(counters.clone());
        let out = f(&counters);
        self.counters_live
            .lock()
            .expect("counter blocks lock")
            .remove(key);
        self.counters_retired
            .lock()
            .expect("counter totals lock")
            .add(&counters.snapshot());
        out
    }

    fn control(&self, session: u64, req: ControlRequest) -> ControlResponse {
        self.rpcs[req.kind_index()].fetch_add(1, Ordering::Relaxed);
        match req {
            ControlRequest::Ping => ControlResponse::Pong,
            ControlRequest::Stats => ControlResponse::Stats(Box::new(self.stats())),
            ControlRequest::Alloc { len, align, tag } => match self.alloc_local(len, align, tag) {
                Ok(offset) => ControlResponse::Allocated {
                    rkey: self.welcome.regions[0].rkey,
                    region_len: self.welcome.regions[0].len,
                    offset,
                    len: len.next_multiple_of(crate::alloc::GRANULE),
                },
                Err(e) => alloc_error(e),
            },
            ControlRequest::Free { offset } => match self.free_local(offset) {
                Ok(len) => ControlResponse::Freed { len },
                Err(e) => alloc_error(e),
            },
            ControlRequest::Zero { offset, len } => {
                let inside = self
                    .allocator
                    .lock()
                    .expect("allocator lock")
                    .containing(offset, len)
                    .is_some();
                if !inside {
                    return ControlResponse::error(
                        ErrorCode::Invalid,
                        format!("{len} bytes at {offset:#x} are not inside one allocated extent"),
                    );
                }
                self.data_region()
                    .discard(offset, len)
                    .expect("extent inside the region");
                ControlResponse::Ok
            }
            ControlRequest::Cluster => match self.cluster_info() {
                Some(c) => ControlResponse::Cluster(c),
                None => ControlResponse::error(
                    ErrorCode::Unavailable,
                    "this node has not joined a cluster",
                ),
            },
            ControlRequest::Join { node } => self.accept_join(node),
            ControlRequest::RangeLock { space, l, r } => {
                if l >= r {
                    return ControlResponse::error(
                        ErrorCode::Invalid,
                        format!("empty range [{l}, {r})"),
                    );
                }
                let mut t = self.range_locks.lock().expect("range locks");
                while t
                    .get(&space)
                    .is_some_and(|v| v.iter().any(|&(a, b, _)| a < r && l < b))
                {
                    t = self.range_freed.wait(t).expect("range locks");
                }
                t.entry(space).or_default().push((l, r, session));
                ControlResponse::Ok
            }
            ControlRequest::RangeUnlock { space, l, r } => {
                let mut t = self.range_locks.lock().expect("range locks");
                let held = t.get_mut(&space).and_then(|v| {
                    let i = v
                        .iter()
                        .position(|&(a, b, s)| (a, b, s) == (l, r, session))?;
                    Some(v.swap_remove(i))
                });
                drop(t);
                match held {
                    Some(_) => {
                        self.range_freed.notify_all();
                        ControlResponse::Ok
                    }
                    None => ControlResponse::error(
                        ErrorCode::NotFound,
                        format!("[{l}, {r}) of space {space} is not held by this session"),
                    ),
                }
            }
            ControlRequest::QosShares { shares } => match &self.qos {
                Some(q) => {
                    q.set_shares(&shares);
                    ControlResponse::QosNode(q.status(self.cfg.node_id))
                }
                None => ControlResponse::error(
                    ErrorCode::Invalid,
                    "a standalone node takes no part in QoS",
                ),
            },
            ControlRequest::QosSet {
                slot,
                reservation,
                limit,
                weight,
            } => match self.qos_set(session, slot, reservation, limit, weight) {
                Ok(r) => r,
                Err((code, message)) => ControlResponse::Error { code, message },
            },
            ControlRequest::QosStatus => match &self.cluster_qos {
                Some(c) => {
                    let mounts = c.lock().expect("cluster qos").report();
                    ControlResponse::QosStatus(crate::control::QosStatus {
                        mounts,
                        nodes: self.qos_nodes(None),
                    })
                }
                None => ControlResponse::error(
                    ErrorCode::NotPrimary,
                    "QoS status is kept by the primary",
                ),
            },
            ControlRequest::Meta(m) => match &self.namespace {
                Some(ns) => ns.lock().expect("namespace lock").handle(session, m, self),
                None => ControlResponse::error(
                    ErrorCode::NotPrimary,
                    format!(
                        "node {} is not the primary; namespace operations go to the primary",
                        self.cfg.name
                    ),
                ),
            },
        }
    }

    fn data_region(&self) -> &Region {
        &self.table.regions()[0]
    }

    /// Allocates here; a tagged extent gets its tag written before it is handed out.
    fn alloc_local(&self, len: u64, align: u64, tag: Option<u64>) -> Result<u64, AllocError> {
        let (len, align) = match tag {
            Some(_) => (
                len.checked_add(TAG_SPACE)
                    .ok_or_else(|| AllocError::Invalid("length overflows".into()))?,
                align.max(TAG_SPACE),
            ),
            None => (len, align),
        };
        let offset = self
            .allocator
            .lock()
            .expect("allocator lock")
            .alloc_tagged(len, align, tag.is_some())?;
        if let Some(t) = tag {
            self.data_region()
                .store(offset, t)
                .expect("tag inside the region");
        }
        Ok(offset)
    }

    /// Frees here: plain extents are zeroed and reusable at once; tagged ones are tombstoned
    /// and quarantined first (see [`crate::meta`]). Returns the extent's length.
    fn free_local(&self, offset: u64) -> Result<u64, AllocError> {
        let mut a = self.allocator.lock().expect("allocator lock");
        let (len, tagged) = a
            .extent(offset)
            .ok_or(AllocError::NotAllocated { offset })?;
        if tagged {
            self.data_region()
                .store(offset, 0)
                .expect("tag inside the region");
            a.mark_untagged(offset);
            drop(a);
            self.quarantine.lock().expect("quarantine lock").push((
                Instant::now() + self.cfg.quarantine,
                offset,
                len,
            ));
            Ok(len)
        } else {
            self.data_region()
                .discard(offset, len)
                .expect("extent inside the region");
            a.free(offset)
        }
    }

    fn cluster_info(&self) -> Option<ClusterInfo> {
        let primary = self.primary.lock().expect("primary lock").clone()?;
        let mut nodes = vec![self.me.lock().expect("me lock").clone()];
        nodes.extend(
            self.peers
                .lock()
                .expect("peers lock")
                .values()
                .map(|p| p.addr.clone()),
        );
        nodes.sort_by_key(|n| n.node_id);
        Some(ClusterInfo { primary, nodes })
    }

    fn accept_join(&self, node: NodeAddr) -> ControlResponse {
        if self.namespace.is_none() {
            return ControlResponse::error(
                ErrorCode::NotPrimary,
                format!("node {} is not the primary", self.cfg.name),
            );
        }
        if node.node_id == self.cfg.node_id {
            return ControlResponse::error(
                ErrorCode::Exists,
                format!("node id {} is the primary's own id", node.node_id),
            );
        }
        if let Some(p) = self.peers.lock().expect("peers lock").get(&node.node_id) {
            if p.addr.name != node.name || p.addr.tcp != node.tcp {
                return ControlResponse::error(
                    ErrorCode::Exists,
                    format!(
                        "node id {} is already in the cluster as {}",
                        node.node_id, p.addr.name
                    ),
                );
            }
        }
        let addr = match (&node.tcp, &node.shm) {
            (Some(t), _) => t.clone(),
            (None, Some(p)) => format!("unix:{p}"),
            (None, None) => {
                return ControlResponse::error(
                    ErrorCode::Invalid,
                    "a joining node must listen somewhere",
                )
            }
        };
        let control = match ControlClient::connect(
            &addr,
            &self.cfg.secret,
            &format!("primary-{}", self.cfg.name),
        ) {
            Ok(c) => Arc::new(c),
            Err(e) => {
                return ControlResponse::error(
                    ErrorCode::Unavailable,
                    format!("cannot reach joining node {} at {addr}: {e}", node.name),
                )
            }
        };
        info!(node = node.node_id, name = %node.name, %addr, "node joined");
        self.peers.lock().expect("peers lock").insert(
            node.node_id,
            Peer {
                addr: node,
                control: Some(control),
            },
        );
        ControlResponse::Cluster(self.cluster_info().expect("the primary knows itself"))
    }

    /// Every node's QoS status; with `shares`, each node first gets its new shares.
    fn qos_nodes(&self, shares: Option<&crate::qos::Placement>) -> Vec<QosNodeStatus> {
        let me = self.cfg.node_id;
        let mut out = Vec::new();
        if let Some(q) = &self.qos {
            if let Some(s) = shares.and_then(|s| s.get(&me)) {
                q.set_shares(s);
            }
            out.push(q.status(me));
        }
        let peers: Vec<(u32, Arc<ControlClient>)> = self
            .peers
            .lock()
            .expect("peers lock")
            .iter()
            .filter_map(|(&id, p)| p.control.clone().map(|c| (id, c)))
            .collect();
        for (id, c) in peers {
            let req = match shares {
                Some(s) => ControlRequest::QosShares {
                    shares: s.get(&id).cloned().unwrap_or_default(),
                },
                // Keep the node's shares: send what the controller last placed there.
                None => ControlRequest::QosShares {
                    shares: self.current_shares(id),
                },
            };
            match c.call(&req) {
                Ok(ControlResponse::QosNode(st)) => out.push(st),
                other => warn!(node = id, reply = ?other, "no QoS status from a node"),
            }
        }
        out
    }

    /// The shares the controller last placed on `node`.
    fn current_shares(&self, node: u32) -> Vec<(u16, u64, u64, u32)> {
        self.cluster_qos.as_ref().map_or_else(Vec::new, |c| {
            let c = c.lock().expect("cluster qos");
            c.placed.get(&node).cloned().unwrap_or_default()
        })
    }

    /// The controller's round: every node's status, pShift placement, new shares pushed.
    fn place_qos(&self) {
        let Some(c) = &self.cluster_qos else { return };
        let nodes = self.qos_nodes(None);
        let shares = c.lock().expect("cluster qos").place(&nodes);
        self.qos_nodes(Some(&shares));
    }

    fn qos_set(
        &self,
        session: u64,
        slot: Option<u16>,
        reservation: u64,
        limit: u64,
        weight: u32,
    ) -> Result<ControlResponse, (ErrorCode, String)> {
        let (Some(c), Some(ns)) = (&self.cluster_qos, &self.namespace) else {
            return Err((ErrorCode::NotPrimary, "QoS is set on the primary".into()));
        };
        let (slot, session) = match slot {
            Some(s) => {
                let owner = c
                    .lock()
                    .expect("cluster qos")
                    .mounts
                    .get(&s)
                    .map(|m| m.session);
                match owner {
                    Some(o) => (s, o),
                    None => {
                        return Err((ErrorCode::NotFound, format!("no mount has QoS slot {s}")))
                    }
                }
            }
            None => (
                ns.lock().expect("namespace lock").locks.attach(session)?,
                session,
            ),
        };
        let nodes = self.qos_nodes(None);
        let q = crate::qos::MountQos {
            session,
            reservation,
            limit,
            weight,
        };
        let shares = {
            let mut c = c.lock().expect("cluster qos");
            c.admit(slot, q, &nodes)?;
            c.place(&nodes)
        };
        self.qos_nodes(Some(&shares));
        info!(slot, reservation, limit, weight, "QoS admitted");
        Ok(ControlResponse::QosGranted {
            slot,
            reservation,
            limit,
        })
    }

    fn peer(&self, node: u32) -> Result<Arc<ControlClient>, (ErrorCode, String)> {
        self.peers
            .lock()
            .expect("peers lock")
            .get(&node)
            .and_then(|p| p.control.clone())
            .ok_or((
                ErrorCode::Unavailable,
                format!("node {node} is not in the cluster"),
            ))
    }
}

fn rpc_err(e: crate::control::RpcError) -> (ErrorCode, String) {
    match e {
        crate::control::RpcError::Refused { code, message } => (code, message),
        other => (ErrorCode::Unavailable, other.to_string()),
    }
}

impl Storage for Shared {
    fn data_nodes(&self) -> Vec<u32> {
        let mut v = vec![self.cfg.node_id];
        v.extend(self.peers.lock().expect("peers lock").keys());
        v.sort_unstable();
        v
    }

    fn alloc(&self, node: u32, len: u64, tag: Option<u64>) -> Result<u64, (ErrorCode, String)> {
        if node == self.cfg.node_id {
            let align = if tag.is_some() {
                TAG_SPACE
            } else {
                crate::alloc::GRANULE
            };
            return self
                .alloc_local(len, align, tag)
                .map_err(|e| match alloc_error(e) {
                    ControlResponse::Error { code, message } => (code, message),
                    _ => unreachable!("alloc_error builds errors"),
                });
        }
        self.peer(node)?
            .alloc_tagged(len, TAG_SPACE, tag)
            .map(|(_, off)| off)
            .map_err(rpc_err)
    }

    fn free(&self, node: u32, offset: u64) -> Result<(), (ErrorCode, String)> {
        if node == self.cfg.node_id {
            return self
                .free_local(offset)
                .map(|_| ())
                .map_err(|e| (ErrorCode::Internal, e.to_string()));
        }
        self.peer(node)?.free(offset).map(|_| ()).map_err(rpc_err)
    }

    fn zero(&self, node: u32, offset: u64, len: u64) -> Result<(), (ErrorCode, String)> {
        let req = ControlRequest::Zero { offset, len };
        let resp = if node == self.cfg.node_id {
            self.control(0, req)
        } else {
            self.peer(node)?.call(&req).map_err(rpc_err)?
        };
        match resp {
            ControlResponse::Error { code, message } => Err((code, message)),
            _ => Ok(()),
        }
    }

    fn local(&self) -> (u32, &Region) {
        (self.cfg.node_id, self.data_region())
    }

    fn fs_stat(&self) -> FsStat {
        let mut s = FsStat::default();
        // Not `self.stats()`: that takes the namespace lock, which the caller may hold.
        let mine = self.allocator.lock().expect("allocator lock").stats();
        s.capacity += mine.capacity;
        s.free += mine.free;
        let peers: Vec<_> = self
            .peers
            .lock()
            .expect("peers lock")
            .values()
            .filter_map(|p| p.control.clone())
            .collect();
        for p in peers {
            if let Ok(st) = p.stats() {
                s.capacity += st.capacity;
                s.free += st.free;
            }
        }
        s
    }
}

/// Offers this node to the primary.
fn join(shared: &Shared, addr: &str) -> Result<(), String> {
    let c = ControlClient::connect(
        addr,
        &shared.cfg.secret,
        &format!("node-{}", shared.cfg.name),
    )
    .map_err(|e| e.to_string())?;
    let me = shared.me.lock().expect("me lock").clone();
    match c.call(&ControlRequest::Join { node: me }) {
        Ok(ControlResponse::Cluster(info)) => {
            info!(primary = %info.primary.name, nodes = info.nodes.len(), "joined the cluster");
            *shared.primary.lock().expect("primary lock") = Some(info.primary);
            Ok(())
        }
        Ok(other) => Err(format!("unexpected reply {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Recovers lock trees of dead clients and frees retired trees (see [`crate::locktree`]).
fn tend_lock_trees(shared: Arc<Shared>) {
    let ns = shared.namespace.as_ref().expect("primary");
    while !shared.stopping.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(1));
        let mut ns = ns.lock().expect("namespace lock");
        ns.locks.tick(&crate::meta::LocalTreeMemory(&*shared));
    }
}

/// Returns quarantined extents to the allocator once their time is up, zeroed.
fn reap_quarantine(shared: Arc<Shared>) {
    while !shared.stopping.load(Ordering::SeqCst) {
        std::thread::sleep(
            Duration::from_millis(100).min(shared.cfg.quarantine.max(Duration::from_millis(1))),
        );
        let now = Instant::now();
        let due: Vec<_> = {
            let mut q = shared.quarantine.lock().expect("quarantine lock");
            let (due, keep): (Vec<_>, Vec<_>) = q.drain(..).partition(|e| e.0 <= now);
            *q = keep;
            due
        };
        for (_, offset, len) in due {
            shared
                .data_region()
                .discard(offset, len)
                .expect("extent inside the region");
            if let Err(e) = shared
                .allocator
                .lock()
                .expect("allocator lock")
                .free(offset)
            {
                warn!(error = %e, "quarantined extent vanished");
            }
        }
    }
}

fn alloc_error(e: AllocError) -> ControlResponse {
    let code = match e {
        AllocError::OutOfMemory { .. } => ErrorCode::OutOfMemory,
        AllocError::Invalid(_) => ErrorCode::Invalid,
        AllocError::NotAllocated { .. } => ErrorCode::NotFound,
    };
    ControlResponse::Error {
        code,
        message: e.to_string(),
    }
}

fn accept_tcp(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match conn {
            Ok(stream) => {
                let peer = stream
                    .peer_addr()
                    .map_or_else(|_| "?".into(), |a| a.to_string());
                let _ = stream.set_nodelay(true);
                let s = shared.clone();
                spawn_conn(peer.clone(), move || serve_conn(stream, &peer, &s));
            }
            Err(e) => warn!(error = %e, "accept failed"),
        }
    }
}

fn accept_unix(listener: UnixListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match conn {
            Ok(stream) => {
                let s = shared.clone();
                spawn_conn("unix".into(), move || serve_conn(stream, "unix", &s));
            }
            Err(e) => warn!(error = %e, "accept failed"),
        }
    }
}

fn spawn_conn(peer: String, f: impl FnOnce() + Send + 'static) {
    if let Err(e) = std::thread::Builder::new()
        .name(format!("conn-{peer}"))
        .spawn(f)
    {
        warn!(%peer, error = %e, "cannot start a connection thread; dropping the connection");
    }
}

/// Authenticates a fresh connection; logs and counts failures.
fn handshake<S: Read + Write>(
    stream: &mut S,
    peer: &str,
    shared: &Shared,
    unix: bool,
) -> Option<ConnKind> {
    shared.connections_total.fetch_add(1, Ordering::Relaxed);
    let result = server_handshake(
        stream,
        &shared.cfg.secret,
        &shared.cfg.name,
        &shared.welcome,
        |h| {
            if h.kind == ConnKind::Shm && !unix {
                Err("shm connections must use the memory node's Unix socket (--shm-socket)".into())
            } else if h.kind == ConnKind::Rdma && shared.rdma.is_none() {
                Err(
                    "this memory node serves no RDMA clients (start it with --rdma-device NAME)"
                        .into(),
                )
            } else {
                Ok(())
            }
        },
    );
    match result {
        Ok(hello) => {
            debug!(%peer, client = %hello.client_name, kind = ?hello.kind, "client authenticated");
            Some(hello.kind)
        }
        Err(HandshakeError::WrongSecret { client }) => {
            shared.auth_failures.fetch_add(1, Ordering::Relaxed);
            warn!(%peer, %client, "refused a client: wrong cluster secret");
            None
        }
        Err(HandshakeError::Wire(WireError::Closed)) => None,
        Err(e) => {
            shared.protocol_errors.fetch_add(1, Ordering::Relaxed);
            warn!(%peer, error = %e, "handshake failed; closing the connection");
            None
        }
    }
}

/// Counts a connection of `kind` as open for as long as the guard lives.
struct OpenGuard<'a>(&'a AtomicU64);

impl<'a> OpenGuard<'a> {
    fn new(shared: &'a Shared, kind: ConnKind) -> Self {
        let c = &shared.open[kind as usize - 1];
        c.fetch_add(1, Ordering::Relaxed);
        OpenGuard(c)
    }
}

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

fn log_end(shared: &Shared, peer: &str, what: &str, r: Result<(), WireError>) {
    match r {
        Ok(()) | Err(WireError::Closed) => debug!(%peer, "{what} connection closed"),
        Err(WireError::Io(e)) => debug!(%peer, error = %e, "{what} connection dropped"),
        Err(e) => {
            shared.protocol_errors.fetch_add(1, Ordering::Relaxed);
            warn!(%peer, error = %e, "closing {what} connection: malformed input");
        }
    }
}

/// A stream a client connects over: TCP or Unix.
trait Conn: Read + Write + AsRawFd + Send + Sized + 'static {
    fn duplicate(&self) -> std::io::Result<Self>;
    fn set_timeout(&self, t: Option<Duration>);
    /// The Unix stream itself, for shm clients (`None` over TCP).
    fn into_unix(self) -> Option<UnixStream>;
}

impl Conn for TcpStream {
    fn duplicate(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn set_timeout(&self, t: Option<Duration>) {
        let _ = self.set_read_timeout(t);
    }
    fn into_unix(self) -> Option<UnixStream> {
        None
    }
}

impl Conn for UnixStream {
    fn duplicate(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn set_timeout(&self, t: Option<Duration>) {
        let _ = self.set_read_timeout(t);
    }
    fn into_unix(self) -> Option<UnixStream> {
        Some(self)
    }
}

/// Authenticates a connection and serves it as the kind of connection it asked for.
fn serve_conn<S: Conn>(mut stream: S, peer: &str, shared: &Shared) {
    stream.set_timeout(Some(HANDSHAKE_TIMEOUT));
    let unix = std::any::TypeId::of::<S>() == std::any::TypeId::of::<UnixStream>();
    let Some(kind) = handshake(&mut stream, peer, shared, unix) else {
        return;
    };
    stream.set_timeout(None);
    let _open = OpenGuard::new(shared, kind);
    let Ok(clone) = stream.duplicate() else {
        return;
    };
    match kind {
        ConnKind::Verbs => {
            let fd = (stream.as_raw_fd(), shared.cfg.poll);
            let r = shared.with_counters(VerbCounters::local(), |c| {
                rackfs_verbs::tcp::serve_verbs(clone, stream, fd, &shared.table, c)
            });
            log_end(shared, peer, "verbs", r);
        }
        ConnKind::Control => log_end(
            shared,
            peer,
            "control",
            serve_control(clone, stream, shared),
        ),
        ConnKind::Shm => match stream.into_unix() {
            Some(u) => serve_shm(u, shared),
            None => unreachable!("refused in the handshake"),
        },
        ConnKind::Rdma => {
            let nic = shared.rdma.as_ref().expect("refused in the handshake");
            match nic.serve(stream) {
                Ok(()) => debug!(%peer, "rdma client gone; its queue pair is destroyed"),
                Err(e) => warn!(%peer, error = %e, "rdma connection set-up failed"),
            }
        }
    }
}

fn serve_shm(mut stream: UnixStream, shared: &Shared) {
    let counters =
        match Region::create_memfd("rackfs-shm-counters", COUNTER_BLOCK_LEN, 0, Access::ALL) {
            Ok(r) => VerbCounters::in_region(Arc::new(r)),
            Err(e) => {
                warn!(error = %e, "cannot create an shm counter block; dropping the client");
                return;
            }
        };
    if let Err(e) = rackfs_verbs::shm::send_regions(&stream, &shared.table, counters.region()) {
        warn!(error = %e, "cannot send regions to an shm client");
        return;
    }
    shared.with_counters(counters, |_| {
        // The client never writes here; the read returns when it disconnects or dies.
        let mut buf = [0u8; 64];
        while let Ok(n) = stream.read(&mut buf) {
            if n == 0 {
                break;
            }
        }
    });
    debug!("shm client disconnected");
}

/// Serves control RPCs; the connection is one client session (its opens end with it).
fn serve_control(r: impl Read, w: impl Write, shared: &Shared) -> Result<(), WireError> {
    let session = shared.next_session.fetch_add(1, Ordering::Relaxed);
    let result = serve_session(r, w, shared, session);
    if let Some(ns) = &shared.namespace {
        ns.lock()
            .expect("namespace lock")
            .end_session(session, shared);
    }
    for v in shared.range_locks.lock().expect("range locks").values_mut() {
        v.retain(|e| e.2 != session);
    }
    if let Some(c) = &shared.cluster_qos {
        if c.lock().expect("cluster qos").end_session(session) {
            shared.place_qos();
        }
    }
    shared.range_freed.notify_all();
    result
}

fn serve_session(
    r: impl Read,
    w: impl Write,
    shared: &Shared,
    session: u64,
) -> Result<(), WireError> {
    let mut reader = BufReader::new(r);
    let mut writer = BufWriter::new(w);
    let mut body = Vec::new();
    loop {
        let kind = wire::read_frame(&mut reader, &mut body)?;
        if kind != FrameKind::ControlRequest {
            return Err(WireError::Unexpected {
                expected: FrameKind::ControlRequest,
                got: kind,
            });
        }
        let (id, req) = ControlRequest::decode(&body)?;
        let resp = shared.control(session, req);
        wire::write_frame(&mut writer, FrameKind::ControlResponse, &resp.encode(id))?;
        writer.flush()?;
    }
}
