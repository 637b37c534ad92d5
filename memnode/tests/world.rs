//! A whole cluster of production memory nodes in one process, under the [`Turnstile`]: each
//! node is a simulated process whose threads (its duties, roles, take-over, group commit and
//! the requests it serves) run one at a time in an order the seed decides, on virtual time.
//! The coordinator is the embedded one (`rackfs_coord::Local`), served apart from the nodes
//! as `rackfs up` serves it. Control connections are a [`Loopback`] whose requests are
//! served on a thread of the process they are sent to: a stopped process answers nothing
//! until it resumes (its callers time out at their deadline, as over a socket, and what
//! they sent is still served when it resumes), and a killed one fails its callers.
//!
//! Five scenarios, with a mount creating a file every 50 ms at whichever primary the
//! coordinator names (and, in all but the re-elected primary's, a second mount running the
//! production client core, `rackfs_fs::client`, that finds and follows primaries as a real
//! mount does):
//! * issue 24's split brain: the primary is stopped past its lease, its standby takes over
//!   and makes the third node its standby, the old primary resumes, then the new primary is
//!   killed: the third node must take over with the namespace whole;
//! * random faults: once the cluster is healthy (a primary and a running standby), a random
//!   node is stopped past its lease or killed and started again, empty, as `rackfs up`
//!   restarts it (also when it exits, deposed, or cannot rejoin yet); and the same with
//!   partitions too: a node cut off from another node or from the coordinator for 2.5-6 s
//!   (every request and answer across the cut lost, both ways);
//! * a data node stopped past its lease while the primary changes follows the new one;
//! * a primary stopped past its lease, and re-elected, while its standby is stopped longer:
//!   it must keep serving (the stopped node delays neither its lease nor its changes), drop
//!   and unname the stale standby, and the node that takes over when it is killed must have
//!   every creation it answered.
//!
//! A restarted node is reached at its earlier addresses too, as at a deployment's fixed ports
//! or `rackfs up`'s sockets.
//!
//! Oracle: a checker samples every node throughout, never two acting primaries (a metadata
//! service and a valid serve lease) at once; at the end every creation a primary
//! acknowledged is on the node acting as primary, and each file created once all three nodes
//! had joined still asks for its 2 replicas; the client core's mount sees none of its
//! creations fail (one fault at a time is well within its patience).
//!
//! `RACKFS_WORLD_SEEDS=N` runs N seeds of each (default 2 of the split brain, 8 of random
//! faults; a seed takes 0.2-0.5 s here), from `RACKFS_WORLD_FIRST` (default 0);
//! `RACKFS_WORLD_SEED=S` one. `scripts/simulate` runs many, in parallel.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{addr, secret, socket, Scratch};
use rackfs_clock::turnstile::{seeds, Outcome};
use rackfs_clock::{Bell, Clock, SharedClock, Turnstile};
use rackfs_coord::{Coordinator, Local};
use rackfs_memnode::config::Coordination;
use rackfs_memnode::control::serve_on;
use rackfs_memnode::coordinator::{parse_primary, parse_standby};
use rackfs_memnode::node::{Exit, Node};
use rackfs_memnode::term::PRIMARY_KEY;
use rackfs_memnode::{MemNode, NodeConfig, NodeEnv, Role};
use rackfs_meta::Storage;
use rackfs_proto::control::{ControlRequest, ControlResponse, ErrorCode};
use rackfs_proto::link::{ControlLink, Dial, Loopback};
use rackfs_proto::namespace::{MetaRequest, NewKind, ROOT_INO};
use rackfs_proto::record::REC_REPLICAS;
use rackfs_proto::{Refusal, RpcError};
use rackfs_verbs::{Secret, VerbsError};

/// The world groups (processes) of the coordinator (never paused or killed) and of the
/// test's own threads. Node `id` first runs as process `id`, its `k`th restart as
/// `id + 10 k`.
const COORD: u32 = u32::MAX - 1;
const DRIVER: u32 = u32::MAX;
/// The world group of the mount running the production client core (never paused, killed or
/// cut off: [`party`] 0 is no node).
const CLIENT: u32 = 100;
const NODE_LEASE: Duration = Duration::from_secs(2);
/// How long a control call waits for a paused node before it times out.
const CALL_DEADLINE: Duration = Duration::from_secs(2);

/// The control network of one world (see the module docs).
struct Net {
    lo: Loopback,
    world: Turnstile,
    /// Address -> the group serving it.
    at: Mutex<HashMap<String, u32>>,
    /// Pairs of parties ([`party`]) that cannot reach each other now, the lower first.
    cut: Mutex<HashSet<(u32, u32)>>,
}

/// Who group `group` is on the network: a node (its id, whatever its restarts), the
/// coordinator or the test's own threads (the mount).
fn party(group: u32) -> u32 {
    if group >= COORD {
        group
    } else {
        group % 10
    }
}

impl Net {
    /// Cuts (or heals) the network between parties `a` and `b` (see [`party`]): what one sends
    /// the other is lost, in both directions.
    fn partition(&self, a: u32, b: u32, cut: bool) {
        let pair = (a.min(b), a.max(b));
        let mut c = self.cut.lock().unwrap();
        if cut {
            c.insert(pair);
        } else {
            c.remove(&pair);
        }
    }

    /// Whether the calling thread's process and group `to` are cut off from each other.
    fn cut_off_from(&self, to: u32) -> bool {
        let Some(from) = Turnstile::group_here().map(party) else {
            return false;
        };
        let to = party(to);
        self.cut
            .lock()
            .unwrap()
            .contains(&(from.min(to), from.max(to)))
    }

    /// Kills process `group`: its addresses refuse connections, its threads unwind.
    fn kill(&self, group: u32) {
        let addrs: Vec<String> = (self.at.lock().unwrap().iter())
            .filter(|(_, g)| **g == group)
            .map(|(a, _)| a.clone())
            .collect();
        for a in addrs {
            self.lo.set_down(&a, true);
        }
        self.world.kill(group);
    }
}

struct WorldDial(Arc<Net>);

impl Dial for WorldDial {
    fn connect(
        &self,
        addr: &str,
        secret: &Secret,
        client_name: &str,
    ) -> Result<Arc<dyn ControlLink>, RpcError> {
        // A stopped process's kernel still accepts connections: only its calls wait.
        Turnstile::yield_now();
        let inner = self.0.lo.connect(addr, secret, client_name)?;
        let group = self.0.at.lock().unwrap().get(addr).copied();
        Ok(Arc::new(WorldLink {
            net: self.0.clone(),
            inner,
            group: group.expect("a served address has a process"),
            deadline: Mutex::new(CALL_DEADLINE),
        }))
    }
}

/// A connection of the world: each request is served on a thread of the process it was
/// sent to (so a stopped process answers nothing until it resumes, and then answers what
/// waited), and its caller waits for the answer until the deadline.
struct WorldLink {
    net: Arc<Net>,
    inner: Arc<dyn ControlLink>,
    /// The process serving it.
    group: u32,
    deadline: Mutex<Duration>,
}

/// Where a served request's answer is left for its caller.
type Answer = Arc<(
    rackfs_clock::Mutex<Option<Result<ControlResponse, RpcError>>>,
    Bell,
)>;

/// A closed connection ends its session on the node, on a thread of the node's process (a
/// stopped node notices when it resumes): that thread drops the last handle on it.
impl Drop for WorldLink {
    fn drop(&mut self) {
        let inner = self.inner.clone();
        let name = format!("{}/closed", self.group);
        self.net.world.spawn(self.group, &name, move || drop(inner));
    }
}

impl ControlLink for WorldLink {
    fn call(&self, req: &ControlRequest) -> Result<ControlResponse, RpcError> {
        let world = &self.net.world;
        let lost = || {
            RpcError::Connection(VerbsError::ConnectionLost {
                peer: self.inner.peer().into(),
                reason: "the process was killed".into(),
            })
        };
        // A killed process's thread that unwinds runs destructors, which may call out; a
        // process killed with SIGKILL sends nothing more.
        if Turnstile::killed_here() {
            return Err(RpcError::Connection(VerbsError::ConnectionLost {
                peer: self.inner.peer().into(),
                reason: "the calling process was killed".into(),
            }));
        }
        Turnstile::yield_now();
        if world.killed(self.group) {
            return Err(lost());
        }
        let answer: Answer = Arc::default();
        // A request sent across a cut is lost: the caller hears nothing until its deadline.
        if !self.net.cut_off_from(self.group) {
            let (inner, req2, left) = (self.inner.clone(), req.clone(), answer.clone());
            world.spawn(self.group, &format!("{}/serve", self.group), move || {
                let r = inner.call(&req2);
                *left.0.lock().unwrap() = Some(r);
                left.1.notify_all();
            });
        }
        let deadline = *self.deadline.lock().unwrap();
        let until = world.now() + deadline;
        let mut got = answer.0.lock().unwrap();
        loop {
            // So is an answer that comes back across one.
            if let Some(r) = got.take().filter(|_| !self.net.cut_off_from(self.group)) {
                return r;
            }
            if world.killed(self.group) {
                return Err(lost());
            }
            let now = world.now();
            if now >= until {
                return Err(RpcError::Timeout {
                    node: self.inner.node_name().into(),
                    peer: self.inner.peer().into(),
                    after: deadline,
                });
            }
            // Looks again now and then: the process may be killed meanwhile.
            let slice = (until - now).min(Duration::from_millis(100));
            got = answer.1.wait_timeout(got, slice).0;
        }
    }

    fn set_deadline(&self, d: Duration) {
        *self.deadline.lock().unwrap() = d;
    }

    fn peer(&self) -> &str {
        self.inner.peer()
    }

    fn node_id(&self) -> u32 {
        self.inner.node_id()
    }

    fn node_name(&self) -> &str {
        self.inner.node_name()
    }
}

/// Node `id` of the world as process `group` (its socket named after it: a restarted node
/// is a new process): a tcp listener (bound, never connected to: the primary's key names a
/// tcp address), the coordinator served apart, a standby.
fn config(dir: &Path, id: u32, group: u32, role: Role) -> NodeConfig {
    NodeConfig {
        listen: Some("127.0.0.1:0".into()),
        shm_socket: Some(socket(dir, group)),
        region_len: 16 << 20,
        lock_lease: 2 * NODE_LEASE,
        node_lease: NODE_LEASE,
        coordinator: Coordination::Served("unix:coordinator".into()),
        cluster: "world".into(),
        standby: true,
        // The world proves metadata and membership, not QoS: a check every 100 ms instead of
        // every 1 ms keeps the QoS monitors from taking most of the world's turns (at 10 ms
        // they were half of them).
        qos: rackfs_memnode::qos::QosConfig {
            check: Duration::from_millis(100),
            ..Default::default()
        },
        ..common::config(dir, id, role)
    }
}

/// A node's surroundings as process `group`: the world's clock and threads, the world's
/// network, on which it is served at its addresses once it serves, and how it ends.
fn env(net: &Arc<Net>, group: u32, exit: Arc<Exit>) -> NodeEnv {
    let served = net.clone();
    NodeEnv {
        clock: Arc::new(net.world.clone()),
        dial: Arc::new(WorldDial(net.clone())),
        spawn: Arc::new(net.world.threads(group)),
        exit,
        serving: Some(Box::new(move |node: &Arc<Node>| {
            // Where its peers reach it: the primary's key names its tcp address, a joining
            // node's is its socket's.
            // And where its earlier processes were: a restarted node listens where it did
            // before (a deployment's fixed ports, `rackfs up`'s sockets), so whoever knew
            // that address reaches it again.
            let me = node.members.me();
            let socket = me.shm.map(|p| format!("unix:{p}"));
            let earlier: Vec<String> = (served.at.lock().unwrap().iter())
                .filter(|(_, &g)| party(g) == party(group))
                .map(|(a, _)| a.clone())
                .collect();
            for at in me.tcp.into_iter().chain(socket).chain(earlier) {
                served.at.lock().unwrap().insert(at.clone(), group);
                serve_on(&served.lo, &at, node);
            }
        })),
    }
}

/// Serves `coord` at `unix:coordinator`, as `rackfs up`'s process does.
fn serve_coordinator(net: &Arc<Net>, coord: Arc<Local>) {
    net.at
        .lock()
        .unwrap()
        .insert("unix:coordinator".into(), COORD);
    net.lo.serve(
        "unix:coordinator",
        u32::MAX,
        "coordinator",
        move |_session, req| match req {
            ControlRequest::Coord(call) => {
                match rackfs_memnode::coordinator::serve(&*coord, call) {
                    Ok(a) => ControlResponse::Coord(a),
                    Err(r) => r.into(),
                }
            }
            _ => Refusal::new(ErrorCode::NotPrimary, "this is the coordinator").into(),
        },
        None,
    );
}

fn create(link: &dyn ControlLink, name: &str) -> Result<u64, RpcError> {
    match link.meta(MetaRequest::Create {
        parent: ROOT_INO,
        name: name.as_bytes().to_vec(),
        kind: NewKind::File {
            stripe_unit: 1 << 20,
            replicas: 2,
        },
        perm: 0o644,
        uid: 0,
        gid: 0,
    })? {
        ControlResponse::Attr(a) => Ok(a.ino),
        other => panic!("create answered {other:?}"),
    }
}

fn lookup(link: &dyn ControlLink, name: &str) -> Result<u64, RpcError> {
    match link.meta(MetaRequest::Lookup {
        parent: ROOT_INO,
        name: name.as_bytes().to_vec(),
    })? {
        ControlResponse::Attr(a) => Ok(a.ino),
        other => panic!("lookup answered {other:?}"),
    }
}

/// Each node's process now: its world group and the node (a restart is another group).
type Nodes = Arc<Mutex<HashMap<u32, (u32, Arc<Node>)>>>;

/// What one seed's run saw.
#[derive(Debug, Default)]
struct Seen {
    /// Times (virtual) at which two nodes acted as primary, and which.
    two_primaries: Vec<(Duration, Vec<u32>)>,
    /// Files whose creation a primary acknowledged to the mount, and their inodes.
    acked: Vec<(String, u64)>,
    /// Acknowledged files the last primary does not have (or answers otherwise).
    lost: Vec<(String, u64, String)>,
    /// Acknowledged files created once all three nodes had joined that the last primary
    /// lists with fewer replicas than the 2 they asked for (the cluster had 3 nodes then, at
    /// most one of them failed at a time), and how many.
    short: Vec<(String, u64, u64)>,
    /// How many creations were acknowledged when all three nodes first took data.
    whole_from: Option<usize>,
    /// The client core's mount: creations of a new name that failed, with the errno (EIO
    /// only when its retries ran out through failovers; `EEXIST` would mean a change made
    /// twice or a retry not recognised).
    client_failed: Vec<(String, i32)>,
    /// Whether the scenario ran the client core's mount (all but the re-elected primary's,
    /// whose mounts keep quiet while its nodes are stopped).
    client_ran: bool,
    /// The node acting as primary at the end, where `lost` was looked for.
    last_primary: Option<u32>,
    /// The split brain: the file created before the faults, the nodes that took over from
    /// the stopped primary and from the killed one, and the file looked up at the end.
    created: Option<u64>,
    first_successor: Option<u32>,
    second_successor: Option<u32>,
    found: Option<Result<u64, String>>,
    /// Random faults: how many, and why the cluster did not heal between two if it did not.
    faults: usize,
    unhealed: Option<String>,
    /// Creations answered while a node was stopped (where a scenario counts them).
    served_meanwhile: Option<usize>,
    log: Vec<String>,
}

/// One seed's world: three nodes (1 the first primary), the coordinator, a checker that
/// never two nodes act as primary, and what the test's threads saw.
struct Cluster {
    world: Turnstile,
    net: Arc<Net>,
    coord: Arc<Local>,
    nodes: Nodes,
    /// Times each node was started again.
    restarts: Mutex<HashMap<u32, u32>>,
    seen: Arc<Mutex<Seen>>,
    dir: Scratch,
}

impl Cluster {
    fn new(seed: u64, name: &str) -> Arc<Cluster> {
        // RUST_LOG=info shows what the nodes log, each line naming its thread's group.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_thread_names(true)
            .with_test_writer()
            .try_init();
        let world = Turnstile::new(seed);
        world.set_watchdog(Duration::from_secs(30));
        let net = Arc::new(Net {
            lo: Loopback::new(),
            world: world.clone(),
            at: Mutex::new(HashMap::new()),
            cut: Mutex::default(),
        });
        let clock: SharedClock = Arc::new(world.clone());
        let coord = Arc::new(Local::with_clock(NODE_LEASE / 4, clock));
        serve_coordinator(&net, coord.clone());
        let c = Arc::new(Cluster {
            world,
            net,
            coord,
            nodes: Arc::default(),
            restarts: Mutex::default(),
            seen: Arc::default(),
            dir: Scratch::new(&format!("world-{name}-{seed}")),
        });
        c.start_node(1, 1, Role::Primary);
        for id in [2, 3] {
            c.start_node(id, id, Role::Join(vec![addr(&c.dir.0, 1)]));
        }
        let c2 = c.clone();
        c.world.spawn(DRIVER, "checker", move || loop {
            let a = c2.acting();
            let whole = c2.seen.lock().unwrap().whole_from.is_some();
            if let ([p], false) = (&a[..], whole) {
                let primary = c2.nodes.lock().unwrap().get(p).map(|(_, n)| n.clone());
                if primary.is_some_and(|n| Storage::data_nodes(&*n).len() == 3) {
                    let mut seen = c2.seen.lock().unwrap();
                    seen.whole_from = Some(seen.acked.len());
                }
            }
            if a.len() > 1 {
                c2.seen
                    .lock()
                    .unwrap()
                    .two_primaries
                    .push((c2.world.now(), a));
            }
            c2.world.sleep(Duration::from_millis(10));
        });
        c
    }

    /// Starts node `id` as process `group`, which holds it until killed. A node that cannot
    /// start (a restart refused while its old lease holds) or that exits is started again a
    /// lease and a half second later, as `rackfs up` does.
    fn start_node(self: &Arc<Self>, id: u32, group: u32, role: Role) {
        let (c, cfg) = (self.clone(), config(&self.dir.0, id, group, role));
        self.world.spawn(group, &format!("mn{id}-main"), move || {
            // A node that ends itself (deposed, it learnt of another primary) is started
            // again by its supervisor.
            let weak = Arc::downgrade(&c);
            let exit: Arc<Exit> = Arc::new(move |code| {
                if let Some(c) = weak.upgrade() {
                    c.note(format!(
                        "mn{id} (process {group}) exited with status {code}"
                    ));
                    c.restart_later(id);
                    c.net.kill(group);
                }
            });
            match MemNode::start_in(cfg, env(&c.net, group, exit)) {
                Ok(node) => {
                    c.nodes
                        .lock()
                        .unwrap()
                        .insert(id, (group, node.node().clone()));
                    loop {
                        c.world.sleep(Duration::from_secs(3600));
                    }
                }
                Err(e) => {
                    c.note(format!("mn{id} (process {group}) could not start: {e}"));
                    c.restart_later(id);
                    c.net.kill(group);
                }
            }
        });
    }

    /// Starts node `id` again a lease and a half second from now, as `rackfs up` does.
    fn restart_later(self: &Arc<Self>, id: u32) {
        let c = self.clone();
        self.world.spawn(DRIVER, "supervisor", move || {
            c.world.sleep(NODE_LEASE + Duration::from_millis(500));
            c.restart(id);
        });
    }

    /// Starts node `id` again, empty, as a new process that finds the primary through the
    /// coordinator.
    fn restart(self: &Arc<Self>, id: u32) {
        let k = {
            let mut r = self.restarts.lock().unwrap();
            let k = r.entry(id).or_default();
            *k += 1;
            *k
        };
        let group = id + 10 * k;
        self.note(format!("starting mn{id} again, empty, as process {group}"));
        self.start_node(id, group, Role::Join(Vec::new()));
    }

    fn note(&self, what: String) {
        let line = format!("{:?} {what}", self.world.now());
        self.seen.lock().unwrap().log.push(line);
    }

    /// Waits (on virtual time, looking every 100 ms) up to `within` for `healed`; if it does
    /// not come, notes `why()` as the run's `unhealed` and returns false.
    fn heals(
        &self,
        within: Duration,
        healed: impl Fn() -> bool,
        why: impl FnOnce() -> String,
    ) -> bool {
        let by = self.world.now() + within;
        while !healed() {
            if self.world.now() >= by {
                self.seen.lock().unwrap().unhealed = Some(why());
                return false;
            }
            self.world.sleep(Duration::from_millis(100));
        }
        true
    }

    /// The nodes acting as primary now: a metadata service and a valid serve lease.
    fn acting(&self) -> Vec<u32> {
        let mut v: Vec<u32> = (self.nodes.lock().unwrap().iter())
            .filter(|(_, (g, n))| !self.world.killed(*g) && n.meta.get().is_some() && n.serving())
            .map(|(id, _)| *id)
            .collect();
        v.sort_unstable();
        v
    }

    /// The process node `id` runs as now.
    fn group_of(&self, id: u32) -> u32 {
        self.nodes.lock().unwrap().get(&id).map_or(id, |(g, _)| *g)
    }

    /// A connection to the primary the coordinator names (as a mount finds it).
    fn connect_primary(&self, dial: &WorldDial, who: &str) -> Option<Arc<dyn ControlLink>> {
        let v = self.coord.get(PRIMARY_KEY).ok().flatten()?;
        let (_, tcp, _) = parse_primary(&v)?;
        dial.connect(&tcp, &secret(), who).ok()
    }

    /// A mount creating a file every 50 ms until `until`, at the primary the coordinator
    /// names (found again after a failure), idle during `quiet`; a creation whose answer does
    /// not come is not counted.
    fn spawn_mount(self: &Arc<Self>, until: Duration, quiet: std::ops::Range<Duration>) {
        let c = self.clone();
        self.world.spawn(DRIVER, "mount", move || {
            let dial = WorldDial(c.net.clone());
            let mut link: Option<Arc<dyn ControlLink>> = None;
            for i in 0.. {
                if c.world.now() >= until {
                    break;
                }
                c.world.sleep(Duration::from_millis(50));
                if quiet.contains(&c.world.now()) {
                    continue;
                }
                let Some(l) = link.clone().or_else(|| c.connect_primary(&dial, "mount")) else {
                    continue;
                };
                link = Some(l.clone());
                let name = format!("f{i}");
                match create(&*l, &name) {
                    Ok(ino) => c.seen.lock().unwrap().acked.push((name, ino)),
                    Err(RpcError::Refused { .. }) => {}
                    Err(_) => link = None,
                }
            }
        });
    }

    /// A mount running the production client core (`rackfs_fs::client`), over the world's
    /// network and clock, that creates and closes a new file every 150 ms until `until`: it
    /// finds the primary, follows take-overs and carries its requests through them as a real
    /// mount does. Its acknowledged creations join the raw mount's in [`Seen::acked`].
    fn spawn_client(self: &Arc<Self>, until: Duration) {
        self.seen.lock().unwrap().client_ran = true;
        let c = self.clone();
        self.world.spawn(CLIENT, "client-main", move || {
            let env = rackfs_fs::env::Env {
                clock: Arc::new(c.world.clone()),
                dial: Arc::new(WorldDial(c.net.clone())),
                spawn: Arc::new(c.world.threads(CLIENT)),
            };
            // Mounted once the first primary serves (as `rackfs up` mounts).
            let cluster = loop {
                let connected = rackfs_fs::cluster::Cluster::connect(
                    env.clone(),
                    &[addr(&c.dir.0, 1)],
                    secret(),
                    rackfs_fs::options::TransportChoice::Tcp,
                    None,
                    "mount:/world",
                );
                match connected {
                    Ok(cluster) => break cluster,
                    Err(e) if c.world.now() > Duration::from_secs(5) => {
                        c.note(format!("the client core could not connect: {e}"));
                        return;
                    }
                    Err(_) => c.world.sleep(Duration::from_millis(100)),
                }
            };
            let client = rackfs_fs::client::Client::new(Arc::new(cluster), Default::default());
            let me = rackfs_fs::client::Caller { uid: 0, gid: 0 };
            let excl = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL;
            for i in 0.. {
                c.world.sleep(Duration::from_millis(150));
                if c.world.now() >= until {
                    break;
                }
                let name = format!("c{i}");
                let os = std::ffi::OsStr::new(&name);
                match client.create(ROOT_INO, os, 0o644, 0, excl, me) {
                    Ok((attr, opened)) => {
                        c.seen.lock().unwrap().acked.push((name, attr.ino));
                        if let Err(e) = client.release(attr.ino, opened.fh) {
                            c.note(format!("the client core's close of c{i}: {e:?}"));
                        }
                    }
                    Err(e) => c.seen.lock().unwrap().client_failed.push((name, e.code())),
                }
            }
        });
    }

    /// Looks up every acknowledged creation on node `id` (acting as primary).
    fn check_acked(&self, id: u32) {
        let dial = WorldDial(self.net.clone());
        self.seen.lock().unwrap().last_primary = Some(id);
        let (acked, whole_from) = {
            let seen = self.seen.lock().unwrap();
            (seen.acked.clone(), seen.whole_from.unwrap_or(usize::MAX))
        };
        let at = addr_of(&self.dir.0, self.group_of(id));
        let Ok(m) = dial.connect(&at, &secret(), "checker") else {
            return;
        };
        let node = self.nodes.lock().unwrap().get(&id).map(|(_, n)| n.clone());
        for (i, (name, ino)) in acked.into_iter().enumerate() {
            match lookup(&*m, &name) {
                Ok(i) if i == ino => {}
                other => {
                    (self.seen.lock().unwrap().lost).push((name, ino, format!("{other:?}")));
                    continue;
                }
            }
            // The replicas the file's record says it has (what mounts read one-sidedly).
            let replicas = node.as_ref().and_then(|n| {
                let record = n.meta.get()?.lock().unwrap().namespace.record(ino).ok()?;
                Some(rackfs_meta::file::read_word(
                    n.data_region(),
                    record + REC_REPLICAS,
                ))
            });
            if let (Some(r @ 0..2), true) = (replicas, i >= whole_from) {
                self.seen.lock().unwrap().short.push((name, ino, r));
            }
        }
    }

    /// Runs the world to `until`, then kills everything.
    fn finish(&self, until: Duration) -> (Outcome, Seen) {
        let outcome = self.world.run(until);
        let groups: Vec<u32> = self
            .nodes
            .lock()
            .unwrap()
            .values()
            .map(|(g, _)| *g)
            .collect();
        for g in groups {
            self.net.kill(g);
        }
        self.world.kill(DRIVER);
        self.world.kill(CLIENT);
        let _ = self.world.run(until + Duration::from_secs(1));
        (outcome, std::mem::take(&mut *self.seen.lock().unwrap()))
    }
}

/// Where the node running as process `group` is reached (its socket).
fn addr_of(dir: &Path, group: u32) -> String {
    format!("unix:{}", socket(dir, group).display())
}

/// Issue 24's split brain (see the module docs) on `seed`.
fn split_brain(seed: u64) -> (Outcome, Seen) {
    let c = Cluster::new(seed, "split");
    c.spawn_mount(Duration::from_secs(38), Duration::ZERO..Duration::ZERO);
    c.spawn_client(Duration::from_secs(38));
    let c2 = c.clone();
    c.world.spawn(DRIVER, "faults", move || {
        let (w, dial) = (&c2.world, WorldDial(c2.net.clone()));
        w.sleep(Duration::from_secs(5));
        let mount = dial
            .connect(&addr(&c2.dir.0, 1), &secret(), "mount")
            .expect("the primary serves");
        let ino = create(&*mount, "kept").expect("the primary creates a file");
        c2.seen.lock().unwrap().created = Some(ino);
        c2.note(format!("created ino {ino}; pausing mn1 for 6 s"));
        w.pause(1, Duration::from_secs(6));
        // The standby takes over while mn1 is stopped; mn1 resumes at 11 s.
        w.sleep(Duration::from_secs(14));
        let first = c2.acting();
        c2.note(format!("acting after the pause: {first:?}"));
        let Some(&next) = first.iter().find(|&&id| id != 1) else {
            return;
        };
        c2.seen.lock().unwrap().first_successor = Some(next);
        c2.note(format!("killing mn{next}"));
        c2.net.kill(c2.group_of(next));
        w.sleep(Duration::from_secs(20));
        let second = c2.acting();
        c2.note(format!("acting after the kill: {second:?}"));
        let Some(&last) = second.iter().find(|&&id| id != 1 && id != next) else {
            return;
        };
        c2.seen.lock().unwrap().second_successor = Some(last);
        let found = dial
            .connect(&addr_of(&c2.dir.0, c2.group_of(last)), &secret(), "mount")
            .and_then(|m| lookup(&*m, "kept"))
            .map_err(|e| e.to_string());
        c2.seen.lock().unwrap().found = Some(found);
        c2.check_acked(last);
    });
    c.finish(Duration::from_secs(45))
}

/// splitmix64: the faults' own choices, drawn from the seed.
fn next(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A time in `[lo, hi)` ms drawn from `x`.
fn between(x: &mut u64, lo: u64, hi: u64) -> Duration {
    Duration::from_millis(lo + next(x) % (hi - lo))
}

/// Whether the cluster can lose a node now: one node acts as primary and another follows
/// it as its metadata standby, both running (neither killed nor stopped).
fn healthy(c: &Cluster) -> bool {
    let acting = c.acting();
    let [p] = acting[..] else { return false };
    let nodes = c.nodes.lock().unwrap();
    let running = |id: u32| {
        nodes
            .get(&id)
            .is_some_and(|(g, _)| !c.world.killed(*g) && c.world.paused_until(*g) <= c.world.now())
    };
    let follower = nodes.get(&p).and_then(|(_, n)| n.standby.follower());
    running(p) && follower.is_some_and(running)
}

/// Random faults on `seed`: until 40 s, once the cluster is healthy again, a random node is
/// stopped past its lease (2.5-6 s) or killed and started again, empty, 0.5-3 s later (and
/// again while its old lease refuses it, as `rackfs up` restarts it); the mount creates throughout. At the end every acknowledged
/// creation is on the node acting as primary.
fn random_faults(seed: u64, partitions: bool) -> (Outcome, Seen) {
    // Its own scratch directory (sockets) per scenario: the two run at once in one process.
    let c = Cluster::new(seed, if partitions { "partitions" } else { "random" });
    c.spawn_mount(Duration::from_secs(50), Duration::ZERO..Duration::ZERO);
    c.spawn_client(Duration::from_secs(50));
    // Faults start until 40 s; by 52 s the last one healed and the mount's last creation
    // was answered or timed out.
    let c2 = c.clone();
    c.world.spawn(DRIVER, "faults", move || {
        let w = &c2.world;
        let mut x = seed ^ 0x5eed;
        w.sleep(Duration::from_secs(5));
        while w.now() < Duration::from_secs(40) {
            let why = || {
                let key = |k: &str| {
                    let v = c2.coord.get(k).ok().flatten().unwrap_or_default();
                    String::from_utf8_lossy(&v).into_owned()
                };
                format!(
                    "no primary with a live standby for 20 s: acting {:?}, coordinator's \
                     primary key {:?}, standby key {:?}",
                    c2.acting(),
                    key(PRIMARY_KEY),
                    key("standby")
                )
            };
            if !c2.heals(Duration::from_secs(20), || healthy(&c2), why) {
                return;
            }
            w.sleep(between(&mut x, 1000, 4000));
            if !healthy(&c2) {
                // The last fault's aftermath went on meanwhile (a standby dropped late): one
                // fault at a time, so the cluster heals first.
                continue;
            }
            let alive: Vec<u32> = (1..=3).filter(|&id| !w.killed(c2.group_of(id))).collect();
            if w.now() >= Duration::from_secs(40) || alive.is_empty() {
                break;
            }
            let id = alive[(next(&mut x) % alive.len() as u64) as usize];
            let group = c2.group_of(id);
            c2.seen.lock().unwrap().faults += 1;
            let kind = next(&mut x) % if partitions { 3 } else { 2 };
            if kind == 2 {
                // Cut it off from another node or from the coordinator for a while.
                let others: Vec<u32> = (alive.iter().copied().filter(|&o| o != id))
                    .chain([COORD])
                    .collect();
                let other = others[(next(&mut x) % others.len() as u64) as usize];
                let d = between(&mut x, 2500, 6000);
                let name = |p: u32| match p {
                    COORD => "the coordinator".to_string(),
                    n => format!("mn{n}"),
                };
                c2.note(format!(
                    "cutting {} off from {} for {d:?}",
                    name(id),
                    name(other)
                ));
                c2.net.partition(id, other, true);
                w.sleep(d);
                c2.net.partition(id, other, false);
                c2.note(format!(
                    "{} and {} reach each other again",
                    name(id),
                    name(other)
                ));
            } else if kind == 0 {
                let d = between(&mut x, 2500, 6000);
                c2.note(format!("pausing mn{id} (process {group}) for {d:?}"));
                w.pause(group, d);
            } else {
                c2.note(format!("killing mn{id} (process {group})"));
                c2.net.kill(group);
                w.sleep(between(&mut x, 500, 3000));
                c2.restart(id);
            }
        }
        w.sleep(Duration::from_secs(52).saturating_sub(w.now()));
        let acting = c2.acting();
        c2.note(format!("acting at the end: {acting:?}"));
        if let [p] = acting[..] {
            c2.check_acked(p);
        }
    });
    c.finish(Duration::from_secs(56))
}

/// A data node stopped past its lease while the primary changes, on `seed`: the third node
/// (neither primary nor standby) is stopped for 3 s, and 1 s into that the primary for 6 s;
/// the standby takes over, the third node resumes with its lease lapsed and must follow the
/// new primary (and be admitted by it) rather than ask the old one to admit it.
fn lapsed_while_the_primary_changes(seed: u64) -> (Outcome, Seen) {
    let c = Cluster::new(seed, "lapsed");
    c.spawn_mount(Duration::from_secs(30), Duration::ZERO..Duration::ZERO);
    c.spawn_client(Duration::from_secs(30));
    let c2 = c.clone();
    c.world.spawn(DRIVER, "faults", move || {
        let w = &c2.world;
        w.sleep(Duration::from_secs(5));
        let standby = {
            let nodes = c2.nodes.lock().unwrap();
            nodes.get(&1).and_then(|(_, n)| n.standby.follower())
        };
        let Some(third) = standby.and_then(|s| (2..=3).find(|&id| id != s)) else {
            c2.note("mn1 has no standby at 5 s".into());
            return;
        };
        c2.note(format!("pausing mn{third} for 3 s, then mn1 for 6 s"));
        w.pause(third, Duration::from_secs(3));
        w.sleep(Duration::from_secs(1));
        w.pause(1, Duration::from_secs(6));
        // Healthy, and the third node takes data from the new primary again.
        let rejoined = || {
            let acting = c2.acting();
            let [p] = acting[..] else { return false };
            let primary = c2.nodes.lock().unwrap().get(&p).map(|(_, n)| n.clone());
            let takes = primary.is_some_and(|n| Storage::data_nodes(&*n).contains(&third));
            takes && healthy(&c2)
        };
        let why = || {
            format!(
                "20 s after the pauses mn{third} takes no data from a primary with a running \
                 standby: acting {:?}",
                c2.acting()
            )
        };
        if !c2.heals(Duration::from_secs(20), rejoined, why) {
            return;
        }
        c2.note(format!(
            "healthy again, mn{third} taking data, acting {:?}",
            c2.acting()
        ));
        w.sleep(Duration::from_secs(34).saturating_sub(w.now()));
        if let [p] = c2.acting()[..] {
            c2.check_acked(p);
        }
    });
    c.finish(Duration::from_secs(36))
}

/// A primary re-elected while its standby is stopped, on `seed`: the standby is stopped for
/// 10 s and the primary, at the same moment, for 3 s (past its lease, with nobody able to take
/// over meanwhile); the primary wins its key back and cannot declare its new epoch to the
/// stopped standby. It must drop it (the `standby` key too) and make the third node its
/// standby, so that when it is killed at 14 s, just before the stale standby resumes, the
/// node that takes over has every creation the primary acknowledged.
fn reelected_with_its_standby_stopped(seed: u64) -> (Outcome, Seen) {
    let c = Cluster::new(seed, "reelected");
    // Quiet while both are stopped, so that no change is in flight to fail and drop the
    // standby before the re-elected primary declares its epoch to it.
    c.spawn_mount(
        Duration::from_secs(32),
        Duration::from_millis(4500)..Duration::from_secs(10),
    );
    let c2 = c.clone();
    c.world.spawn(DRIVER, "faults", move || {
        let w = &c2.world;
        w.sleep(Duration::from_secs(5));
        let standby = {
            let nodes = c2.nodes.lock().unwrap();
            nodes.get(&1).and_then(|(_, n)| n.standby.follower())
        };
        let Some(standby) = standby else {
            c2.note("mn1 has no standby at 5 s".into());
            return;
        };
        c2.note(format!("pausing mn{standby} for 10 s and mn1 for 3 s"));
        w.pause(c2.group_of(standby), Duration::from_secs(10));
        w.pause(c2.group_of(1), Duration::from_secs(3));
        w.sleep(Duration::from_secs(5));
        let before = c2.seen.lock().unwrap().acked.len();
        w.sleep(Duration::from_secs(4));
        let served = c2.seen.lock().unwrap().acked.len() - before;
        c2.seen.lock().unwrap().served_meanwhile = Some(served);
        let named = c2.coord.get("standby").ok().flatten();
        let named = named.as_deref().and_then(parse_standby);
        if named == Some(standby) {
            c2.seen.lock().unwrap().unhealed = Some(format!(
                "at 14 s the standby key still names mn{standby}, stopped since 5 s"
            ));
        }
        let acting = c2.acting();
        c2.note(format!(
            "{served} creations answered from 10 s to 14 s; acting at 14 s: {acting:?}; killing mn1"
        ));
        c2.net.kill(c2.group_of(1));
        let taken = || matches!(c2.acting()[..], [p] if p != 1);
        let why = || {
            format!(
                "nobody took over from mn1 within 12 s: acting {:?}",
                c2.acting()
            )
        };
        if !c2.heals(Duration::from_secs(12), taken, why) {
            return;
        }
        w.sleep(Duration::from_secs(34).saturating_sub(w.now()));
        if let [p] = c2.acting()[..] {
            c2.check_acked(p);
        }
    });
    c.finish(Duration::from_secs(36))
}

/// The command that replays `seed` of `test`.
fn replay(seed: u64, test: &str) -> String {
    format!("replay: RACKFS_WORLD_SEED={seed} cargo test -p rackfs-memnode --test world {test}")
}

/// What every run must show, whatever its faults.
fn check_common(seed: u64, test: &str, outcome: &Outcome, seen: &Seen) {
    let replay = replay(seed, test);
    assert_eq!(
        *outcome,
        Outcome::TimeLimit,
        "seed {seed}: {seen:#?}\n{replay}"
    );
    assert!(
        seen.two_primaries.is_empty(),
        "seed {seed}: two primaries acted at once: {seen:#?}\n{replay}"
    );
    assert!(
        seen.last_primary.is_some() && seen.lost.is_empty() && seen.acked.len() > 100,
        "seed {seed}: every acknowledged creation is on the last primary: {seen:#?}\n{replay}"
    );
    // One fault at a time, each healed before the next: a take-over comes well within the
    // client core's patience for one (`FAILOVER_WAIT`), so none of its creations fails.
    let by_client = seen
        .acked
        .iter()
        .filter(|(n, _)| n.starts_with('c'))
        .count();
    assert!(
        !seen.client_ran || (by_client > 100 && seen.client_failed.is_empty()),
        "seed {seed}: the client core's mount creates through the faults: {seen:#?}\n{replay}"
    );
    assert!(
        seen.short.is_empty(),
        "seed {seed}: files created while the cluster had 3 nodes keep the 2 replicas they \
         asked for: {seen:#?}\n{replay}"
    );
}

#[test]
fn a_primary_stopped_past_its_lease_stays_silent_and_a_third_node_takes_over_whole() {
    for seed in seeds("RACKFS_WORLD", 2) {
        let (outcome, seen) = split_brain(seed);
        let test = "a_primary_stopped";
        let replay = replay(seed, test);
        assert!(seen.created.is_some(), "seed {seed}: {seen:#?}\n{replay}");
        assert!(
            seen.first_successor.is_some(),
            "seed {seed}: nobody took over from the stopped primary: {seen:#?}\n{replay}"
        );
        assert!(
            seen.second_successor.is_some(),
            "seed {seed}: nobody took over from the killed one: {seen:#?}\n{replay}"
        );
        assert_eq!(
            seen.found,
            Some(Ok(seen.created.unwrap())),
            "seed {seed}: the file is on the last primary: {seen:#?}\n{replay}"
        );
        check_common(seed, test, &outcome, &seen);
    }
}

/// Random faults (with partitions too, if `partitions`) on each of `seeds`: the cluster heals
/// between faults and passes the common checks; failures name `test` to replay a seed with.
fn random_faults_hold(seeds: impl IntoIterator<Item = u64>, partitions: bool, test: &str) {
    for seed in seeds {
        let (outcome, seen) = random_faults(seed, partitions);
        assert!(
            seen.unhealed.is_none() && seen.faults >= 3,
            "seed {seed}: the cluster heals between faults: {seen:#?}\n{}",
            replay(seed, test)
        );
        check_common(seed, test, &outcome, &seen);
    }
}

#[test]
fn random_pauses_kills_and_restarts_lose_no_acknowledged_creation() {
    random_faults_hold(seeds("RACKFS_WORLD", 8), false, "random_pauses");
}

/// The random faults of the seeds that found a primary elected again after its successor's
/// lease lapsed, serving without the changes the successor had answered (`scripts/simulate
/// 1000` before the `last_primary` record; each failed then). Any code change may move what a
/// seed does: this keeps them as five more random runs, whatever they now exercise.
#[test]
fn seeds_that_found_a_stale_primary_elected_again_lose_nothing() {
    random_faults_hold([376, 430, 486, 680, 905], false, "random_pauses");
}

/// The same faults, and partitions between a node and another or the coordinator (each
/// message across the cut lost, both ways) for 2.5-6 s.
#[test]
fn random_partitions_pauses_and_kills_lose_no_acknowledged_creation() {
    random_faults_hold(seeds("RACKFS_WORLD", 8), true, "random_partitions");
}

#[test]
fn a_data_node_stopped_past_its_lease_while_the_primary_changes_follows_the_new_one() {
    for seed in seeds("RACKFS_WORLD", 2) {
        let (outcome, seen) = lapsed_while_the_primary_changes(seed);
        let test = "a_data_node_stopped";
        assert!(
            seen.unhealed.is_none() && seen.log.len() >= 2,
            "seed {seed}: the cluster heals: {seen:#?}\n{}",
            replay(seed, test)
        );
        check_common(seed, test, &outcome, &seen);
    }
}

#[test]
fn a_primary_reelected_while_its_standby_is_stopped_drops_it_and_loses_nothing() {
    for seed in seeds("RACKFS_WORLD", 2) {
        let (outcome, seen) = reelected_with_its_standby_stopped(seed);
        let test = "a_primary_reelected";
        assert!(
            seen.unhealed.is_none() && seen.log.len() >= 2,
            "seed {seed}: another node takes over: {seen:#?}\n{}",
            replay(seed, test)
        );
        // One every 50 ms is 80: the metadata service does not wait for the stopped standby.
        assert!(
            seen.served_meanwhile >= Some(60),
            "seed {seed}: the primary serves while its old standby is stopped: {seen:#?}\n{}",
            replay(seed, test)
        );
        check_common(seed, test, &outcome, &seen);
    }
}
