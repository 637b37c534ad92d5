//! The RackFS metadata service as a library: no sockets, no threads, no clock of its own.
//!
//! Each part owns its state: [`Namespace`] (directories, inodes, file records and extent
//! tables), [`LockTrees`] (the files' Citron lock trees and the mounts' lock slots) and
//! [`placement::ClusterQos`] (admission and pShift placement). [`MetaService`] composes the
//! first two behind the namespace RPC. Everything the service needs from its node goes through
//! [`Storage`]: the daemon implements it over its allocator and peers, [`MemStorage`] in
//! process for tests, so the service runs under property tests and under simulation alike.
//! The caller serialises calls (one `&mut` at a time).

pub mod file;
pub mod locktree;
pub mod namespace;
pub mod placement;
pub mod storage;

use std::time::Duration;

use rackfs_proto::control::ControlResponse;
use rackfs_proto::locktree::TreeWord;
use rackfs_proto::namespace::{Change, MetaRequest};
use rackfs_proto::record::REC_LOCKS;
use rackfs_proto::Refusal;

pub use locktree::LockTrees;
pub use namespace::Namespace;
pub use storage::{MemStorage, Storage};

/// The namespace and the lock-tree service, answering [`MetaRequest`]s.
pub struct MetaService {
    pub namespace: Namespace,
    pub locks: LockTrees,
    /// Changes other mounts must forget, since [`MetaService::take_changes`] last ran.
    changes: Vec<Change>,
}

impl MetaService {
    /// An empty filesystem whose root was made at `now_ns` (ns since the epoch);
    /// `lock_grace`: how long retired lock trees and the lock slots of ended sessions are kept
    /// (see [`locktree`]).
    pub fn new(lock_grace: Duration, now_ns: u64) -> MetaService {
        MetaService {
            namespace: Namespace::new(now_ns),
            locks: LockTrees::new(lock_grace, lock_grace),
            changes: Vec::new(),
        }
    }

    /// The namespace changes made since the last call (see [`Namespace::changes_of`]).
    pub fn take_changes(&mut self) -> Vec<Change> {
        std::mem::take(&mut self.changes)
    }

    /// Handles one request on behalf of client session `session`.
    pub fn handle(&mut self, session: u64, req: MetaRequest, st: &dyn Storage) -> ControlResponse {
        let resp = match req {
            MetaRequest::LockSlot => self
                .locks
                .attach(session)
                .map_or_else(ControlResponse::from, ControlResponse::LockSlot),
            MetaRequest::LockTree { ino, old, units } => self
                .publish_tree(ino, old, units, st)
                .map_or_else(ControlResponse::from, |w| ControlResponse::LockTree(w.0)),
            other => {
                let changes = self.namespace.changes_of(&other);
                let resp = self.namespace.handle(session, other, st);
                if !matches!(resp, ControlResponse::Error { .. }) {
                    self.changes.extend(changes);
                }
                resp
            }
        };
        self.retire_deleted(st);
        resp
    }

    /// A client session was fenced: its lock slot is watched as dead (its range locks are
    /// recovered); its opens stay until it ends or a new session adopts them.
    pub fn fence_session(&mut self, session: u64, st: &dyn Storage) {
        self.locks.end_session(session, st);
    }

    /// Session `to` takes over the opens of fenced session `from`.
    pub fn adopt(&mut self, from: u64, to: u64) {
        self.namespace.adopt(from, to);
    }

    /// A client session ended (its mount went away): its opens are released and its lock slot
    /// is watched as dead.
    pub fn end_session(&mut self, session: u64, st: &dyn Storage) {
        self.locks.end_session(session, st);
        self.namespace.end_session(session, st);
        self.retire_deleted(st);
    }

    /// Lock-tree recovery and reaping; call every millisecond or so.
    pub fn tick(&mut self, st: &dyn Storage) {
        self.locks.tick(st);
    }

    fn publish_tree(
        &mut self,
        ino: u64,
        old: u64,
        units: u64,
        st: &dyn Storage,
    ) -> Result<TreeWord, Refusal> {
        let record = self.namespace.record(ino)?;
        self.locks
            .publish(st, ino, record + REC_LOCKS, TreeWord(old), units)
    }

    fn retire_deleted(&mut self, st: &dyn Storage) {
        for ino in self.namespace.take_deleted() {
            self.locks.forget(st, ino);
        }
    }
}
