//! Two memory nodes in one process, calling each other in memory: a primary and a data node,
//! each a real node started by `MemNode::start_in`, sharing a `rackfs_proto::link::Loopback`
//! that hands each control request to the addressed node's own dispatch
//! (`rackfs_memnode::control::answer`). The data node joins the primary, registers with the
//! coordinator embedded in it and is admitted, and the primary places a new file's stripe on
//! it, all over the loopback: the first step of a whole-cluster simulation (issue 24).
//!
//! Each node still binds a Unix socket (a node must listen somewhere to be joined, and its
//! address is where the loopback serves it), but no connection crosses one: the test checks
//! that neither node accepted any. The nodes run on the host's clock: their duty threads
//! sleep on the node's clock, and a `ManualClock`'s sleep returns at once having moved time,
//! so on one they would spin; virtual time for whole nodes needs the simulation's scheduler.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{addr, config, secret, Scratch};
use rackfs_clock::{SharedClock, SystemClock};
use rackfs_memnode::control::serve_on;
use rackfs_memnode::coordinator::{node_key, node_value};
use rackfs_memnode::node::Node;
use rackfs_memnode::{MemNode, NodeEnv, Role};
use rackfs_proto::control::{ControlRequest, ControlResponse, ErrorCode, RPC_KINDS};
use rackfs_proto::link::{ControlLink, Dial, Loopback};
use rackfs_proto::namespace::{MetaRequest, NewKind, StripeExtent, ROOT_INO};
use rackfs_proto::record::TAG_SPACE;
use rackfs_proto::RpcError;

/// Runs on `clock`, dials `lo`, and is served on `lo` at its address once it serves: each
/// request goes to the node's control dispatch, each closed connection ends its session
/// there. The loopback keeps only a weak handle on the node (the node keeps the loopback).
fn env(lo: &Arc<Loopback>, clock: &SharedClock) -> NodeEnv {
    let served = lo.clone();
    NodeEnv {
        clock: clock.clone(),
        dial: lo.clone(),
        spawn: Arc::new(rackfs_clock::Threads),
        exit: Arc::new(|code| panic!("node exited with {code}")),
        serving: Some(Box::new(move |node: &Arc<Node>| {
            let at = format!(
                "unix:{}",
                node.cfg.shm_socket.as_ref().expect("a socket").display()
            );
            serve_on(&served, &at, node);
        })),
    }
}

/// The index of RPC kind `name` in a node's counters (`NodeStats::rpcs`).
fn kind(name: &str) -> usize {
    RPC_KINDS
        .iter()
        .position(|k| *k == name)
        .expect("an RPC kind")
}

/// A primary (node 0) and a data node (node 1) on the host's clock, their sockets in `dir`,
/// calling each other over `lo`. The data node joins in `start_in`: through the loopback to
/// the primary, which connects back to it (declaring its term) over the loopback too; then it
/// registers with the coordinator embedded in the primary and is admitted, all before
/// `start_in` returns.
fn two_nodes(dir: &Path, lo: &Arc<Loopback>) -> (MemNode, MemNode) {
    let clock: SharedClock = Arc::new(SystemClock::new());
    let primary = MemNode::start_in(config(dir, 0, Role::Primary), env(lo, &clock))
        .expect("the primary starts");
    let data = MemNode::start_in(
        config(dir, 1, Role::Join(vec![addr(dir, 0)])),
        env(lo, &clock),
    )
    .expect("the data node starts and joins the primary");
    (primary, data)
}

/// Creates file `f` (two replicas) through `mount` and has its first 4 KiB placed: the
/// stripe's replicas.
fn file_with_a_stripe(mount: &dyn ControlLink) -> Vec<StripeExtent> {
    let ino = match mount.meta(MetaRequest::Create {
        parent: ROOT_INO,
        name: b"f".to_vec(),
        kind: NewKind::File {
            stripe_unit: 1 << 20,
            replicas: 2,
        },
        perm: 0o644,
        uid: 0,
        gid: 0,
    }) {
        Ok(ControlResponse::Attr(a)) => a.ino,
        other => panic!("create: {other:?}"),
    };
    match mount.meta(MetaRequest::AllocStripe {
        ino,
        stripe: 0,
        end: 4096,
    }) {
        Ok(ControlResponse::Stripe(r)) => r,
        other => panic!("alloc stripe: {other:?}"),
    }
}

#[test]
fn a_data_node_joins_a_primary_in_memory_and_takes_a_stripe_of_a_new_file() {
    let dir = Scratch::new("joins");
    let lo = Arc::new(Loopback::new());
    let (primary, data) = two_nodes(&dir.0, &lo);
    let (p, d) = (primary.node(), data.node());

    assert_eq!(
        d.members.primary_id(),
        Some(0),
        "the data node follows node 0"
    );
    assert_eq!(p.members.data_nodes(), vec![0, 1]);
    let epoch = p.epochs.get().and_then(|e| e.admitted(1));
    assert!(epoch.is_some(), "the primary admitted node 1");
    let registered = rackfs_memnode::coordinator::members(&*p.coord).expect("the members");
    assert_eq!(
        registered,
        vec![(1, epoch.unwrap())],
        "node 1 registered in the primary's coordinator under the epoch it was admitted with"
    );
    assert!(d.serving(), "admitted, the data node serves data");
    let before = d.stats();

    // A mount's requests, over the loopback to the primary.
    let mount = lo
        .connect(&addr(&dir.0, 0), &secret(), "mount")
        .expect("a connection to the primary");
    let replicas = file_with_a_stripe(&*mount);
    let mut nodes: Vec<u32> = replicas.iter().map(|r| r.node).collect();
    nodes.sort_unstable();
    assert_eq!(nodes, vec![0, 1], "one replica on each node: {replicas:?}");

    // The data node allocated its replica itself, for the primary, and holds it under the
    // stripe's tag (written at the extent's base, `TAG_SPACE` before its data).
    let on_data = replicas.iter().find(|r| r.node == 1).expect("node 1's");
    let base = on_data.offset - TAG_SPACE;
    assert_eq!(d.data_region().load(base).ok(), Some(on_data.tag));
    let held = d.store.resolve(&[(base, on_data.tag)]);
    assert!(
        held.changed.is_empty(),
        "node 1 holds its extent under its tag: {held:?}"
    );
    let after = d.stats();
    assert!(
        after.used > before.used,
        "{} -> {}",
        before.used,
        after.used
    );
    let alloc = kind("alloc");
    assert_eq!(after.rpcs[alloc] - before.rpcs[alloc], 1, "one alloc");
    assert!(
        after.rpcs[kind("primary")] >= 1,
        "the primary declared its term to the data node"
    );
    let ps = p.stats();
    assert_eq!(ps.rpcs[kind("join")], 1);
    assert!(ps.rpcs[kind("node_admit")] >= 1);
    assert!(
        ps.rpcs[kind("coord")] >= 2,
        "the data node's coordinator calls (its lease, its key) went to the primary"
    );

    // The primary counts the data node's memory by asking it (its stats, over the loopback).
    let stat = match mount.meta(MetaRequest::StatFs) {
        Ok(ControlResponse::FsStat(s)) => s,
        other => panic!("statfs: {other:?}"),
    };
    let counted: Vec<u32> = stat.nodes.iter().map(|n| n.node).collect();
    assert_eq!(counted, vec![0, 1]);
    assert_eq!(
        stat.nodes[1].capacity, after.capacity,
        "node 1's memory as it told the primary"
    );

    // Nothing crossed a socket.
    assert_eq!((ps.connections_total, after.connections_total), (0, 0));

    drop(mount);
    drop(data);
    drop(primary);
}

/// A primary whose lease lapsed (deposed, perhaps: on etcd its standby may be taking over on
/// a mirror that still lists the data node's replicas) admits no data node under a new epoch,
/// so it frees none of the replicas of the node's earlier epoch. Seen on etcd: a primary that
/// had not yet noticed its lapse admitted its standby under a new epoch, freed the standby's
/// replicas, and the standby took over with a layout pointing at freed extents.
#[test]
fn a_primary_whose_lease_lapsed_admits_no_node_and_frees_nothing() {
    let dir = Scratch::new("lapsed");
    let lo = Arc::new(Loopback::new());
    let (primary, data) = two_nodes(&dir.0, &lo);
    let (p, d) = (primary.node(), data.node());
    let first = p
        .epochs
        .get()
        .and_then(|e| e.admitted(1))
        .expect("admitted");
    let mount = lo
        .connect(&addr(&dir.0, 0), &secret(), "mount")
        .expect("a connection to the primary");
    let replicas = file_with_a_stripe(&*mount);
    let on_data = *replicas.iter().find(|r| r.node == 1).expect("node 1's");
    let base = on_data.offset - TAG_SPACE;

    // Node 1 registers under a new epoch (as after its own lease lapsed), and the primary's
    // lease lapses before node 1 asks it to be admitted.
    let (lease, _) = p.coord.grant(Duration::from_secs(60)).expect("a lease");
    p.coord
        .put(
            &node_key(1),
            &node_value(&d.members.me(), lease),
            Some(lease),
        )
        .expect("node 1 registers again");
    p.serve.end();
    let asks = lo
        .connect(&addr(&dir.0, 0), &secret(), "lease-mn1")
        .expect("a connection to the primary");
    match asks.call(&ControlRequest::NodeAdmit {
        node: 1,
        epoch: lease,
    }) {
        Err(RpcError::Refused { code, .. }) => assert_eq!(code, ErrorCode::NotPrimary),
        other => panic!("a lapsed primary admitted node 1: {other:?}"),
    }
    assert_eq!(p.epochs.get().and_then(|e| e.admitted(1)), Some(first));
    let held = d.store.resolve(&[(base, on_data.tag)]);
    assert!(
        held.changed.is_empty(),
        "node 1 still holds its replica under its tag: {held:?}"
    );
}

/// A primary reaches a data node through the Unix socket its address names only when the
/// node there answers as that node: a socket path naming another node (or stale, or another
/// host's) sends it to the node's tcp address instead.
#[test]
fn a_data_node_is_reached_through_its_socket_only_when_it_answers_as_itself() {
    use rackfs_memnode::term::connect_node;
    use rackfs_proto::control::NodeAddr;
    let dir = Scratch::new("socket-first");
    let lo = Arc::new(Loopback::new());
    let (primary, _data) = two_nodes(&dir.0, &lo);
    let epoch = primary.node().term.epoch();
    let sock = |id| common::socket(&dir.0, id).display().to_string();
    // The loopback serves node 1 only at its socket's address: it stands in for its tcp one.
    let known = primary.node().members.addr_of(1).expect("node 1 joined");
    let node1 = |shm: Option<String>| NodeAddr {
        tcp: Some(addr(&dir.0, 1)),
        shm,
        ..known.clone()
    };
    let reach = |to: NodeAddr| {
        let c = connect_node(&*lo, &to, &secret(), "test", 0, epoch).expect("node 1 reached");
        (c.node_id(), c.peer().to_string())
    };
    assert_eq!(
        reach(node1(Some(sock(1)))),
        (1, addr(&dir.0, 1)),
        "its own socket"
    );
    assert_eq!(
        reach(node1(Some(sock(0)))).0,
        1,
        "a socket where node 0 answers is not node 1's"
    );
    assert_eq!(
        reach(node1(Some(dir.0.join("gone.sock").display().to_string()))).0,
        1,
        "a socket nobody serves"
    );
    let nowhere = NodeAddr {
        tcp: None,
        ..node1(Some(sock(0)))
    };
    assert!(
        connect_node(&*lo, &nowhere, &secret(), "test", 0, epoch).is_err(),
        "another node's socket and no tcp address: not reached"
    );
}
