//! A mount's connections: one control connection to the primary, one queue pair per node.
//!
//! Control connections are opened through the mount's [`crate::link::Dial`] (the network's on
//! a live mount, in process under test) and time comes from its [`crate::clock::Clock`], both
//! from the [`Env`] the cluster was connected with; queue pairs go through the verbs
//! transports.

use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rackfs_locks::LockConfig;
use rackfs_proto::control::{ClusterInfo, NodeAddr};
use rackfs_proto::control::{ControlRequest, ControlResponse};
use rackfs_proto::namespace::MetaRequest;
use rackfs_proto::RpcError;
use rackfs_qos::engine::InFlight;
use rackfs_qos::{EngineConfig, QosEngine};
use rackfs_verbs::{QueuePair, Secret, VerbsError};
use rustc_hash::FxHashMap;
use tracing::{debug, info, warn};

use crate::clock::SharedClock;
use crate::env::Env;
use crate::link::ControlLink;
use crate::metrics::{Metered, MountMetrics};
use crate::options::{ReadPolicy, TransportChoice};
use crate::replica::NodeLoads;

/// Why a mount could not reach its cluster.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("no cluster address given")]
    NoAddress,
    #[error("cannot reach any of {addrs}: {last}")]
    Unreachable { addrs: String, last: String },
    #[error("{0}")]
    Rpc(#[from] RpcError),
    #[error("{0}")]
    Verbs(#[from] VerbsError),
}

/// A data node as the mount reaches it.
pub struct Node {
    pub qp: QueuePair,
    pub rkey: u32,
    /// The session this connection was opened under (its fence token).
    pub session: u64,
}

/// A mount's view of its cluster. Its *session* on the primary (control connection, fence
/// token, lock slot, QoS slot, data connections) is replaced whole when the primary fences the
/// mount ([`Cluster::recover`]); an operation that must not outlive its session (a write under
/// a range lock) names the session it started in, and [`Cluster::node_in`] refuses it a
/// connection of another.
pub struct Cluster {
    /// The control connection to the primary and its session id (this mount's fence token).
    primary: RwLock<(Arc<dyn ControlLink>, u64)>,
    /// The primary's node id (it changes when a standby takes over).
    primary_id: std::sync::atomic::AtomicU32,
    info: RwLock<ClusterInfo>,
    nodes: RwLock<FxHashMap<u32, Arc<Node>>>,
    secret: Secret,
    transport: TransportChoice,
    rdma_device: Option<String>,
    name: String,
    /// This mount's lock client slot on the primary, its calibrated lock configuration and the
    /// session the slot belongs to.
    lock_client: Mutex<Option<(u16, LockConfig, u64)>>,
    /// Held while the lock client is set up (slot, calibration, lease).
    lock_setup: Mutex<()>,
    /// How many more files' lock trees this mount may keep ([`crate::lock::KEPT_TREES`]).
    keep_budget: Arc<rackfs_locks::KeepBudget>,
    /// QoS: this mount's slot and its engine per node (`None`: `qos=off`).
    qos: RwLock<Option<Qos>>,
    /// How long a verb batch over tcp waits for its node, in ms (the mount's `timeout=`).
    deadline_ms: std::sync::atomic::AtomicU64,
    lease: RwLock<Arc<Lease>>,
    /// The QoS this mount asked for (reservation, limit, weight), asked again in a new session.
    qos_wanted: Mutex<Option<(u64, u64, u32)>>,
    /// Told the QoS slot of each new session (the mount's state record keeps it).
    on_session: Mutex<Option<SessionHook>>,
    /// Run once this mount continues on a primary that took over (see [`Cluster::failover`]).
    on_failover: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
    /// How many times this mount moved to a primary that took over.
    failovers: std::sync::atomic::AtomicU64,
    /// Namespace requests numbered so far (see [`MetaRequest::Numbered`]).
    requests: std::sync::atomic::AtomicU64,
    /// Held while a new session is set up.
    recovering: Mutex<()>,
    /// What this mount observes of each node, for choosing which replica a read goes to.
    pub loads: NodeLoads,
    /// What the core takes from its surroundings (time; see [`crate::env`]).
    env: Env,
    /// This mount's counters and latencies (see [`crate::metrics`]).
    metrics: Arc<MountMetrics>,
}

/// Told each new session's QoS slot and the primary's address (it changes on a failover).
type SessionHook = Box<dyn Fn(Option<u16>, Option<&str>) + Send + Sync>;

/// This mount's lease as a lock holder, renewed by a thread of its own while the mount lives
/// (see `rackfs_memnode::lease`); once the primary fenced the mount, why.
#[derive(Default)]
struct Lease {
    fenced: std::sync::OnceLock<String>,
    /// A new session replaced this one (after a fence, or on a primary that took over).
    replaced: std::sync::atomic::AtomicBool,
}

impl Lease {
    fn over(&self) -> bool {
        self.replaced.load(std::sync::atomic::Ordering::SeqCst) || self.fenced.get().is_some()
    }
}

struct Qos {
    slot: u16,
    engines: FxHashMap<u32, Arc<QosEngine>>,
}

fn local_socket(addr: &NodeAddr, transport: TransportChoice) -> Option<&str> {
    match transport {
        TransportChoice::Tcp | TransportChoice::Rdma => None,
        _ => addr.shm.as_deref().filter(|p| Path::new(p).exists()),
    }
}

/// Where to open a control connection to `node`: its local socket when the transport may use
/// it, else its tcp address.
fn control_addr(node: &NodeAddr, transport: TransportChoice) -> Result<String, ConnectError> {
    match (local_socket(node, transport), &node.tcp) {
        (Some(sock), _) => Ok(format!("unix:{sock}")),
        (None, Some(tcp)) => Ok(tcp.clone()),
        (None, None) => Err(ConnectError::Unreachable {
            addrs: node.name.clone(),
            last: "the node has no address".into(),
        }),
    }
}

impl Cluster {
    /// The control connection to the primary (of the current session; a fenced mount gets a
    /// new session first).
    pub fn primary(&self) -> Arc<dyn ControlLink> {
        self.primary_session().0
    }

    /// [`Cluster::primary`] with its session id.
    pub fn primary_session(&self) -> (Arc<dyn ControlLink>, u64) {
        if self.is_fenced() {
            if let Err(e) = self.recover() {
                warn!(error = %e, "cannot start a new session after the fence");
            }
        }
        self.primary.read().expect("primary lock").clone()
    }

    /// The primary's node id: its region holds the file records and lock trees.
    pub fn primary_id(&self) -> u32 {
        self.primary_id.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Sets how long control RPCs to the primary and verb batches over tcp wait for their node.
    pub fn set_deadline(&self, d: Duration) {
        self.primary.read().expect("primary lock").0.set_deadline(d);
        self.deadline_ms
            .store(d.as_millis() as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// A second control connection to the primary (for the mount's watcher).
    pub fn connect_primary(&self) -> Result<Arc<dyn ControlLink>, ConnectError> {
        let p = self.info.read().expect("cluster info lock").primary.clone();
        let addr = control_addr(&p, self.transport)?;
        Ok(self.dial(&addr)?)
    }

    /// A new control connection to `addr`, through the mount's dialer.
    fn dial(&self, addr: &str) -> Result<Arc<dyn ControlLink>, RpcError> {
        self.env.dial.connect(addr, &self.secret, &self.name)
    }

    /// Connects to the cluster through any of `addrs` (`host:port` or `unix:PATH`); the
    /// mount's core takes time (and everything else [`Env`] holds) from `env`.
    pub fn connect(
        env: Env,
        addrs: &[String],
        secret: Secret,
        transport: TransportChoice,
        rdma_device: Option<String>,
        name: &str,
    ) -> Result<Cluster, ConnectError> {
        if addrs.is_empty() {
            return Err(ConnectError::NoAddress);
        }
        // Every control connection the core opens is timed into the mount's metrics.
        let metrics = Arc::new(MountMetrics::default());
        let env = Env {
            dial: Arc::new(Metered::new(env.dial, metrics.clone(), env.clock.clone())),
            ..env
        };
        let mut last = String::new();
        for addr in addrs {
            let first = match env.dial.connect(addr, &secret, name) {
                Ok(c) => c,
                Err(RpcError::Connection(e @ VerbsError::Auth { .. })) => return Err(e.into()),
                Err(e @ RpcError::Version { .. }) => return Err(e.into()),
                Err(e) => {
                    last = e.to_string();
                    continue;
                }
            };
            let info = first.cluster()?;
            // The primary over its Unix socket when it is on this host (shm): a third less
            // per round trip than loopback TCP.
            let best = control_addr(&info.primary, transport)?;
            let primary = if info.primary.node_id != first.node_id() {
                env.dial.connect(&best, &secret, name)?
            } else if best != *addr && best.starts_with("unix:") {
                env.dial.connect(&best, &secret, name).unwrap_or_else(|e| {
                    debug!(error = %e, socket = %best, "the primary's Unix socket refused: staying on {addr}");
                    first
                })
            } else {
                first
            };
            let session = session_of(&*primary)?;
            info!(primary = %info.primary.name, nodes = info.nodes.len(), session, "connected to the cluster");
            for (id, why) in &info.down {
                warn!(
                    node = id,
                    reason = %why,
                    "the cluster is degraded: this memory node is down (stripes it alone holds return EIO)"
                );
            }
            return Ok(Cluster {
                primary_id: primary.node_id().into(),
                primary: RwLock::new((primary, session)),
                info: RwLock::new(info),
                nodes: RwLock::default(),
                secret,
                transport,
                rdma_device,
                name: name.into(),
                lock_client: Mutex::new(None),
                lock_setup: Mutex::new(()),
                keep_budget: rackfs_locks::KeepBudget::new(crate::lock::KEPT_TREES),
                qos: RwLock::new(None),
                deadline_ms: (rackfs_verbs::tcp::DEFAULT_DEADLINE.as_millis() as u64).into(),
                lease: RwLock::default(),
                qos_wanted: Mutex::new(None),
                on_session: Mutex::new(None),
                on_failover: Mutex::new(None),
                requests: Default::default(),
                failovers: 0.into(),
                recovering: Mutex::new(()),
                loads: NodeLoads::new(ReadPolicy::Adaptive, env.clock.clone()),
                env,
                metrics,
            });
        }
        Err(ConnectError::Unreachable {
            addrs: addrs.join(","),
            last,
        })
    }

    /// How long (ns) a stripe on `node` may be written without re-checking its tag since it
    /// was last seen live: half the node's quarantine (0 for a node not known yet).
    pub fn stripe_lease_ns(&self, node: u32) -> u64 {
        self.info
            .read()
            .expect("cluster info lock")
            .nodes
            .iter()
            .find(|n| n.node_id == node)
            .map_or(0, |n| n.quarantine_ms * 500_000)
    }

    /// The budget of lock trees this mount keeps at once, shared by its files.
    pub fn keep_budget(&self) -> Arc<rackfs_locks::KeepBudget> {
        self.keep_budget.clone()
    }

    /// Starts a thread of the core through the mount's [`crate::spawn::Spawn`].
    pub fn spawn(&self, name: &str, work: crate::spawn::Work) -> std::io::Result<()> {
        self.env.spawn.spawn(name, work)
    }

    /// The clock this mount's core takes time from.
    pub fn clock(&self) -> &SharedClock {
        &self.env.clock
    }

    /// What this mount's core takes from its surroundings.
    pub fn env(&self) -> &Env {
        &self.env
    }

    pub fn info(&self) -> ClusterInfo {
        self.info.read().expect("cluster info lock").clone()
    }

    /// This mount's session on the primary (the token nodes fence it by).
    pub fn session(&self) -> u64 {
        self.primary.read().expect("primary lock").1
    }

    fn lease(&self) -> Arc<Lease> {
        self.lease.read().expect("lease lock").clone()
    }

    /// Whether the mount's current session is over (fenced, or replaced by a new one since):
    /// what waits on the primary's memory in that session waits for nothing.
    pub fn session_over(&self) -> impl Fn() -> bool + Send + Sync + 'static {
        // Weak: a held lease would keep its renewal thread going after the session ended.
        let lease = Arc::downgrade(&self.lease());
        move || lease.upgrade().is_none_or(|l| l.over())
    }

    /// Why the primary fenced this mount's session, if it did (until a new session starts).
    fn fenced(&self) -> Option<String> {
        self.lease().fenced.get().cloned()
    }

    /// Whether the primary fenced this mount's session (checked on every operation: no copy).
    fn is_fenced(&self) -> bool {
        self.lease
            .read()
            .expect("lease lock")
            .fenced
            .get()
            .is_some()
    }

    /// Calls `hook` with the QoS slot of every new session this mount starts and the
    /// primary's tcp address.
    pub fn on_new_session(&self, hook: impl Fn(Option<u16>, Option<&str>) + Send + Sync + 'static) {
        *self.on_session.lock().expect("session hook lock") = Some(Box::new(hook));
    }

    /// Calls `hook` once this mount continues on a primary that took over: the mount forgets
    /// its cached layouts and reports what it wrote to the files it has open.
    pub fn on_failover(&self, hook: impl Fn() + Send + Sync + 'static) {
        *self.on_failover.lock().expect("failover hook lock") = Some(Box::new(hook));
    }

    /// A namespace request to the primary. If the primary stopped answering and the cluster
    /// elects its primary (etcd), the mount waits for the one elected next
    /// ([`Cluster::failover`]) and sends the request there as a retry (across up to
    /// three failovers): a change the old primary made (and the standby mirrored)
    /// is answered as it was, not made twice.
    pub fn meta(&self, req: MetaRequest) -> Result<ControlResponse, RpcError> {
        let req = MetaRequest::Numbered {
            id: self
                .requests
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            req: Box::new(req),
        };
        let (primary, mut session) = self.primary_session();
        let mut asked = req.clone();
        let mut r = primary.meta(req);
        // Refused as fenced, the request was not made: asked again, once, in a new session.
        if let Err(RpcError::Refused {
            code: rackfs_proto::ErrorCode::Fenced,
            message,
        }) = &r
        {
            match self.fenced_by_primary(session, message) {
                Ok(()) => {
                    let (primary, now) = self.primary_session();
                    session = now;
                    r = primary.meta(asked.clone());
                }
                Err(e) => warn!(error = %e, "no new session after the primary fenced this mount"),
            }
        }
        // A primary that took over may die too.
        for _ in 0..META_FAILOVERS {
            match r {
                Err(e) if primary_lost(&e) && self.elects_primary() => {
                    if let Err(why) = self.failover(session) {
                        warn!(error = %why, "no primary took over: EIO");
                        return Err(e);
                    }
                    // If the old primary made the change before it died, the new one answers
                    // what it answered instead of making it twice. The retry wraps the earlier
                    // ones: any session this request went through may have made it.
                    asked = MetaRequest::Retry {
                        from: session,
                        req: Box::new(asked),
                    };
                    let (primary, now) = self.primary_session();
                    session = now;
                    r = primary.meta(asked.clone());
                }
                done => return done,
            }
        }
        r
    }

    /// How many times this mount moved to a primary that took over (see
    /// [`Cluster::primary_replaced`]).
    pub fn failovers(&self) -> u64 {
        self.failovers.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// After an operation that started when [`Cluster::failovers`] was `before` failed with
    /// EIO: whether the primary is gone (or no longer acts) and another took over, this mount
    /// now continuing there; the operation may then run again. `false` when the primary still
    /// answers (the failure was something else).
    pub fn primary_replaced(&self, before: u64) -> bool {
        if !self.elects_primary() {
            return false;
        }
        // A failover another thread is making swaps the primary's link before it counts:
        // waited out first, or the probe below would find the new primary answering and the
        // count not moved yet.
        drop(self.recovering.lock().expect("recovery lock"));
        if self.failovers() != before {
            return true; // another thread moved on meanwhile
        }
        let (primary, session) = self.primary.read().expect("primary lock").clone();
        let probe = primary.meta(MetaRequest::GetAttr {
            ino: rackfs_proto::namespace::ROOT_INO,
        });
        match probe {
            Err(e) if primary_lost(&e) => match self.failover(session) {
                Ok(()) => true,
                Err(why) => {
                    warn!(error = %why, "no primary took over: EIO");
                    false
                }
            },
            _ => self.failovers() != before,
        }
    }

    /// Whether the primary this mount knows still serves it in session `session`: it answers
    /// a namespace request there (not deposed, the session not fenced). A data operation the
    /// primary failed may then be tried again on a new connection: a primary paused for about
    /// its lease may keep it, or win it back, yet refuse data until it renewed its own. One
    /// that says it is not serving is asked again for up to 2 s (it may be renewing its lease
    /// right now); one that does not answer is not. Never starts a new session.
    pub fn primary_serves(&self, session: u64) -> bool {
        let started = self.clock().now();
        loop {
            let (primary, now) = self.primary.read().expect("primary lock").clone();
            if now != session || self.is_fenced() {
                return false;
            }
            match primary.meta(MetaRequest::GetAttr {
                ino: rackfs_proto::namespace::ROOT_INO,
            }) {
                Ok(ControlResponse::Attr(_)) => return true,
                Err(RpcError::Refused {
                    code: rackfs_proto::ErrorCode::NotPrimary,
                    ..
                }) if self.clock().now().saturating_sub(started) < PRIMARY_RETURN => {
                    self.clock().sleep(Duration::from_millis(50));
                }
                _ => return false,
            }
        }
    }

    /// Whether another node is elected primary when this one dies (etcd).
    pub fn elects_primary(&self) -> bool {
        self.info.read().expect("cluster info lock").elects
    }

    /// The primary of session `failed` stopped answering: finds the primary elected since
    /// (asking every node this mount knows, for up to [`FAILOVER_WAIT`]) and continues there
    /// under a new session that adopts the old one's open files, as after a fence.
    pub fn failover(&self, failed: u64) -> Result<(), ConnectError> {
        let _one = self.recovering.lock().expect("recovery lock");
        if self.session() != failed {
            return Ok(()); // another thread did it
        }
        let old = self.primary_id();
        let started = self.clock().now();
        warn!(
            primary = old,
            "the primary does not answer: waiting for another to take over"
        );
        let waited = || self.clock().now().saturating_sub(started) > FAILOVER_WAIT;
        let (new, id) = loop {
            let Some((client, info)) = self.find_primary(old) else {
                if waited() {
                    return Err(ConnectError::Unreachable {
                        addrs: "every known node".into(),
                        last: format!(
                            "no primary serving within {FAILOVER_WAIT:?} (node {old} was)"
                        ),
                    });
                }
                self.clock().sleep(Duration::from_millis(200));
                continue;
            };
            let new = info.primary.node_id;
            self.learn(info, true);
            self.primary_id
                .store(new, std::sync::atomic::Ordering::SeqCst);
            match self.take_over_session(client, failed) {
                Ok(id) => break (new, id),
                // The node found went away (an old primary that resumed for a moment before
                // it learnt it was deposed): another is looked for, within the same patience.
                Err(e) if !waited() => {
                    warn!(primary = new, error = %e, "the primary found did not give this mount a session; looking again");
                    self.clock().sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(e),
            }
        };
        // Without its QoS the mount still serves (the new primary may not admit it).
        let slot = self.renew_qos().ok().flatten();
        self.tell_session(slot);
        self.failovers
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if let Some(hook) = self
            .on_failover
            .lock()
            .expect("failover hook lock")
            .as_ref()
        {
            hook();
        }
        warn!(old_primary = old, primary = new, session = id, took = ?self.clock().now().saturating_sub(started), "continuing on the primary that took over");
        Ok(())
    }

    /// A control connection to the primary some node other than `old` names (or to `old`
    /// itself once it serves again), with the cluster as that primary sees it.
    fn find_primary(&self, old: u32) -> Option<(Arc<dyn ControlLink>, ClusterInfo)> {
        let nodes = self.info().nodes;
        for n in nodes.iter().filter(|n| n.node_id != old) {
            let Ok(addr) = control_addr(n, self.transport) else {
                continue;
            };
            let Ok(c) = self.dial(&addr) else {
                continue;
            };
            c.set_deadline(Duration::from_secs(1));
            let Ok(seen) = c.cluster() else { continue };
            if seen.primary.node_id == old {
                continue;
            }
            let p = if seen.primary.node_id == c.node_id() {
                c
            } else {
                let Ok(addr) = control_addr(&seen.primary, self.transport) else {
                    continue;
                };
                match self.dial(&addr) {
                    Ok(p) => p,
                    Err(_) => continue,
                }
            };
            // The new primary's own view: it knows the nodes that follow it.
            match p.cluster() {
                Ok(info) if info.primary.node_id == p.node_id() => return Some((p, info)),
                _ => continue,
            }
        }
        self.old_primary_again(old, &nodes)
    }

    /// The old primary itself, if it serves the namespace again: elected once more after a
    /// pause too short for its standby to take over first (the others then name it, and
    /// nobody else would ever answer).
    fn old_primary_again(
        &self,
        old: u32,
        nodes: &[NodeAddr],
    ) -> Option<(Arc<dyn ControlLink>, ClusterInfo)> {
        let n = nodes.iter().find(|n| n.node_id == old)?;
        let c = self.dial(&control_addr(n, self.transport).ok()?).ok()?;
        c.set_deadline(Duration::from_secs(1));
        let info = c.cluster().ok()?;
        let root = MetaRequest::GetAttr {
            ino: rackfs_proto::namespace::ROOT_INO,
        };
        (info.primary.node_id == old && c.meta(root).is_ok()).then_some((c, info))
    }

    /// The primary refused session `session` as fenced (a namespace request can learn it
    /// before the lease's renewer does): the session is marked so, and the mount continues
    /// under a new one ([`Cluster::recover`]; nothing if another thread did meanwhile).
    fn fenced_by_primary(&self, session: u64, why: &str) -> Result<(), ConnectError> {
        {
            let _one = self.recovering.lock().expect("recovery lock");
            if self.session() == session {
                let _ = self.lease().fenced.set(why.to_string());
            }
        }
        self.recover()
    }

    /// After the primary fenced this mount: starts a new session (control connection, fence
    /// token, lock and QoS slots; data connections are made anew on use) and takes over the
    /// fenced session's open files. Operations of the fenced session fail with EIO; those that
    /// start later run in the new one.
    pub fn recover(&self) -> Result<(), ConnectError> {
        let _one = self.recovering.lock().expect("recovery lock");
        let Some(why) = self.fenced() else {
            return Ok(()); // another thread did it
        };
        let old = self.session();
        let id = self.take_over_session(self.connect_primary()?, old)?;
        let slot = self.renew_qos()?;
        self.tell_session(slot);
        warn!(old, new = id, fenced = %why, "this mount continues under a new session (its operations in flight when it was fenced failed with EIO)");
        Ok(())
    }

    /// Starts a new session on `client` (a connection to the primary) that takes over the open
    /// files of this mount's session `from` (before the old connection closes, which would
    /// release them); per-session state (data connections, lock client, QoS, lease) starts
    /// afresh. Returns the new session's id.
    fn take_over_session(
        &self,
        client: Arc<dyn ControlLink>,
        from: u64,
    ) -> Result<u64, ConnectError> {
        client.set_deadline(Duration::from_millis(
            self.deadline_ms.load(std::sync::atomic::Ordering::Relaxed),
        ));
        let id = session_of(&*client)?;
        if let Err(e) = client.call(&ControlRequest::Adopt { from }) {
            warn!(error = %e, "the new session could not take over the open files");
        }
        *self.primary.write().expect("primary lock") = (client, id);
        self.nodes.write().expect("nodes lock").clear();
        *self.lock_client.lock().expect("lock client") = None;
        *self.qos.write().expect("qos lock") = None;
        let old = std::mem::take(&mut *self.lease.write().expect("lease lock"));
        old.replaced
            .store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(id)
    }

    /// Asks the primary again for the QoS this mount asked for; its slot (`None`: no QoS).
    fn renew_qos(&self) -> Result<Option<u16>, RpcError> {
        let wanted = *self.qos_wanted.lock().expect("qos wanted lock");
        wanted.map(|(r, l, w)| self.enable_qos(r, l, w)).transpose()
    }

    /// Tells the session hook (the mount's state record) the new session's QoS slot and the
    /// primary's address.
    fn tell_session(&self, slot: Option<u16>) {
        let primary = self.info().primary.tcp;
        if let Some(hook) = self.on_session.lock().expect("session hook lock").as_ref() {
            hook(slot, primary.as_deref());
        }
    }

    /// The queue pair to node `id` in session `session` (EIO-worthy `Fenced` if the mount has
    /// moved on to another session since).
    pub fn node_in(&self, id: u32, session: u64) -> Result<Arc<Node>, VerbsError> {
        let n = self.node(id)?;
        if n.session != session {
            return Err(VerbsError::Fenced {
                peer: format!("node {id}"),
                reason: format!("session {session} was fenced; this operation belonged to it"),
            });
        }
        Ok(n)
    }

    /// The queue pair to node `id`, connecting on first use.
    pub fn node(&self, id: u32) -> Result<Arc<Node>, VerbsError> {
        if self.is_fenced() {
            if let Err(e) = self.recover() {
                return Err(VerbsError::Fenced {
                    peer: format!("node {id}"),
                    reason: format!("no new session after the fence: {e}"),
                });
            }
        }
        if let Some(n) = self.nodes.read().expect("nodes lock").get(&id) {
            if !n.qp.is_broken() {
                return Ok(n.clone());
            }
        }
        let cached = self.info().nodes.into_iter().find(|n| n.node_id == id);
        let addr = cached.or_else(|| self.ask_addr(id));
        let session = self.session();
        let addr = addr.ok_or_else(|| VerbsError::Connect {
            peer: format!("node {id}"),
            reason: "not in the cluster".into(),
        })?;
        let qp = match self.connect_to(&addr, session) {
            Ok(qp) => qp,
            // A node started again listens elsewhere: ask the primary where it is now.
            Err(e) => match self.ask_addr(id) {
                Some(now) if now != addr => self.connect_to(&now, session)?,
                _ => return Err(e),
            },
        };
        let rkey = qp
            .regions()
            .first()
            .map(|r| r.rkey)
            .ok_or_else(|| VerbsError::Protocol {
                peer: addr.name.clone(),
                reason: "node registered no region".into(),
            })?;
        info!(
            node = id,
            peer = qp.peer(),
            transport = qp.transport(),
            "connected to a memory node"
        );
        let node = Arc::new(Node { qp, rkey, session });
        let mut nodes = self.nodes.write().expect("nodes lock");
        // Kept only if no new session started meanwhile (its clear would have missed it).
        if self.session() == session {
            nodes.insert(id, node.clone());
        }
        Ok(node)
    }

    /// Keeps the nodes this mount knows current, asking the primary every second (on a
    /// thread that ends with the mount): they are where it looks for a primary that took
    /// over, so a node that joined after the mount must be among them (a mount that knew only
    /// the first primary failed every request with `EIO` once it died).
    pub fn keep_members_known(self: &Arc<Self>) {
        let (weak, clock) = (Arc::downgrade(self), self.clock().clone());
        let refresh = move || loop {
            clock.sleep(MEMBERS_EVERY);
            let Some(cl) = weak.upgrade() else { return };
            match cl.primary().cluster() {
                Ok(info) => cl.learn(info, false),
                Err(e) => debug!(error = %e, "cannot ask the primary for the cluster's nodes"),
            }
        };
        if let Err(e) = self.env.spawn.spawn("rackfs-members", Box::new(refresh)) {
            warn!(error = %e, "no thread to follow the cluster's nodes: a primary that takes over may not be found");
        }
    }

    /// Where node `id` is now, as the primary says (the cached cluster map is refreshed).
    fn ask_addr(&self, id: u32) -> Option<NodeAddr> {
        let info = self.primary().cluster().ok()?;
        let addr = info.nodes.iter().find(|n| n.node_id == id).cloned();
        self.learn(info, false);
        addr
    }

    /// Takes a primary's cluster map, keeping the nodes it does not list: after a take-over,
    /// data nodes join the new primary within a quarter of their lease, and until then their
    /// stripes are read and written as before (a map without them failed every write to
    /// them, for good, once it was learnt in that window). Who the primary is changes only
    /// when this mount follows one (`follow`): a map asked of the primary while it is being
    /// deposed names the deposed one, and the watcher, reconnecting there, took the primary
    /// this mount had just followed for dead and failed over from it.
    fn learn(&self, mut info: ClusterInfo, follow: bool) {
        let mut known = self.info.write().expect("cluster info lock");
        for n in std::mem::take(&mut known.nodes) {
            if !info.nodes.iter().any(|m| m.node_id == n.node_id) {
                info.nodes.push(n);
            }
        }
        if !follow {
            info.primary = known.primary.clone();
        }
        *known = info;
    }

    /// A new queue pair to the node at `addr`, over the mount's transport.
    fn connect_to(&self, addr: &NodeAddr, session: u64) -> Result<QueuePair, VerbsError> {
        Ok(
            match (
                local_socket(addr, self.transport),
                &addr.tcp,
                self.transport,
            ) {
                (Some(sock), _, _) => rackfs_verbs::shm::connect_fenced(
                    Path::new(sock),
                    &self.secret,
                    &self.name,
                    session,
                )?,
                (None, _, TransportChoice::Shm) => {
                    return Err(VerbsError::Connect {
                        peer: addr.name.clone(),
                        reason: "transport=shm but the node's socket is not on this host".into(),
                    })
                }
                (None, Some(tcp), TransportChoice::Rdma) => rackfs_verbs::rdma::connect(
                    tcp,
                    &self.secret,
                    &self.name,
                    session,
                    self.rdma_device.as_deref(),
                )?,
                (None, Some(tcp), _) => rackfs_verbs::tcp::connect_with(
                    tcp,
                    &self.secret,
                    &self.name,
                    rackfs_verbs::tcp::TcpOptions {
                        deadline: Duration::from_millis(
                            self.deadline_ms.load(std::sync::atomic::Ordering::Relaxed),
                        ),
                        fence: session,
                        ..Default::default()
                    },
                )?,
                (None, None, _) => {
                    return Err(VerbsError::Connect {
                        peer: addr.name.clone(),
                        reason: "the node has no reachable address".into(),
                    })
                }
            },
        )
    }

    /// This mount's lock client slot and lock configuration, obtained on first use: the slot
    /// from the primary (it belongs to this mount's session), the configuration from round
    /// trips measured on the primary's queue pair.
    pub fn lock_client(&self) -> Result<(u16, LockConfig, u64), i32> {
        let (primary, session) = self.primary_session();
        // One set-up at a time; the cache itself is locked only briefly (a new session clears
        // it while a set-up may be under way).
        let _setup = self.lock_setup.lock().expect("lock set-up");
        let cached = self.lock_client.lock().expect("lock client").clone();
        if let Some(c) = cached.filter(|c| c.2 == session) {
            return Ok(c);
        }
        let slot = match primary.meta(MetaRequest::LockSlot) {
            Ok(ControlResponse::LockSlot(s)) => s,
            Ok(_) => return Err(libc::EIO),
            Err(e) => {
                warn!(error = %e, "no lock client slot");
                return Err(e.errno());
            }
        };
        let primary_id = self.primary_id();
        let p = self
            .node_in(primary_id, session)
            .map_err(|e| self.verbs_errno(primary_id, &e))?;
        let cfg = rackfs_verbs::block_on(LockConfig::calibrated(
            &p.qp,
            rackfs_verbs::RemoteAddr::new(p.rkey, 0),
        ))
        .map_err(|e| self.verbs_errno(primary_id, &e))?;
        info!(slot, rtt_budget = ?cfg.rtt_budget, "range locks ready");
        self.keep_lease(session)
            .map_err(|e| self.verbs_errno(primary_id, &e))?;
        *self.lock_client.lock().expect("lock client") = Some((slot, cfg.clone(), session));
        Ok((slot, cfg, session))
    }

    /// Starts renewing this mount's lock lease on a connection of its own, every quarter of
    /// the lease, until the cluster is dropped or the primary says the mount was fenced.
    fn keep_lease(&self, session: u64) -> Result<(), VerbsError> {
        if self.session() != session {
            return Err(VerbsError::Fenced {
                peer: self.primary().peer().into(),
                reason: format!("session {session} ended while its lock slot was set up"),
            });
        }
        let client = self.connect_primary().map_err(|e| VerbsError::Connect {
            peer: self.primary().peer().into(),
            reason: format!("no connection for lease renewals: {e}"),
        })?;
        let lease = Arc::downgrade(&self.lease());
        let renew = move || client.call(&ControlRequest::Renew { of: session });
        let clock = self.clock().clone();
        let renewer = move || {
            let mut every;
            let mut failing = false;
            loop {
                let result = renew();
                let Some(lease) = lease.upgrade() else { return };
                match result {
                    Ok(ControlResponse::Lease { ms }) => {
                        every = Duration::from_millis(ms / 4);
                        if std::mem::take(&mut failing) {
                            info!("lock lease renewed again");
                        }
                    }
                    Err(RpcError::Refused {
                        code: rackfs_proto::control::ErrorCode::Fenced,
                        message,
                    }) => {
                        tracing::error!(
                            "{message}; every operation of this mount now fails with EIO"
                        );
                        let _ = lease.fenced.set(message);
                        return;
                    }
                    other => {
                        if !std::mem::replace(&mut failing, true) {
                            warn!(answer = ?other, "cannot renew the lock lease; retrying");
                        }
                        every = Duration::from_millis(100);
                    }
                }
                drop(lease);
                clock.sleep(every);
            }
        };
        self.env
            .spawn
            .spawn("lease", Box::new(renewer))
            .map_err(|e| VerbsError::Connect {
                peer: "lease thread".into(),
                reason: e.to_string(),
            })?;
        Ok(())
    }

    /// Registers this mount's QoS with the primary (admission control may refuse it, with
    /// the reason); from then on every data operation spends tokens. Returns the mount's slot.
    pub fn enable_qos(&self, reservation: u64, limit: u64, weight: u32) -> Result<u16, RpcError> {
        *self.qos_wanted.lock().expect("qos wanted lock") = Some((reservation, limit, weight));
        let primary = self.primary.read().expect("primary lock").0.clone();
        match primary.call(&ControlRequest::QosSet {
            slot: None,
            reservation,
            limit,
            weight,
        }) {
            Ok(ControlResponse::QosGranted { slot, .. }) => {
                *self.qos.write().expect("qos lock") = Some(Qos {
                    slot,
                    engines: FxHashMap::default(),
                });
                Ok(slot)
            }
            Ok(other) => Err(RpcError::Unexpected {
                peer: primary.peer().into(),
                what: format!("{other:?}"),
            }),
            Err(e) => Err(e),
        }
    }

    /// This mount's counters and latencies.
    pub fn metrics(&self) -> &Arc<MountMetrics> {
        &self.metrics
    }

    /// The Prometheus text of this mount (mounted at `mount`): its metrics, and per node its
    /// QoS tokens spent from the reservation and from the pool, beside what it asked for.
    pub fn render_metrics(&self, mount: &str) -> String {
        let mut p = rackfs_metrics::Page::new();
        self.metrics.render(&mut p, mount);
        if let Some((reservation, limit, weight)) =
            *self.qos_wanted.lock().expect("qos wanted lock")
        {
            for (what, v) in [
                ("reservation", reservation),
                ("limit", limit),
                ("weight", weight as u64),
            ] {
                p.gauge(
                    "mount_qos_asked",
                    "The QoS the mount asked for: reservation and limit in IOPS, weight.",
                    &[("mount", mount), ("what", what)],
                    v,
                );
            }
        }
        let engines: Vec<(u32, Arc<QosEngine>)> = match self.qos.read().expect("qos lock").as_ref()
        {
            Some(q) => q.engines.iter().map(|(&n, e)| (n, e.clone())).collect(),
            None => Vec::new(),
        };
        for (node, e) in engines {
            let t = e.totals();
            let node = node.to_string();
            for (source, v) in [("reservation", t.from_reservation), ("pool", t.from_pool)] {
                p.counter(
                    "mount_qos_tokens_total",
                    "QoS tokens the mount spent (one per 4 KiB operation), by node and source.",
                    &[("mount", mount), ("node", &node), ("source", source)],
                    v,
                );
            }
        }
        p.finish()
    }

    /// Waits until this mount may spend `tokens` on one-sided data operations on `node`
    /// (immediately without QoS); hold the result until the operations are done.
    pub fn admit(&self, node: u32, tokens: u64) -> Result<Option<InFlight>, VerbsError> {
        let engine = {
            let q = self.qos.read().expect("qos lock");
            let Some(q) = q.as_ref() else { return Ok(None) };
            q.engines.get(&node).cloned()
        };
        let engine = match engine {
            Some(e) => e,
            None => {
                let n = self.node(node)?;
                let listed = self.info().nodes.into_iter().find(|a| a.node_id == node);
                let area = listed
                    .or_else(|| self.ask_addr(node))
                    .map(|a| a.qos_area)
                    .ok_or_else(|| VerbsError::Connect {
                        peer: format!("node {node}"),
                        reason: "not in the cluster".into(),
                    })?;
                let mut q = self.qos.write().expect("qos lock");
                let Some(q) = q.as_mut() else { return Ok(None) };
                let slot = q.slot;
                q.engines
                    .entry(node)
                    .or_insert_with(|| {
                        Arc::new(QosEngine::new(
                            n.qp.clone(),
                            rackfs_verbs::RemoteAddr::new(n.rkey, area),
                            slot,
                            EngineConfig::default(),
                        ))
                    })
                    .clone()
            }
        };
        // Admitted at once (the common case) is a wait of zero, recorded without the clock.
        if let Some(admitted) = engine.try_admit(tokens) {
            self.metrics.qos_wait.observe(Duration::ZERO);
            return Ok(Some(admitted));
        }
        let started = self.clock().now();
        let borrow = |t| self.lend_to(node, t);
        let r = rackfs_verbs::block_on(engine.admit_borrowing(tokens, &borrow)).map(Some);
        self.metrics
            .qos_wait
            .observe(self.clock().now().saturating_sub(started));
        r
    }

    /// Takes `tokens` of this period's limit room for node `node`'s engine from the first
    /// other node's engine that has them to spare; whether one had. The mount's limit is one
    /// budget, split over the nodes only by a guess of where it will work.
    fn lend_to(&self, node: u32, tokens: u64) -> bool {
        self.qos_engines()
            .iter()
            .any(|(n, e)| *n != node && e.lend_room(tokens))
    }

    /// Keeps this mount's QoS engines fresh while it is idle (every δ), so its unused
    /// reservation decays, its reports say so, and the nodes can give it to others. The
    /// thread ends with the cluster.
    pub fn start_qos_ticker(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let clock = self.clock().clone();
        let ticker = move || loop {
            // Busy engines refresh on their own (every δ, from their requests); idle ones
            // only need their decay and reports kept roughly current.
            clock.sleep(EngineConfig::default().delta * 4);
            let Some(cl) = weak.upgrade() else { return };
            for (_, e) in cl.qos_engines() {
                if let Err(err) = rackfs_verbs::block_on(e.tick()) {
                    tracing::debug!(error = %err, "QoS refresh failed");
                }
            }
        };
        if let Err(e) = self.env.spawn.spawn("qos-ticker", Box::new(ticker)) {
            warn!(error = %e, "no QoS ticker: an idle mount's reservation decays only on use");
        }
    }

    /// The nodes among `nodes` where this mount's QoS would make `tokens` wait now (none
    /// without QoS): a read passes them over while another replica's node would not.
    pub fn qos_held_back(&self, nodes: impl Iterator<Item = u32>, tokens: u64) -> Vec<u32> {
        let q = self.qos.read().expect("qos lock");
        let Some(q) = q.as_ref() else {
            return Vec::new();
        };
        nodes
            .filter(|n| q.engines.get(n).is_some_and(|e| e.would_wait(tokens)))
            .collect()
    }

    /// This mount's QoS engines by node, for `rackfs status`.
    pub fn qos_engines(&self) -> Vec<(u32, Arc<QosEngine>)> {
        self.qos
            .read()
            .expect("qos lock")
            .as_ref()
            .map(|q| q.engines.iter().map(|(&n, e)| (n, e.clone())).collect())
            .unwrap_or_default()
    }

    /// Data node `node` failed a write: asks the primary to declare it dead and drop it from
    /// every stripe's replicas (answered once that is done, after the node's lease ran out,
    /// so it serves nothing stale). `Ok(true)`: dropped, the write goes to the replicas left;
    /// `Ok(false)`: the node still renews its lease (this mount's connection failed, not the
    /// node): reconnect and write again.
    pub fn node_failed(&self, node: u32) -> Result<bool, i32> {
        self.loads.failed(node);
        match self.primary().call(&ControlRequest::NodeFailed { node }) {
            Ok(ControlResponse::Ok) => Ok(true),
            Ok(_) => Err(libc::EIO),
            Err(RpcError::Refused {
                code: rackfs_proto::ErrorCode::Unavailable,
                message,
            }) => {
                info!(node, why = %message, "a memory node failed a write but still holds its lease: writing again");
                Ok(false)
            }
            Err(e) => {
                warn!(node, error = %e, "cannot have a failed memory node dropped from the replicas: EIO");
                Err(e.errno())
            }
        }
    }

    /// The errno for a failed verb to `node`; a lost or confused connection is dropped so the
    /// next use reconnects.
    pub fn verbs_errno(&self, node: u32, e: &VerbsError) -> i32 {
        if matches!(
            e,
            VerbsError::ConnectionLost { .. }
                | VerbsError::Protocol { .. }
                | VerbsError::Fenced { .. }
        ) {
            self.drop_node(node, e);
        }
        libc::EIO
    }

    /// Forgets a node's connection after it failed, so the next use reconnects.
    pub fn drop_node(&self, id: u32, why: &VerbsError) {
        // The node's QoS engine holds the connection too: it is made anew on the next use.
        if let Some(q) = self.qos.write().expect("qos lock").as_mut() {
            q.engines.remove(&id);
        }
        let mut nodes = self.nodes.write().expect("nodes lock");
        // A tcp connection that is not broken is a newer one than the one that failed.
        let newer = nodes
            .get(&id)
            .is_some_and(|n| n.qp.transport() == "tcp" && !n.qp.is_broken());
        if !newer && nodes.remove(&id).is_some() {
            if let VerbsError::Fenced { .. } = why {
                tracing::error!(node = id, error = %why, "this mount was fenced: operations on the node's data return EIO");
            } else {
                warn!(node = id, error = %why, "lost the connection to a memory node: operations on its data return EIO; the next one reconnects");
            }
        }
    }
}

/// Failovers a namespace request is carried across.
const META_FAILOVERS: usize = 3;

/// How long a primary that says it is not serving is asked again whether it serves a data
/// operation's session (see [`Cluster::primary_serves`]): about a node lease, within which a
/// primary that kept its coordinator lease renews its own.
const PRIMARY_RETURN: Duration = Duration::from_secs(2);

/// How long a mount waits for a standby to take over from a primary that stopped answering.
pub const FAILOVER_WAIT: Duration = Duration::from_secs(20);

/// How often a mount refreshes the nodes it knows ([`Cluster::keep_members_known`]).
const MEMBERS_EVERY: Duration = Duration::from_secs(1);

/// Whether a control call failed because the primary is gone or no longer acts as primary.
fn primary_lost(e: &RpcError) -> bool {
    use rackfs_proto::control::ErrorCode;
    match e {
        RpcError::Connection(_) | RpcError::Timeout { .. } => true,
        RpcError::Refused { code, .. } => matches!(code, ErrorCode::NotPrimary),
        _ => false,
    }
}

/// The session id of a control connection.
fn session_of(c: &dyn ControlLink) -> Result<u64, RpcError> {
    match c.call(&ControlRequest::Session)? {
        ControlResponse::Session { id } => Ok(id),
        other => Err(RpcError::Unexpected {
            peer: c.peer().into(),
            what: format!("{other:?}"),
        }),
    }
}
