//! A whole cluster of production memory nodes in one process, under the [`Turnstile`]: each
//! node is a simulated process whose threads (its duties, roles, take-over, group commit and
//! the requests it serves) run one at a time in an order the seed decides, on virtual time.
//! The coordinator is the embedded one (`rackfs_coord::Local`), served apart from the nodes
//! as `rackfs up` serves it. Control connections are a [`Loopback`] whose requests are
//! served on a thread of the process they are sent to: a stopped process answers nothing
//! until it resumes (its callers time out at their deadline, as over a socket, and what
//! they sent is still served when it resumes), and a killed one fails its callers.
//!
//! The scenario is issue 24's split brain: the primary is stopped past its lease, its standby
//! takes over and makes the third node its standby, the old primary resumes, then the new
//! primary is killed: the third node must take over with the namespace whole. Throughout, a
//! checker samples every node: never two acting primaries (a metadata service and a valid
//! serve lease) at once.
//!
//! `RACKFS_WORLD_SEEDS=N` runs N seeds (default 2: each is 45 s of the world's time and
//! about 20 s of real time here); `RACKFS_WORLD_SEED=S` one.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{addr, secret, Scratch};
use rackfs_clock::turnstile::{seeds, Outcome};
use rackfs_clock::{Bell, Clock, SharedClock, Turnstile};
use rackfs_coord::{Coordinator, Local};
use rackfs_memnode::config::Coordination;
use rackfs_memnode::control::serve_on;
use rackfs_memnode::coordinator::parse_primary;
use rackfs_memnode::node::Node;
use rackfs_memnode::term::PRIMARY_KEY;
use rackfs_memnode::{MemNode, NodeConfig, NodeEnv, Role};
use rackfs_proto::control::{ControlRequest, ControlResponse, ErrorCode};
use rackfs_proto::link::{ControlLink, Dial, Loopback};
use rackfs_proto::namespace::{MetaRequest, NewKind, ROOT_INO};
use rackfs_proto::{Refusal, RpcError};
use rackfs_verbs::{Secret, VerbsError};

/// The world group of the coordinator (never paused or killed), of the test's own threads,
/// and of node `id` (`id` itself).
const COORD: u32 = 100;
const DRIVER: u32 = 101;
const NODES: [u32; 3] = [1, 2, 3];
const NODE_LEASE: Duration = Duration::from_secs(2);
/// How long a control call waits for a paused node before it times out.
const CALL_DEADLINE: Duration = Duration::from_secs(2);

/// The control network of one world (see the module docs).
struct Net {
    lo: Loopback,
    world: Turnstile,
    /// Address -> the group serving it.
    at: Mutex<HashMap<String, u32>>,
}

impl Net {
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
        Turnstile::yield_now();
        if world.killed(self.group) {
            return Err(lost());
        }
        let answer: Answer = Arc::default();
        let (inner, req2, left) = (self.inner.clone(), req.clone(), answer.clone());
        world.spawn(self.group, &format!("{}/serve", self.group), move || {
            let r = inner.call(&req2);
            *left.0.lock().unwrap() = Some(r);
            left.1.notify_all();
        });
        let deadline = *self.deadline.lock().unwrap();
        let until = world.now() + deadline;
        let mut got = answer.0.lock().unwrap();
        loop {
            if let Some(r) = got.take() {
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

/// Node `id` of the world: a tcp listener (bound, never connected to: the primary's key
/// names a tcp address), the coordinator served apart, a standby.
fn config(dir: &Path, id: u32, role: Role) -> NodeConfig {
    NodeConfig {
        listen: Some("127.0.0.1:0".into()),
        region_len: 16 << 20,
        lock_lease: 2 * NODE_LEASE,
        node_lease: NODE_LEASE,
        coordinator: Coordination::Served("unix:coordinator".into()),
        cluster: "world".into(),
        standby: true,
        ..common::config(dir, id, role)
    }
}

/// Node `id`'s surroundings: the world's clock and threads (its group), the world's network,
/// on which it is served at its address once it serves.
fn env(net: &Arc<Net>, id: u32) -> NodeEnv {
    let served = net.clone();
    NodeEnv {
        clock: Arc::new(net.world.clone()),
        dial: Arc::new(WorldDial(net.clone())),
        spawn: Arc::new(net.world.threads(id)),
        exit: {
            let net = net.clone();
            Arc::new(move |_code| net.kill(id))
        },
        serving: Some(Box::new(move |node: &Arc<Node>| {
            // Where its peers reach it: the primary's key names its tcp address, a joining
            // node's is its socket's.
            let me = node.members.me();
            let socket = me.shm.map(|p| format!("unix:{p}"));
            for at in me.tcp.into_iter().chain(socket) {
                served.at.lock().unwrap().insert(at.clone(), id);
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

/// The nodes of a world, as their processes left them.
type Nodes = Arc<Mutex<HashMap<u32, Arc<Node>>>>;

/// Starts node `id` as process `id` of the world; the process holds it until killed.
fn start_node(net: &Arc<Net>, nodes: &Nodes, dir: &Path, id: u32, role: Role) {
    let (net2, nodes, cfg) = (net.clone(), nodes.clone(), config(dir, id, role));
    let clock = net.world.clone();
    net.world.spawn(id, &format!("mn{id}-main"), move || {
        let node = MemNode::start_in(cfg, env(&net2, id)).expect("the node starts");
        nodes.lock().unwrap().insert(id, node.node().clone());
        loop {
            clock.sleep(Duration::from_secs(3600));
        }
    });
}

/// The nodes acting as primary now: a metadata service and a valid serve lease.
fn acting(nodes: &Nodes, world: &Turnstile) -> Vec<u32> {
    let mut v: Vec<u32> = nodes
        .lock()
        .unwrap()
        .iter()
        .filter(|(id, n)| !world.killed(**id) && n.meta.get().is_some() && n.serving())
        .map(|(id, _)| *id)
        .collect();
    v.sort_unstable();
    v
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

/// What one seed's run saw.
#[derive(Debug, Default)]
struct Seen {
    /// Times (virtual) at which two nodes acted as primary, and which.
    two_primaries: Vec<(Duration, Vec<u32>)>,
    /// The file's inode, as created before the faults.
    created: Option<u64>,
    /// The node that took over from the paused primary, and the one after it.
    first_successor: Option<u32>,
    second_successor: Option<u32>,
    /// The file looked up on the last primary.
    found: Option<Result<u64, String>>,
    /// Files whose creation a primary acknowledged to the mount, and their inodes.
    acked: Vec<(String, u64)>,
    /// Acknowledged files the last primary does not have (or answers otherwise).
    lost: Vec<(String, u64, String)>,
    log: Vec<String>,
}

/// Runs the scenario of the module docs on `seed`.
fn run(seed: u64) -> (Outcome, Seen) {
    // RUST_LOG=info shows what the nodes log, each line naming its thread's group (node).
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_thread_names(true)
        .with_test_writer()
        .try_init();
    let dir = Scratch::new(&format!("world-{seed}"));
    let world = Turnstile::new(seed);
    world.set_watchdog(Duration::from_secs(30));
    let net = Arc::new(Net {
        lo: Loopback::new(),
        world: world.clone(),
        at: Mutex::new(HashMap::new()),
    });
    let clock: SharedClock = Arc::new(world.clone());
    let coord = Arc::new(Local::with_clock(NODE_LEASE / 4, clock));
    serve_coordinator(&net, coord.clone());
    let nodes: Nodes = Arc::default();
    start_node(&net, &nodes, &dir.0, 1, Role::Primary);
    for id in [2, 3] {
        start_node(&net, &nodes, &dir.0, id, Role::Join(vec![addr(&dir.0, 1)]));
    }
    let seen = Arc::new(Mutex::new(Seen::default()));

    // The checker: never two acting primaries.
    {
        let (nodes, seen, w) = (nodes.clone(), seen.clone(), world.clone());
        world.spawn(DRIVER, "checker", move || loop {
            let a = acting(&nodes, &w);
            if a.len() > 1 {
                seen.lock().unwrap().two_primaries.push((w.now(), a));
            }
            w.sleep(Duration::from_millis(10));
        });
    }

    // The faults, and what a mount would see.
    {
        let (nodes, seen, w, net, d) = (
            nodes.clone(),
            seen.clone(),
            world.clone(),
            net.clone(),
            dir.0.clone(),
        );
        world.spawn(DRIVER, "faults", move || {
            let note = |s: String| seen.lock().unwrap().log.push(format!("{:?} {s}", w.now()));
            let dial = WorldDial(net.clone());
            w.sleep(Duration::from_secs(5));
            let mount = dial
                .connect(&addr(&d, 1), &secret(), "mount")
                .expect("the primary serves");
            let ino = create(&*mount, "kept").expect("the primary creates a file");
            seen.lock().unwrap().created = Some(ino);
            note(format!("created ino {ino}; pausing mn1 for 6 s"));
            w.pause(1, Duration::from_secs(6));
            // The standby takes over while mn1 is stopped; mn1 resumes at 11 s.
            w.sleep(Duration::from_secs(14));
            let first = acting(&nodes, &w);
            note(format!("acting after the pause: {first:?}"));
            let Some(&next) = first.iter().find(|&&id| id != 1) else {
                return;
            };
            seen.lock().unwrap().first_successor = Some(next);
            note(format!("killing mn{next}"));
            net.kill(next);
            w.sleep(Duration::from_secs(20));
            let second = acting(&nodes, &w);
            note(format!("acting after the kill: {second:?}"));
            let Some(&last) = second.iter().find(|&&id| id != 1 && id != next) else {
                return;
            };
            seen.lock().unwrap().second_successor = Some(last);
            let found = dial
                .connect(&addr(&d, last), &secret(), "mount")
                .and_then(|m| lookup(&*m, "kept"))
                .map_err(|e| e.to_string());
            seen.lock().unwrap().found = Some(found);
            let acked = seen.lock().unwrap().acked.clone();
            let Ok(m) = dial.connect(&addr(&d, last), &secret(), "checker") else {
                return;
            };
            for (name, ino) in acked {
                match lookup(&*m, &name) {
                    Ok(i) if i == ino => {}
                    other => seen
                        .lock()
                        .unwrap()
                        .lost
                        .push((name, ino, format!("{other:?}"))),
                }
            }
        });
    }

    // A mount creating a file every 50 ms until 38 s, at the primary the coordinator names
    // (found again after a failure); a creation whose answer does not come is not counted.
    {
        let (seen, w, net, coord) = (seen.clone(), world.clone(), net.clone(), coord.clone());
        world.spawn(DRIVER, "mount", move || {
            let dial = WorldDial(net);
            let mut link: Option<Arc<dyn ControlLink>> = None;
            for i in 0.. {
                if w.now() >= Duration::from_secs(38) {
                    break;
                }
                w.sleep(Duration::from_millis(50));
                let l = match &link {
                    Some(l) => l.clone(),
                    None => {
                        let primary = coord
                            .get(PRIMARY_KEY)
                            .ok()
                            .flatten()
                            .and_then(|v| parse_primary(&v));
                        match primary
                            .and_then(|(_, tcp, _)| dial.connect(&tcp, &secret(), "mount").ok())
                        {
                            Some(l) => {
                                link = Some(l.clone());
                                l
                            }
                            None => continue,
                        }
                    }
                };
                let name = format!("f{i}");
                match create(&*l, &name) {
                    Ok(ino) => seen.lock().unwrap().acked.push((name, ino)),
                    Err(RpcError::Refused { .. }) => {}
                    Err(_) => link = None,
                }
            }
        });
    }

    let outcome = world.run(Duration::from_secs(45));
    for id in NODES {
        net.kill(id);
    }
    world.kill(DRIVER);
    let _ = world.run(Duration::from_secs(46));
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    (outcome, seen)
}

#[test]
fn a_primary_stopped_past_its_lease_stays_silent_and_a_third_node_takes_over_whole() {
    for seed in seeds("RACKFS_WORLD", 2) {
        let (outcome, seen) = run(seed);
        let replay =
            format!("replay: RACKFS_WORLD_SEED={seed} cargo test -p rackfs-memnode --test world");
        assert_eq!(
            outcome,
            Outcome::TimeLimit,
            "seed {seed}: {seen:#?}\n{replay}"
        );
        assert!(
            seen.two_primaries.is_empty(),
            "seed {seed}: two primaries acted at once: {seen:#?}\n{replay}"
        );
        assert!(seen.created.is_some(), "seed {seed}: {seen:#?}");
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
        assert!(
            seen.lost.is_empty() && seen.acked.len() > 100,
            "seed {seed}: every acknowledged creation is on the last primary: {seen:#?}\n{replay}"
        );
    }
}
