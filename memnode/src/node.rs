//! A running node's parts.
//!
//! [`Node`] composes owned parts, each with its own state and lock: the [`Store`] (region,
//! allocator, quarantine), [`Membership`], the [`NodeCounters`], and on the primary the
//! metadata service ([`MetaService`], one lock for the namespace and lock trees) and the
//! [`QosController`]. The node is the metadata service's [`Storage`]: local memory from the
//! store, remote memory through peers' control connections. What drives the parts sits above
//! this module and is not named here: the control RPC (`control`), data nodes' liveness, the
//! metadata standby, connections (`conn`) and threads (`daemon`).
//!
//! Time is the node's [`Clock`] ([`Node::clock`]): every part reads it and sleeps on it
//! instead of the host's, so a simulation can run the node on virtual time. Only the serve
//! lease is kept on the host's `CLOCK_MONOTONIC`, which its NIC threads and its shm clients
//! (other processes) check it against; [`Node::lease_ns`] moves the node's times onto it.
//!
//! Control connections to other nodes (peers, the primary, the standby, the coordinator in
//! the primary) are opened through the node's [`Dial`] ([`Node::dial`]): the network's in
//! production, an in-process one (`rackfs_proto::link::Loopback`) when several nodes run in
//! one process.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rackfs_clock::{Clock, Mutex, SharedClock, Spawn};
use rackfs_meta::{MetaService, Storage};
use rackfs_proto::control::{
    ControlRequest, ControlResponse, ErrorCode, FsStat, NodeStats, Resolved,
};
use rackfs_proto::link::{ControlLink, Dial};
use rackfs_proto::space::NodeSpace;
use rackfs_proto::{Refusal, RpcError};
use rackfs_verbs::lease::monotonic_ns;
use rackfs_verbs::wire::Welcome;
use rackfs_verbs::{Region, RegionTable};
use tracing::{debug, warn};

use crate::alloc::GRANULE;
use crate::baseline::BaselineLocks;
use crate::config::NodeConfig;
use crate::counters::NodeCounters;
use crate::epochs::Epochs;
use crate::fence::Fences;
use crate::lease::Leases;
use crate::lease_words::LeaseWords;
use crate::membership::Membership;
use crate::qos::NodeQos;
use crate::qos_controller::{QosController, QosNodes};
use crate::replicas::{Discards, Rebuilds};
use crate::standby_state::Standby;
use crate::store::Store;
use crate::term::{Followed, Term};
use crate::watch::Watchers;

/// A memory node's parts (see the module docs).
pub struct Node {
    pub cfg: NodeConfig,
    /// The regions clients reach: data first, then the read-only info page.
    pub table: RegionTable,
    pub welcome: Welcome,
    pub store: Store,
    pub members: Membership,
    pub counters: NodeCounters,
    /// Client nonces seen recently (a repeated one is a replayed handshake).
    pub nonces: rackfs_verbs::auth::NonceLog,
    /// The metadata service (primary only; set when the node starts as primary or takes over).
    pub meta: OnceLock<Mutex<MetaService>>,
    /// This node's QoS monitor (cluster members only).
    pub qos: Option<NodeQos>,
    /// The cluster's QoS controller (primary only).
    pub controller: OnceLock<QosController>,
    /// The mounts' watchers, told of namespace changes (primary only).
    pub watchers: Watchers,
    /// Fenced mounts and the fenceable data connections of this node.
    pub fences: Fences,
    /// Lock holders' leases (primary only).
    pub leases: OnceLock<Leases>,
    /// Where this node's lease, the cluster map and the election live (see
    /// [`crate::coordinator`]).
    pub coord: std::sync::Arc<dyn rackfs_coord::Coordinator>,
    /// The epochs data nodes were admitted under (primary only).
    pub epochs: OnceLock<Epochs>,
    /// This node's own lease to serve data (forever on the primary and standalone nodes).
    pub serve: rackfs_verbs::lease::ServeLease,
    /// Where this node's shm clients keep their copy of its lease.
    pub lease_words: LeaseWords,
    /// Replicas dropped from nodes declared dead, to free when they return (primary only).
    pub discards: Discards,
    /// Tagged frees on other data nodes, sent by the `frees` thread.
    pub frees: crate::frees::Frees,
    /// Re-replication progress (primary only).
    pub rebuilds: Rebuilds,
    /// The benchmark baseline lock server (only when asked for).
    pub baseline: Option<BaselineLocks>,
    /// The RDMA device clients may connect over (with every region registered).
    pub rdma: Option<rackfs_verbs::rdma::RdmaNic>,
    pub next_session: AtomicU64,
    /// Sessions below this one are an earlier primary's (a primary that took over lets mounts
    /// adopt their opens); 0 on a primary that started the cluster.
    pub sessions_from: AtomicU64,
    /// The metadata standby: whom the primary keeps in sync, or this data node's mirror.
    pub standby: Standby,
    /// The primary's term: the guard of its coordinator writes, the epoch it declares to data
    /// nodes (see [`crate::term`]).
    pub term: Term,
    /// A data node's view of primaries: the newest epoch, and what each connection declared.
    pub followed: Followed,
    /// Where the node takes time from and sleeps on: the host's clocks in production, virtual
    /// time under simulation.
    pub clock: SharedClock,
    /// How the node opens control connections to other nodes: the network in production, an
    /// in-process loopback when several nodes run in one process.
    pub dial: Arc<dyn Dial>,
    /// How the node starts the threads of its logic: the host's in production, a simulated
    /// process's under simulation (see [`Node::start_thread`]).
    pub spawn: Arc<dyn Spawn>,
    /// Ends the node's process: the host's exits, a simulation kills the node's process.
    pub exit: Arc<Exit>,
    /// The host's `CLOCK_MONOTONIC` (ns) at 0 on [`Node::clock`] (see [`Node::lease_ns`]).
    pub host_origin: u64,
    /// When the node started, on its clock.
    pub started: Duration,
    pub stopping: AtomicBool,
}

/// Ends a node's process with an exit status (it does not return).
pub type Exit = dyn Fn(i32) + Send + Sync;

/// When the extents a namespace change released on other data nodes are freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreesGo {
    /// Before the change is answered: a file that lives on may have moved or lost a stripe
    /// that a mount still caches.
    BeforeAnswer,
    /// By the frees thread, right after: only files nobody can read any more lost extents
    /// (removed, with no link left and open nowhere: an open file is kept until its last
    /// close, which frees before its answer).
    Soon,
}

/// How long fencing a mount on one node may take (below a control RPC's deadline).
pub(crate) const FENCE_WAIT: Duration = Duration::from_secs(3);

impl Node {
    /// Runs `f` on the metadata service (primary only) under its lock, then returns once the
    /// journal entries it (and every change before it) made are on the standby, so before
    /// anything is answered; the lock is not held meanwhile (group commit, see
    /// [`Standby::commit`](crate::standby_state::Standby::commit)).
    pub fn with_meta<T>(&self, f: impl FnOnce(&mut MetaService) -> T) -> Option<T> {
        self.with_meta_freeing(FreesGo::BeforeAnswer, f)
    }

    /// [`Node::with_meta`], with the extents the change released on other nodes freed before
    /// it returns or soon after ([`FreesGo`]).
    pub fn with_meta_freeing<T>(
        &self,
        go: FreesGo,
        f: impl FnOnce(&mut MetaService) -> T,
    ) -> Option<T> {
        let meta = self.meta.get()?;
        let (out, ticket) = {
            let mut m = meta.lock().expect("metadata lock");
            let out = f(&mut m);
            (out, self.standby.queue(&mut m))
        };
        let Some(frees) = self.standby.commit(
            ticket,
            meta,
            &self.members,
            &*self.coord,
            &*self.clock,
            || self.term.guard(),
        ) else {
            // Deposed: its successor's mirror may lack the change, so nothing acts on it (the
            // callers see `serving()` false and answer nothing).
            self.serve.end();
            self.lease_words.lapsed();
            return Some(out);
        };
        // Only now that the standby has the change may the extents it released go.
        for (node, offset, tag) in frees {
            self.free_soon(node, offset, tag);
        }
        // And they go before the answer: a mount that still caches a stripe the change moved
        // or released (a truncate, a trim) must find its tag gone when it reads after the
        // answer, not the old bytes under the old tag (fsx across two mounts read those).
        match go {
            FreesGo::BeforeAnswer => self.send_frees(),
            FreesGo::Soon => {}
        }
        Some(out)
    }

    /// Copies `len` bytes at `from` of the node at `source` (its tcp address) to `to` of this
    /// node's region ([`crate::store::Store::pull`]); from this node itself (a trim's copy),
    /// within the region, with no connection to itself.
    pub fn pull(
        &self,
        source: &str,
        (from, to, len): (u64, u64, u64),
        expect: u64,
    ) -> Result<(), Refusal> {
        let own = self.members.addr_of(self.cfg.node_id).and_then(|a| a.tcp);
        if own.as_deref() == Some(source) {
            return self.store.copy_within(from, to, len, expect);
        }
        self.store
            .pull(source, &self.cfg.secret, (from, to, len), expect)
    }

    pub fn data_region(&self) -> &Region {
        self.store.region()
    }

    /// Runs `body` on a thread of the node's logic called `name` ([`Node::spawn`]), with
    /// its own handle on the node.
    pub fn start_thread(
        self: &Arc<Self>,
        name: &str,
        body: impl FnOnce(Arc<Node>) + Send + 'static,
    ) {
        let n = self.clone();
        self.spawn
            .spawn(name, Box::new(move || body(n)))
            .expect("spawn a node thread");
    }

    /// Whether the node is shutting down (its threads end their loops).
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// How long the node has run, on its clock.
    pub fn uptime(&self) -> Duration {
        self.clock.now().saturating_sub(self.started)
    }

    /// `t` on the node's clock in the serve lease's time (`rackfs_verbs::lease`: the host's
    /// `CLOCK_MONOTONIC`, which the node's NIC threads and its shm clients check it against).
    pub fn lease_ns(&self, t: Duration) -> u64 {
        self.host_origin.saturating_add(t.as_nanos() as u64)
    }

    /// Whether the node may serve now: its serve lease holds at its clock's now.
    pub fn serving(&self) -> bool {
        let until = self.serve.until();
        until == u64::MAX || self.lease_ns(self.clock.now()) < until
    }

    /// The nodes the QoS controller drives.
    pub(crate) fn qos_nodes(&self) -> QosNodes<'_> {
        QosNodes {
            own: self.qos.as_ref(),
            node_id: self.cfg.node_id,
            members: &self.members,
        }
    }

    /// One round of the QoS controller (primary only).
    pub fn place_qos(&self) {
        if let Some(c) = self.controller.get() {
            c.place(&self.qos_nodes());
        }
    }

    pub fn stats(&self) -> NodeStats {
        let mut s = NodeStats {
            node_id: self.cfg.node_id,
            name: self.cfg.name.clone(),
            uptime_ms: self.uptime().as_millis() as u64,
            rdma: self.rdma.as_ref().map(|n| n.describe()),
            ..NodeStats::default()
        };
        self.store.fill_stats(&mut s);
        self.counters.fill_stats(&mut s);
        if let Some(m) = self.meta.get() {
            let m = m.lock().expect("metadata lock");
            s.lock_trees = m.locks.memory();
            s.lock_recoveries = m.locks.recoveries;
            let up = self.data_nodes();
            let down: Vec<u32> = self
                .members
                .peers()
                .into_iter()
                .map(|(id, _)| id)
                .filter(|id| !up.contains(id))
                .collect();
            s.health = m.namespace.health(&down);
            s.health.rebuilt_stripes = self.rebuilds.stripes.load(Ordering::Relaxed);
            s.health.rebuilt_bytes = self.rebuilds.bytes.load(Ordering::Relaxed);
        }
        s
    }

    /// A client session ended (its connection closed): its opens, lock slot, QoS, lease and
    /// baseline locks go.
    pub fn end_session(&self, session: u64) {
        self.followed.end(session);
        self.release_session(session);
        self.with_meta(|m| m.end_session(session, self));
        if let Some(l) = self.leases.get() {
            l.end(session);
        }
    }

    /// Gives up what a fenced session holds for others: its lock slot (its range locks are
    /// recovered), watcher, QoS and baseline locks. Its opens stay (see
    /// [`ControlRequest::Adopt`]).
    fn release_session(&self, session: u64) {
        self.watchers.end_session(session);
        if let Some(m) = self.meta.get() {
            m.lock()
                .expect("metadata lock")
                .fence_session(session, self);
        }
        if let Some(b) = &self.baseline {
            b.end_session(session);
        }
        if let Some(c) = self.controller.get() {
            c.end_session(&self.qos_nodes(), session);
        }
    }

    /// Fences a mount whose lease expired (see [`crate::lease`]) on this node and every other,
    /// then gives up the session's range locks for recovery. A node that fails is retried; the
    /// locks are given up once every node is fenced or known down, and a down node is fenced
    /// when it is seen up again. Runs on a thread of its own until every node is fenced.
    pub fn fence_mount(&self, session: u64) {
        let started = self.clock.now();
        let lease = self.leases.get().map(Leases::lease);
        warn!(
            session,
            ?lease,
            "a mount did not renew its lock lease: fencing it on every memory node"
        );
        let mut pending: Vec<Option<u32>> = vec![None];
        pending.extend(self.members.peers().into_iter().map(|(id, _)| Some(id)));
        let mut reported = std::collections::HashSet::new();
        let mut released = false;
        while !self.is_stopping() {
            if !self.serving() {
                // Not while this primary's own lease lapsed: deposed, it acts on nothing.
                self.clock.sleep(Duration::from_millis(200));
                continue;
            }
            let up = self.members.data_nodes();
            pending.retain(|node| {
                let result = match node {
                    None => self.fences.fence(session, FENCE_WAIT).map(|_| ()),
                    Some(id) if !up.contains(id) => return true, // when it is back
                    Some(id) => self.fence_on_peer(*id, session),
                };
                let Err(why) = result else { return false };
                let node = node.unwrap_or(self.cfg.node_id);
                if reported.insert(node) {
                    warn!(session, node, %why, "cannot fence the mount on this memory node yet (its range locks stay held until it is fenced or known down); retrying");
                }
                true
            });
            let all_down = pending
                .iter()
                .all(|n| n.is_some_and(|id| !up.contains(&id)));
            if all_down && !released {
                self.release_session(session);
                released = true;
                warn!(
                    session,
                    took = ?self.clock.now().saturating_sub(started),
                    down = ?pending,
                    "mount fenced on every memory node that is up; its range locks are recovered"
                );
            }
            if pending.is_empty() {
                return;
            }
            self.clock.sleep(Duration::from_millis(200));
        }
    }

    fn fence_on_peer(&self, id: u32, session: u64) -> Result<(), String> {
        let peer = self.members.peer(id).map_err(|r| r.message)?;
        match peer.call(&ControlRequest::Fence { token: session }) {
            Ok(ControlResponse::Ok) => Ok(()),
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }
}

impl Node {
    /// Frees the extent at `offset` on `node` now (with `tag`: only the stripe extent tagged
    /// so; a down node's when it is admitted again).
    /// Frees an extent: on this node at once, a tagged one on another node from the frees
    /// thread (see [`crate::frees`]).
    fn free_soon(&self, node: u32, offset: u64, tag: Option<u64>) {
        match tag {
            Some(t) if node != self.cfg.node_id => self.frees.push((node, offset, t)),
            _ => {
                if let Err(e) = self.free_now(node, offset, tag) {
                    warn!(node, offset, error = %e, "a released extent stays allocated");
                }
            }
        }
    }

    /// Sends every free waiting for the frees thread. Those of a node that is down are noted
    /// in [`Node::discards`] only once the sending is over: declaring a node dead holds that
    /// lock while its change sends frees, so taking it while sending would deadlock.
    pub fn send_frees(&self) {
        let mut deferred = Vec::new();
        self.frees.send(|taken| {
            let mut by_node: std::collections::BTreeMap<u32, Vec<(u64, u64)>> = Default::default();
            for (node, offset, tag) in taken {
                by_node.entry(node).or_default().push((offset, tag));
            }
            for (node, extents) in by_node {
                for chunk in extents.chunks(rackfs_proto::control::MAX_FREE_MANY) {
                    match self.free_many_at(node, chunk) {
                        Ok(true) => {}
                        Ok(false) => deferred.extend(chunk.iter().map(|&(o, t)| (node, o, t))),
                        Err(e) => warn!(
                            node,
                            extents = chunk.len(),
                            error = %e,
                            "released extents stay allocated"
                        ),
                    }
                }
            }
        });
        for (node, offset, tag) in deferred {
            self.discards.add(node, offset, Some(tag));
        }
    }

    /// Frees stripe extents (base offset, tag) on another node `node` (only those are queued:
    /// see [`Node::free_soon`]), in one request; `Ok(false)`: the node is down (see
    /// [`Node::free_at`]). Extents the node refuses to free (no longer carrying the tag) are
    /// logged and stay as they are.
    fn free_many_at(&self, node: u32, extents: &[(u64, u64)]) -> Result<bool, Refusal> {
        let refused = match self.with_peer(node, |c| c.free_many(extents.to_vec())) {
            Ok(refused) => refused,
            Err(r) if r.code == ErrorCode::Unavailable => return Ok(false),
            Err(r) => return Err(r),
        };
        for (offset, why) in refused {
            warn!(node, offset, why, "a released extent stays allocated");
        }
        Ok(true)
    }

    fn free_now(&self, node: u32, offset: u64, tag: Option<u64>) -> Result<(), Refusal> {
        if !self.free_at(node, offset, tag)? {
            self.discards.add(node, offset, tag);
        }
        Ok(())
    }

    /// Frees an extent on `node`; `Ok(false)`: the node is down, and the extent is to be freed
    /// when it is admitted again, before it serves anyone ([`Node::discards`]).
    fn free_at(&self, node: u32, offset: u64, tag: Option<u64>) -> Result<bool, Refusal> {
        if node == self.cfg.node_id {
            return self.store.free(offset, tag).map(|_| true);
        }
        match self.with_peer(node, |c| c.free(offset, tag)) {
            Ok(_) => Ok(true),
            Err(r) if r.code == ErrorCode::Unavailable => Ok(false),
            Err(r) => Err(r),
        }
    }

    /// Primary: node `id` did not answer a call: its lease is revoked, so within one lease it
    /// serves nothing and must be admitted again under a new epoch (which first frees what it
    /// should have freed meanwhile).
    fn fence_node(&self, id: u32) {
        let Some(epoch) = self.epochs.get().and_then(|e| e.admitted(id)) else {
            return;
        };
        // A revocation cannot be guarded in the same step as a write: it is made only once
        // the coordinator confirmed this primary's term (see [`crate::term`]).
        let held = self
            .term
            .guard()
            .map(|g| self.coord.holds(&g))
            .unwrap_or(Ok(false));
        if !matches!(held, Ok(true)) {
            warn!(node = id, ?held, "memory node did not answer, but this primary's term is not confirmed: its lease is left alone");
            return;
        }
        match self.coord.revoke(epoch) {
            Ok(()) => warn!(node = id, epoch, "memory node did not answer the primary: its lease is revoked, so it serves nothing until admitted again"),
            Err(e) => warn!(node = id, error = %e, "cannot revoke the lease of a memory node that did not answer; it is dropped when its lease lapses"),
        }
    }

    /// Re-elected at a new epoch: declares it on every connection to a data node (the peers'
    /// and the standby's journal), whose nodes would otherwise refuse this primary's requests
    /// as an earlier primary's. The declarations run at once, each on a thread of its own,
    /// and are waited for up to a quarter of the node lease: a stopped node answers only at
    /// its call's deadline, and the caller (the primary's lease) must not wait that long, or
    /// the lease lapses again meanwhile. A declaration whose epoch is no longer this node's by
    /// the time it runs is skipped.
    pub fn declare_term(self: &Arc<Self>) {
        let epoch = self.term.epoch();
        let req = ControlRequest::Primary {
            node: self.cfg.node_id,
            epoch,
        };
        let peers = self.members.peers();
        let pending = Arc::new(AtomicUsize::new(peers.len() + 1));
        for (id, peer) in peers {
            let (req, pending) = (req.clone(), pending.clone());
            self.start_thread(&format!("declare-{id}"), move |n| {
                if n.term.epoch() == epoch {
                    if let Err(e) = peer.call(&req) {
                        warn!(node = id, epoch, error = %e, "cannot declare this primary's new epoch to a data node; its requests there are refused until it joins again");
                    }
                }
                pending.fetch_sub(1, Ordering::SeqCst);
            });
        }
        let done = pending.clone();
        self.start_thread("declare-standby", move |n| {
            if let (Some(meta), true) = (n.meta.get(), n.term.epoch() == epoch) {
                let guard = || n.term.guard();
                // Deposed meanwhile (not merely re-elected again, whose own declaration
                // follows): as after a refused journal, nothing more is answered.
                let deposed = !(n.standby).declare(&req, meta, &*n.coord, &*n.clock, guard);
                if deposed && n.term.epoch() == epoch {
                    n.serve.end();
                    n.lease_words.lapsed();
                }
            }
            done.fetch_sub(1, Ordering::SeqCst);
        });
        let until = self.clock.now() + self.cfg.node_lease / 4;
        while pending.load(Ordering::SeqCst) > 0 && self.clock.now() < until {
            self.clock.sleep(Duration::from_millis(1));
        }
    }

    /// Has peer `node` carry out `req` (answered `Ok` or refused).
    fn on_peer(&self, node: u32, req: &ControlRequest) -> Result<(), Refusal> {
        self.with_peer(node, |c| c.call(req).map(|_| ()))
    }

    /// Runs one call on peer `node`'s control connection. A peer marked down is not asked (the
    /// metadata service, which calls here under its lock, never waits on it twice); one that
    /// does not answer is marked down and fenced ([`Node::fence_node`]).
    fn with_peer<T>(
        &self,
        node: u32,
        call: impl FnOnce(&dyn ControlLink) -> Result<T, RpcError>,
    ) -> Result<T, Refusal> {
        if self.members.is_down(node) {
            return Err(Refusal::new(
                ErrorCode::Unavailable,
                format!("memory node {node} is down"),
            ));
        }
        call(&*self.members.peer(node)?).map_err(|e| {
            if matches!(e, RpcError::Connection(_) | RpcError::Timeout { .. }) {
                self.members.mark_down(node, &e.to_string());
                self.fence_node(node);
            }
            let r = e.into_refusal();
            Refusal::new(r.code, format!("node {node}: {}", r.message))
        })
    }
}

/// The first session id a node hands out: `clock`'s wall time in ms, shifted, so that
/// sessions of a primary that took over (or restarted) never reuse an earlier primary's ids,
/// which data nodes may hold fenced.
pub(crate) fn first_session(clock: &dyn Clock) -> u64 {
    (clock.wall_ns() / 1_000_000) << 16
}

/// The host's `CLOCK_MONOTONIC` at 0 on `clock` ([`Node::host_origin`]): the one reading of
/// the host's clock the node's logic makes, to keep its serve lease where the host checks it.
/// The host's clock is read first, so the origin errs early by the time between the two
/// readings: a lease moved onto the host's clock ends at worst that much sooner, never later.
pub(crate) fn host_origin(clock: &dyn Clock) -> u64 {
    let host = monotonic_ns();
    host.saturating_sub(clock.now().as_nanos() as u64)
}

impl Storage for Node {
    fn data_nodes(&self) -> Vec<u32> {
        let mut v = self.members.data_nodes();
        // A node takes new data only while it holds the lease it was admitted under.
        if let Some(e) = self.epochs.get() {
            v.retain(|&id| id == self.cfg.node_id || e.is_live(id));
        }
        v
    }

    fn cluster_size(&self) -> usize {
        1 + self.members.peers().len()
    }

    fn alloc(&self, node: u32, len: u64, tag: Option<u64>) -> Result<u64, Refusal> {
        if node == self.cfg.node_id {
            return Ok(self.store.alloc(len, GRANULE, tag)?);
        }
        self.with_peer(node, |c| c.alloc_tagged(len, GRANULE, tag))
            .map(|(_, off)| off)
    }

    fn alloc_many(&self, node: u32, len: u64, tags: &[u64]) -> Result<Vec<u64>, Refusal> {
        if node == self.cfg.node_id {
            return Ok(self.store.alloc_many(len, GRANULE, tags)?);
        }
        self.with_peer(node, |c| c.alloc_many(len, tags.to_vec()))
    }

    fn free(&self, node: u32, offset: u64, tag: Option<u64>) -> Result<(), Refusal> {
        if self.standby.defer_free(node, offset, tag) {
            return Ok(());
        }
        if node == self.cfg.node_id || tag.is_none() {
            return self.free_now(node, offset, tag);
        }
        self.free_soon(node, offset, tag);
        Ok(())
    }

    fn resize(
        &self,
        node: u32,
        offset: u64,
        len: u64,
        tag: u64,
        expect: u64,
    ) -> Result<u64, Refusal> {
        if node == self.cfg.node_id {
            return self.store.resize(offset, len, tag, expect);
        }
        self.with_peer(node, |c| c.resize(offset, len, tag, expect))
    }

    fn zero(&self, node: u32, offset: u64, len: u64, expect: u64) -> Result<(), Refusal> {
        let tag = Some(expect);
        if node == self.cfg.node_id {
            return self.store.zero(offset, len, tag);
        }
        self.on_peer(node, &ControlRequest::Zero { offset, len, tag })
    }

    fn resolve(&self, node: u32, extents: &[(u64, u64)]) -> Result<Resolved, Refusal> {
        if node == self.cfg.node_id {
            return Ok(self.store.resolve(extents));
        }
        self.with_peer(node, |c| c.resolve(extents.to_vec()))
    }

    fn retag(&self, node: u32, offset: u64, expect: u64, tag: u64) -> Result<(), Refusal> {
        if node == self.cfg.node_id {
            return self.store.retag(offset, expect, tag);
        }
        let req = ControlRequest::Retag {
            offset,
            expect,
            tag,
        };
        self.on_peer(node, &req)
    }

    fn copy(
        &self,
        src: u32,
        from: u64,
        expect: u64,
        dst: u32,
        to: u64,
        len: u64,
    ) -> Result<(), Refusal> {
        if src == dst && dst == self.cfg.node_id {
            // This node's own replica: no address needed.
            return self.store.copy_within(from, to, len, expect);
        }
        let source = self
            .members
            .addr_of(src)
            .and_then(|a| a.tcp)
            .ok_or_else(|| {
                Refusal::new(
                    ErrorCode::Unavailable,
                    format!("node {src} has no tcp address to copy from"),
                )
            })?;
        if dst == self.cfg.node_id {
            return self.pull(&source, (from, to, len), expect);
        }
        let pull = ControlRequest::Pull {
            source,
            from,
            to,
            len,
            expect,
        };
        self.on_peer(dst, &pull)
    }

    fn domain(&self, node: u32) -> Option<String> {
        self.members.addr_of(node).and_then(|a| a.domain)
    }

    fn local(&self) -> (u32, &Region) {
        (self.cfg.node_id, self.data_region())
    }

    fn meta_alloc(&self, len: u64) -> Result<u64, Refusal> {
        Ok(self.store.meta_alloc(len)?)
    }

    fn meta_free(&self, offset: u64, _: u64) {
        self.store.meta_free(offset)
    }

    fn load(&self, offset: u64) -> u64 {
        self.data_region().load(offset).expect("word in region")
    }

    /// The nodes that take new data ([`Storage::data_nodes`]: placement's own list) with
    /// their memory; a peer that does not answer counts as none. Quarantined memory counts as
    /// free: an allocation waits for it rather than failing.
    fn fs_stat(&self) -> FsStat {
        // Memory being freed counts as free once it is.
        self.send_frees();
        let data = self.data_nodes();
        let mut nodes = Vec::with_capacity(data.len());
        if data.contains(&self.cfg.node_id) {
            // Not `self.stats()`: that takes the metadata lock, which the caller holds.
            let (capacity, free) = self.store.capacity_free();
            nodes.push(NodeSpace {
                node: self.cfg.node_id,
                capacity,
                free,
            });
        }
        for (node, p) in self.members.live_peers() {
            if !data.contains(&node) {
                continue;
            }
            match p.stats() {
                Ok(st) => nodes.push(NodeSpace {
                    node,
                    capacity: st.capacity,
                    free: st.free + st.quarantined,
                }),
                Err(e) => {
                    debug!(node, error = %e, "statfs: a data node did not answer; its memory is not counted")
                }
            }
        }
        FsStat {
            capacity: nodes.iter().map(|n| n.capacity).sum(),
            free: nodes.iter().map(|n| n.free).sum(),
            nodes,
            ..FsStat::default()
        }
    }

    fn wall_ns(&self) -> u64 {
        self.clock.wall_ns()
    }

    fn elapsed(&self) -> Duration {
        self.uptime()
    }
}
