//! Starting and stopping a memory node: regions, listeners, and one thread per background
//! duty (quarantine reaper, QoS monitor and controller, lock-tree tending, metrics). The
//! threads are the host's; their loops sleep on the node's clock.
//!
//! What the node runs on is handed in ([`NodeEnv`]): its clock and the [`Dial`] it opens
//! control connections to other nodes through. A process hands it the host's
//! ([`MemNode::start`]); several nodes in one process share a virtual clock and a
//! `rackfs_proto::link::Loopback`, each made reachable on it once it serves
//! ([`NodeEnv::serving`]).
//!
//! Remote memory ownership: the node's CPU writes region memory only when it initialises the
//! read-only info region at start-up, and where its parts say so (the store's tags and zeroing,
//! the QoS monitor's area words, the metadata service's records, tables and lock-tree words);
//! everything else in the data region is written by clients through verbs, into extents the
//! allocator handed out.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rackfs_clock::{Mutex, SharedClock, Spawn, SystemClock, Threads};
use rackfs_meta::MetaService;
use rackfs_proto::control::{NodeAddr, NodeStats};
use rackfs_proto::link::{Dial, NetDial};
use rackfs_verbs::auth::NonceLog;
use rackfs_verbs::lease::ServeLease;
use rackfs_verbs::wire::Welcome;
use rackfs_verbs::{Access, Region, RegionTable};
use tracing::{info, warn};

use crate::baseline::BaselineLocks;
use crate::config::{NodeConfig, Role};
use crate::counters::NodeCounters;
use crate::fence::Fences;
use crate::lease::Leases;
use crate::liveness::{Renewer, TakeOver};
use crate::membership::Membership;
use crate::node::{first_session, host_origin, Exit, Node};
use crate::qos::NodeQos;
use crate::qos_controller::QosController;
use crate::store::Store;
use crate::term::PRIMARY_KEY;
use crate::watch::Watchers;

/// Magic at offset 0 of the read-only info region.
pub const INFO_MAGIC: &[u8; 8] = b"RACKFSv1";
const INFO_REGION_LEN: u64 = 4096;

/// How long the frees thread lets frees gather after the first before it sends them.
const FREES_GATHER: Duration = Duration::from_millis(2);

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("nothing to listen on: give --listen ADDR, --shm-socket PATH, or both")]
    NoListener,
    #[error("RDMA: {0}")]
    Rdma(#[from] rackfs_verbs::rdma::RdmaNicError),
    #[error("region size {0} is too small: a memory node needs at least 1 MiB")]
    RegionTooSmall(u64),
    #[error("cannot create the {len}-byte region: {err}")]
    Region { len: u64, err: std::io::Error },
    #[error("cannot listen on {addr}: {err}")]
    Listen { addr: String, err: std::io::Error },
    #[error("cannot reach the coordinator: {0}")]
    Coordinator(#[from] rackfs_coord::CoordError),
    #[error("{0}")]
    Election(#[from] crate::election::ElectionError),
    #[error("cannot join the cluster: {0}")]
    Join(#[from] crate::discover::JoinError),
}

/// Makes `node` the primary, serving `meta`: the metadata service, the QoS controller, the
/// lock-holder leases and the data nodes' epochs, with their background duties.
fn start_primary(node: &Arc<Node>, meta: MetaService) {
    let set = node.meta.set(Mutex::new(meta)).is_ok()
        && node
            .controller
            .set(QosController::new(node.cfg.qos.pshift))
            .is_ok()
        && node
            .leases
            .set(Leases::on(
                node.cfg.lock_lease,
                node.coord.clone(),
                node.clock.clone(),
            ))
            .is_ok()
        && node.epochs.set(Default::default()).is_ok();
    assert!(set, "a node becomes primary once");
    node.members.become_primary();
    duty(node, "qos-controller", node.cfg.qos.period, Node::place_qos);
    let rate = node.cfg.rebuild_rate;
    duty(node, "rebuild", crate::liveness::REBUILD_EVERY, move |n| {
        crate::liveness::rebuild_round(n, rate)
    });
    duty(node, "lock-trees", LOCK_TREE_TICK, |n| {
        let meta = n.meta.get().expect("primary");
        meta.lock().expect("metadata lock").tick(n);
    });
    let lease = node.leases.get().expect("primary").lease();
    let check = (lease / 20).max(Duration::from_millis(10));
    node.start_thread("leases", move |n| {
        let leases = n.leases.get().expect("primary");
        let mut last = n.clock.now();
        while !n.is_stopping() {
            n.clock.sleep(check);
            let now = n.clock.now();
            let gap = now.saturating_sub(last);
            if gap > check + leases.lease() / 4 {
                // This node was paused: nobody could renew meanwhile.
                info!(paused = ?gap, "lease checks resumed after a pause of this node: every mount's lease restarts");
                leases.restart_all(now);
            }
            last = now;
            if !n.serving() {
                continue; // deposed, or not yet renewed: no mount is fenced meanwhile
            }
            for session in leases.expire(now) {
                n.start_thread("fence", move |n| n.fence_mount(session));
            }
        }
    });
    // Mounts whose lease the coordinator let lapse (on a thread of its own: a slow etcd does
    // not hold up the checks above).
    node.start_thread("mount-leases", move |n| {
        let leases = n.leases.get().expect("primary");
        while !n.is_stopping() {
            n.clock.sleep(lease / 8);
            if !n.serving() {
                continue;
            }
            for session in leases.lapsed_in_coordinator() {
                warn!(
                    session,
                    coordinator = n.coord.describe(),
                    "a mount's lease with the coordinator lapsed: fencing it"
                );
                n.start_thread("fence", move |n| n.fence_mount(session));
            }
        }
    });
    duty(node, "members", node.cfg.node_lease / 8, |n| {
        crate::liveness::check_members(n)
    });
    duty(
        node,
        "standby",
        node.cfg.node_lease / 4,
        crate::standby::keep,
    );
}

/// How a data node that is the metadata standby takes over as primary, installed in its
/// renewer: the renewer (liveness) notices when, the standby campaigns and serves its mirror,
/// and the daemon starts the primary; only here do the three meet.
const TAKE_OVER: TakeOver = TakeOver {
    should: crate::standby::should_take_over,
    run: take_over,
};

/// The metadata standby's take-over, which starts the node as the primary once elected.
fn take_over(node: &Arc<Node>) -> bool {
    crate::standby::take_over(node, start_primary)
}

/// Told a node once it serves (see [`NodeEnv::serving`]).
pub type Serving = Box<dyn FnOnce(&Arc<Node>) + Send>;

/// What a node runs on besides its configuration (see the module docs).
pub struct NodeEnv {
    /// Where the node takes time from and sleeps on.
    pub clock: SharedClock,
    /// How it opens control connections to other nodes.
    pub dial: Arc<dyn Dial>,
    /// How it starts the threads of its logic (its duties, roles and waits; the threads
    /// serving its sockets are always the host's).
    pub spawn: Arc<dyn Spawn>,
    /// Ends the node's process with an exit status: a node that learns another is primary
    /// now (see `election`) ends so its supervisor starts it afresh. The host's exits; a
    /// simulation kills the node's process.
    pub exit: Arc<Exit>,
    /// Told the node once it is built, where its listeners start accepting and before it
    /// joins a cluster: an in-process cluster makes it reachable here (serves it on its
    /// loopback). A process needs none: its listeners are its sockets.
    pub serving: Option<Serving>,
}

impl NodeEnv {
    /// The host's: its clocks and the network.
    pub fn host() -> NodeEnv {
        NodeEnv::on_clock(Arc::new(SystemClock::new()))
    }

    /// Time from `clock`, control connections over the network.
    pub fn on_clock(clock: SharedClock) -> NodeEnv {
        NodeEnv {
            clock,
            dial: Arc::new(NetDial::default()),
            spawn: Arc::new(Threads),
            exit: Arc::new(|code| std::process::exit(code)),
            serving: None,
        }
    }
}

/// A running memory node.
pub struct MemNode {
    node: Arc<Node>,
    tcp_addr: Option<SocketAddr>,
}

/// A fresh random remote key: a client from before a restart gets `BadKey`, never new memory.
fn random_rkey() -> u32 {
    let n = rackfs_verbs::auth::nonce();
    u32::from_le_bytes([n[0], n[1], n[2], n[3]]) | 1
}

/// Runs `body` on a named OS thread that serves a socket (it blocks where no simulation
/// sees it), with its own handle on the node.
fn socket_thread(node: &Arc<Node>, name: &str, body: impl FnOnce(Arc<Node>) + Send + 'static) {
    let n = node.clone();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || body(n))
        .expect("spawn a node thread");
}

/// Runs `tick` every `every` (on the node's clock) on a named thread until the node stops.
fn every(node: &Arc<Node>, name: &str, every: Duration, tick: impl Fn(&Node) + Send + 'static) {
    node.start_thread(name, move |n| {
        while !n.is_stopping() {
            n.clock.sleep(every);
            tick(&n);
        }
    });
}

/// Runs the primary's duty `tick` every `every`, skipping it while the primary's own lease is
/// not valid: a primary stopped past its lease acts on nothing once it resumes (see
/// [`crate::term`]).
/// How often the primary recovers the lock trees of dead clients and frees retired ones: both
/// wait for things measured in seconds (a lapsed lease, a tree's grace), so a few milliseconds
/// more cost nothing, and an idle primary does not wake a thousand times a second.
const LOCK_TREE_TICK: Duration = Duration::from_millis(10);

fn duty(node: &Arc<Node>, name: &str, every_: Duration, tick: impl Fn(&Node) + Send + 'static) {
    every(node, name, every_, move |n| {
        if n.serving() {
            tick(n)
        }
    });
}

impl MemNode {
    /// Creates the regions, binds the listeners and starts serving, on the host's clock and
    /// network.
    pub fn start(cfg: NodeConfig) -> Result<MemNode, StartError> {
        // Its own control connections (to the primary, its peers) poll as its sessions do.
        let env = NodeEnv {
            dial: Arc::new(NetDial { poll: cfg.poll }),
            ..NodeEnv::host()
        };
        MemNode::start_in(cfg, env)
    }

    /// [`MemNode::start`] with the node's parts taking time from `clock` (a simulation's).
    pub fn start_with_clock(cfg: NodeConfig, clock: SharedClock) -> Result<MemNode, StartError> {
        MemNode::start_in(cfg, NodeEnv::on_clock(clock))
    }

    /// [`MemNode::start`] on `env`: its clock, its dial, and who is told once the node
    /// serves.
    pub fn start_in(mut cfg: NodeConfig, env: NodeEnv) -> Result<MemNode, StartError> {
        let NodeEnv {
            clock,
            dial,
            spawn,
            exit,
            serving,
        } = env;
        if cfg.listen.is_none() && cfg.shm_socket.is_none() {
            return Err(StartError::NoListener);
        }
        if cfg.region_len < 1 << 20 {
            return Err(StartError::RegionTooSmall(cfg.region_len));
        }
        crate::discover::check(&cfg.role, &cfg.coordinator)?;
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

        let data = Arc::new(data);
        let table = RegionTable::new(vec![data.clone(), Arc::new(info)]);
        let rdma = match &cfg.rdma_device {
            Some(d) => {
                let nic = rackfs_verbs::rdma::RdmaNic::open(d, &table).map_err(StartError::Rdma)?;
                info!(device = %nic.describe(), "serving RDMA clients");
                Some(nic)
            }
            None => None,
        };
        let welcome = Welcome {
            proof: [0; rackfs_verbs::wire::PROOF_LEN], // filled in per connection
            node_name: cfg.name.clone(),
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
        let meta_len = match cfg.role {
            Role::Standalone => 0,
            _ => crate::store::meta_area_len(len),
        };
        let store = Store::new(
            &cfg.name,
            data.clone(),
            cfg.quarantine,
            meta_len,
            clock.clone(),
        );
        // Cluster members run QoS on an area of their region; a standalone node (benchmarks,
        // verbs tests) leaves its whole region to its clients.
        let qos = (cfg.role != Role::Standalone).then(|| {
            let area = store
                .alloc(rackfs_qos::area::AREA_LEN, 64, None)
                .expect("a fresh region has room for the QoS area");
            NodeQos::new(cfg.qos.clone(), &data, area, clock.clone())
        });
        let me = NodeAddr {
            node_id: cfg.node_id,
            name: cfg.name.clone(),
            tcp: tcp_addr.map(|a| a.to_string()),
            shm: cfg.shm_socket.as_ref().map(|p| p.display().to_string()),
            capacity: len,
            qos_area: qos.as_ref().map_or(0, |q| q.area),
            quarantine_ms: cfg.quarantine.as_millis() as u64,
            domain: cfg.domain.clone(),
        };
        let (coord, remote) = crate::coordinator::open(&cfg, &clock, &dial)?;
        if cfg.role == Role::Primary && cfg.coordinator.elects() {
            if let Some(why) = crate::election::joins_instead(&*coord, cfg.node_id)? {
                info!(reason = %why, "the cluster lives: joining it as a data node, not as its primary");
                cfg.role = Role::Join(Vec::new());
            }
        }
        let is_primary = cfg.role == Role::Primary;
        let sessions_from = first_session(&*clock);
        let primacy = match (is_primary, cfg.coordinator.elects()) {
            (true, true) => Some(crate::election::Primacy::campaign(
                coord.clone(),
                crate::coordinator::primary_value(&me, sessions_from),
                cfg.node_lease,
                &cfg.cluster,
                &*clock,
            )?),
            _ => None,
        };
        // The primary's term: its election's, or with the embedded coordinator (no election:
        // it lives and dies with this primary) the key put without a lease.
        let term = match (&primacy, is_primary) {
            (Some(p), _) => Some((p.lease(), p.epoch())),
            (None, true) => {
                let value = crate::coordinator::primary_value(&me, sessions_from);
                let epoch = match coord.create(PRIMARY_KEY, &value, None)? {
                    Ok(epoch) => epoch,
                    Err(_) => coord.created(PRIMARY_KEY)?.map_or(0, |(e, _)| e),
                };
                Some((0, epoch))
            }
            (None, false) => None,
        };
        let node = Arc::new(Node {
            members: Membership::new(me, is_primary),
            meta: OnceLock::new(),
            controller: OnceLock::new(),
            watchers: Watchers::new(clock.clone()),
            fences: Fences::new(clock.clone()),
            leases: OnceLock::new(),
            epochs: OnceLock::new(),
            coord,
            serve: match (&cfg.role, &primacy) {
                // An elected primary's is its election's lease (extended below).
                (Role::Join(_), _) | (_, Some(_)) => ServeLease::none(),
                _ => ServeLease::forever(),
            },
            lease_words: Default::default(),
            discards: Default::default(),
            frees: Default::default(),
            rebuilds: Default::default(),
            baseline: cfg.baseline_lock_server.then(BaselineLocks::default),
            qos,
            store,
            table,
            rdma,
            welcome,
            counters: NodeCounters::default(),
            nonces: NonceLog::default(),
            next_session: AtomicU64::new(sessions_from),
            sessions_from: AtomicU64::new(0),
            standby: Default::default(),
            term: Default::default(),
            followed: Default::default(),
            host_origin: host_origin(&*clock),
            started: clock.now(),
            clock,
            dial,
            spawn,
            exit,
            stopping: AtomicBool::new(false),
            cfg,
        });
        if let Some(p) = &primacy {
            node.serve.extend_to(node.lease_ns(p.until()));
        }
        if let Some((lease, epoch)) = term {
            node.term.begin(lease, epoch);
        }
        node.start_thread("frees", |n| {
            while !n.is_stopping() {
                n.frees.wait(Duration::from_millis(500));
                // A moment for more to gather (removals come in bursts): one request per node
                // carries them all.
                n.clock.sleep(FREES_GATHER);
                n.send_frees();
            }
        });
        every(&node, "quarantine", node.store.reap_interval(), |n| {
            n.store.reap()
        });
        if let Some(q) = &node.qos {
            every(&node, "qos-monitor", q.cfg.check, |n| {
                n.qos.as_ref().expect("QoS node").tick(n.data_region())
            });
        }
        if is_primary {
            let mut m = MetaService::new(node.cfg.quarantine, node.clock.wall_ns());
            m.namespace.set_default_replicas(node.cfg.replicas);
            start_primary(&node, m);
        }
        if let Some(p) = primacy {
            node.start_thread("primary-lease", move |n| p.run(&n));
        }
        if let Some(addr) = &node.cfg.metrics {
            let l = TcpListener::bind(addr).map_err(|err| StartError::Listen {
                addr: addr.clone(),
                err,
            })?;
            socket_thread(&node, "metrics", move |n| {
                crate::metrics::serve(l, || {
                    let qos = n.qos.as_ref().map(|q| q.status(n.cfg.node_id));
                    crate::metrics::render(&n.stats(), qos.as_ref())
                })
            });
        }
        if let Some(l) = tcp {
            socket_thread(&node, "accept-tcp", move |n| crate::conn::accept_tcp(l, n));
        }
        if let Some(l) = unix {
            socket_thread(&node, "accept-unix", move |n| {
                crate::conn::accept_unix(l, n)
            });
        }
        if let Some(serving) = serving {
            serving(&node);
        }
        if let Role::Join(addrs) = &node.cfg.role {
            let primary = match crate::discover::join(&node, addrs) {
                Ok(p) => p,
                Err(e) => {
                    // Stops the listeners and removes the Unix socket: the process ends.
                    drop(MemNode {
                        node: node.clone(),
                        tcp_addr,
                    });
                    return Err(e.into());
                }
            };
            if let Some(r) = &remote {
                r.point_at(&primary);
            }
            // The first lease before anyone is served: data connections are refused without.
            let mut lease = Renewer::new(node.coord.clone(), &primary, TAKE_OVER);
            lease.renew(&node);
            node.start_thread("node-lease", move |n| lease.run(&n));
        }
        info!(
            node = node.cfg.node_id,
            role = ?node.cfg.role,
            name = %node.cfg.name,
            region = len,
            tcp = ?tcp_addr,
            shm = ?node.cfg.shm_socket,
            "memory node serving"
        );
        Ok(MemNode { node, tcp_addr })
    }

    /// The node's parts (for a test or a simulation that drives them).
    pub fn node(&self) -> &Arc<Node> {
        &self.node
    }

    /// The bound TCP address (useful with port 0).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp_addr
    }

    pub fn stats(&self) -> NodeStats {
        self.node.stats()
    }

    /// Stops accepting connections and removes the Unix socket. Open connections keep working
    /// until the process exits.
    pub fn shutdown(&self) {
        if self.node.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the accept loops so they notice.
        if let Some(a) = self.tcp_addr {
            let _ = TcpStream::connect_timeout(&a, Duration::from_millis(200));
        }
        if let Some(p) = &self.node.cfg.shm_socket {
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
