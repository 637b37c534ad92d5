//! What a node counts about its clients: verbs served per connection, control RPCs by kind,
//! open connections by kind, authentication and protocol failures.

use std::sync::atomic::{AtomicU64, Ordering};

use rackfs_clock::Mutex;
use rackfs_proto::control::{NodeStats, RPC_KINDS};
use rackfs_verbs::wire::ConnKind;
use rackfs_verbs::{VerbCounters, VerbTotals};
use slab::Slab;

/// The node's client counters.
#[derive(Default)]
pub struct NodeCounters {
    /// Verb counters of open connections (one block each, written only by its connection).
    live: Mutex<Slab<VerbCounters>>,
    /// Totals of closed connections.
    retired: Mutex<VerbTotals>,
    rpcs: [AtomicU64; RPC_KINDS.len()],
    open: [AtomicU64; 4],
    pub connections_total: AtomicU64,
    pub auth_failures: AtomicU64,
    pub protocol_errors: AtomicU64,
    /// Journal entries replayed on this node's mirror.
    pub journal_entries: AtomicU64,
}

impl NodeCounters {
    /// Counts one RPC of kind `kind` ([`rackfs_proto::ControlRequest::kind_index`]).
    pub fn rpc(&self, kind: usize) {
        self.rpcs[kind].fetch_add(1, Ordering::Relaxed);
    }

    /// Runs `f` with `counters` registered as live, then folds them into the totals.
    pub fn with_verbs<T>(&self, counters: VerbCounters, f: impl FnOnce(&VerbCounters) -> T) -> T {
        let key = self
            .live
            .lock()
            .expect("counter blocks lock")
            .insert(counters.clone());
        let out = f(&counters);
        self.live.lock().expect("counter blocks lock").remove(key);
        self.retired
            .lock()
            .expect("counter totals lock")
            .add(&counters.snapshot());
        out
    }

    /// Counts a connection of `kind` as open for as long as the guard lives.
    pub fn open(&self, kind: ConnKind) -> OpenGuard<'_> {
        let c = &self.open[kind as usize - 1];
        c.fetch_add(1, Ordering::Relaxed);
        OpenGuard(c)
    }

    /// Fills the counter fields of `s`.
    pub fn fill_stats(&self, s: &mut NodeStats) {
        let mut verbs = *self.retired.lock().expect("counter totals lock");
        for (_, c) in self.live.lock().expect("counter blocks lock").iter() {
            verbs.add(&c.snapshot());
        }
        s.verbs = verbs;
        s.rpcs = std::array::from_fn(|i| self.rpcs[i].load(Ordering::Relaxed));
        s.open = std::array::from_fn(|i| self.open[i].load(Ordering::Relaxed));
        s.connections_total = self.connections_total.load(Ordering::Relaxed);
        s.auth_failures = self.auth_failures.load(Ordering::Relaxed);
        s.protocol_errors = self.protocol_errors.load(Ordering::Relaxed);
        s.journal_entries = self.journal_entries.load(Ordering::Relaxed);
    }
}

/// An open connection, counted until dropped.
pub struct OpenGuard<'a>(&'a AtomicU64);

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
